"""Engine: ubatch splitting, generation stops (end of generation, -n, full context, Ctrl-C)."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.engine import Engine, EngineConfig
from moecache.kv_cache import ContextFullError
from moecache.sampling import Sampler, SamplingParams


@pytest.fixture(scope="module")
def eng(code_moe_tiny):
    with Engine(code_moe_tiny, EngineConfig(n_ctx=64, n_ubatch=7)) as e:
        yield e


class Scripted(Sampler):
    """Returns the given ids in order (to drive the stop conditions)."""

    def __init__(self, ids):
        super().__init__(SamplingParams(temp=0.0))
        self.ids = list(ids)

    def sample(self, logits):
        return self.ids.pop(0)


def test_ubatches_give_the_one_pass_logits(eng, code_moe_tiny):
    tokens = np.random.default_rng(2).integers(1, 8000, 30)
    eng.reset()
    split = eng.eval(tokens, logits="all")  # ubatches of 7
    with Engine(code_moe_tiny, EngineConfig(n_ctx=64, n_ubatch=64)) as one:
        full = one.eval(tokens, logits="all")
        last = one.eval([5])
    assert np.abs(split - full).max() / np.abs(full).max() < 1e-5
    assert eng.n_past == 30
    assert np.allclose(eng.eval([5]), last, rtol=1e-4, atol=1e-4)


def test_generation_stops_at_eog_and_at_n_predict(eng):
    eos = eng.tokenizer.eos_id
    eng.reset()
    g = eng.generate([0, 474], Scripted([10, 11, eos, 12]), n_predict=10)
    assert g.tokens == [10, 11] and g.stop == "eog"
    eng.reset()
    g = eng.generate([0, 474], Scripted([10, 11, 12, 13]), n_predict=3)
    assert g.tokens == [10, 11, 12] and g.stop == "length"
    assert eng.n_past == 2 + 2  # the last sampled token is not evaluated


def test_a_stop_callback_ends_generation_with_its_reason(eng):
    """``stop`` (the server's stop strings and cancellation) ends it after the token it saw."""
    eng.reset()
    seen = []
    g = eng.generate([0, 474], Scripted([10, 11, 12, 13]), n_predict=10, on_token=seen.append,
                     stop=lambda t: "stop" if t == 11 else None)
    assert g.tokens == [10, 11] == seen and g.stop == "stop" and g.timings.n_gen == 2


def test_full_context_and_too_long_prompt(eng):
    eng.reset()
    g = eng.generate(list(range(1, 61)), Sampler(SamplingParams(temp=0.0)), n_predict=-1)
    assert g.stop == "context" and len(g.tokens) == 5 and eng.n_past == 64
    eng.reset()
    with pytest.raises(ContextFullError, match="n_ctx 64"):
        eng.generate(list(range(1, 70)), Sampler(SamplingParams(temp=0.0)), n_predict=4)
    assert eng.n_past == 0


def test_ctrl_c_during_generation_keeps_tokens_during_prompt_restores(eng, monkeypatch):
    eng.reset()

    def stop_after_two(t, seen=[]):
        seen.append(t)
        if len(seen) == 2:
            raise KeyboardInterrupt
    g = eng.generate([0, 474], Sampler(SamplingParams(temp=0.0)), n_predict=10, on_token=stop_after_two)
    assert g.stop == "interrupted" and len(g.tokens) == 2
    n = eng.n_past
    calls = []
    real = eng.model.forward

    def interrupted_forward(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # second ubatch of the prompt
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(eng.model, "forward", interrupted_forward)
    g = eng.generate(list(range(1, 20)), Sampler(SamplingParams(temp=0.0)), n_predict=4)
    assert g.stop == "interrupted" and g.tokens == [] and g.timings.n_prompt == 0
    assert eng.n_past == n  # the partly evaluated prompt is forgotten


def test_bad_engine_config_names_the_flag(code_moe_tiny):
    with pytest.raises(ValueError, match="-ub"):
        Engine(code_moe_tiny, EngineConfig(n_ubatch=0))
    with pytest.raises(ValueError, match="-t must be"):
        Engine(code_moe_tiny, EngineConfig(n_threads=-2))


def test_f16_kv_cache_halves_its_bytes_and_keeps_the_logits(tmp_path):
    """-ctk/-ctv f16: the KV cache holds float16 (half the bytes, and the placement plans half), and
    the logits stay within float16 rounding of the float32 cache's, prompt and decode."""
    from moecache.gguf_file import open_gguf
    from moecache.placement import model_sizes
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=31)
    toks = np.random.default_rng(2).integers(0, 200, 24)
    out = {}
    for ct in ("f32", "f16"):
        with Engine(path, EngineConfig(n_ctx=32, cache_type=ct)) as e:
            assert e.kv.k[0].dtype == (np.float16 if ct == "f16" else np.float32)
            out[ct] = np.vstack([e.eval(toks[:20], logits="all")] + [e.eval([int(t)]) for t in toks[20:]])
            out[ct + "_bytes"] = sum(a.nbytes for a in e.kv.k + e.kv.v)
    assert out["f16_bytes"] * 2 == out["f32_bytes"]
    ref = out["f32"]
    err = np.abs(out["f16"] - ref).max() / np.abs(ref).max()
    assert 0 < err < 2e-2  # rounded (not identical), but close
    with open_gguf(path) as m:
        assert model_sizes(m, 32, 2).kv * 2 == model_sizes(m, 32).kv
    with pytest.raises(ValueError, match="-ctk/-ctv"):
        Engine(path, EngineConfig(cache_type="q8_0"))


def test_cpu_experts_round_activations_only_beside_a_gpu_or_when_asked(code_moe_tiny):
    """``Engine(cpu_act_q8=...)``: the default (None) keeps float32 in the CPU's expert kernels when
    the placement has no GPU; True rounds their activations to 8 bits (the logits move by the
    rounding, by less than a tenth of their spread, and the next token stays)."""
    from moecache.placement import PlacementOptions

    toks = [1, 563, 1209, 264, 13]
    logits = {}
    for q8 in (None, True):
        with Engine(code_moe_tiny, EngineConfig(n_ctx=64), placement=PlacementOptions(n_gpu_layers=0),
                    cpu_act_q8=q8) as e:
            assert [x.act_q8 for x in e.model.experts.executors.values()] == [bool(q8)] * len(e.model.experts.executors)
            logits[q8] = e.eval(toks)[-1].astype(np.float64)
    ref = logits[None]
    moved = np.abs(logits[True] - ref).max() / ref.std()
    assert 1e-5 < moved < 0.1 and logits[True].argmax() == ref.argmax()


@pytest.mark.parametrize("asked,has_gpu,gpu_q8,want", [
    (None, True, True, True),  # beside a GPU that rounds: the CPU experts round too
    (None, True, False, False),  # gpu_act_q8=False keeps float32 throughout
    (None, False, True, False),  # the CPU alone: float32
    (True, False, False, True), (False, True, True, False),  # asked
])
def test_cpu_experts_round_by_default_only_beside_a_rounding_gpu(asked, has_gpu, gpu_q8, want):
    from moecache.engine import cpu_experts_round

    assert cpu_experts_round(asked, has_gpu, gpu_q8) is want


def test_a_failed_load_raises_its_own_error(code_moe_tiny):
    """An engine whose __init__ fails before the model is built closes what it opened and raises the
    first error (its close() once raised AttributeError for the model it never had)."""
    with pytest.raises(ValueError, match="load_mode must be"):
        Engine(code_moe_tiny, EngineConfig(n_ctx=64), load_mode="bogus")
