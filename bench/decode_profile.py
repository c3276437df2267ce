"""Where a decode step's (or a prompt's) time goes on the GPU: kernels per token and microseconds per
kernel class.

Loads a model all on one GPU, evaluates a ``-d``-token prompt (the attention depth), then times
``-n`` single-token decode steps (CUDA-graph replays, or op by op with ``--modes eager``) under PyTorch's profiler
(CUPTI sees every kernel of the process, CuPy's included); ``--batch B`` profiles decode steps of B
sequences together instead (serve's slots; the rows are then per step, with the expert cache's hits and
misses per step; ``--host-times`` adds the host's phases of a step, ``--gaps``, ``--halves`` and
``--cpu-cost-scale`` compare the cache's accounting placement, steps in two halves against one pass and
the layer plan's CPU costs in one process). Prints, per kernel name: launches per
token, µs per token, µs per launch, share of the GPU time; then the step's wall time per token next
to the sum of kernel time (the difference is launch gaps, copies and host work).

``--prefill P`` profiles prompts instead: ``-n`` evaluations of a P-token prompt (in ``-ub`` ubatches)
after the depth, reported per prompt token; copies between host and device are rows of their own
(CUPTI's ``Memcpy`` events). ``--vram-budget MiB`` keeps the routed experts in host RAM behind the
expert cache, as ``run --vram-budget`` does (``--load-mode``: how the host experts are held).

Needs PyTorch (present on the lent GPU machines; not a dependency of moecache).

    python bench/decode_profile.py -m /tmp/q30.gguf -c 4096 -d 0 -n 32 [--modes graph,eager] [--json out.json]
    python bench/decode_profile.py -m /tmp/q30.gguf -c 4096 --prefill 512 -n 2 [--vram-budget 8192 --load-mode pin] [--prompt-q8]
    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=30000000 python bench/decode_profile.py -m /tmp/q30.gguf -c 8192 \
        --resolved --vram-budget 8192 --load-mode pin --routing qwen3-moe --batch 8,1 --warmup 96 -n 32 \
        [--host-times] [--gaps on,off] [--halves on,off,on] [--cpu-cost-scale 1,1.5,2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def kernel_class(name: str) -> str:
    """A kernel's name without its quant-format suffix and template arguments (one row per op)."""
    base = name.split("(")[0].split("<")[0]
    for fmt in ("_q4_k", "_q5_k", "_q6_k", "_q8_0", "_q4_0", "_q4_1", "_q5_0", "_q5_1", "_q2_k", "_q3_k",
                "_iq4_nl", "_iq4_xs", "_mxfp4", "_f32", "_f16", "_bf16"):
        if base.endswith(fmt):
            return base[: -len(fmt)] + "_*"
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("-c", type=int, default=4096, help="context size (KV cache positions)")
    ap.add_argument("-d", default="0", help="prompt tokens before the timed steps (attention depth); a comma list "
                    "profiles each depth in turn on the same engine")
    ap.add_argument("-n", type=int, default=32, help="decode steps profiled")
    ap.add_argument("-ub", type=int, default=None, help="physical batch (default 512; with --resolved, resolved)")
    ap.add_argument("-t", type=int, default=None, help="CPU threads (with --resolved; default resolved)")
    ap.add_argument("--ctk", default="f16", help="KV cache type (f16, f32)")
    ap.add_argument("--modes", default="graph", help="comma list: graph (CUDA-graph replays), eager (op by op)")
    ap.add_argument("--by-name", action="store_true", help="one row per kernel name (formats apart)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prefill", type=int, default=0, help="profile -n prompts of this many tokens instead")
    ap.add_argument("--vram-budget", type=int, default=0, help="MiB per GPU (0: none): experts in host RAM")
    ap.add_argument("--load-mode", default=None, help="mmap or pin (host experts; default mmap, or with "
                    "--resolved as resolved)")
    ap.add_argument("--routing", default=None, help="replace the routers' choices by this routing process "
                    "(qwen3-moe, low-locality, uniform: as bench --routing; the routing draws count in the wall time)")
    ap.add_argument("--prompt-q8", action="store_true", help="the grouped 8-bit prompt MoE (Engine(gpu_prompt_q8=True))")
    ap.add_argument("--prompt-stacks", action="store_true", help="the expert cache's opt-in prompt stacks "
                    "(CachedExperts.prompt_stacks True) instead of its default prompt groups")
    ap.add_argument("--resolved", action="store_true",
                    help="load through moecache.load, the settings run and serve resolve (the layer plan, the "
                         "elastic slots, -t; set OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=30000000 as they do), "
                         "instead of an Engine with this script's placement; --prompt-q8 does not apply")
    ap.add_argument("--batch", default="1", metavar="B",
                    help="profile decode steps of B sequences together (Engine.sequences / Engine.decode, as "
                         "serve's slots run; each a -d prompt first); the table is then per step, with the "
                         "expert cache's hits and misses per step; a comma list (1,8) profiles each B in turn "
                         "on the same engine (B 1 then also runs as a slot, through Engine.decode)")
    ap.add_argument("--warmup", type=int, default=4, metavar="N",
                    help="with --batch: decode steps before the profiled ones (the graph's capture, the cache's "
                         "and the plan's settling; serve's slots have run many)")
    ap.add_argument("--gaps", default="on", help="with --batch: a comma list of on/off: the expert cache's "
                    "accounting in the gaps between the handoff's answers (CachedExperts.account_in_gaps), or "
                    "after the last; each B is profiled once per value, in turn on the same engine")
    ap.add_argument("--halves", default="off", help="with --batch: a comma list of on/off: batched steps with the "
                    "CPU's share of the misses run in two halves (CachedExperts.decode_halves, opt-in; from 4 sequences), "
                    "or in one pass; each B is profiled once per value, in turn on the same engine (the batch's "
                    "graph captured again at each change)")
    ap.add_argument("--cpu-cost-scale", default="1", metavar="LIST",
                    help="with --batch: a comma list of factors on the layer plan's CPU costs (PolicyConfig "
                         "t_cpu_layer and t_fixed, as resolved): each B is profiled once per factor, the plan made "
                         "again with those costs first (how the CPU's share of the misses moves a step's time)")
    ap.add_argument("--host-times", action="store_true",
                    help="with --batch: also time the host's phases of each step (the cache's pass hooks, the "
                         "routing draw, the replay, the handoff's answers, launched less the answers) over -n "
                         "more steps")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="with --prefill or --batch: also run the timed prompts (or -n more steps) under "
                         "cProfile (host Python time) and print its top N functions by own time")
    a = ap.parse_args()
    try:
        a.cpu_scales = [float(x) for x in a.cpu_cost_scale.split(",")]
    except ValueError:
        raise SystemExit(f"--cpu-cost-scale: a comma list of numbers, not {a.cpu_cost_scale!r}") from None
    for name in ("gaps", "halves"):
        if set(getattr(a, name).split(",")) - {"on", "off"}:
            raise SystemExit(f"--{name}: a comma list of on and off, not {getattr(a, name)!r}")
    if a.t is not None and not a.resolved:
        raise SystemExit("-t: with --resolved only (the settings run and serve resolve)")
    if a.batch == "1" and (a.gaps != "on" or a.halves != "off" or a.cpu_cost_scale != "1"):
        raise SystemExit("--gaps, --halves and --cpu-cost-scale apply to --batch steps only")
    try:
        a.batches = [int(b) for b in a.batch.split(",")]
        if not a.batches or min(a.batches) < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--batch: a comma list of positive integers, not {a.batch!r}") from None
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        raise SystemExit("bench/decode_profile.py needs PyTorch (its profiler reads CUPTI)") from None
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions

    torch.cuda.init()
    rng = np.random.default_rng(0)
    if a.resolved:  # the settings run and serve resolve (the layer plan, the elastic slots, -t)
        import moecache

        given = {"vram_budget": a.vram_budget << 20 if a.vram_budget else None, "n_ubatch": a.ub, "n_threads": a.t,
                 "load_mode": a.load_mode, "routing": a.routing}  # routing at load, as run --routing has it
        held = moecache.load(a.model, log=print, n_ctx=a.c, cache_type=a.ctk, no_moe_profile=True,
                             **{k: v for k, v in given.items() if v is not None})
    else:
        a.ub, a.load_mode = a.ub or 512, a.load_mode or "mmap"
        cfg = EngineConfig(n_ctx=a.c, n_ubatch=a.ub, n_batch=max(a.ub, 2048), cache_type=a.ctk)
        placement = PlacementOptions(n_gpu_layers=99, vram_budget=a.vram_budget << 20)
        held = Engine(a.model, cfg, log=print, placement=placement, cuda_graph=True, load_mode=a.load_mode,
                      gpu_prompt_q8=a.prompt_q8)
    with held:
        eng = getattr(held, "engine", held)
        vocab = eng.gguf.config.n_vocab
        for cache in eng.caches:
            cache.prompt_stacks = a.prompt_stacks
        if a.routing and not a.resolved:
            from moecache.moe.routing_process import make_routing

            c = eng.gguf.config
            eng.model.routing_override = make_routing(a.routing, c.n_layer, c.n_expert, c.n_expert_used, seed=0)
        results = []
        graph = eng.model.decode_graph
        for depth, mode in [(int(d), m) for d in a.d.split(",") for m in a.modes.split(",")]:
            eng.model.decode_graph = graph if mode == "graph" else None
            eng.reset()
            if a.batches != [1]:  # each slot its own depth prompt
                base = {id(c): c.policy.cfg for c in eng.caches}
                for b in a.batches:
                    for scale in a.cpu_scales:
                        for cache in eng.caches:
                            cfg = base[id(cache)]
                            cache.policy.cfg = dataclasses.replace(cfg, t_cpu_layer=cfg.t_cpu_layer * scale,
                                                                   t_fixed=cfg.t_fixed * scale)
                            cache.policy.replan_soon()
                        for gaps, halves in [(g, h) for g in a.gaps.split(",") for h in a.halves.split(",")]:
                            for cache in eng.caches:
                                cache.account_in_gaps = gaps == "on"
                                cache.decode_halves = halves == "on"
                            results.append(profile_batch(a, torch, profile, ProfilerActivity, eng, rng, depth,
                                                         f"{mode}, accounting in the gaps {gaps}, halves {halves} "
                                                         f"({'two halves' if eng.model.halves_for(b) else 'one pass'}), "
                                                         f"plan's CPU costs x{scale:g}", b))
                continue
            if depth:
                eng.eval(rng.integers(0, vocab, depth))
            if a.prefill:
                results.append(profile_prompts(a, torch, profile, ProfilerActivity, eng, rng, depth, mode))
                continue
            for _ in range(4):  # capture the graph, settle clocks
                eng.eval([int(rng.integers(0, vocab))])
            toks = rng.integers(0, vocab, a.n)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for t in toks:
                    eng.eval([int(t)])
                wall = time.perf_counter() - t0
            # timed again without the profiler (CUPTI adds a little per kernel)
            t0 = time.perf_counter()
            for t in toks:
                eng.eval([int(t)])
            wall_plain = time.perf_counter() - t0
            results.append(report(a, torch, prof, depth, mode, wall, wall_plain))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


def profile_batch(a, torch, profile, activity, eng, rng, depth: int, mode: str, batch: int) -> dict:
    """``-n`` decode steps of ``batch`` sequences together (serve's continuous batching: batched
    CUDA graphs where they replay), each sequence a slot of ``-c`` with a ``depth``-token prompt
    first and its own random token every step, after ``--warmup`` steps; the table per step, and the
    expert caches' counters per step over the steps timed without the profiler."""
    vocab = eng.gguf.config.n_vocab
    seqs = eng.sequences(batch)
    if depth + a.warmup + 2 * a.n > seqs[0].n_ctx:
        raise SystemExit(f"--batch {batch}: each slot holds {seqs[0].n_ctx} positions (-c {a.c} over {batch}), "
                         f"fewer than the depth {depth} + {a.warmup} warm-up + 2 x {a.n} steps")
    for s in seqs:
        s.clear()
        if depth:
            eng.eval(rng.integers(0, vocab, depth), kv=s)

    def steps(n: int) -> None:
        for _ in range(n):
            eng.decode(rng.integers(0, vocab, batch), seqs)

    steps(a.warmup)  # capture the batch's graph, settle clocks, the cache and the plan
    with profile(activities=[activity.CUDA]) as prof:
        t0 = time.perf_counter()
        steps(a.n)
        wall = time.perf_counter() - t0
    for c in eng.caches:
        c.flush()
        c.reset_stats()
    t0 = time.perf_counter()
    steps(a.n)
    wall_plain = time.perf_counter() - t0
    for c in eng.caches:
        c.flush()  # account the last pass's routing
    k = {f: sum(getattr(c.stats, f) for c in eng.caches) / a.n
         for f in ("hits", "misses", "uploads", "cpu_misses", "cpu_wait_ns")} if eng.caches else None
    if k:  # the CPU kernel's time answering the handoff (CachedExperts.cpu_s, zeroed by reset_stats)
        k["cpu_kernel_us"] = sum(float(c.cpu_s.sum()) for c in eng.caches) / a.n * 1e6
    phases = host_times(eng, steps, a.n) if a.host_times else None
    if a.host_profile:
        import cProfile
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        steps(a.n)
        prof_host.disable()
        print(f"host profile of {a.n} steps of {batch} (cProfile; times inflated by its tracing):")
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(a.host_profile)
    for s in seqs:
        s.clear()
    out = report(a, torch, prof, depth, f"{mode}, steps of {batch} sequences", wall, wall_plain, unit="step")
    if k:
        print(f"expert cache per step of {batch}: {k['hits']:.1f} hits, {k['misses']:.1f} misses "
              f"({k['cpu_misses']:.1f} on the CPU, {k['misses'] - k['cpu_misses']:.1f} over the link), "
              f"{k['uploads']:.1f} uploads, the GPU waited {k['cpu_wait_ns'] / 1e3:.0f} us for the CPU, "
              f"the CPU's kernel took {k['cpu_kernel_us']:.0f} us")
        out["cache_per_step"] = k
    if phases:
        out["host_us_per_step"] = phases
    return out


def host_times(eng, steps, n: int) -> dict:
    """Run ``steps(n)`` with the host's phases of a decode step timed (wrappers on this engine's
    objects, removed after): the step (``Engine.decode``), the replay, the caches' pass hooks, the
    routing draw and the handoff's answers; ``launched`` less the answers is the accounting run
    after the last answer (or all of it, with no answers to give), with the uploads it starts.
    Prints and returns µs per step."""
    import moecache.moe.cache as cache_mod
    from moecache.backends import cuda_graph

    spent: dict[str, float] = defaultdict(float)
    undo = []

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[label] += time.perf_counter() - t0
        had = name in vars(owner)
        setattr(owner, name, timed)
        undo.append(lambda: setattr(owner, name, fn) if had else delattr(owner, name))

    wrap(eng, "decode", "Engine.decode")
    wrap(cuda_graph.DecodeGraph, "_replay", "DecodeGraph._replay")
    wrap(cuda_graph._Routes, "draw", "  routes.draw (before the launch)")
    wrap(cache_mod, "serve", "    handoff serve (CPU misses)")
    for c in eng.caches:
        wrap(c, "begin_pass", "  cache.begin_pass (before the launch)")
        wrap(c, "launched", "  cache.launched (during the pass)")
        wrap(c, "end_pass", "  cache.end_pass (after the output)")
    try:
        steps(n)
    finally:
        for u in reversed(undo):
            u()
    out = {k: v / n * 1e6 for k, v in spent.items()}
    launched = out.get("  cache.launched (during the pass)")
    if launched is not None:
        out["    launched less the answers (accounting)"] = launched - out.get("    handoff serve (CPU misses)", 0.0)
    print(f"host phases, µs per step ({n} steps):")
    for k, v in out.items():
        print(f"  {k:45s} {v:9.0f}")
    return out


def profile_prompts(a, torch, profile, activity, eng, rng, depth: int, mode: str) -> dict:
    """``-n`` evaluations of a ``--prefill``-token prompt after ``depth`` tokens (the sequence cut back
    to the depth after each), one warm-up first; the table per prompt token."""
    vocab = eng.gguf.config.n_vocab
    prompts = [rng.integers(0, vocab, a.prefill) for _ in range(a.n + 1)]

    def one(p) -> None:
        eng.eval(p)
        eng.kv.truncate(depth)

    one(prompts[0])  # warm-up: kernels loaded, scratch allocated
    with profile(activities=[activity.CUDA]) as prof:
        t0 = time.perf_counter()
        for p in prompts[1:]:
            one(p)
        wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in prompts[1:]:
        one(p)
    wall_plain = time.perf_counter() - t0
    if a.host_profile:
        import cProfile
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        for p in prompts[1:]:
            one(p)
        prof_host.disable()
        print(f"host profile of {a.n} prompts (cProfile; times inflated by its tracing):")
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(a.host_profile)
    return report(a, torch, prof, depth, f"prefill {a.prefill} (-ub {eng.n_ubatch})", wall, wall_plain,
                  n=a.n * a.prefill)


def report(a, torch, prof, depth: int, mode: str, wall: float, wall_plain: float, n: int | None = None,
           unit: str = "token") -> dict:
    """Print and return the kernel table of one profiled run (``n`` tokens, or steps with ``unit``
    "step"; default ``-n``)."""
    per: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name if a.by_name else kernel_class(ev.name)
            per[name].append(ev.time_range.elapsed_us())
    total = sum(sum(v) for v in per.values())
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))
    n = n or a.n
    u = unit
    print(f"\n{a.model.name}: {n} {u}s at depth {depth}, -c {a.c}, {mode}")
    print(f"wall {wall_plain / n * 1e6:.0f} µs/{u} ({n / wall_plain:.1f} {u}s/s); under the profiler "
          f"{wall / n * 1e6:.0f} µs/{u}; kernel time {total / n:.0f} µs/{u}; "
          f"{sum(len(v) for v in per.values()) / n:.0f} kernels/{u}")
    print(f"{'kernel':40s} {'per ' + u:>8s} {'µs/' + u:>9s} {'µs each':>9s} {'share':>6s}")
    out = []
    for name, ts in rows:
        s = sum(ts)
        out.append({"kernel": name, "per_token": len(ts) / n, "us_per_token": s / n, "us_each": s / len(ts),
                    "share": s / total})
        print(f"{name[:40]:40s} {len(ts) / n:8.1f} {s / n:9.1f} {s / len(ts):9.2f} {100 * s / total:5.1f}%")
    return {"model": a.model.name, "depth": depth, "n_ctx": a.c, "mode": mode, "unit": u,  # *_per_token: per unit
            "wall_us_per_token": wall_plain / n * 1e6, "kernel_us_per_token": total / n, "kernels": out}


if __name__ == "__main__":
    main()
