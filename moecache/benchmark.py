"""``moecache bench``: llama-bench's method and output conventions, plus expert-cache parameters.

Every parameter takes a comma list and ``first-last+step`` / ``first-last*mult`` ranges; the bench
runs every combination (:func:`expand`), one engine per combination, sized for its largest test
(llama-bench sizes the context per test; one engine per combination keeps the expert cache warm
across its tests). Tests are llama-bench's: ``pp N`` (one N-token prompt),
``tg N`` (N single-token decode steps), ``pp N+tg M`` (both, timed together), each optionally after
``-d D`` tokens of context (``pp512 @ d4096``). Tokens are random ids and nothing is sampled, so
tokenization and sampling are outside the timings, as in llama-bench. Each test runs ``-r`` times
after llama-bench's warm-up (one prompt and/or one token); ``--n-gen-warmup N`` first generates N
tokens per engine (an expert cache needs warming). Cache counters cover the timed parts only.
Results carry llama-bench's field names (``tools/llama-bench/llama-bench.cpp``, ``test::get_fields``)
where they apply, plus ours (``moe_cache_mib_granted``, ``vram_budget``, ``routing``, ``hit_rate``,
``uploads_per_token``, ``vram_used_mib``: device memory the engine held, CUDA context excluded).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moecache.probe import cpu_model
from moecache.settings import DEFAULT_WINDOW

# llama-bench's result fields that moecache fills (same names, same meaning), then ours
LLAMA_BENCH_FIELDS = ("build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename",
                      "model_type", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads",
                      "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "flash_attn", "tensor_split",
                      "load_mode", "type_k", "type_v", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns",
                      "stddev_ns", "avg_ts", "stddev_ts")
OUR_FIELDS = ("moe_cache", "moe_cache_mib_granted", "vram_budget", "moe_cache_window", "routing", "miss_split",
              "elastic_slots", "cache_plan", "plan_cpu_layers", "plan_shares",
              "hit_rate", "uploads_per_token", "misses_per_token", "cpu_misses_per_token",
              "cpu_wait_us_per_token", "n_gen_warmup", "vram_used_mib", "depth_ts", "host_expert_layers",
              "graph_steps", "routing_primed")


MAX_LIST_VALUES = 1000  # values one bench flag may list (a range is expanded)
MAX_COMBINATIONS = 10000  # tests x parameter combinations of one bench command


def split_items(text: str | int | None, flag: str) -> list[str]:
    """The comma-separated items of a bench flag's value, stripped (None or "": none).

    Raises:
        ValueError: naming ``flag``: an empty item between commas."""
    parts = [p.strip() for p in str("" if text is None else text).split(",")]
    if parts == [""]:
        return []
    if "" in parts:
        raise ValueError(f"{flag} {text!r}: an empty item between commas")
    return parts


def parse_list(text: str | int | None, flag: str, kind: type = int) -> list:
    """``"1,2,4"``, ``"8-32+8"`` (8, 16, 24, 32), ``"1-16*2"`` (1, 2, 4, 8, 16) -> values.

    Raises:
        ValueError: naming ``flag`` and the bad item: not a number or range, an empty item between
            commas, or more than :data:`MAX_LIST_VALUES` values.
    """
    out: list = []
    for item in split_items(text, flag):
        try:
            if kind is int and "-" in item[1:]:
                first, rest = item[0] + item[1:].split("-", 1)[0], item[1:].split("-", 1)[1]
                op = "+" if "+" in rest else "*" if "*" in rest else None
                last, step = (rest.split(op) if op else (rest, "1"))
                a, b, s = int(first), int(last), int(step)
                if s <= 0 or (op == "*" and s < 2) or b < a:
                    raise ValueError
                v = a
                while v <= b:
                    if len(out) >= MAX_LIST_VALUES:
                        raise OverflowError
                    out.append(v)
                    v = v * s if op == "*" else v + s
                    if op == "*" and v == 0:
                        break
            else:
                out.append(kind(item))
        except OverflowError:
            raise ValueError(f"{flag} {text!r}: more than {MAX_LIST_VALUES} values") from None
        except ValueError:
            raise ValueError(f"{flag} {item!r}: expected a number, a comma list or a range like 8-32+8 or 1-16*2") \
                from None
    if len(out) > MAX_LIST_VALUES:
        raise ValueError(f"{flag} {text!r}: more than {MAX_LIST_VALUES} values")
    return out


@dataclass(frozen=True)
class BenchParams:
    """One combination of the loading parameters (one engine) and the tests run on it."""

    model: Path
    n_batch: int
    n_ubatch: int  # 0: not given (the resolved -ub)
    n_threads: int
    n_gpu_layers: int
    n_cpu_moe: int
    moe_cache: int | None
    vram_budget: int
    moe_cache_window: int | None  # None: not given (DEFAULT_WINDOW)
    routing: str | None
    load_mode: str


@dataclass(frozen=True)
class BenchTest:
    """One llama-bench test: n_prompt prompt tokens and/or n_gen decode steps after n_depth tokens."""

    n_prompt: int
    n_gen: int
    n_depth: int = 0

    @property
    def name(self) -> str:
        """llama-bench's test name: ``pp512``, ``tg128``, ``pp512+tg128``, `` @ d4096`` appended."""
        if self.n_prompt and self.n_gen:
            base = f"pp{self.n_prompt}+tg{self.n_gen}"
        elif self.n_prompt:
            base = f"pp{self.n_prompt}"
        else:
            base = f"tg{self.n_gen}"
        return base + (f" @ d{self.n_depth}" if self.n_depth else "")


def make_tests(prompts: list[int], gens: list[int], pgs: list[tuple[int, int]], depths: list[int]) -> list[BenchTest]:
    """llama-bench's test list: every pp, then every tg, then every pp+tg, for each depth."""
    out = []
    for d in depths or [0]:
        out += [BenchTest(p, 0, d) for p in prompts if p > 0]
        out += [BenchTest(0, g, d) for g in gens if g > 0]
        out += [BenchTest(p, g, d) for p, g in pgs if p > 0 or g > 0]
    return out


@dataclass
class Result:
    """One test's measurements and the fields of its row."""

    fields: dict[str, Any] = field(default_factory=dict)
    samples_ns: list[int] = field(default_factory=list)

    n_tokens: int = 0  # n_prompt + n_gen of the test

    @property
    def samples_ts(self) -> list[float]:
        return [self.n_tokens * 1e9 / s for s in self.samples_ns]


def run_test(eng: Any, test: BenchTest, reps: int, warmup: bool,
             rng: np.random.Generator) -> tuple[list[int], dict[str, int]]:
    """Time ``test`` ``reps`` times on ``eng``. The warm-up (unless ``warmup`` is False) is
    llama-bench's: one ``n_prompt`` prompt and/or one generated token, no depth. Returns the samples
    in ns and the expert caches' counters over the timed parts only (depth prefills and warm-up
    excluded); ``totals["depth_ns"]`` sums the depth prefills' times (ns), which are outside the
    samples, as in llama-bench; ``totals["graph_steps"]`` counts the timed one-token steps replayed
    as a CUDA graph (the rest ran op by op; None without a decode graph). With a ``--routing``
    process each timed prompt's first ubatch (``min(n_prompt, eng.n_ubatch)`` tokens) is drawn
    before the clock starts (:meth:`~moecache.moe.routing_process.RoutingProcess.draw_ahead`),
    counted in ``totals["routing_primed"]`` (None without such a process). ``totals["host_bytes"]``:
    per timed sample, the bytes of expert weights copied from host RAM to a device by op offload and
    the expert caches' prompt path (:meth:`~moecache.moe.executor.ExpertsByLayer.offloaded_bytes`: a
    copy ahead counted whole when begun; decode's slot uploads and zero-copy reads not included; int
    per sample, depth prefills and warm-up excluded; None for an engine whose experts are not an
    ``ExpertsByLayer``, as every ``Engine``'s are)."""
    vocab = eng.gguf.config.n_vocab
    caches = list(getattr(eng, "caches", []))
    graph = getattr(getattr(eng, "model", None), "decode_graph", None)
    # --routing's process: its host draw of a pass emulates a router whose real cost is the GPU's
    # router kernel (it still runs): the timed prompt's first ubatch takes a pass drawn before the
    # clock starts (with every layer on a GPU the later ones are drawn on a worker while the pass
    # before computes; otherwise, and when the worker is slower than the pass, they stay on the clock)
    n_ubatch = getattr(eng, "n_ubatch", None)
    prime = getattr(getattr(getattr(eng, "model", None), "routing_override", None), "draw_ahead", None) if n_ubatch else None
    totals = {"hits": 0, "misses": 0, "uploads": 0, "cpu_misses": 0, "cpu_wait_ns": 0, "tokens": 0, "depth_ns": 0,
              "graph_steps": 0 if graph is not None else None,
              "routing_primed": 0 if prime is not None else None}
    # host expert bytes copied so far (every layer's executor), or None for experts not an ExpertsByLayer
    copied = getattr(getattr(getattr(eng, "model", None), "experts", None), "offloaded_bytes", None)
    totals["host_bytes"] = [] if copied is not None else None

    def once() -> int:
        eng.reset()
        if test.n_depth:
            t_depth = time.perf_counter_ns()
            eng.eval(rng.integers(0, vocab, test.n_depth))
            totals["depth_ns"] += time.perf_counter_ns() - t_depth
        for c in caches:
            c.reset_stats()
        if test.n_prompt and prime is not None:  # the prompt's first ubatch routed before the clock starts
            prime(min(test.n_prompt, n_ubatch))
            totals["routing_primed"] += 1
        r0 = graph.replays if graph is not None else 0
        b0 = copied() if copied is not None else 0
        t0 = time.perf_counter_ns()
        if test.n_prompt:
            eng.eval(rng.integers(0, vocab, test.n_prompt))
        for _ in range(test.n_gen):
            eng.eval([int(rng.integers(0, vocab))])
        ns = time.perf_counter_ns() - t0
        if graph is not None:
            totals["graph_steps"] += graph.replays - r0
        for c in caches:
            c.flush()  # account the last pass's routing (the zero-copy path accounts one pass late)
        if copied is not None:
            totals["host_bytes"].append(copied() - b0)
        for k in ("hits", "misses", "uploads", "cpu_misses", "cpu_wait_ns"):
            totals[k] += sum(getattr(c.stats, k) for c in caches)
        totals["tokens"] += max((c.stats.tokens for c in caches), default=0)  # every cache counts every token
        return ns

    if warmup:
        eng.reset()
        if test.n_prompt:
            eng.eval(rng.integers(0, vocab, test.n_prompt))
        if test.n_gen:
            eng.eval([int(rng.integers(0, vocab))])
    return [once() for _ in range(reps)], totals


def miss_paths(totals: dict) -> dict:
    """The misses' paths per timed token (every MoE layer together) from :func:`run_test`'s totals:
    ``misses_per_token``, ``cpu_misses_per_token`` (those the CPU computed; the rest the GPU read over
    the link) and ``cpu_wait_us_per_token`` (how long the GPU waited for the CPU's answers, us: the
    handoff's ``wait_ns`` measured on the GPU); None each without timed tokens."""
    toks = totals["tokens"]
    if not toks:
        return {"misses_per_token": None, "cpu_misses_per_token": None, "cpu_wait_us_per_token": None}
    return {"misses_per_token": round(totals["misses"] / toks, 3),
            "cpu_misses_per_token": round(totals["cpu_misses"] / toks, 3),
            "cpu_wait_us_per_token": round(totals["cpu_wait_ns"] / toks / 1e3, 1)}


def depth_ts(test: BenchTest, reps: int, depth_ns: int) -> float | None:
    """The depth prefills' speed in t/s: ``reps`` prefills of ``test.n_depth`` tokens in ``depth_ns``
    ns together (run_test's ``totals["depth_ns"]``); None for a test without depth."""
    return test.n_depth * reps * 1e9 / depth_ns if test.n_depth and depth_ns else None


# general.file_type (llama.cpp's llama_ftype) -> the name llama-bench prints in its model column
# (llama_model_ftype_name in src/llama-model-loader.cpp)
FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16", 36: "TQ1_0 - 1.69 bpw ternary",
    37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE",
}


def model_info(eng: Any) -> dict[str, Any]:
    """model_type (arch, parameters, the file type's name as llama-bench prints it, else the type
    holding the most bytes), model_size (bytes) and model_n_params."""
    from gguf import GGMLQuantizationType

    g = eng.gguf
    n_params = sum(int(np.prod(t.shape)) for t in g.tensors.values())
    ftype = g.metadata.get("general.file_type")
    main = FTYPE_NAMES.get(int(ftype) & ~1024) if isinstance(ftype, int) else None  # 1024: "guessed"
    if main is None:
        by_type: dict[int, int] = {}
        for t in g.tensors.values():
            by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + t.n_bytes
        main = GGMLQuantizationType(max(by_type, key=by_type.get)).name
    size = f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M"
    return {"model_type": f"{g.config.arch} {size} {main}", "model_size": g.n_bytes, "model_n_params": n_params}


def plan_fields(eng: Any) -> dict:
    """``bench``'s layer-plan fields at the end of a test: ``cache_plan`` ("layer" when an expert
    cache of ``eng`` follows a layer plan, ``--cache-plan layer``, else "expert"), ``plan_cpu_layers``
    (the layers whose misses the CPU takes a share of) and ``plan_shares`` (how many of the caches'
    layers have each share, "share x layers" by share, e.g. "0x15 4x33"); None for both without a
    plan."""
    planned = [c for c in getattr(eng, "caches", ()) if getattr(c.policy, "layer_plan", False)]
    held = [c for c in planned if c.policy.plan is not None]
    if not held:
        return {"cache_plan": "layer" if planned else "expert", "plan_cpu_layers": None, "plan_shares": None}
    # each cache's own layers (a plan has a row for every layer of the model)
    shares = np.concatenate([c.policy.plan.share[sorted(c.cached_layers)] for c in held]).astype(np.int64)
    counts = np.bincount(shares)
    return {"cache_plan": "layer", "plan_cpu_layers": int((shares > 0).sum()),
            "plan_shares": " ".join(f"{c}x{n}" for c, n in enumerate(counts) if n)}


def bench(params: list[BenchParams], tests: list[BenchTest], reps: int, warmup: bool, n_gen_warmup: int,
          make_engine: Callable[[BenchParams], Any], progress: Callable[[str], None] | None = None,
          say: Callable[[str], None] | None = None) -> list[Result]:
    """Run every test on every parameter combination (one engine per combination).

    Args:
        make_engine: builds the engine of a combination (the CLI's loader: placement, cache, routing).
        progress: told the name of each test as it starts.
        say: told a note (one line) when a test's timed decode steps did not all replay the engine's
            CUDA graph (they ran op by op: its speed is not the graph's).
    """
    results = []
    cpu_info = cpu_model()
    for p in params:
        base_vram = _gpu_used_bytes()
        eng = make_engine(p)
        try:
            rng = np.random.default_rng(0)
            info = model_info(eng)
            if n_gen_warmup:
                eng.reset()
                eng.eval(rng.integers(0, eng.gguf.config.n_vocab, 1))
                for _ in range(n_gen_warmup):
                    eng.eval([int(rng.integers(0, eng.gguf.config.n_vocab))])
            pl = getattr(eng, "placement", None)
            slot_bytes = _slot_bytes(eng)
            for test in tests:
                if progress:
                    progress(f"{p.model.name} {test.name}")
                samples, tot = run_test(eng, test, reps, warmup, rng)
                r = Result(samples_ns=samples, n_tokens=test.n_prompt + test.n_gen)
                hits, misses, uploads, toks = tot["hits"], tot["misses"], tot["uploads"], tot["tokens"]
                r.fields = {
                    "build_commit": _commit(), "build_number": 0, "cpu_info": cpu_info, "gpu_info": _gpu_info(pl),
                    "backends": "CUDA" if pl is not None and pl.devices else "CPU",
                    # n_batch / n_ubatch as they ran: the engine clamps -ub to -b and the context
                    "model_filename": str(p.model), **info,
                    "n_batch": getattr(getattr(eng, "config", None), "n_batch", p.n_batch),
                    "n_ubatch": getattr(eng, "n_ubatch", p.n_ubatch),
                    "n_threads": eng.n_threads, "n_gpu_layers": p.n_gpu_layers, "n_cpu_moe": p.n_cpu_moe,
                    "split_mode": "layer", "main_gpu": 0, "flash_attn": "auto", "tensor_split": "0.00",
                    "load_mode": getattr(eng, "load_mode", p.load_mode),
                    "type_k": getattr(getattr(eng, "config", None), "cache_type", "f32"),
                    "type_v": getattr(getattr(eng, "config", None), "cache_type", "f32"), "n_prompt": test.n_prompt, "n_gen": test.n_gen, "n_depth": test.n_depth,
                    "test_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "moe_cache": -1 if p.moe_cache is None else p.moe_cache,
                    "moe_cache_mib_granted": round(sum(s for _, s in (pl.cache_slots if pl else ())) * slot_bytes
                                                   / 2**20, 1),
                    "vram_budget": p.vram_budget,
                    "moe_cache_window": DEFAULT_WINDOW if p.moe_cache_window is None else p.moe_cache_window, "routing": p.routing or "",
                    "miss_split": int(bool(getattr(eng, "miss_split", False))),  # --miss-split (asked for)
                    # --elastic-slots: the elastic slots placed (counted in moe_cache_mib_granted too)
                    "elastic_slots": sum(n for _, n in (getattr(pl, "elastic_slots", ()) if pl else ())),
                    **plan_fields(eng),
                    # MoE layers whose experts are in host RAM as placed (-ncmoe's N when the placement
                    # chose it: --moe-cache 0 under --vram-budget)
                    "host_expert_layers": host_expert_layers(eng) if pl is not None and pl.devices else None,
                    "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                    "uploads_per_token": round(uploads / toks, 3) if toks else None, "n_gen_warmup": n_gen_warmup,
                    **miss_paths(tot),
                    # the untimed depth prefill's speed (prompt t/s over all reps): a long prompt's pp
                    # and the decode after it from one prefill
                    "depth_ts": depth_ts(test, reps, tot["depth_ns"]),
                    # timed one-token steps replayed as a CUDA graph, of n_gen x reps (the rest ran op by
                    # op); None without a decode graph
                    "graph_steps": tot["graph_steps"],
                    # timed prompts whose first ubatch a --routing process drew before the clock (from
                    # the thirty-ninth session; earlier rows drew it on the clock); None without one
                    "routing_primed": tot["routing_primed"],
                    # GB of experts each timed sample copied from host RAM (op offload and the expert
                    # caches' prompt path; forty-second session on): whether a prompt case's samples
                    # move with the bytes (the prompt keeps fill slots over prompts)
                    "samples_host_gb": (None if tot["host_bytes"] is None
                                        else [round(b / 1e9, 3) for b in tot["host_bytes"]]),
                }
                if tot["graph_steps"] is not None and tot["graph_steps"] < test.n_gen * reps and say:
                    op = test.n_gen * reps - tot["graph_steps"]
                    say(f"note: {test.name}: {op} of {test.n_gen * reps} timed decode steps ran op by op, not as "
                        f"the CUDA graph")
                used = _gpu_used_bytes()
                r.fields["vram_used_mib"] = round((used - base_vram) / 2**20) if used is not None and base_vram is not None \
                    else None
                tss = r.samples_ts
                r.fields.update({"avg_ns": int(statistics.mean(samples)),
                                 "stddev_ns": int(statistics.stdev(samples)) if len(samples) > 1 else 0,
                                 "avg_ts": statistics.mean(tss),
                                 "stddev_ts": statistics.stdev(tss) if len(tss) > 1 else 0.0})
                results.append(r)
        finally:
            eng.close()
            del eng
            release_gpu_memory()  # the next combination is planned on the GPUs' free memory
    return results


def _gpu_used_bytes() -> int | None:
    """Device memory in use on every GPU (total - free, bytes), or None without CuPy or a GPU. The
    difference before loading and after the tests is what an engine held (its CUDA context excluded,
    CuPy's cached blocks included)."""
    try:
        import cupy as cp

        used = 0
        for d in range(cp.cuda.runtime.getDeviceCount()):
            with cp.cuda.Device(d):
                free, total = cp.cuda.runtime.memGetInfo()
            used += total - free
        return used
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: nothing to measure
        return None


def release_gpu_memory() -> None:
    """Return CuPy's cached blocks to the driver (no-op without CuPy loaded)."""
    import gc
    import sys

    gc.collect()
    cp = sys.modules.get("cupy")
    if cp is not None:
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()


def host_expert_layers(eng: Any) -> int:
    """The MoE layers of ``eng`` whose routed experts are not resident on a device: computed on the
    CPU (``--cpu-moe``, ``-ncmoe``, or the layers a budget moved to the host with ``--moe-cache 0``)
    or behind an expert cache. 0 when the model's experts are not placed per layer (no placement)."""
    from moecache.moe.executor import DeviceExperts

    ex = getattr(getattr(getattr(eng, "model", None), "experts", None), "executors", None) or {}
    return sum(1 for e in ex.values() if not isinstance(e, DeviceExperts))


def _slot_bytes(eng: Any) -> int:
    for c in getattr(eng, "caches", []):
        pool = c.pool
        return int(pool.gate[0].nbytes + pool.up[0].nbytes + pool.down[0].nbytes)
    return 0


def _gpu_info(pl: Any) -> str:
    if pl is None or not pl.devices:
        return ""
    from moecache.devices import gpu_name

    return ", ".join(gpu_name(d) for d in pl.devices)


def _commit() -> str:
    """The checkout's short commit, ``-dirty`` appended when tracked files differ from it."""
    try:
        import subprocess

        root = Path(__file__).resolve().parents[1]
        cmd = ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


# ---- output -----------------------------------------------------------------------------------------
def _size(b: int) -> str:
    return f"{b / 2**20:.2f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


# llama-bench's markdown columns (tools/llama-bench/llama-bench.cpp, markdown_printer): model, size,
# params, backend, then each parameter once, under its display name: n_gpu_layers ("ngl") unless the
# backend is the CPU, n_threads ("threads") on the CPU or when given, any other parameter when it
# varies or differs from its default; then test and t/s. Ours follow llama-bench's.
MD_ORDER = ("n_gpu_layers", "n_threads", "n_batch", "n_ubatch", "type_k", "type_v", "n_cpu_moe", "load_mode",
            "moe_cache", "vram_budget", "moe_cache_window", "routing", "miss_split", "elastic_slots", "cache_plan", "n_gen_warmup")
MD_NAMES = {"n_gpu_layers": "ngl", "n_threads": "threads", "split_mode": "sm", "flash_attn": "fa",
            "tensor_split": "ts"}


def md_columns(results: list[Result], shown: list[str]) -> list[str]:
    """The parameter columns of the markdown table (field names, llama-bench's order): ``shown`` are
    the parameters given on the command line (varied or not at their default); a CPU-only run has
    no ngl column and always a threads one. Values are those that ran (n_ubatch: -ub clamped to
    -b and the context, as the engine runs it)."""
    cpu = all(r.fields.get("backends") == "CPU" for r in results)
    cols = set(shown)
    cols.discard("model")
    if cpu:
        cols.discard("n_gpu_layers")
        cols.add("n_threads")
    else:
        cols.add("n_gpu_layers")
    return [k for k in MD_ORDER if k in cols] + sorted(k for k in cols if k not in MD_ORDER)


def _md_value(field: str, v: Any) -> str:
    if field == "vram_budget":
        return _size(v) if v else "-"
    if field == "routing":
        return v or "-"
    return str(v)


def to_markdown(results: list[Result], shown: list[str]) -> str:
    """llama-bench's markdown table: model, size, params, backend, the parameter columns
    (:func:`md_columns`), test and ``t/s`` as ``avg ± stddev``; hit rate when a cache ran."""
    params = md_columns(results, shown)
    has_cache = any(r.fields.get("hit_rate") is not None for r in results)
    header = ["model", "size", "params", "backend"] + [MD_NAMES.get(k, k) for k in params] + ["test", "t/s"] \
        + (["hit rate"] if has_cache else [])
    right = {"size", "params", "t/s", "hit rate"} | {MD_NAMES.get(k, k) for k in params}
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" if h in right else "---" for h in header) + " |"]
    for r in results:
        f = r.fields
        row = [f["model_type"], _size(f["model_size"]), _params(f["model_n_params"]), f["backends"]]
        row += [_md_value(k, f.get(k)) for k in params]
        row += [BenchTest(f["n_prompt"], f["n_gen"], f["n_depth"]).name, f"{f['avg_ts']:.2f} ± {f['stddev_ts']:.2f}"]
        if has_cache:
            row.append("-" if f.get("hit_rate") is None else f"{100 * f['hit_rate']:.1f}%")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def to_records(results: list[Result]) -> list[dict]:
    """One dict per test: llama-bench's fields, ours, and the per-sample lists samples_ns / samples_ts
    and ours samples_host_gb (json and jsonl only, as the samples)."""
    keys = LLAMA_BENCH_FIELDS + OUR_FIELDS
    return [{**{k: r.fields.get(k) for k in keys}, "samples_ns": r.samples_ns, "samples_ts": r.samples_ts,
             "samples_host_gb": r.fields.get("samples_host_gb")}
            for r in results]


def render(results: list[Result], fmt: str, shown: list[str]) -> str:
    """``-o md|csv|json|jsonl`` (``shown``: the parameters given, for the md columns). Raises
    ValueError for another format."""
    if fmt == "md":
        return to_markdown(results, shown)
    recs = to_records(results)
    if fmt == "json":
        return json.dumps(recs, indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in recs)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(LLAMA_BENCH_FIELDS + OUR_FIELDS))
        w.writeheader()
        for r in recs:
            w.writerow({k: r[k] for k in LLAMA_BENCH_FIELDS + OUR_FIELDS})
        return buf.getvalue()
    raise ValueError(f"-o {fmt!r}: expected md, csv, json or jsonl")


def expand(base: BenchParams, **lists: list) -> list[BenchParams]:
    """Every combination of the listed values over ``base`` (a field -> values mapping).

    Raises:
        ValueError: more than :data:`MAX_COMBINATIONS` of them."""
    names = [k for k, v in lists.items() if v]
    n = math.prod(len(lists[k]) for k in names)
    if n > MAX_COMBINATIONS:
        raise ValueError(f"{n} combinations of the listed flags' values: at most {MAX_COMBINATIONS}")
    combos = itertools.product(*(lists[k] for k in names))
    return [replace(base, **dict(zip(names, c))) for c in combos]
