"""Prompt attention on the GPU: the tiled tensor-core kernel (``attn_prompt``) against the batched-matmul
path it replaced (float32 scores in chunks, :meth:`moecache.backends.ops.ArrayOps.attention`), one
layer of Qwen3-30B-A3B's shape (32 query heads, 4 KV heads, head 128, float16 cache), one ubatch of
``-ub`` queries ending at each context length.

    python bench/attn_prompt.py --ctx 512,4096,12620 -ub 512,2048
    python bench/attn_prompt.py --ctx 16384,65536 -ub 32     # a short turn deep in a long context

Prints µs per layer and the useful TFLOPS (causal: 4 * D * H * sum over queries of its keys), and the
largest difference of the two outputs. A short turn deep in a context is the kernel's weak case: its
grid is ceil(T / 64) x n_head blocks, each walking every key tile in turn (32 blocks for T <= 64).
Needs CuPy and a GPU.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    import cupy as cp

    from moecache.backends.cupy_backend import CupyBackend
    from moecache.backends.ops import ArrayOps

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="512,4096,12620", help="context lengths at the end of the ubatch")
    ap.add_argument("-ub", default="512,2048", help="queries per ubatch")
    ap.add_argument("--heads", default="32,4,128", help="n_head,n_head_kv,head_dim")
    ap.add_argument("-r", type=int, default=5, help="timed repetitions")
    a = ap.parse_args()
    h, h_kv, d = (int(x) for x in a.heads.split(","))
    be = CupyBackend()
    rng = np.random.default_rng(0)
    scale = 1 / np.sqrt(d)

    def timed(f) -> float:
        f()
        cp.cuda.Device().synchronize()
        ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
        ev0.record()
        for _ in range(a.r):
            f()
        ev1.record()
        ev1.synchronize()
        return cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / a.r

    print(f"{h} heads, {h_kv} KV heads, head {d}, float16 cache; {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for ctx in (int(x) for x in a.ctx.split(",")):
        for ub in (int(x) for x in a.ub.split(",")):
            if ub > ctx:
                continue
            pos0 = ctx - ub
            k = cp.asarray(rng.standard_normal((ctx, h_kv, d)), dtype=cp.float16)
            v = cp.asarray(rng.standard_normal((ctx, h_kv, d)), dtype=cp.float16)
            q = cp.asarray(rng.standard_normal((ub, h, d)), dtype=cp.float32)
            pos = cp.arange(pos0, ctx, dtype=cp.int32)
            tiled = timed(lambda: be.attention(q, k, v, pos, scale))
            old = timed(lambda: ArrayOps.attention(be, q, k, v, pos0, scale))
            diff = float(cp.abs(be.attention(q, k, v, pos, scale) - ArrayOps.attention(be, q, k, v, pos0, scale)).max())
            flop = 4.0 * d * h * (ub * pos0 + ub * (ub + 1) / 2)
            print(f"ctx {ctx:6d} -ub {ub:5d}: tiled {tiled:9.1f} us ({flop / tiled / 1e6:6.1f} TFLOPS), "
                  f"chunked float32 {old:9.1f} us ({flop / old / 1e6:6.1f}), {old / tiled:5.1f}x; max |diff| {diff:.1e}",
                  flush=True)
            del k, v, q


if __name__ == "__main__":
    main()
