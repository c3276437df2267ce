"""The transformers reference (moecache.testing.hf_reference) and the synthetic models of every
architecture it runs.

The reference's hyperparameters come from gguf-py's reader, not moecache's parser: checked against
the synthetic writer's own parameters for every architecture, and against llama.cpp's defaults for
keys a file leaves out.

qwen3moe is checked against the float64 numpy reference (moecache.testing.reference), on a
synthetic model and on the real code-moe-tiny: max |hf - numpy| / max |numpy| < 1e-4 (measured
6.3e-7 and 7.2e-7). The other architectures have no numpy reference; they were checked once
against llama.cpp b11434 (all-F32 copies of the tiny presets, F32 KV cache: 3e-7..1e-6, gemma3
6e-4 from ggml's f16 GELU table), and here get a smoke test plus checks of the conventions
hf_reference undoes (llama's q/k permutation, gemma3's +1 on norms, gemma3's layer types).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from moecache.testing import reference
from moecache.testing.synth import PRESETS, write_model

TINY_ARCHS = {name: c for name, c in PRESETS.items() if name.startswith("tiny")}
# 24 tokens: longer than tiny-gemma3's sliding window (8), so its window is exercised
TOKENS = [1, 5, 9, 200, 17, 33, 250, 4, 77, 100, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 120, 130, 140, 150]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Every tiny preset, written once (the writer is deterministic)."""
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for name, c in TINY_ARCHS.items():
        out[name] = d / f"{name}.gguf"
        write_model(out[name], c, seed=0)
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_qwen3moe_matches_numpy_reference(hf, models):
    path = models["tiny"]
    got = hf.hf_logits(path, TOKENS)
    want = reference.forward(path, np.array(TOKENS)).logits
    assert got.dtype == np.float32 and got.shape == (len(TOKENS), PRESETS["tiny"].n_vocab)
    assert rel_err(got, want) < 1e-4


def test_code_moe_tiny_matches_numpy_reference(hf, code_moe_tiny):
    tokens = np.random.default_rng(0).integers(0, 8192, 32)
    got = hf.hf_logits(code_moe_tiny, tokens)
    want = reference.forward(code_moe_tiny, tokens).logits
    assert got.shape == (32, 8192)
    assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("name", [n for n in TINY_ARCHS if n != "tiny"])
def test_every_arch_builds_and_gives_sane_logits(hf, models, name):
    """The model builds with every parameter from the file (strict load), the logits are finite
    with a sensible spread (balanced init: std about 1), and the model is causal: a prefix gets
    the same logits alone."""
    from moecache.gguf_file import open_gguf

    path = models[name]
    with open_gguf(path) as m:  # the reader validates the file against moecache.arch
        assert m.arch == TINY_ARCHS[name].arch
    model = hf.hf_model(path)
    logits = hf.hf_logits(path, TOKENS, model=model)
    assert logits.shape == (len(TOKENS), TINY_ARCHS[name].n_vocab)
    assert np.all(np.isfinite(logits))
    assert 0.3 < logits.std() < 3.0
    assert len(set(logits.argmax(-1).tolist())) > len(TOKENS) // 3  # not one token everywhere
    prefix = hf.hf_logits(path, TOKENS[:10], model=model)
    np.testing.assert_allclose(prefix, logits[:10], rtol=0, atol=1e-4 * np.abs(logits).max())


@pytest.mark.parametrize("name", list(TINY_ARCHS))
def test_reference_hparams_are_the_writers_parameters(hf, models, name):
    """The reference reads its hyperparameters with gguf-py, not with moecache's parser: they must
    be the synthetic writer's own parameters (SynthConfig), and the transformers config must carry
    them. moecache's parser (ModelConfig) must agree with both."""
    from gguf import GGUFReader

    from moecache.gguf_file import open_gguf

    c = TINY_ARCHS[name]
    hp = hf.read_hparams(GGUFReader(models[name]))
    moe = c.n_expert > 0
    want = dict(arch=c.arch, n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head, n_head_kv=c.n_head_kv,
                head_dim=c.head_dim, head_dim_v=c.head_dim, rope_dim=c.head_dim, n_expert=c.n_expert,
                n_expert_used=c.n_expert_used, n_vocab=c.n_vocab, context_length=c.context_length,
                rope_freq_base=c.rope_freq_base, sliding_window=c.sliding_window,
                shared_expert_ff=c.shared_expert_ff, rope_type="norm" if c.arch == "llama" else "neox",
                leading_dense_block_count=0, rope_scaling_type=None, final_logit_softcapping=None)
    if moe:
        want["expert_ff"] = c.expert_ff
    got = {k: getattr(hp, k) for k in want}
    assert got == want
    assert hp.norm_eps == pytest.approx(c.norm_eps, rel=1e-7)  # stored as float32

    hc = hf.hf_config(hp)
    assert (hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim,
            hc.vocab_size) == (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_vocab)
    assert hc.rms_norm_eps == hp.norm_eps
    theta = hc.rope_parameters.get("full_attention", hc.rope_parameters)["rope_theta"]
    assert theta == c.rope_freq_base
    if moe:
        experts = getattr(hc, "num_experts", None) or hc.num_local_experts
        width = hc.intermediate_size if type(hc).__name__ in ("MixtralConfig", "OlmoeConfig") \
            else hc.moe_intermediate_size
        assert (experts, hc.num_experts_per_tok, width) == (c.n_expert, c.n_expert_used, c.expert_ff)
    else:
        assert hc.intermediate_size == c.n_ff

    with open_gguf(models[name]) as m:  # moecache's own parser, on the same file
        ours = {k: getattr(m.config, k) for k in want}
    assert ours == got | {"sliding_window": c.sliding_window or None}  # None there: no window


def test_reference_hparams_follow_llamacpp_defaults(hf, tmp_path):
    """Keys a file may leave out get llama.cpp's defaults (llama_model::load_hparams): head_count_kv
    = head_count, key_length = value_length = n_embd / n_head, rope.dimension_count = key_length,
    freq_base 10000; qwen3moe's expert width n_ff / n_expert_used; qwen2moe's shared one n_ff."""
    from gguf import GGUFReader, GGUFWriter

    def file(arch, **keys):
        path = tmp_path / f"{arch}.gguf"
        w = GGUFWriter(path, arch)
        for k, v in {"block_count": 2, "context_length": 64, "embedding_length": 96,
                     "attention.head_count": 4, "attention.layer_norm_rms_epsilon": 1e-5, **keys}.items():
            if v is None:
                continue
            (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"{arch}.{k}", v)
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        return hf.read_hparams(GGUFReader(path))

    q = file("qwen3moe", feed_forward_length=512, expert_count=8, expert_used_count=4)
    assert (q.n_head_kv, q.head_dim, q.head_dim_v, q.rope_dim) == (4, 24, 24, 24)
    assert (q.expert_ff, q.shared_expert_ff, q.rope_freq_base, q.n_vocab) == (128, 0, 10000.0, 3)
    q = file("qwen3moe", **{"attention.key_length": 32, "expert_feed_forward_length": 48,
                            "vocab_size": 7, "expert_count": 8, "expert_used_count": 4})
    assert (q.head_dim, q.head_dim_v, q.rope_dim, q.expert_ff, q.n_vocab) == (32, 24, 32, 48, 7)
    q2 = file("qwen2moe", feed_forward_length=256, expert_count=4, expert_used_count=2)
    assert (q2.expert_ff, q2.shared_expert_ff) == (128, 256)
    mx = file("llama", feed_forward_length=256, expert_count=8, expert_used_count=2)
    assert (mx.expert_ff, mx.rope_type) == (256, "norm")
    g = file("gemma3", feed_forward_length=256)
    assert (g.sliding_window_pattern, g.rope_freq_base_swa, g.sliding_window, g.is_moe) == (6, 10000.0, 0, False)
    with pytest.raises(KeyError, match="olmoe.block_count"):
        file("olmoe", block_count=None)


def test_hf_config_facts(hf, models):
    """What each architecture's transformers config must say (see the module docstring)."""
    from gguf import GGUFReader

    def config(name):
        return hf.hf_config(hf.read_hparams(GGUFReader(models[name])))

    assert config("tiny").norm_topk_prob is True
    q2 = config("tiny-qwen2moe")
    assert q2.norm_topk_prob is False and q2.qkv_bias is True
    assert (q2.moe_intermediate_size, q2.shared_expert_intermediate_size) == (32, 64)
    assert config("tiny-olmoe").norm_topk_prob is False
    mx = config("tiny-mixtral")
    assert type(mx).__name__ == "MixtralConfig" and mx.intermediate_size == 64 and mx.num_local_experts == 8
    assert type(config("tiny-llama")).__name__ == "LlamaConfig"
    g = config("tiny-gemma3")
    assert g.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert g.sliding_window == 8 and g.query_pre_attn_scalar == 32
    assert g.hidden_activation == "gelu_pytorch_tanh"
    assert g.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert g.rope_parameters["full_attention"]["rope_theta"] == PRESETS["tiny-gemma3"].rope_freq_base
    for name in TINY_ARCHS:
        c = config(name)
        assert c._attn_implementation == "eager" and c.head_dim == TINY_ARCHS[name].head_dim


def test_gemma3_norms_lose_the_converters_plus_one(hf, models):
    from gguf import GGUFReader

    path = models["tiny-gemma3"]
    model = hf.hf_model(path)
    raw = {t.name: np.array(t.data, dtype=np.float32) for t in GGUFReader(path).tensors}
    got = model.model.norm.weight.detach().numpy()
    np.testing.assert_array_equal(got, raw["output_norm.weight"] - np.float32(1))
    layer = model.model.layers[5]
    np.testing.assert_array_equal(layer.self_attn.q_norm.weight.detach().numpy(),
                                  raw["blk.5.attn_q_norm.weight"] - np.float32(1))
    np.testing.assert_array_equal(layer.post_feedforward_layernorm.weight.detach().numpy(),
                                  raw["blk.5.post_ffw_norm.weight"] - np.float32(1))
    # gemma3 scales the embeddings by sqrt(n_embd) itself; the tied lm_head is the raw table
    assert float(model.model.embed_tokens.embed_scale) == pytest.approx(math.sqrt(64))
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(),
                                  model.model.embed_tokens.weight.detach().numpy())


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The llama converter's q/k permutation (conversion/llama.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(x: np.ndarray, pos: float, pairs: str) -> np.ndarray:
    """RoPE of one head vector x (d,): pairs "adjacent" (x[2i], x[2i+1]; llama.cpp "norm") or
    "halves" (x[i], x[i+d/2]; NeoX, transformers' rotate_half)."""
    d = x.shape[-1]
    theta = pos * 10000.0 ** (-np.arange(d // 2) * 2.0 / d)
    a, b = (x[0::2], x[1::2]) if pairs == "adjacent" else (x[: d // 2], x[d // 2:])
    ra, rb = a * np.cos(theta) - b * np.sin(theta), b * np.cos(theta) + a * np.sin(theta)
    out = np.empty_like(x)
    if pairs == "adjacent":
        out[0::2], out[1::2] = ra, rb
    else:
        out[: d // 2], out[d // 2:] = ra, rb
    return out


def test_unpermute_turns_llamacpp_rope_into_rotate_half(hf):
    """A permuted q (as in a llama GGUF) with llama.cpp's adjacent-pair RoPE gives the same
    attention scores as the un-permuted q with transformers' half-split RoPE."""
    rng = np.random.default_rng(0)
    n_head, n_kv, d, e = 4, 2, 8, 16
    wq, wk = rng.standard_normal((n_head * d, e)), rng.standard_normal((n_kv * d, e))
    gq, gk = _permute(wq, n_head), _permute(wk, n_kv)  # what the GGUF holds
    np.testing.assert_array_equal(hf.unpermute_qk(gq, n_head), wq)
    np.testing.assert_array_equal(hf.unpermute_qk(gk, n_kv), wk)
    x, y = rng.standard_normal(e), rng.standard_normal(e)
    for h in range(n_head):
        kv = h // (n_head // n_kv)
        q_gguf = _rope((gq @ x).reshape(n_head, d)[h], 5.0, "adjacent")
        k_gguf = _rope((gk @ y).reshape(n_kv, d)[kv], 2.0, "adjacent")
        q_hf = _rope((hf.unpermute_qk(gq, n_head) @ x).reshape(n_head, d)[h], 5.0, "halves")
        k_hf = _rope((hf.unpermute_qk(gk, n_kv) @ y).reshape(n_kv, d)[kv], 2.0, "halves")
        assert q_gguf @ k_gguf == pytest.approx(q_hf @ k_hf, rel=1e-12)


def test_synth_refuses_what_llamacpp_would_not_load():
    from dataclasses import replace

    from moecache.testing.synth import tensor_specs

    bad = {
        "is dense": replace(PRESETS["tiny-gemma3"], n_expert=8, n_expert_used=2),
        "needs experts": replace(PRESETS["tiny-olmoe"], n_expert=0),
        "shared expert": replace(PRESETS["tiny-qwen2moe"], shared_expert_ff=0),
        "n_head_kv == n_head": replace(PRESETS["tiny-olmoe"], n_head_kv=2),
        "output.weight": replace(PRESETS["tiny-olmoe"], tied_output=True),
        "no shared expert": replace(PRESETS["tiny"], shared_expert_ff=64),
        "no sliding-window": replace(PRESETS["tiny-qwen3"], sliding_window=8),
    }
    for match, c in bad.items():
        with pytest.raises(ValueError, match=match):
            tensor_specs(c)
    # a tied output drops output.weight; Mixtral's experts are feed_forward_length wide
    names = {s.name for s in tensor_specs(PRESETS["tiny-llama"])}
    assert "output.weight" not in names and "blk.0.ffn_gate.weight" in names
    names = {s.name for s in tensor_specs(PRESETS["tiny-mixtral"])}
    assert "output.weight" in names and "blk.0.ffn_gate_exps.weight" in names
