"""Numba dequantizers for the 32-weight block formats (and F32/F16/BF16 read as 32-weight blocks).

Each ``deq_<type>(blk, out, outu, ob)`` decodes one block into ``out[ob:ob + 32]``: ``blk`` is the block's bytes (uint8, length
``type_size``; for the float formats, 32 elements), ``out`` the kernels' float32 scratch of 256
entries (its length gives the loops' run-time trip count, see ``_common.trip32``), ``outu`` the same scratch viewed as uint32 (lets F32
and BF16 write bit patterns without a scalar bitcast). Layouts and formulas: ggml-common.h block
structs and gguf-py ``gguf/quants.py`` (``Q4_0.dequantize_blocks`` etc.), which the tests use as
the reference. All are ``inline='always'`` so the kernel loop that calls them is compiled as one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moecache.quants._common import F16_LUT, INLINE, f16_at, trip32, u16_at, u32_at

# kvalues_iq4nl (ggml-common.h): the non-linear 4-bit codebook of IQ4_NL and IQ4_XS.
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=np.float32)
# FP4 E2M1 values doubled (kvalues_mxfp4, ggml-common.h); the e8m0 scale is halved to match.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


@njit(**INLINE)
def deq_f32(blk, out, outu, ob):
    n32 = trip32(out)
    for i in range(n32):
        outu[ob + i] = u32_at(blk, 4 * i)


@njit(**INLINE)
def deq_f16(blk, out, outu, ob):
    n32 = trip32(out)
    for i in range(n32):
        out[ob + i] = F16_LUT[u16_at(blk, 2 * i)]


@njit(**INLINE)
def deq_bf16(blk, out, outu, ob):
    n32 = trip32(out)
    for i in range(n32):
        outu[ob + i] = np.uint32(u16_at(blk, 2 * i)) << np.uint32(16)


@njit(**INLINE)
def deq_q8_0(blk, out, outu, ob):
    n32 = trip32(out)
    d = f16_at(blk, 0)
    for i in range(n32):
        out[ob + i] = d * np.float32(np.int32(np.int8(blk[2 + i])))


@njit(**INLINE)
def deq_q4_0(blk, out, outu, ob):
    n32 = trip32(out)
    d = f16_at(blk, 0)
    for i in range(n32 >> 1):
        q = blk[2 + i]
        out[ob + i] = d * np.float32(np.int32((q & 0xF) - 8))
        out[ob + i + 16] = d * np.float32(np.int32((q >> 4) - 8))


@njit(**INLINE)
def deq_q4_1(blk, out, outu, ob):
    n32 = trip32(out)
    d = f16_at(blk, 0)
    m = f16_at(blk, 2)
    for i in range(n32 >> 1):
        q = blk[4 + i]
        out[ob + i] = d * np.float32(np.int32(q & 0xF)) + m
        out[ob + i + 16] = d * np.float32(np.int32(q >> 4)) + m


@njit(**INLINE)
def deq_q5_0(blk, out, outu, ob):
    # literal trip count: with trip32 the 5th-bit shifts vectorized badly (20% slower, measured)
    d = f16_at(blk, 0)
    qh = u32_at(blk, 2)
    for i in range(16):
        q = np.int32(blk[6 + i])
        h0 = np.int32((qh >> np.uint32(i)) & np.uint32(1)) << 4
        h1 = np.int32((qh >> np.uint32(i + 16)) & np.uint32(1)) << 4
        out[ob + i] = d * np.float32(((q & 0xF) | h0) - 16)
        out[ob + i + 16] = d * np.float32(((q >> 4) | h1) - 16)


@njit(**INLINE)
def deq_q5_1(blk, out, outu, ob):
    # literal trip count: with trip32 the 5th-bit shifts vectorized badly (20% slower, measured)
    d = f16_at(blk, 0)
    m = f16_at(blk, 2)
    qh = u32_at(blk, 4)
    for i in range(16):
        q = np.int32(blk[8 + i])
        h0 = np.int32((qh >> np.uint32(i)) & np.uint32(1)) << 4
        h1 = np.int32((qh >> np.uint32(i + 16)) & np.uint32(1)) << 4
        out[ob + i] = d * np.float32((q & 0xF) | h0) + m
        out[ob + i + 16] = d * np.float32((q >> 4) | h1) + m


@njit(**INLINE)
def deq_iq4_nl(blk, out, outu, ob):
    n32 = trip32(out)
    d = f16_at(blk, 0)
    for i in range(n32 >> 1):
        q = np.int32(blk[2 + i])
        out[ob + i] = d * IQ4NL_VALUES[q & 0xF]
        out[ob + i + 16] = d * IQ4NL_VALUES[q >> 4]


@njit(**INLINE)
def deq_mxfp4(blk, out, outu, ob):
    n32 = trip32(out)
    # ggml_e8m0_to_fp32_half: 2^(e-128); e < 2 gives the subnormal bit patterns.
    e = np.uint32(blk[0])
    if e < np.uint32(2):
        outu[ob + 31] = np.uint32(0x00200000) << e
    else:
        outu[ob + 31] = (e - np.uint32(1)) << np.uint32(23)
    d = out[ob + 31]
    for i in range(n32 >> 1):
        q = np.int32(blk[1 + i])
        out[ob + i] = d * MXFP4_VALUES[q & 0xF]
        out[ob + i + 16] = d * MXFP4_VALUES[q >> 4]
