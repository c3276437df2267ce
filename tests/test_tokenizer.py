"""moecache.tokenizer against llama.cpp's token ids.

Reference ids: tests/data/llamacpp/tokenize_*.json (llama-tokenize b11434, see its README), and a
few more recorded the same way and written here where used.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from moecache.errors import GGUFError
from moecache.gguf_file import TokenizerInfo, open_gguf
from moecache.testing.synth import SynthConfig, write_model
from moecache.tokenizer import BYTE, CONTROL, Tokenizer, gpt2_byte_chars

DATA = Path(__file__).parent / "data" / "llamacpp"
REFS = {name: json.loads((DATA / f"tokenize_{name}.json").read_text())["cases"]
        for name in ("gemma3-270m", "code-moe-tiny")}

_TOKS: dict[Path, Tokenizer] = {}


def _load(path: Path) -> Tokenizer:
    """One Tokenizer per file for the whole session (gemma3's takes ~2 s to build)."""
    if path not in _TOKS:
        _TOKS[path] = Tokenizer.from_gguf(open_gguf(path))
    return _TOKS[path]


@pytest.fixture
def gemma(gemma3_270m: Path) -> Tokenizer:
    return _load(gemma3_270m)


@pytest.fixture
def cmt(code_moe_tiny: Path) -> Tokenizer:
    return _load(code_moe_tiny)


@pytest.fixture(scope="module")
def synth_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_model(p, SynthConfig())
    return p


@pytest.fixture
def synth(synth_path: Path) -> Tokenizer:
    return _load(synth_path)


def _cases(name: str) -> list:
    return [pytest.param(c, id=f"{i}-{'bos' if c['add_bos'] else 'nobos'}-{'sp' if c['parse_special'] else 'nosp'}")
            for i, c in enumerate(REFS[name])]


# ---- llama.cpp reference ids -------------------------------------------------------------------

@pytest.mark.parametrize("case", _cases("gemma3-270m"))
def test_gemma3_matches_llamacpp(gemma: Tokenizer, case: dict) -> None:
    assert gemma.encode(case["text"], add_bos=case["add_bos"], parse_special=case["parse_special"]) == case["ids"]


@pytest.mark.parametrize("case", _cases("code-moe-tiny"))
def test_code_moe_tiny_matches_llamacpp(cmt: Tokenizer, case: dict) -> None:
    assert cmt.encode(case["text"], add_bos=case["add_bos"], parse_special=case["parse_special"]) == case["ids"]


@pytest.mark.parametrize("name", ["gemma3-270m", "code-moe-tiny"])
def test_reference_ids_decode_to_the_text(name: str, request: pytest.FixtureRequest) -> None:
    """Every reference id list decodes back to its text; BOS renders as its text unless skipped."""
    tok = request.getfixturevalue("gemma" if name.startswith("gemma") else "cmt")
    bos_text = tok.token_bytes(tok.bos_id).decode()
    for c in REFS[name]:
        assert tok.decode(c["ids"]) == bos_text * c["add_bos"] + c["text"], c
        if c["add_bos"] and c["parse_special"] and "<" not in c["text"]:
            assert tok.decode(c["ids"], skip_special=True) == c["text"], c


def test_text_that_is_not_unicode_is_a_value_error(cmt: Tokenizer) -> None:
    """A lone surrogate (undecodable bytes read with surrogateescape, a JSON "\\udc80" escape) is no
    text: ValueError naming where, not the tokenizers library's TypeError."""
    with pytest.raises(ValueError, match="lone surrogate '\\\\udc80' at character 2"):
        cmt.encode("ab\udc80c")
    assert cmt.encode("abc") == cmt.encode("abc")


def test_default_add_bos_is_the_models(gemma: Tokenizer, cmt: Tokenizer) -> None:
    assert gemma.add_bos and gemma.bos_id == 2 and gemma.eos_id == 1
    assert gemma.encode("Hello, world!") == [2, 9259, 236764, 1902, 236888]
    assert cmt.add_bos and cmt.bos_id == cmt.eos_id == 0
    assert cmt.encode("") == [0] and cmt.encode("", add_bos=False) == []


def test_gemma3_overrides_like_llamacpp(gemma: Tokenizer) -> None:
    """</s> (id 212) is user-defined in gemma3's GGUF; llama.cpp makes it CONTROL and end-of-generation
    (it is on its list of end markers), so --no-parse-special no longer cuts it out of the text.
    llama-tokenize: "x</s>y" -> [236781, 212, 236762]; with --no-parse-special
    [236781, 954, 236751, 236813, 236762]."""
    assert gemma.token_type[212] == CONTROL
    assert gemma.encode("x</s>y", add_bos=False) == [236781, 212, 236762]
    assert gemma.encode("x</s>y", add_bos=False, parse_special=False) == [236781, 954, 236751, 236813, 236762]


# ---- byte fallback, pieces, streaming ----------------------------------------------------------

SHAKING = "\U0001FAE8"  # 🫨 (Unicode 15): not in gemma3's vocabulary, 4 byte tokens


def test_gemma3_byte_fallback(gemma: Tokenizer) -> None:
    # llama-tokenize --no-bos 'shaking 🫨 face' -> [1179, 1557, 236743, 478, 397, 409, 406, 3392]
    ids = gemma.encode(f"shaking {SHAKING} face", add_bos=False)
    assert ids == [1179, 1557, 236743, 478, 397, 409, 406, 3392]
    assert [gemma.tokens[i] for i in ids[3:7]] == ["<0xF0>", "<0x9F>", "<0xAB>", "<0xA8>"]
    assert all(gemma.token_type[i] == BYTE for i in ids[3:7])
    assert b"".join(gemma.token_bytes(i) for i in ids[3:7]) == SHAKING.encode()
    assert gemma.decode(ids) == f"shaking {SHAKING} face"
    assert gemma.decode(ids[3:5]) == "\ufffd"  # half a character: replaced, as bytes.decode(errors="replace")


def test_streamer_holds_partial_utf8(gemma: Tokenizer) -> None:
    ids = gemma.encode(f"shaking {SHAKING} face", add_bos=False)
    s = gemma.streamer()
    out = [s.push(i) for i in ids]
    assert out == ["sh", "aking", " ", "", "", "", SHAKING, " face"]
    assert s.flush() == ""
    s = gemma.streamer()
    assert s.push(ids[3]) == "" and s.push(ids[4]) == ""
    assert s.flush() == "\ufffd"  # an unfinished character at the end
    assert s.push(gemma.tokens.index("<0x80>")) == "\ufffd"  # a lone continuation byte, after flush


def test_streamer_equals_decode(gemma: Tokenizer, cmt: Tokenizer) -> None:
    text = "Ünïcödé 你好 emoji 😀👍🏽 👨\u200d👩\u200d👧 ❤️ and 🫨\n\tdef f(): return 1"
    for tok in (gemma, cmt):
        ids = tok.encode(text)
        for skip in (False, True):
            s = tok.streamer(skip_special=skip)
            assert "".join(s.push(i) for i in ids) + s.flush() == tok.decode(ids, skip_special=skip)


def test_token_bytes(gemma: Tokenizer, cmt: Tokenizer) -> None:
    assert gemma.token_bytes(105) == b"<start_of_turn>"  # control: its text
    assert gemma.token_bytes(107) == b"\n"  # user-defined
    assert gemma.token_bytes(gemma.tokens.index("<0xE2>")) == b"\xe2"
    assert gemma.token_bytes(gemma.tokens.index("\u2581world")) == b" world"
    assert cmt.token_bytes(0) == b"<|endoftext|>"
    space, newline = gpt2_byte_chars()[ord(" ")], gpt2_byte_chars()[ord("\n")]
    assert (space, newline) == ("\u0120", "\u010a")  # Ġ, Ċ
    for text in (space + "def", newline):
        assert cmt.token_bytes(cmt.tokens.index(text)) == text.replace(space, " ").replace(newline, "\n").encode()
    with pytest.raises(ValueError, match="out of range"):
        gemma.token_bytes(gemma.n_vocab)
    with pytest.raises(ValueError, match="out of range"):
        cmt.decode([1, -1])


def test_skip_special_keeps_user_defined(gemma: Tokenizer) -> None:
    ids = gemma.encode("<start_of_turn>user\nHi<end_of_turn>\n")
    assert ids == [2, 105, 2364, 107, 10979, 106, 107]
    assert gemma.decode(ids, skip_special=True) == "user\nHi\n"


# ---- end of generation -------------------------------------------------------------------------

def test_eog(gemma: Tokenizer, cmt: Tokenizer, synth: Tokenizer) -> None:
    # gemma3: <eos>, <end_of_turn>, and </s> (see test_gemma3_overrides_like_llamacpp)
    assert gemma.eog_ids == {1, 106, 212}
    assert gemma.is_eog(106) and gemma.is_eog(1) and not gemma.is_eog(2) and not gemma.is_eog(105)
    assert cmt.eog_ids == {0}
    assert synth.eog_ids == {2} and synth.is_eog(2) and not synth.is_eog(1)


# ---- the synthetic SPM vocabulary (with a space prefix) ----------------------------------------

def test_synth_matches_llamacpp(synth: Tokenizer) -> None:
    # llama-tokenize on `python -m moecache.testing.synth --preset tiny` (the same 300-token vocabulary)
    assert synth.add_space_prefix and synth.add_bos
    assert synth.encode("Hello world") == [1, 259, 75, 104, 111, 111, 114, 259, 122, 114, 117, 111, 103]
    assert synth.encode(" the  of") == [1, 259, 259, 119, 107, 104, 259, 259, 114, 105]
    assert synth.encode("é😀") == [1, 259, 198, 172, 243, 162, 155, 131]


@pytest.mark.parametrize("text", ["Hello world", " the school was good", "x", "a  b\tc\nd ", "  ", "",
                                  "QUIZ: 1+2=3? {ok} [yes] (no) ~!@#$%^&*_|\\/'\"`", "no\n\nnewline at end\n"])
def test_synth_round_trip(synth: Tokenizer, text: str) -> None:
    ids = synth.encode(text)
    assert ids[0] == synth.bos_id
    assert synth.decode(ids, skip_special=True) == text
    assert synth.decode(synth.encode(text, add_bos=False)) == text


def test_synth_unicode_falls_back_to_bytes(synth: Tokenizer) -> None:
    ids = synth.encode("é😀", add_bos=False)
    assert all(synth.token_type[i] == BYTE for i in ids[1:])
    assert synth.decode(ids) == "é😀"
    s = synth.streamer()
    assert [s.push(i) for i in ids] == [" ", "", "é", "", "", "", "😀"]  # " ": the space prefix, kept


# ---- other pre-tokenizers, with code-moe-tiny's vocabulary -------------------------------------

class _Meta(dict):
    """Stand-in for gguf_file.Metadata (what TokenizerInfo and from_gguf use of it)."""

    def array_len(self, key: str) -> int | None:
        v = self.get(key)
        return len(v) if isinstance(v, (list, np.ndarray)) else None


def _fake_model(md: dict, arch: str = "qwen3moe") -> SimpleNamespace:
    meta = _Meta(md)
    return SimpleNamespace(path=Path("fake.gguf"), arch=arch, metadata=meta, tokenizer=TokenizerInfo(meta))


@pytest.fixture
def cmt_meta(code_moe_tiny: Path) -> dict:
    md = open_gguf(code_moe_tiny).metadata
    return {k: md[k] for k in md if k.startswith("tokenizer.")}


# llama-tokenize --no-bos on copies of code-moe-tiny.gguf with only tokenizer.ggml.pre changed
PRE_REFS = {
    "gpt-2": {"year 2024: 1234567 items": [3277, 453, 1339, 20, 26, 1386, 1856, 23, 2327],
              "a\n\n\nb\r\n c  ": [65, 586, 199, 66, 202, 199, 287, 257],
              "日本語123": [163, 246, 99, 163, 251, 106, 165, 104, 253, 2196]},
    "qwen2": {"year 2024: 1234567 items": [3277, 221, 18, 16, 18, 20, 26, 221, 17, 18, 19, 20, 21, 22, 23, 2327],
              "a\n\n\nb\r\n c  ": [65, 7378, 66, 202, 199, 287, 257],
              "日本語123": [163, 246, 99, 163, 251, 106, 165, 104, 253, 17, 18, 19]},
    "llama-bpe": {"year 2024: 1234567 items": [3277, 221, 1009, 18, 20, 26, 221, 2196, 5858, 23, 2327],
                  "a\n\n\nb\r\n c  ": [65, 7378, 66, 202, 199, 287, 257],
                  "x!!\n\n  y": [88, 1, 1, 586, 221, 656]},
}


@pytest.mark.parametrize("pre", sorted(PRE_REFS))
def test_bpe_pre_tokenizers(cmt_meta: dict, pre: str) -> None:
    tok = Tokenizer.from_gguf(_fake_model({**cmt_meta, "tokenizer.ggml.pre": pre}))
    for text, ids in PRE_REFS[pre].items():
        assert tok.encode(text, add_bos=False) == ids, text
        assert tok.decode(ids) == text


def test_add_bos_default_per_type(cmt_meta: dict) -> None:
    """Without tokenizer.ggml.add_bos_token: llama3-style BPE adds BOS, GPT-2 style does not."""
    md = {k: v for k, v in cmt_meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert not Tokenizer.from_gguf(_fake_model(md)).add_bos
    assert Tokenizer.from_gguf(_fake_model({**md, "tokenizer.ggml.pre": "llama-bpe"})).add_bos


# ---- bad inputs --------------------------------------------------------------------------------

def test_unsupported_tokenizer_model(cmt_meta: dict) -> None:
    with pytest.raises(GGUFError, match=r"fake\.gguf: unsupported tokenizer: tokenizer\.ggml\.model = 'bert'"):
        Tokenizer.from_gguf(_fake_model({**cmt_meta, "tokenizer.ggml.model": "bert"}))
    md = {k: v for k, v in cmt_meta.items() if k != "tokenizer.ggml.model"}
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.model is missing"):
        Tokenizer.from_gguf(_fake_model(md))


@pytest.mark.parametrize("pre", ["deepseek-llm", "default", None])
def test_unsupported_pre_tokenizer(cmt_meta: dict, pre: str | None) -> None:
    md = {**cmt_meta, "tokenizer.ggml.pre": pre}
    with pytest.raises(GGUFError, match=rf"tokenizer\.ggml\.pre = {pre!r} for tokenizer\.ggml\.model 'gpt2'"):
        Tokenizer.from_gguf(_fake_model(md))


def test_missing_vocabulary_and_merges(cmt_meta: dict) -> None:
    md = {k: v for k, v in cmt_meta.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.tokens is missing"):
        Tokenizer.from_gguf(_fake_model(md))
    md = {k: v for k, v in cmt_meta.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.merges is missing"):
        Tokenizer.from_gguf(_fake_model(md))
    md = {**cmt_meta, "tokenizer.ggml.token_type": cmt_meta["tokenizer.ggml.token_type"][:10]}
    with pytest.raises(GGUFError, match=r"token_type has 10 entries for 8192 tokens"):
        Tokenizer.from_gguf(_fake_model(md))


def test_no_bos_token(cmt_meta: dict) -> None:
    """A BPE vocabulary without a BOS key gets llama.cpp's default id 11; one that is too small
    for it has none, and asking for BOS is an error."""
    md = {k: v for k, v in cmt_meta.items() if k != "tokenizer.ggml.bos_token_id"}
    assert Tokenizer.from_gguf(_fake_model(md)).bos_id == 11
    small = {**md, "tokenizer.ggml.tokens": cmt_meta["tokenizer.ggml.tokens"][:11],
             "tokenizer.ggml.token_type": cmt_meta["tokenizer.ggml.token_type"][:11],
             "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": 0}
    tok = Tokenizer.from_gguf(_fake_model(small))
    assert tok.bos_id is None
    with pytest.raises(ValueError, match="no BOS token"):
        tok.encode("a")
    assert tok.encode("!", add_bos=False) == [1]
