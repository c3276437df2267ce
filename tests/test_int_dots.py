"""The CPU's 8-bit-activation integer dots (moecache/quants/int_dots.py), in CI.

References are independent of the code under test: the rounding rule written out per element
(tests/test_act_q8.py's ``rule``), the weights dequantized by gguf-py in float64. The IR is checked
on both of its roads on any machine: the one the host compiles (through the Numba kernels) and the
portable one, run through llvmlite's MCJIT; where the host has AVX512-VNNI the two must agree.
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from numba import njit
from test_act_q8 import rule

from moecache.quants import int_dots
from moecache.quants.formats import FORMATS
from moecache.quants.random_blocks import random_rows

# format -> (its row dot, the IR symbol, where its f16 d sits in a block, the block's bytes)
ROADS = {"Q8_0": (int_dots.q80_row_dot, "moecache_q80_q8_row", 0, 34),
         "Q4_K": (int_dots.q4k_row_dot, "moecache_q4k_q8_row", 0, 144),
         "Q5_K": (int_dots.q5k_row_dot, "moecache_q5k_q8_row", 0, 176),
         "Q6_K": (int_dots.q6k_row_dot, "moecache_q6k_q8_row", 208, 210)}


def _activations(rng, n: int) -> np.ndarray:
    x = (rng.standard_normal(n) * rng.uniform(0.01, 100)).astype(np.float32)
    x[32:64] = 0.0  # a unit of zeros: scale 0
    x[100] = 1e6 * (1 + abs(x[100]))  # one large value: its unit's others round to 0
    return x


def _quantize(x: np.ndarray):
    n = x.shape[0]
    q, r = np.empty(n, np.int8), np.empty(n, np.float32)
    d, s = np.empty(n // 32, np.float32), np.empty(n // 32, np.float32)
    int_dots.quantize_row(x, q, d, s, r)
    return q, d, s, r


def test_quantize_row_follows_the_rule(rng):
    x = _activations(rng, 512)
    q, d, s, r = _quantize(x)
    want = rule(x)
    np.testing.assert_array_equal(r.astype(np.float64), want.astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(q.astype(np.float64) * d.repeat(32), want)  # q * d, exact in float64
    sums = q.astype(np.int64).reshape(-1, 32).sum(1)
    np.testing.assert_array_equal(s, (sums.astype(np.float32) * d))
    assert d[1] == 0 and not q[32:64].any()
    for bad in (np.inf, np.nan):  # a non-finite value: its unit's scale and values NaN, the others kept
        y = x.copy()
        y[70] = bad
        _, d2, s2, r2 = _quantize(y)
        assert np.isnan(d2[2]) and np.isnan(s2[2]) and np.isnan(r2[64:96]).all()
        np.testing.assert_array_equal(np.delete(r2, np.s_[64:96]), np.delete(r, np.s_[64:96]))


def _rows_of(dot):
    @njit
    def rows(W, q, d, s):
        out = np.empty(W.shape[0], np.float32)
        for i in range(W.shape[0]):
            out[i] = dot(W[i], q, d, s)
        return out
    return rows


_ROWS = {name: _rows_of(road[0]) for name, road in ROADS.items()}


def _check_rows(y: np.ndarray, W: np.ndarray, x: np.ndarray, fmt: str) -> None:
    """y against gguf-py's float64 weights times the rule's activations: within 5e-5 of the sum
    of the products' magnitudes (float32 scales and sums; the scale and the min term of a Q4_K
    weight, and the offset 32 of a Q6_K quant, are summed apart, and each can exceed the weight
    itself, so 1e-5 is not always kept)."""
    Wf = gguf_dequantize(W, FORMATS[fmt].ggml_type).astype(np.float64)
    xr = rule(x)
    ref = Wf @ xr
    bound = np.abs(Wf) @ np.abs(xr)
    assert (np.abs(y.astype(np.float64) - ref) <= 5e-5 * bound).all()


@pytest.mark.parametrize("fmt", sorted(ROADS))
@pytest.mark.parametrize("n_in", [256, 2048])
def test_row_dot_matches_gguf(fmt, n_in, rng):
    W = random_rows(FORMATS[fmt], 24, n_in, rng, std=0.05)
    at = ROADS[fmt][2]
    W[1, at:at + 2] = (0x05, 0x00)  # a subnormal f16 d (the IR widens halves with integer ops)
    W[2, at:at + 2] = (0x10, 0x83)  # a negative subnormal one
    x = _activations(rng, n_in)
    q, d, s, _ = _quantize(x)
    _check_rows(_ROWS[fmt](W, q, d, s), W, x, fmt)


@pytest.mark.parametrize("n_in", [32, 96, 288])
def test_q8_0_row_dot_of_an_odd_block_count(n_in, rng):
    """Q8_0's dot takes blocks two at a time and an odd last one alone: rows of 1, 3 and 9 blocks
    against gguf-py, through the kernels' road and the portable IR."""
    W = random_rows(FORMATS["Q8_0"], 12, n_in, rng, std=0.05)
    x = _activations(rng, max(n_in, 128))[:n_in]
    q, d, s, _ = _quantize(x)
    y = _ROWS["Q8_0"](W, q, d, s)
    _check_rows(y, W, x, "Q8_0")
    keep, portable = _mcjit(False)
    yp = np.array([_call(portable["Q8_0"], W[i], q, d, s, 34) for i in range(W.shape[0])])
    np.testing.assert_allclose(yp, y, rtol=1e-6, atol=0)
    assert keep is not None


def test_rows_q8_takes_the_integer_dots(rng):
    """``cpu.rows_q8`` (the MoE kernel's products with 8-bit activations) gives each ROW_DOTS
    format's integer dot bit for bit, not the float kernel on the rounded values (whose sums
    round differently)."""
    from moecache.quants import cpu
    from moecache.quants.cpu import STEP

    def via_rows_q8(fmt_id):
        @njit
        def run(W, q, d, s, x):  # (fmt_id: a closure constant, as the kernels' format ids are)
            Q, D, S, X = q.reshape(1, -1), d.reshape(1, -1), s.reshape(1, -1), x.reshape(1, -1)
            Y = np.zeros((1, W.shape[0]), np.float32)
            qrow = np.zeros(1, np.int32)
            bad = np.zeros(1, np.int32)
            cpu.rows_q8(fmt_id, W, Q, D, S, qrow, X, S, Y, 0, W.shape[0], 0, 1, STEP, bad)
            return Y[0]
        return run

    for fmt in sorted(ROADS):
        n_in = 256 if fmt != "Q8_0" else 96
        W = random_rows(FORMATS[fmt], 8, n_in, rng, std=0.05)
        x = _activations(rng, 128 if n_in < 128 else n_in)[:n_in]
        q, d, s, r = _quantize(x)
        got = via_rows_q8(FORMATS[fmt].ggml_type)(W, q, d, s, r)
        np.testing.assert_array_equal(got, _ROWS[fmt](W, q, d, s), err_msg=fmt)


def _mcjit(vnni: bool):
    """The IR's function compiled by llvmlite's MCJIT as a ctypes function: the VNNI road for the
    host CPU; the portable road for a generic x86-64 (no AVX, no F16C: what any CPU can run)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = llvm.parse_assembly(int_dots.module_ir(vnni))
    mod.verify()
    cpu, feats = (llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()) if vnni else ("generic", "")
    tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=feats, opt=2)
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    proto = ctypes.CFUNCTYPE(ctypes.c_uint32, *[ctypes.c_void_p] * 4, ctypes.c_int64)  # the float's bits
    return engine, {name: proto(engine.get_function_address(road[1])) for name, road in ROADS.items()}


def _call(fn, row, q, d, s, block_bytes) -> np.float32:
    bits = fn(row.ctypes.data, q.ctypes.data, d.ctypes.data, s.ctypes.data, row.shape[0] // block_bytes)
    return np.array([bits], np.uint32).view(np.float32)[0]


@pytest.mark.parametrize("fmt", sorted(ROADS))
def test_portable_ir_matches_gguf_and_the_vnni_road(fmt, rng):
    """The portable IR, compiled for a generic x86-64 (what a CPU without AVX512-VNNI runs), against
    the reference on any machine; where the host has VNNI, its ``vpdpbusd`` road gives the same
    floats."""
    W = random_rows(FORMATS[fmt], 16, 1024, rng, std=0.05)
    x = _activations(rng, 1024)
    q, d, s, _ = _quantize(x)
    nbytes = ROADS[fmt][3]
    keep, portable = _mcjit(False)
    y = np.array([_call(portable[fmt], W[i], q, d, s, nbytes) for i in range(W.shape[0])])
    _check_rows(y, W, x, fmt)
    np.testing.assert_allclose(_ROWS[fmt](W, q, d, s), y, rtol=1e-6, atol=0)  # the kernels' road
    if int_dots.host_has_vnni():
        keep2, vnni = _mcjit(True)
        yv = np.array([_call(vnni[fmt], W[i], q, d, s, nbytes) for i in range(W.shape[0])])
        np.testing.assert_array_equal(yv, y)
    assert keep is not None


def test_row_dots_prefetch_the_weights_ahead():
    """Each row dot asks for the weights ``PREFETCH_BYTES`` ahead of the block it reads, one request
    per 64 bytes of a loop step, so consecutive steps cover every line of a row
    (bench/results/kernels-2core-prefetch.md: without it a core waits for each line)."""
    mod = llvm.parse_assembly(int_dots.module_ir(False))
    steps = {"moecache_q4k_q8_row": int_dots.Q4_K_BYTES, "moecache_q5k_q8_row": int_dots.Q5_K_BYTES,
             "moecache_q6k_q8_row": int_dots.Q6_K_BYTES, "moecache_q80_q8_row": 2 * int_dots.Q8_0_BYTES}
    for sym, step in steps.items():
        text = str(mod.get_function(sym))
        assert text.count("call void @llvm.prefetch") == -(-step // 64), sym
        offs = sorted(int(line.split("i64 ")[-1]) for line in text.splitlines() if "%pf" in line and "getelementptr" in line)
        assert offs == [int_dots.PREFETCH_BYTES + 64 * i for i in range(len(offs))], sym


def test_prefetcher_for_covers_each_fused_dots_step():
    """The float kernels' step (256 weights) of every fused-dot format gets one prefetch request per
    64 bytes; a step beyond the prepared line counts is refused, not mapped to a wrong count."""
    from moecache.quants.dots import DOTS

    for name in DOTS:
        f = FORMATS[name]
        step = 256 // f.block_size * f.type_size
        assert int_dots.prefetcher_for(step) is int_dots._PREFETCHERS[-(-step // 64)], name
    with pytest.raises(ValueError, match="bytes"):
        int_dots.prefetcher_for(64 * max(int_dots.PREFETCH_LINES) + 1)


def test_float_dots_prefetch_except_those_measured_without():
    """The float kernels' one-token step (``cpu.dot_step``) asks for the weights ahead in every
    fused-dot format but those of ``cpu.FLOAT_DOTS_WITHOUT_PREFETCH`` (Q8_0: its rows read 79 GB/s
    on the H200 without the prefetch and 44 with it, bench/results/kernels-h200-prefetch.md): the
    compiled step's LLVM IR holds ``llvm.prefetch`` calls exactly when it should."""
    from numba import njit

    from moecache.quants import cpu
    from moecache.quants.dots import DOTS

    assert cpu.FLOAT_DOTS_WITHOUT_PREFETCH == {"Q8_0"}
    for name in ("Q8_0", "Q4_K"):
        assert name in DOTS
        f = FORMATS[name]
        fid = f.ggml_type
        step = njit(lambda row, x, xs: cpu.dot_step(fid, row, 0, x, 0, xs, 0, 8))
        step(np.zeros(2 * (256 // f.block_size) * f.type_size, np.uint8), np.zeros(512, np.float32),
             np.zeros(16, np.float32))
        text = "\n".join(step.inspect_llvm().values())
        calls = sum("call void @llvm.prefetch" in line for line in text.splitlines())
        assert (calls == 0) == (name in cpu.FLOAT_DOTS_WITHOUT_PREFETCH), (name, calls)
