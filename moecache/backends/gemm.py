"""The prompt's tensor-core products: cuBLAS GEMMs of float16 operands into float32 results.

Prompt ubatches (more than :data:`~moecache.backends.ops.DECODE_MAX_TOKENS` tokens) dequantize a
weight to float16, round the activations to float16 and run ``cublasGemmStridedBatchedEx`` with
float16 A and B, a float32 C and float32 accumulation (``CUBLAS_COMPUTE_32F``): the tensor cores'
rate instead of FP32's (llama.cpp's cuBLAS path for quantized weights also feeds it float16). Each
product's rounding error is at most that of two float16 roundings per term (relative 2**-11
each) plus float32 accumulation. float16 holds magnitudes up to 65504: an activation beyond that
becomes inf (llama.cpp's MMQ kernels, its default for these formats, scale per block and do not
overflow); ``Engine(gpu_act_q8=False)`` keeps every product in float32.

cuBLAS is column-major; our arrays are row-major. A row-major (r, c) array is the column-major
(c, r) one, so ``Y = X @ W.T`` (row-major) is ``Y^T = W^T(op T) @ X^T`` in cuBLAS's terms.
:func:`rows_times_weights_t` builds that call's arguments; :func:`emulate` executes any
:class:`GemmCall` on flat host buffers with cuBLAS's column-major rules, the CPU twin that CI uses
to check the arguments (the GPU runs them through :func:`run`, which also takes float32 operands).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

OP_N, OP_T = 0, 1  # cublasOperation_t
CUDA_R_32F, CUDA_R_16F = 0, 2  # cudaDataType_t
CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t
CUBLAS_GEMM_DEFAULT = -1  # cublasGemmAlgo_t


@dataclass(frozen=True)
class GemmCall:
    """The shape arguments of one ``cublasGemmStridedBatchedEx``: for b < batch,
    ``C_b (m, n) = op(A_b) (m, k) @ op(B_b) (k, n)``, all column-major, where matrix b of A starts
    ``stride_a`` elements after matrix b - 1 (the same for B and C) and ``ld*`` are leading
    dimensions in elements."""
    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int


def rows_times_weights_t(batch: int, t: int, n_out: int, n_in: int) -> GemmCall:
    """``Y[b] = X[b] @ W[b].T`` for row-major C-contiguous X (batch, t, n_in), W (batch, n_out,
    n_in) and Y (batch, t, n_out), passed as A = W, B = X, C = Y. Raises ValueError for a
    dimension < 1."""
    if min(batch, t, n_out, n_in) < 1:
        raise ValueError(f"GEMM shape needs positive sizes, got batch {batch}, t {t}, n_out {n_out}, n_in {n_in}")
    return GemmCall(OP_T, OP_N, m=n_out, n=t, k=n_in, lda=n_in, ldb=n_in, ldc=n_out,
                    stride_a=n_out * n_in, stride_b=t * n_in, stride_c=t * n_out, batch=batch)


def _colmajor(flat: np.ndarray, offset: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The column-major (rows, cols) matrix with leading dimension ld at ``flat[offset:]``."""
    if ld < rows or offset + (cols - 1) * ld + rows > flat.size:
        raise ValueError(f"a ({rows}, {cols}) matrix with leading dimension {ld} at {offset} does not fit "
                         f"{flat.size} elements")
    s = flat.strides[0]
    return np.lib.stride_tricks.as_strided(flat[offset:], (rows, cols), (s, ld * s), writeable=False)


def emulate(call: GemmCall, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """Run ``call`` as cuBLAS would (alpha 1, beta 0) on flat 1-D host buffers, in float64:
    ``c`` (writable, any float dtype) receives the products. Raises ValueError when a matrix does
    not fit its buffer."""
    for i in range(call.batch):
        ra, ca = (call.m, call.k) if call.transa == OP_N else (call.k, call.m)
        rb, cb = (call.k, call.n) if call.transb == OP_N else (call.n, call.k)
        A = _colmajor(a, i * call.stride_a, ra, ca, call.lda).astype(np.float64)
        B = _colmajor(b, i * call.stride_b, rb, cb, call.ldb).astype(np.float64)
        prod = (A if call.transa == OP_N else A.T) @ (B if call.transb == OP_N else B.T)
        if call.ldc < call.m or i * call.stride_c + (call.n - 1) * call.ldc + call.m > c.size:
            raise ValueError("C does not fit its buffer")
        for j in range(call.n):
            o = i * call.stride_c + j * call.ldc
            c[o:o + call.m] = prod[:, j]


_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
_ONE_AT, _ZERO_AT = _ONE.ctypes.data, _ZERO.ctypes.data  # alpha and beta: host pointers, live as the arrays
_LIBS: list[Any] = []  # (cupy, its cublas module, {dtype: cudaDataType_t}) once imported


def _libs() -> tuple[Any, Any, dict]:
    if not _LIBS:
        import cupy as cp
        from cupy_backends.cuda.libs import cublas

        _LIBS.append((cp, cublas, {cp.dtype(cp.float16): CUDA_R_16F, cp.dtype(cp.float32): CUDA_R_32F}))
    return _LIBS[0]


def run(call: GemmCall, a: Any, b: Any, c: Any) -> None:
    """Run ``call`` on the current CUDA device and stream: ``a`` and ``b`` C-contiguous CuPy arrays,
    both float16 (tensor cores) or both float32, ``c`` a C-contiguous float32 CuPy array;
    accumulation in float32. Raises ValueError for other dtypes or arrays smaller than ``call``.
    A prompt ubatch runs a dozen of these per layer from the host, so the checks are plain
    attribute reads (the prompt with every expert on the GPU is host-bound)."""
    cp, cublas, types = _libs()
    ab = types.get(a.dtype)
    n = call.batch
    if (ab is None or b.dtype != a.dtype or c.dtype != cp.float32
            or not (a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous)
            or a.size < call.stride_a * n or b.size < call.stride_b * n or c.size < call.stride_c * n):
        raise ValueError(f"GEMM operands A {a.dtype} {a.shape}, B {b.dtype} {b.shape}, C {c.dtype} {c.shape} "
                         f"do not fit {call} (A and B C-contiguous float16 or float32, C float32)")
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, getattr(cublas, "CUBLAS_POINTER_MODE_HOST", 0))  # alpha, beta: host
    cublas.gemmStridedBatchedEx(
        handle, call.transa, call.transb, call.m, call.n, call.k, _ONE_AT,
        a.data.ptr, ab, call.lda, call.stride_a, b.data.ptr, ab, call.ldb, call.stride_b,
        _ZERO_AT, c.data.ptr, CUDA_R_32F, call.ldc, call.stride_c, n,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


__all__ = ["GemmCall", "emulate", "rows_times_weights_t", "run"]
