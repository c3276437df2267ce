"""Expert execution: the one interface a MoE layer calls to compute its routed experts.

The model computes the router on its own (architecture-specific gating) and hands the result, a
:class:`Routing`, to an :class:`ExpertExecutor`. :class:`CPUExperts` computes every routed expert
with the Numba kernel :func:`moecache.quants.cpu.moe_ffn` (the plain CPU path, and the miss path of
the expert cache). The expert-cache executor replaces it with the same call signature: split the
routed pairs into hits (resident in VRAM slots, computed on the GPU) and misses (computed here),
run both at once and sum them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from moecache.quants import cpu


@dataclass(frozen=True)
class Routing:
    """Top-k routing of one MoE layer for the T tokens of a ubatch (host arrays).

    Attributes:
        ids: int32 (T, k) expert ids per token, best first.
        weights: float32 (T, k) the weight of each expert's output in the token's sum.
    """

    ids: np.ndarray
    weights: np.ndarray

    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The routed (token, expert) pairs grouped by expert (CSR), as :func:`cpu.moe_ffn` takes them.

        Returns:
            ``(expert_ids int32 (G,), offsets int32 (G+1,), token_rows int32 (P,), weights float32 (P,))``
            with pairs of ``expert_ids[g]`` at ``offsets[g]:offsets[g+1]``, P = T * k.
        """
        t, k = self.ids.shape
        flat = self.ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        sorted_ids = flat[order]
        eids, counts = np.unique(sorted_ids, return_counts=True)
        offsets = np.zeros(eids.shape[0] + 1, np.int32)
        np.cumsum(counts, out=offsets[1:])
        rows = (order // k).astype(np.int32)
        return eids.astype(np.int32), offsets, rows, self.weights.reshape(-1)[order].astype(np.float32)


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts, stacked as in the GGUF (``blk.N.ffn_{gate,up,down}_exps``).

    Attributes:
        gate, up: uint8 (n_expert, expert_ff, row_bytes); down: uint8 (n_expert, n_embd, row_bytes).
        types: GGML type ids of (gate, up, down).
        act: "silu" (SwiGLU) or "gelu" (GeGLU).
    """

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    types: tuple[int, int, int]
    act: str = "silu"


class ExpertExecutor(Protocol):
    """Computes ``sum_k w[t,k] * expert_{ids[t,k]}(h[t])`` for every token t of one layer."""

    def __call__(self, il: int, h: Any, routing: Routing) -> Any:
        """``h``: float32 (T, n_embd) backend array -> float32 (T, n_embd) backend array."""
        ...


class CPUExperts:
    """Every routed expert on the CPU (Numba), straight from the host copy of the weights.

    Args:
        layers: layer index -> that layer's experts.
        backend: the model's backend, for moving h to the host and the result back (a no-op on
            the CPU backend); None = numpy arrays in and out.
    """

    def __init__(self, layers: dict[int, ExpertWeights], backend: Any = None):
        self.layers = layers
        self.backend = backend

    def __call__(self, il: int, h: Any, routing: Routing) -> Any:
        e = self.layers[il]
        eids, offs, rows, wts = routing.groups()
        act = cpu.ACT_SILU if e.act == "silu" else cpu.ACT_GELU
        be = self.backend
        hh = be.to_host(h) if be is not None else h
        out = cpu.moe_ffn(e.gate, e.up, e.down, e.types, eids, offs, rows, wts, hh, act=act)
        return be.asarray(out) if be is not None else out
