"""``moecache perplexity``: perplexity of a text file, chunked and scored as llama-perplexity does."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cli.common import UserError, load_engine, note, resolve_model


def perplexity_command(model: Path | None, file: Path, n_ctx: int, engine_config, n_chunks: int,
                       ngl: int | None, flash_attn: str | None) -> None:
    """Tokenize ``file`` (with BOS as the model says), score it, print llama-perplexity's final line."""
    if n_ctx < 4:
        raise UserError(f"-c must be >= 4 for perplexity, got {n_ctx}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {file}: {e}") from None
    eng = load_engine(resolve_model(model), engine_config, ngl, flash_attn)
    try:
        tokens = eng.tokenizer.encode(text)
        if len(tokens) < 2 * n_ctx:
            raise UserError(f"{file} has {len(tokens)} tokens; perplexity with -c {n_ctx} needs at least "
                            f"{2 * n_ctx}: use a longer text or a smaller -c")
        if n_chunks > 0:
            tokens = tokens[:n_chunks * n_ctx]
        total = len(tokens) // n_ctx
        note(f"perplexity: {len(tokens)} tokens, {total} chunks of {n_ctx}, scoring the second half of each")
        running: list[str] = []
        err_console = Console(stderr=True)
        with Progress(TextColumn("chunks"), BarColumn(), MofNCompleteColumn(), TextColumn("ppl {task.fields[ppl]}"),
                      TimeRemainingColumn(), console=err_console, transient=True,
                      disable=not err_console.is_terminal) as bar:
            task = bar.add_task("ppl", total=total, ppl="-")

            def progress(i: int, n: int, ppl: float) -> None:
                running.append(f"[{i + 1}]{ppl:.4f}")
                bar.update(task, advance=1, ppl=f"{ppl:.4f}")
            res = eng.perplexity(tokens, n_ctx, progress)
        sys.stdout.write(",".join(running) + ",\n")
        sys.stdout.write(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}\n")
        sys.stdout.flush()
        note(f"scored {res.count} tokens in {res.seconds:.2f} s "
             f"({res.n_chunks * n_ctx / res.seconds:.1f} tokens per second evaluated)")
    finally:
        eng.close()


__all__ = ["perplexity_command", "typer"]
