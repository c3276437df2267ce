"""Numba fused block dots for one token: ``x · dequantize(row)`` over 256 weights without a scratch.

The decode kernels' one-token path (``cpu.rows_for`` with a single token): instead of dequantizing
a block into a float32 scratch and dotting the scratch with x (``deq_block`` + ``_dot_tokens``),
each function here reads the quantized bytes and multiplies them into x in one loop. The block's
scales come out of the loop (a K-quant weight is ``d*sc*q - dmin*m``, so its dot with x is
``d * sum(sc * q * x) - dmin * sum(m * xsum)``, where ``xsum`` holds x's sums per 32 weights), the
loop runs 32 (or 16) times over all of a step's sub-blocks at once, and LLVM turns it into vector
code with one reduction per 256 weights. Measured on one core of the development VM (AMD EPYC,
AVX-512, numba 0.68): Q4_K 4.8 -> 9.7 GB/s of weights, Q8_0 6.8 -> 25; on the H200 machine's
16-thread Xeon Q4_K 20.5 -> 35.6 GB/s, Q8_0 30.0 -> 79.6 (bench/results/kernels-h200-cpu-dots.md).
An int16-product variant (activations rounded to int8 per 256 values, as llama.cpp's q8_K; LLVM
emits vpmaddwd) was 22% faster on one core but moved a Q4_K row's result by 0.7%: not taken.
Layouts: ggml-common.h (block_q4_K ...), as the ``deq_*`` decoders.

Integer values are converted with ``np.float32(np.int32(...))``: Numba widens uint8/int32
arithmetic to int64, and int64-to-float vectors hold half as many lanes.

Every function has the signature ``dot_<type>(row, o, x, xb, xs, sb, n32) -> float32``:
    row: uint8, the matrix row's bytes; o: byte offset of the step's first block in ``row``.
    x: float32 (n_in,), one token's activations; xb: index of the step's first weight in ``x``.
    xs: float32 (n_in // 32,), x's sums per 32 weights; sb: index of the step's first sum.
    n32: the number 32 as a run-time value (``_common.trip32``: an opaque trip count vectorizes).
A step is 256 weights: one super-block of the K-quants, eight blocks of Q8_0/Q4_0.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moecache.quants._common import INLINE, f16_at, u16_at


@njit(**INLINE)
def _lo(b):
    return np.float32(np.int32(b & 15))


@njit(**INLINE)
def _hi(b):
    return np.float32(np.int32(b >> 4))


@njit(**INLINE)
def _i8f(b):
    return np.float32(np.int32(np.int8(b)))


@njit(**INLINE)
def _sc_lo(row, o, j):
    """Scale of sub-block j < 4 of a Q4_K/Q5_K block at ``row[o:]``: low 6 bits of scales[j]."""
    return np.float32(np.int32(row[o + 4 + j] & 63))


@njit(**INLINE)
def _mn_lo(row, o, j):
    return np.float32(np.int32(row[o + 8 + j] & 63))


@njit(**INLINE)
def _sc_hi(row, o, j):
    """Scale of sub-block j >= 4: low nibble of scales[j + 4], top 2 bits of scales[j - 4]."""
    return np.float32(np.int32((row[o + 8 + j] & 15) | ((row[o + j] >> 2) & 48)))


@njit(**INLINE)
def _mn_hi(row, o, j):
    return np.float32(np.int32((row[o + 8 + j] >> 4) | ((row[o + 4 + j] >> 2) & 48)))


@njit(**INLINE)
def _k4_scales(row, o):
    """The 8 scales and 8 mins of a Q4_K/Q5_K block at ``row[o:]`` (12 packed bytes at o + 4; the
    layout of ``blocks256._scale_min_k4``), as float32, without branches."""
    return (_sc_lo(row, o, 0), _sc_lo(row, o, 1), _sc_lo(row, o, 2), _sc_lo(row, o, 3),
            _sc_hi(row, o, 4), _sc_hi(row, o, 5), _sc_hi(row, o, 6), _sc_hi(row, o, 7),
            _mn_lo(row, o, 0), _mn_lo(row, o, 1), _mn_lo(row, o, 2), _mn_lo(row, o, 3),
            _mn_hi(row, o, 4), _mn_hi(row, o, 5), _mn_hi(row, o, 6), _mn_hi(row, o, 7))


@njit(**INLINE)
def _mins_k4(m0, m1, m2, m3, m4, m5, m6, m7, xs, sb):
    return (m0 * xs[sb] + m1 * xs[sb + 1] + m2 * xs[sb + 2] + m3 * xs[sb + 3]
            + m4 * xs[sb + 4] + m5 * xs[sb + 5] + m6 * xs[sb + 6] + m7 * xs[sb + 7])


@njit(**INLINE)
def dot_q4_k(row, o, x, xb, xs, sb, n32):
    # d @0, dmin @2, scales[12] @4, qs[128] @16; sub-blocks 2p / 2p+1 are the low / high nibbles of
    # qs[32p:32p+32].
    d = f16_at(row, o)
    dmin = f16_at(row, o + 2)
    f0, f1, f2, f3, f4, f5, f6, f7, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
    q = o + 16
    s = np.float32(0.0)
    for l in range(n32):
        a = row[q + l]
        b = row[q + 32 + l]
        c = row[q + 64 + l]
        e = row[q + 96 + l]
        s += (f0 * _lo(a) * x[xb + l] + f1 * _hi(a) * x[xb + 32 + l]
              + f2 * _lo(b) * x[xb + 64 + l] + f3 * _hi(b) * x[xb + 96 + l]
              + f4 * _lo(c) * x[xb + 128 + l] + f5 * _hi(c) * x[xb + 160 + l]
              + f6 * _lo(e) * x[xb + 192 + l] + f7 * _hi(e) * x[xb + 224 + l])
    return d * s - dmin * _mins_k4(m0, m1, m2, m3, m4, m5, m6, m7, xs, sb)


@njit(**INLINE)
def _h5(h, bit):
    return np.float32(np.int32(((h >> bit) & 1) << 4))


@njit(**INLINE)
def dot_q5_k(row, o, x, xb, xs, sb, n32):
    # d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48; as Q4_K plus a 5th bit: bit j of qh[l]
    # for weight l of sub-block j.
    d = f16_at(row, o)
    dmin = f16_at(row, o + 2)
    f0, f1, f2, f3, f4, f5, f6, f7, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
    q = o + 48
    s = np.float32(0.0)
    for l in range(n32):
        a = row[q + l]
        b = row[q + 32 + l]
        c = row[q + 64 + l]
        e = row[q + 96 + l]
        h = row[o + 16 + l]
        s += (f0 * (_lo(a) + _h5(h, 0)) * x[xb + l] + f1 * (_hi(a) + _h5(h, 1)) * x[xb + 32 + l]
              + f2 * (_lo(b) + _h5(h, 2)) * x[xb + 64 + l] + f3 * (_hi(b) + _h5(h, 3)) * x[xb + 96 + l]
              + f4 * (_lo(c) + _h5(h, 4)) * x[xb + 128 + l] + f5 * (_hi(c) + _h5(h, 5)) * x[xb + 160 + l]
              + f6 * (_lo(e) + _h5(h, 6)) * x[xb + 192 + l] + f7 * (_hi(e) + _h5(h, 7)) * x[xb + 224 + l])
    return d * s - dmin * _mins_k4(m0, m1, m2, m3, m4, m5, m6, m7, xs, sb)


@njit(**INLINE)
def _q6(lnib, qh2):
    return np.float32(np.int32(lnib | (qh2 << 4)) - np.int32(32))


@njit(**INLINE)
def _q6_quad(row, o, x, xb, n, h, l, g0, g1, g2, g3):
    # the 4 weights n*128 + h*16 + l + 32j (j < 4) of a Q6_K block, times x, times their scales
    a = o + n * 64 + h * 16 + l
    la = row[a]
    lb = row[a + 32]
    qh = row[o + 128 + n * 32 + h * 16 + l]
    w = xb + n * 128 + h * 16 + l
    return (g0 * _q6(la & 15, qh & 3) * x[w] + g1 * _q6(lb & 15, (qh >> 2) & 3) * x[w + 32]
            + g2 * _q6(la >> 4, (qh >> 4) & 3) * x[w + 64] + g3 * _q6(lb >> 4, qh >> 6) * x[w + 96])


@njit(**INLINE)
def dot_q6_k(row, o, x, xb, xs, sb, n32):
    # ql[128] @0, qh[64] @128, scales:int8[16] @192, d @208. Weight n*128 + j*32 + l (n<2, j<4,
    # l<32): low 4 bits = nibble (j>>1) of ql[n*64 + (j&1)*32 + l], high 2 bits = bits 2j..2j+1 of
    # qh[n*32 + l]; value d*sc*(q - 32) with scale n*8 + 2j + l//16. One loop over l < 16 covers
    # both halves h = l//16 of every (n, j): 16 terms, one reduction.
    d = f16_at(row, o + 208)
    c = o + 192
    a0, a1, a2, a3 = _i8f(row[c]), _i8f(row[c + 2]), _i8f(row[c + 4]), _i8f(row[c + 6])
    b0, b1, b2, b3 = _i8f(row[c + 1]), _i8f(row[c + 3]), _i8f(row[c + 5]), _i8f(row[c + 7])
    e0, e1, e2, e3 = _i8f(row[c + 8]), _i8f(row[c + 10]), _i8f(row[c + 12]), _i8f(row[c + 14])
    f0, f1, f2, f3 = _i8f(row[c + 9]), _i8f(row[c + 11]), _i8f(row[c + 13]), _i8f(row[c + 15])
    s = np.float32(0.0)
    for l in range(n32 >> 1):
        s += (_q6_quad(row, o, x, xb, 0, 0, l, a0, a1, a2, a3) + _q6_quad(row, o, x, xb, 0, 1, l, b0, b1, b2, b3)
              + _q6_quad(row, o, x, xb, 1, 0, l, e0, e1, e2, e3) + _q6_quad(row, o, x, xb, 1, 1, l, f0, f1, f2, f3))
    return d * s


@njit(**INLINE)
def dot_q8_0(row, o, x, xb, xs, sb, n32):
    # 8 blocks of 34 bytes: d @0 (f16), qs:int8[32] @2.
    d0 = f16_at(row, o)
    d1 = f16_at(row, o + 34)
    d2 = f16_at(row, o + 68)
    d3 = f16_at(row, o + 102)
    d4 = f16_at(row, o + 136)
    d5 = f16_at(row, o + 170)
    d6 = f16_at(row, o + 204)
    d7 = f16_at(row, o + 238)
    q = o + 2
    s = np.float32(0.0)
    for l in range(n32):
        s += (d0 * _i8f(row[q + l]) * x[xb + l] + d1 * _i8f(row[q + 34 + l]) * x[xb + 32 + l]
              + d2 * _i8f(row[q + 68 + l]) * x[xb + 64 + l] + d3 * _i8f(row[q + 102 + l]) * x[xb + 96 + l]
              + d4 * _i8f(row[q + 136 + l]) * x[xb + 128 + l] + d5 * _i8f(row[q + 170 + l]) * x[xb + 160 + l]
              + d6 * _i8f(row[q + 204 + l]) * x[xb + 192 + l] + d7 * _i8f(row[q + 238 + l]) * x[xb + 224 + l])
    return s


@njit(**INLINE)
def _q4_0_pair(row, b, x, w, l):
    # block at row[b:] (d @0, qs[16] @2): weight l = low nibble of qs[l] - 8, weight 16 + l = high.
    v = row[b + 2 + l]
    return (_lo(v) - np.float32(8.0)) * x[w + l] + (_hi(v) - np.float32(8.0)) * x[w + 16 + l]


@njit(**INLINE)
def dot_q4_0(row, o, x, xb, xs, sb, n32):
    # 8 blocks of 18 bytes: d @0 (f16), qs[16] @2.
    d0 = f16_at(row, o)
    d1 = f16_at(row, o + 18)
    d2 = f16_at(row, o + 36)
    d3 = f16_at(row, o + 54)
    d4 = f16_at(row, o + 72)
    d5 = f16_at(row, o + 90)
    d6 = f16_at(row, o + 108)
    d7 = f16_at(row, o + 126)
    s = np.float32(0.0)
    for l in range(n32 >> 1):
        s += (d0 * _q4_0_pair(row, o, x, xb, l) + d1 * _q4_0_pair(row, o + 18, x, xb + 32, l)
              + d2 * _q4_0_pair(row, o + 36, x, xb + 64, l) + d3 * _q4_0_pair(row, o + 54, x, xb + 96, l)
              + d4 * _q4_0_pair(row, o + 72, x, xb + 128, l) + d5 * _q4_0_pair(row, o + 90, x, xb + 160, l)
              + d6 * _q4_0_pair(row, o + 108, x, xb + 192, l) + d7 * _q4_0_pair(row, o + 126, x, xb + 224, l))
    return s


@njit(**INLINE)
def _nf(row, o):
    """1 if the f16 at ``row[o:o+2]`` is infinite or NaN (exponent bits all set), else 0."""
    return np.int32((u16_at(row, o) & 0x7C00) == 0x7C00)


@njit(**INLINE)
def _nf8(row, o, stride):
    return (_nf(row, o) | _nf(row, o + stride) | _nf(row, o + 2 * stride) | _nf(row, o + 3 * stride)
            | _nf(row, o + 4 * stride) | _nf(row, o + 5 * stride) | _nf(row, o + 6 * stride)
            | _nf(row, o + 7 * stride))


# Infinite or NaN scale fields in a step (1 or 0): with the scales factored out of the sums, the
# fused dots do not give the per-weight products' NaN/inf pattern (inf * 0 = NaN in one weight),
# so the row kernel recomputes such a row by dequantizing it. Checked on the bits, not the float
# result: the kernels are compiled with fastmath, under which LLVM may fold an isfinite test.
@njit(**INLINE)
def nonfinite_q4_k(row, o):
    return _nf(row, o) | _nf(row, o + 2)


@njit(**INLINE)
def nonfinite_q6_k(row, o):
    return _nf(row, o + 208)


@njit(**INLINE)
def nonfinite_q8_0(row, o):
    return _nf8(row, o, 34)


@njit(**INLINE)
def nonfinite_q4_0(row, o):
    return _nf8(row, o, 18)


# GGML type name -> (fused dot of one 256-weight step, its non-finite-scale test): the formats with
# a one-token fast path.
DOTS = {"Q4_K": (dot_q4_k, nonfinite_q4_k), "Q5_K": (dot_q5_k, nonfinite_q4_k),
        "Q6_K": (dot_q6_k, nonfinite_q6_k), "Q8_0": (dot_q8_0, nonfinite_q8_0),
        "Q4_0": (dot_q4_0, nonfinite_q4_0)}
