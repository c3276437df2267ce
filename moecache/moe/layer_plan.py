"""The layer plan: how many of the pool's slots each MoE layer gets, and which path its misses take.

Why (issue 19; ``bench/results/miss-split-h200.md``, ``static-h200-s28.md``): at flat routing the
per-expert policy spreads the slots over every layer, so every layer keeps ~5.6 misses per token and
pays for them one by one over the link (~60 us each on the H200), while the static placement
(``-ncmoe``) makes whole layers free of misses and hands the other layers' eight experts to the CPU
in one call per layer: 70.7 t/s against the cache's 54.5 at 8 GiB with uniform routing. A layer's
miss cost is not linear in its misses: the CPU path has a fixed cost per layer that only a layer
with no miss at all avoids.

Model, per layer ``l`` holding its ``s`` most used experts in slots (``u`` the policy's usage: the
average fraction of tokens that route to an expert, so a layer's usages sum to ``top_k``):

- expected misses per token ``m(s) = sum of u over the experts not held``;
- probability that a token misses at all ``p(s) = 1 - prod(1 - u)`` over them (experts taken as
  independent: an approximation of top-k routing);
- the link path (the GPU reads each miss over PCIe, zero-copy): ``t_link * m(s)``;
- the CPU path (the layer's misses handed to the CPU in one call, :mod:`moecache.moe.handoff`):
  ``t_fixed * p(s) + t_cpu * m(s)``;
- the layer's cost is the cheaper path (or the link path when there is no CPU path).

The plan minimises the sum over layers under ``sum(s) <= n_slots``, exactly, by dynamic programming
over layers and slot counts (per-layer costs are not convex, so a greedy per-slot choice would not
find whole layers). Ties give slots to later layers: the host's accounting of a pass then runs
while the GPU computes the last (miss-free) layers instead of after them. Within a layer, held
experts rank by ``u``, residents' usage counted ``1 + keep_bonus`` times (so near-equal usages do not
swap residents back and forth).

At flat routing whole layers win (a layer's last slots save its fixed cost too); with local routing
a layer's hot set covers most of its tokens and the plan holds hot sets, as the per-expert policy does.
"""

from __future__ import annotations

from dataclasses import dataclass

from moecache.quants import _numba_setup  # noqa: F401  (configures numba before any @njit)

import numpy as np
from numba import njit

TIE_SLOPE = 1e-6  # layer l's miss cost counts (1 + TIE_SLOPE * l) times: ties go to later layers


@dataclass(frozen=True)
class MissCosts:
    """Seconds per token of a layer's misses, by path.

    Attributes:
        t_link: one miss read by the GPU over PCIe from page-locked host RAM (expert bytes / the
            zero-copy read rate).
        t_cpu: one miss computed on the CPU (expert bytes / the CPU kernels' read rate).
        t_fixed: what a layer pays once when the CPU computes any of its misses (the handoff's
            round trip, the parallel region's fork and join).
        cpu: whether the CPU path exists (the expert cache's host handoff); False: link only.
    """

    t_link: float
    t_cpu: float
    t_fixed: float
    cpu: bool = True

    def validate(self) -> None:
        if min(self.t_link, self.t_cpu, self.t_fixed) < 0:
            raise ValueError(f"miss costs must be >= 0, got {self}")


@dataclass(frozen=True)
class LayerPlan:
    """One plan.

    Attributes:
        slots: int64 (n_layer,) slots per layer.
        cpu: bool (n_layer,) the layer's misses go to the CPU (else the GPU reads them over the link).
        target: bool (n_layer, n_expert) the experts the plan holds in slots.
        cost: predicted seconds per token of every layer's misses.
    """

    slots: np.ndarray
    cpu: np.ndarray
    target: np.ndarray
    cost: float


def _costs(u_sorted: np.ndarray, costs: MissCosts) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and slot count ``s`` (0..n_expert): the misses' cost and whether the CPU path is
    the cheaper, from usages sorted descending per layer (float (n_layer, n_expert)). Returns
    (float64 (n_layer, n_expert + 1), bool (n_layer, n_expert + 1))."""
    n_layer, n_expert = u_sorted.shape
    u = np.clip(u_sorted, 0.0, 1.0 - 1e-12)
    m = np.zeros((n_layer, n_expert + 1))
    m[:, :-1] = np.cumsum(u[:, ::-1], axis=1)[:, ::-1]  # misses when the first s are held
    keep = np.ones((n_layer, n_expert + 1))
    keep[:, :-1] = np.exp(np.cumsum(np.log1p(-u[:, ::-1]), axis=1)[:, ::-1])  # P(no miss)
    link = costs.t_link * m
    if costs.cpu:
        cpu = costs.t_fixed * (1.0 - keep) + costs.t_cpu * m
        on_cpu = cpu < link
        cost = np.where(on_cpu, cpu, link)
    else:
        on_cpu = np.zeros(m.shape, bool)
        cost = link
    cost = cost * (1.0 + TIE_SLOPE * np.arange(n_layer))[:, None]
    return cost, on_cpu


def plan_layers(usage: np.ndarray, n_slots: int, costs: MissCosts, resident: np.ndarray | None = None,
                keep_bonus: float = 0.5) -> LayerPlan:
    """The plan of least predicted miss cost for ``n_slots`` slots.

    Args:
        usage: float (n_layer, n_expert) the policy's usage (fraction of tokens per expert); rows of
            layers the pool does not hold are zero (they get no slots).
        n_slots: slots in the pool (>= 0).
        costs: the paths' costs (:class:`MissCosts`).
        resident: bool (n_layer, n_expert) experts in slots now (their usage ranks ``1 + keep_bonus``
            times higher within their layer), or None.
        keep_bonus: see ``resident``.

    Returns:
        A :class:`LayerPlan`. Raises ValueError for a negative ``n_slots`` or costs.
    """
    costs.validate()
    if n_slots < 0:
        raise ValueError(f"n_slots must be >= 0, got {n_slots}")
    usage = np.asarray(usage, np.float64)
    n_layer, n_expert = usage.shape
    rank = usage if resident is None else usage * np.where(resident, 1.0 + keep_bonus, 1.0)
    order = np.argsort(-rank, axis=1, kind="stable")
    u_sorted = np.take_along_axis(usage, order, axis=1)
    cost, on_cpu = _costs(u_sorted, costs)
    budget = min(int(n_slots), n_layer * n_expert)
    slots = _allocate(cost, budget)
    target = np.zeros((n_layer, n_expert), bool)
    for il in range(n_layer):
        target[il, order[il, :slots[il]]] = True
    idx = np.arange(n_layer)
    return LayerPlan(slots, on_cpu[idx, slots].copy(), target,
                     float((cost[idx, slots] / (1.0 + TIE_SLOPE * idx)).sum()))


def held_cost(usage: np.ndarray, held: np.ndarray, costs: MissCosts) -> float:
    """Predicted seconds per token of every layer's misses with the experts ``held`` (bool
    (n_layer, n_expert)) in slots, each layer on its cheaper path (the model above)."""
    u = np.clip(np.asarray(usage, np.float64), 0.0, 1.0 - 1e-12)
    out = np.where(held, 0.0, u)
    m = out.sum(axis=1)
    link = costs.t_link * m
    if not costs.cpu:
        return float(link.sum())
    cpu = costs.t_fixed * (1.0 - np.exp(np.log1p(-out).sum(axis=1))) + costs.t_cpu * m
    return float(np.minimum(link, cpu).sum())


@njit(cache=True, nogil=True)
def _allocate(cost, budget):  # pragma: no cover - compiled
    """Slots per layer (int64 (n_layer,)) minimising ``sum(cost[l, s_l])`` under ``sum(s_l) <=
    budget`` (cost float64 (n_layer, n_expert + 1)): dynamic programming over layers, the smallest
    ``s`` on a tie."""
    n_layer, width = cost.shape
    best = np.zeros(budget + 1)
    choice = np.zeros((n_layer, budget + 1), np.int16)
    nxt = np.empty(budget + 1)
    for il in range(n_layer):
        for b in range(budget + 1):
            v = best[b] + cost[il, 0]
            c = 0
            top = min(width - 1, b)
            for s in range(1, top + 1):
                w = best[b - s] + cost[il, s]
                if w < v:
                    v = w
                    c = s
            nxt[b] = v
            choice[il, b] = c
        best[:] = nxt
    slots = np.zeros(n_layer, np.int64)
    b = budget
    for il in range(n_layer - 1, -1, -1):
        s = choice[il, b]
        slots[il] = s
        b -= s
    return slots
