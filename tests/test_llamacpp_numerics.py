"""The llama.cpp rounding emulation used to compare with llama.cpp's recorded numbers."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from moecache.testing.llamacpp_numerics import gelu_f16_table, round_q8_0, round_q8_K


def test_round_q8_0_equals_a_q8_0_round_trip_except_ties(rng):
    x = (rng.standard_normal((4, 256)) * rng.uniform(0.01, 50, (4, 1))).astype(np.float32)
    ref = dequantize(quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0).astype(np.float32)
    # gguf-py rounds half away from zero, ggml's AVX path half to even: random data has no ties
    np.testing.assert_array_equal(round_q8_0(x), ref)
    # a tie: amax 127 * 1 -> x = 24.5 rounds to 24 (even)
    t = np.zeros((1, 32), np.float32)
    t[0, 0], t[0, 1] = 127.0, 24.5
    assert round_q8_0(t)[0, 1] == 24.0


def test_round_q8_K_error_is_at_most_half_a_step(rng):
    x = (rng.standard_normal((3, 512)) * 7).astype(np.float32)
    y = round_q8_K(x)
    blocks = x.reshape(3, 2, 256)
    step = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(y - x).reshape(3, 2, 256) <= step * 0.5 + 1e-6)
    q = y.reshape(3, 2, 256) / step
    np.testing.assert_allclose(q, np.rint(q), atol=1e-3)  # on the grid
    assert not np.array_equal(y, x)


def test_gelu_table_tails_and_f16_rounding():
    x = np.array([-12.0, -3.0, 0.5, 2.0, 11.0], np.float32)
    y = gelu_f16_table(x)
    assert y[0] == 0.0 and y[-1] == 11.0
    exact = 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(y[1:4], exact[1:4], rtol=2e-3)
    assert np.all(y[1:4] == y[1:4].astype(np.float16).astype(np.float32))
