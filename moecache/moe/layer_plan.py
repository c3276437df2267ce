"""The layer plan: how many of the pool's slots each MoE layer gets, and which path its misses take.

Why (issue 19; ``bench/results/miss-split-h200.md``, ``static-h200-s28.md``): at flat routing the
per-expert policy spreads the slots over every layer, so every layer keeps ~5.6 misses per token and
pays for them one by one over the link (~60 us each on the H200), while the static placement
(``-ncmoe``) makes whole layers free of misses and hands the other layers' eight experts to the CPU
in one call per layer (70.7 t/s against the cache's 54.5 at 8 GiB with uniform routing in the
twenty-eighth session's processes; level, 55.9 and 55.4, in one lease of the twenty-ninth: the gain
measured since is from splitting those layers' misses between the CPU and the link, below). A layer's
miss cost is not linear in its misses: the CPU path has a fixed cost per layer that only a layer
with no miss at all avoids.

Model, per layer ``l`` holding its ``s`` most used experts in slots (``u`` the policy's usage: the
average fraction of tokens that route to an expert, so a layer's usages sum to ``top_k``):

- expected misses per token ``m(s) = sum of u over the experts not held``; a token's misses ``x``
  taken as binomial over its ``top_k`` experts, each a miss with probability ``m(s) / top_k`` (an
  approximation of top-k routing; a token has at most ``top_k`` misses);
- share 0, the link path (the GPU reads each miss over PCIe, zero-copy): ``t_link * x``;
- a share ``c`` of 1..``max_share`` (the host handoff, :mod:`moecache.moe.handoff`: the CPU takes up
  to ``c`` of the token's misses in one call while the GPU reads the others over the link, both at
  once): ``max(t_fixed + t_cpu * min(x, c), t_link * (x - min(x, c)))`` when ``x > 0``, else 0;
- a layer costs the expectation over ``x`` at its cheapest share (the expectation of the maximum,
  not the maximum of expectations: a token with one miss pays the CPU's fixed cost in full);
- a pass of several tokens (``serve``'s batched steps, :attr:`MissCosts.tokens`) makes one CPU call
  per layer for all of them: the fixed cost is paid once a pass (:func:`_share_costs`). Measured
  (H200, 8 GiB, qwen3-moe routing, 8 streams, ``bench/results/serve-h200.md``): 229.3 t/s with this
  cost against 181.4 with the one-token cost, which gave no layer a CPU share at ~1.2 misses a token
  (one run each, on two machines of the same kind).

Measured on the H200 (bench/results/layer-plan-h200.md, whole layers in slots, the other layers'
eight misses each): the CPU taking 3-6 of them while the link read the rest, a uniform-routing token
took 13.6-15.4 ms, against 18.0-18.2 with all eight on the CPU (the default cache, every miss over
the link: 19.2 ms in its own process).

The plan minimises the sum over layers under ``sum(s) <= n_slots``, exactly, by dynamic programming
over layers and slot counts (per-layer costs are not convex, so a greedy per-slot choice would not
find whole layers). Ties give slots to later layers, so that the host's accounting of a pass can run
while the GPU computes the last (miss-free) layers instead of after them (the intent; not measured,
and the usage's residual noise usually outweighs the tie). Within a layer, held
experts rank by ``u``, residents' usage counted ``1 + keep_bonus`` times (so near-equal usages do not
swap residents back and forth).

At flat routing whole layers win (a layer's last slots save its fixed cost too); with local routing
a layer's hot set covers most of its tokens and the plan holds hot sets, as the per-expert policy does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moecache.quants import _numba_setup  # noqa: F401  (configures numba before any @njit)

import numpy as np
from numba import njit

TIE_SLOPE = 1e-6  # layer l's miss cost counts (1 + TIE_SLOPE * l) times: ties go to later layers
# the dynamic programme's width in slot units (plan_layers: larger budgets plan in units of slots); 48
# layers of 128 experts at 1900 slots: 4 ms a plan (2-core host) against 14 at 2048, with a predicted
# cost 0.05-0.13% above the exact programme's (skewed to flat routing, thirtieth session)
PLAN_UNITS = 1024


@dataclass(frozen=True)
class MissCosts:
    """Seconds per token of a layer's misses, by path.

    Attributes:
        t_link: one miss read by the GPU over PCIe from page-locked host RAM (expert bytes / the
            zero-copy read rate).
        t_cpu: one miss computed on the CPU (expert bytes / the CPU kernels' read rate).
        t_fixed: what a layer pays once when the CPU computes any of its misses (the handoff's
            round trip, the parallel region's fork and join).
        max_share: the most misses per token the CPU may take in a layer (the model's top_k); 0:
            no CPU path (the expert cache has no host handoff), link only.
        k: experts per token (``expert_used_count``): a token's misses are binomial over ``k``.
        tokens: decode tokens per pass (>= 1; ``serve``'s batched steps carry several): a pass of
            ``tokens`` tokens hands the CPU up to ``share`` of each token's misses in one call and
            pays the fixed cost once (see :func:`_share_costs`).
    """

    t_link: float
    t_cpu: float
    t_fixed: float
    max_share: int = 8
    k: int = 8
    tokens: float = 1.0

    def validate(self) -> None:
        if (min(self.t_link, self.t_cpu, self.t_fixed, self.max_share) < 0 or self.k < 1
                or not (self.tokens >= 1 and math.isfinite(self.tokens))):
            raise ValueError(f"miss costs must be >= 0, k >= 1 and tokens >= 1, got {self}")


@dataclass(frozen=True)
class LayerPlan:
    """One plan.

    Attributes:
        slots: int64 (n_layer,) slots per layer.
        share: int32 (n_layer,) misses per token the CPU takes in each layer (0: the GPU reads every
            miss over the link).
        target: bool (n_layer, n_expert) the experts the plan holds in slots.
        cost: predicted seconds per token of every layer's misses.
    """

    slots: np.ndarray
    share: np.ndarray
    target: np.ndarray
    cost: float

    @property
    def cpu(self) -> np.ndarray:
        """bool (n_layer,): the layers whose misses the CPU takes a share of."""
        return self.share > 0


def _share_costs(m: np.ndarray, costs: MissCosts) -> tuple[np.ndarray, np.ndarray]:
    """The expected cost per token (float64, ``m``'s shape) of ``m`` expected misses per token at the
    cheapest share, and that share (int32), under the binomial model above (``n = k``).

    A pass of ``B = costs.tokens > 1`` tokens (each token's misses independent, binomial as above)
    hands the CPU ``C``, the sum over its tokens of ``min(x, c)``, and the link the rest, ``L``; it
    costs ``E[max(t_fixed * [C > 0] + t_cpu * C, t_link * L)]``, per token that over ``B``. The
    expectation is taken with the difference of the two paths' times as a normal variable (its
    mean and variance summed over the B tokens, the fixed cost at its mean ``t_fixed * P(C > 0)``):
    ``E[max(D, 0)] = mu * Phi(mu / sigma) + sigma * phi(mu / sigma)``; one token per pass keeps the
    exact expectation above."""
    n = costs.k
    p = np.clip(m / n, 0.0, 1.0)
    x = np.arange(n + 1)
    comb = np.array([math.comb(n, int(i)) for i in x], np.float64)
    pmf = comb * p[..., None] ** x * (1.0 - p[..., None]) ** (n - x)  # (..., n + 1)
    cost = costs.t_link * m
    share = np.zeros(m.shape, np.int32)
    b = float(costs.tokens)
    for c in range(1, costs.max_share + 1):
        on_cpu = np.minimum(x, c)
        if b > 1.0:
            d = costs.t_cpu * on_cpu - costs.t_link * (x - on_cpu)  # the CPU's time less the link's, per token
            d_mean = pmf @ d
            d_var = np.maximum(pmf @ (d * d) - d_mean * d_mean, 0.0)
            any_cpu = 1.0 - pmf[..., 0] ** b  # some token of the pass has a miss (c >= 1: it goes to the CPU)
            mu = costs.t_fixed * any_cpu + b * d_mean
            sigma = np.sqrt(b * d_var)
            link = costs.t_link * b * (m - pmf @ on_cpu)
            mean = (link + _mean_positive(mu, sigma)) / b
        else:
            each = np.where(x > 0, np.maximum(costs.t_fixed + costs.t_cpu * on_cpu, costs.t_link * (x - on_cpu)), 0.0)
            mean = pmf @ each
        better = mean < cost
        cost = np.where(better, mean, cost)
        share[better] = c
    return cost, share


def _mean_positive(mu: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """``E[max(D, 0)]`` for ``D`` normal with mean ``mu`` and standard deviation ``sigma`` (float
    arrays of one shape; ``max(mu, 0)`` where ``sigma`` is 0). The normal CDF through erf by
    Abramowitz and Stegun's 7.1.26 (absolute error < 1.5e-7), numpy having no erf."""
    safe = np.where(sigma > 0, sigma, 1.0)
    z = mu / safe
    a = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-a * a)
    cdf = 0.5 * (1.0 + np.sign(z) * erf)
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return np.where(sigma > 0, mu * cdf + safe * pdf, np.maximum(mu, 0.0))


def _costs(u_sorted: np.ndarray, costs: MissCosts) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and slot count ``s`` (0..n_expert): the misses' cost at the cheapest share and that
    share, from usages sorted descending per layer (float (n_layer, n_expert)). Returns
    (float64 (n_layer, n_expert + 1), int32 (n_layer, n_expert + 1))."""
    n_layer, n_expert = u_sorted.shape
    m = np.zeros((n_layer, n_expert + 1))
    m[:, :-1] = np.cumsum(np.clip(u_sorted, 0.0, None)[:, ::-1], axis=1)[:, ::-1]  # misses when the first s are held
    cost, share = _share_costs(m, costs)
    cost = cost * (1.0 + TIE_SLOPE * np.arange(n_layer))[:, None]
    return cost, share


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
    cost, share = _costs(u_sorted, costs)
    budget = min(int(n_slots), n_layer * n_expert)
    # slot counts a layer may take: every count while the budget is at most PLAN_UNITS slots, else
    # multiples of a unit of q slots (and the whole layer), each charged ceil(s / q) units, so the
    # programme stays ~PLAN_UNITS wide (a 61-layer, 384-expert model with 12000 slots took 0.34 s a
    # plan with every count)
    q = _unit(budget, n_expert)
    counts = np.unique(np.append(np.arange(0, n_expert + 1, q), n_expert))
    pick = _allocate(np.ascontiguousarray(cost[:, counts]), -(-counts // q), budget // q)
    slots = counts[pick].astype(np.int64)
    if q > 1:  # the slots the units left over (whole layers charged ceil(n_expert / q) units, budget % q)
        _spend_leftover(cost, slots, budget)
    target = np.zeros((n_layer, n_expert), bool)
    np.put_along_axis(target, order, np.arange(n_expert) < slots[:, None], axis=1)  # each layer's first slots
    idx = np.arange(n_layer)
    return LayerPlan(slots, share[idx, slots].copy(), target,
                     float((cost[idx, slots] / (1.0 + TIE_SLOPE * idx)).sum()))


def _unit(budget: int, n_expert: int) -> int:
    """The programme's slot unit: the smallest ``q >= ceil(budget / PLAN_UNITS)`` that divides
    ``n_expert`` when one is at most twice that (a whole layer then costs exactly its slots), else
    that ceiling."""
    q0 = max(1, -(-budget // PLAN_UNITS))
    return next((q for q in range(q0, 2 * q0 + 1) if n_expert % q == 0), q0)


def _spend_leftover(cost: np.ndarray, slots: np.ndarray, budget: int) -> None:
    """Give the slots a unit plan left unused (``budget - slots.sum()``) one at a time to the layer
    whose cost (float (n_layer, n_expert + 1)) falls most, while one falls; ``slots`` in place."""
    n_layer, width = cost.shape
    rows = np.arange(n_layer)
    for _ in range(budget - int(slots.sum())):
        nxt = np.minimum(slots + 1, width - 1)
        gain = np.where(slots < width - 1, cost[rows, slots] - cost[rows, nxt], -np.inf)
        il = int(np.argmax(gain))
        if gain[il] <= 0:
            break
        slots[il] += 1


def reshare(plan: LayerPlan, usage: np.ndarray, costs: MissCosts) -> LayerPlan:
    """``plan`` with the shares (and predicted cost) that are cheapest for the experts it holds under
    ``usage`` (float (n_layer, n_expert)) and ``costs``: the same slots and targets, so nothing to
    upload (the tokens per decode pass moved since the plan was made)."""
    cost, share = _held_costs(usage, plan.target, costs)
    return LayerPlan(plan.slots, share, plan.target, float(cost.sum()))


def held_cost(usage: np.ndarray, held: np.ndarray, costs: MissCosts) -> float:
    """Predicted seconds per token of every layer's misses with the experts ``held`` (bool
    (n_layer, n_expert)) in slots, each layer at its cheapest share (the model above)."""
    return float(_held_costs(usage, held, costs)[0].sum())


def _held_costs(usage: np.ndarray, held: np.ndarray, costs: MissCosts) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the misses' cost (float64 (n_layer,)) and the cheapest share (int32) with the experts
    ``held`` in slots: the expected misses are the usage of the experts not held."""
    m = np.where(held, 0.0, np.clip(np.asarray(usage, np.float64), 0.0, None)).sum(axis=1)
    return _share_costs(m, costs)


@njit(cache=True, nogil=True)
def _allocate(cost, units, budget):  # pragma: no cover - compiled
    """The option per layer (int64 (n_layer,), an index into ``units``) minimising ``sum(cost[l,
    o_l])`` under ``sum(units[o_l]) <= budget`` (cost float64 (n_layer, n_opt), units int64 (n_opt,)
    ascending from 0): dynamic programming over layers, the cheaper and then the smaller option on a
    tie."""
    n_layer, n_opt = cost.shape
    best = np.zeros(budget + 1)
    choice = np.zeros((n_layer, budget + 1), np.int16)
    nxt = np.empty(budget + 1)
    for il in range(n_layer):
        for b in range(budget + 1):
            v = best[b] + cost[il, 0]
            c = 0
            for o in range(1, n_opt):
                w = units[o]
                if w > b:
                    break
                t = best[b - w] + cost[il, o]
                if t < v:
                    v = t
                    c = o
            nxt[b] = v
            choice[il, b] = c
        best[:] = nxt
    pick = np.zeros(n_layer, np.int64)
    b = budget
    for il in range(n_layer - 1, -1, -1):
        o = choice[il, b]
        pick[il] = o
        b -= units[o]
    return pick
