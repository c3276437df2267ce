"""8-bit activations of the GPU's decode products, and their CPU twin.

For weights of the formats in :data:`Q8_ACT`, the CUDA kernels of ``moecache/quants/cuda/mmvq.cu``
round a product's activations to int8 once per op (llama.cpp's MMVQ idea: integer dot products of
weight and activation quants, float scales per block). Per 32 consecutive values of a row:
``d = max|x| / 127`` (float32), ``q = rint(x / d)`` (float32 division, ties to even; 0 when
``max|x|`` is 0); the product then sees ``q * d`` instead of x. :func:`q8_round` applies exactly
that rounding on the host, so the CPU backend can run the GPU's arithmetic (``NumpyBackend(act_q8=
True)``) and the tests compare the two. (llama.cpp's CPU backend rounds differently: per 256
values for the K-quants, scales stored as f16; ``moecache.testing.llamacpp_numerics`` emulates
that rule to compare with its recorded numbers.)
"""

from __future__ import annotations

import numpy as np

# format -> (pieces per block, weights per block) of the mmvq.cu kernels (VFORMAT's PPB, QK)
Q8_ACT: dict[str, tuple[int, int]] = {"Q8_0": (1, 32), "Q4_0": (1, 32), "Q4_K": (4, 256), "Q5_K": (4, 256),
                                      "Q6_K": (4, 256)}


def grouped_prompt_ok(types: tuple[int, int, int]) -> bool:
    """Whether the GPU's grouped 8-bit prompt MoE (``CupyBackend.prompt_q8``: moeq_gglu / moeq_gdown
    of mmvq.cu) takes experts of these GGML types (gate, up, down): gate and up of one format, all
    three in :data:`Q8_ACT`. Others take the float16 GEMMs."""
    from moecache.quants.formats import format_for

    g, u, d = (format_for(t).name for t in types)
    return g == u and g in Q8_ACT and d in Q8_ACT


def q8_round(x: np.ndarray) -> np.ndarray:
    """float32 (..., n), n % 32 == 0 -> float32 (..., n): each value replaced by ``q * d`` of its
    32-value unit (the module's rule), by the CPU expert kernels' own rounding
    (:func:`moecache.quants.int_dots.quantize_rows`; a unit holding inf or NaN becomes NaN).

    Raises:
        ValueError: n is not a multiple of 32.
    """
    from moecache.quants.int_dots import quantize_rows

    n = x.shape[-1]
    if n % 32:
        raise ValueError(f"q8_round: rows of {n} values are not a multiple of 32")
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n)
    d = np.empty((b.shape[0], n // 32), np.float32)
    r = np.empty_like(b)
    quantize_rows(b, np.empty(b.shape, np.int8), d, np.empty_like(d), r)
    return r.reshape(x.shape)
