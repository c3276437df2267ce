"""Zero-copy microbenchmark: the MoE decode kernels (moe_glu + moe_down, Q4_K, one token) reading k
Qwen3-30B-A3B-shaped experts (2048 x 768, 2.65 MB) from page-locked host RAM over PCIe, next to the
same kernels reading them from VRAM, and a plain host-to-device copy for the link's DMA rate.

Each timed iteration uploads fresh expert ids from Python (a small synchronous copy) and launches
the two kernels, so the VRAM column is bound by that Python loop (~100 us), not by HBM; the
zero-copy column shows the PCIe read rate once it exceeds that. Run on the GPU machine:

    python bench/zero_copy.py

Results: bench/results/zero-copy-h200.txt.
"""
import time, numpy as np, cupy as cp, cupyx
from moecache.backends.cupy_backend import NULL, CupyBackend, WARPS_PER_BLOCK
from moecache.quants.formats import FORMATS
from moecache.quants.random_blocks import random_rows
be = CupyBackend(0)
fmt = FORMATS["Q4_K"]; E, ff, d = 64, 768, 2048
rng = np.random.default_rng(0)
g1 = random_rows(fmt, ff, d, rng); rb = g1.shape[1]
gate_h = cupyx.empty_pinned((E, ff, rb), np.uint8); up_h = cupyx.empty_pinned((E, ff, rb), np.uint8)
d1 = random_rows(fmt, d, ff, rng); rbd = d1.shape[1]
down_h = cupyx.empty_pinned((E, d, rbd), np.uint8)
for e in range(E):
    gate_h[e] = np.roll(g1, e, 0); up_h[e] = np.roll(g1, 2*e+1, 0); down_h[e] = np.roll(d1, e, 0)
gate_d, up_d, down_d = cp.asarray(gate_h), cp.asarray(up_h), cp.asarray(down_h)
eb = ff*rb*2 + d*rbd
print("expert MB", eb/1e6)
h = cp.asarray(rng.standard_normal((1, d)).astype(np.float32))
glu, down = be._fn("moe_glu_q4_k"), be._fn("moe_down_q4_k")
def run(src, k, reps=50):
    G, U, D = src
    ids = cp.asarray(rng.choice(E, k, replace=False).astype(np.int32)[None])
    w = cp.full((1, k), 1.0/k, cp.float32)
    a = cp.empty((k, ff), cp.float32); y = cp.empty((1, d), cp.float32)
    def once():
        glu(((ff + WARPS_PER_BLOCK - 1)//WARPS_PER_BLOCK, k), (32*WARPS_PER_BLOCK,), (G, U, ids, h, a, np.int32(k), np.int64(ff), np.int64(rb), np.int64(ff*rb), np.int64(d), np.int32(0), NULL, NULL, NULL, NULL, NULL))
        down(((d + WARPS_PER_BLOCK - 1)//WARPS_PER_BLOCK, 1), (32*WARPS_PER_BLOCK,), (D, ids, w, a, y, np.int32(k), np.int64(d), np.int64(rbd), np.int64(d*rbd), np.int64(ff), NULL, NULL, NULL))
    once(); cp.cuda.Device().synchronize()
    s, e_ = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        ids = cp.asarray(rng.choice(E, k, replace=False).astype(np.int32)[None])
        once()
    e_.record(); e_.synchronize()
    ms = cp.cuda.get_elapsed_time(s, e_)/reps
    return ms, y.get()
hp = tuple(np.uint64(x.ctypes.data) for x in (gate_h, up_h, down_h))
for k in (1, 2, 4, 8):
    ms_d, yd = run((gate_d, up_d, down_d), k)
    ms_h, yh = run(hp, k)
    print(f"k={k}: HBM {ms_d*1e3:7.1f} us ({k*eb/ms_d/1e6:6.1f} GB/s)  zero-copy {ms_h*1e3:7.1f} us ({k*eb/ms_h/1e6:6.1f} GB/s)")
# the expert cache's miss staging kernel (ops.cu stage_misses): k missed experts copied host -> VRAM,
# then the same MoE kernels reading them from the scratch (slot map all -1); ids fixed, timed as a
# loop of launch triples (comparable with the zero-copy column above)
stage = be._fn("stage_misses")
n_gu, n_d = ff * rb // 16, d * rbd // 16
for k in (1, 2, 4, 8):
    ids = cp.asarray(rng.choice(E, k, replace=False).astype(np.int32)[None])
    smap = cp.full(E, -1, cp.int32)
    sg, su, sd = cp.empty((k, ff, rb), cp.uint8), cp.empty((k, ff, rb), cp.uint8), cp.empty((k, d, rbd), cp.uint8)
    a = cp.empty((k, ff), cp.float32); y = cp.empty((1, d), cp.float32); w = cp.full((1, k), 1.0 / k, cp.float32)
    def staged():
        stage(((max(n_gu, n_d) + 4095) // 4096, k, 3), (256,), (ids, smap, *hp, sg, su, sd, np.int64(n_gu), np.int64(n_d), np.int64(4096)))
        glu(((ff + WARPS_PER_BLOCK - 1)//WARPS_PER_BLOCK, k), (32*WARPS_PER_BLOCK,), (gate_d, up_d, ids, h, a, np.int32(k), np.int64(ff), np.int64(rb), np.int64(ff*rb), np.int64(d), np.int32(0), smap, hp[0], hp[1], sg, su))
        down(((d + WARPS_PER_BLOCK - 1)//WARPS_PER_BLOCK, 1), (32*WARPS_PER_BLOCK,), (down_d, ids, w, a, y, np.int32(k), np.int64(d), np.int64(rbd), np.int64(d*rbd), np.int64(ff), smap, hp[2], sd))
    staged(); cp.cuda.Device().synchronize()
    s, e_ = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(50):
        staged()
    e_.record(); e_.synchronize()
    ms = cp.cuda.get_elapsed_time(s, e_) / 50
    ok = bool((sg.get() == gate_h[ids.get()[0]]).all() and (sd.get() == down_h[ids.get()[0]]).all())
    print(f"stage_misses k={k}: {ms*1e3:7.1f} us ({k*eb/ms/1e6:6.1f} GB/s), copies equal: {ok}")
# copy bandwidth for reference
buf = cp.empty(gate_h.nbytes, cp.uint8); s=time.perf_counter(); buf.set(gate_h.reshape(-1)); cp.cuda.Device().synchronize(); print("H2D copy GB/s", gate_h.nbytes/(time.perf_counter()-s)/1e9)
