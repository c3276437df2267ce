"""The decode products of Qwen3-30B-A3B's shapes on one GPU: µs per call and GB/s of weights read by
``gemvq_<fmt>`` / ``moeq_glu`` / ``moeq_down`` (8-bit activations) and the float32-activation
``gemv_<fmt>``, for builds with several MMVQ_UNROLL (launches replayed from a CUDA graph).

    python bench/gemv_variants.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from moecache.backends import cupy_backend as cb  # noqa: E402
from moecache.backends.numpy_backend import Linear  # noqa: E402
from moecache.moe.routing import Routing  # noqa: E402
from moecache.quants.formats import FORMATS  # noqa: E402
from moecache.quants.random_blocks import random_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_variants import timed  # noqa: E402


def main() -> None:
    rng = np.random.default_rng(0)
    shapes = [("Q8_0", 4096, 2048, "attn_q"), ("Q8_0", 512, 2048, "attn_k"), ("Q8_0", 2048, 4096, "attn_output"),
              ("Q8_0", 32000, 2048, "output"), ("Q4_K", 4096, 2048, "q4_k 4096x2048"),
              ("Q6_K", 4096, 2048, "q6_k 4096x2048"), ("F32", 128, 2048, "ffn_gate_inp")]
    mats = {name: (fmt, Linear(name, cp.asarray(random_rows(FORMATS[fmt], r, c, rng)), FORMATS[fmt].ggml_type, c))
            for fmt, r, c, name in shapes}
    x = cp.asarray(rng.standard_normal((1, 4096)).astype(np.float32))
    n_exp, ff, n_embd, k = 128, 768, 2048, 8
    q4 = FORMATS["Q4_K"]
    g = cp.asarray(np.stack([random_rows(q4, ff, n_embd, rng, std=0.05) for _ in range(n_exp)]))
    u = cp.asarray(np.stack([random_rows(q4, ff, n_embd, rng, std=0.05) for _ in range(n_exp)]))
    d = cp.asarray(np.stack([random_rows(q4, n_embd, ff, rng, std=0.05) for _ in range(n_exp)]))
    ids = cp.asarray(rng.choice(n_exp, (1, k), replace=False).astype(np.int32))
    wts = cp.asarray(np.full((1, k), 1 / k, np.float32))
    h = cp.asarray(rng.standard_normal((1, n_embd)).astype(np.float32))
    src_q = cb.QUANT_SRC.read_text() + "\n" + cb.MMVQ_SRC.read_text()
    for unroll in (1, 2, 4):
        be = cb.CupyBackend(act_q8=True)
        mod = cp.RawModule(code=src_q, options=("-std=c++17", f"-DMMVQ_UNROLL={unroll}"))
        be.__dict__["_modules"] = (mod, be._modules[1])  # the cached_property, replaced by this build
        print(f"MMVQ_UNROLL {unroll}")
        for name, (fmt, w) in mats.items():
            xi = x[:, :w.n_in].copy()
            us = timed(lambda: be.matmul(w, xi))  # noqa: B023
            print(f"  {name:18s} {fmt:5s} {us:7.2f} µs  {w.data.nbytes / us / 1e3:7.0f} GB/s")
        r = Routing(ids, wts)
        us = timed(lambda: be.moe_ffn(g, u, d, (q4.ggml_type,) * 3, r, h, "silu"))
        nbytes = k * (2 * g[0].nbytes + d[0].nbytes)
        print(f"  moe 8 experts (glu+down) {us:7.2f} µs  {nbytes / us / 1e3:7.0f} GB/s")
    be = cb.CupyBackend(act_q8=False)
    print("float32 activations (gemv_<fmt>)")
    for name, (fmt, w) in mats.items():
        xi = x[:, :w.n_in].copy()
        us = timed(lambda: be.matmul(w, xi))  # noqa: B023
        print(f"  {name:18s} {fmt:5s} {us:7.2f} µs  {w.data.nbytes / us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
