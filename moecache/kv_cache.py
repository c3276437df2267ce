"""The KV cache: keys and values of every past position, per layer, for one sequence.

Positions are contiguous from 0: the cache holds positions ``0 .. n_past - 1`` and a forward pass
of T tokens appends positions ``n_past .. n_past + T - 1`` (llama.cpp's single-sequence case).
``-c`` (``n_ctx``) is the capacity; a batch that would pass it raises :class:`ContextFullError`
before anything is written, so the cache is never left half-updated.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import numpy as np

from moecache.errors import MoecacheError


class ContextFullError(MoecacheError):
    """The tokens do not fit in the context (``-c``)."""


@dataclass(frozen=True)
class KVShape:
    """Per-layer shape of the cache: ``(n_ctx, n_head_kv, head_dim)`` keys, ``(..., head_dim_v)`` values."""

    n_layer: int
    n_ctx: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int

    def n_bytes(self, itemsize: int = 4) -> int:
        """Bytes of the whole cache at ``itemsize`` bytes per element."""
        return self.n_layer * self.n_ctx * self.n_head_kv * (self.head_dim + self.head_dim_v) * itemsize


class KVCache:
    """Keys and values for ``shape.n_ctx`` positions of every layer.

    Args:
        shape: the sizes (see :class:`KVShape`).
        xp: array module the buffers live in (numpy; cupy on the GPU backend).
        dtype: element type (float32 on the CPU).
        zeros: ``(layer, shape) -> zero array`` to allocate each layer's buffers where that layer
            runs (several devices); default ``xp.zeros``.

    Attributes:
        k, v: lists of ``n_layer`` arrays, ``(n_ctx, n_head_kv, head_dim[_v])``.
        n_past: number of positions filled.
        parent, offset: a :meth:`slice`'s whole cache and the row its positions start at there
            (None and 0 for a cache of its own).
    """

    def __init__(self, shape: KVShape, xp: Any = np, dtype: Any = np.float32,
                 zeros: Callable[[int, tuple[int, ...]], Any] | None = None):
        self.shape = shape
        self.xp = xp
        if zeros is None:
            def zeros(il: int, shp: tuple[int, ...]) -> Any:
                return xp.zeros(shp, dtype)
        self.k = [zeros(il, (shape.n_ctx, shape.n_head_kv, shape.head_dim)) for il in range(shape.n_layer)]
        self.v = [zeros(il, (shape.n_ctx, shape.n_head_kv, shape.head_dim_v)) for il in range(shape.n_layer)]
        self.n_past = 0
        self.parent: KVCache | None = None
        self.offset = 0

    @property
    def n_ctx(self) -> int:
        return self.shape.n_ctx

    def slice(self, start: int, n_ctx: int) -> KVCache:
        """A cache of its own bookkeeping over positions ``start .. start + n_ctx - 1`` of this
        one's buffers (views, no copy): the sequences of a server's slots share one allocation as
        llama-server's do (``-c`` split over ``-np``). ValueError when the range is not inside."""
        if not (0 <= start and 1 <= n_ctx and start + n_ctx <= self.n_ctx):
            raise ValueError(f"slice({start}, {n_ctx}): outside a cache of {self.n_ctx} positions")
        out = object.__new__(KVCache)
        out.shape = KVShape(self.shape.n_layer, n_ctx, self.shape.n_head_kv, self.shape.head_dim, self.shape.head_dim_v)
        out.xp = self.xp
        out.k = [a[start:start + n_ctx] for a in self.k]
        out.v = [a[start:start + n_ctx] for a in self.v]
        out.n_past = 0
        out.parent = self if self.parent is None else self.parent
        out.offset = self.offset + start
        return out

    def check_room(self, n_tokens: int) -> None:
        """Raise ContextFullError unless ``n_tokens`` more positions fit."""
        if self.n_past + n_tokens > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.n_past} positions used + {n_tokens} new > n_ctx {self.n_ctx} (raise -c)")

    def advance(self, n_tokens: int) -> None:
        """Mark ``n_tokens`` more positions as filled (after every layer stored them)."""
        self.check_room(n_tokens)
        self.n_past += n_tokens

    def truncate(self, n_past: int) -> None:
        """Forget positions ``n_past ..`` (keep a common prefix; the data is overwritten later)."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"truncate({n_past}): cache holds {self.n_past} positions")
        self.n_past = n_past

    def clear(self) -> None:
        """Forget every position."""
        self.n_past = 0
