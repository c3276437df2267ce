"""Write-combined page-locked memory for the experts in host RAM (issue 19, item 3), measured against
the ordinary page-locked memory that ``--load-mode pin`` allocates today.

For each kind of host buffer, k Qwen3-30B-A3B-shaped Q4_K experts (gate and up 768 x 2048, down
2048 x 768: 2.65 MB) per decode token go through the expert cache's own decode path,
``CupyBackend.moe_ffn_cached``, with every expert a miss:

- zero-copy: the MoE kernels read the experts in place over PCIe;
- staged: ``stage_misses`` first copies them into a VRAM scratch in 16-byte words.

The GPU reads of either path may gain from write-combined memory. The CPU path loses: the CPU's miss
kernels (the hybrid cache, ``--cpu-moe``) read host experts, and write-combined memory is uncached
for CPU reads. So the CPU's single-thread read rate of each buffer is measured too (numpy sum over
uint64 words).

Every timed token reads other experts: ``--reps`` id sets drawn up front, uploaded before the timing.
GB/s = k x expert bytes / time per token. The outputs of the two buffers are compared (the same
bytes, so the same results).

    python bench/zero_copy_wc.py [--experts 64] [--reps 50] [--k 1,2,4,8]

Needs CuPy and an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CUDA_HOST_ALLOC_MAPPED = 0x02  # cudaHostAllocMapped
CUDA_HOST_ALLOC_WRITE_COMBINED = 0x04  # cudaHostAllocWriteCombined


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64, help="experts per matrix in the host buffers")
    ap.add_argument("--reps", type=int, default=50, help="timed tokens per arm")
    ap.add_argument("--k", default="1,2,4,8", help="experts per token (all misses)")
    a = ap.parse_args()

    import cupy as cp
    import cupyx

    from moecache.backends.cupy_backend import CupyBackend
    from moecache.moe.routing import Routing
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    be = CupyBackend(0)
    fmt = FORMATS["Q4_K"]
    E, ff, d = a.experts, 768, 2048
    rng = np.random.default_rng(0)
    g1, d1 = random_rows(fmt, ff, d, rng), random_rows(fmt, d, ff, rng)
    shapes = [(E, ff, g1.shape[1]), (E, ff, g1.shape[1]), (E, d, d1.shape[1])]
    expert_bytes = sum(int(np.prod(s[1:])) for s in shapes)
    wc_ptrs: list[int] = []

    def wc_array(shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        ptr = cp.cuda.runtime.hostAlloc(n, CUDA_HOST_ALLOC_WRITE_COMBINED | CUDA_HOST_ALLOC_MAPPED)
        wc_ptrs.append(ptr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr)).reshape(shape)

    def filled(make) -> tuple[np.ndarray, ...]:
        out = tuple(make(s) for s in shapes)
        for e in range(E):  # distinct experts: rows rolled per expert
            out[0][e] = np.roll(g1, e, 0)
            out[1][e] = np.roll(g1, 2 * e + 1, 0)
            out[2][e] = np.roll(d1, e, 0)
        return out

    kinds = {"pinned": filled(lambda s: cupyx.empty_pinned(s, np.uint8)), "write-combined": filled(wc_array)}
    print(f"expert {expert_bytes / 1e6:.3f} MB (Q4_K, 768 x 2048 gate/up, 2048 x 768 down); {E} experts per buffer; "
          f"{a.reps} tokens per arm")
    for name, host in kinds.items():
        why = be.zero_copy_ok(list(host))
        print(f"{name}: zero_copy_ok -> {why or 'yes'}")

    pool = tuple(cp.zeros((1, *s[1:]), cp.uint8) for s in shapes)  # one slot, never mapped
    slot_map = cp.full(E, -1, cp.int32)
    types = (fmt.ggml_type,) * 3
    h = cp.asarray(rng.standard_normal((1, d)).astype(np.float32))
    ks = [int(x) for x in a.k.split(",")]
    results: dict[tuple[str, str, int], np.ndarray] = {}
    for k in ks:
        id_sets = [cp.asarray(rng.choice(E, k, replace=False).astype(np.int32)[None]) for _ in range(a.reps)]
        w = cp.full((1, k), 1.0 / k, cp.float32)
        scratch = tuple(cp.empty((k, *s[1:]), cp.uint8) for s in shapes)
        for name, host in kinds.items():
            for path, scr in (("zero-copy", None), ("staged", scratch)):
                def token(ids):
                    return be.moe_ffn_cached(pool, types, Routing(ids, w), h, "silu", slot_map, host, scr)
                results[(name, path, k)] = token(id_sets[0]).get()
                cp.cuda.Device().synchronize()
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                for ids in id_sets:
                    token(ids)
                e.record()
                e.synchronize()
                us = cp.cuda.get_elapsed_time(s, e) * 1e3 / a.reps
                print(f"k={k} {name:14s} {path:9s} {us:8.1f} us/token  {k * expert_bytes / us / 1e3:6.1f} GB/s", flush=True)
        same = all(np.array_equal(results[("pinned", p, k)], results[("write-combined", p, k)])
                   for p in ("zero-copy", "staged"))
        print(f"k={k}: outputs of the two buffers identical: {same}")

    for name, host in kinds.items():  # the CPU's read rate of each buffer (the CPU miss path reads these)
        buf = host[0].reshape(-1).view(np.uint64)
        buf.sum()
        t0 = time.perf_counter()
        buf.sum()
        dt = time.perf_counter() - t0
        print(f"CPU read (one thread, numpy sum) of the {name} gate buffer: {buf.nbytes / dt / 1e9:6.2f} GB/s")
    kinds.clear()
    for ptr in wc_ptrs:
        cp.cuda.runtime.freeHost(ptr)


if __name__ == "__main__":
    main()
