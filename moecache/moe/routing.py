"""Top-k expert routing: the :class:`Routing` of one MoE layer and the softmax top-k that makes it.

A Routing may hold backend arrays (on the GPU backend the router runs on the device and the ids
never leave it when every expert is resident); :meth:`Routing.host` brings a numpy copy for the
consumers that need one (the CPU experts, the route observers, the expert cache's bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Routing:
    """Top-k routing of one MoE layer for the T tokens of a ubatch.

    Attributes:
        ids: int32 (T, k) expert ids per token, best first (numpy or backend array).
        weights: float32 (T, k) the weight of each expert's output in the token's sum.
    """

    ids: Any
    weights: Any
    _host: list = field(default_factory=list, repr=False, compare=False)

    @property
    def on_host(self) -> bool:
        return isinstance(self.ids, np.ndarray)

    def host(self) -> Routing:
        """This routing with numpy arrays (a device-to-host copy the first time, if on a device)."""
        if self.on_host:
            return self
        if not self._host:
            self._host.append(Routing(np.asarray(self.ids.get(), np.int32), np.asarray(self.weights.get(), np.float32)))
        return self._host[0]

    def host_ids(self) -> np.ndarray:
        """int32 (T, k) numpy ids: the host copy's if there is one, else only the ids are copied (a
        consumer that keeps the weights on the device saves the weights' copy and its wait)."""
        if self.on_host:
            return np.asarray(self.ids, np.int32)
        if self._host:
            return self._host[0].ids
        return np.asarray(self.ids.get(), np.int32)

    def groups(self, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The routed (token, expert) pairs grouped by expert (CSR), as :func:`moecache.quants.cpu.moe_ffn`
        takes them; with ``mask`` (bool (T, k)) only the pairs it selects (the expert cache's misses).

        Returns:
            ``(expert_ids int32 (G,), offsets int32 (G+1,), token_rows int32 (P,), weights float32 (P,))``
            with pairs of ``expert_ids[g]`` at ``offsets[g]:offsets[g+1]``, P = T * k, tokens in
            increasing order within a group; P = the selected pairs with a mask.
        """
        h = self.host()
        t, k = h.ids.shape
        flat = h.ids.reshape(-1)
        if mask is None:
            order = np.argsort(flat, kind="stable")
        else:
            sel = np.flatnonzero(np.asarray(mask).reshape(-1))
            order = sel[np.argsort(flat[sel], kind="stable")]
        eids, counts = np.unique(flat[order], return_counts=True)
        offsets = np.zeros(eids.shape[0] + 1, np.int32)
        np.cumsum(counts, out=offsets[1:])
        rows = (order // k).astype(np.int32)
        return eids.astype(np.int32), offsets, rows, h.weights.reshape(-1)[order].astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def topk_routing(probs: np.ndarray, k: int, renorm: bool, scale: float | None = None) -> Routing:
    """The k largest of ``probs`` (T, n_expert) per token (ties: lower id first), their probabilities
    as weights.

    ``renorm`` divides the k weights by their sum (llama.cpp ``norm_w``; Qwen3-MoE
    ``norm_topk_prob``); ``scale`` multiplies them (``expert_weights_scale``).
    """
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(probs, ids, axis=-1).astype(np.float32)
    if renorm:
        w = w / w.sum(axis=-1, keepdims=True)
    if scale and scale != 1.0:  # 0 means unset, as in llama.cpp
        w = w * np.float32(scale)
    return Routing(ids, w.astype(np.float32))
