"""The ``moecache`` command: llama.cpp-style subcommands.

Heavy imports (numba, cupy, the kernels) happen inside the commands so ``--help`` is instant.
Errors meant for the user (:class:`moecache.errors.MoecacheError`) print one line on stderr and
exit 1; commands that are not built yet say so and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="moecache",
    help="Run Mixture-of-Experts GGUF models larger than GPU memory: hot experts cached in VRAM, "
         "misses computed on the CPU at the same time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def fail(message: str, code: int = 1) -> None:
    """Print ``error: message`` on stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def not_built(command: str, what: str) -> None:
    typer.echo(f"moecache {command}: not built yet in this version ({what}).", err=True)
    raise typer.Exit(2)


@app.command(context_settings=_PASSTHROUGH)
def run(ctx: typer.Context) -> None:
    """Generate text like llama-cli: one-shot -p PROMPT or interactive chat. (Not built yet.)"""
    not_built("run", "text generation needs the model forward passes")


@app.command(context_settings=_PASSTHROUGH)
def perplexity(ctx: typer.Context) -> None:
    """Perplexity over a text file, chunked as llama-perplexity does. (Not built yet.)"""
    not_built("perplexity", "needs the model forward passes")


@app.command(context_settings=_PASSTHROUGH)
def serve(ctx: typer.Context) -> None:
    """OpenAI-compatible HTTP server like llama-server. (Not built yet.)"""
    not_built("serve", "the OpenAI-compatible server comes later")


@app.command(context_settings=_PASSTHROUGH)
def bench(ctx: typer.Context) -> None:
    """Benchmark pp/tg speed like llama-bench, with expert-cache arms. (Not built yet.)"""
    not_built("bench", "needs the GPU runtime and the expert cache")


@app.command("probe-pcie", context_settings=_PASSTHROUGH)
def probe_pcie(ctx: typer.Context) -> None:
    """Measure GPU links (PCIe bandwidth), VRAM, host RAM bandwidth and cores. (Not built yet.)"""
    not_built("probe-pcie", "the startup probe comes later")


@app.command(context_settings=_PASSTHROUGH)
def profile(ctx: typer.Context) -> None:
    """Show, save or preload expert-usage profiles. (Not built yet.)"""
    not_built("profile", "needs the expert cache")


@app.command()
def info(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF file (first shard of a split model).")],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
) -> None:
    """Validate a GGUF and print its architecture, hyperparameters and tensor summary."""
    from moecache.errors import MoecacheError

    try:
        from cli.info import show_info

        show_info(model, tensors)
    except MoecacheError as e:
        fail(str(e))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
