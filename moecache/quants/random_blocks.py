"""Random *valid* GGML blocks: random payload bytes with sane scale fields.

Used by the kernel tests (fresh blocks every run, never zeros) and by the synthetic GGUF writer
(which also centres them: :func:`center_blocks`).
gguf-py can quantize only a few formats, so K-quant and IQ blocks are built here directly: every
byte of a block is random except the float scale fields listed in
:data:`moecache.quants.formats.FORMATS`, which get finite, positive, moderate values. Every format's values are linear in its f16 scale
fields, so multiplying those fields by ``c`` multiplies every dequantized weight by ``c`` (MXFP4's
e8m0 exponent moves by whole powers of two); :func:`random_rows` uses that to hit a requested std.
"""

from __future__ import annotations

import numpy as np

from moecache.quants.formats import BlockFormat


FLOAT_STD = 0.05  # std of the elements random_blocks draws for F32/F16/BF16


def _put_f16(blocks: np.ndarray, off: int, vals: np.ndarray) -> None:
    blocks[:, off:off + 2] = vals.astype(np.float16).reshape(-1, 1).view(np.uint8).reshape(-1, 2)


def _get_f16(blocks: np.ndarray, off: int) -> np.ndarray:
    return blocks[:, off:off + 2].copy().view(np.float16).reshape(-1).astype(np.float64)


def random_blocks(fmt: BlockFormat, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` random valid blocks of ``fmt`` as uint8 of shape (n_blocks, fmt.type_size).

    Scale fields are log-uniform in [2^-9, 2^-5] (f16) or exponents 2^-9..2^-3 (e8m0); float
    formats get N(0, FLOAT_STD) elements. The weight std therefore differs between formats; use
    :func:`random_rows` with ``std`` to control it.
    """
    if fmt.float_elems is not None:
        vals = rng.standard_normal(n_blocks * fmt.block_size).astype(np.float32) * np.float32(FLOAT_STD)
        if fmt.float_elems == "f32":
            raw = vals.view(np.uint8)
        elif fmt.float_elems == "f16":
            raw = vals.astype(np.float16).view(np.uint8)
        else:  # bf16: round to nearest even on the upper 16 bits
            u = vals.view(np.uint32).astype(np.uint64)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            raw = u.astype(np.uint16).view(np.uint8)
        return np.ascontiguousarray(raw.reshape(n_blocks, fmt.type_size))
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)
    for off, enc in fmt.scales:
        if enc == "f16":
            _put_f16(blocks, off, np.exp2(rng.uniform(-9.0, -5.0, n_blocks)))
        elif enc == "e8m0":
            blocks[:, off] = rng.integers(127 - 9, 127 - 2, n_blocks, dtype=np.uint8)
        else:  # pragma: no cover - the table has no other scale encodings
            raise ValueError(f"{fmt.name}: unknown scale encoding {enc}")
    return blocks


def scale_blocks(fmt: BlockFormat, blocks: np.ndarray, factor: float) -> None:
    """Multiply every dequantized weight of ``blocks`` by ``factor`` (> 0), in place.

    f16 scale fields are multiplied exactly up to f16 rounding; e8m0 exponents move by the nearest
    power of two; float formats are rescaled element-wise.
    """
    if factor <= 0:
        raise ValueError("factor must be positive")
    if fmt.float_elems is not None:
        dt = {"f32": np.float32, "f16": np.float16}.get(fmt.float_elems)
        if dt is not None:
            v = blocks.view(dt)
            v *= dt(factor)
        else:
            u = blocks.view(np.uint16).astype(np.uint32) << 16
            f = u.view(np.float32) * np.float32(factor)
            blocks.view(np.uint16)[...] = (f.view(np.uint32) >> 16).astype(np.uint16)
        return
    for off, enc in fmt.scales:
        if enc == "f16":
            _put_f16(blocks, off, _get_f16(blocks, off) * factor)
        else:
            shift = int(round(np.log2(factor)))
            blocks[:, off] = np.clip(blocks[:, off].astype(np.int32) + shift, 1, 254).astype(np.uint8)


def random_rows(fmt: BlockFormat, n_rows: int, n_in: int, rng: np.random.Generator,
                std: float | None = None) -> np.ndarray:
    """A random valid quantized matrix: uint8 of shape (n_rows, fmt.row_bytes(n_in)).

    With ``std``, the scale fields are rescaled so that the dequantized weights have about that
    standard deviation (measured with gguf-py on up to 4096 of the blocks).

    Raises:
        ValueError: n_in is not a multiple of the block size.
    """
    rb = fmt.row_bytes(n_in)
    nb = n_rows * (n_in // fmt.block_size)
    blocks = random_blocks(fmt, nb, rng)
    if std is not None:
        from gguf.quants import dequantize

        sample = blocks[: min(nb, 4096)]
        cur = float(np.std(dequantize(sample.reshape(-1), fmt.ggml_type).astype(np.float64)))
        if cur > 0:
            scale_blocks(fmt, blocks, std / cur)
    return blocks.reshape(n_rows, rb)


def random_experts(formats: tuple[BlockFormat, BlockFormat, BlockFormat], n_expert: int, n_embd: int,
                   ff: int, rng: np.random.Generator, std: float = 0.05) -> tuple[np.ndarray, ...]:
    """Stacked random experts of an MoE layer in the GGUF layout: (gate, up, down) uint8 of shapes
    (n_expert, ff, row bytes of n_embd), the same, and (n_expert, n_embd, row bytes of ff), in the
    ``formats`` of (gate, up, down); weights of about ``std`` (see :func:`random_rows`)."""
    return tuple(np.stack([random_rows(f, r, c, rng, std=std) for _ in range(n_expert)])
                 for f, r, c in zip(formats, (ff, ff, n_embd), (n_embd, n_embd, ff)))


# Mean of the unsigned quant q in formats whose weights are d*sc*q - dmin*m (K) or d*q + m (_1).
_Q_MEAN = {"Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5, "Q4_1": 7.5, "Q5_1": 15.5}


def center_blocks(fmt: BlockFormat, blocks: np.ndarray, rng: np.random.Generator) -> None:
    """Make random blocks zero-mean, in place: centre the mins, then flip each block's sign at random.

    Q4_K/Q5_K: every sub-block's 6-bit min equals its scale and dmin = d * mean(q), so a weight is
    d*sc*(q - mean q). Q2_K: the same with 4-bit nibbles. Q4_1/Q5_1: m = -d * mean(q). The sign
    flip (of every f16 scale field of a block together) removes the rest (q - 8 has mean -0.5).
    MXFP4 (symmetric FP4 values, e8m0 scale) and the float formats are zero-mean already.
    """
    name = fmt.name
    if name in ("Q4_K", "Q5_K"):
        # scales[12] at byte 4 (get_scale_min_k4): bytes 0-3 hold sc0-3 and the high bits of
        # sc4-7, bytes 4-7 the same for the mins, bytes 8-11 low nibble sc4-7 | high nibble m4-7
        blocks[:, 8:12] = blocks[:, 4:8]
        lo = blocks[:, 12:16] & 0x0F
        blocks[:, 12:16] = lo | (lo << 4)
        _put_f16(blocks, 2, _get_f16(blocks, 0) * _Q_MEAN[name])
    elif name == "Q2_K":
        lo = blocks[:, 0:16] & 0x0F  # scales[16]: low nibble scale, high nibble min
        blocks[:, 0:16] = lo | (lo << 4)
        _put_f16(blocks, 82, _get_f16(blocks, 80) * _Q_MEAN[name])
    elif name in ("Q4_1", "Q5_1"):
        _put_f16(blocks, 2, -_get_f16(blocks, 0) * _Q_MEAN[name])
    f16_offsets = [off for off, enc in fmt.scales if enc == "f16"]
    if f16_offsets:
        sign = rng.integers(0, 2, len(blocks), dtype=np.uint8) << 7
        for off in f16_offsets:
            blocks[:, off + 1] ^= sign  # the sign bit of a little-endian f16
