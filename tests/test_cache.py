"""The expert cache's hybrid executor on the CPU twin (NumpyBackend: slots in host arrays, copies
that land one poll late): hybrid output equals the all-CPU output for any cache map and routing,
a slot is never read while its copy is in flight, and a generation with the cache churning gives
the CPU-only logits at every step. tests/test_gpu.py runs the same on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends import NumpyBackend
from moecache.gguf_file import open_gguf
from moecache.models import build_model
from moecache.models.base import expert_weights
from moecache.moe.cache import CachedExperts
from moecache.moe.executor import CPUExperts
from moecache.moe.policy import Admission, CachePolicy, PolicyConfig
from moecache.moe.routing import topk_routing

NEVER = PolicyConfig(t_upload=1.0)  # uploads never pay back: the map stays as the test sets it


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from moecache.testing.synth import PRESETS, SynthConfig, write_model

    path = tmp_path_factory.mktemp("cache") / "moe.gguf"
    base = PRESETS["tiny"]
    cfg = SynthConfig(**{**base.__dict__, "n_expert": 16, "n_expert_used": 4, "name": "synthetic-cache"})
    write_model(path, cfg, seed=21)
    return path


def _cache(ew, n_layer, n_expert, n_slots, cfg=PolicyConfig()):
    return CachedExperts(ew, NumpyBackend(), n_slots, CachePolicy(n_layer, n_expert, n_slots, cfg), 32)


def _fill(cache, ew, pairs):
    """Put (layer, expert) pairs into slots directly (a known map)."""
    for slot, (il, e) in enumerate(pairs):
        for pool_arr, src in zip((cache.pool.gate, cache.pool.up, cache.pool.down), (ew[il].gate, ew[il].up, ew[il].down)):
            pool_arr[slot] = src[e]
        cache.pool.owner[slot] = (il, e)
        cache.slot_of[il, e] = slot


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_equals_cpu_for_random_maps_and_routings(model_path, seed):
    rng = np.random.default_rng(seed)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = int(rng.integers(1, c.n_layer * c.n_expert))
        cache = _cache(ew, c.n_layer, c.n_expert, n_slots, NEVER)
        pairs = [(int(p) // c.n_expert, int(p) % c.n_expert) for p in rng.choice(c.n_layer * c.n_expert, n_slots,
                                                                                  replace=False)]
        _fill(cache, ew, pairs)
        ref_ex = CPUExperts(ew, NumpyBackend())
        for il in ew:
            t = int(rng.integers(1, 20))
            h = rng.standard_normal((t, c.n_embd)).astype(np.float32)
            r = topk_routing(rng.dirichlet(np.ones(c.n_expert), t).astype(np.float32), c.n_expert_used, True)
            np.testing.assert_allclose(cache(il, h, r), ref_ex(il, h, r), rtol=1e-5, atol=1e-6)
        assert cache.stats.hits > 0 and cache.stats.misses > 0
        cache.close()


def test_all_hits_and_all_misses(model_path):
    rng = np.random.default_rng(7)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        h = rng.standard_normal((3, c.n_embd)).astype(np.float32)
        r = topk_routing(rng.dirichlet(np.ones(c.n_expert), 3).astype(np.float32), c.n_expert_used, True)
        ref = CPUExperts(ew, NumpyBackend())(0, h, r)
        full = _cache(ew, c.n_layer, c.n_expert, c.n_expert, NEVER)
        _fill(full, ew, [(0, e) for e in range(c.n_expert)])
        np.testing.assert_allclose(full(0, h, r), ref, rtol=1e-5, atol=1e-6)
        assert full.stats.misses == 0
        empty = _cache(ew, c.n_layer, c.n_expert, 4, NEVER)
        np.testing.assert_allclose(empty(0, h, r), ref, rtol=1e-5, atol=1e-6)
        assert empty.stats.hits == 0
        # act_q8: the misses computed on the CPU take the 8-bit kernel (CPUExperts(act_q8=True)'s
        # sums, visibly off the float32 ones)
        q8 = CachedExperts(ew, NumpyBackend(), 4, CachePolicy(c.n_layer, c.n_expert, 4, NEVER), 32, act_q8=True)
        got = q8(0, h, r)
        assert q8.stats.misses > 0 and q8.stats.hits == 0 and q8.offload.act_q8
        np.testing.assert_allclose(got, CPUExperts(ew, NumpyBackend(), act_q8=True)(0, h, r), rtol=1e-5, atol=1e-6)
        assert np.abs(got - ref).max() > 1e-4 * np.abs(ref).max()
        q8.close()


def test_slots_are_not_read_while_their_copy_is_in_flight(model_path):
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        cache = _cache(ew, c.n_layer, c.n_expert, 2)
        h = np.ones((1, c.n_embd), np.float32)
        from moecache.moe.routing import Routing
        r = Routing(np.array([[3, 5, 7, 9][:c.n_expert_used]], np.int32),
                    np.full((1, c.n_expert_used), 1.0 / c.n_expert_used, np.float32))
        cache(0, h, r)  # admits two experts: copies in flight
        assert cache.stats.uploads == 2 and (cache.slot_of[0] == -1).all()
        cache.poll()  # first poll: the twin's copies have not landed
        assert (cache.slot_of[0] == -1).all()
        cache.poll()
        assert sorted(np.flatnonzero(cache.slot_of[0] >= 0).tolist()) == [3, 5]


def test_generation_with_a_churning_cache_matches_cpu_at_every_step(model_path):
    rng = np.random.default_rng(3)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = c.n_layer * c.n_expert // 4  # a quarter of the experts: hits, misses and evictions
        cache = _cache(ew, c.n_layer, c.n_expert, n_slots, PolicyConfig(window=8, min_residency=1, hysteresis=0.1))
        ref_lm = build_model(m, NumpyBackend())
        lm = build_model(m, NumpyBackend(), experts=cache)
        kv_ref, kv = ref_lm.new_kv_cache(160), lm.new_kv_cache(160)
        prompt = rng.integers(0, c.n_vocab, 40)  # a prompt ubatch: the op-offload path
        np.testing.assert_allclose(lm.forward(prompt, kv), ref_lm.forward(prompt, kv_ref), rtol=1e-4, atol=1e-5)
        tok = int(prompt[-1])
        for step in range(60):
            ref = ref_lm.forward(np.array([tok]), kv_ref)
            got = lm.forward(np.array([tok]), kv)
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=f"step {step}")
            tok = int(rng.integers(0, c.n_vocab))  # random tokens: routing moves, the cache churns
        more = rng.integers(0, c.n_vocab, 40)  # a second prompt ubatch reads resident experts from their slots
        np.testing.assert_allclose(lm.forward(more, kv, logits="all"), ref_lm.forward(more, kv_ref, logits="all"),
                                   rtol=1e-4, atol=1e-5)
        assert cache.prompt_slot_reads > 0
        s = cache.stats
        assert s.hits > 0 and s.misses > 0 and s.uploads > n_slots  # evictions happened
        assert 0 < s.hit_rate < 1
        cache.close()


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("keep", [True, False])
def test_first_decode_after_a_prompt_fills_the_empty_slots(model_path, zero_copy, keep):
    """After a prompt ubatch (op offload: it admits nothing), the first decode pass fills the empty
    slots with the experts the prompt used most (by the policy's usage after the prompt) and waits
    for their copies: that decode pass reads them as hits (hybrid and zero-copy paths), and its
    output still equals the all-CPU output. A later prompt with every slot full changes nothing.
    With ``prompt_keep`` the prompt itself left each layer's share of the empty slots (a third of
    them each, three layers) holding that layer's experts of most routed pairs, no upload made;
    the decode pass then holds the same experts as without it, copying only those not kept."""
    rng = np.random.default_rng(11)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = c.n_layer * c.n_expert // 4
        make = _zero_copy_cache if zero_copy else _cache
        cache = make(ew, c.n_layer, c.n_expert, n_slots, NEVER)  # decode itself admits nothing
        cache.prompt_keep = keep
        assert cache.zero_copy == zero_copy
        ref_lm = build_model(m, NumpyBackend())
        lm = build_model(m, NumpyBackend(), experts=cache, pass_hooks=[cache])
        kv_ref, kv = ref_lm.new_kv_cache(128), lm.new_kv_cache(128)
        prompt = rng.integers(0, c.n_vocab, 40)
        np.testing.assert_allclose(lm.forward(prompt, kv), ref_lm.forward(prompt, kv_ref), rtol=1e-4, atol=1e-5)
        assert cache.stats.uploads == 0  # the prompt admitted nothing
        kept = set()
        if keep:
            pairs = cache.policy.counts  # the routed pairs per expert of this one prompt
            for il in range(c.n_layer):
                kept |= {(il, int(x)) for x in np.argsort(-pairs[il], kind="stable")[:n_slots // c.n_layer]}
            assert {(il, e) for il, e in zip(*np.nonzero(cache.slot_of >= 0))} == kept
            assert cache.prompt_keeps == n_slots and cache.policy.n_resident == n_slots
            for il, x in kept:  # the slots hold the experts' bytes
                sl = cache.slot_of[il, x]
                assert np.array_equal(cache.pool.down[sl], ew[il].down[x])
        else:
            assert (cache.slot_of < 0).all() and cache.prompt_keeps == 0
        usage = cache.policy.usage.copy()
        want = set(divmod(int(f), c.n_expert) for f in np.argsort(-usage, axis=None, kind="stable")[:n_slots]
                   if usage.flat[f] > 0)
        assert len(want) == n_slots
        tok = np.array([int(prompt[-1])])
        np.testing.assert_allclose(lm.forward(tok, kv), ref_lm.forward(tok, kv_ref), rtol=1e-4, atol=1e-5)
        loaded = {(il, e) for il, e in zip(*np.nonzero(cache.slot_of >= 0))}
        assert loaded == want and cache.prompt_fills == len(want - kept) and cache.stats.uploads == len(want - kept)
        assert cache.policy.n_resident == n_slots and not cache._kept.any()
        for il, x in want:
            assert cache.pool.owner[cache.slot_of[il, x]] == (il, x)
        cache.flush()  # the zero-copy path accounts a pass at the next launch
        assert cache.stats.hits > 0  # the decode pass read the filled slots
        uploads = cache.stats.uploads
        more = rng.integers(0, c.n_vocab, 40)
        lm.forward(more, kv)
        lm.forward(np.array([int(more[-1])]), kv)
        assert cache.stats.uploads == uploads and cache.prompt_fills == len(want - kept)  # no empty slot: no fill
        assert cache.prompt_keeps == len(kept) and not cache._kept.any()  # ... and no keep
        cache.close()


def _zero_copy_cache(ew, n_layer, n_expert, n_slots, cfg=PolicyConfig(), stage=False):
    return CachedExperts(ew, NumpyBackend(), n_slots, CachePolicy(n_layer, n_expert, n_slots, cfg), 32,
                         zero_copy=True, top_k=4, stage_misses=stage)


@pytest.mark.parametrize("seed,stage", [(s, False) for s in range(4)] + [(s, True) for s in range(3)])
def test_zero_copy_path_reads_hits_from_slots_and_misses_from_host(model_path, seed, stage):
    """The zero-copy path (one call: hits from slots, misses from the host arrays). Each mapped slot
    holds the bytes of the *next* expert of its layer and unmapped slots hold garbage, so the output
    equals the all-CPU output with every hit's expert id shifted by one only if hits are read from
    the slot the device map names and misses from host RAM; the twin's device map is a separate
    array the hooks keep current. ``stage``: misses go through the VRAM scratch (ubatches of 1-2
    tokens; the scratch starts as garbage, so a pair read from the wrong scratch row shows)."""
    from moecache.moe.routing import Routing

    rng = np.random.default_rng(100 + seed)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = int(rng.integers(2, c.n_layer * c.n_expert - 1))
        cache = _zero_copy_cache(ew, c.n_layer, c.n_expert, n_slots, NEVER, stage)
        assert cache.zero_copy and cache.zero_copy_why is None and (cache.scratch is not None) == stage
        if stage:
            for arr in cache.scratch:
                arr[...] = rng.integers(0, 256, arr.shape, dtype=np.uint8)  # garbage, finite or not
        pairs = [(int(p) // c.n_expert, int(p) % c.n_expert)
                 for p in rng.choice(c.n_layer * c.n_expert, n_slots - 1, replace=False)]
        _fill(cache, ew, [(il, (e + 1) % c.n_expert) for il, e in pairs])  # slot s: the next expert's bytes
        cache.slot_of[:] = -1  # ... mapped as expert e
        for s, (il, e) in enumerate(pairs):
            cache.slot_of[il, e] = s
        for arr in (cache.pool.gate, cache.pool.up, cache.pool.down):
            arr[n_slots - 1] = 0xFF  # an unmapped slot: NaN scales if anything reads it
        cache._map_dirty = True
        ref_ex = CPUExperts(ew, NumpyBackend())
        t = int(rng.integers(1, 3 if stage else 17))
        cache.begin_pass(t)
        np.testing.assert_array_equal(cache._map_dev, cache.slot_of)
        routes = {}
        for il in ew:
            h = rng.standard_normal((t, c.n_embd)).astype(np.float32)
            r = topk_routing(rng.dirichlet(np.ones(c.n_expert), t).astype(np.float32), c.n_expert_used, True)
            routes[il] = r.ids
            hit = cache.slot_of[il][r.ids] >= 0
            shifted = Routing(np.where(hit, (r.ids + 1) % c.n_expert, r.ids).astype(np.int32), r.weights)
            np.testing.assert_allclose(cache(il, h, r), ref_ex(il, h, shifted), rtol=1e-5, atol=1e-6)
        cache.launched()
        cache.end_pass()
        assert cache.stats.tokens == 0  # accounted while the next pass runs
        cache.launched()
        hits = sum(int((cache.slot_of[il][routes[il]] >= 0).sum()) for il in ew)
        assert cache.stats.tokens == t and cache.stats.hits == hits
        assert cache.stats.hits + cache.stats.misses == len(ew) * t * c.n_expert_used
        cache.close()


def test_zero_copy_device_map_never_shows_a_slot_in_flight(model_path):
    """Admissions made while a pass runs reach the device map only after their copy completed, and a
    victim leaves the device map before the pass that follows its eviction."""
    from moecache.moe.routing import Routing

    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        cache = _zero_copy_cache(ew, c.n_layer, c.n_expert, 2, PolicyConfig(min_residency=0, hysteresis=0.0))
        h = np.ones((1, c.n_embd), np.float32)
        k = c.n_expert_used

        def step(ids):
            cache.begin_pass(1)
            dev = cache._map_dev.copy()
            for il, e in zip(*np.nonzero(dev >= 0)):  # every mapped slot is owned by, and holds, its expert
                s = dev[il, e]
                assert cache.pool.owner[s] == (il, e)
                for pool_arr, src in zip((cache.pool.gate, cache.pool.up, cache.pool.down),
                                         (ew[il].gate, ew[il].up, ew[il].down)):
                    np.testing.assert_array_equal(pool_arr[s], src[e])
            cache(0, h, Routing(np.array([ids[:k]], np.int32), np.full((1, k), 1.0 / k, np.float32)))
            cache.launched()
            cache.end_pass()
            return dev

        step([3, 5, 7, 9])
        dev = step([3, 5, 7, 9])  # the first pass is accounted now: two admissions, copies in flight
        assert cache.stats.uploads == 2 and (dev[0] == -1).all()
        dev = step([3, 5, 7, 9])
        assert (dev[0] == -1).all()  # the twin's copies land at their second poll
        dev = step([3, 5, 7, 9])
        assert sorted(np.flatnonzero(dev[0] >= 0).tolist()) == [3, 5]
        for _ in range(12):  # a new hot set: 3 and 5 are evicted for two of it
            dev = step([11, 13, 2, 4])
        now = sorted(np.flatnonzero(cache.slot_of[0] >= 0).tolist())
        assert len(now) == 2 and set(now) <= {11, 13, 2, 4}
        assert sorted(np.flatnonzero(dev[0] >= 0).tolist()) == now
        cache.close()


def test_zero_copy_generation_with_a_churning_cache_matches_cpu_at_every_step(model_path):
    rng = np.random.default_rng(4)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = c.n_layer * c.n_expert // 4
        cache = _zero_copy_cache(ew, c.n_layer, c.n_expert, n_slots, PolicyConfig(window=8, min_residency=1, hysteresis=0.1))
        ref_lm = build_model(m, NumpyBackend())
        lm = build_model(m, NumpyBackend(), experts=cache, pass_hooks=[cache])
        # expected hits: each zero-copy pass's routing against the device map at its begin_pass
        want = {"hits": 0, "map": None}
        begin, zero_copy = cache.begin_pass, cache._zero_copy

        def spy_begin(n):
            begin(n)
            want["map"] = cache._map_dev.copy()

        def spy_zero_copy(il, e, h, r, t, part=None):
            want["hits"] += int((want["map"][il][r.ids] >= 0).sum())
            return zero_copy(il, e, h, r, t, part)

        cache.begin_pass, cache._zero_copy = spy_begin, spy_zero_copy
        kv_ref, kv = ref_lm.new_kv_cache(160), lm.new_kv_cache(160)
        prompt = rng.integers(0, c.n_vocab, 40)
        np.testing.assert_allclose(lm.forward(prompt, kv), ref_lm.forward(prompt, kv_ref), rtol=1e-4, atol=1e-5)
        tok = int(prompt[-1])
        for step in range(60):
            n = 1 if step % 10 else 3  # a few multi-token decode ubatches
            toks = np.array([tok] + list(rng.integers(0, c.n_vocab, n - 1)))
            ref = ref_lm.forward(toks, kv_ref)
            got = lm.forward(toks, kv)
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=f"step {step}")
            tok = int(rng.integers(0, c.n_vocab))
        s = cache.stats
        assert s.tokens == 40 + 54 + 6 * 3 - 1  # prompt + decode; the last pass is accounted at the next launch
        cache.flush()
        assert s.tokens == 40 + 54 + 6 * 3 and s.hits == want["hits"]
        assert s.hits + s.misses == (54 + 6 * 3) * c.n_layer * c.n_expert_used
        assert s.hits > 0 and s.misses > 0 and s.uploads > n_slots
        cache.close()


class Twin(NumpyBackend):
    """A NumpyBackend standing in for GPU 0 (the placement's device)."""

    device = 0


def test_engine_places_the_cache_when_the_model_does_not_fit(model_path, monkeypatch):
    import moecache.engine as engine_mod
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import RESERVE_BYTES, USABLE_FRACTION, PlacementOptions, model_sizes

    with open_gguf(model_path) as m:
        sz = model_sizes(m, 96)
    need_dense = sum(sz.dense) + sz.n_layer * sz.kv + sz.output
    free = int((RESERVE_BYTES + sz.largest_matrix_f32 + need_dense + sum(sz.experts) // 3) / USABLE_FRACTION)
    monkeypatch.setattr(engine_mod, "gpu_memory", lambda: ([free], [0], ""))
    monkeypatch.setattr(engine_mod, "make_backends", lambda devices, log, act_q8=True, prompt_q8=False: {-1: NumpyBackend(), 0: Twin()})
    notes: list[str] = []
    rng = np.random.default_rng(5)
    with Engine(model_path, EngineConfig(n_ctx=96)) as ref, \
            Engine(model_path, EngineConfig(n_ctx=96), log=notes.append, placement=PlacementOptions()) as eng:
        pl = eng.placement
        assert pl.layer_device == (0,) * sz.n_layer and not any(pl.experts_on_device)
        assert len(pl.cache_slots) == 1 and 0 < pl.cache_slots[0][1] < sum(sz.experts) // sz.expert_each
        assert any("expert cache on GPU 0 (the model does not fit in VRAM)" in n for n in notes)
        toks = rng.integers(0, m.config.n_vocab, 40)
        np.testing.assert_allclose(eng.eval(toks), ref.eval(toks), rtol=1e-4, atol=1e-5)
        for i in range(30):
            t = [int(rng.integers(0, m.config.n_vocab))]
            np.testing.assert_allclose(eng.eval(t), ref.eval(t), rtol=1e-4, atol=1e-5)
        st = eng.caches[0].stats
        assert st.hits > 0 and st.uploads > 0


@pytest.mark.parametrize("opts,want", [
    (dict(), "expert cache on GPU 0"), (dict(moe_cache=0), "expert cache off (--moe-cache 0)"),
    (dict(cpu_moe=True), "expert cache off: --cpu-moe"), (dict(cpu_moe=True, moe_cache=64), "requested 64 MiB")])
def test_cache_sizing_notes(opts, want):
    from moecache.placement import ModelSizes, PlacementOptions, plan
    from moecache.probe import GiB

    sizes = ModelSizes((GiB // 2,) * 8, (2 * GiB,) * 8, GiB // 4, GiB // 2, 0, 2 * GiB // 128)
    p = plan(PlacementOptions(**opts), sizes, [12 * GiB])
    assert any(want in n for n in p.notes), p.notes
    if "moe_cache" in opts and opts["moe_cache"] == 64:
        assert p.cache_slots == ((0, (64 << 20) // sizes.expert_each),)
    p = plan(PlacementOptions(vram_budget=8 * GiB), sizes, [80 * GiB])  # a big GPU, emulated small
    slots = dict(p.cache_slots)[0]
    assert not any(p.experts_on_device) and slots * sizes.expert_each < 8 * GiB - 6 * GiB


def test_cli_cache_flags(model_path):
    import json

    from typer.testing import CliRunner

    from moecache.cli.main import app

    run = ["run", "-m", str(model_path), "-p", "hello", "-n", "3", "--temp", "0", "-c", "64"]
    r = CliRunner().invoke(app, run + ["--moe-cache", "0", "--vram-budget", "8GiB", "--routing", "qwen3-moe",
                                       "--moe-cache-window", "16", "--json"])
    assert r.exit_code == 0, r.output
    assert "output text is meaningless" in r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("{"))
    assert len(json.loads(line)["tokens"]) == 3
    for args, msg in ((["--vram-budget", "lots"], "--vram-budget 'lots'"), (["--routing", "zipf"], "not a preset"),
                      (["--moe-cache", "-5"], "--moe-cache '-5': expected -1")):
        r = CliRunner().invoke(app, run + args)
        assert r.exit_code == 1 and msg in r.output, r.output


def _prompt_group_sizes(m, cache, rng, monkeypatch) -> list[int]:
    """A 40-token prompt through a model whose experts are ``cache``, checked against the all-CPU
    logits; the number of experts of each prompt group's backend call (not the slots' call), in
    call order."""
    sizes: list[int] = []
    real = cache.be.moe_ffn

    def spy(gate, up, down, types, routing, h, act):
        if gate is not cache.pool.gate:
            sizes.append(gate.shape[0])
            ids = np.asarray(routing.ids)
            assert ids.shape == (h.shape[0], m.config.n_expert_used) and ids.min() >= -1 and ids.max() < gate.shape[0]
        return real(gate, up, down, types, routing, h, act)
    monkeypatch.setattr(cache.be, "moe_ffn", spy)
    ref_lm = build_model(m, NumpyBackend())
    lm = build_model(m, NumpyBackend(), experts=cache)
    prompt = rng.integers(0, m.config.n_vocab, 40)
    np.testing.assert_allclose(lm.forward(prompt, lm.new_kv_cache(64), logits="all"),
                               ref_lm.forward(prompt, ref_lm.new_kv_cache(64), logits="all"), rtol=1e-4, atol=1e-5)
    return sizes


@pytest.mark.parametrize("pinned", [True, False])
def test_prompt_ubatch_brings_its_experts_in_bounded_groups(model_path, monkeypatch, pinned):
    """A prompt ubatch whose used experts exceed PROMPT_GROUP_BYTES computes the resident ones from
    their slots in one call and the others group by group, each call on the whole ubatch with the
    other experts' pairs marked -1; the output is the all-CPU output, no group brings more than the
    cap's worth of experts, and none brings a resident expert. With page-locked weights (``pinned``)
    the groups alternate between two buffers, the next group's copy started before this group's
    call (the twin's buffer reads NaN until its copy finishes, so a call on a buffer whose copy was
    not finished, or whose copy was restarted under it, would show); otherwise each group is
    uploaded in turn."""
    rng = np.random.default_rng(5)
    with open_gguf(model_path) as m:
        c, ew, per, cache = _group_cache(m, monkeypatch)
        cache.prompt_stacks = False  # the groups (the default)
        cache.prompt_group_ahead = False  # buffers per layer (the copy ahead: the tests below)
        if not pinned:
            monkeypatch.setattr(cache.be, "zero_copy_ok", lambda arrays: "host experts are not in page-locked memory")
        resident = [(il, e) for il in range(c.n_layer) for e in (1, 6, 11, 14)][:8]
        _fill(cache, ew, resident)
        layers, starts, uploads, allocs = [], [], [], []
        _spy(monkeypatch, cache, "_prompt_groups", layers)
        _spy(monkeypatch, cache.be, "upload_experts", uploads)
        _spy(monkeypatch, cache.be, "empty_u8", allocs)
        _spy_starts(monkeypatch, cache, starts)
        sizes = _prompt_group_sizes(m, cache, rng, monkeypatch)
        assert max(sizes) == 3 and len(sizes) >= c.n_layer * 2  # every layer split, none over the cap
        assert cache.prompt_slot_reads > 0  # resident experts read from their slots
        res = set(resident)
        brought = []
        if pinned:
            assert not uploads and all(compact for *_, compact in starts)
            assert len(starts) == len(sizes)  # one copy per group
            for ws, ids, out, _ in starts:
                brought.append((next(i for i in ew if ws[0] is ew[i].gate), ids))
            # two buffers per layer of two groups or more, reused: 6 arrays (gate, up, down each)
            assert len(allocs) == 6 * len(layers)
            bufs_of = {}
            for ws, ids, out, _ in starts:
                bufs_of.setdefault(id(ws[0]), set()).add(id(out[0]))
            assert all(len(b) == 2 for b in bufs_of.values())
        else:
            assert not starts and not allocs
            assert len(uploads) == 3 * len(sizes)  # gate, up, down of each group
            for w, ids in uploads[::3]:
                brought.append((next(i for i in ew if w is ew[i].gate), ids))
        for il, ids in brought:
            assert not {(il, int(x)) for x in ids} & res  # a resident expert is never copied again
        cache.close()


def test_prompt_group_ahead_copies_the_next_layers_first_group_during_this_layer(model_path, monkeypatch):
    """prompt_group_ahead (on by default, page-locked weights): after a prompt layer's groups, the next cached
    layer's first group (its first non-resident experts by id) is copied into the free one of two
    group buffers kept across the layers; that layer computes its first group from it. The logits
    equal the all-CPU model's (the twin's buffers read NaN until their copy finishes, so a group
    computed from a buffer whose copy was not finished, or was restarted under it, would show); every
    layer but the first takes its first group from the copy ahead, none is dropped; the two buffers
    are made once for the pass; no resident expert is copied; a decode pass gives the buffers back."""
    rng = np.random.default_rng(7)
    with open_gguf(model_path) as m:
        c, ew, per, cache = _group_cache(m, monkeypatch)
        cache.prompt_group_ahead = True
        # three residents in layers 0 and 1, two in layer 2: odd numbers of groups, so copies ahead land
        # in either buffer
        resident = [(il, e) for il in range(c.n_layer) for e in (0, 6, 11)][:8]
        _fill(cache, ew, resident)
        starts, allocs, aheads = [], [], []
        _spy(monkeypatch, cache.be, "empty_u8", allocs)
        _spy(monkeypatch, cache._group_ahead, "begin", aheads)
        _spy_starts(monkeypatch, cache, starts)
        sizes = _prompt_group_sizes(m, cache, rng, monkeypatch)
        assert max(sizes) == 3
        assert cache.group_prefetch == [c.n_layer - 1, c.n_layer - 1, 0]
        assert len(allocs) == 6  # two buffers of gate, up, down for the whole pass
        assert {tag[0] for *_, tag in aheads} == {0, 1}  # both buffers took a copy ahead
        assert cache.offload.offloaded_bytes == per * sum(ids.size for _, ids, _, _ in starts)  # each copy once
        outs = {id(o[0]) for *_, o, _ in starts}
        assert len(outs) == 2 and all(compact for *_, compact in starts)
        res = set(resident)
        for ws, ids, _, _ in starts:
            il = next(i for i in ew if ws[0] is ew[i].gate)
            assert not {(il, int(x)) for x in ids} & res
        # the copies ahead: each layer after the first, its first non-resident experts by id
        firsts = [(next(i for i in ew if ws[0] is ew[i].gate), ids) for ws, ids, _, _ in starts]
        for il in range(1, c.n_layer):
            want = np.flatnonzero(cache.slot_of[il] < 0)[:3]
            assert any(j == il and np.array_equal(ids, want) for j, ids in firsts)
        assert cache._gbufs is not None
        cache._prompt_seen = False  # (no fill after the prompt: _fill set the slots behind the policy's back)
        cache.begin_pass(1)  # a decode pass: the kept buffers go back
        assert cache._gbufs is None
        cache.close()


def test_prompt_group_ahead_skips_unused_and_newly_resident_experts(model_path):
    """The first group copied ahead is chosen before the layer's routing: an expert of it that the
    ubatch does not use is not computed (a group none of whose experts is used makes no call), and
    one made resident since the copy began is computed from its slot only, not twice; the layer's
    output equals the CPU kernel's over the same routing."""
    from moecache.moe.routing import Routing
    from moecache.quants import cpu

    rng = np.random.default_rng(11)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        per = CachedExperts._expert_bytes(ew[0])
        cache = CachedExperts(ew, NumpyBackend(), 8, CachePolicy(c.n_layer, c.n_expert, 8, NEVER), 32,
                              prompt_group_bytes=3 * per)
        cache.prompt_group_ahead = True
        cache.prompt_keep = False  # the slots as the test sets them (keeps: the tests below)
        t, k = 40, c.n_expert_used
        h = rng.standard_normal((t, c.n_embd)).astype(np.float32)
        ids0 = np.stack([rng.choice(c.n_expert, k, replace=False) for _ in range(t)]).astype(np.int32)
        w = rng.dirichlet(np.ones(k), t).astype(np.float32)
        cache._prompt_groups(0, ew[0], h, Routing(ids0, w), np.unique(ids0))
        assert cache.group_prefetch[0] == 1  # layer 1's experts 0, 1, 2 in flight
        _fill(cache, ew, [(1, 1)])  # expert 1 of layer 1 made resident while its copy ran
        ids1 = np.stack([rng.choice(np.arange(1, c.n_expert), k, replace=False) for _ in range(t)]).astype(np.int32)
        ids1[0, 0] = 1  # expert 1 used (from its slot); expert 0 never used
        r1 = Routing(ids1, w)
        calls = []
        real = cache.be.moe_ffn
        cache.be.moe_ffn = lambda *a: (calls.append(np.asarray(a[4].ids)), real(*a))[1]
        got = cache._prompt_groups(1, ew[1], h, r1, np.unique(ids1))
        e1 = ew[1]
        eids, offs, rows, wts = r1.groups()
        want = cpu.moe_ffn(e1.gate, e1.up, e1.down, e1.types, eids, offs, rows, wts, h)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert cache.group_prefetch[1] == 1
        slot_call, first_group = calls[0], calls[1]
        assert (slot_call[ids1 == 1] == cache.slot_of[1, 1]).all()
        assert (first_group[ids1 == 1] == -1).all() and (first_group[ids1 == 2] == 2).all()
        # a first group of which nothing is used: no call for it
        cache._prompt_groups(0, ew[0], h, Routing(ids0, w), np.unique(ids0))
        ids2 = np.stack([rng.choice(np.arange(4, c.n_expert), k, replace=False) for _ in range(t)]).astype(np.int32)
        calls.clear()
        got = cache._prompt_groups(1, ew[1], h, Routing(ids2, w), np.unique(ids2))
        eids, offs, rows, wts = Routing(ids2, w).groups()
        np.testing.assert_allclose(got, cpu.moe_ffn(e1.gate, e1.up, e1.down, e1.types, eids, offs, rows, wts, h),
                                   rtol=1e-4, atol=1e-5)
        # no resident expert used, experts 4-15 in four groups of three; the group ahead (0, 2, 3) not called
        assert len(calls) == 4 and cache.group_prefetch[1] == 2
        # lifecycle: a copy ahead that no layer takes is dropped by the next pass; the kept buffers stay
        # for prompt passes, go back for a decode pass and when the option is switched off
        cache.be.moe_ffn = real
        s0, u0, d0 = cache.group_prefetch  # layer 1 left a copy for layer 2 in flight
        cache._prompt_groups(0, ew[0], h, Routing(ids0, w), np.unique(ids0))  # drops it, starts layer 1's
        cache.begin_pass(t)  # a new prompt pass: layer 1's copy is dropped, the buffers stay
        assert cache.group_prefetch == [s0 + 1, u0, d0 + 2] and cache._gbufs is not None
        cache.begin_pass(1)
        assert cache._gbufs is None
        cache._prompt_groups(0, ew[0], h, Routing(ids0, w), np.unique(ids0))
        assert cache._gbufs is not None
        cache.prompt_group_ahead = False
        cache._prompt_groups(0, ew[0], h, Routing(ids0, w), np.unique(ids0))
        assert cache._gbufs is None and cache.group_prefetch == [s0 + 2, u0, d0 + 3]
        cache.close()


@pytest.mark.parametrize("pinned", [True, False])
def test_prompt_keeps_leave_copied_experts_in_the_empty_slots(model_path, monkeypatch, pinned):
    """prompt_keep (on by default): a prompt ubatch's groups leave, in each cached layer, its share of
    the empty slots (the empty slots divided by the layers left: 1, 1, 2, 2 of the 6 empty here) holding
    the layer's used, non-resident experts of most routed pairs, copied from the group buffer on
    the device (the twin's buffers read 0xFF until their copy finishes, so a copy from a buffer not
    yet filled, or refilled for a later group, would show in the slots' bytes); residents set
    before stay where they are; no upload is counted. The next prompt reads the kept experts from
    their slots and copies none of them from the host, and both prompts' logits equal the all-CPU
    model's."""
    rng = np.random.default_rng(17)
    with open_gguf(model_path) as m:
        c, ew, per, cache = _group_cache(m, monkeypatch)
        assert cache.prompt_keep
        if not pinned:
            monkeypatch.setattr(cache.be, "zero_copy_ok", lambda arrays: "host experts are not in page-locked memory")
        resident = [(0, 5), (2, 7)]
        _fill(cache, ew, resident)
        for il, x in resident:
            cache.policy.keep(il, np.array([x]))
        layers, starts, uploads = [], [], []
        _spy(monkeypatch, cache, "_prompt_groups", layers)
        _spy(monkeypatch, cache.be, "upload_experts", uploads)
        _spy_starts(monkeypatch, cache, starts)
        _prompt_group_sizes(m, cache, rng, monkeypatch)
        assert len(layers) == c.n_layer
        kept, free = set(), 6
        for i, (il, e_, h, r, used) in enumerate(layers):
            n = free // (c.n_layer - i)  # this layer's share of the slots still empty
            free -= n
            pairs = np.bincount(np.asarray(r.ids).reshape(-1), minlength=c.n_expert)
            cand = [int(x) for x in used if (il, int(x)) not in resident]
            kept |= {(il, x) for x in sorted(cand, key=lambda x: (-pairs[x], x))[:n]}
        assert c.n_layer == 4 and [sum(1 for k in kept if k[0] == il) for il in range(4)] == [1, 1, 2, 2]
        assert {(il, x) for il, x in zip(*np.nonzero(cache.slot_of >= 0))} == kept | set(resident)
        assert cache.prompt_keeps == 6 and cache.policy.n_resident == 8 and cache.stats.uploads == 0
        for il, x in resident:
            assert cache.slot_of[il, x] == resident.index((il, x))  # not moved, not evicted
        for il, x in kept:
            sl = cache.slot_of[il, x]
            assert cache.pool.owner[sl] == (il, x)
            for pool_arr, w in zip((cache.pool.gate, cache.pool.up, cache.pool.down), (ew[il].gate, ew[il].up, ew[il].down)):
                assert np.array_equal(pool_arr[sl], w[x])
        # the next prompt: the kept experts are read from their slots, never copied again
        layers.clear(), starts.clear(), uploads.clear()
        reads = cache.prompt_slot_reads
        _prompt_group_sizes(m, cache, rng, monkeypatch)
        assert cache.prompt_keeps == 6  # no empty slot left: no keep
        used2 = {(il, int(x)) for il, _, _, _, used in layers for x in used}
        assert cache.prompt_slot_reads - reads == len(used2 & (kept | set(resident))) > 0
        brought = ([(next(i for i in ew if ws[0] is ew[i].gate), ids) for ws, ids, _, _ in starts] if pinned
                   else [(next(i for i in ew if w is ew[i].gate), ids) for w, ids in uploads[::3]])
        assert brought and not {(il, int(x)) for il, ids in brought for x in ids} & kept
        cache.close()


def _ubatch(c, rng, experts, t=40):
    """A prompt ubatch of ``t`` tokens for one layer of config ``c``: (h float32 (t, n_embd), ids int32
    (t, k) each token's k distinct experts drawn from ``experts``, w float32 (t, k) weights summing to 1)."""
    k = c.n_expert_used
    h = rng.standard_normal((t, c.n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    return h, ids, rng.dirichlet(np.ones(k), t).astype(np.float32)


def _slots_agree(cache):
    """The pool, the map, the policy and the kept mask agree: every owned slot's expert owns no other
    slot, is resident in the policy and mapped to that slot (or its copy is in flight); the policy
    counts exactly the owned slots; every kept expert is resident."""
    owned = [(s, o) for s, o in enumerate(cache.pool.owner) if o is not None and o != ("lent",)]
    keys = [o for _, o in owned]
    assert len(set(keys)) == len(keys)
    flight = {(p[1], p[2]): p[3] for p in cache._pending}
    for s, key in owned:
        assert cache.policy.resident[key]
        assert cache.slot_of[key] == s or flight.get(key) == s
    assert cache.policy.n_resident == int(cache.policy.resident.sum()) == len(owned)
    assert not (cache._kept & ~cache.policy.resident).any()
    mapped = np.argwhere(cache.slot_of >= 0)
    assert all(cache.pool.owner[cache.slot_of[il, x]] == (il, x) for il, x in mapped)


def test_prompt_keeps_skip_experts_whose_admission_is_in_flight(model_path):
    """An expert decode admitted into an empty slot whose copy has not landed yet (mapped -1, the
    policy holding it) is not kept into a second slot by a prompt that uses it; the pool, the map and
    the policy agree after the prompt, after the copy lands, and after a second prompt past decode
    admissions into slots the first one left empty; the prompts' output is the CPU kernel's."""
    from moecache.moe.routing import Routing
    from moecache.quants import cpu

    rng = np.random.default_rng(31)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        cache = _cache(ew, c.n_layer, c.n_expert, 40, NEVER)
        h, ids, w = _ubatch(c, rng, np.arange(6))  # experts 0-5
        r = Routing(ids, w)
        hot = int(np.argmax(np.bincount(ids.reshape(-1), minlength=c.n_expert)))
        cache.policy.keep(0, np.array([hot]))  # (the policy's side of an admission)
        cache._apply([Admission(0, hot, None)])  # its copy in flight: lands at the second poll
        for il in range(c.n_layer):
            got = cache(il, h, r)
            e = ew[il]
            eids, offs, rows, wts = r.groups()
            np.testing.assert_allclose(got, cpu.moe_ffn(e.gate, e.up, e.down, e.types, eids, offs, rows, wts, h),
                                       rtol=1e-4, atol=1e-5)
            if il == 0:
                assert sum(o == (0, hot) for o in cache.pool.owner) == 1 and not cache._kept[0, hot]
                _slots_agree(cache)
        assert cache.prompt_keeps == 6 * c.n_layer - 1  # every used expert (40 slots), the admitted one apart
        cache._settle(1e18)
        _slots_agree(cache)
        assert cache.slot_of[0, hot] >= 0
        # decode admissions into slots the prompt left empty, then a prompt using other experts
        free = [s for s, o in enumerate(cache.pool.owner) if o is None]
        adm = [(il, 6) for il in range(min(len(free), c.n_layer))]
        for il, x in adm:
            cache.policy.keep(il, np.array([x]))
        cache._apply([Admission(il, x, None) for il, x in adm])
        _, ids2, _ = _ubatch(c, rng, np.arange(6, 12))
        for il in range(c.n_layer):
            cache(il, h, Routing(ids2, w))
            _slots_agree(cache)
        cache._settle(1e18)
        _slots_agree(cache)
        cache.close()


def test_prompt_keeps_are_chosen_again_by_the_first_decode_pass(model_path, monkeypatch):
    """fill_after_prompt with kept experts: they count as empty slots for the policy's choice; the
    chosen ones stay in place (not copied again), the chosen others are loaded, and kept experts
    not chosen give up their slots only as the loads need them, least used first (a choice of fewer
    experts than slots, as a layer plan may make, leaves the rest of them resident)."""
    from moecache.moe.routing import Routing

    rng = np.random.default_rng(23)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        cache = _cache(ew, c.n_layer, c.n_expert, 6, NEVER)
        h, ids, w = _ubatch(c, rng, np.arange(c.n_expert))
        for il in range(c.n_layer):
            cache(il, h, Routing(ids, w))  # keeps: 2 a layer
        kept = {(il, int(x)) for il, x in zip(*np.nonzero(cache.slot_of >= 0))}
        assert len(kept) == 6 and cache._kept.sum() == 6
        usage = cache.policy.usage
        usage[...] = 0.0
        ranked = sorted(kept)
        for i, key in enumerate(ranked):
            usage[key] = 1.0 + i  # the kept experts' usage: ranked[0] least used
        new = [(il, x) for il in range(c.n_layer) for x in range(c.n_expert) if (il, x) not in kept][:3]
        choice = [ranked[5], new[0], new[1]]  # one kept expert chosen, two new ones; three slots unused
        real = cache.policy.preload

        def preload(u):
            out = real(np.where(np.isin(np.arange(u.size).reshape(u.shape),
                                        [il * c.n_expert + x for il, x in choice]), 1.0, 0.0))
            cache.policy.usage[...] = u
            return out
        monkeypatch.setattr(cache.policy, "preload", preload)
        before = {key: int(cache.slot_of[key]) for key in kept}
        assert cache.fill_after_prompt() == 2
        cache._settle(1e18)
        now = {(il, int(x)) for il, x in zip(*np.nonzero(cache.slot_of >= 0))}
        # loads need 2 slots, none free: the two least used kept experts not chosen (ranked[0], ranked[1]) go
        assert now == set(choice) | set(ranked[2:5])
        assert all(cache.slot_of[key] == before[key] for key in ranked[2:])
        assert cache.policy.n_resident == 6 and cache.stats.uploads == 2
        assert all(cache.pool.owner[cache.slot_of[key]] == key for key in now)
        assert not cache._kept.any()
        cache.close()


def _prompt_matches_cpu(lm, ref_lm, prompt):
    """Every position's logits of ``prompt`` through ``lm`` equal the all-CPU model's ``ref_lm``'s."""
    np.testing.assert_allclose(lm.forward(prompt, lm.new_kv_cache(64), logits="all"),
                               ref_lm.forward(prompt, ref_lm.new_kv_cache(64), logits="all"), rtol=1e-4, atol=1e-5)


def _group_cache(m, monkeypatch):
    """(config, expert weights, bytes of one expert, a cache of 8 slots that never uploads) for model
    ``m``, with prompt groups of three experts."""
    import moecache.moe.cache as cache_mod

    c = m.config
    ew = expert_weights(m, "silu")
    per = CachedExperts._expert_bytes(ew[0])
    monkeypatch.setattr(cache_mod, "PROMPT_GROUP_BYTES", 3 * per)
    return c, ew, per, _cache(ew, c.n_layer, c.n_expert, 8, NEVER)


def _spy_starts(monkeypatch, cache, starts):
    """Record each ``start_upload`` of ``cache``'s backend in ``starts`` as (ws, experts copied, out,
    compact), then make the call."""
    real = cache.be.start_upload
    monkeypatch.setattr(cache.be, "start_upload", lambda ws, experts=None, out=None, compact=False: (
        starts.append((ws, experts.copy(), out, compact)), real(ws, experts, out, compact))[1])


def _spy(monkeypatch, obj, name, calls):
    """Record the arguments of every call of ``obj.name`` in ``calls``, then make the call."""
    real = getattr(obj, name)

    def spy(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(obj, name, spy)


@pytest.mark.parametrize("limit", ["none", "two stacks", "one stack", "no stack", "default"])
def test_prompt_stacks_read_residents_from_slots_and_copy_the_next_layer_ahead(model_path, monkeypatch, limit):
    """prompt_stacks (opt-in): two 40-token prompts give the all-CPU logits with every layer
    computed from one stack of its experts, in two buffers (prompt_stack_buffers = 2) allocated once
    and used in turn; the resident
    experts come from their slots (device copies), never from the host; each layer after the first
    computes from the copy of its non-resident experts begun while the layer before computed (the
    twin's copies read 0xFF bytes, NaN, until finished, and wherever no expert was copied). With
    --vram-budget's room for one buffer only, no copy runs ahead; with room for none, the layers
    bring their experts in groups; either is noted once. With prompt_stack_buffers left at its
    default, 1 (no budget): one buffer, no copy ahead, and no note."""
    import moecache.moe.cache as cache_mod

    rng = np.random.default_rng(8)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        stack = sum(int(w.nbytes) for w in (ew[0].gate, ew[0].up, ew[0].down))
        margin = cache_mod.STACK_MARGIN_BYTES  # what the layer's MoE call allocates after the buffers
        vram_limit = {"none": None, "two stacks": 2 * stack + margin, "one stack": 2 * stack + margin - 1,
                      "no stack": stack + margin - 1, "default": None}[limit]
        notes = []
        cache = CachedExperts(ew, NumpyBackend(), 8, CachePolicy(c.n_layer, c.n_expert, 8, NEVER), 32,
                              vram_limit=vram_limit, log=notes.append)
        assert not cache.prompt_stacks  # the default since the fifteenth session: the groups
        cache.prompt_stacks = True
        assert cache.prompt_stack_buffers == 1  # the default: the copy ahead gained nothing on the H200
        if limit != "default":
            cache.prompt_stack_buffers = 2
        resident = [(il, e) for il in range(c.n_layer) for e in (2, 5)][:8]
        _fill(cache, ew, resident)
        real_empty, real_buffers = cache.be.empty_u8, cache._stack_buffers
        allocs, in_stacks = [], [False]

        def empty(shape):  # the twin's memory in use grows with what the stacks allocate
            a = real_empty(shape)
            if in_stacks[0]:  # not the prompt groups' buffers
                allocs.append(a.nbytes)
                cache.be.in_use += a.nbytes
            return a

        def buffers(e):
            in_stacks[0] = True
            try:
                return real_buffers(e)
            finally:
                in_stacks[0] = False
        monkeypatch.setattr(cache.be, "empty_u8", empty)
        monkeypatch.setattr(cache, "_stack_buffers", buffers)
        uploads, gathers, groups = [], [], []
        _spy(monkeypatch, cache.be, "upload_experts_into", uploads)
        _spy(monkeypatch, cache.be, "gather_into", gathers)
        _spy(monkeypatch, cache, "_prompt_groups", groups)
        ref_lm = build_model(m, NumpyBackend())
        lm = build_model(m, NumpyBackend(), experts=cache)
        for _ in range(2):
            _prompt_matches_cpu(lm, ref_lm, rng.integers(0, c.n_vocab, 40))
        n_bufs = {"none": 2, "two stacks": 2, "one stack": 1, "no stack": 0, "default": 1}[limit]
        assert sum(allocs) == n_bufs * stack  # allocated once, for both prompts
        assert len(notes) == (n_bufs < cache.prompt_stack_buffers) and all("room for" in n for n in notes)
        started, used, dropped = cache.stack_prefetch
        if not n_bufs:
            assert not uploads and not gathers and len(groups) >= 2 * c.n_layer and started == 0
            return
        assert not groups and dropped == 0
        ahead = n_bufs == 2
        assert started == used == (2 * (c.n_layer - 1) if ahead else 0)
        res = {(il, e) for il, e in resident}
        for dst, w, ids in [u for u in uploads if u[2].size]:  # host copies: never a resident expert
            il = next(i for i in ew if w is ew[i].gate or w is ew[i].up or w is ew[i].down)
            assert not {(il, int(x)) for x in ids} & res
            assert not ahead or il == min(ew)  # with copies ahead only the first layer copies its own
        assert cache.prompt_slot_reads > 0
        gathered = {cache.pool.owner[int(slot)] for _, ids, _, rows in gathers for slot in rows}
        assert gathered == res  # every resident expert (40-token prompts use them all) from its slot
        cache.close()


def test_prompt_stack_halves_copy_the_next_layers_half_while_the_other_computes(model_path, monkeypatch):
    """prompt_stack_halves (opt-in): one buffer, each prompt layer computed in two halves of its
    expert ids, the next layer's non-resident experts of a half copied once this layer's half is
    queued. Two 40-token prompts give the all-CPU logits; every layer after the first computes from
    the two copies begun during the layer before (the twin poisons a half with 0xFF bytes, NaN,
    while its copy is in flight, so a read of the half being copied, or of a position no one
    wrote, shows); only the first layer copies from the host on the compute stream; the resident
    experts come from their slots; one buffer's memory."""
    rng = np.random.default_rng(9)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        stack = sum(int(w.nbytes) for w in (ew[0].gate, ew[0].up, ew[0].down))
        cache = CachedExperts(ew, NumpyBackend(), 8, CachePolicy(c.n_layer, c.n_expert, 8, NEVER), 32)
        assert not cache.prompt_stack_halves  # opt-in
        cache.prompt_stacks = cache.prompt_stack_halves = True
        half = c.n_expert // 2
        resident = [(il, e) for il in range(c.n_layer) for e in (2, half + 1)][:8]  # one in each half
        _fill(cache, ew, resident)
        allocs, uploads, gathers, calls = [], [], [], []
        real_empty = cache.be.empty_u8
        monkeypatch.setattr(cache.be, "empty_u8", lambda shape: (allocs.append(int(np.prod(shape))), real_empty(shape))[1])
        _spy(monkeypatch, cache.be, "upload_experts_into", uploads)
        _spy(monkeypatch, cache.be, "gather_into", gathers)
        _spy(monkeypatch, cache.be, "moe_ffn", calls)
        ref_lm = build_model(m, NumpyBackend())
        lm = build_model(m, NumpyBackend(), experts=cache)
        for _ in range(2):
            _prompt_matches_cpu(lm, ref_lm, rng.integers(0, c.n_vocab, 40))
        assert sum(allocs) == stack  # one buffer, allocated once
        started, used, dropped = cache.stack_prefetch
        assert started == used == 2 * 2 * (c.n_layer - 1) and dropped == 0  # two halves per later layer
        assert len(calls) == 2 * 2 * c.n_layer  # one call per half and layer
        for _, _, _, _, routing, _, _ in calls:  # each call's pairs lie in one half (the others: -1, none)
            ids = np.asarray(routing.ids)
            ids = ids[ids >= 0]
            assert (ids < half).all() or (ids >= half).all()
        res = set(resident)
        for _, w, ids in [u for u in uploads if u[2].size]:
            il = next(i for i in ew if w is ew[i].gate or w is ew[i].up or w is ew[i].down)
            assert il == min(ew) and not {(il, int(x)) for x in ids} & res  # the first layer only, no resident
        gathered = {cache.pool.owner[int(slot)] for _, ids, _, rows in gathers for slot in rows}
        assert gathered == res
        assert cache.stack_prefetch[2] == 0  # nothing was in flight at the end of a prompt

        def one_prompt():
            calls.clear()
            _prompt_matches_cpu(lm, ref_lm, rng.integers(0, c.n_vocab, 40))
            return len(calls)

        # where no copy ahead can start, a layer is one call, as with one buffer: a ubatch with too few
        # pairs per expert, then weights a copy cannot start from (a mapped file on the GPU: the first
        # layer tries, its halves get no copy, and the prompt continues in one call per layer)
        import moecache.moe.cache as cache_mod

        monkeypatch.setattr(cache_mod, "MIN_PAIRS_PER_EXPERT", 10 ** 6)
        assert one_prompt() == c.n_layer and cache.stack_prefetch[0] == started
        monkeypatch.setattr(cache_mod, "MIN_PAIRS_PER_EXPERT", 2)
        monkeypatch.setattr(cache.be, "start_upload", lambda *a, **k: None)
        assert one_prompt() == 2 + (c.n_layer - 1) and not cache._copy_ok
        assert one_prompt() == c.n_layer
        cache.close()


def test_prompt_stacks_give_buffers_back_as_a_prompt_grows(model_path, monkeypatch):
    """_keep_room: the twin's memory in use is the live stack buffers plus the blocks the pool holds
    from the ubatch before (its transients). Each check returns those to the driver and measures
    them; while the buffers, those transients and their largest growth from one ubatch to the next
    (at least ROOM_FLOOR_BYTES) pass --vram-budget, a buffer goes back: the second first (no more
    copies ahead, noted), later the first (the groups); every ubatch still gives the all-CPU output."""
    import moecache.moe.cache as cache_mod

    rng = np.random.default_rng(10)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        s = sum(int(w.nbytes) for w in (ew[0].gate, ew[0].up, ew[0].down))  # one buffer
        monkeypatch.setattr(cache_mod, "STACK_MARGIN_BYTES", s)
        notes = []
        cache = CachedExperts(ew, NumpyBackend(), 8, CachePolicy(c.n_layer, c.n_expert, 8, NEVER), 32,
                              vram_limit=3 * s, log=notes.append)
        cache.prompt_stacks = True
        cache.prompt_stack_buffers = 2
        cached = [0]  # the pool's blocks from the ubatch before
        releases = []
        monkeypatch.setattr(cache.be, "memory_in_use",
                            lambda: sum(int(a.nbytes) for buf in (cache._bufs or []) for a in buf) + cached[0])
        monkeypatch.setattr(cache.be, "release_cached", lambda: (releases.append(cached[0]), cached.__setitem__(0, 0)))
        groups = []
        _spy(monkeypatch, cache, "_prompt_groups", groups)
        ref_ex = CPUExperts(ew, NumpyBackend())
        u = s // 16  # the floor is 4u; the limit 3s = 2s + 16u (+ s's remainder, under 16 bytes)
        monkeypatch.setattr(cache_mod, "ROOM_FLOOR_BYTES", 4 * u)
        # (transients of the ubatch before, buffers after the check, copies ahead); live buffers +
        # transients + max(largest growth, floor 4u) against 3s:
        steps = [(0, 2, True),  # no buffers yet: no check; both allocated (room_for: s + s, 2s + s <= 3s)
                 (14 * u, 1, False),  # 2s + 14u + floor 4u > 3s: one back (a growth-only rule would keep it)
                 (14 * u, 1, False),  # s + 14u + 4u
                 (22 * u, 1, False),  # s + 22u + growth 8u <= s + 32u
                 (25 * u, 0, False)]  # s + 25u + largest growth 8u > 3s (the latest, 3u, would keep it)
        for step, (trans, n_bufs, ahead) in enumerate(steps):
            cached[0] = trans
            if step == 1:
                cache._turn = 1  # the first layer would take the second buffer: the one given back
            n_rel = len(releases)
            cache.begin_pass(40)
            started = cache.stack_prefetch[0]
            groups.clear()
            for il in ew:
                h = rng.standard_normal((40, c.n_embd)).astype(np.float32)
                r = topk_routing(rng.dirichlet(np.ones(c.n_expert), 40).astype(np.float32), c.n_expert_used, True)
                np.testing.assert_allclose(cache(il, h, r), ref_ex(il, h, r), rtol=1e-5, atol=1e-6)
            assert len(cache._bufs) == n_bufs, step
            assert (cache.stack_prefetch[0] > started) == ahead, step
            assert bool(groups) == (n_bufs == 0), step
            if step:  # the check gave the pool's blocks back (and once more per buffer given back)
                assert releases[n_rel] == trans and len(releases) - n_rel == 1 + (n_bufs < steps[step - 1][1]), step
        assert len(notes) == 2 and "1 buffer(s) left (no copy ahead)" in notes[0] and "groups" in notes[1]
        # each note gives the figures it decided on (MiB; the twin's are KiB, so 0 here)
        assert all("in use" in n and "transients" in n and "growth allowed" in n and "budget" in n for n in notes)
        cache.close()


def test_prompt_stacks_without_a_budget_keep_within_the_gpu_memory(model_path):
    """No --vram-budget (vram_limit None): the stacks keep within the placement's share
    (USABLE_FRACTION) of the GPU's own memory (the twin's ``total``): a GPU whose memory in use
    leaves no room there for a buffer and its margin gives the prompt the groups, noted; with room,
    one buffer, given back (noted) at the first ubatch whose memory in use and the least growth
    allowed (ROOM_FLOOR_BYTES) pass that share. Every ubatch gives the all-CPU output."""
    import moecache.moe.cache as cache_mod

    rng = np.random.default_rng(11)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        stack = sum(int(w.nbytes) for w in (ew[0].gate, ew[0].up, ew[0].down))
        ref_ex = CPUExperts(ew, NumpyBackend())

        def prompt(cache):
            cache.begin_pass(40)
            for il in ew:
                h = rng.standard_normal((40, c.n_embd)).astype(np.float32)
                r = topk_routing(rng.dirichlet(np.ones(c.n_expert), 40).astype(np.float32), c.n_expert_used, True)
                np.testing.assert_allclose(cache(il, h, r), ref_ex(il, h, r), rtol=1e-5, atol=1e-6)

        for room in (False, True):
            notes = []
            cache = CachedExperts(ew, NumpyBackend(), 8, CachePolicy(c.n_layer, c.n_expert, 8, NEVER), 32,
                                  log=notes.append)
            assert cache.vram_limit is None
            cache.prompt_stacks = True
            cache.be.in_use = 1 << 30
            usable = cache.be.in_use + stack + cache_mod.STACK_MARGIN_BYTES - (0 if room else 1)
            cache.be.total = int(usable / cache_mod.USABLE_FRACTION) + 1  # the placement's share of it: usable
            prompt(cache)
            assert len(cache._bufs) == int(room)
            if not room:
                assert len(notes) == 1 and "room for 0 of 1" in notes[0] and "in the GPU's" in notes[0]
                cache.close()
                continue
            assert not notes  # the GPU's memory less what is in use: more than the floor
            prompt(cache)
            assert len(cache._bufs) == 1
            limit = int(cache.be.total * cache_mod.USABLE_FRACTION)
            cache.be.in_use = limit - cache_mod.ROOM_FLOOR_BYTES + 1  # the floor no longer fits
            prompt(cache)
            assert not cache._bufs and len(notes) == 1 and "near the GPU memory" in notes[0]
            assert f"GPU memory {limit >> 20} MiB" in notes[0]
            cache.close()


def test_close_waits_for_the_slot_copies_in_flight(model_path):
    """close() completes every slot copy still in flight, published or evicted (retired), before the
    slots' memory can go back: the twin's copies land only when polled twice or waited for, so a
    close that did not wait leaves 0xFF bytes where the experts belong."""
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        cache = _cache(ew, c.n_layer, c.n_expert, 2)
        cache._apply([Admission(0, 1, None), Admission(0, 2, None)])
        cache._apply([Admission(1, 3, (0, 2))])  # evicts (0, 2) while its copy is in flight: retired
        assert len(cache._pending) == 2 and len(cache._retired) == 1
        slot_13, slot_01 = cache.pool.owner.index((1, 3)), cache.pool.owner.index((0, 1))
        assert (cache.pool.gate[slot_13] == 0xFF).all()  # nothing landed yet
        retired = cache._retired[0]
        cache.close()
        assert not cache._pending and not cache._retired and retired.srcs is None  # the retired copy ran too
        for slot, (il, e) in ((slot_01, (0, 1)), (slot_13, (1, 3))):
            for pool_arr, w in zip((cache.pool.gate, cache.pool.up, cache.pool.down),
                                   (ew[il].gate, ew[il].up, ew[il].down)):
                np.testing.assert_array_equal(pool_arr[slot], w[e])


def test_a_copy_left_in_flight_is_dropped_by_the_next_pass(model_path):
    """A prompt pass cut short after a layer began the next one's copy: the next pass's begin drops it
    (counted), and a later prompt ubatch still equals the CPU."""
    rng = np.random.default_rng(9)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        cache = _cache(ew, c.n_layer, c.n_expert, 8, NEVER)
        cache.prompt_stacks = True
        cache.prompt_stack_buffers = 2  # a copy ahead
        ref_ex = CPUExperts(ew, NumpyBackend())
        first = min(ew)
        h = rng.standard_normal((40, c.n_embd)).astype(np.float32)
        r = topk_routing(rng.dirichlet(np.ones(c.n_expert), 40).astype(np.float32), c.n_expert_used, True)
        np.testing.assert_allclose(cache(first, h, r), ref_ex(first, h, r), rtol=1e-5, atol=1e-6)
        assert cache.stack_prefetch == [1, 0, 0] and cache._ahead._flight is not None
        cache.begin_pass(40)
        assert cache.stack_prefetch == [1, 0, 1] and cache._ahead._flight is None
        for il in ew:
            np.testing.assert_allclose(cache(il, h, r), ref_ex(il, h, r), rtol=1e-5, atol=1e-6)
        assert cache.stack_prefetch == [1 + c.n_layer - 1, c.n_layer - 1, 1]
        cache.close()


def test_executors_say_whether_a_decode_step_can_be_captured(model_path):
    """The CUDA graph asks the experts' executor (``graph_capturable``), not its class: host experts
    and an expert cache that computes misses on the CPU cannot be captured; resident experts and a
    zero-copy cache can; a layer map answers with its first reason."""
    from moecache.moe.executor import DeviceExperts, ExpertsByLayer

    with open_gguf(model_path) as m:
        ew = expert_weights(m, "silu")
        c = m.config
        n_slots = 5
        host = CPUExperts(ew, NumpyBackend())
        resident = DeviceExperts(ew, NumpyBackend())
        assert host.graph_capturable() == "routed experts in host RAM" and resident.graph_capturable() is None
        cpu_cache = _cache(ew, c.n_layer, c.n_expert, n_slots)  # a NumpyBackend: no device, misses on the CPU
        assert "computes its misses on the CPU" in cpu_cache.graph_capturable()
        twin = CachedExperts(ew, Twin(), n_slots, CachePolicy(c.n_layer, c.n_expert, n_slots), 32, top_k=c.n_expert_used)
        assert twin.zero_copy and twin.graph_capturable() is None
        layers = list(ew)
        mixed = ExpertsByLayer({layers[0]: resident, **{il: host for il in layers[1:]}})
        assert mixed.graph_capturable() == "routed experts in host RAM"
        assert ExpertsByLayer({il: resident for il in layers}).graph_capturable() is None
        assert ExpertsByLayer({}).graph_capturable() is None  # a dense model
        cpu_cache.close()
        twin.close()


def test_prompt_group_bytes_is_a_per_cache_setting(model_path, monkeypatch):
    """prompt_group_bytes: None takes the
    module's PROMPT_GROUP_BYTES at construction, a value caps each prompt group to that many bytes
    of experts, and the output stays the all-CPU output; a cap below one byte is refused."""
    import moecache.moe.cache as cache_mod

    rng = np.random.default_rng(6)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        per = CachedExperts._expert_bytes(ew[0])
        assert _cache(ew, c.n_layer, c.n_expert, 8, NEVER).prompt_group_bytes == cache_mod.PROMPT_GROUP_BYTES
        cache = _cache(ew, c.n_layer, c.n_expert, 8, NEVER)
        cache.prompt_stacks = False
        cache.prompt_group_bytes = 2 * per
        assert max(_prompt_group_sizes(m, cache, rng, monkeypatch)) == 2
    with pytest.raises(ValueError, match="prompt_group_bytes"):
        CachedExperts(ew, NumpyBackend(), 8, cache.policy, prompt_group_bytes=0)


def test_engine_plans_with_the_memory_in_use(model_path, monkeypatch):
    """The engine hands what its probe found in use on the GPU to the plan: it counts against
    --vram-budget, so 12 slots' worth in use gives the cache 0.95 x that many bytes fewer (12 slots,
    give or take the rounding); the caches' prompt groups stay PROMPT_GROUP_BYTES."""
    import moecache.engine as engine_mod
    import moecache.moe.cache as cache_mod
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import RESERVE_BYTES, USABLE_FRACTION, PlacementOptions, model_sizes

    with open_gguf(model_path) as m:
        sz = model_sizes(m, 96)
    need = sum(sz.dense) + sz.n_layer * sz.kv + sz.output
    budget = int((RESERVE_BYTES + sz.largest_matrix_f32 + need + sum(sz.experts) // 2) / USABLE_FRACTION)
    monkeypatch.setattr(engine_mod, "make_backends", lambda devices, log, act_q8=True, prompt_q8=False: {-1: NumpyBackend(), 0: Twin()})
    slots = {}
    used_big = int(12 * sz.expert_each / USABLE_FRACTION)  # 12 slots' worth
    for used in (0, used_big):
        monkeypatch.setattr(engine_mod, "gpu_memory", lambda u=used: ([80 << 30], [u], ""))
        with Engine(model_path, EngineConfig(n_ctx=96), placement=PlacementOptions(vram_budget=budget)) as eng:
            slots[used] = eng.placement.cache_slots[0][1]
            assert eng.caches[0].prompt_group_bytes == cache_mod.PROMPT_GROUP_BYTES
    assert slots[0] - slots[used_big] in (11, 12, 13), slots


def test_prompt_passes_run_under_the_backends_budget_guard(model_path):
    """Under a --vram-budget (vram_limit) a prompt pass (offload_min_batch tokens or more) starts the
    backend's budget guard before it and stops it after (CuPy's pool then gives its free blocks back
    before growing past the budget: CupyBackend.budget_guard); decode passes and a cache without a
    budget never start it."""
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        for limit in (None, 1 << 40):
            cache = CachedExperts(ew, NumpyBackend(), 8, CachePolicy(c.n_layer, c.n_expert, 8, NEVER), 32,
                                  vram_limit=limit)
            lm = build_model(m, NumpyBackend(), experts=cache)
            if cache not in lm.pass_hooks:
                lm.pass_hooks.append(cache)
            seen = []
            real = cache._prompt_groups

            def spy(*a):
                seen.append(cache._guard is not None and cache._guard.on)
                return real(*a)
            cache._prompt_groups = spy
            kv = lm.new_kv_cache(64)
            lm.forward(np.arange(40), kv)
            assert seen and all(seen) == (limit is not None)
            assert cache._guard is None or not cache._guard.on  # stopped after the pass
            starts = 0 if cache._guard is None else cache._guard.starts
            lm.forward(np.array([3]), kv)  # a decode pass
            assert (0 if cache._guard is None else cache._guard.starts) == starts == (limit is not None)
            if limit is not None:  # a prompt pass an exception cut short leaves it started: the next
                cache.begin_pass(40)  # decode pass stops it, and so does close()
                assert cache._guard.on
                cache.begin_pass(1)
                assert not cache._guard.on
                cache.begin_pass(40)
                cache.close()
                assert not cache._guard.on
            cache.close()


@pytest.mark.parametrize("seed", range(3))
def test_miss_split_twin_gives_the_zero_copy_output(model_path, seed):
    """--miss-split in the CPU twin (the inline handoff): up to ncpu misses of each token go to the
    CPU kernel from host RAM, the rest of the misses and the hits to the backend, summed. Slots hold
    the *next* expert's bytes (as in the zero-copy test above): the output equals the all-CPU one with
    hits shifted only if every hit is still read from its slot and every miss, on either side, from
    the host; the CPU's pair count is the split rule's."""
    from moecache.moe.handoff import split_pairs
    from moecache.moe.routing import Routing

    print("seed", seed)
    rng = np.random.default_rng(200 + seed)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = int(rng.integers(2, c.n_layer * c.n_expert // 2))
        cache = CachedExperts(ew, NumpyBackend(), n_slots, CachePolicy(c.n_layer, c.n_expert, n_slots, NEVER), 32,
                              zero_copy=True, top_k=c.n_expert_used, miss_split=True)
        assert cache.handoff is not None and cache.handoff.inline
        pairs = [(int(p) // c.n_expert, int(p) % c.n_expert)
                 for p in rng.choice(c.n_layer * c.n_expert, n_slots, replace=False)]
        _fill(cache, ew, [(il, (e + 1) % c.n_expert) for il, e in pairs])
        cache.slot_of[:] = -1
        for s, (il, e) in enumerate(pairs):
            cache.slot_of[il, e] = s
        cache._map_dirty = True
        n_cpu = int(rng.integers(1, c.n_expert_used + 1))
        cache.fix_split(n_cpu)  # pinned: the controller's refit after the pass must keep it
        ref_ex = CPUExperts(ew, NumpyBackend())
        t = int(rng.integers(1, 5))
        cache.begin_pass(t)
        np.testing.assert_array_equal(cache._ncpu_dev, n_cpu)
        want_cpu = 0
        for il in ew:
            h = rng.standard_normal((t, c.n_embd)).astype(np.float32)
            r = topk_routing(rng.dirichlet(np.ones(c.n_expert), t).astype(np.float32), c.n_expert_used, True)
            hit = cache.slot_of[il][r.ids] >= 0
            shifted = Routing(np.where(hit, (r.ids + 1) % c.n_expert, r.ids).astype(np.int32), r.weights)
            np.testing.assert_allclose(cache(il, h, r), ref_ex(il, h, shifted), rtol=1e-5, atol=1e-6)
            want_cpu += int((split_pairs(r.ids, cache.slot_of[il], n_cpu)[0] >= 0).sum())
        cache.launched()
        cache.end_pass()
        assert want_cpu > 0 and cache.stats.cpu_misses == want_cpu
        assert cache.split.ncpu.tolist() == [n_cpu] * c.n_layer
        cache.launched()
        assert cache.stats.hits + cache.stats.misses == len(ew) * t * c.n_expert_used
        cache.close()


class _ThreadHandoff:
    """The GPU's side of a replayed graph with the miss split, played by a test thread: the cache's
    replay road (serve in launched(), the controller in end_pass) without a GPU."""

    inline = False

    def __init__(self, buf):
        self.buf = buf
        self.seq = 0

    def go(self, seq, stream=None):
        self.seq = seq


def test_miss_split_replay_road_serves_only_layers_with_a_share(model_path):
    """A replayed pass (no layer called op by op) with the miss split: launched() answers the posts
    of the layers whose share is non-zero, in order, with the layer's own experts; end_pass() counts
    the CPU's pairs, refits the shares, and raises when the GPU gave up waiting."""
    import threading

    from moecache.errors import MoecacheError
    from moecache.moe.handoff import HandoffBuffers
    from moecache.moe.routing import Routing

    rng = np.random.default_rng(7)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        k = c.n_expert_used
        cache = CachedExperts(ew, NumpyBackend(), 4, CachePolicy(c.n_layer, c.n_expert, 4, NEVER), 32,
                              zero_copy=True, top_k=k, miss_split=True)
        buf = HandoffBuffers.allocate(c.n_layer, 16, c.n_embd, k)
        cache.handoff = _ThreadHandoff(buf)
        layers = sorted(cache.cached_layers)
        cache._split_layers = list(layers)  # as a capture records them
        served = layers[1]
        cache.split.ncpu[:] = 0
        cache.split.ncpu[served] = 2
        cache._ncpu_dirty = True
        cache.begin_pass(1)
        assert cache._serve == [served] and cache._replayed_split()
        h = rng.standard_normal((1, c.n_embd)).astype(np.float32)
        ids = np.full((1, k), -1, np.int32)
        ids[0, -2:] = rng.choice(c.n_expert, 2, replace=False)
        w = rng.random((1, k)).astype(np.float32)
        got = {}

        def gpu():
            for il in layers:  # every layer posts; only the served one has pairs for the CPU
                if il == served:
                    buf.h[:1], buf.ids[:1], buf.w[:1] = h, ids, w
                buf.count[il] = 2 if il == served else 0
                buf.n_miss[il] = 3
                buf.n_tok[il] = 1
                buf.wait_ns[il] = 0
                buf.flag[il] = cache.handoff.seq
                if il == served:
                    while buf.done[il] < cache.handoff.seq:
                        pass
                    got[il] = buf.out[:1].copy()

        th = threading.Thread(target=gpu)
        th.start()
        cache.launched()
        th.join(10)
        assert not th.is_alive() and list(got) == [served]
        ref = CPUExperts(ew, NumpyBackend())(served, h, Routing(np.where(ids >= 0, ids, 0).astype(np.int32),
                                                                 np.where(ids >= 0, w, 0).astype(np.float32)))
        np.testing.assert_allclose(got[served], ref, rtol=1e-5, atol=1e-6)
        calm = cache.split.calm.copy()
        cache.end_pass()
        assert cache.stats.cpu_misses == 2
        others = [il for il in layers if il != served]
        assert (cache.split.calm[others] == calm[others] + 1).all()  # misses left to the GPU, no wait
        # a pass in which the GPU stopped waiting: the error surfaces at its end
        cache.begin_pass(1)
        buf.count[:] = 0
        buf.flag[:] = cache.handoff.seq
        cache.launched()
        buf.err[0] = served + 1
        with pytest.raises(MoecacheError, match=f"layer {served}"):
            cache.end_pass()
        # the second half's handoff is checked too (a step in halves; its record reset by the check)
        cache.begin_pass(1)
        buf.flag[:] = cache.handoff.seq
        cache.launched()
        cache.handoff_b.buf.err[0] = served + 1
        with pytest.raises(MoecacheError, match=f"layer {served}"):
            cache.end_pass()
        assert cache.handoff_b.buf.err[0] == 0 and buf.err[0] == 0
        cache.close()


def _gapped_pass(model_path, rng, n_passes: int = 1, fail_at: int | None = None, in_gaps: bool = True):
    """A replayed pass with the miss split on the numpy twin, every cached layer handing one pair to
    the CPU (a test thread in the GPU's role), and ``n_passes`` earlier passes' routing waiting to be
    accounted (2 tokens each, every pair a miss). Returns (the cache, a twin cache flushed at once
    with the same routing, the host's (tokens, uploads) as it began each answer, the cached layers,
    the error launched() raised or None, the open model file to close last). ``fail_at``: that
    answer raises KeyboardInterrupt."""
    import threading

    from moecache.moe.handoff import HandoffBuffers

    m = open_gguf(model_path)
    c = m.config
    ew = expert_weights(m, "silu")
    k = c.n_expert_used
    pol = PolicyConfig(t_upload=1e-9, min_residency=0)  # every miss pays its upload
    gapped = CachedExperts(ew, NumpyBackend(), 4, CachePolicy(c.n_layer, c.n_expert, 4, pol), 32,
                           zero_copy=True, top_k=k, miss_split=True)
    gapped.account_in_gaps = in_gaps
    at_once = CachedExperts(ew, NumpyBackend(), 4, CachePolicy(c.n_layer, c.n_expert, 4, pol), 32,
                            zero_copy=True, top_k=k)
    buf = HandoffBuffers.allocate(c.n_layer, 16, c.n_embd, k)
    gapped.handoff = _ThreadHandoff(buf)
    layers = sorted(gapped.cached_layers)
    assert len(layers) >= 4
    gapped._split_layers = list(layers)
    gapped.split.ncpu[:] = 1
    gapped._ncpu_dirty = True
    gapped.begin_pass(1)
    assert gapped._serve == layers and gapped._replayed_split()
    for _ in range(n_passes):  # the earlier passes' routing, as end_pass logs it: empty slot maps
        ids = np.full((c.n_layer, 2, k), -1, np.int32)
        for il in layers:
            for t in range(2):
                ids[il, t] = rng.choice(c.n_expert, k, replace=False)
        live = np.full((c.n_layer, c.n_expert), -1, np.int32)
        for cache in (gapped, at_once):
            cache._pending_routes.append((ids.copy(), live.copy(), 2))
    seen = []
    answer = gapped._split_compute

    def compute(il, h, ids, w, out):  # the host, as it begins each answer
        seen.append((gapped.stats.tokens, gapped.stats.uploads))
        if len(seen) - 1 == fail_at:
            raise KeyboardInterrupt
        answer(il, h, ids, w, out)

    gapped._split_compute = compute
    h = rng.standard_normal((1, c.n_embd)).astype(np.float32)

    def gpu():
        for il in layers:
            buf.h[:1], buf.ids[:1], buf.w[:1] = h, np.r_[[int(rng.integers(c.n_expert))], [-1] * (k - 1)], 1.0
            buf.count[il], buf.n_tok[il], buf.wait_ns[il] = 1, 1, 0
            buf.flag[il] = gapped.handoff.seq
            while buf.done[il] < gapped.handoff.seq:
                pass

    th = threading.Thread(target=gpu)
    th.start()
    err = None
    try:
        gapped.launched()
    except KeyboardInterrupt as e:
        err = e
    th.join(10)
    assert not th.is_alive()
    return gapped, at_once, seen, layers, err, m


def _agree(cache):
    """The policy's residents are the experts the slots hold (or copy into)."""
    owned = {o for o in cache.pool.owner if o is not None}
    assert owned == {tuple(map(int, x)) for x in np.argwhere(cache.policy.resident)}


@pytest.mark.parametrize("in_gaps", [True, False])
def test_replayed_pass_accounts_the_last_pass_in_the_gaps_between_answers(model_path, in_gaps):
    """With the handoff's answers to give, launched() runs the last pass's accounting a unit at a time
    between them (the pass's counters before the first wait, the plan after the first answer, one
    upload after each later one, the rest after the last); with account_in_gaps False, all of it
    after the last answer. Either way the same counters, admissions and slots as flush() run at once
    on a twin cache fed the same routing."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    gapped, at_once, seen, layers, err, m = _gapped_pass(model_path, np.random.default_rng(seed), in_gaps=in_gaps)
    assert err is None
    at_once.flush()
    if in_gaps:
        assert seen == [(2, max(0, j - 1)) for j in range(len(layers))]
        assert gapped.stats.uploads > len(layers) - 2  # the rest ran after the last answer
    else:
        assert seen == [(0, 0)] * len(layers)
    for f in ("tokens", "hits", "misses", "uploads", "uploaded_bytes"):
        assert getattr(gapped.stats, f) == getattr(at_once.stats, f), f
    assert gapped.pool.owner == at_once.pool.owner
    np.testing.assert_array_equal(gapped.policy.resident, at_once.policy.resident)
    np.testing.assert_array_equal(gapped.policy.usage, at_once.policy.usage)
    _agree(gapped)
    gapped.end_pass()
    gapped.close()
    at_once.close()
    m.close()


def test_an_answer_that_fails_leaves_the_policy_and_the_slots_agreeing(model_path):
    """Ctrl-C in the middle of the handoff's answers, while the accounting runs in their gaps: the
    error propagates, the decision in progress is applied whole (the policy counts it resident at
    once), the pass not begun stays pending, and the next flush accounts it."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    gapped, at_once, seen, layers, err, m = _gapped_pass(model_path, np.random.default_rng(seed), n_passes=2,
                                                      fail_at=3)
    assert isinstance(err, KeyboardInterrupt)
    assert seen[-1] == (2, 2)  # stopped within the first pass's admissions
    _agree(gapped)
    assert len(gapped._pending_routes) == 1  # the second pass, not begun
    gapped.flush()
    _agree(gapped)
    assert gapped.stats.tokens == 4 and not gapped._pending_routes
    gapped.close()
    at_once.close()
    m.close()


def test_pool_finds_a_victims_slot_also_after_a_direct_write():
    from moecache.moe.cache import _Pool

    pool = _Pool(None, None, None, (0, 0, 0), [None] * 6)
    pool.set_owner(2, (0, 5))
    pool.set_owner(4, (1, 1))
    assert pool.slot_held_by((0, 5)) == 2 and pool.slot_held_by((1, 1)) == 4
    pool.owner[2] = (1, 1)  # a slot overwritten without the hint (as tests fill slots): the hint for
    pool.owner[5] = (0, 5)  # (0, 5) still says 2, which owner no longer confirms: the search finds 5
    assert pool.slot_held_by((0, 5)) == 5
    pool.set_owner(2, None)
    pool.set_owner(5, None)
    pool.owner[3] = (0, 5)  # written without any hint: the search finds it
    assert pool.slot_held_by((0, 5)) == 3
    with pytest.raises(ValueError):
        pool.slot_held_by((2, 2))


def test_fix_split_needs_the_miss_split(model_path):
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        cache = CachedExperts(ew, NumpyBackend(), 4, CachePolicy(c.n_layer, c.n_expert, 4, NEVER), 32,
                              zero_copy=True, top_k=c.n_expert_used)
        with pytest.raises(ValueError, match="no miss split"):
            cache.fix_split(1)
        cache.close()


def test_miss_split_without_the_zero_copy_path_is_said(model_path):
    """--miss-split splits the zero-copy path's misses: a cache without that path says so once and
    runs as before (no handoff)."""
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        said = []
        cache = CachedExperts(ew, NumpyBackend(), 4, CachePolicy(c.n_layer, c.n_expert, 4, NEVER), 32,
                              zero_copy=False, top_k=c.n_expert_used, miss_split=True, log=said.append)
        assert cache.handoff is None and cache.split is None
        assert len(said) == 1 and "--miss-split ignored" in said[0] and "zero-copy" in said[0]
        cache.close()


def test_plan_sizes_the_elastic_slots_from_the_reserve():
    """The elastic slots are the reserve (free less the budget: margin, RESERVE_BYTES, prompt scratch)
    less DECODE_KEEP_BYTES, in slots, on top of the plain cache; none with a --moe-cache size, with
    the option off, or when every expert already has a slot."""
    from moecache.placement import DECODE_KEEP_BYTES, RESERVE_BYTES, USABLE_FRACTION, ModelSizes, PlacementOptions, plan
    from moecache.probe import GiB

    sizes = ModelSizes((GiB // 2,) * 8, (2 * GiB,) * 8, GiB // 4, GiB // 2, 250 << 20, 2 * GiB // 128)
    free = 12 * GiB
    plain = plan(PlacementOptions(), sizes, [free])
    el = plan(PlacementOptions(elastic_slots=True), sizes, [free])
    reserve = free - (int(free * USABLE_FRACTION) - RESERVE_BYTES - sizes.largest_matrix_f32)
    extra = (reserve - DECODE_KEEP_BYTES) // sizes.expert_each
    assert plain.elastic_slots == () and extra > 0
    assert el.elastic_slots == ((0, extra),)
    assert el.cache_slots == ((0, plain.cache_slots[0][1] + extra),)
    assert any("elastic slots" in n for n in el.notes)
    assert plan(PlacementOptions(elastic_slots=True, moe_cache=512), sizes, [free]).elastic_slots == ()
    # a GPU that nearly holds every expert: the elastic slots stop at all of them
    big = plan(PlacementOptions(elastic_slots=True), sizes, [int((6 + 16 + 1.5) * GiB)])
    every = sum(sizes.experts) // sizes.expert_each
    assert big.cache_slots[0][1] <= every and (not big.elastic_slots or big.cache_slots[0][1] == every)


def _twin_gpu_with_elastic_slots(model_path, monkeypatch, gpu_backend) -> tuple[int, int]:
    """A twin GPU (``gpu_backend``) whose free memory leaves the expert cache a third of the model's
    experts, and a decode keep that leaves a sixth of them as elastic slots: ``(free bytes, elastic
    slots)`` for engines at ``-c 160``."""
    import moecache.engine as engine_mod
    import moecache.placement as placement_mod
    from moecache.placement import RESERVE_BYTES, USABLE_FRACTION, model_sizes

    with open_gguf(model_path) as m:
        sz = model_sizes(m, 160)
    need_dense = sum(sz.dense) + sz.n_layer * sz.kv + sz.output
    free = int((RESERVE_BYTES + sz.largest_matrix_f32 + need_dense + sum(sz.experts) // 3) / USABLE_FRACTION)
    reserve = free - (int(free * USABLE_FRACTION) - RESERVE_BYTES - sz.largest_matrix_f32)
    want = sum(sz.experts) // sz.expert_each // 6
    monkeypatch.setattr(placement_mod, "DECODE_KEEP_BYTES", reserve - want * sz.expert_each)
    monkeypatch.setattr(engine_mod, "gpu_memory", lambda: ([free], [0], ""))
    monkeypatch.setattr(engine_mod, "make_backends",
                        lambda devices, log, act_q8=True, prompt_q8=False: {-1: NumpyBackend(), 0: gpu_backend})
    return free, want


def test_elastic_slots_are_lent_to_prompts_and_taken_back(model_path, monkeypatch):
    """Engine with elastic slots on a twin GPU: the slots start lent; a prompt pass empties the last
    slots (their experts leave the map and the policy) and gives their memory back (the twin
    overwrites them with 0xFF bytes, as memory mapped anew would hold anything); the second decode
    pass after it lets the prompt's leftovers and CuPy's cached blocks go first, then takes back as
    many as fit under the budget less TAKE_BACK_MARGIN_BYTES, and fills them. Logits equal the CPU
    engine's through prompt, decode, prompt, decode; while no memory or only part of it would fit
    (``room``) decode keeps the rest lent (one note), stays right, and takes and fills the rest
    once they fit."""
    from moecache.engine import Engine, EngineConfig
    from moecache.moe.cache import LENT, RECLAIM_RETRY_PASSES, TAKE_BACK_DELAY_PASSES, TAKE_BACK_MARGIN_BYTES

    from moecache.placement import PlacementOptions

    free, want = _twin_gpu_with_elastic_slots(model_path, monkeypatch, Twin())
    with open_gguf(model_path) as m:
        n_vocab = m.config.n_vocab
    notes: list[str] = []
    rng = np.random.default_rng(11)
    with Engine(model_path, EngineConfig(n_ctx=160)) as ref, \
            Engine(model_path, EngineConfig(n_ctx=160), log=notes.append,
                   placement=PlacementOptions(elastic_slots=True, vram_budget=free)) as eng:
        assert eng.placement.elastic_slots == ((0, want),)
        cache = eng.caches[0]
        el = cache._elastic
        n = len(cache.pool.owner)
        lo = n - cache.tail
        assert cache.tail == want and el.bytes == sum(a[lo:].nbytes for a in (cache.pool.gate, cache.pool.up,
                                                                               cache.pool.down))
        order: list[str] = []  # the reclaim lets CuPy's cached blocks go before it asks for the memory
        release, take = cache.be.release_cached, el.take_back
        monkeypatch.setattr(cache.be, "release_cached", lambda: (order.append("release"), release())[1])
        monkeypatch.setattr(el, "take_back", lambda limit: (order.append("take"), take(limit))[1])

        def lent(live: int = 0) -> None:
            assert cache._tail_lent and all(o is LENT for o in cache.pool.owner[lo + live:]) and el.live == live
            assert not (cache.slot_of >= lo + live).any() and cache.policy.n_slots == lo + live
            assert cache.policy.n_resident <= lo + live and np.all(cache.pool.gate[lo + live:] == 0xFF)

        def taken_back() -> None:
            assert not cache._tail_lent and cache.policy.n_slots == n and el.mapped
            assert any(o is not None and o is not LENT for o in cache.pool.owner[lo:])  # filled after the prompt

        def step(toks) -> None:
            np.testing.assert_allclose(eng.eval(toks), ref.eval(toks), rtol=1e-4, atol=1e-5)

        lent()  # from the start, until decode has run (the engine's warm-up pass is the first)
        assert cache.tail_lends == el.lends == 1 and cache._reclaim_in == TAKE_BACK_DELAY_PASSES - 1
        for _ in range(TAKE_BACK_DELAY_PASSES - 1):
            step([int(rng.integers(0, n_vocab))])
            lent()
        step([int(rng.integers(0, n_vocab))])
        taken_back()
        for round_ in range(2):
            step(rng.integers(0, n_vocab, 40))
            lent()
            assert cache.tail_lends == round_ + 2 and el.lends == round_ + 2
            drops, fills = cache.be.input_drops, cache.prompt_fills
            for _ in range(TAKE_BACK_DELAY_PASSES):  # decode's own memory first: the slots wait
                step([int(rng.integers(0, n_vocab))])
                lent()
            assert cache.prompt_fills == fills  # the fill waits for them
            order.clear()
            step([int(rng.integers(0, n_vocab))])
            # the prompt's kept inputs and CuPy's cached blocks go before the memory is asked for
            # under the budget less the margin; the slots are filled in the same pass
            assert cache.be.input_drops > drops and order[:2] == ["release", "take"]
            assert el.limits[-1] == cache.vram_limit - TAKE_BACK_MARGIN_BYTES == free - TAKE_BACK_MARGIN_BYTES
            assert cache.prompt_fills > fills
            taken_back()
            for _ in range(5):
                step([int(rng.integers(0, n_vocab))])
            taken_back()
            assert cache.tail_reclaims == el.take_backs == round_ + 2
        # no room to map them again: decode keeps them lent (said once), and stays right
        step(rng.integers(0, n_vocab, 36))
        el.room = 0
        tries = len(el.limits)
        for _ in range(TAKE_BACK_DELAY_PASSES + 4):
            step([int(rng.integers(0, n_vocab))])
            lent()
        assert sum(f"elastic slots: 0 of {want} taken back" in x for x in notes) == 1
        assert len(el.limits) == tries + 1  # one try, then RECLAIM_RETRY_PASSES passes without one
        # room for some: the first ones come back (and are filled), the rest a retry later
        el.room = part = want // 2
        fills = cache.prompt_fills
        for _ in range(RECLAIM_RETRY_PASSES - 3):
            step([int(rng.integers(0, n_vocab))])
            lent()
        step([int(rng.integers(0, n_vocab))])
        lent(part)
        assert cache.prompt_fills > fills and len(el.limits) == tries + 2  # a late take-back fills the slots too
        assert any(o is not None for o in cache.pool.owner[lo:lo + part])
        assert sum("elastic slots:" in x for x in notes) == 1
        el.room = None
        for _ in range(RECLAIM_RETRY_PASSES):
            step([int(rng.integers(0, n_vocab))])
            lent(part)
        step([int(rng.integers(0, n_vocab))])
        taken_back()
        assert cache.stats.hits > 0 and cache.stats.uploads > 0
        # a pass an exception cuts short (Ctrl-C in a prompt): the budget guard stops, no routing
        # log is left expected, the slots stay lent until decode
        boom = KeyboardInterrupt()

        def cut(*a, **k):
            raise boom

        orig = cache._prompt
        cache._prompt = cut
        eng.reset()
        with pytest.raises(KeyboardInterrupt):
            eng.eval(rng.integers(0, n_vocab, 40))
        cache._prompt = orig
        assert cache._tail_lent and cache._expect == 0 and cache._guard is not None and not cache._guard.on
        # prompt_stacks' buffers go before the take-back (their memory counts under the budget)
        cache.prompt_stacks = True
        eng.reset()
        eng.eval(rng.integers(0, n_vocab, 40))
        assert cache._bufs is not None
        for _ in range(TAKE_BACK_DELAY_PASSES + 1):
            eng.eval([int(rng.integers(0, n_vocab))])
        assert cache._bufs is None and not cache._tail_lent
        # tries that take none back come less and less often (each waits for the GPU); one that
        # takes some back, or a lend, starts the wait again at RECLAIM_RETRY_PASSES
        eng.reset()
        eng.eval(rng.integers(0, n_vocab, 40))
        el.room = 0
        waits = []
        for _ in range(7):
            cache.reclaim_tail()
            waits.append(cache._reclaim_in)
        assert waits == [8, 16, 32, 64, 128, 256, 256] and RECLAIM_RETRY_PASSES == 8
        el.room = 1
        assert not cache.reclaim_tail() and cache._reclaim_in == RECLAIM_RETRY_PASSES and cache._live == 1
        el.room = None
        assert cache.reclaim_tail() and not cache._tail_lent


def test_elastic_slots_left_out_where_the_backend_cannot_make_them(model_path, monkeypatch):
    """A backend whose elastic_slot_arrays raises (a driver without virtual memory): the cache holds
    the plain slots only (the elastic ones' memory is the prompts' reserve), says why once, and
    prompts and decode still equal the CPU engine's."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions

    class NoVmm(Twin):
        def elastic_slot_arrays(self, shapes, tail):
            raise RuntimeError("no virtual memory here")

    _, want = _twin_gpu_with_elastic_slots(model_path, monkeypatch, NoVmm())
    with open_gguf(model_path) as m:
        n_vocab = m.config.n_vocab
    notes: list[str] = []
    rng = np.random.default_rng(12)
    with Engine(model_path, EngineConfig(n_ctx=160)) as ref, \
            Engine(model_path, EngineConfig(n_ctx=160), log=notes.append,
                   placement=PlacementOptions(elastic_slots=True)) as eng:
        (g, planned), = eng.placement.cache_slots
        assert eng.placement.elastic_slots == ((0, want),)
        cache = eng.caches[0]
        assert cache.tail == 0 and cache._elastic is None
        n = len(cache.pool.owner)
        assert n == cache.policy.n_slots == cache.pool.gate.shape[0] and n <= planned - want
        assert sum("elastic slots are left out" in x and "no virtual memory here" in x for x in notes) == 1
        for toks in (rng.integers(0, n_vocab, 40), *[[int(t)] for t in rng.integers(0, n_vocab, 8)]):
            np.testing.assert_allclose(eng.eval(toks), ref.eval(toks), rtol=1e-4, atol=1e-5)
        assert cache.policy.n_resident <= n


def test_elastic_slots_flag_road(model_path):
    """--elastic-slots / --no-elastic-slots: on unless --no-elastic-slots; run and bench pass it to
    the placement; serve's resolution too, with the reason either way."""
    from typer.testing import CliRunner

    import moecache.cli.bench as bench_mod
    from moecache.cli.main import app
    from moecache.probe import GiB, GpuInfo, HostInfo, Probe
    from moecache.settings import Settings, model_facts, resolve

    assert Settings().placement_options().elastic_slots is True
    assert Settings(elastic_slots=True).placement_options().elastic_slots is True
    assert Settings(elastic_slots=False).placement_options().elastic_slots is False
    with open_gguf(model_path) as m:
        facts = model_facts(m, "f16")
    probe = Probe(HostInfo("test cpu", 4, 8, 16 * GiB, 12 * GiB), (GpuInfo(0, "gpu", "", 8 * GiB, 8 * GiB),))
    assert resolve(Settings(), facts, probe, command="run").placement.elastic_slots
    assert not resolve(Settings(elastic_slots=False), facts, probe, command="run").placement.elastic_slots
    served = resolve(Settings(), facts, probe, command="serve")  # serve too (its prompts lend them)
    assert served.placement.elastic_slots and "serve" in served.reasons["elastic_slots"]
    asked = resolve(Settings(elastic_slots=False), facts, probe, command="serve")
    assert not asked.placement.elastic_slots and asked.reasons["elastic_slots"] == "--no-elastic-slots given"
    seen = []
    orig = bench_mod.load_engine

    def spy(path, settings, *a, **k):
        seen.append(settings.elastic_slots)
        return orig(path, settings, *a, **k)

    bench_mod.load_engine = spy
    try:
        runs = [CliRunner().invoke(app, ["bench", "-m", str(model_path), "-p", "0", "-n", "2", "-r", "1", *flag,
                                         "-o", "jsonl"]) for flag in (["--no-elastic-slots"], ["--elastic-slots"], [])]
    finally:
        bench_mod.load_engine = orig
    for r in runs:
        assert r.exit_code == 0, r.output
    assert seen == [False, True, None]
    import json

    row = json.loads(next(ln for ln in r.output.splitlines() if ln.startswith("{")))
    assert row["elastic_slots"] == 0  # no GPU here: no expert cache, no elastic slots
    # serve's flag reaches its Settings (the server itself is not started)
    import moecache.cli.serve as serve_mod

    got = []
    real = serve_mod.serve_command
    serve_mod.serve_command = lambda opts, settings, sampling: got.append(settings.elastic_slots)
    try:
        runs = [CliRunner().invoke(app, ["serve", "-m", str(model_path), *flag])
                for flag in (["--no-elastic-slots"], ["--elastic-slots"], [])]
    finally:
        serve_mod.serve_command = real
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert got == [False, True, None]


def test_layer_plan_with_elastic_slots_on_a_twin_gpu(model_path, monkeypatch):
    """--cache-plan layer with elastic slots on a twin GPU: every lend and take-back resizes the pool
    under a plan (the next plan fits the new pool); logits equal the CPU engine's through prompt,
    decode, prompt, decode, with the plan's CPU shares answered by the twin's inline handoff."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions

    free, want = _twin_gpu_with_elastic_slots(model_path, monkeypatch, Twin())
    with open_gguf(model_path) as m:
        n_vocab = m.config.n_vocab
    rng = np.random.default_rng(12)
    cfg = PolicyConfig(window=4, layer_plan=True, min_residency=1, t_link=1e-3)  # the link priced out: CPU shares
    with Engine(model_path, EngineConfig(n_ctx=160)) as ref, \
            Engine(model_path, EngineConfig(n_ctx=160), placement=PlacementOptions(elastic_slots=True, vram_budget=free),
                   policy_config=cfg, gpu_act_q8=False) as eng:  # float activations (the CPU shares' too)
        cache = eng.caches[0]
        pol = cache.policy
        assert not cache.act_q8
        assert cache.tail == want and pol.layer_plan and cache.handoff is not None and cache.handoff.inline
        sizes = set()
        for round_ in range(3):
            toks = rng.integers(0, n_vocab, 40)
            np.testing.assert_allclose(eng.eval(toks), ref.eval(toks), rtol=1e-4, atol=1e-5)
            for _ in range(12):
                t = [int(rng.integers(0, n_vocab))]
                np.testing.assert_allclose(eng.eval(t), ref.eval(t), rtol=1e-4, atol=1e-5)
                sizes.add(pol.n_slots)
                assert pol.n_resident == int(pol.resident.sum()) <= pol.n_slots
            cache.flush()
            assert pol.plan is not None and pol.plan.target.sum() <= pol.n_slots
        assert len(sizes) >= 2  # the pool changed size under the plan (lent, then taken back)
        np.testing.assert_array_equal(cache.split.ncpu, pol.plan.share)
        assert cache.stats.cpu_misses > 0 and pol.plans >= 2


def test_serves_pattern_with_the_layer_plan_and_elastic_slots_on_a_twin_gpu(model_path, monkeypatch):
    """serve's defaults on a twin GPU (the layer plan, elastic slots, three slots): prompts of new
    requests, one of them in two chunks, arrive while other slots decode in batched passes of 1-3
    tokens (moecache.testing.fidelity.SERVE_STEPS); every prompt's and pass's logits equal the CPU
    engine's on the same schedule; the prompts lent the elastic slots and the passes after them took
    them back, the plan's CPU shares answered misses, and the plan saw passes of several tokens."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.fidelity import serve_steps

    free, want = _twin_gpu_with_elastic_slots(model_path, monkeypatch, Twin())
    with open_gguf(model_path) as m:
        n_vocab = m.config.n_vocab
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    cfg = PolicyConfig(window=4, layer_plan=True, min_residency=1, t_link=1e-3)  # the link priced out: CPU shares
    with Engine(model_path, EngineConfig(n_ctx=240)) as ref, \
            Engine(model_path, EngineConfig(n_ctx=240), placement=PlacementOptions(elastic_slots=True, vram_budget=free),
                   policy_config=cfg, gpu_act_q8=False) as eng:
        cache = eng.caches[0]
        assert cache.tail > 0 and cache.policy.layer_plan and cache.handoff is not None

        def check(a, b, what):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=what)
        lends, reclaims = cache.tail_lends, cache.tail_reclaims
        passes = serve_steps((eng, ref), np.random.default_rng(seed), n_vocab, check)
        cache.flush()
        assert passes == 19
        # steps 4, 10 and 15 find the slots taken back and lend them (step 0's prompt finds them still
        # lent since the load); the second pass after each prompt pass takes them back (after steps 0,
        # 4, 10 and 15: the 12-token chunk of step 6 is not a prompt pass)
        print(f"lends {cache.tail_lends - lends}, take-backs {cache.tail_reclaims - reclaims}")
        assert cache.tail_lends - lends == 3 and cache.tail_reclaims - reclaims == 4
        assert cache.stats.cpu_misses > 0 and cache.policy.plans >= 2 and cache.policy.pass_tokens > 1.0


def test_the_first_batched_decode_step_seeds_the_plans_tokens_per_pass(model_path, monkeypatch):
    """The engine's warm-up token is not a decode pass of the user's: after the load the policy has
    seen none, so the first batched step of 3 sequences sets its tokens per pass to 3 (the layer
    plan's costs), and a prompt of the same three sequences before it counted nothing."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions

    free, _ = _twin_gpu_with_elastic_slots(model_path, monkeypatch, Twin())
    cfg = PolicyConfig(window=4, layer_plan=True, min_residency=1)
    with Engine(model_path, EngineConfig(n_ctx=160), placement=PlacementOptions(elastic_slots=True, vram_budget=free),
                policy_config=cfg) as eng:
        pol = eng.caches[0].policy
        assert pol._decode_passes == 0 and pol.pass_tokens == 1.0
        kvs = eng.sequences(3)
        for k in kvs:
            eng.eval([1, 2, 3], kv=k)
        assert pol._decode_passes == 0
        eng.decode([4, 5, 6], kvs)
        assert pol._decode_passes == 1 and pol.miss_costs().tokens == 3.0


@pytest.mark.parametrize("seed,routing", [(0, False), (1, False), (2, True)])
def test_batched_steps_in_halves_give_the_one_pass_logits(model_path, seed, routing):
    """A batched decode step of slices of one cache with the miss split (the inline handoff of the
    CPU twin) runs in two halves (DecoderLM._body_halves: each half's post to its own handoff, the
    wait for its CPU share queued before its next block): the logits equal the all-CPU model's, the
    caches' counters equal those of the same steps run in one pass (decode_halves off), and each
    half logs its routing at its own rows. With a routing process (``routing``: --routing) each layer's
    choices are drawn once for the pass and each half takes its rows, as one pass would. A step of
    fewer than HALVES_MIN_TOKENS runs in one pass; qwen2moe-like blocks (moe_out_last False) never
    run in halves."""
    from moecache.moe.cache import HALVES_MIN_TOKENS
    from moecache.moe.executor import ExpertsByLayer

    print("seed", seed, "routing process", routing)
    rng = np.random.default_rng(300 + seed)
    with open_gguf(model_path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        n_slots = c.n_layer * c.n_expert // 3
        ref_lm = build_model(m, NumpyBackend())
        lms, caches = [], []
        for halves in (True, False):
            cache = CachedExperts(ew, NumpyBackend(), n_slots, CachePolicy(c.n_layer, c.n_expert, n_slots, NEVER),
                                  32, zero_copy=True, top_k=c.n_expert_used, miss_split=True)
            cache.decode_halves = halves
            _fill(cache, ew, [(int(p) // c.n_expert, int(p) % c.n_expert)
                              for p in np.random.default_rng(seed).choice(c.n_layer * c.n_expert, n_slots, replace=False)])
            cache._map_dirty = True
            cache.fix_split(int(rng.integers(1, c.n_expert_used + 1)) if halves else int(caches[0].split.ncpu[0]))
            lms.append(build_model(m, NumpyBackend(), experts=ExpertsByLayer({il: cache for il in ew}),
                                   pass_hooks=[cache]))
            caches.append(cache)
        if routing:  # the same process in each model: the same draws
            from moecache.moe.routing_process import make_routing

            for lm in (*lms, ref_lm):
                lm.routing_override = make_routing("qwen3-moe", c.n_layer, c.n_expert, c.n_expert_used, seed=seed)
        n = int(rng.integers(HALVES_MIN_TOKENS, 9))
        kvs = [[w.slice(i * 32, 32) for i in range(n)] for w in (lm.new_kv_cache(32 * n) for lm in (*lms, ref_lm))]
        assert lms[0].halves_for(n) and not lms[1].halves_for(n) and not lms[0].halves_for(HALVES_MIN_TOKENS - 1)
        ids_logged = []
        log = caches[0]._ids_log
        posts_b = []  # the second half's posts: its rows
        post_b = caches[0].handoff_b.post
        caches[0].handoff_b.post = lambda il, h, *rest: posts_b.append(h.shape[0]) or post_b(il, h, *rest)
        events = []  # (kind, half, layer) of the posts and waits, in the order they are queued

        def spy(half, hf):
            post, wait = hf.post, hf.wait
            hf.post = lambda il, *a: events.append(("post", half, il)) or post(il, *a)
            hf.wait = lambda il, *a, **k: events.append(("wait", half, il)) or wait(il, *a, **k)
        spy(0, caches[0].handoff)
        spy(1, caches[0].handoff_b)
        for step in range(4):
            events.clear()
            toks = rng.integers(0, c.n_vocab, n)
            want = ref_lm.forward_seqs(toks, kvs[2])
            for lm, kv in zip(lms, kvs):
                got = lm.forward_seqs(toks, kv)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"step {step}")
            ids_logged.append(log[:, :n].copy())
        for cache in caches:
            cache.flush()
        a, b = caches[0].stats, caches[1].stats
        assert a.cpu_misses > 0 and (a.tokens, a.hits, a.misses, a.cpu_misses) == (b.tokens, b.hits, b.misses,
                                                                                   b.cpu_misses)
        assert (ids_logged[-1] >= 0).all()  # both halves' rows logged
        np.testing.assert_array_equal(ids_logged[-1], caches[1]._ids_log[:, :n])

        assert posts_b == [n - (n + 1) // 2] * (4 * len(ew)) and not caches[1].handoff_b.buf.flag.any()
        # a half's wait is queued after the other half's post of the layer, before its own next post
        want, prev = [], None
        for il in sorted(ew):
            want += ([("wait", 0, prev)] if prev is not None else []) + [("post", 0, il)]
            want += ([("wait", 1, prev)] if prev is not None else []) + [("post", 1, il)]
            prev = il
        assert events == want + [("wait", 0, prev), ("wait", 1, prev)]
        lms[0].moe_out_last = False  # as qwen2moe's class says
        assert not lms[0].halves_for(n)
        for cache in caches:
            cache.close()
