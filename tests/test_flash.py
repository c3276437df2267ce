"""The tiled prompt attention's CPU twin (moecache.backends.flash; runs in CI).

The reference is causal grouped-query attention written out here in float64 from its definition
(softmax over the keys each query sees, per head, of the scaled dot products), independent of
moecache's attention code. The twin rounds the queries and each tile's probabilities to float16, so
it may differ from the reference by that rounding and no more; a wrong mask, window, tile bound or
head mapping moves outputs by the size of the values themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends import NumpyBackend
from moecache.backends.flash import FLASH_TILE, flash_attention_twin, flash_ok


@pytest.fixture
def seed() -> int:
    s = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {s}")
    return s


def reference(q, k, v, pos0, scale, window=None, softcap=None):
    """float64 (T, H * D): query t at position pos0 + t, head h, sees keys j of KV head
    h // (H / H_kv) with j <= pos0 + t (and j > pos0 + t - window with a window)."""
    t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros((t, h, v.shape[2]))
    for i in range(t):
        p = pos0 + i
        lo = 0 if not window else max(0, p - window + 1)
        for hh in range(h):
            kk = k[lo:p + 1, hh // g].astype(np.float64)
            s = kk @ q[i, hh].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[i, hh] = w @ v[lo:p + 1, hh // g].astype(np.float64) / w.sum()
    return out.reshape(t, -1)


CASES = [  # T, pos0, n_head, n_kv, head_dim, window, softcap
    (17, 0, 4, 2, 64, None, None),           # the fewest queries the tiled path takes, one tile
    (100, 0, 8, 2, 128, None, None),         # queries and keys across tiles, a partial last tile
    (70, 130, 6, 3, 64, None, None),         # a later ubatch: keys of earlier ones, tiles not at pos0
    (64, 200, 4, 1, 64, 48, None),           # a window: rows start mid-tile, earlier tiles masked out
    (40, 300, 4, 4, 128, None, 20.0),        # plain multi-head, softcap
]


@pytest.mark.parametrize("t,pos0,n_head,n_kv,d,window,softcap", CASES)
def test_twin_is_attention_up_to_float16_rounding(seed, t, pos0, n_head, n_kv, d, window, softcap):
    rng = np.random.default_rng(seed)
    n_ctx = pos0 + t + 9  # rows past the prompt: never read (NaN would show)
    k = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    k[pos0 + t:] = np.nan
    v[pos0 + t:] = np.nan
    q = (rng.standard_normal((t, n_head, d)) * 2).astype(np.float32)  # peaked softmax rows
    scale = 1 / np.sqrt(d)
    got = flash_attention_twin(q, k, v, pos0, scale, window, softcap)
    ref = reference(q, k, v, pos0, scale, window, softcap)
    err = np.abs(got - ref)
    print(f"max |twin - float64| {err.max():.2e}, mean {err.mean():.2e}")
    assert got.dtype == np.float32 and got.shape == (t, n_head * d)
    # q to float16: scores move by ~2^-11 of sum |q k| * scale (~0.02 here); P to float16: 2^-11
    assert err.max() < 1e-2 and err.mean() < 5e-4


def test_twin_rounds_per_tile_and_the_roundings_show(seed):
    """The roundings are there: the twin is not float64 attention (so the GPU test that compares
    the kernel with it checks float16 products), and with all of a row's keys in one tile it
    equals one rounding of q and of P against the row's own maximum."""
    rng = np.random.default_rng(seed)
    t, h, d = 20, 2, 64
    k = rng.standard_normal((t, h, d)).astype(np.float16)
    v = rng.standard_normal((t, h, d)).astype(np.float16)
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    got = flash_attention_twin(q, k, v, 0, 0.125)
    assert np.abs(got - reference(q, k, v, 0, 0.125)).max() > 1e-6
    qr = q.astype(np.float16).astype(np.float64)
    want = np.zeros((t, h, d))
    for i in range(t):
        for hh in range(h):
            s = k[:i + 1, hh].astype(np.float64) @ qr[i, hh] * 0.125
            p = np.exp(s - s.max())
            want[i, hh] = p.astype(np.float16).astype(np.float64) @ v[:i + 1, hh].astype(np.float64) / p.sum()
    np.testing.assert_allclose(got, want.reshape(t, -1), rtol=1e-6, atol=1e-7)
    assert t < FLASH_TILE


def tiled_reference(q, k, v, pos0, scale, window=None):
    """The kernel's recurrence written per row in float64: tiles of keys at multiples of FLASH_TILE
    up to the row's position, the row's keys of a tile only; M, L (unrounded P), O += f16(P) V."""
    t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros((t, h, d))
    qr = q.astype(np.float16).astype(np.float64)
    for i in range(t):
        p = pos0 + i
        first = 0 if not window else max(0, p - window + 1)
        for hh in range(h):
            m, l, o = -np.inf, 0.0, np.zeros(d)
            for j0 in range(0, p + 1, FLASH_TILE):
                keys = np.arange(max(j0, first), min(j0 + FLASH_TILE, p + 1))
                if keys.size == 0:
                    continue
                s = k[keys, hh // g].astype(np.float64) @ qr[i, hh] * scale
                mn = max(m, s.max())
                pr = np.exp(s - mn)
                a = np.exp(m - mn)
                l = l * a + pr.sum()
                o = o * a + pr.astype(np.float16).astype(np.float64) @ v[keys, hh // g].astype(np.float64)
                m = mn
            out[i, hh] = o / l
    return out.reshape(t, -1)


@pytest.mark.parametrize("t,pos0,window", [(150, 0, None), (100, 37, 90), (80, 500, 130)])
def test_twin_tiles_the_keys_at_multiples_of_the_tile(seed, t, pos0, window):
    """Several tiles per row, a window whose start is not a multiple of the tile: the twin's tile
    grid is the one written out per row (tiles of 32 or 128 keys, or tiles from the window's start,
    round other P and fail)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((pos0 + t, 2, 64)).astype(np.float16)
    v = rng.standard_normal((pos0 + t, 2, 64)).astype(np.float16)
    q = (rng.standard_normal((t, 4, 64)) * 2).astype(np.float32)
    np.testing.assert_allclose(flash_attention_twin(q, k, v, pos0, 0.125, window),
                               tiled_reference(q, k, v, pos0, 0.125, window), rtol=1e-6, atol=1e-7)


def test_the_kernels_tile_and_block_are_the_python_ones():
    """ops.cu's PA_BK is FLASH_TILE (the twin's tile grid), its PA_BQ and threads what the GPU
    backend launches with (read from the sources: no CuPy here)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "moecache" / "backends"
    cu = (root / "cuda" / "ops.cu").read_text()
    define = {m.group(1): m.group(2).split("//")[0].strip() for m in re.finditer(r"#define (PA_\w+) (.+)", cu)}
    assert int(define["PA_BK"]) == FLASH_TILE
    warps = int(define["PA_WARPS"])
    assert define["PA_BQ"] == "(16 * PA_WARPS)"
    py = (root / "cupy_backend.py").read_text()
    assert int(re.search(r"^PA_THREADS = (\d+)", py, re.M).group(1)) == 32 * warps
    assert int(re.search(r"^PA_BQ = (\d+)", py, re.M).group(1)) == 16 * warps


def test_which_calls_take_the_tiled_path():
    f16, f32 = np.float16, np.float32
    assert flash_ok(17, 128, 128, f16, f16) and flash_ok(512, 64, 64, f16, f16)
    assert not flash_ok(16, 128, 128, f16, f16)             # a decode-sized ubatch: the decode kernels
    assert not flash_ok(512, 128, 128, f32, f32)            # a float32 cache
    assert not flash_ok(512, 128, 128, f16, f32)            # V's cache float32
    assert not flash_ok(512, 256, 256, f16, f16)            # a head size the kernel is not built for
    assert not flash_ok(512, 128, 64, f16, f16)             # K and V heads of different sizes
    assert not flash_ok(512, 128, 128, f16, f16, np.zeros(512, np.int32))  # a batched step over slots


def test_numpy_backend_takes_the_twin_only_with_act_q8(seed):
    rng = np.random.default_rng(seed)
    t, n_ctx, h, d = 40, 64, 4, 64
    k = rng.standard_normal((n_ctx, 2, d)).astype(np.float16)
    v = rng.standard_normal((n_ctx, 2, d)).astype(np.float16)
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    pos = np.arange(5, 5 + t)
    twin = NumpyBackend(act_q8=True).attention(q, k, v, pos, 0.125)
    np.testing.assert_array_equal(twin, flash_attention_twin(q, k, v, 5, 0.125))
    plain = NumpyBackend().attention(q, k, v, pos, 0.125)
    np.testing.assert_allclose(plain, reference(q, k, v, 5, 0.125), rtol=1e-4, atol=1e-5)
    assert np.abs(twin - plain).max() > 1e-6
    few = NumpyBackend(act_q8=True).attention(q[:16], k, v, pos[:16], 0.125)  # 16 queries: not tiled
    np.testing.assert_array_equal(few, NumpyBackend().attention(q[:16], k, v, pos[:16], 0.125))
