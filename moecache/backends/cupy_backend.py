"""GPU backend (first slice): the model's operations on CuPy arrays.

Weights are uploaded in their GGUF quant format and dequantized on the GPU by the CUDA kernels of
``moecache/quants/cuda/dequant.cu`` (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K; F16/BF16/F32 by array
conversion); a matmul dequantizes W to a float32 scratch matrix and calls cuBLAS (``x @ W.T``).
Other quant formats are dequantized once at load on the CPU and kept as float32 on the GPU (said
once per format). Up to 16 tokens, the same five formats use fused kernels that read the quantized
rows once (a warp per output row, no scratch matrix). This is the correct-first version of the GPU
runtime: faster GEMV (vectorized loads, integer dot products) and tensor-core prefill are the GPU
runtime issue's next steps.

Requires CuPy (``pip install -e '.[cuda]'``); importing this module without it raises ImportError.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import cupy as cp
import numpy as np

from moecache.backends.numpy_backend import Linear, NumpyBackend
from moecache.backends.ops import ArrayOps
from moecache.gguf_file import TensorView
from moecache.quants.formats import format_for

CUDA_SRC = Path(__file__).resolve().parents[1] / "quants" / "cuda" / "dequant.cu"
# format name -> (kernel name, weights per block, bytes per block)
KERNELS = {"Q8_0": ("deq_q8_0", 32, 34), "Q4_0": ("deq_q4_0", 32, 18), "Q5_0": ("deq_q5_0", 32, 22),
           "Q4_K": ("deq_q4_k", 256, 144), "Q6_K": ("deq_q6_k", 256, 210)}
THREADS = 128
GEMV_MAX_TOKENS = 16  # MAX_TOK of dequant.cu: fewer tokens use the fused kernels, more dequantize + cuBLAS
GEMV_ROWS_PER_BLOCK = 4  # warps (one output row each) per CUDA block


class CupyBackend(ArrayOps):
    """Array operations on one GPU (the current CuPy device).

    Args:
        log: where one-line notes go (formats without a GPU kernel); default: discard.
    """

    name = "cuda"
    xp = cp

    def __init__(self, log: Callable[[str], None] | None = None):
        self.log = log or (lambda s: None)
        self._noted: set[str] = set()
        self._cpu = NumpyBackend()

    @cached_property
    def _module(self) -> cp.RawModule:
        return cp.RawModule(code=CUDA_SRC.read_text(), options=("-std=c++17",))

    # ---- weights -------------------------------------------------------------------------------
    def linear(self, t: TensorView) -> Linear:
        """Upload a matrix (or stacked experts): raw blocks for formats with a kernel, float32 else."""
        fmt = format_for(t.ggml_type, t.name)
        if fmt.name == "F32":
            return Linear(t.name, cp.asarray(t.data.view(np.float32)), t.ggml_type, t.shape[-1])
        if fmt.name in KERNELS:
            return Linear(t.name, cp.asarray(t.data), t.ggml_type, t.shape[-1])
        if fmt.name not in self._noted:
            self._noted.add(fmt.name)
            self.log(f"note: no GPU kernel for {fmt.name} yet: its tensors are dequantized on the CPU at load "
                     f"and kept as float32 on the GPU")
        rows = t.data.reshape(-1, t.data.shape[-1])
        dense = self._cpu.dequantize_rows(rows, t.ggml_type, t.shape[-1], t.name)
        return Linear(t.name, cp.asarray(dense.reshape(*t.shape)), t.ggml_type, t.shape[-1])

    def vector(self, t: TensorView) -> cp.ndarray:
        """A 1-D tensor as float32 on the GPU."""
        return cp.asarray(self._cpu.vector(t))

    def asarray(self, a: np.ndarray) -> cp.ndarray:
        """Host array -> GPU array."""
        return cp.asarray(a)

    def to_host(self, a: cp.ndarray) -> np.ndarray:
        """GPU array -> numpy array (a device-to-host copy)."""
        return cp.asnumpy(a)

    # ---- operations ----------------------------------------------------------------------------
    def dequantize(self, w: Linear, rows: cp.ndarray | None = None) -> cp.ndarray:
        """float32 (n, n_in) of W's rows (all, or the uint8 block rows given)."""
        if w.is_f32:
            return w.data if rows is None else rows
        data = w.data if rows is None else rows
        name = format_for(w.ggml_type, w.name).name
        if name == "F16":
            return data.view(cp.float16).astype(cp.float32)
        if name == "BF16":
            return (data.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        kname, bs, tsz = KERNELS[name]
        n_rows, row_bytes = data.shape
        nb = w.n_in // bs
        out = cp.empty((n_rows, w.n_in), cp.float32)
        total = n_rows * nb
        kern = self._module.get_function(kname)
        kern(((total + THREADS - 1) // THREADS,), (THREADS,),
             (data, out, np.int64(n_rows), np.int64(row_bytes), np.int64(nb)))
        return out

    def matmul(self, w: Linear, x: cp.ndarray) -> cp.ndarray:
        """``x @ W.T``: float32 (T, n_in) -> (T, n_out). Up to GEMV_MAX_TOKENS tokens: a fused kernel
        reads the quantized rows once (one warp per row); more: dequantize W, then cuBLAS."""
        if w.is_f32:
            return x @ w.data.T
        name = format_for(w.ggml_type, w.name).name
        if x.shape[0] <= GEMV_MAX_TOKENS and name in KERNELS and w.data.ndim == 2:
            x = cp.ascontiguousarray(x, dtype=cp.float32)
            n_rows, row_bytes = w.data.shape
            y = cp.empty((x.shape[0], n_rows), cp.float32)
            kern = self._module.get_function("gemv_" + KERNELS[name][0].removeprefix("deq_"))
            kern(((n_rows + GEMV_ROWS_PER_BLOCK - 1) // GEMV_ROWS_PER_BLOCK,), (32 * GEMV_ROWS_PER_BLOCK,),
                 (w.data, x, y, np.int64(n_rows), np.int64(row_bytes), np.int64(w.n_in), np.int32(x.shape[0])))
            return y
        return x @ self.dequantize(w).T

    def embed(self, w: Linear, ids: np.ndarray) -> cp.ndarray:
        """Rows ``ids`` of an embedding matrix, dequantized: int (T,) -> float32 (T, n_in)."""
        idx = cp.asarray(np.asarray(ids, dtype=np.int64))
        return self.dequantize(w, w.data[idx]) if not w.is_f32 else w.data[idx]


__all__ = ["CupyBackend", "KERNELS"]


def available() -> tuple[bool, str]:
    """(True, device name) when a CUDA device answers, else (False, the reason)."""
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any CUDA error means no usable GPU
        return False, f"CUDA unavailable: {e}"
    if n == 0:
        return False, "no CUDA device"
    props: Any = cp.cuda.runtime.getDeviceProperties(0)
    return True, props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
