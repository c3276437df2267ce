"""Continuous batching in the engine: several sequences decoded in one forward pass
(``Engine.sequences``, ``Engine.decode``, ``DecoderLM.forward_seqs``), and several sequences' prompt
chunks in one pass (``Engine.eval_seqs``, ``DecoderLM.forward_parts``), give each sequence the logits
it gets alone, for every architecture; the sequences share the engine's KV cache memory."""

from __future__ import annotations

import numpy as np
import pytest

from faults import bad_row
from moecache.engine import Engine, EngineConfig
from moecache.kv_cache import ContextFullError

ARCHS = ["tiny", "tiny-qwen2moe", "tiny-olmoe", "tiny-mixtral", "tiny-llama", "tiny-qwen3", "tiny-gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def engine(request, tmp_path_factory):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("batch") / f"{request.param}.gguf"
    write_model(path, PRESETS[request.param], seed=2)
    with Engine(path, EngineConfig(n_ctx=96, n_threads=2)) as eng:
        yield eng


def test_batched_decode_equals_each_sequence_alone(engine, rng):
    """Three sequences of different prompt lengths, prefilled one by one, then decoded six steps
    together: every row equals the logits of the same sequence run alone on the engine's own cache
    (float32 sums in another order: within 1e-4 of logits of size ~1-10)."""
    V = engine.gguf.config.n_vocab
    prompts = [rng.integers(0, V, n) for n in (5, 9, 3)]
    steps = rng.integers(0, V, (6, 3))
    ref = []
    for i, p in enumerate(prompts):
        engine.reset()
        rows = [engine.eval(p)[-1]]
        rows += [engine.eval([t])[-1] for t in steps[:, i]]
        ref.append(np.array(rows))
    engine.reset()
    kvs = engine.sequences(3)
    got = [[engine.eval(p, kv=k)[-1]] for p, k in zip(prompts, kvs)]
    for step in steps:
        lg = engine.decode(step, kvs)
        assert lg.shape == (3, V)
        for i in range(3):
            got[i].append(lg[i])
    for i in range(3):
        np.testing.assert_allclose(np.array(got[i]), ref[i], rtol=0, atol=1e-4)
        assert kvs[i].n_past == len(prompts[i]) + 6


def test_sequences_share_the_cache_and_keep_their_own_room(engine):
    """Sequences are views of the engine's cache (n_ctx split evenly), each full at its own size;
    one sequence is the engine's own cache; bad counts are one clear error."""
    kvs = engine.sequences(4)
    assert [k.n_ctx for k in kvs] == [24] * 4 and engine.sequences(1) == [engine.kv]
    assert np.shares_memory(kvs[1].k[0], engine.kv.k[0]) and not np.shares_memory(kvs[1].k[0], kvs[2].k[0])
    engine.eval(np.zeros(24, np.int64), kv=kvs[1])
    with pytest.raises(ContextFullError):
        engine.decode([1, 1], [kvs[0], kvs[1]])
    assert kvs[0].n_past == 0  # nothing evaluated when one of them is full
    with pytest.raises(ValueError, match="given twice"):
        engine.decode([1, 1], [kvs[0], kvs[0]])
    with pytest.raises(ValueError, match="2 tokens for 3 sequences"):
        engine.decode([1, 1], kvs[:3])
    with pytest.raises(ValueError, match="between 1 and n_ctx"):
        engine.sequences(0)
    for k in kvs:
        k.clear()


def test_a_non_finite_sequence_is_named_by_its_row(engine, monkeypatch):
    """Engine.decode names the rows whose logits are not finite and keeps the others' (serve fails
    only those requests)."""
    from moecache.errors import NonFiniteError

    kvs = engine.sequences(3)
    monkeypatch.setattr(engine.model, "forward_seqs", bad_row(engine.model.forward_seqs, 1))
    with pytest.raises(NonFiniteError) as e:
        engine.decode([1, 2, 3], kvs)
    assert e.value.rows == [1] and np.isfinite(e.value.logits[[0, 2]]).all()
    for k in kvs:
        k.clear()


def test_prompt_chunks_of_several_sequences_in_one_pass_equal_each_alone(engine, rng, monkeypatch):
    """Engine.eval_seqs: three sequences' prompts, each in two chunks (the second on top of the
    sequence's first), packed into passes of at most -ub tokens (here 7: a part is cut across two
    passes, and passes hold several parts), give each part's last logits as the sequence alone gets
    them; the passes with several parts go through DecoderLM.forward_parts (float32 sums in
    another order: within 1e-4)."""
    V = engine.gguf.config.n_vocab
    firsts = [rng.integers(0, V, n) for n in (5, 2, 3)]
    seconds = [rng.integers(0, V, n) for n in (4, 6, 1)]
    ref = []
    for a, b in zip(firsts, seconds):
        engine.reset()
        ref.append((engine.eval(a)[-1], engine.eval(b)[-1]))
    engine.reset()
    kvs = engine.sequences(3)
    monkeypatch.setattr(engine, "n_ubatch", 7)
    calls = []
    real, real_one = engine.model.forward_parts, engine.model.forward

    def counted(parts, caches):
        calls.append([len(p) for p in parts])
        return real(parts, caches)

    def counted_one(tokens, kv, logits="last"):
        calls.append(len(tokens))
        return real_one(tokens, kv, logits)
    monkeypatch.setattr(engine.model, "forward_parts", counted)
    monkeypatch.setattr(engine.model, "forward", counted_one)
    got1 = engine.eval_seqs(firsts, kvs)
    got2 = engine.eval_seqs(seconds, kvs)
    assert calls == [[5, 2], 3, [4, 3], [3, 1]]  # 5+2 | 3 alone (forward) || 4+3 of 6 | 3+1
    for i in range(3):
        np.testing.assert_allclose(got1[i], ref[i][0], rtol=0, atol=1e-4)
        np.testing.assert_allclose(got2[i], ref[i][1], rtol=0, atol=1e-4)
        assert kvs[i].n_past == len(firsts[i]) + len(seconds[i])
    for k in kvs:
        k.clear()


def test_eval_seqs_keeps_short_parts_apart_when_experts_would_be_copied(engine, monkeypatch, rng):
    """With experts in host RAM behind a GPU (Engine.prompt_pass_min set; here faked at 8 on the
    CPU engine, whose own is None), parts that are all shorter than it get a pass each
    (Engine.shares_pass); once one part reaches it, all go in one pass. The logits are the same
    either way; in a pass each, a part whose logits are not finite is named and the others kept."""
    from moecache.engine import Engine
    from moecache.errors import NonFiniteError

    assert engine.prompt_pass_min is None
    V = engine.gguf.config.n_vocab
    short, long_ = [rng.integers(0, V, n) for n in (3, 7)], [rng.integers(0, V, n) for n in (3, 8)]
    kvs = engine.sequences(2)
    ref = engine.eval_seqs(short, kvs)
    for k in kvs:
        k.clear()
    ref_long = engine.eval_seqs(long_, kvs)
    for k in kvs:
        k.clear()
    monkeypatch.setattr(Engine, "prompt_pass_min", property(lambda self: 8))
    assert not engine.shares_pass([3, 7]) and not engine.shares_pass([7, 7]) and engine.shares_pass([3, 8])
    merged = []
    real = engine.model.forward_parts
    monkeypatch.setattr(engine.model, "forward_parts", lambda ps, ks: merged.append(len(ps)) or real(ps, ks))
    np.testing.assert_allclose(engine.eval_seqs(short, kvs), ref, rtol=0, atol=1e-4)
    assert merged == [] and [k.n_past for k in kvs] == [3, 7]
    for k in kvs:
        k.clear()
    np.testing.assert_allclose(engine.eval_seqs(long_, kvs), ref_long, rtol=0, atol=1e-4)
    assert merged == [2]
    for k in kvs:
        k.clear()
    # a pass each: a part whose logits are not finite is named, the other kept
    real_one, calls = engine.model.forward, []

    def second_bad(tokens, kv, logits="last"):
        calls.append(len(tokens))
        lg = real_one(tokens, kv, logits)
        if len(calls) == 2:
            lg[-1, 0] = np.nan
        return lg
    monkeypatch.setattr(engine.model, "forward", second_bad)
    with pytest.raises(NonFiniteError) as e:
        engine.eval_seqs(short, kvs)
    assert calls == [3, 7] and e.value.rows == [1]
    np.testing.assert_allclose(e.value.logits[0], ref[0], rtol=0, atol=1e-4)
    assert [k.n_past for k in kvs] == [3, 7]
    for k in kvs:
        k.clear()


def test_eval_seqs_refuses_bad_parts_before_any_change(engine, monkeypatch):
    """Engine.eval_seqs: a part that does not fit, counts that differ, an empty part, a cache given
    twice, an id outside the vocabulary (in a later pass): one clear error, nothing evaluated;
    non-finite rows are named (serve fails those requests only) and the other rows kept."""
    from moecache.errors import NonFiniteError

    kvs = engine.sequences(4)
    with pytest.raises(ContextFullError):
        engine.eval_seqs([[1, 2], list(range(25))], kvs[:2])
    assert kvs[0].n_past == 0
    with pytest.raises(ValueError, match="2 parts for 3 sequences"):
        engine.eval_seqs([[1], [2]], kvs[:3])
    with pytest.raises(ValueError, match="an empty part"):
        engine.eval_seqs([[1], []], kvs[:2])
    with pytest.raises(ValueError, match="given twice"):
        engine.eval_seqs([[1], [2]], [kvs[0], kvs[0]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.model.forward_parts([np.array([1]), np.array([-1])], kvs[:2])
    monkeypatch.setattr(engine, "n_ubatch", 2)  # the bad id would be in the second pass
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.eval_seqs([[1, 2], [3, -1]], kvs[:2])
    monkeypatch.undo()
    assert all(k.n_past == 0 for k in kvs)
    monkeypatch.setattr(engine.model, "forward_parts", bad_row(engine.model.forward_parts, 1, np.inf))
    with pytest.raises(NonFiniteError) as e:
        engine.eval_seqs([[1, 2], [3], [4, 5]], kvs[:3])
    assert e.value.rows == [1] and np.isfinite(e.value.logits[[0, 2]]).all()
    for k in kvs:
        k.clear()


def _attention_f64(q, k, v, p, scale, window=None):
    """Reference causal GQA attention of one query at position p over keys 0..p of k, v (float64)."""
    n_head, d = q.shape
    g = n_head // k.shape[1]
    lo = 0 if window is None else max(0, p - window + 1)
    out = []
    for h in range(n_head):
        kk = k[lo:p + 1, h // g].astype(np.float64)
        s = kk @ q[h].astype(np.float64) * scale
        w = np.exp(s - s.max())
        out.append((w / w.sum()) @ v[lo:p + 1, h // g].astype(np.float64))
    return np.concatenate(out)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_with_kv_base_reads_each_sequences_own_rows(rng, window):
    """ArrayOps.attention with kv_base (a batched step over slices of one cache): query i at its own
    position over rows kv_base[i] .. kv_base[i] + pos[i] only, against float64 attention on that
    sequence's rows (the sequences' rows out of token order; K and V of different head sizes);
    qk_rope_store with kv_base writes k, v at kv_base[t] + pos[t] and nowhere else."""
    from moecache.backends import NumpyBackend

    be = NumpyBackend()
    n_seq, m, n_head, n_kv, d, dv = 4, 16, 8, 2, 32, 24
    k = rng.standard_normal((n_seq * m, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_seq * m, n_kv, dv)).astype(np.float32)
    q = rng.standard_normal((n_seq, n_head, d)).astype(np.float32)
    base = np.array([2, 0, 3, 1], np.int32) * m
    pos = np.array([0, 7, 15, 3], np.int32)
    got = be.attention(q, k, v, pos, 0.2, window, None, kv_base=base, n_ctx=m)
    for i in range(n_seq):
        ref = _attention_f64(q[i], k[base[i]:base[i] + m], v[base[i]:base[i] + m], int(pos[i]), 0.2, window)
        np.testing.assert_allclose(got[i], ref, rtol=1e-5, atol=1e-5, err_msg=f"sequence {i}")
    k_all, v_all = np.zeros_like(k), np.zeros_like(v)
    kn = rng.standard_normal((n_seq, n_kv, d)).astype(np.float32)
    vn = rng.standard_normal((n_seq, n_kv, dv)).astype(np.float32)
    cos, sin = np.ones((n_seq, d // 2), np.float32), np.zeros((n_seq, d // 2), np.float32)  # no rotation
    be.qk_rope_store(q, kn, vn, None, None, 1e-6, cos, sin, True, k_all, v_all, pos, kv_base=base)
    rows = base + pos
    np.testing.assert_array_equal(k_all[rows], kn)
    np.testing.assert_array_equal(v_all[rows], vn)
    others = np.setdiff1d(np.arange(n_seq * m), rows)
    assert not k_all[others].any() and not v_all[others].any()


def test_batched_decode_of_caches_of_their_own_equals_the_shared_path(engine, rng):
    """forward_seqs takes one attention launch for slices of one cache (Engine.sequences) and a
    loop over sequences for caches of their own: both give the same logits."""
    from moecache.kv_cache import KVCache
    from moecache.models.base import shared_cache

    V = engine.gguf.config.n_vocab
    kvs = engine.sequences(3)
    own = [KVCache(k.shape, np, k.k[0].dtype) for k in kvs]
    assert shared_cache(kvs) is not None and shared_cache(own) is None
    prompts = [rng.integers(0, V, n) for n in (4, 2, 6)]
    for p, a, b in zip(prompts, kvs, own):
        engine.eval(p, kv=a)
        engine.eval(p, kv=b)
    for step in rng.integers(0, V, (3, 3)):
        np.testing.assert_allclose(engine.model.forward_seqs(step, kvs), engine.model.forward_seqs(step, own),
                                   rtol=0, atol=1e-5)
    for k in kvs:
        k.clear()


def test_pass_hooks_hear_of_decode_steps_only(tmp_path):
    """The model tells its pass hooks' ``note_decode`` of each decode step and its sequences (a
    one-token eval: 1; a batched step of N sequences: N) before the pass, and not of prompt passes,
    however short (the layer plan's tokens per decode pass, moecache/moe/policy.py)."""
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=2)

    class Hook:
        def __init__(self):
            self.log = []

        def note_decode(self, n):
            self.log.append(("decode", n))

        def begin_pass(self, n):
            self.log.append(("pass", n))

        def launched(self):
            pass

        def end_pass(self):
            pass

        def abort_pass(self):
            pass

    with Engine(path, EngineConfig(n_ctx=96, n_threads=2)) as eng:
        hook = Hook()
        eng.model.pass_hooks.append(hook)
        eng.eval([1, 2, 3, 4, 5])  # a prompt: no decode step
        eng.eval([6])
        kvs = eng.sequences(3)
        for k in kvs:
            eng.eval([7, 8], kv=k)
        eng.decode([1, 2, 3], kvs)
        assert hook.log == [("pass", 5), ("decode", 1), ("pass", 1), ("pass", 2), ("pass", 2), ("pass", 2),
                            ("decode", 3), ("pass", 3)]
