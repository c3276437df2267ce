"""Routing processes (../shared/routing.md), the cache policy and its replay: the presets reproduce
routing.md's reference numbers, and the policy beats plain LRU in modelled time per token."""

from __future__ import annotations

import numpy as np
import pytest

import bench_scripts
from conftest import require_shared
from moecache.moe.policy import Admission, CachePolicy, PolicyConfig
from moecache.moe.replay import replay_lru, replay_policy
from moecache.moe.routing_process import PRESETS, RoutingProcess, TraceRouting, make_routing

L = 8  # layers replayed (statistics are per layer; 8 keep the tests fast)


def lru_hit_rates(preset, n_expert, k, slots_per_layer, seed=1, tokens=256):
    return [100 * replay_lru(make_routing(preset, L, n_expert, k, seed), L, tokens, s * L).hit_rate
            for s in slots_per_layer]


def test_qwen3_preset_reproduces_the_lru_curve():
    # routing.md: about 32/72/88/95 % at 6/19/38/64 % of 128 experts, 256 cold decode tokens
    got = lru_hit_rates("qwen3-moe", 128, 8, [8, 24, 49, 82])
    for g, want in zip(got, [32, 72, 88, 95]):
        assert abs(g - want) < 6, got


def test_olmoe_preset_reproduces_the_lru_curve():
    got = lru_hit_rates("olmoe", 64, 8, [8, 16, 24, 32])
    for g, want in zip(got, [26, 56, 69, 77]):
        assert abs(g - want) < 6, got


def test_low_locality_overlap_and_prefill_coverage():
    src = make_routing("low-locality", 1, 128, 4, 0)
    ids = src.route(0, 600).ids
    overlap = np.mean([len(set(a) & set(b)) / 4 for a, b in zip(ids[:-1], ids[1:])])
    assert 0.11 < overlap < 0.22  # routing.md: ~16%
    for preset, n_expert, lo in (("qwen3-moe", 128, 0.70), ("olmoe", 64, 0.95)):
        src = make_routing(preset, L, n_expert, 8, 2)
        touched = [np.unique(src.route(layer, 512).ids).size / n_expert for layer in range(L)]
        assert np.mean(touched) >= lo, (preset, touched)


def test_uniform_has_no_skew_and_weights_are_a_softmax():
    r = make_routing("uniform", 2, 64, 8, 3).route(0, 4000)
    counts = np.bincount(r.ids.reshape(-1), minlength=64) / r.ids.size
    assert counts.max() < 1.25 / 64 and counts.min() > 0.75 / 64
    assert np.allclose(r.weights.sum(axis=1), 1.0, atol=1e-5) and (r.weights > 0).all()
    assert all(len(set(row)) == 8 for row in r.ids)  # k distinct experts per token


@pytest.mark.parametrize("preset,n_expert,slots", [("qwen3-moe", 128, 24), ("qwen3-moe", 128, 49),
                                                   ("olmoe", 64, 16), ("olmoe", 64, 24),
                                                   ("uniform", 128, 24), ("low-locality", 128, 64)])
def test_policy_beats_lru_in_modelled_time(preset, n_expert, slots):
    cfg = PolicyConfig()
    lru = replay_lru(make_routing(preset, L, n_expert, 8, 5), L, 256, slots * L, cfg)
    ours = replay_policy(make_routing(preset, L, n_expert, 8, 5), L, n_expert, 256, slots * L, cfg)
    assert ours.us_per_token < 0.95 * lru.us_per_token, (ours, lru)
    assert ours.uploads_per_token <= cfg.uploads_per_token


@pytest.mark.parametrize("slots", [4, 8, 12])
def test_policy_beats_lru_on_the_real_trace(slots):
    trace = require_shared("code-moe-tiny.routes.npz")
    tr = TraceRouting(trace)
    assert (tr.n_layer, tr.n_expert, tr.k) == (8, 16, 4)
    lru = replay_lru(TraceRouting(trace), 8, 4096, slots * 8)
    ours = replay_policy(TraceRouting(trace), 8, 16, 4096, slots * 8)
    # routing README: per-layer LRU 0.273 / 0.610 / 0.849 at 4 / 8 / 12 slots (65k tokens)
    assert abs(lru.hit_rate - {4: 0.273, 8: 0.610, 12: 0.849}[slots]) < 0.04
    assert ours.us_per_token < 0.8 * lru.us_per_token and ours.hit_rate >= lru.hit_rate


def test_malformed_traces_get_one_clear_error(tmp_path):
    """--routing FILE: a trace that cannot drive this model is refused when it is loaded, naming
    what is wrong, not in the middle of a run (negative ids reached a kernel; 0 tokens gave numpy's
    reduction error; a top-k other than the model's was taken)."""
    good = np.zeros((2, 5, 4), np.int32)
    cases = {"negative": (dict(routes=good - 1), "expert ids >= 0"),
             "float": (dict(routes=good.astype(np.float32)), "integers"),
             "uint32": (dict(routes=np.full((2, 5, 4), 0xFFFFFFFF, np.uint32)), "below 2\\*\\*31"),
             "empty": (dict(routes=np.zeros((2, 0, 4), np.int32)), "no tokens"),
             "nan weights": (dict(routes=good, weights=np.full(good.shape, np.nan, np.float32)), "finite"),
             "weights shape": (dict(routes=good, weights=np.ones((2, 5, 3), np.float32)), "shape"),
             "top-k": (dict(routes=np.zeros((2, 5, 3), np.int32)), "3 experts per token")}
    for name, (arrays, words) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(ValueError, match=words):
            make_routing(str(path), 2, 16, 4)
    pickled = tmp_path / "pickle.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not a routing trace.*pickle"):
        make_routing(str(pickled), 2, 16, 4)
    np.savez(tmp_path / "ok.npz", routes=good + 15)
    assert make_routing(str(tmp_path / "ok.npz"), 2, 16, 4).route(1, 3).ids.shape == (3, 4)


def test_admission_must_pay_back():
    ids = np.array([[3, 5]])
    cheap = CachePolicy(1, 8, 4, PolicyConfig(window=64, t_cpu=66e-6, t_gpu=4e-6, t_upload=48e-6))
    cheap.new_tokens(1)
    cheap.observe(0, ids)
    assert [a.expert for a in cheap.decide(0, ids[0])] == [3, 5]  # one use over 64 tokens saves 62 us > 48
    dear = CachePolicy(1, 8, 4, PolicyConfig(window=64, t_cpu=66e-6, t_gpu=4e-6, t_upload=100e-6))
    dear.new_tokens(1)
    dear.observe(0, ids)
    assert dear.decide(0, ids[0]) == []  # saves 62 us, costs 100: no upload


def test_upload_budget_is_respected():
    cfg = PolicyConfig(uploads_per_token=2, burst=2)
    pol = CachePolicy(4, 64, 200, cfg)
    src = make_routing("uniform", 4, 64, 8, 0)
    for t in range(50):
        pol.new_tokens(1)
        before = pol.uploads
        for layer in range(4):
            ids = src.route(layer, 1).ids
            pol.observe(layer, ids)
            pol.decide(layer, ids[0][~pol.resident[layer, ids[0]]])
        assert pol.uploads - before <= 2
    assert pol.uploads <= 2 * 50 + 2


def test_no_ping_pong_between_two_alternating_experts():
    pol = CachePolicy(1, 4, 1, PolicyConfig())
    for t in range(200):
        ids = np.array([[t % 2]])
        pol.new_tokens(1)
        pol.observe(0, ids)
        pol.decide(0, ids[0][~pol.resident[0, ids[0]]])
    assert pol.uploads == 1  # the first one fills the slot; the equally used other never displaces it


def test_recent_admissions_are_not_evicted_and_hot_experts_displace_cold_ones():
    pol = CachePolicy(1, 8, 1, PolicyConfig(min_residency=4))
    pol.new_tokens(1)
    pol.observe(0, np.array([[0]]))
    assert [a.expert for a in pol.decide(0, np.array([0]))] == [0]
    for t in range(3):  # a hot newcomer cannot evict expert 0 during its minimum residency
        pol.new_tokens(1)
        pol.observe(0, np.array([[1]]))
        assert pol.decide(0, np.array([1])) == []
    for t in range(30):
        pol.new_tokens(1)
        pol.observe(0, np.array([[1]]))
        adm = pol.decide(0, np.array([1]) if not pol.resident[0, 1] else np.array([], int))
        if adm:
            assert adm[0].victim == (0, 0)
            break
    assert pol.resident[0, 1] and not pol.resident[0, 0]


def test_preload_fills_slots_with_the_most_used():
    pol = CachePolicy(2, 4, 3, PolicyConfig())
    usage = np.array([[0.5, 0.0, 0.2, 0.1], [0.05, 0.4, 0.0, 0.0]])
    adm = pol.preload(usage)
    assert [(a.layer, a.expert) for a in adm] == [(0, 0), (1, 1), (0, 2)] and pol.n_resident == 3


def test_bad_routing_names_and_files(tmp_path):
    with pytest.raises(ValueError, match="not a preset"):
        make_routing("zipf", 2, 8, 2)
    bad = tmp_path / "bad.npz"
    np.savez(bad, ids=np.zeros((2, 3, 2)))
    with pytest.raises(ValueError, match="no 'routes' array"):
        make_routing(str(bad), 2, 8, 2)
    small = tmp_path / "small.npz"
    np.savez(small, routes=np.zeros((1, 10, 2), np.uint8))
    with pytest.raises(ValueError, match="the trace has 1 layers"):
        make_routing(str(small), 2, 8, 2)
    assert set(PRESETS) == {"qwen3-moe", "olmoe", "low-locality", "uniform"}
    assert isinstance(make_routing("olmoe", 2, 64, 8), RoutingProcess)


def test_adaptive_budget_follows_token_time_unless_deterministic():
    pol = CachePolicy(1, 8, 4, PolicyConfig(t_upload=50e-6, uploads_per_token=16, adaptive=True))
    pol.set_budget(400e-6)  # half of a 400 us token fits 4 uploads of 50 us
    assert pol.uploads_per_token == 4.0
    pol.set_budget(10e-6)
    assert pol.uploads_per_token == 1.0  # never below one
    pol.set_budget(1.0)
    assert pol.uploads_per_token == 16.0  # never above the configured cap
    fixed = CachePolicy(1, 8, 4, PolicyConfig(t_upload=50e-6, uploads_per_token=16, adaptive=False))
    fixed.set_budget(400e-6)
    assert fixed.uploads_per_token == 16.0


def test_observe_all_equals_observe_per_layer():
    rng = np.random.default_rng(9)
    a, b = CachePolicy(6, 32, 40), CachePolicy(6, 32, 40)
    layers = np.array([0, 2, 3, 5])
    for _ in range(20):
        t = int(rng.integers(1, 4))
        ids = np.stack([np.stack([rng.choice(32, 4, replace=False) for _ in range(t)]) for _ in layers])
        a.observe_all(layers, ids)
        for i, il in enumerate(layers):
            b.observe(int(il), ids[i])
    np.testing.assert_allclose(a.usage, b.usage, rtol=1e-12)
    np.testing.assert_array_equal(a.clock, b.clock)
    assert a.usage[[1, 4]].sum() == 0 and a.usage[layers].min() >= 0


def test_cached_victim_gives_the_same_decisions_as_a_fresh_search():
    """The victim is cached between usage/residency changes: the admissions equal those of a policy
    that searches afresh at every call."""

    class Fresh(CachePolicy):
        def _victim(self):
            self._vc = False
            return super()._victim()

    cfg = PolicyConfig(window=16, min_residency=2)
    a, b = CachePolicy(4, 32, 20, cfg), Fresh(4, 32, 20, cfg)
    src = make_routing("olmoe", 4, 32, 4, seed=2)
    for _ in range(200):
        ids = np.stack([src.route(il, 1).ids for il in range(4)])
        for p in (a, b):
            p.new_tokens(1)
            p.observe_all(np.arange(4), ids)
        for il in range(4):
            da = a.decide(il, ids[il][~a.resident[il][ids[il]]])
            db = b.decide(il, ids[il][~b.resident[il][ids[il]]])
            assert da == db
    assert a.uploads == b.uploads > 20


@pytest.mark.parametrize("preset,per_token", [("uniform", 2.0), ("qwen3-moe", 0.5), ("olmoe", 16.0)])
def test_decide_early_exits_change_no_decision(preset, per_token):
    """decide() returns early (no credit; the most used miss does not pay over the victim) before
    sorting the candidates: every admission and victim equals that of the plain rule, written here
    as the module docstring states it (candidates by usage, stop at the first that does not pay)."""

    class Plain(CachePolicy):
        def decide(self, layer, missed):
            cfg, out = self.cfg, []
            gain = cfg.window * (cfg.t_cpu - cfg.t_gpu)
            cands = sorted(sorted({int(e) for e in missed if not self.resident[layer, e]}),
                           key=lambda e: -self.usage[layer, e])  # ties: ascending ids
            for e in cands:
                ue = self.usage[layer, e]
                if self.credit < 1.0 or ue * gain <= cfg.t_upload:
                    break
                victim = None
                if self.n_resident >= self.n_slots:
                    victim = self._victim()
                    if victim is None:
                        break
                    uv = self.usage[victim]
                    if (ue - uv) * gain <= cfg.t_upload or ue < (1.0 + cfg.hysteresis) * uv:
                        break
                    self.resident[victim] = False
                    self.n_resident -= 1
                    self._vc = False
                self.resident[layer, e] = True
                self.admitted_at[layer, e] = self.clock[layer]
                self.n_resident += 1
                self.credit -= 1.0
                self.uploads += 1
                out.append(Admission(layer, e, victim))
            return out

    for min_res, hyst, t in ((2, 0.5, 1), (0, 0.0, 3)):
        cfg = PolicyConfig(window=16, min_residency=min_res, hysteresis=hyst, uploads_per_token=per_token, burst=4.0)
        a, b = CachePolicy(6, 32, 40, cfg), Plain(6, 32, 40, cfg)
        src = make_routing(preset, 6, 32, 4, seed=3)
        lag = a.resident.copy()  # the map a pass used lags the policy: some "misses" are residents by now
        for _ in range(300):
            ids = np.stack([src.route(il, t).ids for il in range(6)])
            for p in (a, b):
                p.new_tokens(t)
                p.observe_all(np.arange(6), ids)
            for il in range(6):
                missed = ids[il][~lag[il][ids[il]]]
                assert a.decide(il, missed) == b.decide(il, missed)
            lag = a.resident.copy()
        assert a.uploads == b.uploads > 30
        np.testing.assert_array_equal(a.resident, b.resident)


@pytest.mark.parametrize("preset", ["uniform", "qwen3-moe"])
def test_may_admit_is_false_only_where_decide_admits_nothing(preset):
    """flush() skips decide() for the layers may_admit() rules out: for each of them, at any point
    of a pass's decisions, decide() on a copy of the policy admits nothing; and the ones it keeps
    include every layer that admits."""
    import copy

    for min_res, hyst, t in ((2, 0.5, 1), (0, 0.0, 3)):
        cfg = PolicyConfig(window=16, min_residency=min_res, hysteresis=hyst, uploads_per_token=3.0, burst=6.0)
        p = CachePolicy(6, 32, 40, cfg)
        src = make_routing(preset, 6, 32, 4, seed=4)
        kept = skipped = 0
        lag = p.resident.copy()  # as flush: misses against the map the pass used (residents by now among them)
        for _ in range(200):
            ids = np.stack([src.route(il, t).ids.reshape(-1) for il in range(6)])
            p.new_tokens(t)
            p.observe_all(np.arange(6), ids.reshape(6, t, -1))
            missed = ~lag[np.arange(6)[:, None], ids]
            ok = p.may_admit(np.arange(6), ids, missed)
            for il in range(6):
                if not ok[il]:
                    skipped += 1
                    assert copy.deepcopy(p).decide(il, ids[il][missed[il]]) == []
                else:
                    kept += 1
                    p.decide(il, ids[il][missed[il]])
            lag = p.resident.copy()
        assert p.uploads > 20 and kept > 20 and skipped > 20, (min_res, hyst, t, p.uploads, kept, skipped)


def test_victim_search_is_numpys_masked_argmin():
    """The compiled victim search against numpy: the least-used resident past its minimum residency,
    the first in row-major order on ties (usages drawn from a few values), None when none is."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print("seed", seed)
    rng = np.random.default_rng(seed)
    for case in range(200):
        n_l, n_e = int(rng.integers(1, 7)), int(rng.integers(1, 40))
        p = CachePolicy(n_l, n_e, n_l * n_e, PolicyConfig(min_residency=int(rng.integers(0, 5))))
        p.resident[...] = rng.random((n_l, n_e)) < rng.random()
        p.clock[...] = rng.integers(0, 20, n_l)
        p.admitted_at[...] = rng.integers(-5, 20, (n_l, n_e))
        p.usage[...] = rng.choice([0.0, 0.25, 0.5, 1.0], (n_l, n_e)) if case % 2 else rng.random((n_l, n_e))
        ok = p.resident & (p.clock[:, None] - p.admitted_at >= p.cfg.min_residency)
        want = divmod(int(np.argmin(np.where(ok, p.usage, np.inf))), n_e) if ok.any() else None
        assert p._victim() == want, case


def test_victim_search_is_compiled_when_the_policy_is_made():
    """A fresh process: making a policy compiles (or loads) the victim search, so the pool's filling
    up mid-decode does not stall a token on Numba."""
    import subprocess
    import sys

    code = ("from moecache.moe.policy import CachePolicy, _least_used_eligible\n"
            "assert not _least_used_eligible.signatures\n"
            "CachePolicy(2, 4, 3)\n"
            "print(len(_least_used_eligible.signatures))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr


def test_drawing_ahead_and_whole_passes_give_the_layer_by_layer_choices():
    """A CUDA-graph decode takes whole passes (next_token) and draws the next one early
    (draw_ahead); every pass, including prompts and new prompts after graph-decoded tokens, must get
    the choices a layer-by-layer decode gets from the same seed."""
    n_layer, k = 6, 4
    a = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 32, k, seed=3)  # op by op
    b = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 32, k, seed=3)  # graph: whole passes, drawn ahead
    plan = [8, 1, 1, 1, 5, 1, 1, "new", 7, 1, 1, "new", 1, 1]
    for step, n in enumerate(plan):
        if n == "new":
            a.new_prompt()
            b.new_prompt()
            continue
        rs = [a.route(il, n) for il in range(n_layer)]
        if n == 1:
            ids_b, w_b = b.next_token()
            assert w_b.shape == (n_layer, 1, k) and np.allclose(w_b.sum(axis=2), 1.0)
            b.draw_ahead()
            b.draw_ahead()  # idempotent: one pass ahead at most
        else:
            got = [b.route(il, n) for il in range(n_layer)]
            ids_b, w_b = np.stack([r.ids for r in got]), np.stack([r.weights for r in got])
        assert np.array_equal(np.stack([r.ids for r in rs]), ids_b), step
        assert np.array_equal(np.stack([r.weights for r in rs]), w_b), step


def test_a_prompt_pass_drawn_ahead_on_request_gives_the_same_choices():
    """draw_ahead(n) (bench: a prompt's first ubatch drawn before the clock): the next pass of n
    tokens takes it, with the choices a process that never drew ahead gets; one of another size
    pending (a worker's, after a short last ubatch) is dropped and the generator rewound; a pass of
    n already pending is kept, not drawn twice; a pass of another size drops what was drawn."""
    n_layer, k = 4, 2
    a = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 32, k, seed=11)  # never draws ahead
    b = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 32, k, seed=11)
    b.draw_passes_ahead = True  # multi-token passes start the next one on a worker
    # (size asked ahead, size of the pass that follows): 12 after a pending 5 (dropped), 12 after a
    # pending 12 (kept), 7 then a pass of 3 (dropped by the pass)
    plan = [(None, 5), (12, 12), (12, 12), (7, 3), (None, 1), (9, 9)]
    for step, (ahead, n) in enumerate(plan):
        if ahead is not None:
            pending = b._ahead
            b.draw_ahead(ahead)
            assert b._ahead is not None and b._ahead[0] == ahead and b._ahead[1].done()
            if pending is not None and pending[0] == ahead:
                assert b._ahead is pending  # kept, its worker's draw waited for
        ref = np.stack([a.route(il, n).ids for il in range(n_layer)])
        got = np.stack([b.route(il, n).ids for il in range(n_layer)])
        assert np.array_equal(ref, got), step
    with pytest.raises(ValueError, match="n_tokens"):
        b.draw_ahead(0)


def test_passes_drawn_ahead_on_a_worker_give_the_same_choices():
    """draw_passes_ahead (GPU runs): a multi-token pass starts drawing the next pass of its size on a
    worker thread. Prompt ubatches of one size, then a shorter last one, decode steps (graph-style,
    drawn ahead too), batched steps of changing sizes and new prompts must route exactly as a
    process that draws every pass when asked (the generator rewound when a pass drawn ahead is not
    the one asked for)."""
    n_layer, k = 5, 4
    a = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 64, k, seed=7)  # draws when asked
    b = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 64, k, seed=7)
    b.draw_passes_ahead = True
    plan = [16, 16, 16, 9, 1, 1, "graph", "graph", 1, 3, 3, 2, 3, "new", 16, 16, 1, "new", 8, "restart", 8, 8]
    ahead_seen = 0
    for step, n in enumerate(plan):
        if n in ("new", "restart"):
            for rp in (a, b):
                rp.new_prompt() if n == "new" else rp.restart(5)
            continue
        if n == "graph":
            ref, got = a.next_token()[0], b.next_token()[0]
            b.draw_ahead()
        else:
            ref = np.stack([a.route(il, n).ids for il in range(n_layer)])
            got = np.stack([b.route(il, n).ids for il in range(n_layer)])
            ahead_seen += b._ahead is not None and b._ahead[0] == n > 1
        assert np.array_equal(ref, got), (step, n)
    assert ahead_seen >= 8  # the worker did draw ahead
    assert a._ahead is None
    # against the token-by-token numpy draw, chained across passes (a lost drift or a generator drawn
    # twice would fail here even where both processes above share it)
    b = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 64, k, seed=7)
    b.draw_passes_ahead = True
    ref = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 64, k, seed=7)
    for n in (16, 16, 16, 9, 16, 16):
        got = np.stack([b.route(il, n).ids for il in range(n_layer)])
        ref_ids, _, ref.x = _numpy_draw(ref, n)
        assert np.array_equal(got, ref_ids), n


@pytest.mark.parametrize("policy", ["ACTIVE", None])
def test_the_draw_ahead_worker_takes_one_numba_thread_under_active_waiting(monkeypatch, policy):
    """Under OMP_WAIT_POLICY=ACTIVE the routing process's worker runs its Numba kernels on one thread
    (a team of its own stopped the main team's spin: moecache.threads.one_thread_if_active), with the
    same choices as a process that draws every pass when asked; otherwise it keeps Numba's count.
    The main thread's count is never touched."""
    import numba

    main_threads = numba.get_num_threads()  # Numba's threads start here, before the policy changes
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    a = RoutingProcess(PRESETS["uniform"], 4, 32, 4, seed=9)
    b = RoutingProcess(PRESETS["uniform"], 4, 32, 4, seed=9)
    b.draw_passes_ahead = True
    for n in (12, 12, 12):
        ref = np.stack([a.route(il, n).ids for il in range(4)])
        assert np.array_equal(np.stack([b.route(il, n).ids for il in range(4)]), ref)
    assert b._worker is not None
    in_worker = b._worker.submit(numba.get_num_threads).result()
    assert in_worker == (1 if policy == "ACTIVE" else main_threads)
    assert numba.get_num_threads() == main_threads
    b._drop_ahead()
    b._worker.shutdown()


def test_a_failed_draw_ahead_raises_in_the_pass_that_takes_it(monkeypatch):
    """An exception in the worker's draw reaches the caller of the pass that takes it (nothing
    fails silently), once: the generator is rewound and the pass after draws anew, the choices a
    process that never drew ahead makes. A pass of another size drops a draw ahead, rewound too."""
    import moecache.moe.routing_process as rpm

    rp = RoutingProcess(PRESETS["uniform"], 3, 16, 2, seed=0)
    rp.draw_passes_ahead = True
    ref = RoutingProcess(PRESETS["uniform"], 3, 16, 2, seed=0)
    assert np.array_equal(rp.route(0, 4).ids, ref.route(0, 4).ids)  # rp now draws the next pass ahead
    rp._drop_ahead()
    real = rpm._draw
    monkeypatch.setattr(rpm, "_draw", lambda *a: (_ for _ in ()).throw(RuntimeError("draw broke")))
    rp._begin_ahead(4, background=True)
    with pytest.raises(RuntimeError, match="draw broke"):
        rp.route(0, 4)
    monkeypatch.setattr(rpm, "_draw", real)
    assert rp._ahead is None
    assert np.array_equal(rp.route(0, 4).ids, ref.route(0, 4).ids)  # drawn anew, as the reference's
    assert rp._ahead is not None and rp._ahead[0] == 4
    assert np.array_equal(rp.route(0, 3).ids, ref.route(0, 3).ids)  # another size: dropped, rewound


def test_restart_routes_the_same_request_whatever_came_before():
    """RoutingProcess.restart(seed): two processes of one model that routed different histories (and
    one with a pass drawn ahead) route the same tokens after restarting with the same seed; the
    model's popularity stays (another model's seed routes differently)."""
    a = RoutingProcess(PRESETS["qwen3-moe"], 4, 32, 4, seed=0)
    b = RoutingProcess(PRESETS["qwen3-moe"], 4, 32, 4, seed=0)
    for _ in range(37):
        a.next_token()
    b.new_prompt()
    b.next_token()
    b.draw_ahead()
    a.restart(99)
    b.restart(99)
    for _ in range(5):
        assert np.array_equal(a.next_token()[0], b.next_token()[0])
    a.restart(99)
    other = RoutingProcess(PRESETS["qwen3-moe"], 4, 32, 4, seed=1)
    other.restart(99)
    assert not np.array_equal(a.next_token()[0], other.next_token()[0])


def test_prompt_warm_replay_fills_only_empty_slots():
    """bench/prompt_warm.py's arms on a small qwen3-moe-preset model: into empty slots the fill loads
    exactly the slots' worth of experts at the prompt's end and raises the decode's early hit rate
    (the prompt and its decode share a hot set in the preset); 'now' loads nothing then."""
    import argparse
    prompt_warm = bench_scripts.load("prompt_warm")

    a = argparse.Namespace(layers=4, experts=32, k=4, p=256, n=64, ub=128, requests=2, window=64)
    res = prompt_warm.run("qwen3-moe", 0.25, 0, a)
    n_slots = 8 * 4
    assert res["now"].warm_uploads == 0 and res["fill"].warm_uploads == 2 * n_slots
    assert res["fill"].hits64 > res["now"].hits64
    assert res["now"].total64 == res["fill"].total64 == 2 * 64 * 4 * 4


def test_prompt_warm_fill_takes_only_empty_slots():
    """prompt_warm's 'fill' arm (CachePolicy.preload of the usage after the prompt) loads the most-used
    non-resident experts into the empty slots only: residents stay, a full cache loads nothing."""
    prompt_warm = bench_scripts.load("prompt_warm")

    pol = CachePolicy(2, 8, 4)
    pol.usage[:] = np.arange(16, dtype=float).reshape(2, 8) / 16  # expert (1, 7) most used, then (1, 6) ...
    for layer, e in [(0, 0), (0, 1)]:  # two residents, the least used of all
        pol.resident[layer, e] = True
        pol.n_resident += 1
    visible = pol.resident.copy()
    assert prompt_warm._warm(pol, visible, "fill") == 2
    assert {tuple(p) for p in np.argwhere(visible)} == {(0, 0), (0, 1), (1, 7), (1, 6)}
    assert prompt_warm._warm(pol, visible, "fill") == 0  # full: nothing moves
    assert prompt_warm._warm(pol, visible, "now") == 0


def _numpy_draw(rp, n_tokens):
    """The routing process's pass drawn with numpy alone, token by token (the implementation before
    the compiled pass: full logits, Generator.gumbel, a stable sort): the reference of the test below."""
    p = rp.p
    base = p.s * rp.z + p.tau * rp.w
    a, b = p.rho, np.sqrt(max(0.0, 1.0 - p.rho * p.rho))
    logits = np.empty((rp.n_layer, n_tokens, rp.n_expert))
    x = rp.x
    for t in range(n_tokens):
        x = a * x + b * rp.rng.standard_normal(x.shape)
        logits[:, t] = base + p.g * x
    logits += rp.rng.gumbel(size=logits.shape)
    order = np.argsort(-logits, axis=2, kind="stable")[:, :, :rp.k]
    chosen = np.take_along_axis(logits, order, axis=2)
    w = np.exp(chosen - chosen[:, :, :1])
    return order.astype(np.int32), (w / w.sum(axis=2, keepdims=True)).astype(np.float32), x


@pytest.mark.parametrize("preset,n_expert,k", [("qwen3-moe", 128, 8), ("low-locality", 64, 4), ("uniform", 16, 16)])
def test_compiled_pass_draws_what_numpy_draws(preset, n_expert, k):
    """RoutingProcess._draw (one compiled pass, a layer per thread) against a token-by-token numpy
    draw from the same generator state: the same experts in the same order, the same weights
    (float32 rounding aside), the same drift state after, over prompt and decode passes."""
    a = RoutingProcess(PRESETS[preset], 5, n_expert, k, seed=11)
    b = RoutingProcess(PRESETS[preset], 5, n_expert, k, seed=11)
    for n in (37, 1, 1, 300):
        x_before = a.x.copy()
        ids, w, x = a._draw(n)
        np.testing.assert_array_equal(a.x, x_before)  # the draw leaves the state to its taker
        a.x = x
        ref_ids, ref_w, ref_x = _numpy_draw(b, n)
        b.x = ref_x
        assert np.array_equal(ids, ref_ids), n
        np.testing.assert_allclose(w, ref_w, rtol=2e-7, atol=1e-8)
        np.testing.assert_array_equal(a.x, b.x)


def test_compiled_pass_ties_and_a_zero_uniform():
    """_draw_pass on chosen inputs: equal logits are taken in expert order (a stable sort's), the
    best first, with equal weights; a uniform of exactly 0 gives a finite logit (the guard), not
    +inf and NaN weights."""
    from moecache.moe.routing_process import _draw_pass

    n_layer, n_tok, n_expert, k = 2, 3, 6, 3
    base = np.zeros((n_layer, n_expert))
    base[1, 4] = 1.0  # layer 1: expert 4 strictly best, the rest tied
    u = np.full((n_layer, n_tok, n_expert), 0.5)
    u[0, 2, 5] = 0.0  # layer 0, token 2: expert 5's noise from u = 0
    ids = np.empty((n_layer, n_tok, k), np.int32)
    w = np.empty((n_layer, n_tok, k), np.float32)
    _draw_pass(base, 0.0, 0.0, 0.0, np.zeros((n_layer, n_expert)), np.zeros((n_tok, n_layer, n_expert)), u, ids, w)
    assert ids[0, 0].tolist() == [0, 1, 2] and ids[1, 0].tolist() == [4, 0, 1]
    np.testing.assert_allclose(w[0, 0], 1 / 3, rtol=1e-6)
    assert ids[0, 2, 0] == 5 and np.isfinite(w).all()  # u = 0: the largest noise, still finite


def test_resize_evicts_and_refuses_overfull():
    """resize: the evicted experts stop being resident, the slot count changes, admissions then fill
    only the slots left; more residents than the new count is a ValueError."""
    p = CachePolicy(2, 8, 4, PolicyConfig(t_upload=1e-9, window=4, min_residency=0, hysteresis=0.0))
    adm = p.preload(np.arange(16, dtype=float).reshape(2, 8) + 1)
    assert p.n_resident == 4 and len(adm) == 4
    keys = [(a.layer, a.expert) for a in adm]
    with pytest.raises(ValueError, match="do not fit"):
        p.resize(2)
    p.resize(2, keys[:2])
    assert p.n_slots == 2 and p.n_resident == 2 and not any(p.resident[k] for k in keys[:2])
    assert all(p.resident[k] for k in keys[2:])
    p.resize(4)
    assert p.n_slots == 4 and p.n_resident == 2
