"""Shared Numba helpers for the block dequantizers: reading little-endian fields out of a block.

Numba has no float16 on the CPU target, so f16 fields are decoded through a 65536-entry float32
lookup table (256 KiB, compiled into the kernels as a constant).
"""

from __future__ import annotations

from moecache.quants import _numba_setup  # noqa: F401  (configures numba before any @njit)

import numpy as np
from numba import njit

F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# Keyword arguments shared by every helper that a kernel inlines.
INLINE = dict(inline="always", cache=True, nogil=True, fastmath=True)


@njit(**INLINE)
def u16_at(blk, o):
    """Little-endian uint16 at byte offset ``o`` of a uint8 array, as int32."""
    return np.int32(blk[o]) | (np.int32(blk[o + 1]) << 8)


@njit(**INLINE)
def f16_at(blk, o):
    """IEEE half at byte offset ``o`` of a uint8 array, as float32."""
    return F16_LUT[u16_at(blk, o)]


@njit(**INLINE)
def u32_at(blk, o):
    """Little-endian uint32 at byte offset ``o`` of a uint8 array, as uint32."""
    return (np.uint32(blk[o]) | (np.uint32(blk[o + 1]) << np.uint32(8))
            | (np.uint32(blk[o + 2]) << np.uint32(16)) | (np.uint32(blk[o + 3]) << np.uint32(24)))


@njit(**INLINE)
def trip32(out):
    """The number 32, as a run-time value: ``len(out) // 8`` of the 256-entry scratch, which the
    kernels allocate with a run-time size. The decoders' inner loops run ``trip32`` (or half)
    times: with a literal 32 LLVM fully unrolls them into scalar int-to-float conversions, with an
    opaque trip count it vectorizes them (2x faster Q8_0 and Q4_0 decoding, measured)."""
    return out.shape[0] >> 3
