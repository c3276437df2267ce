"""Prompt attention in key tiles with an online softmax: which calls the GPU's tensor-core kernel
takes (``attn_prompt_*`` of ``moecache/backends/cuda/ops.cu``), and its CPU twin.

The scheme is FlashAttention-2's (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", Algorithm 1): the keys go in tiles of :data:`FLASH_TILE`; per
query row a running maximum M and sum L of ``e^(s - M)``; the output accumulates ``P V`` of each tile
after the rows' earlier sums are scaled by ``e^(M_old - M_new)``. No scores block is materialized:
the prompt's attention needs no memory beyond its output.

With float16 products (the GPU's default arithmetic, ``act_q8``) the query rows and each tile's
``P = e^(s - M)`` are rounded to float16 before their products (the cache's K and V are float16
already); sums stay float32. :func:`flash_attention_twin` reproduces exactly that order of roundings
(the tile grid included: it changes M, hence which P round), so ``NumpyBackend(act_q8=True)`` runs the
GPU's default arithmetic. Without ``act_q8`` the kernel splits Q and P in two float16 parts (as the
decode kernel ``attn_gqa_mma_t`` does) and matches float32 attention to float rounding; its CPU twin
is then :meth:`moecache.backends.ops.ArrayOps.attention` itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moecache.backends.ops import DECODE_MAX_TOKENS

FLASH_TILE = 64  # keys per tile (PA_BK of ops.cu); tiles start at multiples of it
FLASH_HEAD_DIMS = (64, 128)  # head sizes the kernel is compiled for (attn_prompt_d2*, attn_prompt_d4*)


def flash_ok(n_tok: int, head_dim: int, head_dim_v: int, k_dtype: Any, v_dtype: Any, kv_base: Any = None) -> bool:
    """Whether a prompt's attention takes the tiled path: more than :data:`DECODE_MAX_TOKENS` queries
    of one sequence (``kv_base`` None), float16 K and V caches, K and V heads of one size in
    :data:`FLASH_HEAD_DIMS`. (The GPU also needs sm_80+ and contiguous, 16-byte aligned caches.)"""
    return (kv_base is None and n_tok > DECODE_MAX_TOKENS and head_dim == head_dim_v
            and head_dim in FLASH_HEAD_DIMS and np.dtype(k_dtype) == np.float16 and np.dtype(v_dtype) == np.float16)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def flash_attention_twin(q: np.ndarray, k_all: np.ndarray, v_all: np.ndarray, pos0: int, scale: float,
                         window: int | None = None, softcap: float | None = None) -> np.ndarray:
    """Causal grouped-query attention as the GPU's ``attn_prompt`` kernel computes it by default.

    Args:
        q: float32 (T, n_head, D), positions ``pos0 .. pos0 + T - 1``.
        k_all, v_all: float16 (n_ctx, n_head_kv, D), positions ``0 .. pos0 + T - 1`` filled; query
            head h reads KV head ``h // (n_head / n_head_kv)``.
        scale: multiplies q.k; window: sliding window (keys ``p - window < j <= p``; None or 0: all);
            softcap: ``softcap * tanh(s / softcap)`` on the scaled scores if set (positive).

    Returns:
        float32 (T, n_head * D).

    The order of roundings is the kernel's: q rounded to float16; per tile of :data:`FLASH_TILE`
    keys (tiles at multiples of it), ``s = q.k * scale`` (then the softcap), masked keys ``-inf``,
    ``M_new = max(M, max s)``, ``P = e^(s - M_new)``, ``L = L e^(M - M_new) + sum P`` (P unrounded),
    ``O = O e^(M - M_new) + f16(P) V``; the output is ``O / L``. Sums in float64 here, float32 on
    the GPU: the two agree to float32 rounding, but for the rare P within that of a float16
    rounding boundary.
    """
    t, h, d = q.shape
    n_kv = k_all.shape[1]
    g = h // n_kv
    end = pos0 + t
    window = window if window and window > 0 else None  # the kernel's reading: 0 or less, no window
    lo = 0 if not window else max(0, pos0 - window + 1)
    lo -= lo % FLASH_TILE
    qh = _f16(q).reshape(t, n_kv, g, d).transpose(1, 2, 0, 3)  # (n_kv, g, T, D)
    qpos = np.arange(pos0, end)[:, None]
    m = np.full((n_kv, g, t), -np.inf)
    l = np.zeros((n_kv, g, t))
    o = np.zeros((n_kv, g, t, d))
    for k0 in range(lo, end, FLASH_TILE):
        k1 = min(end, k0 + FLASH_TILE)
        kt = k_all[k0:k1].astype(np.float64).transpose(1, 0, 2)  # (n_kv, n, D)
        vt = v_all[k0:k1].astype(np.float64).transpose(1, 0, 2)
        s = np.einsum("kgtd,knd->kgtn", qh, kt) * scale
        if softcap and softcap > 0:
            s = softcap * np.tanh(s / softcap)
        kpos = np.arange(k0, k1)[None, :]
        ok = kpos <= qpos
        if window:
            ok &= kpos > qpos - window
        s = np.where(ok, s, -np.inf)
        mn = np.maximum(m, s.max(axis=-1))
        live = np.isfinite(mn)
        with np.errstate(invalid="ignore"):
            alpha = np.where(live, np.exp(np.where(live, m - mn, 0.0)), 1.0)
            p = np.where(live[..., None], np.exp(s - np.where(live, mn, 0.0)[..., None]), 0.0)
        l = l * alpha + p.sum(axis=-1)
        o = o * alpha[..., None] + np.einsum("kgtn,knd->kgtd", _f16(p), vt)
        m = mn
    out = o / l[..., None]  # every query sees its own key: L > 0
    return out.transpose(2, 0, 1, 3).reshape(t, h * d).astype(np.float32)
