"""The synthetic GGUF writer: valid files, reproducible bytes, zero-mean blocks, near-uniform routing.

The routing test is the one that matters for benchmarks: a synthetic model whose routing collapses
onto a few experts flatters any expert cache. It runs the float64 reference forward
(moecache.testing.reference) over 256 random tokens of an 8-layer, 16-expert top-4 Q4_K model and
bounds every layer's expert usage (share 1.0 = uniform; 4.0 = an expert every token picks).
Measured with seed 0: balanced init 0.59-1.61 in every layer, all 16 experts used; naive init
(std 0.02, uncentred blocks) 3.5x from layer 1 on and 4.0x with 5 of 16 experts used by layer 7;
balanced scales with uncentred Q4_K blocks 3.7x by layer 2, 4.0x with 5 used by layer 7 (residual
RMS ~6000). The bounds (max < 2.5x, >= 90% of experts used) fail both.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf.quants import dequantize

from moecache.quants.formats import FORMATS
from moecache.testing import reference
from moecache.testing.synth import PRESETS, SynthConfig, TensorSpec, main, tensor_bytes, tensor_specs, write_model

TINY = PRESETS["tiny"]
# Not trivial: deep enough for a collapse to show, Q4_K experts (the benchmark model's type).
ROUTING = SynthConfig(name="routing-test", n_layer=8, n_embd=256, n_head=8, n_head_kv=2, head_dim=32,
                      n_expert=16, n_expert_used=4, expert_ff=256, n_vocab=512, expert_type="Q4_K")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_model(path, TINY, seed=0)
    return path


def kv(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def test_tiny_has_configured_tensors_and_keys(tiny):
    assert tiny.stat().st_size < 5e6
    r = GGUFReader(tiny)
    assert kv(r, "general.architecture") == "qwen3moe"
    a = "qwen3moe."
    c = TINY
    expect = {"block_count": c.n_layer, "context_length": c.context_length, "embedding_length": c.n_embd,
              "feed_forward_length": c.n_ff, "attention.head_count": c.n_head,
              "attention.head_count_kv": c.n_head_kv, "attention.key_length": c.head_dim,
              "attention.value_length": c.head_dim, "expert_count": c.n_expert,
              "expert_used_count": c.n_expert_used, "expert_feed_forward_length": c.expert_ff}
    for k, v in expect.items():
        assert kv(r, a + k) == v, k
    assert kv(r, a + "rope.freq_base") == pytest.approx(c.rope_freq_base)
    assert kv(r, a + "attention.layer_norm_rms_epsilon") == pytest.approx(c.norm_eps)

    specs = tensor_specs(c)
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == [s.name for s in specs]
    assert len(specs) == 3 + 12 * c.n_layer
    for s in specs:
        t = tensors[s.name]
        assert t.tensor_type == FORMATS[s.qtype].ggml_type, s.name
        assert tuple(int(d) for d in t.shape) == s.shape[::-1], s.name  # ggml order: innermost first
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type == GGMLQuantizationType[c.expert_type]
    assert tuple(tensors["blk.0.ffn_down_exps.weight"].shape) == (c.expert_ff, c.n_embd, c.n_expert)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == GGMLQuantizationType.F32
    for name in tensors:
        w = dequantize(tensors[name].data, GGMLQuantizationType(tensors[name].tensor_type))
        assert np.all(np.isfinite(w)), name
    norm = dequantize(tensors["output_norm.weight"].data, GGMLQuantizationType.F32)
    assert 0.5 < norm.min() and norm.max() < 1.5 and norm.std() > 0.01  # 1 + jitter


def test_tokenizer_section(tiny):
    r = GGUFReader(tiny)
    assert kv(r, "tokenizer.ggml.model") == "llama"
    tokens = kv(r, "tokenizer.ggml.tokens")
    types = kv(r, "tokenizer.ggml.token_type")
    scores = kv(r, "tokenizer.ggml.scores")
    assert len(tokens) == len(types) == len(scores) == TINY.n_vocab
    assert len(set(tokens)) == len(tokens)
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert list(types[:3]) == [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert all(t == TokenType.BYTE for t in types[3:259])
    assert all(t == TokenType.NORMAL for t in types[259:])
    assert tokens[259] == "\u2581" and "\u2581the" in tokens
    assert np.all(np.diff(scores[259:]) < 0)
    assert kv(r, "tokenizer.ggml.bos_token_id") == 1
    assert kv(r, "tokenizer.ggml.eos_token_id") == 2
    assert kv(r, "tokenizer.ggml.unknown_token_id") == 0
    assert kv(r, "tokenizer.ggml.add_bos_token") is True


def test_seed_decides_the_bytes(tiny, tmp_path):
    same, other = tmp_path / "same.gguf", tmp_path / "other.gguf"
    write_model(same, TINY, seed=0, workers=2)  # threads do not change the bytes
    write_model(other, TINY, seed=1)
    assert same.read_bytes() == tiny.read_bytes()
    a, b = tiny.read_bytes(), other.read_bytes()
    assert len(a) == len(b) and a != b
    assert not list(tmp_path.glob("*.partial"))
    # every weight tensor differs, not just one
    ta = {t.name: t.data for t in GGUFReader(tiny).tensors}
    tb = {t.name: t.data for t in GGUFReader(other).tensors}
    assert all(not np.array_equal(ta[n], tb[n]) for n in ta)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_blocks_are_valid_zero_mean_and_scaled(qtype):
    """Every format: finite, RMS near the requested std, mean ~0 and no shared sign of row means
    (random K-quant bytes have mean/std ~0.6, all rows positive: see center_blocks)."""
    spec = TensorSpec("blk.0.ffn_gate_exps.weight", (4, 96, 512), qtype, "input")
    raw = tensor_bytes(spec, seed=3).reshape(4, 96, -1)
    w = dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64)
    assert w.shape == spec.shape
    assert np.all(np.isfinite(w))
    std = 1 / math.sqrt(512)
    rms = math.sqrt(np.mean(w * w))
    assert 0.7 * std < rms < 1.4 * std
    assert abs(w.mean()) < 0.02 * rms
    row_means = w.mean(axis=-1).ravel()
    assert 0.3 < np.mean(row_means > 0) < 0.7


def test_routing_stays_near_uniform(tmp_path):
    path = tmp_path / "routing.gguf"
    write_model(path, ROUTING, seed=0)
    tokens = np.random.default_rng(1).integers(0, ROUTING.n_vocab, 256)
    out = reference.forward(path, tokens)
    assert np.all(np.isfinite(out.logits))
    usage = out.usage
    assert usage.shape == (ROUTING.n_layer, ROUTING.n_expert)
    assert np.all(usage.sum(axis=1) == len(tokens) * ROUTING.n_expert_used)
    share = usage / usage.sum(axis=1, keepdims=True) * ROUTING.n_expert  # 1.0 = uniform
    for layer, s in enumerate(share):
        assert s.max() < 2.5, f"layer {layer}: an expert takes {s.max():.2f}x its uniform share"
        assert np.mean(s > 0) >= 0.9, f"layer {layer}: only {np.sum(s > 0)} experts used"
    # the residual stream grows slowly (RMS 1 -> ~2 after 8 layers) instead of exploding
    assert max(np.sqrt(np.mean(h * h)) for h in out.hidden) < 5


def test_bad_shape_is_refused_before_writing(tmp_path):
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match="block size"):
        write_model(path, replace(TINY, expert_type="Q4_K"), seed=0)  # n_embd 64 < 256
    with pytest.raises(ValueError, match="architecture"):
        write_model(path, replace(TINY, arch="nope"), seed=0)
    assert not path.exists()


def test_command_line(tmp_path, tiny):
    path = tmp_path / "cli.gguf"
    main(["--preset", "tiny", "--seed", "0", "-o", str(path)])
    assert path.read_bytes() == tiny.read_bytes()
    main(["--preset", "tiny", "--set", "n_layer=1", "-o", str(path)])
    assert kv(GGUFReader(path), "qwen3moe.block_count") == 1


def test_preset_qwen3_30b_a3b_shape():
    specs = tensor_specs(PRESETS["qwen3-30b-a3b"])
    size = sum(s.nbytes for s in specs)
    assert 16.5 * 2**30 > size > 15.5 * 2**30  # ~16.3 GiB, as the benchmark's anchor model
    gate = next(s for s in specs if s.name == "blk.47.ffn_gate_exps.weight")
    assert gate.shape == (128, 768, 2048) and gate.qtype == "Q4_K"


def test_opens_with_gguf_file(tiny, tmp_path):
    from moecache.gguf_file import open_gguf

    m = open_gguf(tiny)
    assert m.arch == "qwen3moe" and len(m.tensors) == len(tensor_specs(TINY))
    assert m.tokenizer.model == "llama" and m.tokenizer.n_tokens == TINY.n_vocab
    path = tmp_path / "routing.gguf"
    write_model(path, replace(ROUTING, n_layer=1), seed=0)
    open_gguf(path)


def test_reference_building_blocks():
    """Pin the conventions later parity tests rely on: NeoX pairs (i, i + d/2), causal GQA,
    softmax top-k with renormalized weights."""
    rng = np.random.default_rng(0)
    x = np.array([[[1.0, 0.0, 0.0, 0.0]]])
    np.testing.assert_allclose(reference.rope_neox(x, np.array([1.0]), 10000.0),
                               [[[math.cos(1), 0.0, math.sin(1), 0.0]]], atol=1e-15)
    q, k = rng.standard_normal((2, 1, 1, 8))

    def dot(m, n):
        return float(np.sum(reference.rope_neox(q, np.array([m]), 1e4) * reference.rope_neox(k, np.array([n]), 1e4)))
    assert dot(3.0, 1.0) == pytest.approx(dot(10.0, 8.0))  # depends on m - n only

    q, k, v = rng.standard_normal((5, 4, 8)), rng.standard_normal((5, 2, 8)), rng.standard_normal((5, 2, 8))
    out = reference.attention(q, k, v).reshape(5, 4, 8)
    np.testing.assert_allclose(out[0], v[0][[0, 0, 1, 1]])  # token 0 sees itself; heads 0,1 -> kv 0
    v2 = v.copy()
    v2[3:] += 1.0
    np.testing.assert_allclose(reference.attention(q, k, v2)[:3], reference.attention(q, k, v)[:3])  # causal

    x = rng.standard_normal((6, 16))
    router = rng.standard_normal((8, 16))
    gate, up, down = rng.standard_normal((8, 4, 16)), rng.standard_normal((8, 4, 16)), rng.standard_normal((8, 16, 4))
    y, ids, w = reference.moe(x, router, gate, up, down, k=3)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    assert np.all(np.sort(ids, axis=1) == np.sort(np.argsort(-(x @ router.T), axis=1)[:, :3], axis=1))
    t = 2
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    expect = sum(w[t, j] * down[ids[t, j]] @ (silu(gate[ids[t, j]] @ x[t]) * (up[ids[t, j]] @ x[t])) for j in range(3))
    np.testing.assert_allclose(y[t], expect)
