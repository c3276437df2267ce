"""The miss split's share swept by hand: decode speed at fixed CPU shares of each token's misses.

Loads the model as ``moecache bench`` does for an 8 GiB budget case (expert cache, page-locked
experts, ``--miss-split``), generates ``--warmup`` tokens, then for each arm pins every layer's share
(:meth:`moecache.moe.cache.CachedExperts.fix_split`: 0 = every miss read by the GPU over PCIe, k =
every miss on the CPU; ``auto`` = :class:`moecache.moe.handoff.SplitControl` refitting online from
a share of 0; ``keep`` = the last arm's shares, still refitting when that arm was ``auto``),
generates ``--settle`` tokens, then times ``-n`` one-token decode steps. Per arm: t/s, the hit rate,
the CPU's misses per token, the host's compute time per token (the Numba call inside the handoff's
answers, ``CachedExperts.cpu_s``) and the GPU's wait for those answers per token (the handoff's
``wait_ns``, summed over layers). ``--no-split`` loads without the split (one arm, ``off``): the
graph without the handoff's kernels, the baseline the shares are measured against. The OpenMP
wait policy is the ``moecache`` command's for the same flags (:func:`moecache.threads.openmp_wait_for_args`:
active waiting with the split; a user's ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins); until the
twenty-seventh session this script left libgomp's default spin instead.

    python bench/miss_split.py -m /tmp/q30.gguf --vram-budget 8GiB --routing uniform [--no-split]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("-n", type=int, default=128, help="timed decode steps per arm")
    ap.add_argument("--settle", type=int, default=32, help="untimed steps after each arm's share is set")
    ap.add_argument("--warmup", type=int, default=256, help="untimed steps after loading (the cache fills)")
    ap.add_argument("--shares", default="0,1,2,3,4,8,auto", help="arms: shares of each token's misses, or auto")
    ap.add_argument("-t", type=int, default=15)
    ap.add_argument("--no-split", action="store_true", help="load without --miss-split: one arm, off")
    ap.add_argument("--cache-plan", default="expert", choices=("expert", "layer"), help="layer: load with "
                    "--cache-plan layer instead of --miss-split (arms 'keep', or 'auto' after a fixed one: the plan's own shares)")
    ap.add_argument("--kernel-alone", type=int, default=0, help="after the arms: time this many CPU calls of one "
                    "layer's 8 (top_k) random experts for one token outside the decode step (moe_ffn_routed)")
    a = ap.parse_args()

    from moecache.threads import openmp_wait_for_args

    # the OpenMP wait policy the moecache command would give (active with --miss-split), before numba loads
    flag = ["--cache-plan", a.cache_plan] + ([] if a.no_split or a.cache_plan == "layer" else ["--miss-split"])
    print("OpenMP wait:", openmp_wait_for_args(flag + ["-t", str(a.t)]), file=sys.stderr)
    from moecache.cli.common import load_engine
    from moecache.settings import Settings
    from moecache.sizes import parse_size

    settings = Settings(n_ctx=a.warmup + len(a.shares.split(",")) * (a.settle + a.n) + 16, n_threads=a.t,
                        moe_cache=-1, vram_budget=parse_size(a.vram_budget, "--vram-budget"), load_mode="pin",
                        routing=a.routing, miss_split=not a.no_split and a.cache_plan == "expert",
                        cache_plan=a.cache_plan)
    eng = load_engine(a.model, settings, "bench").engine
    if not eng.caches:
        raise SystemExit("no expert cache (a GPU, a model bigger than --vram-budget): nothing to split")
    cache = eng.caches[0]
    rng = np.random.default_rng(0)
    vocab = eng.gguf.config.n_vocab

    def step() -> None:
        eng.eval([int(rng.integers(0, vocab))])

    eng.reset()
    for _ in range(a.warmup):
        step()
    arms = ["off"] if a.no_split else a.shares.split(",")
    for arm in arms:
        if arm not in ("off", "keep"):
            cache.fix_split(None if arm == "auto" else int(arm))
        for _ in range(a.settle):
            step()
        cache.flush()
        s0 = (cache.stats.hits, cache.stats.misses, cache.stats.cpu_misses)
        cpu0 = float(cache.cpu_s.sum())
        wait_ns = 0
        t0 = time.perf_counter()
        for _ in range(a.n):
            step()
            if cache.handoff is not None:
                wait_ns += int(cache.handoff.buf.wait_ns.sum())  # this pass's waits (every cached layer posts)
        dt = time.perf_counter() - t0
        cache.flush()
        hits, misses, cpu_m = (x - y for x, y in zip((cache.stats.hits, cache.stats.misses, cache.stats.cpu_misses), s0))
        row = {"routing": a.routing, "arm": arm, "tg_ts": round(a.n / dt, 2), "ms_per_token": round(1e3 * dt / a.n, 3),
               "hit_rate": round(hits / max(1, hits + misses), 4), "misses_per_token": round(misses / a.n, 1),
               "cpu_misses_per_token": round(cpu_m / a.n, 1),
               "host_compute_ms_per_token": round(1e3 * (float(cache.cpu_s.sum()) - cpu0) / a.n, 3),
               "gpu_wait_ms_per_token": round(wait_ns / 1e6 / a.n, 3),
               "ncpu_mean": None if cache.split is None else round(float(cache.split.ncpu.mean()), 2),
               "cpu_layers": None if cache.split is None else int((cache.split.ncpu > 0).sum())}
        print(json.dumps(row), flush=True)
    if a.kernel_alone:
        from moecache.quants import cpu

        il = min(cache.cached_layers)
        e = cache.layers[il]
        k = eng.gguf.config.n_expert_used
        h = rng.standard_normal((1, e.down.shape[1])).astype(np.float32)
        out = np.zeros_like(h)
        times = []
        for _ in range(a.kernel_alone):
            ids = rng.choice(e.gate.shape[0], (1, k), replace=False).astype(np.int32)
            w = np.full((1, k), 1.0 / k, np.float32)
            t0 = time.perf_counter()
            cpu.moe_ffn_routed(e.gate, e.up, e.down, e.types, ids, w, h, out, cpu.ACT_SILU, cache.act_q8)
            times.append(time.perf_counter() - t0)
        t = np.array(times[len(times) // 4:]) * 1e6
        print(json.dumps({"kernel_alone_us_median": round(float(np.median(t)), 1), "p10": round(float(np.percentile(t, 10)), 1),
                          "p90": round(float(np.percentile(t, 90)), 1), "experts": k}), flush=True)


if __name__ == "__main__":
    main()
