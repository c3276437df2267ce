"""A CPU backend that rounds matmul inputs the way llama.cpp's CPU backend does (tests only).

ggml's CPU matmul does not multiply a quantized weight by float32 activations: it first quantizes
the activation row to the weight type's ``vec_dot_type`` (``ggml-cpu.c`` ``type_traits_cpu``):
Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants and IQ4_XS, F16 for
F16 weights, BF16 for BF16. The integer dot product then equals the float dot product of the
dequantized weight with the *rounded* activation, which is what this backend computes.

moecache itself keeps float32 activations (its logits match transformers' to ~1e-6). On models
with large activations (gemma3) the rounding moves llama.cpp's perplexity by a few percent; this
backend lets tests compare with llama.cpp's recorded numbers on equal terms. Formats:
``quantize_row_q8_0_ref`` / ``quantize_row_q8_K_ref`` in ``ggml/src/ggml-quants.c``.
"""

from __future__ import annotations

import numpy as np

from moecache.backends.numpy_backend import Linear, NumpyBackend
from moecache.quants.formats import BY_TYPE

Q8_0_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"}
Q8_K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def round_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 (and Q8_1, same values) round trip over blocks of 32 as ggml's x86 AVX path computes
    it (``ggml-cpu/arch/x86/quants.c`` ``quantize_row_q8_0``, which made the recorded numbers):
    ``q = rint(x * 127/amax)`` (round half to even), ``d = amax/127`` stored as f16.
    float32 (..., n) -> float32 (..., n).

    Half-way cases are common, not rare: a row dequantized from Q8_0 (an embedding) has values
    whose ratios are ratios of small integers, so the rounding mode matters (it moves gemma3's
    perplexity by 3%).
    """
    s = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(s).max(axis=-1, keepdims=True)
    mul = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(s * mul)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return (q * d).reshape(x.shape).astype(np.float32)


def round_q8_K(x: np.ndarray) -> np.ndarray:
    """Q8_K round trip over blocks of 256: ``iscale = -127/max`` (max = the signed value of largest
    magnitude), ``q = min(127, nearest(iscale*x))``, ``d = 1/iscale`` (float32)."""
    s = x.reshape(*x.shape[:-1], -1, 256).astype(np.float32)
    mx = np.take_along_axis(s, np.abs(s).argmax(axis=-1)[..., None], axis=-1)
    iscale = np.divide(np.float32(-127), mx, out=np.zeros_like(mx), where=mx != 0)
    q = np.minimum(np.float32(127), np.rint(iscale * s))
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return (q * d).reshape(x.shape).astype(np.float32)


def gelu_f16_table(x: np.ndarray) -> np.ndarray:
    """ggml's CPU GELU (``GGML_GELU_FP16``, ``ggml-cpu/vec.h``): x rounded to f16, looked up in a
    table of f16 GELU values; 0 at x <= -10, x at x >= 10."""
    h = x.astype(np.float16).astype(np.float32)
    c = np.float32(0.7978845608028654)
    g = (np.float32(0.5) * h * (np.float32(1) + np.tanh(c * (h + np.float32(0.044715) * h ** 3))))
    g = g.astype(np.float16).astype(np.float32)
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, g)).astype(np.float32)


class LlamaCppRoundingBackend(NumpyBackend):
    """:class:`NumpyBackend` with llama.cpp's activation rounding before every quantized matmul
    and its f16-table GELU."""

    name = "cpu-llamacpp-rounding"

    def glu(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
        if act == "gelu":
            return gelu_f16_table(gate) * up
        return super().glu(gate, up, act)

    def matmul(self, w: Linear, x: np.ndarray) -> np.ndarray:
        t = BY_TYPE[w.ggml_type].name
        if t in Q8_K_TYPES:
            x = round_q8_K(x)
        elif t in Q8_0_TYPES:
            x = round_q8_0(x)
        elif t == "F16":
            x = x.astype(np.float16).astype(np.float32)
        return super().matmul(w, x)
