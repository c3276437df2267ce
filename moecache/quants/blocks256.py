"""Numba dequantizers for the 256-weight super-block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.

Same contract as :mod:`moecache.quants.blocks32`: ``deq_<type>(blk, out, outu)`` decodes one block
(``blk``: uint8 of ``type_size`` bytes) into ``out[0:256]`` (float32, exactly 256 entries: its length
gives the inner loops' run-time trip count, see ``_common.trip32``); ``outu`` is ``out`` viewed as
uint32. Layouts: ggml-common.h (block_q2_K ... block_iq4_xs); reference: gguf-py ``gguf/quants.py``.

Every function walks the block in sub-blocks, decodes that sub-block's scale (and min) into scalars,
then runs a plain counted loop over its weights with loop-invariant shifts, which LLVM vectorizes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moecache.quants._common import INLINE, f16_at, trip32, u16_at
from moecache.quants.blocks32 import IQ4NL_VALUES


@njit(**INLINE)
def _scale_min_k4(blk, j):
    """(scale, min) of sub-block ``j`` (0..7) from the 12 packed bytes at blk[4:16] (Q4_K, Q5_K).

    Bytes 0-3: low 6 bits = scales 0-3, top 2 bits = high bits of scales 4-7; bytes 4-7 the same for
    the mins; bytes 8-11: low nibble = low 4 bits of scales 4-7, high nibble = those of mins 4-7.
    """
    if j < 4:
        sc = np.int32(blk[4 + j]) & 63
        mn = np.int32(blk[8 + j]) & 63
    else:
        b = np.int32(blk[8 + j])
        sc = (b & 0xF) | ((np.int32(blk[j]) >> 2) & 0x30)
        mn = (b >> 4) | ((np.int32(blk[4 + j]) >> 2) & 0x30)
    return sc, mn


@njit(**INLINE)
def deq_q2_k(blk, out, outu):
    n32 = trip32(out)
    # scales[16] @0 (low nibble: scale, high: min, per 16 weights), qs[64] @16, d @80, dmin @82.
    # Weight n*128 + j*32 + l (n<2, j<4, l<32) = bits 2j..2j+1 of qs[n*32 + l]; each qs byte feeds
    # 4 weights, so the loop runs over 16 bytes and writes 4 sub-blocks (scales n*8 + 2j + h).
    d = f16_at(blk, 80)
    dmin = f16_at(blk, 82)
    for k in range(4):
        n = k >> 1
        h = k & 1
        s0 = np.int32(blk[n * 8 + h])
        s1 = np.int32(blk[n * 8 + 2 + h])
        s2 = np.int32(blk[n * 8 + 4 + h])
        s3 = np.int32(blk[n * 8 + 6 + h])
        d0 = d * np.float32(s0 & 0xF)
        d1 = d * np.float32(s1 & 0xF)
        d2 = d * np.float32(s2 & 0xF)
        d3 = d * np.float32(s3 & 0xF)
        m0 = dmin * np.float32(s0 >> 4)
        m1 = dmin * np.float32(s1 >> 4)
        m2 = dmin * np.float32(s2 >> 4)
        m3 = dmin * np.float32(s3 >> 4)
        o = n * 128 + h * 16
        q0 = 16 + n * 32 + h * 16
        for l in range(n32 >> 1):
            q = np.int32(blk[q0 + l])
            out[o + l] = d0 * np.float32(q & 3) - m0
            out[o + 32 + l] = d1 * np.float32((q >> 2) & 3) - m1
            out[o + 64 + l] = d2 * np.float32((q >> 4) & 3) - m2
            out[o + 96 + l] = d3 * np.float32(q >> 6) - m3

@njit(**INLINE)
def _q3_scale(blk, i):
    """Signed 6-bit scale ``i`` (0..15) of a Q3_K block: low nibble from byte 96 + (i & 7) (shifted
    by 4 for i >= 8), high 2 bits from byte 104 + (i & 3) (shifted by 2 * (i >> 2)); offset 32."""
    lo = (np.int32(blk[96 + (i & 7)]) >> (4 * (i >> 3))) & 0xF
    hi = (np.int32(blk[104 + (i & 3)]) >> (2 * (i >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit(**INLINE)
def deq_q3_k(blk, out, outu):
    # literal trip counts here: with trip32 this decoder measured 37% slower (it vectorizes badly)
    # hmask[32] @0, qs[64] @32, scales[12] @96 (16 6-bit signed scales, offset 32), d @108.
    # Weight m*32 + l (m = n*4 + j) = bits 2j..2j+1 of qs[n*32 + l], minus 4 unless bit m of
    # hmask[l]. Loop over 16 qs bytes writing 4 sub-blocks (scales 2m + h).
    d = f16_at(blk, 108)
    for n in range(2):
        for h in range(2):
            d0 = d * np.float32(_q3_scale(blk, n * 8 + h))
            d1 = d * np.float32(_q3_scale(blk, n * 8 + 2 + h))
            d2 = d * np.float32(_q3_scale(blk, n * 8 + 4 + h))
            d3 = d * np.float32(_q3_scale(blk, n * 8 + 6 + h))
            o = n * 128 + h * 16
            q0 = 32 + n * 32 + h * 16
            m = 4 * n
            for l in range(16):
                q = np.int32(blk[q0 + l])
                hm = np.int32(blk[h * 16 + l]) >> m
                out[o + l] = d0 * np.float32((q & 3) + ((hm & 1) << 2) - 4)
                out[o + 32 + l] = d1 * np.float32(((q >> 2) & 3) + ((hm & 2) << 1) - 4)
                out[o + 64 + l] = d2 * np.float32(((q >> 4) & 3) + (hm & 4) - 4)
                out[o + 96 + l] = d3 * np.float32((q >> 6) + ((hm & 8) >> 1) - 4)

@njit(**INLINE)
def deq_q4_k(blk, out, outu):
    n32 = trip32(out)
    # d @0, dmin @2, scales[12] @4, qs[128] @16. Pair p of sub-blocks (2p, 2p+1) shares qs[32p:32p+32]:
    # low nibbles are sub-block 2p, high nibbles 2p+1. value = d*sc*q - dmin*mn.
    d = f16_at(blk, 0)
    dmin = f16_at(blk, 2)
    for p in range(4):
        sc0, mn0 = _scale_min_k4(blk, 2 * p)
        sc1, mn1 = _scale_min_k4(blk, 2 * p + 1)
        d0 = d * np.float32(sc0)
        m0 = dmin * np.float32(mn0)
        d1 = d * np.float32(sc1)
        m1 = dmin * np.float32(mn1)
        o = 64 * p
        q0 = 16 + 32 * p
        for l in range(n32):
            q = blk[q0 + l]
            out[o + l] = d0 * np.float32(np.int32(q & 0xF)) - m0
            out[o + 32 + l] = d1 * np.float32(np.int32(q >> 4)) - m1


@njit(**INLINE)
def deq_q5_k(blk, out, outu):
    n32 = trip32(out)
    # d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48. As Q4_K, plus 5th bit of weight l of
    # sub-block j = bit j of qh[l].
    d = f16_at(blk, 0)
    dmin = f16_at(blk, 2)
    for p in range(4):
        sc0, mn0 = _scale_min_k4(blk, 2 * p)
        sc1, mn1 = _scale_min_k4(blk, 2 * p + 1)
        d0 = d * np.float32(sc0)
        m0 = dmin * np.float32(mn0)
        d1 = d * np.float32(sc1)
        m1 = dmin * np.float32(mn1)
        o = 64 * p
        q0 = 48 + 32 * p
        s0 = 2 * p
        s1 = 2 * p + 1
        for l in range(n32):
            q = blk[q0 + l]
            qh = blk[16 + l]
            out[o + l] = d0 * np.float32(np.int32((q & 0xF) | (((qh >> s0) & 1) << 4))) - m0
            out[o + 32 + l] = d1 * np.float32(np.int32((q >> 4) | (((qh >> s1) & 1) << 4))) - m1


@njit(**INLINE)
def _i8(b):
    v = np.int32(b)
    return v - ((v & 0x80) << 1)


@njit(**INLINE)
def deq_q6_k(blk, out, outu):
    n32 = trip32(out)
    # ql[128] @0, qh[64] @128, scales:int8[16] @192, d @208. Weight n*128 + j*32 + l (n<2, j<4,
    # l<32): low 4 bits = nibble (j>>1) of ql[n*64 + (j&1)*32 + l], high 2 bits = bits 2j..2j+1 of
    # qh[n*32 + l]; value = d*sc*(q - 32), one int8 scale per 16 weights (n*8 + 2j + l//16).
    # Loop over 16 positions l reading 2 ql bytes + 1 qh byte and writing 4 weights.
    d = f16_at(blk, 208)
    for n in range(2):
        for h in range(2):
            sb = 192 + n * 8 + h
            d0 = d * np.float32(_i8(blk[sb]))
            d1 = d * np.float32(_i8(blk[sb + 2]))
            d2 = d * np.float32(_i8(blk[sb + 4]))
            d3 = d * np.float32(_i8(blk[sb + 6]))
            o = n * 128 + h * 16
            a = n * 64 + h * 16
            b = 128 + n * 32 + h * 16
            for l in range(n32 >> 1):
                la = blk[a + l]
                lb = blk[a + 32 + l]
                qh = blk[b + l]
                out[o + l] = d0 * np.float32(np.int32(((la & 0xF) | ((qh & 3) << 4)) - 32))
                out[o + 32 + l] = d1 * np.float32(np.int32(((lb & 0xF) | ((qh & 0xC) << 2)) - 32))
                out[o + 64 + l] = d2 * np.float32(np.int32(((la >> 4) | (qh & 0x30)) - 32))
                out[o + 96 + l] = d3 * np.float32(np.int32(((lb >> 4) | ((qh & 0xC0) >> 2)) - 32))

@njit(**INLINE)
def deq_iq4_xs(blk, out, outu):
    n32 = trip32(out)
    # d @0, scales_h:u16 @2 (2 high bits per sub-block), scales_l[4] @4 (nibble per sub-block),
    # qs[128] @8: sub-block j uses qs[16j:16j+16], low nibbles = weights 0-15, high = 16-31.
    d = f16_at(blk, 0)
    sh = u16_at(blk, 2)
    for j in range(8):
        lo = (np.int32(blk[4 + (j >> 1)]) >> (4 * (j & 1))) & 0xF
        hi = (sh >> (2 * j)) & 3
        dl = d * np.float32((lo | (hi << 4)) - 32)
        o = 32 * j
        q0 = 8 + 16 * j
        for l in range(n32 >> 1):
            q = np.int32(blk[q0 + l])
            out[o + l] = dl * IQ4NL_VALUES[q & 0xF]
            out[o + 16 + l] = dl * IQ4NL_VALUES[q >> 4]
