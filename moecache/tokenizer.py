"""Text <-> token ids from a GGUF's ``tokenizer.*`` fields, giving the ids llama.cpp gives.

:meth:`Tokenizer.from_gguf` builds a Hugging Face ``tokenizers`` BPE model from the vocabulary
stored in the GGUF and wraps it in the parts of llama.cpp's tokenizer that are not BPE
(``src/llama-vocab.cpp``, build b11434):

1. Special-token partition (``tokenizer_st_partition``): the text of every CONTROL, UNKNOWN and
   USER_DEFINED token is cut out of the input before BPE sees it, longest texts first over the
   whole input. With ``parse_special=False`` only USER_DEFINED texts are cut out (gemma3 has
   user-defined tokens for runs of ``\\n``, ``\\t`` and spaces, and for HTML tags).
2. Each remaining fragment is tokenized on its own:

   - ``tokenizer.ggml.model = "llama"`` (SentencePiece-style, llama.cpp's SPM): a space is
     prepended when ``add_space_prefix`` holds (``tokenizer.ggml.add_space_prefix``; true when the
     key is absent, gemma3 says false), spaces become ``▁``, and adjacent symbols are merged,
     highest-scoring merged piece first, starting from single characters; characters that never
     form a token come out as byte tokens ``<0xXX>``. The ``tokenizers`` BPE model does this
     when its merge list is every ``(left, right)`` split of every token into two tokens, ranked
     by the score of the whole token (:func:`spm_merges`), with ``byte_fallback``.
   - ``"gpt2"`` (byte-level BPE): split by the pre-tokenizer regex of ``tokenizer.ggml.pre``
     (:data:`BPE_PRE`), bytes mapped to GPT-2's printable characters, then the GGUF's merges.

3. BOS/EOS are added as llama.cpp does for ``add_special``.

Decoding renders each token as llama.cpp's ``token_to_piece`` does (:meth:`Tokenizer.token_bytes`)
and joins the bytes; see :meth:`Tokenizer.decode` for the two deliberate differences.

Known divergences from llama.cpp, none seen in the reference data: when two different pieces
with equal scores could both be merged next, llama.cpp takes the leftmost and ``tokenizers`` the
lower id (gemma3's normal tokens all have distinct scores; two splits of one piece are never
pending at once, since the symbols inside a piece's span merge as they would in the piece alone);
a character missing from an SPM vocabulary is byte-encoded at once here, while llama.cpp would
still let it merge; the LSTRIP/RSTRIP attributes llama.cpp sets by model name (phi-3, jina,
modern-bert) are not applied.
"""

from __future__ import annotations

import codecs
import gc
from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from moecache.errors import GGUFError

if TYPE_CHECKING:
    from moecache.gguf_file import GGUFModel

# tokenizer.ggml.token_type values (gguf-py TokenType; llama.cpp LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # ▁, SentencePiece's visible space
_GROUP_CHARS = 4  # special texts are looked for in groups by their first characters

# ---- pre-tokenizers (llama-vocab.cpp llm_tokenizer_bpe, llama_vocab::impl::load) -------------

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split regex, ignore_merges, add_bos default), for tokenizer.ggml.model
# "gpt2". The names are those llama.cpp maps to its GPT2, LLAMA3 and QWEN2 pre-tokenizer types
# (the GPT2 regex is written with the trailing \s+ that llama.cpp's hand-written splitter has).
BPE_PRE: dict[str, tuple[str, bool, bool]] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "exaone4"), (_GPT2_RE, False, False)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2"), (_LLAMA3_RE, True, True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), (_LLAMA3_RE, False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"),
                    (_QWEN2_RE, False, False)),
}

# ---- special tokens recognised by their text (llama_vocab::impl::load) ------------------------

# Tokens that end generation. llama.cpp also forces the CONTROL type on them.
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
))
# End-of-turn / end-of-message candidates, used when tokenizer.ggml.eot/eom_token_id are absent.
EOT_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
))
EOM_TEXTS = frozenset(("<|eom_id|>",))
# Fill-in-the-middle tokens: llama.cpp forces CONTROL on all of them; PAD, REP and SEP also end
# generation. Each: (metadata key suffix, texts).
FIM_TEXTS: dict[str, tuple[frozenset[str], bool]] = {
    "fim_pre": (frozenset(("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                           "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")), False),
    "fim_suf": (frozenset(("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                           "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")), False),
    "fim_mid": (frozenset(("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                           "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>")), False),
    "fim_pad": (frozenset(("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")), True),
    "fim_rep": (frozenset(("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")), True),
    "fim_sep": (frozenset(("<|file_sep|>",)), True),
}
# gpt-oss: always rendered, never control (llama.cpp sets them USER_DEFINED).
_ALWAYS_USER_DEFINED = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))


def gpt2_byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the
    other 68 bytes take the characters U+0100, U+0101, ... in byte order (space -> ``Ġ``,
    ``\\n`` -> ``Ċ``).
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return out


_CHAR_TO_BYTE = {c: b for b, c in enumerate(gpt2_byte_chars())}


# ---- SentencePiece scores -> BPE merges --------------------------------------------------------

_HASH_MUL = np.uint64(0x100000001B3)  # FNV-1a 64-bit prime, used here as a polynomial base
_HASH_WIDTH = 64  # tokens up to this many characters take the vectorized path


def spm_merges(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges that make BPE tokenize like llama.cpp's SPM tokenizer.

    Args:
        tokens: the vocabulary, by id.
        scores: float32 ``(len(tokens),)``, higher merges first (``tokenizer.ggml.scores``).
        vocab: text -> id (the last id of a duplicated text, as in llama.cpp's ``token_to_id``).

    Returns every ``(left, right)`` with ``left``, ``right`` and ``left + right`` all in the
    vocabulary, best first: by the score of ``left + right`` (descending), then its id, then
    ``len(left)``. About 0.5 million merges for gemma3's 262144 tokens.

    Candidates are found with 64-bit polynomial hashes of all prefixes and suffixes (numpy),
    which must also agree in length; tokens longer than 64 characters or containing NUL are split
    in plain Python.
    """
    n = len(tokens)
    canon = np.fromiter((vocab[t] for t in tokens), np.int64, n) if len(vocab) != n else np.arange(n)
    lens = np.fromiter(map(len, tokens), np.int64, n)
    slow = lens > _HASH_WIDTH
    width = int(lens[~slow].max(initial=1))
    arr = np.array([t if not s else "" for t, s in zip(tokens, slow)], dtype=f"<U{width}")
    # numpy drops trailing NULs: such tokens (and any with NUL inside, to keep hashes honest) go slow
    slow |= np.char.str_len(arr) != lens
    codes = arr.view(np.uint32).reshape(n, width).astype(np.uint64) + np.uint64(1)
    prefix = np.zeros((n, width + 1), np.uint64)  # prefix[:, k] = hash(t[:k])
    for k in range(width):
        prefix[:, k + 1] = prefix[:, k] * _HASH_MUL + codes[:, k]
    pw = np.array([pow(int(_HASH_MUL), k, 1 << 64) for k in range(width + 1)], np.uint64)
    fast_lens = np.where(slow, 0, lens)
    full = prefix[np.arange(n), fast_lens]

    fast_ids = np.nonzero(~slow)[0]
    order = fast_ids[np.argsort(full[fast_ids], kind="stable")]
    table = full[order]

    def lookup(h: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(table, h).clip(0, len(table) - 1)
        return np.where(table[pos] == h, order[pos], -1)

    # Equal hashes: the same text twice (fine: ids go through ``canon``) or, with odds of about
    # 1e-9 for 262k tokens, two texts: then a lookup could miss a token, so split all in Python.
    same = np.nonzero(table[1:] == table[:-1])[0]
    if any(tokens[order[j]] != tokens[order[j + 1]] for j in same.tolist()):
        slow[:] = True
    ids, lefts, rights, ks = [], [], [], []
    for k in range(1, width):
        sel = np.nonzero(~slow & (lens > k))[0]
        right = lookup(full[sel] - prefix[sel, k] * pw[lens[sel] - k])
        hit = right >= 0
        sel, right = sel[hit], right[hit]
        left = lookup(prefix[sel, k])
        hit = left >= 0
        ids.append(sel[hit])
        lefts.append(left[hit])
        rights.append(right[hit])
        ks.append(np.full(int(hit.sum()), k))
    # slow path: long tokens, NULs, hash collisions
    get = vocab.get
    s_ids, s_l, s_r, s_k = [], [], [], []
    for i in np.nonzero(slow)[0].tolist():
        t = tokens[i]
        for k in range(1, len(t)):
            r = get(t[k:])
            if r is not None:
                li = get(t[:k])
                if li is not None:
                    s_ids.append(i), s_l.append(li), s_r.append(r), s_k.append(k)
    ids.append(np.array(s_ids, np.int64))
    lefts.append(np.array(s_l, np.int64))
    rights.append(np.array(s_r, np.int64))
    ks.append(np.array(s_k, np.int64))
    idx, lft, rgt, kk = (np.concatenate(a) for a in (ids, lefts, rights, ks))
    lft, rgt = canon[lft], canon[rgt]
    # the merged text's own id decides the score (llama.cpp looks the text up)
    tgt = canon[idx]
    keep = tgt == idx  # a duplicated text: keep the split once, for the id that wins the lookup
    idx, lft, rgt, kk = idx[keep], lft[keep], rgt[keep], kk[keep]
    # a hash match is also a length match; two 64-bit hashes of different texts of equal length
    # agreeing is a ~1e-14 event per lookup, so the pairs are not compared as strings
    good = (lens[lft] == kk) & (lens[rgt] == lens[idx] - kk)
    idx, lft, rgt, kk = idx[good], lft[good], rgt[good], kk[good]
    rank = np.lexsort((kk, idx, -scores[idx].astype(np.float64)))
    return list(zip([tokens[i] for i in lft[rank].tolist()], [tokens[i] for i in rgt[rank].tolist()]))


# ---- the tokenizer -----------------------------------------------------------------------------

class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get back only complete UTF-8 text.

    A character split over several byte tokens (an emoji as 4 ``<0xXX>`` tokens) comes out whole
    when its last byte arrives; invalid byte sequences become U+FFFD, as in
    :meth:`Tokenizer.decode`. Use :meth:`Tokenizer.streamer` to make one.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self._tok = tok
        self._skip = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        """Text completed by token ``id`` ('' while a multi-byte character is still partial)."""
        return self._dec.decode(self._tok._piece(id, self._skip))

    def flush(self) -> str:
        """Whatever is still buffered (an incomplete character becomes U+FFFD); resets the decoder."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


class Tokenizer:
    """A GGUF model's tokenizer. Build it with :meth:`from_gguf`.

    Attributes:
        n_vocab: number of tokens (``tokenizer.ggml.tokens``).
        bos_id, eos_id: ``tokenizer.ggml.bos_token_id`` / ``eos_token_id``, or llama.cpp's default
            for the tokenizer type when absent (SPM: 1 and 2; BPE: 11 and 11), None when out of range.
        eog_ids: ids that end generation, as llama.cpp's vocab loader computes them (eos, eot, eom,
            FIM pad/repo/file-separator, and tokens whose text is a known end marker:
            :data:`EOG_TEXTS`).
        add_bos: the model's default for adding BOS (``tokenizer.ggml.add_bos_token``; when absent:
            true for SPM and llama3-style BPE, false for other BPE).
        add_eos: the same for EOS (``tokenizer.ggml.add_eos_token``; default false).
        add_space_prefix: SPM only: a space is put before each text fragment
            (``tokenizer.ggml.add_space_prefix``; default true for SPM, false for BPE).
        model, pre: ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre``.
        tokens: the token texts, by id.
        token_type: int32 ``(n_vocab,)``, the GGUF's token types after llama.cpp's overrides
            (end markers and FIM tokens become CONTROL, ...).
    """

    def __init__(self, *, model: str, pre: str | None, tokens: list[str], token_type: np.ndarray,
                 hf: Any, bos_id: int | None, eos_id: int | None, eog_ids: Iterable[int], add_bos: bool,
                 add_eos: bool, add_space_prefix: bool):
        self.model = model
        self.pre = pre
        self.tokens = tokens
        self.token_type = token_type
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = frozenset(int(i) for i in eog_ids)
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.add_space_prefix = bool(add_space_prefix)
        self._hf = hf
        self._spm = model == "llama"
        self._pieces: dict[int, bytes] = {}
        # special-token partition table: longest text first (llama.cpp sorts by byte length)
        special = np.nonzero((token_type == CONTROL) | (token_type == UNKNOWN) | (token_type == USER_DEFINED))[0]
        entries = sorted(((tokens[i], int(i)) for i in special.tolist() if tokens[i]),
                         key=lambda e: (-len(e[0].encode("utf-8", "surrogateescape")), e[1]))
        self._special_rank: list[tuple[str, int, bool]] = [
            (t, i, int(token_type[i]) == USER_DEFINED) for t, i in entries]
        # grouped by their first 4 characters, so that a text without "<unu" skips 6241 <unusedN>
        self._special_groups: dict[str, list[int]] = {}
        for r, (t, _, _) in enumerate(self._special_rank):
            self._special_groups.setdefault(t[:_GROUP_CHARS], []).append(r)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, model: GGUFModel) -> Tokenizer:
        """Build the tokenizer of an opened GGUF (:func:`moecache.gguf_file.open_gguf`).

        Supported: ``tokenizer.ggml.model`` ``"llama"`` (any ``pre``: llama.cpp ignores it for
        SPM) and ``"gpt2"`` with a ``tokenizer.ggml.pre`` in :data:`BPE_PRE`.
        Raises GGUFError (naming the file and key) for another tokenizer model or pre-tokenizer,
        a missing or empty ``tokenizer.ggml.tokens``, missing merges (gpt2), or scores or token
        types shorter than the token list. Absent scores count as 0 and absent types as NORMAL, as
        in llama.cpp.
        Takes about 2 s for a 262k-token SPM vocabulary (gemma3), 0.1 s for small ones.
        """
        enabled = gc.isenabled()
        gc.disable()  # ~1M small tuples and strings are made: cyclic GC passes would cost ~0.5 s
        try:
            return cls._from_gguf(model)
        finally:
            if enabled:
                gc.enable()

    @classmethod
    def _from_gguf(cls, model: GGUFModel) -> Tokenizer:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        info, md, where = model.tokenizer, model.metadata, str(model.path)
        kind = info.model
        if kind is None:
            raise GGUFError(f"{where}: no tokenizer: tokenizer.ggml.model is missing")
        if kind not in ("llama", "gpt2"):
            raise GGUFError(f"{where}: unsupported tokenizer: tokenizer.ggml.model = {kind!r} "
                            f"(supported: 'llama' (SentencePiece), 'gpt2' (byte-level BPE))")
        pre = info.pre
        if kind == "gpt2" and pre not in BPE_PRE:
            raise GGUFError(f"{where}: unsupported pre-tokenizer: tokenizer.ggml.pre = {pre!r} for "
                            f"tokenizer.ggml.model 'gpt2' (supported: {', '.join(sorted(BPE_PRE))})")
        tokens = info.tokens
        if not tokens:
            raise GGUFError(f"{where}: tokenizer.ggml.tokens is missing or empty")
        if not isinstance(tokens, list):
            raise GGUFError(f"{where}: tokenizer.ggml.tokens is not an array of strings")
        n = len(tokens)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does
        ttype = info.token_type
        if ttype is None:
            ttype = np.full(n, NORMAL, np.int32)
        elif len(ttype) < n:
            raise GGUFError(f"{where}: tokenizer.ggml.token_type has {len(ttype)} entries for {n} tokens")
        ttype = np.asarray(ttype[:n], np.int32).copy()
        vocab = dict(zip(tokens, range(n)))  # a duplicated text maps to its last id, as in llama.cpp

        def key_id(name: str, default: int | None) -> int | None:
            if default is not None and not 0 <= default < n:
                default = None
            v = md.get(f"tokenizer.ggml.{name}")
            return int(v) if v is not None and 0 <= int(v) < n else default

        if kind == "llama":
            scores = info.scores
            if scores is None:
                scores = np.zeros(n, np.float32)
            elif len(scores) < n:
                raise GGUFError(f"{where}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            scores = np.asarray(scores[:n], np.float32)
            unk = key_id("unknown_token_id", 0)
            bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, vocab), byte_fallback=True,
                             unk_token=tokens[unk] if unk is not None else None, fuse_unk=False)
            hf = HFTokenizer(bpe)
            bos_default, eos_default = 1, 2
            add_bos_default, space_default = True, True
        else:
            regex, ignore_merges, add_bos_default = BPE_PRE[pre]
            raw = info.merges
            if raw is None:
                raise GGUFError(f"{where}: tokenizer.ggml.merges is missing (needed by tokenizer.ggml.model 'gpt2')")
            merges = []
            for m in raw:
                p = m.find(" ", 1)
                if p > 0:
                    a, b = m[:p], m[p + 1:]
                    if a in vocab and b in vocab and a + b in vocab:  # tokenizers rejects the rest
                        merges.append((a, b))
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
            hf = HFTokenizer(bpe)
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            bos_default = eos_default = 11
            space_default = False

        bos_id = key_id("bos_token_id", bos_default)
        eos_id = key_id("eos_token_id", eos_default)
        eot_id = key_id("eot_token_id", None)
        eom_id = key_id("eom_token_id", None)
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        add_eos = md.get("tokenizer.ggml.add_eos_token")
        space = md.get("tokenizer.ggml.add_space_prefix")
        eog = _eog_ids(tokens, ttype, md, key_id, eos_id, eot_id, eom_id)
        return cls(model=kind, pre=pre, tokens=tokens, token_type=ttype, hf=hf, bos_id=bos_id, eos_id=eos_id,
                   eog_ids=eog, add_bos=add_bos_default if add_bos is None else bool(add_bos),
                   add_eos=False if add_eos is None else bool(add_eos),
                   add_space_prefix=space_default if space is None or kind != "llama" else bool(space))

    # -- encoding ------------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split ``text`` into raw fragments (str) and special token ids (int), llama.cpp's way:
        for each special text, longest first, cut every occurrence out of every raw fragment."""
        ranks: list[int] = []
        for head, rs in self._special_groups.items():
            if head in text:
                ranks.extend(rs)
        parts: list[str | int] = [text]
        for r in sorted(ranks):
            st, sid, user_defined = self._special_rank[r]
            if not parse_special and not user_defined:
                continue
            if st not in text:
                continue
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or st not in p:
                    out.append(p)
                    continue
                for j, seg in enumerate(p.split(st)):
                    if j:
                        out.append(sid)
                    if seg:
                        out.append(seg)
            parts = out
        return parts

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, equal to llama.cpp's ``llama_tokenize``.

        Args:
            text: the text (any str).
            add_bos: None: the model's defaults (llama.cpp ``add_special=true``: BOS if
                :attr:`add_bos`, EOS if :attr:`add_eos`); True: BOS always (EOS as the model says);
                False: neither (llama.cpp ``add_special=false``, ``llama-tokenize --no-bos``).
            parse_special: text of control tokens (``<start_of_turn>``, ``<|im_end|>``) becomes those
                tokens; when False it is tokenized as plain text. Text of user-defined tokens is
                always matched, as in llama.cpp.

        Returns a list of ids in ``[0, n_vocab)``. Raises ValueError if BOS is wanted and the
        model has none, or if ``text`` is not Unicode text (a lone UTF-16 surrogate, as undecodable
        bytes read with ``surrogateescape`` or a ``"\\udc80"`` JSON escape give).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text is not valid Unicode: a lone surrogate {e.object[e.start:e.end]!a} at "
                             f"character {e.start}") from None
        ids: list[int] = []
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos:
            if self.bos_id is None:
                raise ValueError("this model has no BOS token (tokenizer.ggml.bos_token_id)")
            ids.append(self.bos_id)
        parts = self._partition(text, parse_special) if text else []
        for p in parts:
            if isinstance(p, int):
                ids.append(p)
            elif self._spm:  # no pre-tokenizer: the BPE model takes the fragment whole
                frag = (SPACE_MARK if self.add_space_prefix else "") + p.replace(" ", SPACE_MARK)
                ids.extend(t.id for t in self._hf.model.tokenize(frag))
            else:
                ids.extend(self._hf.encode(p, add_special_tokens=False).ids)
        if add_bos is not False and self.add_eos:
            if self.eos_id is None:
                raise ValueError("this model has no EOS token (tokenizer.ggml.eos_token_id)")
            ids.append(self.eos_id)
        return ids

    # -- decoding ------------------------------------------------------------------------------

    def _check(self, id: int) -> int:
        id = int(id)
        if not 0 <= id < self.n_vocab:
            raise ValueError(f"token id {id} is out of range [0, {self.n_vocab})")
        return id

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of any token's text (at least 1): a text of N bytes is at least
        N / this many tokens, a bound known before tokenizing it."""
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self.tokens), default=1) or 1

    def token_bytes(self, id: int) -> bytes:
        """The bytes of token ``id`` as llama.cpp's ``token_to_piece(special=true)`` renders them.

        Control, unknown and user-defined tokens: their text. SPM normal tokens: the text with
        ``▁`` as space. BPE normal tokens: GPT-2 characters mapped back to bytes (a character
        outside that alphabet gives its own UTF-8; llama.cpp writes ``[UNK_BYTE_..]`` there). Byte
        tokens: the one byte. Unused and undefined types: empty. Raises ValueError when ``id``
        is out of range.
        """
        return self._piece(self._check(id), False)

    def _piece(self, id: int, skip_special: bool) -> bytes:
        id = int(id)
        b = self._pieces.get(id)
        if b is None:
            b = self._render(self._check(id))
            self._pieces[id] = b
        if skip_special and self.token_type[id] in (CONTROL, UNKNOWN):
            return b""
        return b

    def _render(self, id: int) -> bytes:
        t, ty = self.tokens[id], int(self.token_type[id])
        if ty in (CONTROL, UNKNOWN, USER_DEFINED):
            return t.encode("utf-8", "surrogateescape")
        if ty == NORMAL:
            if self._spm:
                return t.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape")
            return b"".join(bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode("utf-8", "surrogateescape")
                            for c in t)
        if ty == BYTE:
            if len(t) == 6 and t.startswith("<0x"):
                return bytes((int(t[3:5], 16),))
            return t.encode("utf-8", "surrogateescape")  # BPE byte-typed tokens: llama.cpp reads <0xXX> too
        return b""

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``: the pieces of :meth:`token_bytes` joined, decoded as UTF-8 (invalid
        bytes -> U+FFFD).

        ``skip_special`` leaves out control and unknown tokens (BOS, ``<end_of_turn>``; user-defined
        ones stay). When the vocabulary adds a space prefix (SPM with ``add_space_prefix``), one
        leading space is dropped from the first piece after any leading BOS, so that
        ``decode(encode(x), skip_special=True) == x``; llama.cpp's ``llama_detokenize`` keeps the
        space when a BOS comes first, and also applies ``clean_up_tokenization_spaces`` for some
        BPE vocabularies: neither is done here, so decode equals the concatenated stream.
        Raises ValueError for an out-of-range id.
        """
        out: list[bytes] = []
        strip = self.add_space_prefix
        for n, i in enumerate(ids):
            i = self._check(i)
            b = self._piece(i, skip_special)
            if strip:
                if n == 0 and i == self.bos_id:
                    out.append(b)
                    continue
                if b.startswith(b" "):
                    b = b[1:]
                strip = False
            out.append(b)
        return b"".join(out).decode("utf-8", errors="replace")

    def streamer(self, skip_special: bool = False) -> StreamDecoder:
        """A :class:`StreamDecoder` for generated ids (no leading-space stripping)."""
        return StreamDecoder(self, skip_special)

    def is_eog(self, id: int) -> bool:
        """True if ``id`` ends generation (:attr:`eog_ids`)."""
        return int(id) in self.eog_ids

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, bos={self.bos_id}, "
                f"eos={self.eos_id}, eog={sorted(self.eog_ids)}, add_bos={self.add_bos})")


def _eog_ids(tokens: list[str], ttype: np.ndarray, md: Any, key_id: Any, eos_id: int | None,
             eot_id: int | None, eom_id: int | None) -> set[int]:
    """End-of-generation ids as llama.cpp's vocab loader computes them; updates ``ttype`` in place
    with its type overrides (end markers and FIM tokens become CONTROL, gpt-oss's channel tokens
    USER_DEFINED). Where llama.cpp picks one of several matching texts by hash-map order, the
    lowest id is taken here."""
    by_text: dict[str, int] = {}
    names = EOG_TEXTS | EOT_TEXTS | EOM_TEXTS | _ALWAYS_USER_DEFINED
    for _, (texts, _) in FIM_TEXTS.items():
        names = names | texts
    for i, t in enumerate(tokens):
        if t in names and t not in by_text:
            by_text[t] = i

    def force_control(i: int) -> None:
        if ttype[i] != CONTROL:
            ttype[i] = CONTROL

    def first(texts: frozenset[str]) -> int | None:
        hits = [by_text[t] for t in texts if t in by_text]
        return min(hits) if hits else None

    if eot_id is None and (eot_id := first(EOT_TEXTS)) is not None:
        force_control(eot_id)
    if eom_id is None and (eom_id := first(EOM_TEXTS)) is not None:
        force_control(eom_id)
    eog: set[int] = set()
    for name, (texts, ends) in FIM_TEXTS.items():
        fid = key_id(f"{name}_token_id", None)
        if fid is None and (fid := first(texts)) is not None:
            force_control(fid)
        if ends and fid is not None:
            eog.add(fid)
    for t in EOG_TEXTS:
        if t in by_text:
            eog.add(by_text[t])
            force_control(by_text[t])
    for t in _ALWAYS_USER_DEFINED:
        if t in by_text:
            ttype[by_text[t]] = USER_DEFINED
    eog.update(i for i in (eos_id, eot_id, eom_id) if i is not None)
    texts = {tokens[i]: i for i in eog}
    # gpt-oss / solar-open: <|end|> is not an end there
    if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                               or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
        eog.discard(texts["<|end|>"])
        ttype[texts["<|end|>"]] = USER_DEFINED
    # gemma4 / plamo2: </s> is an ordinary token there
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        ttype[texts["</s>"]] = NORMAL
    return eog
