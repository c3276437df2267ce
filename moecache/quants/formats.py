"""The one table of GGML block formats that moecache reads.

Every quantized GGUF tensor is a row-major array of rows (one row per output feature); each row is
a sequence of fixed-size *blocks*, each block encoding ``block_size`` consecutive weights in
``type_size`` bytes. The layouts below follow ggml's ``ggml-common.h`` (block structs) and
gguf-py's ``gguf/quants.py`` (reference dequantization, which the tests compare against).

``scales`` lists the byte offsets and encodings of each block's floating-point scale fields. They
are what a random *valid* block must get right (random bytes there can decode to inf/NaN or huge
values); every other byte of a block may be random. See :mod:`moecache.quants.random_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from moecache.errors import UnsupportedQuantError


@dataclass(frozen=True)
class BlockFormat:
    """One GGML block format.

    Attributes:
        name: GGML type name as in GGUF (``"Q4_K"``).
        ggml_type: the ``ggml_type`` enum value stored in GGUF tensor infos; also the kernel id.
        block_size: weights per block.
        type_size: bytes per block.
        layout: the block's fields in byte order, ``name[bytes]``.
        scales: ``(byte offset, encoding)`` of each float scale field; encodings are
            ``"f16"``, ``"bf16"``, ``"f32"`` (IEEE) and ``"e8m0"`` (a power-of-two exponent byte).
        float_elems: for the plain float formats F32/F16/BF16, the encoding of every element.
    """

    name: str
    ggml_type: int
    block_size: int
    type_size: int
    layout: str
    scales: tuple[tuple[int, str], ...] = ()
    float_elems: str | None = None

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n_in: int) -> int:
        """Bytes of one row of ``n_in`` weights. Raises ValueError if n_in is not a block multiple."""
        if n_in % self.block_size:
            raise ValueError(f"{self.name}: row length {n_in} is not a multiple of the block size {self.block_size}")
        return n_in // self.block_size * self.type_size


def _f(name: str, block: int, size: int, layout: str, scales=(), float_elems=None) -> BlockFormat:
    return BlockFormat(name, int(GGMLQuantizationType[name]), block, size, layout, tuple(scales), float_elems)


# Block layouts: ggml-common.h (block_q4_0, block_q4_K, ...). QK_K = 256, K_SCALE_SIZE = 12.
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    _f("F32", 1, 4, "f32[4]", float_elems="f32"),
    _f("F16", 1, 2, "f16[2]", float_elems="f16"),
    _f("BF16", 1, 2, "bf16[2]", float_elems="bf16"),
    _f("Q4_0", 32, 18, "d:f16[2] qs[16] (low nibbles: weights 0-15, high: 16-31; value = d*(q-8))", [(0, "f16")]),
    _f("Q4_1", 32, 20, "d:f16[2] m:f16[2] qs[16] (value = d*q + m)", [(0, "f16"), (2, "f16")]),
    _f("Q5_0", 32, 22, "d:f16[2] qh[4] qs[16] (5th bits in qh; value = d*(q-16))", [(0, "f16")]),
    _f("Q5_1", 32, 24, "d:f16[2] m:f16[2] qh[4] qs[16] (value = d*q + m)", [(0, "f16"), (2, "f16")]),
    _f("Q8_0", 32, 34, "d:f16[2] qs:int8[32] (value = d*q)", [(0, "f16")]),
    _f("Q2_K", 256, 84, "scales[16] (4-bit scale | 4-bit min) qs[64] d:f16[2] dmin:f16[2]", [(80, "f16"), (82, "f16")]),
    _f("Q3_K", 256, 110, "hmask[32] qs[64] scales[12] (16 6-bit scales) d:f16[2]", [(108, "f16")]),
    _f("Q4_K", 256, 144, "d:f16[2] dmin:f16[2] scales[12] (8 6-bit scales, 8 6-bit mins) qs[128]", [(0, "f16"), (2, "f16")]),
    _f("Q5_K", 256, 176, "d:f16[2] dmin:f16[2] scales[12] qh[32] qs[128]", [(0, "f16"), (2, "f16")]),
    _f("Q6_K", 256, 210, "ql[128] qh[64] scales:int8[16] d:f16[2]", [(208, "f16")]),
    _f("IQ4_NL", 32, 18, "d:f16[2] qs[16] (4-bit indices into the kvalues_iq4nl table)", [(0, "f16")]),
    _f("IQ4_XS", 256, 136, "d:f16[2] scales_h:u16[2] scales_l[4] qs[128] (8 6-bit scales, iq4nl table)", [(0, "f16")]),
    _f("MXFP4", 32, 17, "e:e8m0[1] qs[16] (OCP MX v1.0 FP4 E2M1; value = 2^(e-127) * fp4)", [(0, "e8m0")]),
)}

BY_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}


def format_for(ggml_type: int | GGMLQuantizationType, tensor_name: str | None = None) -> BlockFormat:
    """The BlockFormat of a GGML type id.

    Raises:
        UnsupportedQuantError: the type is not in :data:`FORMATS` (the message names the tensor
            and the type).
    """
    fmt = BY_TYPE.get(int(ggml_type))
    if fmt is None:
        try:
            tname = GGMLQuantizationType(int(ggml_type)).name
        except ValueError:
            tname = f"unknown type id {int(ggml_type)}"
        where = f"tensor '{tensor_name}': " if tensor_name else ""
        supported = ", ".join(FORMATS)
        raise UnsupportedQuantError(f"{where}unsupported quant type {tname} (supported: {supported})")
    return fmt
