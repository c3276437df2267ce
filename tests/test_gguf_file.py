"""moecache.gguf_file and moecache.arch on tiny GGUFs written with gguf-py's GGUFWriter.

A valid tiny qwen3moe (2 layers, n_embd 64, 4 experts, ~100 KB) is written once; each error case
is a corrupted copy of it (or a variant written with a key/tensor left out). Expected shapes are
spelled out here by hand, independently of moecache.arch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

from moecache.arch import ARCHS, ModelConfig, expected_tensors
from moecache.errors import GGUFError, UnsupportedArchError, UnsupportedQuantError
from moecache.gguf_file import open_gguf
from moecache.quants.formats import FORMATS
from moecache.quants.random_blocks import random_rows

A = "qwen3moe"
N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM = 2, 64, 4, 2, 16
N_EXPERT, N_USED, EXPERT_FF, N_FF, CTX = 4, 2, 32, 96, 128
TOKENS = ["<|endoftext|>", "a", "b", "Ġthe", "é", "日本", b"\xff\xfe"] + [f"t{i}" for i in range(89)]
N_VOCAB = len(TOKENS)  # 96

# ---- writing ------------------------------------------------------------------------------------


def qwen3moe_keys() -> dict:
    return {
        f"{A}.block_count": N_LAYER, f"{A}.context_length": CTX, f"{A}.embedding_length": N_EMBD,
        f"{A}.feed_forward_length": N_FF, f"{A}.attention.head_count": N_HEAD,
        f"{A}.attention.head_count_kv": N_HEAD_KV, f"{A}.attention.key_length": HEAD_DIM,
        f"{A}.attention.value_length": HEAD_DIM, f"{A}.rope.dimension_count": HEAD_DIM,
        f"{A}.rope.freq_base": 1e6, f"{A}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{A}.expert_count": N_EXPERT, f"{A}.expert_used_count": N_USED,
        f"{A}.expert_feed_forward_length": EXPERT_FF,
        "general.name": "tiny", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3] + [1] * (N_VOCAB - 1),
        "tokenizer.ggml.scores": [float(-i) for i in range(N_VOCAB)],
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.eot_token_id": 1,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": "{{ messages }}",
    }


def q8(rng, *shape):
    """Random valid Q8_0 bytes for a tensor of logical `shape`: uint8 (*shape[:-1], row_bytes)."""
    rows = random_rows(FORMATS["Q8_0"], math.prod(shape[:-1]), shape[-1], rng, std=0.02)
    return rows.reshape(*shape[:-1], rows.shape[-1]), QT.Q8_0


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32), None


# logical shapes of the tiny qwen3moe, numpy order, written out by hand
QWEN3MOE_SHAPES = {
    "token_embd.weight": (N_VOCAB, N_EMBD), "output_norm.weight": (N_EMBD,), "output.weight": (N_VOCAB, N_EMBD),
    **{f"blk.{i}.{n}": s for i in range(N_LAYER) for n, s in {
        "attn_norm.weight": (64,), "attn_q.weight": (64, 64), "attn_k.weight": (32, 64),
        "attn_v.weight": (32, 64), "attn_output.weight": (64, 64), "attn_q_norm.weight": (16,),
        "attn_k_norm.weight": (16,), "ffn_norm.weight": (64,), "ffn_gate_inp.weight": (4, 64),
        "ffn_gate_exps.weight": (4, 32, 64), "ffn_up_exps.weight": (4, 32, 64),
        "ffn_down_exps.weight": (4, 64, 32)}.items()},
}


def make_tensors(shapes: dict, rng) -> dict:
    """Norms, router and 1-D tensors F32; matrices Q8_0 (as in code-moe-tiny)."""
    return {n: (f32(rng, *s) if len(s) == 1 or "ffn_gate_inp" in n else q8(rng, *s)) for n, s in shapes.items()}


def _add_key(w: gguf.GGUFWriter, key: str, v) -> None:
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    else:
        w.add_array(key, v)


def write_gguf(path: Path, arch: str, keys: dict, tensors: dict, alignment: int | None = None,
               split_max_tensors: int = 0) -> Path:
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    if alignment:
        w.add_custom_alignment(alignment)
    for k, v in keys.items():
        _add_key(w, k, v)
    for name, (arr, qt) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, keys, tensors) of a valid tiny qwen3moe."""
    d = tmp_path_factory.mktemp("tiny")
    keys, tensors = qwen3moe_keys(), make_tensors(QWEN3MOE_SHAPES, np.random.default_rng(0))
    return write_gguf(d / "tiny.gguf", A, keys, tensors), keys, tensors


def variant(tmp_path, tiny, *, drop_keys=(), drop_tensors=(), keys=None, tensors=None, arch=A, **kw) -> Path:
    """A copy of the tiny model written with keys/tensors changed or left out."""
    _, k0, t0 = tiny
    k = {n: v for n, v in k0.items() if n not in drop_keys} | (keys or {})
    t = {n: v for n, v in t0.items() if n not in drop_tensors} | (tensors or {})
    return write_gguf(tmp_path / "variant.gguf", arch, k, t, **kw)


def patched(tmp_path, src: Path, pos: int, new: bytes) -> Path:
    b = bytearray(src.read_bytes())
    b[pos:pos + len(new)] = new
    out = tmp_path / "patched.gguf"
    out.write_bytes(bytes(b))
    return out


def tensor_info_pos(path: Path, name: str) -> tuple[int, int]:
    """File positions of a tensor info's ggml type (u32) and data offset (u64) fields."""
    r = gguf.GGUFReader(path)
    f = next(t.field for t in r.tensors if t.name == name)
    off_pos = f.offset + sum(int(p.nbytes) for p in f.parts[:-1])
    return off_pos - 4, off_pos


def raises(exc, path, *needles):
    with pytest.raises(exc) as ei:
        open_gguf(path)
    msg = str(ei.value)
    if os.environ.get("SHOW_MSGS"):
        print(f"\n[{ei.type.__name__}] {msg}")
    assert "\n" not in msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


# ---- a valid file -------------------------------------------------------------------------------


def test_config_equals_written_keys(tiny):
    with open_gguf(tiny[0]) as m:
        c = m.config
        assert m.arch == c.arch == A
        assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v) == (2, 64, 4, 2, 16, 16)
        assert (c.n_ff, c.n_expert, c.n_expert_used, c.expert_ff) == (N_FF, 4, 2, 32)
        assert (c.shared_expert_ff, c.n_expert_shared, c.leading_dense_block_count) == (0, 0, 0)
        assert (c.context_length, c.n_vocab, c.rope_dim, c.rope_type) == (CTX, N_VOCAB, 16, "neox")
        assert c.rope_freq_base == 1e6 and c.norm_eps == pytest.approx(1e-6)
        assert c.rope_scaling_type is None and c.sliding_window is None
        assert c.is_moe and c.layer_is_moe(0) and (c.n_embd_q, c.n_embd_k_gqa) == (64, 32)
        assert m.version == 3 and m.alignment == 32 and m.paths == (tiny[0],) and not m.tied_output
        assert m.unexpected_tensors == ()


def test_tensor_views_are_the_written_bytes(tiny):
    path, _, written = tiny
    with open_gguf(path) as m:
        assert list(m.tensors) == list(written)
        base = m._readers[0].data
        for name, (arr, qt) in written.items():
            t = m.tensors[name]
            assert t.name == name and t.shape == QWEN3MOE_SHAPES[name]
            assert t.ggml_type == int(qt if qt is not None else QT.F32)
            assert t.data.dtype == np.uint8 and t.data.shape == (*t.shape[:-1], t.row_bytes)
            assert t.n_bytes == t.data.nbytes == arr.nbytes and t.n_rows == math.prod(t.shape[:-1])
            assert t.offset % 32 == 0 and t.file == 0
            assert not t.data.flags.writeable and np.shares_memory(t.data, base)  # a view, no copy
            np.testing.assert_array_equal(t.data, arr.view(np.uint8).reshape(t.data.shape))
        t = m.tensors["blk.1.ffn_down_exps.weight"]
        assert t.type_name == "Q8_0" and t.row_bytes == 34 and t.data[3].shape == (64, 34)
        norm = m.tensors["output_norm.weight"].data.view("<f4")
        np.testing.assert_array_equal(norm, written["output_norm.weight"][0])
        assert m.n_bytes == sum(a.nbytes for a, _ in written.values())


def test_metadata_and_tokenizer(tiny):
    with open_gguf(tiny[0]) as m:
        md = m.metadata
        assert "tokenizer.ggml.tokens" not in md._cache  # not decoded until asked
        assert md.array_len("tokenizer.ggml.tokens") == N_VOCAB == m.tokenizer.n_tokens
        assert md["general.name"] == "tiny" and md[f"{A}.block_count"] == 2
        assert md["general.architecture"] == A and "GGUF.version" not in md
        assert md.value_type("tokenizer.ggml.token_type") == (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        tok = m.tokenizer
        assert tok.model == "gpt2" and tok.pre == "qwen2"
        assert tok.tokens[:6] == TOKENS[:6] and tok.tokens[7:] == TOKENS[7:]
        assert tok.tokens[6].encode("utf-8", "surrogateescape") == b"\xff\xfe"  # invalid UTF-8 survives
        assert tok.token_type.dtype == np.int32 and tok.token_type.tolist() == [3] + [1] * (N_VOCAB - 1)
        assert tok.scores.dtype == np.float32 and tok.scores[5] == -5.0
        assert tok.merges == ["Ġ t", "h e", "Ġt he"]
        assert (tok.bos_id, tok.eos_id, tok.eot_id, tok.eom_id) == (0, 0, 1, None)
        assert tok.add_bos is False and tok.add_eos is None and tok.chat_template == "{{ messages }}"
        assert len(md) == len(list(md)) == len(qwen3moe_keys()) + 1  # + general.architecture
        assert "[96 items]" in repr(md)


def test_close_and_context_manager(tiny):
    m = open_gguf(str(tiny[0]))
    view = m.tensors["token_embd.weight"].data
    assert "qwen3moe" in repr(m)
    m.close()
    m.close()
    assert m.tensors == {}
    assert view.shape == (N_VOCAB, 68) and int(view.sum()) > 0  # views held by the caller stay valid


def test_tied_output_when_output_absent(tmp_path, tiny):
    m = open_gguf(variant(tmp_path, tiny, drop_tensors=["output.weight"]))
    assert m.tied_output and "output.weight" not in m.tensors


def test_custom_alignment(tmp_path, tiny):
    m = open_gguf(variant(tmp_path, tiny, alignment=256))
    assert m.alignment == 256 and m.metadata["general.alignment"] == 256
    assert all(t.offset % 256 == 0 for t in m.tensors.values())


def test_vocab_size_from_token_embd_without_tokenizer(tmp_path, tiny):
    m = open_gguf(variant(tmp_path, tiny, drop_keys=[k for k in tiny[1] if k.startswith("tokenizer.")]))
    assert m.config.n_vocab == N_VOCAB and m.tokenizer.tokens is None and m.tokenizer.n_tokens == 0


def test_unexpected_tensors_are_kept(tmp_path, tiny):
    m = open_gguf(variant(tmp_path, tiny, tensors={"extra.weight": f32(np.random.default_rng(1), 8)}))
    assert m.unexpected_tensors == ("extra.weight",) and m.tensors["extra.weight"].shape == (8,)


# ---- split models -------------------------------------------------------------------------------


def write_split(tmp_path, tiny) -> list[Path]:
    _, keys, tensors = tiny
    write_gguf(tmp_path / "model.gguf", A, keys, tensors, split_max_tensors=10)
    shards = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(shards) == 3 and shards[0].name == "model-00001-of-00003.gguf"  # 27 tensors
    return shards


def test_split_model_loads_as_one(tmp_path, tiny):
    shards = write_split(tmp_path, tiny)
    single = open_gguf(tiny[0])
    for given in (shards[0], shards[2]):
        m = open_gguf(given)
        assert m.paths == tuple(shards) and m.path == shards[0]
        assert m.config == single.config and list(m.tensors) == list(single.tensors)
        assert m.metadata["split.count"] == 3 and m.tokenizer.tokens == single.tokenizer.tokens
        for name, t in m.tensors.items():
            np.testing.assert_array_equal(t.data, single.tensors[name].data)
        assert [m.tensors[n].file for n in ("token_embd.weight", "blk.1.ffn_down_exps.weight")] == [0, 2]


def test_split_missing_shard(tmp_path, tiny):
    shards = write_split(tmp_path, tiny)
    shards[1].unlink()
    raises(GGUFError, shards[0], "model-00002-of-00003.gguf", "missing")


def test_split_shard_renamed(tmp_path, tiny):
    shards = write_split(tmp_path, tiny)
    renamed = shards[0].with_name("renamed.gguf")
    shards[0].rename(renamed)
    raises(GGUFError, renamed, "-00001-of-00003.gguf")


def test_split_shards_of_different_models(tmp_path, tiny):
    shards = write_split(tmp_path, tiny)
    shards[2].write_bytes(shards[1].read_bytes())  # shard 3 replaced by a copy of shard 2
    raises(GGUFError, shards[0], "model-00003-of-00003.gguf", "split.no=1")


# ---- error cases --------------------------------------------------------------------------------


def test_not_found_and_not_a_file(tmp_path):
    raises(GGUFError, tmp_path / "nope.gguf", "nope.gguf", "no such file")
    raises(GGUFError, tmp_path, "not a file")


def test_empty_file(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    raises(GGUFError, tmp_path / "empty.gguf", "empty")


def test_wrong_magic(tmp_path, tiny):
    p = patched(tmp_path, tiny[0], 0, b"PK\x03\x04")
    raises(GGUFError, p, "not a GGUF file", "PK\\x03\\x04")


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(tmp_path, tiny, version):
    p = patched(tmp_path, tiny[0], 4, version.to_bytes(4, "little"))
    raises(GGUFError, p, f"unsupported GGUF version {version}")


def test_big_endian_rejected(tmp_path, tiny):
    raises(GGUFError, patched(tmp_path, tiny[0], 4, (3).to_bytes(4, "big")), "big-endian")


def test_truncated_tensor_data(tmp_path, tiny):
    data = tiny[0].read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:-100])
    raises(GGUFError, p, "truncated", "blk.1.ffn_down_exps.weight", "8704 bytes", "100 missing")
    p.write_bytes(data[:len(data) // 2])
    raises(GGUFError, p, "truncated", "more tensors also past the end")


@pytest.mark.parametrize("where", ["magic", "counts", "key0", "kv", "tokens", "scores", "tensor_info", "last_info"])
def test_truncated_header(tmp_path, tiny, where):
    r = gguf.GGUFReader(tiny[0])
    ti = [t.field.offset for t in r.tensors]
    cut = {"magic": 6, "counts": 20, "key0": 24, "kv": 200, "tokens": r.fields["tokenizer.ggml.tokens"].offset + 50,
           "scores": r.fields["tokenizer.ggml.scores"].offset + 50, "tensor_info": ti[0] + 30,
           "last_info": r.data_offset - 40}[where]
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny[0].read_bytes()[:cut])
    needle = {"tokens": "tokenizer.ggml.tokens", "scores": "tokenizer.ggml.scores",
              "tensor_info": "tensor info 0 of 27", "last_info": "after 'blk.1.ffn_up_exps.weight'"}.get(where, "")
    raises(GGUFError, p, "truncated", needle)


def test_truncated_token_array_names_key(tmp_path, tiny):
    r = gguf.GGUFReader(tiny[0])
    f = r.fields["tokenizer.ggml.tokens"]
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny[0].read_bytes()[:f.offset + 100])
    raises(GGUFError, p, "truncated", "tokenizer.ggml.tokens")


def test_corrupt_value_type_names_key(tmp_path, tiny):
    f = gguf.GGUFReader(tiny[0]).fields[f"{A}.expert_count"]
    pos = f.offset + 8 + len(f"{A}.expert_count")
    raises(GGUFError, patched(tmp_path, tiny[0], pos, (99).to_bytes(4, "little")),
           f"'{A}.expert_count'", "unknown value type 99")


def test_misaligned_tensor_offset(tmp_path, tiny):
    _, off_pos = tensor_info_pos(tiny[0], "output_norm.weight")
    old = int.from_bytes(tiny[0].read_bytes()[off_pos:off_pos + 8], "little")
    p = patched(tmp_path, tiny[0], off_pos, (old + 16).to_bytes(8, "little"))
    raises(GGUFError, p, "output_norm.weight", "misaligned", f"{old + 16}", "general.alignment = 32")


def test_unknown_architecture(tmp_path, tiny):
    p = variant(tmp_path, tiny, arch="mamba9")
    raises(UnsupportedArchError, p, "'mamba9'", "qwen3moe", "olmoe", "supported")


@pytest.mark.parametrize("qt", [QT.Q8_1, QT.IQ2_XXS, QT.I32], ids=lambda q: q.name)
def test_unsupported_quant_type(tmp_path, tiny, qt):
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = np.random.default_rng(2).integers(0, 255, (4, 64, 256 // block * size), dtype=np.uint8)
    p = variant(tmp_path, tiny, tensors={"blk.0.ffn_down_exps.weight": (raw, qt)})
    raises(UnsupportedQuantError, p, "blk.0.ffn_down_exps.weight", qt.name)


def test_unknown_type_id(tmp_path, tiny):
    type_pos, _ = tensor_info_pos(tiny[0], "blk.0.attn_q.weight")
    p = patched(tmp_path, tiny[0], type_pos, (4).to_bytes(4, "little"))  # 4 was Q4_2, removed from ggml
    raises(UnsupportedQuantError, p, "blk.0.attn_q.weight", "unknown type id 4")


def test_missing_keys_all_named(tmp_path, tiny):
    p = variant(tmp_path, tiny, drop_keys=[f"{A}.block_count", f"{A}.expert_count"])
    raises(GGUFError, p, "missing required keys", f"{A}.block_count", f"{A}.expert_count")


def test_wrong_key_type(tmp_path, tiny):
    p = variant(tmp_path, tiny, keys={f"{A}.block_count": "two"})
    raises(GGUFError, p, f"{A}.block_count", "expected int")


def test_inconsistent_hyperparameters(tmp_path, tiny):
    p = variant(tmp_path, tiny, keys={f"{A}.expert_used_count": 8})
    raises(GGUFError, p, f"{A}.expert_used_count (8)")


def test_missing_tensors_all_named(tmp_path, tiny):
    p = variant(tmp_path, tiny, drop_tensors=["blk.1.attn_k.weight", "output_norm.weight"])
    raises(GGUFError, p, "missing tensors", "blk.1.attn_k.weight", "output_norm.weight")


def test_old_per_expert_layout_hint(tmp_path, tiny):
    rng = np.random.default_rng(3)
    per_expert = {f"blk.0.ffn_gate.{e}.weight": q8(rng, 32, 64) for e in range(N_EXPERT)}
    p = variant(tmp_path, tiny, drop_tensors=["blk.0.ffn_gate_exps.weight"], tensors=per_expert)
    raises(GGUFError, p, "blk.0.ffn_gate_exps.weight", "re-convert")


def test_shape_mismatch(tmp_path, tiny):
    rng = np.random.default_rng(4)
    p = variant(tmp_path, tiny, tensors={"blk.0.ffn_gate_exps.weight": q8(rng, 4, 64, 64),
                                         "blk.1.attn_k_norm.weight": f32(rng, 32)})
    raises(GGUFError, p, "blk.0.ffn_gate_exps.weight expected (4, 32, 64) got (4, 64, 64)",
           "blk.1.attn_k_norm.weight expected (16,) got (32,)")


# ---- every architecture of the table ------------------------------------------------------------

_KEY_OF = {  # ModelConfig field -> GGUF key suffix (the inverse of arch.config_from_metadata)
    "n_layer": "block_count", "n_embd": "embedding_length", "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv", "head_dim": "attention.key_length",
    "head_dim_v": "attention.value_length", "n_ff": "feed_forward_length", "n_expert": "expert_count",
    "n_expert_used": "expert_used_count", "expert_ff": "expert_feed_forward_length",
    "shared_expert_ff": "expert_shared_feed_forward_length", "context_length": "context_length",
    "norm_eps": "attention.layer_norm_rms_epsilon", "rope_freq_base": "rope.freq_base",
    "rope_dim": "rope.dimension_count", "sliding_window": "attention.sliding_window",
}


def tiny_config(arch: str, moe: bool) -> ModelConfig:
    expert_ff = 0 if not moe else 96 if arch in ("llama", "olmoe") else 32  # llama/olmoe: experts are n_ff wide
    return ModelConfig(
        arch=arch, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, head_dim_v=16, n_ff=96,
        n_expert=4 if moe else 0, n_expert_used=2 if moe else 0, expert_ff=expert_ff,
        shared_expert_ff=64 if arch == "qwen2moe" else 0, n_expert_shared=1 if arch == "qwen2moe" else 0,
        context_length=128, n_vocab=N_VOCAB, norm_eps=float(np.float32(1e-5)), rope_freq_base=5e5, rope_dim=16,
        rope_type=ARCHS[arch].rope_type, sliding_window=32 if arch == "gemma3" else None)


ARCH_CASES = [(a, True) for a in ("qwen3moe", "qwen2moe", "olmoe", "llama")] + \
             [(a, False) for a in ("llama", "qwen3", "gemma3")]


def test_cases_cover_the_table():
    assert {a for a, _ in ARCH_CASES} == set(ARCHS)


@pytest.mark.parametrize("arch,moe", ARCH_CASES)
def test_every_arch_roundtrips(tmp_path, arch, moe):
    cfg = tiny_config(arch, moe)
    keys = {f"{arch}.{_KEY_OF[f]}": getattr(cfg, f) for f in _KEY_OF if getattr(cfg, f)}
    if arch in ("llama", "olmoe"):  # their experts are feed_forward_length wide; no expert_ff key
        keys.pop(f"{arch}.expert_feed_forward_length", None)
    keys["tokenizer.ggml.tokens"] = TOKENS
    shapes = {n: s for n, (s, optional) in expected_tensors(cfg).items()}
    p = write_gguf(tmp_path / f"{arch}.gguf", arch, keys, make_tensors(shapes, np.random.default_rng(5)))
    m = open_gguf(p)
    assert m.config == cfg and m.config.is_moe == moe
    assert {n: t.shape for n, t in m.tensors.items()} == shapes


@pytest.mark.parametrize("arch,moe", ARCH_CASES)
def test_arch_tensor_names_match_gguf_py(arch, moe):
    """Every name in the table is one gguf-py's MODEL_TENSORS lists for that architecture."""
    enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    allowed = {TENSOR_NAMES[t].format(bid=i) for t in MODEL_TENSORS[enum] for i in range(2)}
    for name in expected_tensors(tiny_config(arch, moe)):
        assert name.rsplit(".", 1)[0] in allowed and name.rsplit(".", 1)[1] in ("weight", "bias"), name


def test_qwen2moe_shared_expert_defaults_to_n_ff(tmp_path):
    cfg = tiny_config("qwen2moe", True)
    keys = {f"qwen2moe.{_KEY_OF[f]}": getattr(cfg, f) for f in _KEY_OF if getattr(cfg, f)}
    del keys["qwen2moe.expert_shared_feed_forward_length"], keys["qwen2moe.expert_feed_forward_length"]
    keys["qwen2moe.feed_forward_length"] = 64  # llama.cpp: n_ff_exp = n_ff / n_expert_used, n_ff_shexp = n_ff
    keys["tokenizer.ggml.tokens"] = TOKENS
    want = tiny_config("qwen2moe", True)
    want = ModelConfig(**{**want.__dict__, "n_ff": 64, "expert_ff": 32, "shared_expert_ff": 64})
    shapes = {n: s for n, (s, _) in expected_tensors(want).items()}
    m = open_gguf(write_gguf(tmp_path / "q2.gguf", "qwen2moe", keys, make_tensors(shapes, np.random.default_rng(6))))
    assert m.config == want


# ---- the real model in /work/shared/models -------------------------------------------------------


def test_code_moe_tiny_matches_readme(code_moe_tiny):
    with open_gguf(code_moe_tiny) as m:
        c = m.config
        assert (c.arch, c.n_embd, c.n_layer) == ("qwen3moe", 384, 8)
        assert (c.n_expert, c.n_expert_used, c.expert_ff) == (16, 4, 256)
        assert (c.n_head, c.n_head_kv, c.head_dim, c.n_vocab, c.context_length) == (6, 2, 64, 8192, 1024)
        assert c.rope_freq_base == 1e6 and c.norm_eps == pytest.approx(1e-6) and c.rope_type == "neox"
        assert c.shared_expert_ff == 0 and not m.tied_output and m.unexpected_tensors == ()
        assert m.tensors["blk.0.ffn_gate_exps.weight"].shape == (16, 256, 384)
        assert m.tensors["blk.0.ffn_gate_exps.weight"].type_name == "Q8_0"
        assert m.tensors["blk.0.ffn_gate_inp.weight"].type_name == "F32"
        tok = m.tokenizer
        assert (tok.model, tok.pre, tok.n_tokens) == ("gpt2", "gpt-2", 8192)
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (0, 0, True)
        assert tok.tokens[0] == "<|endoftext|>" and len(tok.merges) == 7935 and tok.token_type[0] == 3
        assert os.path.getsize(code_moe_tiny) == 50_632_256


def test_corrupt_key_is_named_in_one_short_line(tmp_path, tiny):
    # the first key starts after magic, version, tensor count, kv count (4+4+8+8) and its u64 length
    src = tiny[0].read_bytes()
    assert src[32:32 + len("general.")] == b"general."
    msg = raises(GGUFError, patched(tmp_path, tiny[0], 34, b"\n"), "invalid key", "metadata entry 0")
    assert len(msg) < 300
    long_len = (10**6).to_bytes(8, "little")  # a key "length" that swallows the token list
    msg = raises(GGUFError, patched(tmp_path, tiny[0], 24, long_len))
    assert len(msg) < 300


def test_value_length_defaults_to_n_embd_over_n_head_as_llama_cpp():
    """llama.cpp (llama-model.cpp, load_hparams) defaults both attention.key_length and
    attention.value_length to n_embd / n_head, each on its own: a file giving key_length alone keeps
    value heads of n_embd / n_head (an earlier version took key_length for both)."""
    from moecache.arch import config_from_metadata

    md = {"general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.context_length": 128,
          "qwen3.embedding_length": 64, "qwen3.feed_forward_length": 96, "qwen3.attention.head_count": 4,
          "qwen3.attention.head_count_kv": 2, "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
          "qwen3.attention.key_length": 32}
    c = config_from_metadata(md, N_VOCAB)
    assert c.head_dim == 32 and c.head_dim_v == 16
    md["qwen3.attention.value_length"] = 8
    assert config_from_metadata(md, N_VOCAB).head_dim_v == 8
