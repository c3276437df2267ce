"""The expert-cache policy: which (layer, expert) pairs occupy the VRAM slots.

One pool of ``n_slots`` slots serves every layer (a layer with skewed routing can take more slots
than one whose routing is flat). Per (layer, expert) the policy keeps **usage**, an exponentially
weighted average of "used by this token" with time constant ``window`` tokens
(``u <- beta * u + (1 - beta) * [used]``, ``beta = 1 - 1/window``), so ``u * window`` estimates the
uses over the next ``window`` tokens.

After a layer's routing, each expert that missed is a candidate (most used first):

- **payback**: admit it only if the time it is expected to save over the window,
  ``u_e * window * (t_cpu - t_gpu)``, exceeds the upload cost ``t_upload`` (bytes / measured link
  bandwidth); over a resident victim ``v`` the saving is ``(u_e - u_v) * window * (t_cpu - t_gpu)``;
- **hysteresis**: a challenger also needs ``u_e >= (1 + hysteresis) * u_v``, and an expert admitted
  less than ``min_residency`` tokens ago is not evicted: no ping-pong between near-equal experts;
- **upload budget**: at most ``uploads_per_token`` uploads per token on average (a credit that
  refills by that much per token, capped at ``burst``). With ``adaptive`` the executor replaces the
  count by what fits in half of the measured token time at ``t_upload`` each
  (:meth:`CachePolicy.set_budget`); ``--deterministic`` keeps the fixed count, so decisions
  follow token counts only.

Victims are the least-used residents of any layer. The policy only decides, and counts an admitted
expert as resident at once; the executor (:mod:`moecache.moe.cache`) copies it and publishes the
slot when the copy completed.
Source of the rule: ../shared/design.md ("swap only when it pays back").

With ``layer_plan`` (``--cache-plan layer``) the slots follow a **layer plan** instead
(:mod:`moecache.moe.layer_plan`): every ``window`` tokens :meth:`CachePolicy.replan` computes the
slots per layer, the experts to hold and each layer's share of its misses for the CPU (the link
reading the rest at the same time) that minimise the misses' predicted cost (whole layers at flat
routing, hot sets with local routing), and adopts it when its saving over
:data:`PLAN_HORIZON_WINDOWS` windows pays for the uploads it needs and is at least
:data:`PLAN_MARGIN` of the current plan's cost. Until the first plan (``window`` tokens, or a
prompt's fill) the per-expert rule above admits. Under a plan a missed expert is
admitted only if the plan holds it, in place of the least-used resident the plan does not hold
(``min_residency`` and the upload credit as above), and the credit a pass leaves uploads planned
experts not missed yet (:meth:`CachePolicy.fill_plan`); the executor hands up to ``plan.share[il]``
of each token's misses of layer ``il`` to the CPU, the GPU reading the others over the link.
"""

from __future__ import annotations

from dataclasses import dataclass

from moecache.moe.layer_plan import LayerPlan, MissCosts, held_cost, plan_layers, reshare
from moecache.quants import _numba_setup  # noqa: F401  (configures numba before any @njit)

import numpy as np
from numba import njit

# the layer plan's horizon: a plan is adopted when its predicted saving over this many windows pays for the
# uploads it needs (the usage's time constant is one window, but a stable routing keeps a plan's saving
# much longer; over one window, a plan made from the first, noisy usage was never replaced at flat routing)
PLAN_HORIZON_WINDOWS = 4
# a new layer plan must also predict this much less than the current one (relative): the usage left after
# the shrinkage still carries noise, and a plan that is not clearly better is not worth its uploads' risk
PLAN_MARGIN = 0.03
# tokens per decode pass as the layer plan sees them: a running mean with weight 1 / PASS_TOKENS_SPAN to
# the newest pass (serve's batched steps: slots join and leave between steps)
PASS_TOKENS_SPAN = 8
NOISE_MARGIN = 2.0  # the layer plan's usage shrinkage counts the sampling noise this many times (_shrunk)


@dataclass(frozen=True)
class PolicyConfig:
    """Policy settings; times in seconds per expert (gate + up + down of one token).

    Attributes:
        window: ``--moe-cache-window``: the usage time constant in tokens.
        t_cpu: computing one routed pair on the CPU (a miss).
        t_gpu: computing one routed pair from a slot (a hit).
        t_upload: copying one expert into a slot (expert bytes / link bandwidth).
        uploads_per_token: average upload budget per token (the credit's refill).
        burst: most uploads the credit can save up (a topic switch may use them at once).
        hysteresis: relative usage margin a challenger needs over its victim.
        min_residency: tokens an admitted expert is safe from eviction.
        adaptive: let the executor set the budget from measured token times (the CLI turns it on
            unless ``--deterministic``; False: the fixed count).
        layer_plan: ``--cache-plan layer``: the slots follow a layer plan (see the module's text).
        t_link: the layer plan's cost of one miss the GPU reads over PCIe (zero-copy).
        t_cpu_layer: the layer plan's cost of one miss in a layer's one CPU call.
        t_fixed: the layer plan's fixed cost of a layer whose misses go to the CPU (per token).
    """

    window: int = 64
    t_cpu: float = 66e-6
    t_gpu: float = 4e-6
    t_upload: float = 48e-6
    uploads_per_token: float = 16.0
    burst: float = 128.0
    hysteresis: float = 0.5
    min_residency: int = 4
    adaptive: bool = False
    layer_plan: bool = False
    t_link: float = 60e-6
    t_cpu_layer: float = 35e-6
    t_fixed: float = 85e-6

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError(f"--moe-cache-window must be >= 1 token, got {self.window}")
        if min(self.t_cpu, self.t_gpu, self.t_upload, self.t_link, self.t_cpu_layer, self.t_fixed) < 0 or self.uploads_per_token < 0:
            raise ValueError("policy times and the upload budget must be >= 0")


@dataclass(frozen=True)
class Admission:
    """One decision: upload ``expert`` of ``layer`` into a slot, evicting ``victim`` (layer, expert) or
    taking a free slot (``victim`` None)."""

    layer: int
    expert: int
    victim: tuple[int, int] | None


class CachePolicy:
    """Usage statistics and admission decisions for one pool.

    Args:
        n_layer, n_expert: the model's MoE shape (layers without experts simply never route).
        n_slots: slots in the pool.
        config: the knobs (:class:`PolicyConfig`).
    """

    def __init__(self, n_layer: int, n_expert: int, n_slots: int, config: PolicyConfig = PolicyConfig()):
        config.validate()
        self.cfg = config
        self.n_slots = n_slots
        self.beta = 1.0 - 1.0 / config.window
        self.usage = np.zeros((n_layer, n_expert))
        self.counts = np.zeros((n_layer, n_expert), np.int64)  # routed pairs seen per expert (saved profiles)
        self.resident = np.zeros((n_layer, n_expert), bool)  # in a slot, or its copy in flight
        self.admitted_at = np.full((n_layer, n_expert), -(1 << 60), np.int64)
        self.clock = np.zeros(n_layer, np.int64)  # tokens seen per layer
        self.n_resident = 0
        self.credit = float(config.burst)
        self.uploads = 0
        self.uploads_per_token = config.uploads_per_token
        self._vc: tuple[int, int] | None | bool = False  # the victim, cached until usage or residency changes
        # the layer plan (config.layer_plan): on while the executor can use it (it may turn it off)
        self.layer_plan = config.layer_plan
        self.max_share = 8  # the most misses per token the executor can hand the CPU in a layer (0: none)
        self.top_k: int | None = None  # experts per token (the executor's; None: from the routing seen)
        self.pass_tokens = 1.0  # decode tokens per pass, a running mean (note_pass; serve's batched steps)
        self._decode_passes = 0  # decode passes noted (the first one seeds the mean)
        self._plan_tokens = 1.0  # the tokens per pass the plan's shares were chosen for
        self.plan: LayerPlan | None = None
        self.plans = 0  # plans adopted
        self._plan_t: int | None = None  # the token clock at the last replan (None: replan at the next call)
        self._force = False  # the next replan adopts its plan whatever it saves (replan_soon)
        if self.layer_plan:  # the plan's dynamic programme compiled (or loaded from Numba's cache) now,
            # not at the first replan (mid-decode, possibly inside a timed run)
            plan_layers(np.full((2, 2), 0.5), 1, MissCosts(1.0, 1.0, 1.0, 1, 1))
        # the victim search compiled (or loaded from Numba's cache) now, not when the pool first fills
        # (mid-decode, possibly inside a timed run)
        _least_used_eligible(self.resident, self.clock, self.admitted_at, self.usage, 0.0)

    def new_tokens(self, n_tokens: int) -> None:
        """Start a forward pass of ``n_tokens`` tokens: refill the upload credit."""
        self.credit = min(self.cfg.burst, self.credit + self.uploads_per_token * n_tokens)

    def set_budget(self, token_seconds: float) -> None:
        """Adaptive budget: the uploads that fit in half a token's measured time (at least one,
        at most the configured count); ignored unless ``adaptive``."""
        if self.cfg.adaptive and token_seconds > 0 and self.cfg.t_upload > 0:
            fit = 0.5 * token_seconds / self.cfg.t_upload
            self.uploads_per_token = float(min(self.cfg.uploads_per_token, max(1.0, fit)))

    def observe(self, layer: int, ids: np.ndarray) -> None:
        """Record a layer's routing of T tokens (int (T, k) expert ids): decay, then count the uses."""
        t = ids.shape[0]
        used = np.zeros(self.usage.shape[1])
        np.add.at(used, ids.reshape(-1), 1.0)
        self.counts[layer] += used.astype(np.int64)
        self.usage[layer] = self._decayed(self.usage[layer], used, t)
        self.clock[layer] += t
        self._vc = False

    def _decayed(self, u: np.ndarray, used: np.ndarray, t: int) -> np.ndarray:
        """Usage after ``t`` tokens that used each expert ``used`` times (a token at most once)."""
        return u * self.beta ** t + (1.0 - self.beta) * np.minimum(used, t)

    def observe_all(self, layers: np.ndarray, ids: np.ndarray) -> None:
        """:meth:`observe` for several layers at once: ``ids`` int (len(layers), T, k), layer order."""
        layers = np.asarray(layers, np.int64)
        n_l, t = ids.shape[0], ids.shape[1]
        n_e = self.usage.shape[1]
        used = np.zeros((n_l, n_e))
        np.add.at(used, (np.repeat(np.arange(n_l), ids[0].size), ids.reshape(-1)), 1.0)
        self.counts[layers] += used.astype(np.int64)
        self.usage[layers] = self._decayed(self.usage[layers], used, t)
        self.clock[layers] += t
        self._vc = False

    def may_admit(self, layers: np.ndarray, ids: np.ndarray, missed: np.ndarray) -> np.ndarray:
        """Which of ``layers`` (int (n,)) :meth:`decide` could admit an expert for now: bool (n,),
        False where it would return nothing (no credit; the most used of the layer's misses does
        not pay, alone or over the current victim). ``ids`` int (n, m) each layer's routed experts,
        ``missed`` bool (n, m) which of them missed. Credit only falls and the victim's usage only
        rises while a pass's decisions are taken, so a False stays False for the rest of that pass:
        :meth:`moecache.moe.cache.CachedExperts.flush` calls :meth:`decide` only for the Trues.
        Under a layer plan: True where a missed expert is planned and not resident, and a slot is
        free or a resident the plan does not hold can go."""
        if self.credit < 1.0:
            return np.zeros(len(layers), bool)
        if self._planned():
            if self.n_resident >= self.n_slots and self._victim() is None:
                return np.zeros(len(layers), bool)
            rows = np.asarray(layers)[:, None]
            return (missed & self.plan.target[rows, ids] & ~self.resident[rows, ids]).any(axis=1)
        top = np.where(missed, self.usage[np.asarray(layers)[:, None], ids], -np.inf).max(axis=1)
        return np.broadcast_to(self._pays(top), top.shape).copy()  # (a scalar False where nothing can pay)

    def _pays(self, top):
        """Whether an expert of usage ``top`` (a float, or a float array: elementwise) pays for an
        upload now: alone while a slot is free, else over the current victim by the upload price and
        the hysteresis margin (:meth:`decide`'s rule for its first, most used, candidate)."""
        cfg = self.cfg
        gain = cfg.window * (cfg.t_cpu - cfg.t_gpu)
        if gain <= 0:
            return False
        ok = top * gain > cfg.t_upload
        if self.n_resident >= self.n_slots:
            victim = self._victim()
            if victim is None:
                return False
            uv = self.usage[victim]
            ok = ok & ((top - uv) * gain > cfg.t_upload) & (top >= (1.0 + cfg.hysteresis) * uv)
        return ok

    def decide(self, layer: int, missed: np.ndarray) -> list[Admission]:
        """Admissions for the experts of ``layer`` that missed (after :meth:`observe`), most used
        first, within the credit. The returned experts count as resident from now (their copies are
        in flight); victims are no longer resident."""
        if self._planned():
            return self._decide_planned(layer, missed)
        cfg = self.cfg
        gain = cfg.window * (cfg.t_cpu - cfg.t_gpu)
        out: list[Admission] = []
        # the loop below stops at its first candidate (the most used) when there is no credit or that
        # one does not pay: the same test on the largest usage among the misses first, without sorting
        if gain <= 0 or missed.size == 0 or self.credit < 1.0 or not self._pays(self.usage[layer, missed].max()):
            return out
        cand = np.unique(missed)
        cand = cand[~self.resident[layer, cand]]
        cand = cand[np.argsort(-self.usage[layer, cand], kind="stable")]
        for e in cand:
            if self.credit < 1.0:
                break
            ue = self.usage[layer, e]
            if self.n_resident < self.n_slots:
                if ue * gain <= cfg.t_upload:
                    break  # later candidates are used less
                victim = None
            else:
                if ue * gain <= cfg.t_upload:
                    break  # cannot pay back even over an unused victim
                victim = self._victim()
                if victim is None:
                    break
                uv = self.usage[victim]
                if (ue - uv) * gain <= cfg.t_upload or ue < (1.0 + cfg.hysteresis) * uv:
                    break
            out.append(self._admit(layer, int(e), victim))
        return out

    def _admit(self, layer: int, e: int, victim: tuple[int, int] | None) -> Admission:
        """Count ``e`` of ``layer`` resident from now, in place of ``victim`` (None: a free slot),
        paid from the credit."""
        if victim is not None:
            self.resident[victim] = False
            self.n_resident -= 1
            self._vc = False
        self.resident[layer, e] = True
        self.admitted_at[layer, e] = self.clock[layer]
        self.n_resident += 1
        self.credit -= 1.0
        self.uploads += 1
        return Admission(layer, e, victim)

    def _planned(self) -> bool:
        """Admissions follow a layer plan (``layer_plan`` on and a plan made)."""
        return self.layer_plan and self.plan is not None

    def _decide_planned(self, layer: int, missed: np.ndarray) -> list[Admission]:
        """:meth:`decide` under a layer plan: the missed experts the plan holds, most used first, into
        free slots or in place of the least-used residents it does not hold, within the credit."""
        out: list[Admission] = []
        if missed.size == 0:
            return out
        cand = np.unique(missed)
        cand = cand[self.plan.target[layer, cand] & ~self.resident[layer, cand]]
        for e in cand[np.argsort(-self.usage[layer, cand], kind="stable")].tolist():
            a = self._admit_planned(layer, e)
            if a is None:
                break
            out.append(a)
        return out

    def _admit_planned(self, layer: int, e: int) -> Admission | None:
        """Admit planned expert ``e`` of ``layer`` into a free slot or over the least-used resident
        the plan does not hold; None when the credit is spent or no such resident may go."""
        if self.credit < 1.0:
            return None
        victim = None
        if self.n_resident >= self.n_slots:
            victim = self._victim()
            if victim is None:
                return None
        return self._admit(layer, e, victim)

    def fill_plan(self) -> list[Admission]:
        """Under a layer plan, after a pass's own admissions: the credit left goes to planned experts
        that are not resident yet, whether or not this pass missed them (most used first, as
        :meth:`decide` admits them), so a plan is in slots within its uploads' time instead of
        waiting for each expert's next miss."""
        if not self._planned() or self.credit < 1.0:
            return []
        want = np.flatnonzero((self.plan.target & ~self.resident).reshape(-1))
        if not want.size:
            return []
        want = want[np.argsort(-self.usage.reshape(-1)[want], kind="stable")]
        out: list[Admission] = []
        for flat in want[:int(self.credit)].tolist():
            a = self._admit_planned(*divmod(flat, self.usage.shape[1]))
            if a is None:
                break
            out.append(a)
        return out

    def note_pass(self, n_tokens: int) -> None:
        """A decode pass of ``n_tokens`` tokens (one per sequence; at least 1 counts) is coming: the
        running mean of tokens per pass that the layer plan's costs take (:attr:`MissCosts.tokens`;
        the first pass sets it, then weight ``1 / PASS_TOKENS_SPAN`` to the newest)."""
        n = max(1, int(n_tokens))
        self._decode_passes += 1
        self.pass_tokens = float(n) if self._decode_passes == 1 else \
            self.pass_tokens + (n - self.pass_tokens) / PASS_TOKENS_SPAN

    def miss_costs(self) -> MissCosts:
        """The layer plan's path costs from the config (the CPU path as the executor allows; the
        running mean of tokens per decode pass, rounded to a tenth)."""
        c = self.cfg
        k = self.top_k
        if k is None:  # routed pairs per token of the layers seen (each token routes k)
            seen = self.clock > 0
            k = int(round(float((self.counts.sum(axis=1)[seen] / self.clock[seen]).max()))) if seen.any() else 1
        return MissCosts(c.t_link, c.t_cpu_layer, c.t_fixed, min(self.max_share, max(1, k)), max(1, k),
                         max(1.0, round(self.pass_tokens, 1)))

    def replan(self) -> bool:
        """With ``layer_plan``: every ``window`` tokens (the first time after ``window`` tokens: the
        usage is too noisy before, and the per-expert rule admits until then; or at the next call
        after a resize or :meth:`replan_soon`),
        plan the slots from the usage (:func:`moecache.moe.layer_plan.plan_layers`) and adopt the
        plan when its predicted saving over :data:`PLAN_HORIZON_WINDOWS` windows, against the current
        plan under the same usage, exceeds the uploads it needs (experts it holds that are not
        resident, ``t_upload`` each) and is at least :data:`PLAN_MARGIN` of the current plan's cost.
        A plan kept while the tokens per decode pass moved (``serve``'s slots joining or leaving)
        gets the shares that are cheapest for its held experts now
        (:func:`moecache.moe.layer_plan.reshare`: no uploads). Returns whether a plan was adopted or
        its shares changed (the executor then sets each layer's share from ``plan.share``)."""
        if not self.layer_plan:
            return False
        now = int(self.clock.max()) if self.clock.size else 0
        if now < self.cfg.window:
            return False
        if self._plan_t is not None and now - self._plan_t < self.cfg.window:
            return False
        self._plan_t = now
        costs = self.miss_costs()
        usage = self._per_token(self.usage)
        new = plan_layers(usage, self.n_slots, costs, self.resident, self.cfg.hysteresis)
        force, self._force = self._force, False
        if self.plan is not None and self.plan.target.sum() <= self.n_slots and not force:
            cur = held_cost(usage, self.plan.target, costs)
            uploads = int((new.target & ~self.resident).sum())
            if ((cur - new.cost) * PLAN_HORIZON_WINDOWS * self.cfg.window <= uploads * self.cfg.t_upload
                    or new.cost > (1.0 - PLAN_MARGIN) * cur):
                if costs.tokens == self._plan_tokens:
                    return False
                self._plan_tokens = costs.tokens
                kept = reshare(self.plan, usage, costs)
                changed = not np.array_equal(kept.share, self.plan.share)
                self.plan = kept
                return changed
        self._adopt(new, now, costs.tokens)
        return True

    def _adopt(self, plan: LayerPlan, now: int, tokens: float) -> None:
        """``plan`` from now (token clock ``now``; its shares chosen for ``tokens`` per decode pass):
        admissions and victims follow it."""
        self.plan = plan
        self.plans += 1
        self._plan_t = now
        self._plan_tokens = tokens
        self._vc = False

    def forget_passes(self) -> None:
        """Forget the tokens per decode pass seen so far (the engine's warm-up token is not a
        user's pass): the next decode pass seeds the mean again."""
        self.pass_tokens = 1.0
        self._decode_passes = 0

    def replan_soon(self) -> None:
        """Make the next :meth:`replan` plan again and adopt its plan without the margins (the
        executor's miss paths changed: ``max_share``)."""
        self._plan_t = None
        self._force = True

    def _per_token(self, usage: np.ndarray) -> np.ndarray:
        """``usage`` scaled per layer to the fraction of tokens that use each expert, the layer
        plan's unit: each layer's row sums to its experts per token (routed pairs / tokens seen;
        the usage's own scale is off by the average's start from zero and by prompt passes, which
        count as one step each). Rows of layers that saw no token stay as they are."""
        out = np.array(usage, np.float64)
        tot = out.sum(axis=1)
        seen = (self.clock > 0) & (tot > 0)
        k = self.counts.sum(axis=1)[seen] / self.clock[seen]
        out[seen] *= (k / tot[seen])[:, None]
        return _shrunk(out, self.cfg.window)

    def _victim(self) -> tuple[int, int] | None:
        """The least-used resident past its minimum residency (under a layer plan: of those it does
        not hold), as (layer, expert); cached until the usage, the residents or the plan change (an
        admission into a free slot is too young to be one)."""
        if self._vc is not False:
            return self._vc
        held = self.resident & ~self.plan.target if self._planned() else self.resident
        flat = _least_used_eligible(held, self.clock, self.admitted_at, self.usage,
                                    float(self.cfg.min_residency))
        self._vc = None if flat < 0 else divmod(flat, self.usage.shape[1])
        return self._vc

    def keep(self, layer: int, experts: np.ndarray) -> None:
        """Count ``experts`` (int ids) of ``layer`` resident from now, in slots that were empty: a
        prompt's copies left in the pool (:attr:`moecache.moe.cache.CachedExperts.prompt_keep`), or
        kept experts that stay after :meth:`forget`. No upload and no credit; ``min_residency``
        protects them as it protects an admission. Raises ValueError when more experts would be
        resident than there are slots."""
        new = np.unique(np.asarray(experts, np.int64))
        new = new[~self.resident[layer, new]]
        if self.n_resident + new.size > self.n_slots:
            raise ValueError(f"keep: {self.n_resident} + {new.size} residents do not fit in {self.n_slots} slots")
        self.resident[layer, new] = True
        self.admitted_at[layer, new] = self.clock[layer]
        self.n_resident += int(new.size)
        self._vc = False

    def forget(self, mask: np.ndarray) -> None:
        """Count the experts of ``mask`` (bool (n_layer, n_expert)) not resident from now (their slots
        are about to be chosen again, :meth:`moecache.moe.cache.CachedExperts.fill_after_prompt`)."""
        gone = mask & self.resident
        self.resident[gone] = False
        self.n_resident -= int(gone.sum())
        self._vc = False

    def clear_residents(self) -> None:
        """Forget every resident expert (their slots are being emptied: a preload replaces what the
        warm-up token admitted)."""
        self.resident[...] = False
        self.n_resident = 0
        self._vc = False

    def resize(self, n_slots: int, evicted: list[tuple[int, int]] = ()) -> None:
        """The pool has ``n_slots`` slots from now (the expert cache lends its elastic slots to a
        prompt and takes them back, :meth:`moecache.moe.cache.CachedExperts.lend_tail`);
        ``evicted`` (layer, expert) were resident in the slots that left and are not any more.
        Raises ValueError when more experts would stay resident than ``n_slots``."""
        for key in evicted:
            if self.resident[key]:
                self.resident[key] = False
                self.n_resident -= 1
        if self.n_resident > n_slots:
            raise ValueError(f"resize: {self.n_resident} residents do not fit in {n_slots} slots")
        self.n_slots = n_slots
        self._vc = False
        if self.plan is not None:  # a layer plan is made again for the new pool at the next replan
            self.replan_soon()

    def preload(self, usage: np.ndarray) -> list[Admission]:
        """Fill empty slots with the most-used experts of a saved profile (float (n_layer, n_expert)
        usage), most used first; the usage becomes the starting statistics. The loaded experts are
        admitted now (``min_residency`` protects them as it protects a decode admission)."""
        self.usage[...] = usage
        self._vc = False
        order = np.argsort(-usage, axis=None, kind="stable")
        held = None
        if self.layer_plan and usage.any():  # under a layer plan: the plan for this usage, adopted now
            costs = self.miss_costs()
            self._adopt(plan_layers(self._per_token(usage), self.n_slots, costs, self.resident,
                                    self.cfg.hysteresis), int(self.clock.max()) if self.clock.size else 0,
                        costs.tokens)
            held = self.plan.target.reshape(-1)
            order = order[held[order]]
        out = []
        for flat in order:
            if self.n_resident >= self.n_slots or (held is None and usage.flat[flat] <= 0):
                break
            layer, e = divmod(int(flat), usage.shape[1])
            if not self.resident[layer, e]:
                self.resident[layer, e] = True
                self.admitted_at[layer, e] = self.clock[layer]
                self.n_resident += 1
                out.append(Admission(layer, e, None))
        return out


def _shrunk(u: np.ndarray, window: int) -> np.ndarray:
    """Each layer's usages (float (n_layer, n_expert), fractions of tokens) pulled toward the layer's
    mean by the share of their spread that sampling noise explains (James-Stein style): an average
    with time constant ``window`` of a 0/1 use with probability ``p`` has variance ``p (1 - p) /
    (2 window - 1)``. At flat routing the spread is all noise and the usages become flat (a plan
    made on the noise would hold experts that are not hotter and replace them every window); a
    layer with real hot experts keeps most of its spread. The noise counts :data:`NOISE_MARGIN`
    times: the average has not settled in its first windows, and the spread of a layer's few
    experts is itself a noisy estimate (a spread 1.3 times the noise by chance would keep a quarter
    of it as apparent hot sets)."""
    mean = u.mean(axis=1, keepdims=True)
    spread = u.var(axis=1, keepdims=True)
    noise = mean * (1.0 - mean) / (2 * window - 1)
    keep = np.clip(1.0 - NOISE_MARGIN * noise / np.maximum(spread, 1e-300), 0.0, 1.0)
    return mean + keep * (u - mean)


@njit(cache=True, nogil=True)
def _least_used_eligible(resident, clock, admitted_at, usage, min_residency):  # pragma: no cover - compiled
    """The flat index (layer * n_expert + expert) of the least-used resident admitted at least
    ``min_residency`` tokens ago (its layer's clock), the first such in row-major order on a tie
    (``np.argmin``'s rule); -1 when there is none. One pass over the (n_layer, n_expert) arrays:
    bool resident, int64 clock (n_layer,) and admitted_at, float64 usage."""
    best = -1
    best_u = np.inf
    n_layer, n_expert = usage.shape
    for il in range(n_layer):
        c = clock[il]
        for e in range(n_expert):
            if resident[il, e] and c - admitted_at[il, e] >= min_residency:
                u = usage[il, e]
                if best < 0 or u < best_u:
                    best = il * n_expert + e
                    best_u = u
    return best

