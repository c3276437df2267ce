"""Every CPU kernel format against gguf-py's reference dequantization, in float64.

Weights are fresh random *valid* blocks (random payload bytes, sane scales; see
moecache.quants.random_blocks) drawn anew on every run; x is random normal, never zeros.

Tolerance: the kernels dequantize exactly as ggml does (float32 scale products) and accumulate
dot products in float32 with reassociation (fastmath), but do NOT quantize activations to 8 bits
(llama.cpp does, which costs ~1e-3 relative). The only error is float32 rounding of sums of n_in
products: ~sqrt(n_in) * 2^-24 relative per output, so the bound ||y - ref|| / ||ref|| < 2e-6
holds with margin for every format at n_in <= 4096 and fails on any decoding mistake (a wrong
bit or scale shifts the result by >= 1e-3).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from moecache.errors import UnsupportedQuantError
from moecache.quants import cpu
from moecache.quants.formats import FORMATS, format_for
from moecache.quants.random_blocks import random_rows

REL_TOL = 2e-6


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    assert np.all(np.isfinite(y)), "NaN/inf in kernel output"
    return float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))


@pytest.fixture
def rng():
    """Fresh blocks every run; the seed is printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"rng seed = {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("n_tokens", [None, 1, 3, 9])
def test_matmul_matches_gguf(name, n_tokens, rng):
    fmt = FORMATS[name]
    n_in = 512 if fmt.block_size < 256 else 1024
    n_out = int(rng.integers(33, 97))  # odd row counts exercise the chunk tails
    W = random_rows(fmt, n_out, n_in, rng, std=0.02)
    shape = (n_in,) if n_tokens is None else (n_tokens, n_in)
    x = rng.standard_normal(shape).astype(np.float32)
    Wref = gguf_dequantize(W, fmt.ggml_type).astype(np.float64)
    assert Wref.shape == (n_out, n_in)
    ref = x.astype(np.float64) @ Wref.T
    y = cpu.matmul(W, fmt.ggml_type, x)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert rel_err(y, ref) < REL_TOL


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_matches_gguf(name, rng):
    fmt = FORMATS[name]
    n_in = 256 * 3 if fmt.block_size == 256 else 32 * 5
    W = random_rows(fmt, 17, n_in, rng, std=0.02)
    ref = gguf_dequantize(W, fmt.ggml_type).astype(np.float64)
    got = cpu.dequantize(W, fmt.ggml_type, n_in)
    assert np.all(np.isfinite(got))
    # both sides compute scale * q in float32; allow one float32 rounding step
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_matmul_into_out_buffer(rng):
    fmt = FORMATS["Q8_0"]
    W = random_rows(fmt, 40, 256, rng, std=0.02)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    out = np.full((2, 40), np.nan, np.float32)  # poisoned: every element must be written
    y = cpu.matmul(W, fmt.ggml_type, x, out=out)
    assert y is out or np.shares_memory(y, out)
    ref = x.astype(np.float64) @ gguf_dequantize(W, fmt.ggml_type).astype(np.float64).T
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_1, GGMLQuantizationType.IQ2_XXS,
                                   GGMLQuantizationType.TQ1_0])
def test_unsupported_type_is_named(qtype):
    with pytest.raises(UnsupportedQuantError) as e:
        format_for(qtype, "blk.3.ffn_down_exps")
    assert qtype.name in str(e.value) and "blk.3.ffn_down_exps" in str(e.value)
    with pytest.raises(UnsupportedQuantError, match=qtype.name):
        cpu.matmul(np.zeros((4, 64), np.uint8), int(qtype), np.ones(256, np.float32), name="w")


def test_shape_errors(rng):
    fmt = FORMATS["Q4_0"]
    W = random_rows(fmt, 8, 64, rng)
    with pytest.raises(ValueError, match="multiple"):
        cpu.matmul(W, fmt.ggml_type, np.ones(60, np.float32))
    with pytest.raises(ValueError, match="shape"):
        cpu.matmul(W, fmt.ggml_type, np.ones(96, np.float32))


def test_kernels_run_from_two_threads_at_once(rng):
    """The hybrid executor calls the kernels from a worker thread while another thread works:
    the kernels release the GIL and the pinned threading layer must be thread-safe (the
    ``workqueue`` layer aborts the process here)."""
    from concurrent.futures import ThreadPoolExecutor

    import numba

    fmt = FORMATS["Q4_K"]
    Ws = [random_rows(fmt, 96, 512, rng, std=0.02) for _ in range(4)]
    xs = [rng.standard_normal((2, 512)).astype(np.float32) for _ in range(4)]
    refs = [x.astype(np.float64) @ gguf_dequantize(W, fmt.ggml_type).astype(np.float64).T for W, x in zip(Ws, xs)]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda i: [cpu.matmul(Ws[i], fmt.ggml_type, xs[i]) for _ in range(20)][-1], range(4)))
    for y, ref in zip(outs, refs):
        assert rel_err(y, ref) < REL_TOL
    assert numba.threading_layer() in ("omp", "tbb")
    assert cpu._matmul_kernel(fmt.ggml_type).targetoptions["nogil"]


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.block_size < 256 or f.float_elems])
def test_row_tail_shorter_than_a_step(name, rng):
    """Rows whose length is not a multiple of 256 end with a block-by-block tail."""
    fmt = FORMATS[name]
    n_in = 256 + 32 * 3
    W = random_rows(fmt, 37, n_in, rng, std=0.02)
    x = rng.standard_normal((4, n_in)).astype(np.float32)
    ref = x.astype(np.float64) @ gguf_dequantize(W, fmt.ggml_type).astype(np.float64).T
    assert rel_err(cpu.matmul(W, fmt.ggml_type, x), ref) < REL_TOL


def test_mxfp4_tiny_exponents(rng):
    """e8m0 exponents 0 and 1 decode through ggml's subnormal bit patterns."""
    fmt = FORMATS["MXFP4"]
    W = random_rows(fmt, 16, 256, rng)
    blocks = W.reshape(-1, fmt.type_size)
    blocks[:, 0] = rng.integers(0, 4, blocks.shape[0], dtype=np.uint8)  # 0, 1, 2, 3
    ref = gguf_dequantize(W, fmt.ggml_type).astype(np.float64)
    assert np.count_nonzero(ref) > 0  # not all-zero: the small exponents decode to tiny values
    np.testing.assert_array_equal(cpu.dequantize(W, fmt.ggml_type, 256), ref.astype(np.float32))


def test_out_buffer_must_match(rng):
    fmt = FORMATS["Q8_0"]
    W = random_rows(fmt, 40, 256, rng)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    for bad in (np.empty((40, 2), np.float32), np.empty((2, 40), np.float64), np.empty((2, 80), np.float32)[:, ::2]):
        with pytest.raises(ValueError, match="out must be"):
            cpu.matmul(W, fmt.ggml_type, x, out=bad)
