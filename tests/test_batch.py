"""Continuous batching in the engine: several sequences decoded in one forward pass
(``Engine.sequences``, ``Engine.decode``, ``DecoderLM.forward_seqs``) give each sequence the logits it
gets alone, for every architecture; the sequences share the engine's KV cache memory."""

from __future__ import annotations

import numpy as np
import pytest

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
    real = engine.model.forward_seqs

    def one_nan(tokens, caches):
        lg = real(tokens, caches)
        lg[1, 0] = np.nan
        return lg
    monkeypatch.setattr(engine.model, "forward_seqs", one_nan)
    with pytest.raises(NonFiniteError) as e:
        engine.decode([1, 2, 3], kvs)
    assert e.value.rows == [1] and np.isfinite(e.value.logits[[0, 2]]).all()
    for k in kvs:
        k.clear()
