"""Device memory of a cache-on engine at ``--vram-budget``: after load, after one prompt ubatch and
after decoding, with CuPy's per-line allocation report for the prompt.

Shows what the placement planner's reserve must cover beyond the planned weights, KV cache and
expert slots: the CUDA context (before loading), kernel modules and cuBLAS (outside CuPy's pool)
and the transient blocks of a prompt ubatch (CuPy's pool total minus its used bytes).

    python bench/vram_peak.py -m /tmp/q30.gguf --vram-budget 8GiB --routing low-locality
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np


def main() -> None:
    import cupy as cp
    from cupy.cuda.memory_hooks import LineProfileHook

    from moecache.sizes import parse_size
    from moecache.engine import Engine, EngineConfig
    from moecache.moe.routing_process import make_routing
    from moecache.placement import PlacementOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default="low-locality")
    ap.add_argument("-p", type=int, default=111, help="prompt tokens (one ubatch)")
    ap.add_argument("-n", type=int, default=32, help="decoded tokens")
    ap.add_argument("-c", type=int, default=4096)
    ap.add_argument("-ctk", "--cache-type", default="f16")
    a = ap.parse_args()
    pool = cp.get_default_memory_pool()

    def report(tag: str) -> None:
        free, total = cp.cuda.runtime.memGetInfo()
        print(f"{tag}: device used {(total - free) >> 20} MiB, pool used {pool.used_bytes() >> 20} MiB, "
              f"pool total {pool.total_bytes() >> 20} MiB", flush=True)

    report("before loading (CUDA context)")
    with Engine(a.model, EngineConfig(n_ctx=a.c, cache_type=a.cache_type),
                placement=PlacementOptions(vram_budget=parse_size(a.vram_budget, "--vram-budget")),
                load_mode="pin", log=print) as eng:
        report("loaded")
        c = eng.gguf.config
        eng.model.routing_override = make_routing(a.routing, c.n_layer, c.n_expert, c.n_expert_used, seed=0)
        rng = np.random.default_rng(0)
        hook = LineProfileHook(max_depth=6)
        with hook:
            eng.eval(rng.integers(0, c.n_vocab, a.p))
        report(f"after pp{a.p}")
        out = io.StringIO()
        hook.print_report(file=out)
        print("\n".join(out.getvalue().splitlines()[:60]))
        for _ in range(a.n):
            eng.eval([int(rng.integers(0, c.n_vocab))])
        report(f"after {a.n} decoded tokens")
        pool.free_all_blocks()
        report("after returning CuPy's cached blocks")


if __name__ == "__main__":
    main()
