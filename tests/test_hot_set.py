"""Saved expert usage (issue 22's persisted hot set): ``run``/``serve`` preload the most used experts
into the expert cache's slots before the first token and add the run's usage to the file at exit.
On the CPU twin: a NumpyBackend stands in for GPU 0 (the placement's device)."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends import NumpyBackend


class Twin(NumpyBackend):
    device = 0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from moecache.testing.synth import PRESETS, SynthConfig, write_model

    path = tmp_path_factory.mktemp("hot") / "moe.gguf"
    cfg = SynthConfig(**{**PRESETS["tiny"].__dict__, "n_expert": 16, "n_expert_used": 4, "name": "synthetic-hot"})
    write_model(path, cfg, seed=31)
    return path


def cached_engine(model_path, monkeypatch, log):
    """An Engine whose placement makes an expert cache of about a third of the experts (the twin)."""
    import moecache.engine as engine_mod
    from moecache.engine import Engine, EngineConfig
    from moecache.gguf_file import open_gguf
    from moecache.placement import RESERVE_BYTES, USABLE_FRACTION, PlacementOptions, model_sizes

    with open_gguf(model_path) as m:
        sz = model_sizes(m, 96)
    need = sum(sz.dense) + sz.n_layer * sz.kv + sz.output
    free = int((RESERVE_BYTES + sz.largest_matrix_f32 + need + sum(sz.experts) // 3) / USABLE_FRACTION)
    monkeypatch.setattr(engine_mod, "gpu_memory", lambda: ([free], [0], ""))
    monkeypatch.setattr(engine_mod, "make_backends", lambda devices, log, act_q8=True, prompt_q8=False: {-1: NumpyBackend(), 0: Twin()})
    eng = Engine(model_path, EngineConfig(n_ctx=96), log=log, placement=PlacementOptions())
    assert len(eng.caches) == 1 and eng.caches[0].pool is not None
    return eng


def test_usage_is_saved_at_exit_and_preloaded_at_the_next_start(model_path, monkeypatch, tmp_path):
    from moecache.moe.profile import HotSet, UsageProfile, model_key

    path = tmp_path / "p.npz"
    rng = np.random.default_rng(3)
    notes: list[str] = []
    eng = cached_engine(model_path, monkeypatch, notes.append)
    try:
        hs = HotSet.start(eng, path, notes.append)
        assert any("no such file yet" in n for n in notes)
        c, key = eng.gguf.config, model_key(eng.gguf)
        eng.eval(rng.integers(0, c.n_vocab, 40))  # a prompt ubatch (op offload), then decode steps
        for _ in range(20):
            eng.eval([int(rng.integers(0, c.n_vocab))])
        assert hs.save(eng, notes.append) == path
    finally:
        eng.close()
    prof = UsageProfile.load(path)
    assert prof.key == key and prof.tokens == 60
    assert prof.counts.shape == (c.n_layer, c.n_expert)
    assert (prof.counts.sum(axis=1) == 60 * c.n_expert_used).all()  # every routed pair, every layer
    assert any("usage of 60 tokens saved" in n for n in notes)

    notes.clear()
    eng = cached_engine(model_path, monkeypatch, notes.append)
    try:
        cache = eng.caches[0]
        assert (cache.slot_of < 0).all()
        hs = HotSet.start(eng, path, notes.append)
        n_slots = cache.policy.n_slots
        loaded = np.argwhere(cache.slot_of >= 0)
        # before any token: the slots hold the most used experts of the profile (ties aside)
        assert len(loaded) == min(n_slots, int((prof.counts > 0).sum()))
        assert any(f"{len(loaded)} experts preloaded" in n for n in notes), notes
        cut = np.sort(prof.counts, axis=None)[::-1][len(loaded) - 1]
        assert all(prof.counts[layer, e] >= cut for layer, e in loaded)
        assert cache.stats.uploads == 0  # the preload's copies are not the user's
        toks = rng.integers(0, c.n_vocab, 8)
        eng.eval(toks[:1])
        cache.flush()  # the zero-copy path accounts a pass at the next launch
        assert cache.stats.hits > 0  # the first decode token already hits
        for t in toks[1:]:
            eng.eval([int(t)])
        hs.save(eng, notes.append)
    finally:
        eng.close()
    again = UsageProfile.load(path)
    assert again.tokens == 60 + 8 and (again.counts.sum(axis=1) == 68 * c.n_expert_used).all()
    assert (again.counts >= prof.counts).all()


def test_foreign_or_broken_profiles_are_refused_with_a_note(model_path, monkeypatch, tmp_path):
    from moecache.moe.profile import HotSet, UsageProfile

    notes: list[str] = []
    eng = cached_engine(model_path, monkeypatch, notes.append)
    try:
        c = eng.gguf.config
        other = tmp_path / "other.npz"
        UsageProfile("another-model.gguf-123-abcdef012345", np.ones((c.n_layer, c.n_expert), np.int64), 10).save(other)
        HotSet.start(eng, other, notes.append)
        assert any("not loaded: it is a profile of another-model.gguf" in n for n in notes)
        wrong = tmp_path / "wrong.npz"
        from moecache.moe.profile import model_key

        UsageProfile(model_key(eng.gguf), np.ones((c.n_layer, c.n_expert + 1), np.int64), 10).save(wrong)
        HotSet.start(eng, wrong, notes.append)
        assert any("its counts are" in n for n in notes)
        broken = tmp_path / "broken.npz"
        broken.write_bytes(b"not a zip file")
        hs = HotSet.start(eng, broken, notes.append)
        assert any("not a moecache usage profile" in n for n in notes)
        assert (eng.caches[0].slot_of < 0).all()  # nothing preloaded from any of them
        eng.eval([1, 2, 3])
        assert hs.save(eng, notes.append) is None  # a refused file is left as it is, even after a run
        assert broken.read_bytes() == b"not a zip file"
        assert UsageProfile.load(other).key.startswith("another-model")
    finally:
        eng.close()


def test_default_path_and_no_cache(model_path, monkeypatch, tmp_path):
    from moecache.engine import Engine, EngineConfig
    from moecache.moe.profile import HotSet, model_key

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with Engine(model_path, EngineConfig(n_ctx=32)) as cpu_only:
        assert HotSet.start(cpu_only, None, print) is None  # no expert cache: nothing to preload or save
    notes: list[str] = []
    eng = cached_engine(model_path, monkeypatch, print)
    try:
        hs = HotSet.start(eng, None, notes.append)
        assert hs.path == tmp_path / "moecache" / "profiles" / f"{model_key(eng.gguf)}.npz"
        assert not notes  # a missing default profile is the first run, not news
        eng.eval([1, 2, 3])
        assert hs.save(eng, notes.append) == hs.path and hs.path.exists()
    finally:
        eng.close()


def test_cli_profile_flags(model_path):
    from typer.testing import CliRunner

    from moecache.cli.main import app

    run = ["run", "-m", str(model_path), "-p", "hello", "-n", "2", "--temp", "0", "-c", "64", "-t", "2"]
    r = CliRunner().invoke(app, run + ["--moe-profile", "x.npz", "--no-moe-profile"])
    assert r.exit_code == 1 and "--moe-profile and --no-moe-profile exclude each other" in r.output
    r = CliRunner().invoke(app, run + ["--moe-profile", "x.npz", "-ngl", "0"])
    assert r.exit_code == 0, r.output
    assert "--moe-profile ignored" in r.output
