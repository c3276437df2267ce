"""Every CPU kernel format against gguf-py's reference dequantization, in float64.

Weights are fresh random *valid* blocks (random payload bytes, sane scales; see
moecache.quants.random_blocks) drawn anew on every run (conftest's ``rng``: the seed is printed,
MOECACHE_TEST_SEED replays it); x is random normal, never zeros. test_extreme_scales adds blocks
whose scale fields are subnormal, infinite or NaN.

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
@pytest.mark.parametrize("n_tokens", [1, 4])
def test_row_tail_shorter_than_a_step(name, n_tokens, rng):
    """Rows whose length is not a multiple of 256 end with a block-by-block tail (after the fused
    one-token steps, or the dequantized steps of several tokens)."""
    fmt = FORMATS[name]
    n_in = 256 + 32 * 3
    W = random_rows(fmt, 37, n_in, rng, std=0.02)
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
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


# Extreme values of a scale field (or, for F32/F16/BF16, of an element), as bit patterns.
F16_EXTREMES = {"smallest subnormal": 0x0001, "largest subnormal": 0x03FF, "negative subnormal": 0x8155,
                "+inf": 0x7C00, "-inf": 0xFC00, "NaN": 0x7E00, "negative NaN with payload": 0xFD01,
                "-0": 0x8000, "largest finite": 0x7BFF}
BF16_EXTREMES = {"smallest subnormal": 0x0001, "negative subnormal": 0x8040, "+inf": 0x7F80, "-inf": 0xFF80,
                 "NaN": 0x7FC0, "negative NaN with payload": 0xFF81, "-0": 0x8000}
F32_EXTREMES = {"smallest subnormal": 0x00000001, "largest subnormal": 0x007FFFFF, "+inf": 0x7F800000,
                "-inf": 0xFF800000, "NaN": 0x7FC00000, "negative NaN with payload": 0xFF800123, "-0": 0x80000000}
E8M0_EXTREMES = {"e=0 (2^-128, subnormal)": 0, "e=1": 1, "e=254": 254, "e=255 (2^127 in ggml, not NaN)": 255}


def _extreme_rows(fmt, n_in, rng):
    """Random valid rows, then for every scale field (the elements of a float format) and every
    extreme value of its encoding: one row with the value in every block (every element), one
    with it in a single random block (element). Returns (W, [(row, label)])."""
    if fmt.float_elems:
        fields = [(0, fmt.float_elems, {"f32": F32_EXTREMES, "f16": F16_EXTREMES, "bf16": BF16_EXTREMES}[fmt.float_elems])]
    else:
        fields = [(off, enc, E8M0_EXTREMES if enc == "e8m0" else F16_EXTREMES) for off, enc in fmt.scales]
    cases = [(off, enc, name, bits, whole) for off, enc, extremes in fields
             for name, bits in extremes.items() for whole in (True, False)]
    n_ordinary = 3
    W = random_rows(fmt, n_ordinary + len(cases), n_in, rng, std=0.02)
    blocks = W.reshape(W.shape[0], -1, fmt.type_size)  # a view: (row, block, byte)
    labels = []
    for r, (off, enc, name, bits, whole) in enumerate(cases, start=n_ordinary):
        nbytes = {"e8m0": 1, "f32": 4}.get(enc, 2)
        raw = np.array([bits], f"<u{nbytes}").view(np.uint8)
        if fmt.float_elems:
            elems = blocks[r].reshape(-1, nbytes)
            elems[slice(None) if whole else int(rng.integers(elems.shape[0]))] = raw
        else:
            blocks[r, slice(None) if whole else int(rng.integers(blocks.shape[1])), off:off + nbytes] = raw
        labels.append((r, f"{fmt.name} {'every block' if whole else 'one block'}: {enc} @{off} = {name}"))
    return W, labels


def _assert_same_nonfinite(got, ref, labels):
    """NaN where the reference has NaN, the same signed infinity where it has one, finite elsewhere
    (in the rows of ``labels``, the last axis)."""
    for r, label in labels:
        assert np.array_equal(np.isnan(got[..., r]), np.isnan(ref[..., r])), label
        fin = np.isfinite(ref[..., r])
        assert np.array_equal(got[..., r][~fin & ~np.isnan(ref[..., r])],
                              ref[..., r][~fin & ~np.isnan(ref[..., r])]), label
        assert np.isfinite(got[..., r][fin]).all(), label


@pytest.mark.parametrize("n_tokens", [1, 3])  # 1: the fused one-token dots (moecache/quants/dots.py)
@pytest.mark.parametrize("name", list(FORMATS))
def test_extreme_scales(name, n_tokens, rng):
    """Blocks whose f16 scale fields (d, and m or dmin where the format has one) are subnormal,
    +-inf, NaN, -0 or the largest finite f16; MXFP4 exponents 0, 1, 254, 255; F32/F16/BF16
    elements with the same values. Reference: gguf-py's dequantization, products in float64.

    What the kernels do with them, as gguf-py and ggml do: subnormal scales decode exactly (the
    f16 table maps them to exact float32 values, no flush to zero: whole rows of them give tiny
    non-zero outputs); inf and NaN propagate, inf times a zero quant (or a zero min) is NaN, so a
    K-quant block with an infinite dmin is NaN wherever its min is 0 and -inf elsewhere; MXFP4's
    e = 255 is 2^127 (ggml's half-scaled e8m0), not NaN. dequantize matches gguf-py value for
    value (one float32 rounding allowed; NaN, infinities and rows of subnormal scales exactly:
    their products have at most 24 significant bits); matmul gives NaN and infinities exactly
    where the float64 product of gguf-py's weights does. The kernels are compiled with fastmath,
    under which LLVM may assume no NaN or inf: this test is what holds them to it.
    """
    fmt = FORMATS[name]
    n_in = 512
    W, labels = _extreme_rows(fmt, n_in, rng)
    with np.errstate(invalid="ignore", over="ignore"):
        ref32 = gguf_dequantize(W, fmt.ggml_type)
        ref = ref32.astype(np.float64)
        got = cpu.dequantize(W, fmt.ggml_type, n_in)
        got64 = got.astype(np.float64)
    _assert_same_nonfinite(got.T, ref.T, labels)  # rows of W are the last axis there
    # finite values: one float32 rounding, relative to each block's largest finite value
    bs = fmt.block_size
    fin = np.isfinite(ref).reshape(-1, bs)
    scale = np.where(fin, np.abs(ref).reshape(-1, bs), 0).max(axis=1, keepdims=True)
    err = np.where(fin, np.abs(got64.reshape(-1, bs) - np.where(fin, ref.reshape(-1, bs), 0)), 0)
    assert (err <= 1e-6 * scale).all(), [lab for r, lab in labels if (err.reshape(W.shape[0], -1)[r] > 0).any()]
    for r, label in labels:
        if "every block" in label and "subnormal" in label and "e=" not in label:
            assert np.count_nonzero(got[r]) > n_in // 2, label  # no flush to zero
            np.testing.assert_array_equal(got[r], ref32[r], err_msg=label)  # exact

    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        y_ref = x.astype(np.float64) @ ref.T
        # float32 rounding of n_in products and their sum; float32 subnormal products (F32
        # elements of 1e-45) round to multiples of 2^-149
        bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.where(np.isfinite(ref), np.abs(ref), 0).T) \
            + n_in * 2.0 ** -149
    y = cpu.matmul(W, fmt.ggml_type, x)
    # MXFP4 weights of 2^126..2^129 overflow a float32 sum where float64 does not: not a decoding
    # question, those rows are left out of the product check
    keep = [r for r in range(W.shape[0]) if not any(rr == r and "e=25" in lab for rr, lab in labels)]
    _assert_same_nonfinite(y, y_ref, [(r, lab) for r, lab in labels if r in keep])
    y, y_ref, bound = y[:, keep], y_ref[:, keep], bound[:, keep]
    fin = np.isfinite(y_ref)
    assert (np.abs(y[fin] - y_ref[fin]) <= bound[fin]).all()
