"""Decode attention on the GPU: time per layer call of ``CupyBackend.attention`` for one query at
several positions and KV cache sizes (float16 cache, Qwen3-30B-A3B's heads: 32 query heads, 4 KV
heads, head_dim 128). Each call is launched from Python, so below ~50 us per call this times the
launch, not the kernel.

    python bench/attention.py
"""

from __future__ import annotations

import numpy as np


def main() -> None:
    import cupy as cp

    from moecache.backends.cupy_backend import CupyBackend, att_splits

    be = CupyBackend(0)
    rng = np.random.default_rng(0)
    for n_ctx in (4096, 16384):
        k = cp.asarray(rng.standard_normal((n_ctx, 4, 128)).astype(np.float16))
        v = cp.asarray(rng.standard_normal((n_ctx, 4, 128)).astype(np.float16))
        q = cp.asarray(rng.standard_normal((1, 32, 128)).astype(np.float32))
        for p in (128, 512, 2048, 4000, 12620):
            if p >= n_ctx:
                continue
            pos = be.positions(np.array([p]))
            for _ in range(3):
                be.attention(q, k, v, pos, 0.088)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            for _ in range(200):
                be.attention(q, k, v, pos, 0.088)
            b.record()
            b.synchronize()
            print(f"n_ctx {n_ctx} ({att_splits(n_ctx)} key runs) pos {p}: "
                  f"{cp.cuda.get_elapsed_time(a, b) / 200 * 1e3:.1f} us per layer", flush=True)


if __name__ == "__main__":
    main()
