"""CPU backend: numpy arrays, quantized matrices through the Numba kernels of :mod:`moecache.quants.cpu`.

Every method takes and returns float32 numpy arrays. Shapes use T for the tokens of the ubatch.
The GPU backend mirrors these signatures on CuPy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moecache.gguf_file import TensorView
from moecache.quants import cpu
from moecache.quants.formats import format_for

# From this many tokens on, a quantized matmul dequantizes row tiles of W to float32 and calls BLAS
# (compute-bound prefill); below it the Numba kernel streams the quantized rows (memory-bound decode).
BLAS_MIN_TOKENS = 16
# Elements of one dequantized float32 tile of W on the BLAS path (16 MiB).
TILE_ELEMS = 4 << 20


@dataclass(frozen=True)
class Linear:
    """A weight matrix as stored in the GGUF: ``y = x @ W.T``.

    Attributes:
        name: GGUF tensor name (for error messages).
        data: uint8 ``(n_out, row_bytes)`` raw blocks, or for float32 tensors the float32
            ``(n_out, n_in)`` matrix itself; experts add a leading ``n_expert`` axis.
        ggml_type: GGML type id.
        n_in: row length in elements.
    """

    name: str
    data: np.ndarray
    ggml_type: int
    n_in: int

    @property
    def n_out(self) -> int:
        return self.data.shape[-2]

    @property
    def is_f32(self) -> bool:
        return self.data.dtype == np.float32


class NumpyBackend:
    """Array operations on the CPU (numpy + Numba kernels). Stateless apart from the array module."""

    name = "cpu"
    xp = np

    # ---- weights -------------------------------------------------------------------------------
    def linear(self, t: TensorView) -> Linear:
        """Wrap a matrix (or stacked experts) without copying: F32 as float32, others as raw blocks."""
        fmt = format_for(t.ggml_type, t.name)
        if fmt.name == "F32":
            return Linear(t.name, t.data.view(np.float32), t.ggml_type, t.shape[-1])
        return Linear(t.name, t.data, t.ggml_type, t.shape[-1])

    def vector(self, t: TensorView) -> np.ndarray:
        """A 1-D tensor (norm weight, bias) as a float32 array, dequantized if it is F16/BF16/..."""
        if format_for(t.ggml_type, t.name).name == "F32":
            return np.array(t.data.view(np.float32).reshape(-1))
        return cpu.dequantize(t.data.reshape(1, -1), t.ggml_type, t.shape[-1], t.name).reshape(-1)

    def asarray(self, a: np.ndarray) -> np.ndarray:
        """Host array -> backend array (float32 stays float32; a no-op here)."""
        return np.ascontiguousarray(a)

    def to_host(self, a: np.ndarray) -> np.ndarray:
        """Backend array -> numpy array (a no-op here)."""
        return a

    # ---- operations ----------------------------------------------------------------------------
    def matmul(self, w: Linear, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: float32 (T, n_in) -> (T, n_out)."""
        if w.is_f32:
            return x @ w.data.T
        if x.shape[0] < BLAS_MIN_TOKENS:
            return cpu.matmul(w.data, w.ggml_type, x, name=w.name)
        out = np.empty((x.shape[0], w.n_out), np.float32)
        rows = max(1, TILE_ELEMS // w.n_in)
        for r0 in range(0, w.n_out, rows):
            tile = cpu.dequantize(w.data[r0:r0 + rows], w.ggml_type, w.n_in, w.name)
            np.matmul(x, tile.T, out=out[:, r0:r0 + rows])
        return out

    def embed(self, w: Linear, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of an embedding matrix, dequantized: int (T,) -> float32 (T, n_in)."""
        if w.is_f32:
            return w.data[ids]
        return cpu.dequantize(w.data[ids], w.ggml_type, w.n_in, w.name)

    def rms_norm(self, x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        """``x / sqrt(mean(x^2) + eps) * w`` over the last axis (Zhang & Sennrich 2019)."""
        ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        y = x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32)
        return y * w if w is not None else y

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
        """Rotary position embedding (Su et al. 2021) of the first ``2 * cos.shape[1]`` dims of each head.

        Args:
            x: float32 (T, n_heads, head_dim).
            cos, sin: float32 (T, n_rot / 2), the angles ``pos * inv_freq``.
            neox: pairs ``(x[i], x[i + n_rot/2])`` (GPT-NeoX, ggml ``ROPE_TYPE_NEOX``) if True, else
                adjacent pairs ``(x[2i], x[2i+1])`` (ggml ``ROPE_TYPE_NORM``, llama).
        """
        half = cos.shape[1]
        c = cos[:, None, :]
        s = sin[:, None, :]
        out = x.copy()
        if neox:
            a, b = x[..., :half], x[..., half:2 * half]
            out[..., :half] = a * c - b * s
            out[..., half:2 * half] = a * s + b * c
        else:
            a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
            out[..., 0:2 * half:2] = a * c - b * s
            out[..., 1:2 * half:2] = a * s + b * c
        return out

    def attention(self, q: np.ndarray, k_all: np.ndarray, v_all: np.ndarray, pos0: int, scale: float,
                  window: int | None = None, softcap: float | None = None) -> np.ndarray:
        """Causal multi-head attention of T new queries over the cached positions, grouped-query.

        Args:
            q: float32 (T, n_head, head_dim), positions ``pos0 .. pos0 + T - 1``.
            k_all, v_all: the layer's cache, (n_ctx, n_head_kv, head_dim[_v]); positions
                ``0 .. pos0 + T - 1`` must be filled. Query head h reads KV head ``h // (n_head / n_head_kv)``.
            scale: multiplies q.k (usually ``1/sqrt(head_dim)``).
            window: sliding window: query at p sees keys at ``p - window < j <= p`` (llama.cpp
                ``LLAMA_SWA_TYPE_STANDARD``); None = all previous positions.
            softcap: ``softcap * tanh(s / softcap)`` on the scores (gemma2) if set.

        Returns:
            float32 (T, n_head * head_dim_v).
        """
        t, n_head, d = q.shape
        end = pos0 + t
        start = 0 if window is None else max(0, pos0 - window + 1)
        k = k_all[start:end]
        v = v_all[start:end]
        n, n_kv, dv = k.shape[0], k.shape[1], v.shape[2]
        g = n_head // n_kv
        qh = q.reshape(t, n_kv, g, d).transpose(1, 2, 0, 3).reshape(n_kv, g * t, d)
        s = np.matmul(qh, k.transpose(1, 2, 0))  # (n_kv, g*t, n)
        s *= np.float32(scale)
        if softcap:
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        qpos = np.arange(pos0, end)[:, None]
        kpos = np.arange(start, end)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= qpos - kpos < window
        s = s.reshape(n_kv, g, t, n)
        s = np.where(allowed, s, np.float32(-np.inf))
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        o = np.matmul(p.reshape(n_kv, g * t, n), v.transpose(1, 0, 2))  # (n_kv, g*t, dv)
        return np.ascontiguousarray(o.reshape(n_kv, g, t, dv).transpose(2, 0, 1, 3)).reshape(t, n_head * dv)

    def glu(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
        """``act(gate) * up``; act "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation as ggml_gelu)."""
        if act == "silu":
            with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0 gives the right limit, 0
                return gate / (np.float32(1.0) + np.exp(-gate)) * up
        c = np.float32(0.7978845608028654)
        return np.float32(0.5) * gate * (1.0 + np.tanh(c * (gate + np.float32(0.044715) * gate ** 3))) * up
