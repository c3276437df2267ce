"""``moecache perplexity``: perplexity of a text file, chunked and scored as llama-perplexity does."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moecache.cli.common import UserError, cache_stats_lines, load_engine, note, read_text_arg, resolve_model


def perplexity_command(model: Path | None, file: Path, settings, n_chunks: int, escape: bool = False,
                       verbose: bool = False) -> None:
    """Tokenize ``file`` as llama-perplexity does (BOS as the model says, special-token text not
    parsed, escapes processed only with ``-e`` (perplexity.cpp turns llama.cpp's default escaping
    off), one trailing newline dropped), score at most
    ``n_chunks`` chunks (-1: all) of ``settings.n_ctx`` tokens (``settings``: a
    :class:`moecache.settings.Settings`), print the running values and llama-perplexity's final line."""
    n_ctx = settings.n_ctx
    if n_ctx < 4:
        raise UserError(f"-c must be >= 4 for perplexity, got {n_ctx}")
    text = read_text_arg(None, file, escape)
    llm = load_engine(resolve_model(model), settings, "perplexity", verbose)
    eng = llm.engine
    try:
        tokens = eng.tokenizer.encode(text, parse_special=False)
        if len(tokens) < 2 * n_ctx:
            raise UserError(f"{file} has {len(tokens)} tokens; perplexity with -c {n_ctx} needs at least "
                            f"{2 * n_ctx}: use a longer text or a smaller -c")
        total = len(tokens) // n_ctx if n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)
        note(f"perplexity: {len(tokens)} tokens, {total} chunks of {n_ctx}, scoring the second half of each")
        running: list[str] = []
        err_console = Console(stderr=True)
        with Progress(TextColumn("chunks"), BarColumn(), MofNCompleteColumn(), TextColumn("ppl {task.fields[ppl]}"),
                      TimeRemainingColumn(), console=err_console, transient=True,
                      disable=not err_console.is_terminal) as bar:
            task = bar.add_task("ppl", total=total, ppl="-")

            def progress(i: int, n: int, ppl: float) -> None:
                running.append(f"[{i + 1}]{ppl:.4f}")
                sys.stdout.write(running[-1] + ",")  # as llama-perplexity: the running value per chunk
                sys.stdout.flush()
                bar.update(task, advance=1, ppl=f"{ppl:.4f}")
            res = eng.perplexity(tokens, n_ctx, progress, max_chunks=total)
        sys.stdout.write("\n")
        sys.stdout.write(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}\n")
        sys.stdout.flush()
        note(f"scored {res.count} tokens in {res.seconds:.2f} s "
             f"({res.n_chunks * n_ctx / res.seconds:.1f} tokens per second evaluated)")
    finally:
        if eng.caches and settings.moe_cache_stats:
            for line in cache_stats_lines(eng):
                note(line)
        llm.close()


__all__ = ["perplexity_command", "typer"]
