"""CPU kernels (Numba): ``Y = X @ W.T`` straight from GGUF blocks, dequantization, and the grouped
MoE expert kernel that is the expert cache's miss path.

Structure (the pattern that compiled well in Numba, ../shared/style.md): a ``prange`` driver over
chunks of output rows calls a serial row-range kernel; the row-range kernel dequantizes one block of
one row into a small float32 scratch (``deq_block``, inlined per format) and dots it with every
token's slice of X, so each weight byte is read once per call whatever the number of tokens.
One token (decode) takes another road for Q4_0, Q8_0, Q4_K, Q5_K and Q6_K: the fused block dots of
:mod:`moecache.quants.dots` multiply the quantized bytes into x with no scratch round trip
(``dot_step``); a row with an infinite or NaN scale field falls back to the dequantize path, whose
NaN/inf pattern is gguf-py's. Several tokens dequantize a row's full steps into a row scratch and
dot it with four tokens per pass.
``moe_ffn(act_q8=True)`` rounds the activations to 8 bits first and takes the integer Q8_0, Q4_K,
Q5_K and Q6_K dots of :mod:`moecache.quants.int_dots` (``rows_q8``).
All kernels are ``nogil`` (the hybrid executor runs them beside the GPU) and cached on disk.

Shapes and dtypes:
    W: uint8 (n_out, row_bytes), a row-major GGUF tensor's bytes (rows = output features).
    X: float32 (n_tokens, n_in) or (n_in,).   Y: float32 (n_tokens, n_out) or (n_out,).
"""

from __future__ import annotations

import functools

from moecache.quants import _numba_setup  # noqa: F401  (must run before numba compiles)

import numba
import numpy as np
from numba import errors, njit, prange
from numba import types as nb_types
from numba.extending import overload

from moecache.quants.blocks32 import (deq_bf16, deq_f16, deq_f32, deq_iq4_nl, deq_mxfp4, deq_q4_0,
                                      deq_q4_1, deq_q5_0, deq_q5_1, deq_q8_0)
from moecache.quants.blocks256 import deq_iq4_xs, deq_q2_k, deq_q3_k, deq_q4_k, deq_q5_k, deq_q6_k
from moecache.quants.dots import DOTS
from moecache.quants.formats import BY_TYPE, FORMATS, BlockFormat, format_for
from moecache.quants.int_dots import ROW_DOTS, finite_f32, prefetcher_for, quantize_row

_KERNEL = dict(cache=True, nogil=True, fastmath=True)
_INLINE = dict(inline="always", **_KERNEL)

# Activations of the gated FFN (the `act` argument of moe_ffn).
ACT_SILU = 0   # SwiGLU: silu(gate) * up (qwen, mixtral, olmoe, deepseek)
ACT_GELU = 1   # GeGLU with tanh-approximated GELU (gemma)

STEP = 256  # weights dequantized per inner step: one dot-product reduction per 256 weights


# The block decoder of every format in formats.FORMATS (one entry per table row).
_DEQ = {
    "F32": deq_f32, "F16": deq_f16, "BF16": deq_bf16, "Q4_0": deq_q4_0, "Q4_1": deq_q4_1,
    "Q5_0": deq_q5_0, "Q5_1": deq_q5_1, "Q8_0": deq_q8_0, "IQ4_NL": deq_iq4_nl, "MXFP4": deq_mxfp4,
    "Q2_K": deq_q2_k, "Q3_K": deq_q3_k, "Q4_K": deq_q4_k, "Q5_K": deq_q5_k, "Q6_K": deq_q6_k,
    "IQ4_XS": deq_iq4_xs,
}
assert set(_DEQ) == set(FORMATS), "every format in formats.FORMATS needs a block decoder"


def _literal_format(fmt) -> BlockFormat:
    if not isinstance(fmt, nb_types.IntegerLiteral):
        raise errors.TypingError("the format id must be a compile-time constant")
    return BY_TYPE[fmt.literal_value]


def deq_block(fmt, blk, out, outu, ob):
    """Dequantize one block of GGML type id ``fmt`` (a compile-time constant) into ``out``:
    32-weight formats write ``out[ob:ob + 32]``, the 256-weight formats ``out[0:256]``.
    Callable from Numba code only."""
    raise NotImplementedError("deq_block is only callable from Numba code")


@overload(deq_block, inline="always")
def _deq_block_impl(fmt, blk, out, outu, ob):
    # Resolved at compile time: only this format's decoder is inlined (a runtime switch over all
    # 16 cost ~12 s of compile time per kernel, and ~3x speed in the inner loop).
    f = _literal_format(fmt)
    deq = _DEQ[f.name]
    if f.block_size == 256:
        return lambda fmt, blk, out, outu, ob: deq(blk, out, outu)
    return lambda fmt, blk, out, outu, ob: deq(blk, out, outu, ob)


def dot_step(fmt, row, o, x, xb, xs, sb, n32):
    """``x[xb:xb + 256] · dequantize(row)`` for the 256 weights (one step) whose blocks start at byte
    ``o`` of ``row``, with the fused dot of GGML type id ``fmt`` (a compile-time constant; see
    :mod:`moecache.quants.dots`); 0 for a format without one. Callable from Numba code only."""
    raise NotImplementedError("dot_step is only callable from Numba code")


# Fused float dots that take no software prefetch: on the H200 machine Q8_0's one-token rows read
# 79.4-79.6 GB/s without it (bench/results/kernels-h200-cpu-dots.md, kernels-h200-cpu-q8.md) and
# 44.3 GB/s with it (kernels-h200-prefetch.md); its hardware prefetch already kept up there.
FLOAT_DOTS_WITHOUT_PREFETCH = frozenset({"Q8_0"})


@overload(dot_step, inline="always")
def _dot_step_impl(fmt, row, o, x, xb, xs, sb, n32):
    f = _literal_format(fmt)
    if f.name not in DOTS:  # typed but never run: the row kernel only calls it for DOTS formats
        return lambda fmt, row, o, x, xb, xs, sb, n32: np.float32(0.0)
    dot = DOTS[f.name][0]
    if f.name in FLOAT_DOTS_WITHOUT_PREFETCH:
        return lambda fmt, row, o, x, xb, xs, sb, n32: dot(row, o, x, xb, xs, sb, n32)
    prefetch = prefetcher_for(STEP // f.block_size * f.type_size)

    def impl(fmt, row, o, x, xb, xs, sb, n32):
        prefetch(row, o)  # the step PREFETCH_BYTES ahead: see moecache.quants.int_dots
        return dot(row, o, x, xb, xs, sb, n32)

    return impl


def step_nonfinite(fmt, row, o):
    """1 if a scale field of the step at byte ``o`` of ``row`` is infinite or NaN, else 0 (formats
    with a fused dot; 0 for the others). Callable from Numba code only."""
    raise NotImplementedError("step_nonfinite is only callable from Numba code")


@overload(step_nonfinite, inline="always")
def _step_nonfinite_impl(fmt, row, o):
    f = _literal_format(fmt)
    if f.name not in DOTS:
        return lambda fmt, row, o: np.int32(0)
    test = DOTS[f.name][1]
    return lambda fmt, row, o: test(row, o)


def kernel_block(fmt: BlockFormat) -> tuple[int, int]:
    """(weights, bytes) of the block the kernels decode at a time: the format's block, or 32
    elements for the plain float formats."""
    if fmt.float_elems is not None:
        return 32, 32 * fmt.type_size
    return fmt.block_size, fmt.type_size


@njit(**_INLINE)
def _dot_tokens(buf, n, X, t0, base, acc):
    """``acc[t] += buf[:n] @ X[t0 + t, base:base + n]`` for every token t of ``acc``: four tokens
    per pass over ``buf`` (one load of buf feeds four products)."""
    nt = acc.shape[0]
    t = 0
    while t + 4 <= nt:
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for i in range(n):
            w = buf[i]
            s0 += w * X[t0 + t, base + i]
            s1 += w * X[t0 + t + 1, base + i]
            s2 += w * X[t0 + t + 2, base + i]
            s3 += w * X[t0 + t + 3, base + i]
        acc[t] += s0
        acc[t + 1] += s1
        acc[t + 2] += s2
        acc[t + 3] += s3
        t += 4
    for u in range(t, nt):
        s = np.float32(0.0)
        for i in range(n):
            s += buf[i] * X[t0 + u, base + i]
        acc[u] += s


@njit(**_KERNEL)
def _dot_tokens2(b0, b1, n, X, t0, acc0, acc1):
    """``acc0[t] += b0[:n] @ X[t0 + t, :n]`` and ``acc1[t] += b1[:n] @ X[t0 + t, :n]`` for every
    token t: two rows and four tokens per pass (each load of a token's activations feeds both rows,
    each load of a row's weights four tokens). Not inlined: one compilation serves every format's
    row kernel."""
    nt = acc0.shape[0]
    t = 0
    while t + 4 <= nt:
        s00 = np.float32(0.0)
        s01 = np.float32(0.0)
        s02 = np.float32(0.0)
        s03 = np.float32(0.0)
        s10 = np.float32(0.0)
        s11 = np.float32(0.0)
        s12 = np.float32(0.0)
        s13 = np.float32(0.0)
        for i in range(n):
            w0 = b0[i]
            w1 = b1[i]
            x0 = X[t0 + t, i]
            x1 = X[t0 + t + 1, i]
            x2 = X[t0 + t + 2, i]
            x3 = X[t0 + t + 3, i]
            s00 += w0 * x0
            s01 += w0 * x1
            s02 += w0 * x2
            s03 += w0 * x3
            s10 += w1 * x0
            s11 += w1 * x1
            s12 += w1 * x2
            s13 += w1 * x3
        acc0[t] += s00
        acc0[t + 1] += s01
        acc0[t + 2] += s02
        acc0[t + 3] += s03
        acc1[t] += s10
        acc1[t + 1] += s11
        acc1[t + 2] += s12
        acc1[t + 3] += s13
        t += 4
    for u in range(t, nt):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        for i in range(n):
            x = X[t0 + u, i]
            s0 += b0[i] * x
            s1 += b1[i] * x
        acc0[u] += s0
        acc1[u] += s1


def _make_rows_kernel(fmt: BlockFormat):
    """The serial row-range kernel of one format: ``Y[t, r] = X[t] @ W[r]`` for r in [r0, r1),
    t in [t0, t1).

    W: read-only uint8 (n_rows, row_bytes); X: float32 (n_tok, n_in); Y: float32 (n_tok, >= r1).
    Rows are walked in steps of 256 weights (8 blocks of the 32-weight formats): one dot-product
    reduction per 256 weights; a row tail shorter than 256 is walked block by block. Each
    dequantized step is dotted with every token, so W is read once whatever the token count.
    """
    FMT = fmt.ggml_type
    BS, TSZ = kernel_block(fmt)
    G = STEP // BS
    FUSED = fmt.name in DOTS

    def deq_rows(W, r, n, out, outu, n_full, nbuf):
        """The full steps of rows r .. r + n - 1, dequantized one row after another into out (a
        function of its own: inlining the decoder a third time into rows_kernel trips Numba's
        pedantic IR check, NumbaIRAssumptionWarning)."""
        for i in range(n):
            row = W[r + i]
            for b in range(n_full):
                o = b * G * TSZ
                at = (i * n_full + b) * nbuf
                rb = out[at:at + nbuf]
                rbu = outu[at:at + nbuf]
                for k in range(G):
                    deq_block(FMT, row[o + k * TSZ:o + (k + 1) * TSZ], rb, rbu, k * BS)

    deq_rows = _jit(deq_rows, f"deq_rows_{fmt.name.lower()}")

    def rows_kernel(W, X, XS, Y, r0, r1, t0, t1, nbuf):
        buf = np.empty(nbuf, np.float32)  # nbuf == STEP, passed at run time (see _common.trip32)
        bufu = buf.view(np.uint32)
        n_tok = t1 - t0
        n_full = X.shape[1] // STEP
        n_tail = (X.shape[1] - n_full * STEP) // BS
        fused = FUSED and n_tok == 1
        n32 = nbuf >> 3
        acc = np.empty(n_tok, np.float32)
        # several tokens: the row's full steps are dequantized into rbuf, then dotted with each
        # token in one pass (one reduction per row and token)
        rbuf = np.empty(n_full * nbuf, np.float32)
        rbufu = rbuf.view(np.uint32)
        r_single = r0
        if not fused and n_tail == 0 and r1 - r0 > 1:
            # several tokens, rows in pairs: each token's activations are loaded once for two rows
            # (1.2x at 8 tokens on one core; bench/kernels.py)
            pair = np.empty(2 * n_full * nbuf, np.float32)
            pairu = pair.view(np.uint32)
            acc2 = np.empty(n_tok, np.float32)
            r_single = r0 + (r1 - r0) // 2 * 2
            for r in range(r0, r_single, 2):
                deq_rows(W, r, 2, pair, pairu, n_full, nbuf)
                acc[:] = 0.0
                acc2[:] = 0.0
                _dot_tokens2(pair[:n_full * nbuf], pair[n_full * nbuf:], n_full * STEP, X, t0, acc, acc2)
                for t in range(n_tok):
                    Y[t0 + t, r] = acc[t]
                    Y[t0 + t, r + 1] = acc2[t]
        for r in range(r_single, r1):
            row = W[r]
            acc[:] = 0.0
            slow = not fused
            if fused:
                a = np.float32(0.0)
                bad = np.int32(0)
                for b in range(n_full):
                    a += dot_step(FMT, row, b * G * TSZ, X[t0], b * STEP, XS[t0], b * (STEP // 32), n32)
                    bad |= step_nonfinite(FMT, row, b * G * TSZ)
                # an infinite or NaN scale: the row takes the per-weight path (see dots.DOTS)
                slow = bad != 0
                if not slow:
                    acc[0] = a
            if slow:
                for b in range(n_full):
                    o = b * G * TSZ
                    rb = rbuf[b * STEP:(b + 1) * STEP]
                    rbu = rbufu[b * STEP:(b + 1) * STEP]
                    for k in range(G):
                        deq_block(FMT, row[o + k * TSZ:o + (k + 1) * TSZ], rb, rbu, k * BS)
                _dot_tokens(rbuf, n_full * STEP, X, t0, 0, acc)
            for b in range(n_tail):
                o = (n_full * G + b) * TSZ
                deq_block(FMT, row[o:o + TSZ], buf, bufu, 0)
                _dot_tokens(buf, BS, X, t0, n_full * STEP + b * BS, acc)
            for t in range(n_tok):
                Y[t0 + t, r] = acc[t]

    return _jit(rows_kernel, f"rows_{fmt.name.lower()}")


def _jit(fn, name: str, parallel: bool = False):
    # Every kernel factory closes over plain ints only (pickled into Numba's cache key) and gets a
    # distinct name, so each specialization has its own on-disk cache entry.
    fn.__name__ = fn.__qualname__ = name
    return njit(parallel=parallel, **_KERNEL)(fn)


_ROWS = {name: _make_rows_kernel(f) for name, f in FORMATS.items()}


def rows_for(fmt, W, X, XS, Y, r0, r1, t0, t1, nbuf):
    """``Y[t, r] = X[t] @ W[r]`` for r in [r0, r1), t in [t0, t1) with the row kernel of GGML type
    ``fmt`` (a compile-time constant); ``XS`` = :func:`block_sums` of X; ``nbuf`` must be STEP.
    Callable from Numba code only."""
    raise NotImplementedError("rows_for is only callable from Numba code")


@overload(rows_for)
def _rows_for_impl(fmt, W, X, XS, Y, r0, r1, t0, t1, nbuf):
    kernel = _ROWS[_literal_format(fmt).name]
    return lambda fmt, W, X, XS, Y, r0, r1, t0, t1, nbuf: kernel(W, X, XS, Y, r0, r1, t0, t1, nbuf)


@njit(**_KERNEL)
def block_sums(X):
    """float32 (n_tok, n_in // 32): the sums of X's (n_tok, n_in) rows per 32 values (the fused
    dots' ``xs``: the min term of Q4_K/Q5_K weights is multiplied by them)."""
    n_tok, n_in = X.shape
    nb = n_in // 32
    XS = np.empty((n_tok, nb), np.float32)
    for t in range(n_tok):
        for b in range(nb):
            a = np.float32(0.0)
            for i in range(32):
                a += X[t, b * 32 + i]
            XS[t, b] = a
    return XS


@functools.cache
def _matmul_kernel(ggml_type: int):
    FMT = ggml_type

    def matmul_kernel(W, X, Y, chunk, nbuf):
        n = W.shape[0]
        n_chunks = (n + chunk - 1) // chunk
        XS = block_sums(X)
        for c in prange(n_chunks):
            rows_for(FMT, W, X, XS, Y, c * chunk, min(n, (c + 1) * chunk), 0, X.shape[0], nbuf)

    return _jit(matmul_kernel, f"matmul_{BY_TYPE[FMT].name.lower()}", parallel=True)


@functools.cache
def _dequant_kernel(ggml_type: int):
    FMT = ggml_type
    BS, TSZ = kernel_block(BY_TYPE[FMT])

    def dequant_kernel(W, Out, nbuf):
        nb = W.shape[1] // TSZ
        for r in prange(W.shape[0]):
            buf = np.empty(nbuf, np.float32)
            bufu = buf.view(np.uint32)
            for b in range(nb):
                deq_block(FMT, W[r, b * TSZ:(b + 1) * TSZ], buf, bufu, 0)
                for i in range(BS):
                    Out[r, b * BS + i] = buf[i]

    return _jit(dequant_kernel, f"dequant_{BY_TYPE[FMT].name.lower()}", parallel=True)


def _chunk(n_rows: int) -> int:
    # Enough chunks that every thread gets several (load balance), few enough that each chunk
    # amortises its scratch set-up.
    per = n_rows // (4 * numba.get_num_threads())
    return int(max(1, min(64, per)))


def _check_out(out: np.ndarray, shape: tuple[int, ...]) -> None:
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape \
            or not out.flags.c_contiguous or not out.flags.writeable:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"out must be a writable C-contiguous float32 array of shape {shape}, got {got}")


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``: weights from a file mapping are read-only, and handing the
    kernels one array type means one compiled specialization."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def _check_weights(W: np.ndarray, ggml_type: int, n_in: int, name: str | None) -> BlockFormat:
    fmt = format_for(ggml_type, name)
    bs, tsz = kernel_block(fmt)
    if n_in % bs:
        raise ValueError(f"{name or fmt.name}: n_in={n_in} is not a multiple of {bs}")
    if W.dtype != np.uint8 or W.ndim != 2 or W.shape[1] != n_in // bs * tsz:
        raise ValueError(f"{name or fmt.name}: expected uint8 weights of shape (n_out, {n_in // bs * tsz}), "
                         f"got {W.dtype} {W.shape}")
    return fmt


def matmul(W: np.ndarray, ggml_type: int, x: np.ndarray, out: np.ndarray | None = None,
           name: str | None = None) -> np.ndarray:
    """``y = W @ x`` for a quantized GGUF matrix W, on all Numba threads.

    Args:
        W: uint8 (n_out, row_bytes) raw tensor bytes (a gguf-py ``tensor.data`` view works as is;
            for F32/F16/BF16 tensors pass ``data.view(np.uint8)``).
        ggml_type: GGML type id of W (``gguf.GGMLQuantizationType``).
        x: float32 (n_in,) or (n_tokens, n_in).
        out: optional float32 (n_out,) or (n_tokens, n_out) output buffer.
        name: tensor name, used in error messages.

    Returns:
        float32 (n_out,) or (n_tokens, n_out).

    Raises:
        UnsupportedQuantError: the type has no kernel. ValueError: inconsistent shapes.
    """
    W = readonly(np.ascontiguousarray(W))
    X = np.ascontiguousarray(x, dtype=np.float32)
    vec = X.ndim == 1
    X2 = X.reshape(1, -1) if vec else X
    fmt = _check_weights(W, ggml_type, X2.shape[1], name)
    n_out = W.shape[0]
    if out is None:
        Y = np.empty((X2.shape[0], n_out), np.float32)
    else:
        _check_out(out, (n_out,) if vec else (X2.shape[0], n_out))
        Y = out.reshape(X2.shape[0], n_out)
    _matmul_kernel(fmt.ggml_type)(W, X2, Y, _chunk(n_out), STEP)
    return Y.reshape(n_out) if vec else Y


def dequantize(W: np.ndarray, ggml_type: int, n_in: int, name: str | None = None) -> np.ndarray:
    """Dequantize a GGUF matrix: uint8 (n_out, row_bytes) -> float32 (n_out, n_in), all threads."""
    W = readonly(np.ascontiguousarray(W))
    fmt = _check_weights(W, ggml_type, n_in, name)
    out = np.empty((W.shape[0], n_in), np.float32)
    _dequant_kernel(fmt.ggml_type)(W, out, STEP)
    return out


@njit(cache=True, nogil=True, fastmath=False, error_model="numpy")
def _activate_rows(act, G, U, p0, p1, f0, f1):
    """``G[p, f] = act(G[p, f]) * U[p, f]`` for p in [p0, p1), f in [f0, f1): SiLU (act 0) or GELU's
    tanh approximation (Hendrycks & Gimpel 2016, as ggml_gelu). Compiled without fastmath, as a
    function of its own: a product that overflows must reach
    :func:`~moecache.quants.int_dots.quantize_row`'s check as an inf, which an instruction flagged
    no-inf (the kernels' fastmath) would not guarantee (``fastmath=False`` spelled out: Numba
    compiles a callee without the option with its first caller's flags; so compiled, its
    zero-division branch raised ZeroDivisionError on a NaN gate). IEEE division
    (``error_model="numpy"``): no such branch at all."""
    c = np.float32(0.7978845608028654)
    for p in range(p0, p1):
        for f in range(f0, f1):
            g = G[p, f]
            if act == 0:
                G[p, f] = g / (np.float32(1.0) + np.exp(-g)) * U[p, f]
            else:
                G[p, f] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g))) \
                    * U[p, f]


def rows_q8(fmt, W, Q, D, S, qrow, X, XS, Y, r0, r1, p0, p1, nbuf, bad):
    """``Y[p, r] = W[r] · a_p`` for r in [r0, r1), p in [p0, p1), the activations rounded to 8 bits:
    a format of :data:`moecache.quants.int_dots.ROW_DOTS` (GGML type id ``fmt``, a compile-time
    constant) takes its integer dot with row ``qrow[p]`` of ``Q``, ``D``, ``S``
    (:func:`moecache.quants.int_dots.quantize_row`), row by row for each pair (the row stays in L1
    for the next); a dot that is not finite (an infinite or NaN scale field, of the weights or of an
    activation unit, always makes it so; an overflow may) sets ``bad[p] = 1`` (int32, per pair) and
    is stored as it is. The other formats take the float kernel (:func:`rows_for`) on the rounded
    values ``X`` (pair p's in row p) and their block sums ``XS``. Callable from Numba code only."""
    raise NotImplementedError("rows_q8 is only callable from Numba code")


@overload(rows_q8)
def _rows_q8_impl(fmt, W, Q, D, S, qrow, X, XS, Y, r0, r1, p0, p1, nbuf, bad):
    f = _literal_format(fmt)
    kernel = _ROWS[f.name]
    if f.name not in ROW_DOTS:
        return lambda fmt, W, Q, D, S, qrow, X, XS, Y, r0, r1, p0, p1, nbuf, bad: \
            kernel(W, X, XS, Y, r0, r1, p0, p1, nbuf)
    dot = ROW_DOTS[f.name]

    def impl(fmt, W, Q, D, S, qrow, X, XS, Y, r0, r1, p0, p1, nbuf, bad):
        for r in range(r0, r1):
            row = W[r]
            for p in range(p0, p1):
                q = qrow[p]
                y = dot(row, Q[q], D[q], S[q])
                Y[p, r] = y
                if not finite_f32(y):  # (integer bits: np.isfinite is True under fastmath)
                    bad[p] = 1
    return impl


@njit(**_KERNEL)
def _group_pairs(ids, idw, n_exp):
    """The (token, expert) pairs of ``ids`` int32 (T, k) (negative: no pair) grouped by expert, as
    :func:`moe_ffn` takes them: ``(expert_ids, offsets, token_rows, weights)`` with experts in
    increasing order and tokens increasing within a group (``Routing.groups``' order, by a counting
    sort), and 0; or empty arrays and 1 + the flat index of the first id >= n_exp."""
    T, K = ids.shape
    counts = np.empty(n_exp, np.int32)
    for e in range(n_exp):
        counts[e] = 0
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            if e >= n_exp:
                return (np.empty(0, np.int32), np.empty(1, np.int32), np.empty(0, np.int32),
                        np.empty(0, np.float32), t * K + j + 1)
            if e >= 0:
                counts[e] += 1
    n_groups = 0
    for e in range(n_exp):
        if counts[e]:
            n_groups += 1
    eids = np.empty(n_groups, np.int32)
    offs = np.empty(n_groups + 1, np.int32)
    nxt = np.empty(n_exp, np.int32)
    offs[0] = 0
    g = 0
    for e in range(n_exp):
        if counts[e]:
            eids[g] = e
            nxt[e] = offs[g]
            offs[g + 1] = offs[g] + counts[e]
            g += 1
    n_pairs = offs[n_groups]
    rows = np.empty(n_pairs, np.int32)
    wts = np.empty(n_pairs, np.float32)
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            if e >= 0:
                p = nxt[e]
                rows[p] = t
                wts[p] = idw[t, j]
                nxt[e] = p + 1
    return eids, offs, rows, wts, 0


@functools.cache
def _moe_kernel(fg: int, fu: int, fd: int, q8: bool):
    """The grouped MoE kernel of one (gate, up, down) format triple, one call per MoE layer:
    a serial prologue (the pairs grouped by expert when ``grouped`` is False, the scratch, ``q8``'s
    rounding of h), then two parallel regions. ``q8``: the activations rounded to 8 bits per 32
    values (h in the prologue; the gated activations by each phase-1 job, its own 32-value units)
    and every product through :func:`rows_q8`; a pair whose gate or up dot is not finite gives NaN
    in all of its token's outputs, a non-finite down dot NaN in that output. Returns 0, or 1 + the
    flat index of an expert id out of range (``grouped`` False). ``nt``: the threads
    (``numba.get_num_threads()``, passed in: that call inside the kernel would keep it out of the
    on-disk cache). The prologue's loops are plain ``range`` loops: an array expression there would
    become a parallel region of its own (a fork and join)."""
    FG, FU, FD, Q8 = fg, fu, fd, q8

    def moe_kernel(Wg, Wu, Wd, grouped, eids_in, offs_in, rows_in, wts_in, ids, idw, H, act, Out, nbuf, nt):
        if grouped:
            eids, offs, rows, wts = eids_in, offs_in, rows_in, wts_in
        else:
            eids, offs, rows, wts, err = _group_pairs(ids, idw, Wg.shape[0])
            if err:
                return err
        n_groups = eids.shape[0]
        n_pairs = rows.shape[0]
        if n_pairs == 0:
            return 0
        n_ff = Wg.shape[1]
        n_tok, n_embd = H.shape
        Hg = np.empty((n_pairs, n_embd), np.float32)
        if Q8:  # (n_embd and n_ff are multiples of 32: every kernel block is)
            XQ = np.empty((n_tok, n_embd), np.int8)
            XD = np.empty((n_tok, n_embd // 32), np.float32)
            XS = np.empty((n_tok, n_embd // 32), np.float32)
            XR = np.empty((n_tok, n_embd), np.float32)
            # only the rows of tokens with a pair here (the handoff's requests carry every token of
            # the step, most with no pair for the CPU): the other rows are never read
            used = np.zeros(n_tok, np.bool_)
            for p in range(n_pairs):
                used[rows[p]] = True
            for t in range(n_tok):
                if used[t]:
                    quantize_row(H[t], XQ[t], XD[t], XS[t], XR[t])
            GQ = np.empty((n_pairs, n_ff), np.int8)
            GD = np.empty((n_pairs, n_ff // 32), np.float32)
            GS = np.empty((n_pairs, n_ff // 32), np.float32)
            GR = np.empty((n_pairs, n_ff), np.float32)
            # ff-row chunks of whole 32-value units (each job rounds its own): 64 rows where that still
            # leaves every thread 8 jobs, else 32
            f_chunk = 64 if n_ff * n_groups >= 64 * 8 * nt else 32
        else:
            XR = H
            XQ = np.empty((0, 0), np.int8)
            XD = np.empty((0, 0), np.float32)
            XS = np.empty((0, 0), np.float32)
            GQ = np.empty((0, 0), np.int8)
            GD = np.empty((0, 0), np.float32)
            GS = np.empty((0, 0), np.float32)
            GR = np.empty((0, 0), np.float32)
            # ff-row chunks: enough jobs across all experts for every thread
            f_chunk = max(4, min(64, n_ff * n_groups // (4 * nt)))
        for p in range(n_pairs):  # h gathered in pair order: an expert's tokens are contiguous
            t = rows[p]
            for i in range(n_embd):
                Hg[p, i] = XR[t, i]
        # output-row chunks of at most 64 rows, the same number for every thread (prange divides its
        # range into one equal part per thread: 2048 rows in chunks of 32 gave 4 of 15 threads a
        # fifth chunk, 17% over the others)
        per = (n_embd + nt - 1) // nt
        r_chunk = (n_embd + nt * ((per + 63) // 64) - 1) // (nt * ((per + 63) // 64))
        Gt = np.empty((n_pairs, n_ff), np.float32)
        Ut = np.empty((n_pairs, n_ff), np.float32)
        Dt = np.empty((n_pairs, n_embd), np.float32)
        pairs = np.empty(n_pairs, np.int32)
        bad = np.empty(n_pairs, np.int32)  # q8: a gate or up dot of the pair was not finite
        bad_down = np.empty(n_pairs, np.int32)  # (the down dots' flags: their Dt values are checked instead)
        for p in range(n_pairs):
            pairs[p] = p
            bad[p] = 0
            bad_down[p] = 0
        HS = block_sums(Hg)
        n_fc = (n_ff + f_chunk - 1) // f_chunk
        # phase 1: each (expert, ff-row chunk) job: gate and up rows for that expert's tokens, then
        # act(gate)*up
        for job in prange(n_groups * n_fc):
            g = job // n_fc
            f0 = (job % n_fc) * f_chunk
            f1 = min(n_ff, f0 + f_chunk)
            e = eids[g]
            p0 = offs[g]
            p1 = offs[g + 1]
            if Q8:
                rows_q8(FG, Wg[e], XQ, XD, XS, rows, Hg, HS, Gt, f0, f1, p0, p1, nbuf, bad)
                rows_q8(FU, Wu[e], XQ, XD, XS, rows, Hg, HS, Ut, f0, f1, p0, p1, nbuf, bad)
            else:
                rows_for(FG, Wg[e], Hg, HS, Gt, f0, f1, p0, p1, nbuf)
                rows_for(FU, Wu[e], Hg, HS, Ut, f0, f1, p0, p1, nbuf)
            _activate_rows(act, Gt, Ut, p0, p1, f0, f1)
            for p in range(p0, p1):
                if Q8:  # f_chunk is a multiple of 32: the job owns whole units of the rounding
                    quantize_row(Gt[p, f0:f1], GQ[p, f0:f1], GD[p, f0 // 32:f1 // 32], GS[p, f0 // 32:f1 // 32],
                                 GR[p, f0:f1])
        # phase 2: each output-row chunk: every expert's down rows, then the weighted sum into Out
        # (a chunk owns its output columns: no races)
        A = GR if Q8 else Gt
        AS = block_sums(A)
        n_out = Wd.shape[1]
        n_rc = (n_out + r_chunk - 1) // r_chunk
        for c in prange(n_rc):
            r0 = c * r_chunk
            r1 = min(n_out, r0 + r_chunk)
            for g in range(n_groups):
                if Q8:
                    rows_q8(FD, Wd[eids[g]], GQ, GD, GS, pairs, A, AS, Dt, r0, r1, offs[g], offs[g + 1], nbuf,
                            bad_down)
                else:
                    rows_for(FD, Wd[eids[g]], A, AS, Dt, r0, r1, offs[g], offs[g + 1], nbuf)
            for p in range(n_pairs):
                t = rows[p]
                w = wts[p]
                if Q8:
                    if bad[p] == 0:
                        for r in range(r0, r1):
                            if finite_f32(Dt[p, r]):
                                Out[t, r] += w * Dt[p, r]
                else:
                    for r in range(r0, r1):
                        Out[t, r] += w * Dt[p, r]
            if Q8:  # a pair with a non-finite dot gives NaN, stored last (the fastmath sums above may
                # assume finite operands: an inf or NaN must not pass through them)
                for p in range(n_pairs):
                    t = rows[p]
                    for r in range(r0, r1):
                        if bad[p] != 0 or not finite_f32(Dt[p, r]):
                            Out[t, r] = np.float32(np.nan)
        return 0

    names = "_".join(BY_TYPE[f].name.lower() for f in (fg, fu, fd))
    return _jit(moe_kernel, f"moe_ffn_{'q8_' if q8 else ''}{names}", parallel=True)


_NO_I32 = np.empty(0, np.int32)
_NO_F32 = np.empty(0, np.float32)
_NO_IDS = np.empty((0, 0), np.int32)
_NO_IDW = np.empty((0, 0), np.float32)


@functools.lru_cache(maxsize=64)
def _expert_formats(types: tuple[int, int, int], gate: tuple, up: tuple, down: tuple,
                    dtypes: tuple) -> tuple[BlockFormat, BlockFormat, BlockFormat]:
    """The formats of an expert triple, its shapes checked (uint8 (n_expert, n_ff, row_bytes) gate
    and up, (n_expert, n_embd, row_bytes) down): ValueError / UnsupportedQuantError otherwise. A
    function of shapes and types only, so a layer's checks run once, not per call."""
    if len(gate) != 3 or len(up) != 3 or len(down) != 3:
        raise ValueError(f"expert tensors must be 3-D, got gate {gate}, up {up}, down {down}")
    n_exp, n_ff, _ = gate
    n_embd = down[1]
    fg = _check_weights(np.empty((0, gate[2]), dtypes[0]), types[0], n_embd, "ffn_gate_exps")
    fu = _check_weights(np.empty((0, up[2]), dtypes[1]), types[1], n_embd, "ffn_up_exps")
    fd = _check_weights(np.empty((0, down[2]), dtypes[2]), types[2], n_ff, "ffn_down_exps")
    if up[:2] != (n_exp, n_ff) or down[0] != n_exp:
        raise ValueError(f"expert tensor shapes disagree: gate {gate}, up {up}, down {down}")
    return fg, fu, fd


def _expert_args(gate_exps, up_exps, down_exps, types, h, out):
    gate_exps, up_exps, down_exps = (readonly(np.ascontiguousarray(a)) for a in (gate_exps, up_exps, down_exps))
    fg, fu, fd = _expert_formats(tuple(int(t) for t in types), gate_exps.shape, up_exps.shape, down_exps.shape,
                                 (gate_exps.dtype, up_exps.dtype, down_exps.dtype))
    H = np.ascontiguousarray(h, dtype=np.float32)
    if H.ndim != 2 or H.shape[1] != down_exps.shape[1]:
        raise ValueError(f"h must be (n_tokens, {down_exps.shape[1]}), got {H.shape}")
    if out is None:
        out = np.zeros(H.shape, np.float32)
    else:
        _check_out(out, H.shape)
    return gate_exps, up_exps, down_exps, (fg, fu, fd), H, out


def _check_act(act) -> None:
    if act not in (ACT_SILU, ACT_GELU):
        raise ValueError(f"moe_ffn: act must be ACT_SILU ({ACT_SILU}) or ACT_GELU ({ACT_GELU}), got {act!r}")


def moe_ffn(gate_exps: np.ndarray, up_exps: np.ndarray, down_exps: np.ndarray,
            types: tuple[int, int, int], expert_ids: np.ndarray, offsets: np.ndarray,
            token_rows: np.ndarray, weights: np.ndarray, h: np.ndarray,
            out: np.ndarray | None = None, act: int = ACT_SILU, act_q8: bool = False) -> np.ndarray:
    """Weighted sum of gated-FFN experts for one MoE layer, in one parallel call.

    ``out[t] += sum over routed pairs (e, t, w) of w * down_e(act(gate_e(h[t])) * up_e(h[t]))``

    Args:
        gate_exps, up_exps: uint8 (n_expert, n_ff, row_bytes) ``blk.N.ffn_gate_exps``/``ffn_up_exps``.
        down_exps: uint8 (n_expert, n_embd, row_bytes) ``blk.N.ffn_down_exps``.
        types: GGML type ids of (gate, up, down).
        expert_ids: int32 (G,) the distinct experts to compute (CSR groups).
        offsets: int32 (G+1,) pairs of group g are ``offsets[g]:offsets[g+1]``.
        token_rows: int32 (P,) row of ``h`` for each pair.
        weights: float32 (P,) routing weight of each pair.
        h: float32 (n_tokens, n_embd) hidden states.
        out: float32 (n_tokens, n_embd) accumulated into; zeros if None.
        act: ACT_SILU (SwiGLU) or ACT_GELU (GeGLU).
        act_q8: round h and the gated activations to 8 bits per 32 values first (the GPU's rule,
            :mod:`moecache.quants.act_q8`); Q8_0, Q4_K, Q5_K and Q6_K experts then take integer dots
            (:mod:`moecache.quants.int_dots`), the other formats the float kernel on the rounded
            values. A non-finite integer dot (an inf or NaN scale in the weights or in h) makes the
            token's outputs NaN (all of them for a gate or up row, that one for a down row).

    Returns:
        ``out``. Raises ValueError on inconsistent shapes, UnsupportedQuantError on unknown types.
        (Every format's block is a multiple of 32 weights, so ``act_q8``'s units always fit.)
    """
    gate_exps, up_exps, down_exps, (fg, fu, fd), H, out = _expert_args(gate_exps, up_exps, down_exps, types, h, out)
    n_tok = H.shape[0]
    n_exp = gate_exps.shape[0]
    eids = np.ascontiguousarray(expert_ids, dtype=np.int32)
    offs = np.ascontiguousarray(offsets, dtype=np.int32)
    rows = np.ascontiguousarray(token_rows, dtype=np.int32)
    wts = np.ascontiguousarray(weights, dtype=np.float32)
    if offs.shape != (eids.shape[0] + 1,) or offs[0] != 0 or offs[-1] != rows.shape[0] \
            or rows.shape != wts.shape or np.any(np.diff(offs) < 0):
        raise ValueError("moe_ffn: offsets must be a CSR index (G+1 ascending, from 0 to P) over token_rows/weights")
    if eids.size and (eids.min() < 0 or eids.max() >= n_exp):
        raise ValueError(f"moe_ffn: expert id out of range [0, {n_exp})")
    if rows.size and (rows.min() < 0 or rows.max() >= n_tok):
        raise ValueError(f"moe_ffn: token row out of range [0, {n_tok})")
    _check_act(act)
    if rows.size == 0:
        return out
    kernel = _moe_kernel(fg.ggml_type, fu.ggml_type, fd.ggml_type, bool(act_q8))
    kernel(gate_exps, up_exps, down_exps, True, eids, offs, rows, wts, _NO_IDS, _NO_IDW, H, act, out, STEP,
           numba.get_num_threads())
    return out


def moe_ffn_routed(gate_exps: np.ndarray, up_exps: np.ndarray, down_exps: np.ndarray,
                   types: tuple[int, int, int], ids: np.ndarray, weights: np.ndarray, h: np.ndarray,
                   out: np.ndarray | None = None, act: int = ACT_SILU, act_q8: bool = False) -> np.ndarray:
    """:func:`moe_ffn` on a layer's routing as the router gives it: the pairs are grouped by expert
    inside the compiled call (the decode step's road: one Python call and one compiled call per
    layer, no numpy sort).

    ``out[t] += sum over j with ids[t, j] >= 0 of weights[t, j] * expert_{ids[t, j]}(h[t])``

    Args:
        gate_exps, up_exps, down_exps, types, h, out, act, act_q8: as :func:`moe_ffn`.
        ids: int32 (T, k) expert of each pair; a negative id is no pair (the expert cache's hits,
            computed elsewhere).
        weights: float32 (T, k) routing weight of each pair.

    Returns:
        ``out``. Raises ValueError on inconsistent shapes, ids that are not integers or an id >=
        n_expert, UnsupportedQuantError on unknown types.
    """
    gate_exps, up_exps, down_exps, (fg, fu, fd), H, out = _expert_args(gate_exps, up_exps, down_exps, types, h, out)
    ids = np.asarray(ids)
    if ids.dtype != np.int32:  # (the engine's ids are int32: no scan on its road)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"moe_ffn_routed: ids must be integers, got {ids.dtype}")
        lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if hi >= gate_exps.shape[0] or lo < np.iinfo(np.int32).min:
            raise ValueError(f"moe_ffn_routed: expert id {hi if hi >= gate_exps.shape[0] else lo} out of range "
                             f"[0, {gate_exps.shape[0]})")
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    idw = np.ascontiguousarray(weights, dtype=np.float32)
    if ids.ndim != 2 or ids.shape[0] != H.shape[0] or idw.shape != ids.shape:
        raise ValueError(f"moe_ffn_routed: ids {ids.shape} and weights {idw.shape} must be (n_tokens, k) with "
                         f"n_tokens {H.shape[0]}")
    _check_act(act)
    kernel = _moe_kernel(fg.ggml_type, fu.ggml_type, fd.ggml_type, bool(act_q8))
    return _run_routed(kernel, gate_exps, up_exps, down_exps, ids, idw, H, act, out)


def _run_routed(kernel, g, u, d, ids, idw, H, act, out):
    """The compiled routed call on checked arrays (:func:`moe_ffn_routed`'s and
    :class:`RoutedExperts`' last step): ``out``, or ValueError naming an expert id >= n_expert."""
    bad = kernel(g, u, d, False, _NO_I32, _NO_I32, _NO_I32, _NO_F32, ids, idw, H, act, out, STEP, numba.get_num_threads())
    if bad:
        raise ValueError(f"moe_ffn_routed: expert id {int(ids.reshape(-1)[bad - 1])} out of range [0, {g.shape[0]})")
    return out


def act_code(name: str) -> int:
    """A GGUF model's gated activation by name (``ExpertWeights.act``: "silu" or "gelu") as the
    kernels' ``act``."""
    return ACT_SILU if name == "silu" else ACT_GELU


class RoutedExperts:
    """One MoE layer's experts prepared for :func:`moe_ffn_routed` calls made again and again (a
    decode step's handoff answers one call per handed-over layer): the weights' shapes and formats
    are checked and the compiled kernel found once, here, so a call checks only its own arrays.

    A call ``(ids, weights, h, out)`` gives :func:`moe_ffn_routed`'s result, bit for bit: with
    ``ids`` int32 and ``weights`` float32 (T, k), ``h`` and ``out`` float32 (T, n_embd), all
    C-contiguous numpy arrays (the handoff's buffers and the engine's arrays are), the kernel is
    called at once (a call without pairs: ~3.6 µs against ~7.5 µs through :func:`moe_ffn_routed`,
    the bare kernel ~1.3 µs, on the development VM, ``bench/cpu_call_cost.py``); any other arrays take
    :func:`moe_ffn_routed` itself (its conversions and its ValueErrors). An expert id >= n_expert
    raises ValueError as there.

    Args:
        gate_exps, up_exps, down_exps, types, act, act_q8: as :func:`moe_ffn_routed`.

    Raises ValueError / UnsupportedQuantError as :func:`moe_ffn_routed` does for the weights.
    """

    def __init__(self, gate_exps: np.ndarray, up_exps: np.ndarray, down_exps: np.ndarray,
                 types: tuple[int, int, int], act: int = ACT_SILU, act_q8: bool = False):
        g, u, d = (readonly(np.ascontiguousarray(a)) for a in (gate_exps, up_exps, down_exps))
        fg, fu, fd = _expert_formats(tuple(int(t) for t in types), g.shape, u.shape, d.shape,
                                     (g.dtype, u.dtype, d.dtype))
        _check_act(act)
        self.gate, self.up, self.down = g, u, d
        self.types = (fg.ggml_type, fu.ggml_type, fd.ggml_type)
        self.act = act
        self.act_q8 = bool(act_q8)
        self.n_embd = d.shape[1]
        self.kernel = _moe_kernel(fg.ggml_type, fu.ggml_type, fd.ggml_type, self.act_q8)

    def __call__(self, ids: np.ndarray, weights: np.ndarray, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out += `` the layer's routed experts of ``h`` (see the class); returns ``out``."""
        if not (type(ids) is np.ndarray and type(weights) is np.ndarray and type(h) is np.ndarray
                and type(out) is np.ndarray and ids.dtype == np.int32 and weights.dtype == np.float32
                and h.dtype == np.float32 and out.dtype == np.float32 and ids.ndim == 2 and h.ndim == 2
                and weights.shape == ids.shape and h.shape[0] == ids.shape[0] and h.shape[1] == self.n_embd
                and out.shape == h.shape and ids.flags.c_contiguous and weights.flags.c_contiguous
                and h.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable):
            return moe_ffn_routed(self.gate, self.up, self.down, self.types, ids, weights, h, out, self.act,
                                  self.act_q8)
        return _run_routed(self.kernel, self.gate, self.up, self.down, ids, weights, h, self.act, out)
