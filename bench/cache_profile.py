"""Where a cache-on decode token's time goes: GPU replay time against the host's share, per token.

Loads the model several times in one process: with the expert cache at ``--vram-budget``
(zero-copy misses, CUDA-graph decode), for each KV cache type of ``-ctk``, with misses read in place
and staged (``--no-staged``: in place only); then entirely in VRAM (no budget: the same graph
without misses, at the first ``-ctk`` type). All use the same routing process. After ``--warmup`` generated tokens, each
starts a fresh 8-token context (the expert cache stays warm; every timed run starts at the same
position) and decodes ``-n`` tokens while this script times, per token:

- wall: the whole ``Engine.eval`` of one token;
- gpu: the graph replay on its stream (CUDA events around the launch);
- feed: copying the routing process's pass (drawn during the previous replay) to the device
  before the launch (benchmarks only);
- ahead: drawing the next pass while the graph runs (``draw_ahead``; off the critical path while
  it is shorter than the replay);
- begin / flush / end: the expert cache's pass hooks (map upload, policy accounting while the graph
  runs, routing log read-back);

then each cache-on engine decodes ``-n`` more tokens at each fixed upload budget of
``--upload-caps`` (default 0: uploads frozen, no admissions), which separates the uploads' share of
the link from the misses'. Hit rates and uploads per token are those of the timed tokens. Misses are read by the MoE kernels
straight from host RAM, or staged into VRAM by a copy kernel first (``stage_misses``). Prints a
markdown table.

    python bench/cache_profile.py -m /tmp/q30.gguf --vram-budget 8GiB --routing qwen3-moe
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


class _TimedGraph:
    """Stands in for a captured CUDA graph: records events around each launch."""

    def __init__(self, graph: Any, sink: list[float]):
        self.graph, self.sink, self._ev = graph, sink, None

    def launch(self, stream: Any) -> None:
        import cupy as cp

        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        self.graph.launch(stream)
        b.record(stream)
        self._ev = (a, b)

    def collect(self) -> None:
        import cupy as cp

        if self._ev is not None:
            a, b = self._ev
            b.synchronize()
            self.sink.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
            self._ev = None


def _timed(obj: Any, name: str, sink: list[float]) -> None:
    """Time every call of ``obj.name`` into ``sink`` (an instance attribute that shadows the method:
    ``delattr(obj, name)`` restores it)."""
    f: Callable = getattr(obj, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        sink.append(time.perf_counter() - t0)
        return r

    setattr(obj, name, g)


def profile(eng: Any, n: int, warmup: int, rng: np.random.Generator) -> dict[str, float]:
    """Median milliseconds per decoded token of each part (see the module docstring)."""
    vocab = eng.gguf.config.n_vocab
    eng.reset()
    eng.eval(rng.integers(0, vocab, 8))
    for _ in range(max(1, warmup)):  # at least one: the graph is captured at the first decode step
        eng.eval([int(rng.integers(0, vocab))])
    # the timed tokens start at the same position after any warm-up (attention grows with it), as
    # llama-bench's tg tests do: a fresh context, the expert cache as the warm-up left it
    eng.reset()
    eng.eval(rng.integers(0, vocab, 8))
    for c in eng.caches:  # hit rate and uploads of the timed tokens only
        c.reset_stats()
    g = eng.model.decode_graph
    if g is None or g._cap is None:
        raise SystemExit(f"decode does not run as a CUDA graph ({'no graph' if g is None else g.failed})")
    parts: dict[str, list[float]] = {k: [] for k in ("wall", "gpu", "draw", "ahead", "begin", "flush", "end")}
    timed = _TimedGraph(g._cap.graph, parts["gpu"])
    g._cap.graph = timed
    if g._cap.routes is not None:
        _timed(g._cap.routes, "draw", parts["draw"])
        _timed(g._cap.routes, "draw_ahead", parts["ahead"])
    for c in eng.caches:
        _timed(c, "begin_pass", parts["begin"])
        _timed(c, "flush", parts["flush"])
        _timed(c, "end_pass", parts["end"])
    for _ in range(n):
        t0 = time.perf_counter()
        eng.eval([int(rng.integers(0, vocab))])
        parts["wall"].append(time.perf_counter() - t0)
        timed.collect()
    g._cap.graph = timed.graph
    wrapped = [(c, n) for c in eng.caches for n in ("begin_pass", "flush", "end_pass")]
    if g._cap.routes is not None:
        wrapped += [(g._cap.routes, "draw"), (g._cap.routes, "draw_ahead")]
    for obj, name in wrapped:
        delattr(obj, name)
    return {k: 1e3 * statistics.median(v) if v else 0.0 for k, v in parts.items()}


def decode_args(ap: argparse.ArgumentParser, routing: str, n: int) -> None:
    """The model and decode options this script and ``policy_variants.py`` share."""
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default=routing)
    ap.add_argument("-c", type=int, default=4096)
    ap.add_argument("-n", type=int, default=n)
    ap.add_argument("--warmup", type=int, default=256)
    ap.add_argument("-t", type=int, default=15)


def main() -> None:
    from moecache.sizes import parse_size
    from moecache.benchmark import release_gpu_memory
    from moecache.placement import PlacementOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_args(ap, "qwen3-moe", 128)
    ap.add_argument("-ctk", "--cache-type", default="f16",
                    help="KV cache types to compare, comma list (f32,f16): one pair of cache-on rows each")
    ap.add_argument("--no-staged", action="store_true", help="skip the staged-misses rows")
    ap.add_argument("--upload-caps", default="0", help="after the adaptive run, -n more tokens at each of these "
                    "fixed upload budgets per token, comma list (0 = uploads frozen; empty: none)")
    a = ap.parse_args()
    budget = parse_size(a.vram_budget, "--vram-budget")
    rows = []
    arms = []
    for kv in a.cache_type.split(","):
        arms.append((f"cache on, {a.vram_budget}, KV {kv}", PlacementOptions(vram_budget=budget), "pin", False, kv))
        if not a.no_staged:
            arms.append((f"cache on, staged misses, KV {kv}", PlacementOptions(vram_budget=budget), "pin", True, kv))
    first_kv = a.cache_type.split(",")[0]
    arms.append((f"all in VRAM, KV {first_kv}", PlacementOptions(), "mmap", False, first_kv))
    for label, opts, mode, stage, kv in arms:
        # one function call per arm: none of its objects outlive it (a loop variable of main's scope
        # kept the first arm's expert cache alive, and the staged arm, planned after it, got 40 slots)
        rows.extend(_run_arm(a, label, opts, mode, stage, kv))
        release_gpu_memory()
    print(f"# Decode time per token: {a.model.name}, --routing {a.routing}, -c {a.c}\n")
    print("| engine | t/s | wall ms | GPU replay ms | feed ms | ahead ms | begin ms | flush ms | end ms | hit rate | "
          "uploads/token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, r, hits in rows:
        hr = ", ".join(f"{100 * h:.1f}%" for h, _ in hits) or "-"
        up = ", ".join(f"{u:.2f}" for _, u in hits) or "-"
        print(f"| {label} | {1e3 / r['wall']:.1f} | {r['wall']:.2f} | {r['gpu']:.2f} | {r['draw']:.2f} | {r['ahead']:.2f} | "
              f"{r['begin']:.2f} | {r['flush']:.2f} | {r['end']:.2f} | {hr} | {up} |")


def _run_arm(a: argparse.Namespace, label: str, opts: Any, mode: str, stage: bool, kv: str) -> list[tuple]:
    """One engine: its adaptive run, then one run per upload cap. Returns the table rows."""
    from moecache.devices import gpu_memory
    from moecache.engine import Engine, EngineConfig
    from moecache.moe.policy import PolicyConfig
    from moecache.moe.routing_process import make_routing

    if opts.vram_budget:
        _, used, _ = gpu_memory()
        print(f"note: {label}: {used[0] / 2**20:.0f} MiB in use on GPU 0 before loading (counted against the "
              f"budget)" if used else f"note: {label}: no GPU", flush=True)
    rows = []
    with Engine(a.model, EngineConfig(n_ctx=a.c, n_threads=a.t, cache_type=kv), placement=opts, load_mode=mode,
                policy_config=PolicyConfig(adaptive=True), stage_misses=stage) as eng:
        c = eng.gguf.config
        eng.model.routing_override = make_routing(a.routing, c.n_layer, c.n_expert, c.n_expert_used, seed=0)
        rng = np.random.default_rng(0)
        if stage and not all(cc.scratch is not None for cc in eng.caches):
            label += " (staging unavailable: direct reads)"
        res = profile(eng, a.n, a.warmup, rng)
        label += f" ({sum(cc.policy.n_slots for cc in eng.caches)} slots)" if eng.caches else ""
        rows.append((label, res, [(cc.stats.hit_rate, cc.stats.uploads / max(1, cc.stats.tokens)) for cc in eng.caches]))
        for cap in (float(x) for x in a.upload_caps.split(",") if x) if eng.caches else ():
            # a fixed upload budget (0: uploads frozen, the misses' own cost)
            for cc in eng.caches:
                cc.flush()  # the adaptive run's last pass is accounted under its own budget
                cc.policy.uploads_per_token = cap
                cc.policy.credit = 0.0
                cc.policy.cfg = PolicyConfig(**{**cc.policy.cfg.__dict__, "adaptive": False, "burst": cap,
                                                "uploads_per_token": cap})
            res = profile(eng, a.n, 0, rng)
            rows.append((label + (", uploads frozen" if cap == 0 else f", <= {cap:g} uploads/token"), res,
                         [(cc.stats.hit_rate, cc.stats.uploads / max(1, cc.stats.tokens)) for cc in eng.caches]))
    return rows


if __name__ == "__main__":
    main()
