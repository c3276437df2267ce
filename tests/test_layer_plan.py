"""The layer plan (--cache-plan layer): the plan is the least-cost one over every possible set of held
experts (brute force over all subsets, the cost model written out here independently), flat routing
gets whole layers, the policy admits only what the plan holds and stops uploading once it holds it,
and the expert cache sends the misses of the plan's CPU layers through the handoff (the CPU twin)
with outputs equal to the all-CPU reference."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moecache.backends import NumpyBackend
from moecache.gguf_file import open_gguf
from moecache.models.base import expert_weights
from moecache.moe.cache import CachedExperts
from moecache.moe.executor import CPUExperts
from moecache.moe.layer_plan import MissCosts, held_cost, plan_layers
from moecache.moe.policy import CachePolicy, PolicyConfig
from moecache.moe.routing import Routing

COSTS = MissCosts(t_link=60e-6, t_cpu=42e-6, t_fixed=50e-6, max_share=4, k=4)


def _layer_costs(m, costs):
    """Each share's expected cost for a layer of ``m`` expected misses a token, the misses binomial
    over the token's k experts: share 0 the link alone, share c the CPU taking up to c of a token's
    misses (its fixed cost when it takes any) while the link reads the rest."""
    n = costs.k
    p = min(1.0, m / n)
    out = []
    for c in range(costs.max_share + 1):
        total = 0.0
        for x in range(n + 1):
            prob = math.comb(n, x) * p ** x * (1 - p) ** (n - x)
            if c == 0:
                total += prob * costs.t_link * x
            elif x:
                mine = min(x, c)
                total += prob * max(costs.t_fixed + costs.t_cpu * mine, costs.t_link * (x - mine))
        out.append(total)
    return out


def _reference_cost(usage, held, costs):
    """The model of moecache/moe/layer_plan.py written out per layer and expert: expected misses,
    the cheapest share."""
    total = 0.0
    for il in range(usage.shape[0]):
        m = sum(usage[il, e] for e in range(usage.shape[1]) if not held[il, e])
        total += min(_layer_costs(m, costs))
    return total


@pytest.mark.parametrize("seed", range(8))
def test_plan_is_the_least_cost_over_every_held_set(seed):
    rng = np.random.default_rng(900 + seed)
    print("seed", 900 + seed)
    n_layer, n_expert = 3, 4
    usage = rng.dirichlet(np.full(n_expert, rng.uniform(0.2, 3.0)), n_layer) * 2  # top-2 routing: rows sum to 2
    usage = np.minimum(usage, 0.999)
    n_slots = int(rng.integers(0, n_layer * n_expert + 2))
    costs = MissCosts(*rng.uniform(10e-6, 100e-6, 3), max_share=int(seed % 3), k=2)
    best = np.inf
    for bits in itertools.product((False, True), repeat=n_layer * n_expert):
        held = np.array(bits).reshape(n_layer, n_expert)
        if held.sum() <= n_slots:
            best = min(best, _reference_cost(usage, held, costs))
    plan = plan_layers(usage, n_slots, costs)
    assert plan.target.sum() <= n_slots and (plan.target.sum(axis=1) == plan.slots).all()
    assert plan.cost == pytest.approx(best, rel=1e-9, abs=1e-15)
    assert _reference_cost(usage, plan.target, costs) == pytest.approx(best, rel=1e-9, abs=1e-15)
    assert held_cost(usage, plan.target, costs) == pytest.approx(best, rel=1e-9, abs=1e-15)
    for il in range(n_layer):  # the share the plan names is the cheapest for what it holds
        rest = ~plan.target[il]
        each = _layer_costs(usage[il, rest].sum(), costs)
        assert 0 <= plan.share[il] <= costs.max_share
        assert each[plan.share[il]] == pytest.approx(min(each), rel=1e-9, abs=1e-15)


def test_flat_routing_gets_whole_layers_the_last_ones_and_the_rest_on_the_cpu():
    n_layer, n_expert, k = 8, 16, 4
    usage = np.full((n_layer, n_expert), k / n_expert)
    plan = plan_layers(usage, 2 * n_expert + 5, COSTS)
    assert plan.slots.tolist() == [0] * 5 + [5, 16, 16]
    assert plan.cpu.tolist() == [True] * 6 + [False, False]
    # spread evenly instead (the per-expert policy's shape at flat routing): dearer
    spread = np.zeros_like(plan.target)
    for i in range(2 * n_expert + 5):
        spread[i % n_layer, i // n_layer] = True
    assert _reference_cost(usage, spread, COSTS) > plan.cost * 1.05


def test_link_only_holds_the_most_used_experts():
    rng = np.random.default_rng(5)
    usage = rng.random((6, 10)) * 0.5
    n = 17
    plan = plan_layers(usage, n, MissCosts(60e-6, 42e-6, 50e-6, max_share=0, k=3))
    top = np.zeros(usage.size, bool)
    top[np.argsort(-usage, axis=None)[:n]] = True
    np.testing.assert_array_equal(plan.target.reshape(-1), top)
    assert not plan.cpu.any()


def test_plan_refuses_negative_inputs():
    with pytest.raises(ValueError):
        plan_layers(np.zeros((2, 4)), -1, COSTS)
    with pytest.raises(ValueError):
        plan_layers(np.zeros((2, 4)), 3, MissCosts(-1.0, 0.0, 0.0))


def _flat_ids(rng, n_layer, n_expert, k, t=1):
    return np.stack([np.stack([rng.choice(n_expert, k, replace=False) for _ in range(t)]) for _ in range(n_layer)])


def test_policy_under_a_layer_plan_admits_only_what_it_holds_and_settles():
    """Flat routing, room for 2.5 layers: the policy plans after a window of tokens, admits only planned
    experts (on a miss, or filling the plan with the credit left), evicts only unplanned ones, fills
    the plan and then uploads nothing more."""
    seed = 31
    print("seed", seed)
    rng = np.random.default_rng(seed)
    n_layer, n_expert, k = 6, 64, 4
    cfg = PolicyConfig(window=128, t_upload=40e-6, layer_plan=True, t_link=60e-6, t_cpu_layer=42e-6, t_fixed=50e-6,
                       uploads_per_token=8, burst=16, min_residency=2)
    pol = CachePolicy(n_layer, n_expert, 160, cfg)
    layers = np.arange(n_layer)
    uploads_at = []
    for step in range(600):
        pol.new_tokens(1)
        ids = _flat_ids(rng, n_layer, n_expert, k)
        live = pol.resident.copy()
        pol.observe_all(layers, ids)
        pol.replan()
        if step < cfg.window - 1:
            assert pol.plan is None  # (the per-expert rule admits until the first plan)
        flat = ids.reshape(n_layer, -1)
        missed = ~np.take_along_axis(live, flat, axis=1)
        for il in np.flatnonzero(pol.may_admit(layers, flat, missed)):
            for a in pol.decide(int(il), flat[il][missed[il]]):
                if pol.plan is not None:
                    assert pol.plan.target[a.layer, a.expert]
                    assert a.victim is None or not pol.plan.target[a.victim]
        if step == cfg.window - 2:
            assert pol.uploads > 0  # per-expert admissions before the plan
        for a in pol.fill_plan():
            assert pol.plan.target[a.layer, a.expert] and (a.victim is None or not pol.plan.target[a.victim])
        assert pol.n_resident == pol.resident.sum() <= 160
        uploads_at.append(pol.uploads)
    # three layers without slots, on the CPU; the room in the others, whose few misses go over the link
    # (at flat routing any split of the room among link-path layers costs the same: linear in misses)
    slots = pol.plan.slots
    assert slots.sum() == 160 and (slots == 0).sum() == 3
    assert (pol.plan.share[slots == 0] == 2).all()  # (4 misses a token: 2 on the CPU, 2 over the link)
    assert (pol.resident == pol.plan.target).all()
    # the first plan (after one window, from noisier usage) may be replaced once; then no churn
    at_plan = uploads_at[cfg.window - 1]
    assert 1 <= pol.plans <= 2 and uploads_at[-1] == uploads_at[350] <= at_plan + 2 * 160


def test_per_token_usage_rows_sum_to_the_experts_per_token():
    """A prompt pass counts as one step of the usage average: the plan's usage is rescaled so each
    layer's row sums to its experts per token."""
    rng = np.random.default_rng(3)
    pol = CachePolicy(2, 8, 4, PolicyConfig(layer_plan=True))
    pol.observe_all(np.arange(2), _flat_ids(rng, 2, 8, 2, t=64))
    pol.observe_all(np.arange(2), _flat_ids(rng, 2, 8, 2, t=1))
    np.testing.assert_allclose(pol._per_token(pol.usage).sum(axis=1), 2.0)


@pytest.mark.parametrize("tokens", [1, 4])
def test_cache_sends_the_plans_cpu_layers_through_the_handoff(tmp_path, tokens):
    """The CPU twin's zero-copy road with the layer plan, passes of one token and of four (serve's
    batched steps; the plan then costs a pass of four): after the plan, each layer's share is the
    plan's; every pass's output equals the all-CPU reference; the CPU took exactly the pairs the
    split rule gives it under those shares."""
    from moecache.moe.handoff import split_pairs
    from moecache.testing.synth import PRESETS, SynthConfig, write_model

    path = tmp_path / "moe.gguf"
    cfg = SynthConfig(**{**PRESETS["tiny"].__dict__, "n_layer": 4, "n_expert": 64, "n_expert_used": 4,
                         "name": "synthetic-plan"})
    write_model(path, cfg, seed=44)
    seed = 45
    print("seed", seed)
    rng = np.random.default_rng(seed)
    with open_gguf(path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = 96  # a layer and a half
        pcfg = PolicyConfig(window=96, t_upload=40e-6, layer_plan=True, t_link=60e-6, t_cpu_layer=42e-6, t_fixed=50e-6,
                            uploads_per_token=8, burst=16, min_residency=2)
        cache = CachedExperts(ew, NumpyBackend(), n_slots, CachePolicy(c.n_layer, c.n_expert, n_slots, pcfg), 32,
                              zero_copy=True, top_k=c.n_expert_used, miss_split=True)
        assert cache.handoff is not None and cache.policy.layer_plan
        ref = CPUExperts(ew, NumpyBackend())
        k = c.n_expert_used
        for step in range(130):
            cache.note_decode(tokens)  # (the model's word for a decode step of `tokens` sequences)
            cache.begin_pass(tokens)
            ncpu = cache.split.ncpu.copy()
            live = cache._map_live.copy()
            want_cpu = 0
            for il in sorted(ew):
                h = rng.standard_normal((tokens, c.n_embd)).astype(np.float32)
                ids = np.stack([rng.choice(c.n_expert, k, replace=False) for _ in range(tokens)]).astype(np.int32)
                r = Routing(ids, rng.dirichlet(np.ones(k), tokens).astype(np.float32))
                np.testing.assert_allclose(cache(il, h, r), ref(il, h, r), rtol=1e-5, atol=1e-6)
                want_cpu += int((split_pairs(ids, live[il], int(ncpu[il]))[0] >= 0).sum())
            before, before_wait = cache.stats.cpu_misses, cache.stats.cpu_wait_ns
            cache.launched()
            # the GPU's waits as handoff_wait records them (0 where the CPU had no pair)
            waits = np.where(cache.handoff.buf.count > 0, rng.integers(1, 10**6, c.n_layer), 0)
            cache.handoff.buf.wait_ns[:] = waits
            cache.end_pass()
            assert cache.stats.cpu_misses - before == want_cpu
            assert cache.stats.cpu_wait_ns - before_wait == int(waits.sum())
        plan = cache.policy.plan
        assert plan is not None and plan.slots.sum() == n_slots
        assert cache.policy.miss_costs().tokens == tokens
        if tokens == 1:  # flat routing, one token a pass: whole layers in slots, two layers with none
            assert (plan.slots == 0).sum() == 2 and (plan.share[plan.slots == 0] > 0).all()
        else:  # four a pass share the CPU's fixed cost: every layer not whole in slots gives it a share
            assert (plan.share[plan.slots < c.n_expert] > 0).all()
        np.testing.assert_array_equal(cache.split.ncpu, plan.share)
        assert cache.stats.cpu_misses > 0
        cache.flush()
        cache.poll()
        np.testing.assert_array_equal(cache.slot_of >= 0, plan.target)  # the plan in slots
        cache.close()


def test_layer_plan_without_the_zero_copy_path_is_said_and_off(tmp_path):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, PRESETS["tiny"], seed=2)
    with open_gguf(path) as m:
        c = m.config
        said = []
        pol = CachePolicy(c.n_layer, c.n_expert, 4, PolicyConfig(layer_plan=True))
        cache = CachedExperts(expert_weights(m, "silu"), NumpyBackend(), 4, pol, 32, zero_copy=False,
                              top_k=c.n_expert_used, miss_split=True, log=said.append)
        assert not pol.layer_plan and cache.handoff is None
        assert len(said) == 1 and "--cache-plan layer ignored" in said[0]  # (not a --miss-split the user never gave)
        cache.close()


def test_settings_check_the_cache_plan():
    from moecache.settings import Settings
    from moecache.threads import experts_on_cpu

    Settings(cache_plan="layer").check()
    with pytest.raises(ValueError, match="--cache-plan"):
        Settings(cache_plan="layers").check()
    with pytest.raises(ValueError, match="--miss-split"):
        Settings(cache_plan="layer", miss_split=True).check()
    assert experts_on_cpu(["--cache-plan", "layer"]) and experts_on_cpu(["--cache-plan=layer"])
    assert not experts_on_cpu(["--cache-plan", "expert"])
    assert not experts_on_cpu(["--cache-plan", "layer", "--cache-plan", "expert"])  # the last one counts


def test_local_routing_gets_hot_sets_with_every_miss_over_the_link():
    """Skewed usage (a few hot experts per layer, the rest rare): the plan holds each layer's hot
    experts (no whole layers) and leaves the rare misses to the link (share 0)."""
    rng = np.random.default_rng(17)
    n_layer, n_expert, k = 6, 64, 4
    usage = np.full((n_layer, n_expert), 0.004)
    for il in range(n_layer):
        usage[il, rng.choice(n_expert, 6, replace=False)] = (k - 0.004 * 58) / 6
    plan = plan_layers(usage, 6 * n_layer, MissCosts(60e-6, 35e-6, 85e-6, max_share=k, k=k))
    np.testing.assert_array_equal(plan.target, usage > 0.1)
    assert (plan.share == 0).all()


def test_residents_win_ties_within_a_layer():
    usage = np.full((1, 8), 0.5)
    resident = np.zeros((1, 8), bool)
    resident[0, [2, 5, 7]] = True
    plan = plan_layers(usage, 3, COSTS, resident)
    np.testing.assert_array_equal(plan.target, resident)


def test_plan_budget_in_units_stays_within_the_slots():
    """Budgets above PLAN_UNITS plan in units of slots: never more slots than the pool, whole layers
    still reachable."""
    from moecache.moe.layer_plan import PLAN_UNITS

    n_layer, n_expert = 30, 200
    n_slots = PLAN_UNITS * 2 + 123
    plan = plan_layers(np.full((n_layer, n_expert), 4 / n_expert), n_slots, MissCosts(60e-6, 35e-6, 85e-6, 4, 4))
    assert plan.slots.sum() <= n_slots and plan.target.sum() == plan.slots.sum()
    assert (plan.slots == n_expert).sum() >= n_slots // n_expert - 1


def test_plan_unit_divides_the_layer_when_it_can():
    """The programme's unit is the smallest divisor of n_expert from ceil(budget / PLAN_UNITS) up to
    twice it (whole layers then cost exactly their slots), else that ceiling."""
    from moecache.moe.layer_plan import PLAN_UNITS, _unit

    assert _unit(PLAN_UNITS, 128) == 1 and _unit(0, 128) == 1
    assert _unit(2 * PLAN_UNITS + 1, 128) == 4  # 3 does not divide 128
    assert _unit(2 * PLAN_UNITS + 1, 200) == 4 and _unit(2 * PLAN_UNITS + 1, 60) == 3
    assert _unit(4 * PLAN_UNITS + 1, 127) == 5  # 127 is prime: no divisor in 5..10


def _flat_policy(n_slots, window, seed):
    """A layer-plan policy of 4 layers x 16 experts (top-2) that has seen one window of flat routing,
    and the generator that drew it."""
    cfg = PolicyConfig(window=window, t_upload=40e-6, layer_plan=True, t_link=60e-6, t_cpu_layer=35e-6, t_fixed=85e-6)
    pol = CachePolicy(4, 16, n_slots, cfg)
    pol.top_k = pol.max_share = 2
    rng = np.random.default_rng(seed)
    for _ in range(window):
        pol.observe_all(np.arange(4), _flat_ids(rng, 4, 16, 2))
    return pol, rng


def test_replan_keeps_a_plan_that_a_new_one_does_not_clearly_beat():
    """The same usage again: the new plan costs the same, so it is not adopted (no uploads for nothing);
    replan_soon (a changed miss path) adopts the next one whatever it saves."""
    pol, _ = _flat_policy(20, window=4, seed=8)
    assert pol.replan() and pol.plans == 1
    first = pol.plan
    pol.clock += 4  # a window later, the same usage
    assert not pol.replan() and pol.plan is first
    pol.max_share = 0
    pol.replan_soon()
    assert pol.replan() and pol.plans == 2 and (pol.plan.share == 0).all()


def test_preload_and_resize_under_a_layer_plan():
    """A profile's usage preloads the plan it makes (its experts only); a smaller pool makes the next
    replan adopt a plan that fits it."""
    n_layer, n_expert = 3, 16
    cfg = PolicyConfig(window=4, layer_plan=True)
    pol = CachePolicy(n_layer, n_expert, 24, cfg)
    pol.top_k = pol.max_share = 4
    usage = np.full((n_layer, n_expert), 0.25)
    adm = pol.preload(usage)
    assert pol.plan is not None and pol.plans == 1
    assert sorted((a.layer, a.expert) for a in adm) == sorted(zip(*np.nonzero(pol.plan.target)))
    assert pol.n_resident == len(adm) == pol.plan.slots.sum() <= 24
    evicted = [(a.layer, a.expert) for a in adm[-8:]]
    pol.resize(16, evicted)
    rng = np.random.default_rng(1)
    for _ in range(4):
        pol.observe_all(np.arange(n_layer), _flat_ids(rng, n_layer, n_expert, 4))
    assert pol.replan() and pol.plan.slots.sum() <= 16


def test_fix_none_gives_a_plans_shares_back():
    from moecache.moe.handoff import SplitControl

    sc = SplitControl(4, 4)
    sc.set_shares(np.array([0, 4, 2, 0]))
    sc.fix(3)
    assert sc.ncpu.tolist() == [3, 3, 3, 3]
    sc.set_shares(np.array([1, 1, 1, 1]))  # a new plan while a share is pinned: kept for later
    assert sc.ncpu.tolist() == [3, 3, 3, 3]
    sc.fix(None)
    assert sc.ncpu.tolist() == [1, 1, 1, 1]
    assert not sc.update([0, 1], np.ones(4, np.int32), np.full(4, 3, np.int32), np.zeros(4, np.int64))


def test_op_by_op_passes_turn_the_plans_cpu_path_off_and_back(tmp_path, monkeypatch):
    """Real passes through a GPU-like handoff (not inline: only a pass being captured hands misses
    over; the twin backend says whether it captures): after PATH_CHECK_PASSES passes run op by op the
    plan's CPU path goes (said once, the plan made again); a half-and-half mix keeps the path it has;
    captured (or replayed) passes bring it back."""
    from moecache.moe.cache import PATH_CHECK_PASSES
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, PRESETS["tiny"], seed=3)
    rng = np.random.default_rng(9)
    with open_gguf(path) as m:
        c = m.config
        said = []
        pol = CachePolicy(c.n_layer, c.n_expert, 4, PolicyConfig(layer_plan=True))
        ew = expert_weights(m, "silu")
        cache = CachedExperts(ew, NumpyBackend(), 4, pol, 32, zero_copy=True, top_k=c.n_expert_used,
                              miss_split=True, log=said.append)
        cache.handoff.inline = False  # as a GPU's handoff
        capturing = [False]
        monkeypatch.setattr(cache.be, "capturing", lambda: capturing[0], raising=False)
        k = c.n_expert_used

        def passes(n, captured):
            for i in range(n):
                capturing[0] = captured(i)
                cache.begin_pass(1)
                for il in sorted(ew):
                    ids = rng.choice(c.n_expert, (1, k), replace=False).astype(np.int32)
                    cache(il, rng.standard_normal((1, c.n_embd)).astype(np.float32),
                          Routing(ids, np.full((1, k), 1.0 / k, np.float32)))
                cache.launched()
                cache.end_pass()

        assert pol.max_share == k
        passes(PATH_CHECK_PASSES, lambda i: i % 2 == 0)  # half and half: kept
        assert pol.max_share == k and not pol._force
        passes(PATH_CHECK_PASSES, lambda i: False)  # op by op
        assert pol.max_share == 0 and pol._force and len([s for s in said if "op by op" in s]) == 1
        passes(PATH_CHECK_PASSES, lambda i: i % 2 == 0)  # half and half: kept off
        assert pol.max_share == 0
        passes(PATH_CHECK_PASSES, lambda i: True)  # captured: back
        assert pol.max_share == k
        assert len([s for s in said if "op by op" in s]) == 1
        capturing[0] = False
        cache.handoff.inline = True
        cache.close()


@pytest.mark.parametrize("seed", range(6))
def test_allocate_with_gapped_units_is_the_least_cost_choice(seed):
    """The programme over options of any unit cost (the unit plans of large pools): its choice costs
    what the best of every combination costs, within the budget (brute force)."""
    from moecache.moe.layer_plan import _allocate

    rng = np.random.default_rng(500 + seed)
    print("seed", 500 + seed)
    n_layer, n_opt = 3, 5
    units = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 9), n_opt - 1, replace=False))]).astype(np.int64)
    cost = rng.random((n_layer, n_opt))
    budget = int(rng.integers(0, 20))
    pick = _allocate(cost, units, budget)
    best = min(sum(cost[il, o] for il, o in enumerate(combo)) for combo in itertools.product(range(n_opt), repeat=n_layer)
               if sum(units[o] for o in combo) <= budget)
    assert units[pick].sum() <= budget
    assert cost[np.arange(n_layer), pick].sum() == pytest.approx(best, rel=1e-12)


def test_unit_plans_spend_the_slots_the_units_leave():
    """Above PLAN_UNITS slots a whole layer of n_expert not a multiple of the unit costs more units
    than slots: the slots left over go to partial layers (flat usage: every slot used)."""
    from moecache.moe.layer_plan import PLAN_UNITS

    n_layer, n_expert = 58, 256
    n_slots = 12000
    assert n_slots > PLAN_UNITS and n_expert % -(-n_slots // PLAN_UNITS)
    plan = plan_layers(np.full((n_layer, n_expert), 8 / n_expert), n_slots, MissCosts(60e-6, 35e-6, 85e-6, 8, 8))
    assert plan.slots.sum() == n_slots == plan.target.sum()


def test_a_resized_pool_is_planned_again_at_the_next_replan():
    """resize() under a plan makes the next replan run before its window and adopt its plan."""
    pol, rng = _flat_policy(32, window=64, seed=4)
    assert pol.replan() and pol.plans == 1
    pol.observe_all(np.arange(4), _flat_ids(rng, 4, 16, 2))
    assert not pol.replan()  # within the window
    pol.resize(48)  # more slots (a take-back): plan now, whatever the margins say
    assert pol.replan() and pol.plans == 2 and pol.plan.slots.sum() <= 48


def test_a_pass_of_several_tokens_pays_the_cpus_fixed_cost_once():
    """With B tokens per pass (serve's batched steps) the CPU's fixed cost is paid once a pass. By
    hand: every pair a miss (m = k = 8, no variance): share 5 of each token's 8 at B = 8
    (max(85/8 + 5 * 33, 3 * 60) = 180 us a token), where one token a pass keeps share 4 (240 us);
    against a Monte Carlo of B binomial tokens (the expectation of the maximum of the two paths'
    times over a pass, per token) the model's cost is within 2.5% at the shares it picks, and never
    above the link alone (counting the fixed cost in every pass, a token's miss or not, is off by
    more)."""
    from moecache.moe.layer_plan import _share_costs

    t = dict(t_link=60e-6, t_cpu=33e-6, t_fixed=85e-6, max_share=8, k=8)
    cost, share = _share_costs(np.array([8.0]), MissCosts(**t, tokens=8.0))
    assert share[0] == 5 and cost[0] == pytest.approx(180e-6)
    cost, share = _share_costs(np.array([8.0]), MissCosts(**t))
    assert share[0] == 4 and cost[0] == pytest.approx(240e-6)
    seed = 71
    print("seed", seed)
    rng = np.random.default_rng(seed)
    for b in (2, 4, 8, 16):
        m = np.array([0.3, 0.6, 1.2, 2.5, 5.0])
        cost, share = _share_costs(m, MissCosts(**t, tokens=float(b)))
        for mi, ci, si in zip(m, cost, share):
            x = rng.binomial(8, mi / 8, size=(40000, b))
            on = np.minimum(x, si)
            cpu = on.sum(axis=1)
            mc = np.where(cpu > 0, t["t_fixed"] + t["t_cpu"] * cpu, 0.0) if si else np.zeros(len(x))
            sim = np.maximum(mc, t["t_link"] * (x - on).sum(axis=1)).mean() / b
            assert ci == pytest.approx(sim, rel=0.025), (b, mi, si)
            assert ci <= t["t_link"] * mi + 1e-12  # never above the link alone (share 0)
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            MissCosts(**t, tokens=bad).validate()


def test_policy_follows_the_tokens_per_decode_pass():
    """note_pass keeps a running mean of tokens per decode pass (weight 1/8 to the newest) and the
    plan's costs take it, rounded to a tenth."""
    pol = CachePolicy(2, 8, 4, PolicyConfig(layer_plan=True))
    assert pol.miss_costs().tokens == 1.0
    for _ in range(200):
        pol.note_pass(8)
    assert pol.miss_costs().tokens == 8.0
    pol.note_pass(0)  # (a pass counts at least one token)
    assert pol.pass_tokens == pytest.approx(8.0 - 7.0 / 8, abs=1e-6)


def test_a_kept_plan_takes_the_shares_of_the_tokens_per_pass_now():
    """A plan made at 8 tokens a pass (serve's batched steps) and kept when the load falls to one
    token a pass (the same usage: no new plan is worth its uploads) gets the one-token shares at the
    next replan, without uploads: the shares the cost model gives its held experts at 1 token a pass,
    which differ from the 8-token ones here (so the test tells them apart)."""
    from moecache.moe.layer_plan import _share_costs

    pol, _ = _flat_policy(20, window=4, seed=8)
    for _ in range(3):
        pol.note_pass(8)
    assert pol.miss_costs().tokens == 8.0
    assert pol.replan() and pol.plans == 1
    first = pol.plan
    usage = pol._per_token(pol.usage)
    m = np.where(first.target, 0.0, usage).sum(axis=1)
    at8 = _share_costs(m, pol.miss_costs())[1]
    np.testing.assert_array_equal(first.share, at8)
    for _ in range(60):  # 9 a pass: the same shares here, so nothing changes (replan says so)
        pol.note_pass(9)
    assert pol.miss_costs().tokens == 9.0
    np.testing.assert_array_equal(_share_costs(m, pol.miss_costs())[1], at8)
    pol.clock += 4
    assert not pol.replan() and pol.plan.target is first.target
    np.testing.assert_array_equal(pol.plan.share, at8)
    for _ in range(60):
        pol.note_pass(1)
    assert pol.miss_costs().tokens == 1.0
    at1 = _share_costs(m, pol.miss_costs())[1]
    assert not np.array_equal(at1, at8)
    resident = pol.resident.copy()
    pol.clock += 4  # a window later, the same usage
    assert pol.replan() and pol.plans == 1  # the same plan, its shares remade
    np.testing.assert_array_equal(pol.plan.share, at1)
    np.testing.assert_array_equal(pol.plan.target, first.target)
    assert (pol.resident == resident).all()
    pol.clock += 4
    assert not pol.replan()  # the tokens per pass unchanged since: nothing to remake
