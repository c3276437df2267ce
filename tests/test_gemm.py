"""The prompt GEMMs' cuBLAS arguments (moecache.backends.gemm), checked on the CPU: the column-major
emulation of the call that :func:`rows_times_weights_t` builds gives ``X @ W.T`` per batch entry,
against numpy's float64 product of the row-major arrays."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends.gemm import OP_N, OP_T, GemmCall, emulate, rows_times_weights_t


@pytest.mark.parametrize("batch,t,n_out,n_in", [(1, 17, 40, 64), (5, 3, 7, 96), (3, 33, 256, 32)])
def test_rows_times_weights_t_is_x_times_w_transposed(rng, batch, t, n_out, n_in):
    x = rng.standard_normal((batch, t, n_in)).astype(np.float16)
    w = rng.standard_normal((batch, n_out, n_in)).astype(np.float16)
    call = rows_times_weights_t(batch, t, n_out, n_in)
    y = np.full(batch * t * n_out, np.nan, np.float64)
    emulate(call, w.reshape(-1), x.reshape(-1), y)  # A = W, B = X, C = Y, as the backend passes them
    ref = np.einsum("bti,boi->bto", x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(y.reshape(batch, t, n_out), ref, rtol=1e-12, atol=1e-12)


def test_emulate_follows_both_operations(rng):
    """A column-major A stored untransposed and B transposed: C = A @ B^T, with leading dimensions
    larger than the rows (padding that must be skipped)."""
    m, n, k, lda, ldb, ldc = 4, 3, 5, 6, 7, 5
    a = rng.standard_normal(lda * k)
    b = rng.standard_normal(ldb * k)
    c = np.full(ldc * n, np.nan)
    emulate(GemmCall(OP_N, OP_T, m, n, k, lda, ldb, ldc, 0, 0, 0, 1), a, b, c)
    A = a.reshape(k, lda).T[:m]  # column j of A at a[j * lda:]
    B = b.reshape(k, ldb).T[:n]  # B is n x k column-major; op(B) = B^T
    np.testing.assert_allclose(c.reshape(n, ldc).T[:m], A @ B.T, rtol=1e-12)
    assert np.isnan(c.reshape(n, ldc)[:, m:]).all()  # the padding rows of C are not written


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="positive"):
        rows_times_weights_t(1, 0, 4, 4)
    call = rows_times_weights_t(2, 3, 4, 5)
    with pytest.raises(ValueError, match="does not fit"):
        emulate(call, np.zeros(4 * 5), np.zeros(2 * 3 * 5), np.zeros(2 * 3 * 4))  # one W for two
