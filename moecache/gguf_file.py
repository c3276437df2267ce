"""Open a GGUF model: hyperparameters, metadata, tokenizer fields and memory-mapped tensor views.

``open_gguf(path)`` reads the header with gguf-py's ``GGUFReader`` (the file is memory-mapped,
never read into RAM), checks it, and returns a :class:`GGUFModel`:

- ``config``: a :class:`moecache.arch.ModelConfig` built from the ``{arch}.*`` keys;
- ``metadata``: every key/value pair, arrays decoded only when asked for (a tokenizer's token
  list can have 150k entries);
- ``tokenizer``: the ``tokenizer.*`` fields by name;
- ``tensors``: name -> :class:`TensorView`, a uint8 view of each tensor's bytes in the mapping.

Split models (``name-00001-of-00003.gguf``, keys ``split.no``/``split.count``/
``split.tensors.count``, written by llama.cpp's ``gguf-split`` and gguf-py's ``GGUFWriter``) open
as one model from any shard's path; metadata comes from the first shard, as in llama.cpp.

Every problem raises one exception with a one-line message naming the file and the culprit:
:class:`~moecache.errors.GGUFError` (missing, foreign, truncated, misaligned or inconsistent file),
:class:`~moecache.errors.UnsupportedArchError` (``general.architecture`` not in
:data:`moecache.arch.ARCHS`) and :class:`~moecache.errors.UnsupportedQuantError` (a tensor type
without a kernel, from :func:`moecache.quants.formats.format_for`).

Format reference: ggml ``docs/gguf.md``; gguf-py ``gguf/gguf_reader.py``.
"""

from __future__ import annotations

import logging
import math
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from moecache.arch import ModelConfig, config_from_metadata, expected_tensors
from moecache.errors import GGUFError, MoecacheError, NonFiniteError, UnsupportedQuantError
from moecache.quants.formats import BlockFormat, format_for

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
# llama.cpp llama_split_path(): "%s-%05d-of-%05d.gguf"
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# GGUF scalar value types as little-endian numpy dtypes (big-endian files are rejected up front).
_NP_DTYPE: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("?"),
}

# gguf-py signals malformed input with these (short reads surface as IndexError/ValueError).
_PARSE_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, struct.error, UnicodeDecodeError)


@dataclass(frozen=True, eq=False)
class TensorView:
    """One tensor of a GGUF file, as bytes in the memory mapping (no copy).

    Attributes:
        name: GGUF tensor name (``blk.0.ffn_gate_exps.weight``).
        ggml_type: GGML type id (``GGMLQuantizationType`` value); the kernel id of
            :data:`moecache.quants.formats.BY_TYPE`.
        shape: logical shape in numpy order, outermost first, in elements (the reverse of ggml's
            ``ne``): ``ffn_gate_exps`` is ``(n_expert, expert_ff, n_embd)``.
        n_bytes: bytes of the tensor data.
        data: read-only uint8 array of shape ``(*shape[:-1], row_bytes)`` for every type, F32/F16/
            BF16 included (raw little-endian bytes); ``data[e]`` of an ``*_exps`` tensor is one
            contiguous expert. A view of the file mapping.
        file: index of the shard holding it in :attr:`GGUFModel.paths` (0 for a single file).
        offset: absolute byte offset of the data in that file.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray = field(repr=False)
    file: int = 0
    offset: int = 0

    @property
    def format(self) -> BlockFormat:
        """The block format of :attr:`ggml_type`."""
        return format_for(self.ggml_type, self.name)

    @property
    def type_name(self) -> str:
        """GGML type name (``"Q8_0"``)."""
        return self.format.name

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (``shape[-1]`` elements)."""
        return int(self.data.shape[-1])

    @property
    def n_rows(self) -> int:
        """Number of rows: the product of all but the last dimension."""
        return math.prod(self.shape[:-1])


# Keys are short dotted ASCII names (ggml docs/gguf.md); a longer or unprintable one means a
# corrupt header, and echoing it would flood the one-line error.
MAX_KEY_BYTES = 256
# llama.cpp ggml.h GGML_MAX_NAME: a tensor name has fewer bytes than this (gguf.cpp refuses longer ones).
GGML_MAX_NAME = 64
# Arrays of arrays may nest this deep (llama.cpp refuses nested arrays altogether; gguf-py reads any
# depth, recursively, and a 5000-deep key overflows Python's stack).
MAX_ARRAY_DEPTH = 16
# The fewest bytes an array item of each type takes: a string is at least its u64 length, an array
# at least its u32 item type and u64 count.
_MIN_ITEM_BYTES: dict[GGUFValueType, int] = {
    **{t: d.itemsize for t, d in _NP_DTYPE.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}


def _short(text: str, limit: int = 60) -> str:
    """repr() of ``text``, cut to ``limit`` characters, for error messages."""
    r = repr(text)
    return r if len(r) <= limit else r[:limit - 3] + "..."


@dataclass(frozen=True)
class _ArraySpan:
    """Where an array value's elements lie in the file (parsed lazily; ``item_type`` ARRAY for
    arrays of arrays, whose items are each a u32 type, a u64 count and the items)."""

    offset: int  # first element
    count: int
    item_type: GGUFValueType
    end: int     # one past the last element's last byte


class _Reader(gguf.GGUFReader):
    """gguf-py's reader with four hooks; the work of each is bounded by the file's size.

    ``_get``: a read past the end of the file raises a GGUFError saying what was being read
    (gguf-py slices the mapping unchecked, and a short read surfaces later as an unrelated
    IndexError or "When changing to a larger dtype..." ValueError); so a key/value or tensor count
    larger than the file holds stops at the first entry past its end. ``_build_fields``: array
    values are not split into one numpy view per element (gguf-py spends ~100 us per element,
    about 30 s for a 150k-token vocabulary with its merges); their location is recorded in
    :attr:`arrays` and :class:`Metadata` decodes them on demand. An array's element count is
    checked against the bytes left before any element is read (each takes at least
    :data:`_MIN_ITEM_BYTES`), and arrays of arrays nest at most :data:`MAX_ARRAY_DEPTH` deep
    (gguf-py recurses without a bound: RecursionError at ~1000 levels, and 2^40 inner arrays took
    minutes and gigabytes before failing). ``_build_tensor_info``: keeps track of which tensor info
    is being read, and bounds the name length and the dimension count before gguf-py slices them.
    ``_build_tensors``: tensor infos are checked (dimensions, type, row length, alignment, data
    offsets back to back as llama.cpp requires, bounds) before gguf-py builds views, which
    otherwise fails with "cannot reshape array" on a truncated file and "is not a valid
    GGMLQuantizationType" on an unknown type, naming no tensor, and accepts overlapping tensors.
    """

    def __init__(self, path: Path):
        self.path = path
        self.arrays: dict[str, _ArraySpan] = {}
        self._where = "the fixed header (magic, version, tensor and key counts)"
        super().__init__(path, "r")

    def _truncated(self, what: str, end: int) -> GGUFError:
        return GGUFError(f"{self.path}: header is truncated: {what} needs bytes up to {end}, "
                         f"the file has {len(self.data)}")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        dt = np.dtype(dtype)
        offset, count = int(offset), int(count)
        end = offset + dt.itemsize * count
        if end > len(self.data):
            raise self._truncated(self._where, end)
        if override_order is not None or self.byte_order != "I":
            return super()._get(offset, dt, count, override_order)
        # a plain ndarray view of the mapping: numpy.memmap views (gguf-py's) cost ~10x the time and
        # memory each, and a header of many small entries makes several per entry
        flat = self.__dict__.get("_flat")
        if flat is None:
            flat = self._flat = self.data.view(np.ndarray)
        return flat[offset:end].view(dt)

    def _build_fields(self, offs: int, count: int) -> int:
        for i in range(int(count)):
            orig = offs
            self._where = f"metadata entry {i} of {count}"
            klen, kdata = self._get_str(offs)
            key = str(bytes(kdata), "utf-8", "replace")
            if not 0 < len(kdata) <= MAX_KEY_BYTES or not key.isprintable():
                raise GGUFError(f"{self.path}: corrupt header: metadata entry {i} of {count} has an invalid key "
                                f"({len(kdata)} bytes: {_short(key)})")
            self._where = f"metadata key '{key}'"
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += 4
            vtype = self._value_type(int(raw_type[0]), key)
            head = [klen, kdata, raw_type]
            if vtype == GGUFValueType.ARRAY:  # record the span, parse nothing (Metadata decodes on demand)
                itype_a, alen_a = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
                itype, n = self._value_type(int(itype_a[0]), key), int(alen_a[0])
                start = offs + 12
                end = self._skip_items(start, itype, n, key, 1)
                self.arrays[key] = _ArraySpan(start, n, itype, end)
                self._push_field(gguf.ReaderField(orig, key, head + [itype_a, alen_a], [], [vtype, itype]),
                                 skip_sum=True)
                offs = end
                continue
            fsize, parts, idxs, types = self._get_field_parts(offs, vtype)
            self._push_field(gguf.ReaderField(orig, key, head + parts, [j + len(head) for j in idxs], types),
                             skip_sum=True)
            offs += fsize
        return offs

    def _skip_items(self, o: int, itype: GGUFValueType, n: int, key: str, depth: int) -> int:
        """Offset past ``n`` array items of type ``itype`` starting at ``o``, without building them.

        The work is bounded by the file: ``n`` items need at least ``n`` times the item's smallest
        encoding (:data:`_MIN_ITEM_BYTES`) before the end of the file, checked before any item is
        read, and arrays nest at most :data:`MAX_ARRAY_DEPTH` deep. Raises GGUFError otherwise.
        """
        size = len(self.data)
        if depth > MAX_ARRAY_DEPTH:
            raise GGUFError(f"{self.path}: corrupt header: metadata key '{key}' nests arrays more than "
                            f"{MAX_ARRAY_DEPTH} deep")
        least = n * _MIN_ITEM_BYTES[itype]
        if least > size - o:
            raise GGUFError(f"{self.path}: header is truncated: the {n}-element array '{key}' needs at least "
                            f"{least} bytes at offset {o}, the file has {max(0, size - o)} left")
        if itype in _NP_DTYPE:
            return o + n * _NP_DTYPE[itype].itemsize
        if itype == GGUFValueType.STRING:
            end = self._skip_strings(o, n)
            if end is None or end > size:
                raise GGUFError(f"{self.path}: header is truncated: the {n}-element array '{key}' "
                                f"runs past the end of the file ({size} bytes)")
            return end
        unpack = struct.unpack_from  # arrays of arrays: each item is (u32 type, u64 count, items)
        with memoryview(self.data) as mv:
            for _ in range(n):
                if o + 12 > size:
                    raise GGUFError(f"{self.path}: header is truncated: the {n}-element array '{key}' "
                                    f"runs past the end of the file ({size} bytes)")
                raw, m = unpack("<IQ", mv, o)
                o = self._skip_items(o + 12, self._value_type(raw, key), m, key, depth + 1)
        return o

    def _value_type(self, raw: int, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{self.path}: metadata key '{key}' has unknown value type {raw} "
                            f"(corrupt header?)") from None

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list]:
        fields: list = []
        unpack = struct.unpack_from
        for i in range(int(count)):
            after = f" (after '{fields[-1].name}')" if fields else ""
            self._where = f"tensor info {i} of {count}{after}"
            # name length and dimension count first: both bound what gguf-py would slice (llama.cpp
            # gguf.cpp refuses names of GGML_MAX_NAME bytes or more and more than GGML_MAX_DIMS dims)
            (n_name,) = unpack("<Q", self._get(offs, np.uint8, 8))
            if not 0 < n_name < GGML_MAX_NAME:
                raise GGUFError(f"{self.path}: corrupt header: tensor info {i} of {count}{after} has a name of "
                                f"{n_name} bytes (GGUF allows 1..{GGML_MAX_NAME - 1})")
            (nd,) = unpack("<I", self._get(offs + 8 + n_name, np.uint8, 4))
            if not 1 <= nd <= GGML_MAX_DIMS:
                name = str(bytes(self._get(offs + 8, np.uint8, n_name)), "utf-8", "replace")
                raise GGUFError(f"{self.path}: tensor '{name}' has {nd} dimensions (GGUF allows 1..{GGML_MAX_DIMS})")
            f = self._get_tensor_info_field(offs)
            offs += sum(int(p.nbytes) for p in f.parts)
            fields.append(f)
        self._where = "the header"
        return offs, fields

    def _skip_strings(self, o: int, n: int) -> int | None:
        """Offset past ``n`` GGUF strings (u64 length + bytes) starting at ``o``; None if past EOF."""
        size, unpack = len(self.data), struct.unpack_from
        with memoryview(self.data) as mv:
            for _ in range(n):
                if o + 8 > size:
                    return None
                o += 8 + unpack("<Q", mv, o)[0]
        return o

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        """Check every tensor info, then let gguf-py build the views.

        Rules (llama.cpp ``gguf.cpp``, ``gguf_init_from_file_impl``): 1..4 dimensions, each < 2^63
        and their product too; a known type whose block size divides the row length; data offsets
        (relative to the aligned data start) laid out back to back in tensor-info order, each equal to
        the running total of the tensors before it padded to ``general.alignment``, so no two
        tensors' bytes overlap; and every tensor inside the file. Raises GGUFError naming the tensor.
        """
        size = len(self.data)
        past_end = []
        expected = 0  # llama.cpp: ti.offset must equal the sum of the padded sizes before it
        align = int(self.alignment)  # a numpy uint32 from gguf-py
        for f in fields:
            _, name_data, n_dims, dims, raw_type, rel = f.parts
            name = str(bytes(name_data), "utf-8", "replace")
            nd = int(n_dims[0])
            if not 1 <= nd <= GGML_MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor '{name}' has {nd} dimensions (GGUF allows 1..{GGML_MAX_DIMS})")
            ne = [int(d) for d in dims]
            if any(d >= 2**63 for d in ne) or math.prod(ne) >= 2**63:
                raise GGUFError(f"{self.path}: tensor '{name}' has impossible dimensions {ne} (element count "
                                f"must be < 2^63)")
            fmt = format_for(int(raw_type[0]), name)
            if ne[0] % fmt.block_size:
                raise GGUFError(f"{self.path}: tensor '{name}': row length {ne[0]} is not a multiple of the "
                                f"{fmt.name} block size {fmt.block_size}")
            off = int(rel[0])
            if off % self.alignment:
                raise GGUFError(f"{self.path}: tensor '{name}' is misaligned: data offset {off} is not a "
                                f"multiple of general.alignment = {self.alignment}")
            n_bytes = math.prod(ne) // fmt.block_size * fmt.type_size
            if off != expected:
                how = "overlaps the tensor before it" if off < expected else "leaves a gap after the tensor before it"
                raise GGUFError(f"{self.path}: tensor '{name}' has data offset {off}, expected {expected}: its data "
                                f"{how} (tensor data must follow the tensor infos' order back to back, each padded "
                                f"to general.alignment = {self.alignment}, as llama.cpp requires)")
            expected += -(-n_bytes // align) * align
            begin = start_offs + off
            if begin + n_bytes > size:
                past_end.append((name, begin, n_bytes))
        if past_end:
            name, begin, n_bytes = past_end[0]
            more = f" ({len(past_end) - 1} more tensors also past the end)" if len(past_end) > 1 else ""
            raise GGUFError(f"{self.path}: file is truncated: tensor '{name}' needs {n_bytes} bytes at "
                            f"bytes {begin}..{begin + n_bytes} but the file has only {size} bytes "
                            f"({begin + n_bytes - size} missing){more}")
        super()._build_tensors(start_offs, fields)


def _open_reader(path: Path) -> _Reader:
    """Open one GGUF file, turning every failure into a one-line GGUFError/UnsupportedQuantError."""
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a file" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from e
    if not head:
        raise GGUFError(f"{path}: file is empty, not a GGUF file")
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (first 4 bytes are {head[:4]!r}, expected {GGUF_MAGIC!r})")
    if len(head) < 8:
        raise GGUFError(f"{path}: header is truncated: the file has only {len(head)} bytes")
    version = int.from_bytes(head[4:8], "little")
    if version and not version & 0xFFFF:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: unsupported GGUF version {version} "
                        f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    try:
        return _Reader(path)
    except UnsupportedQuantError as e:
        raise UnsupportedQuantError(f"{path}: {e}") from None
    except MoecacheError:
        raise
    except _PARSE_ERRORS as e:
        raise GGUFError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from e
    except OSError as e:
        raise GGUFError(f"{path}: cannot map the file: {e.strerror or e}") from e


class Metadata(Mapping[str, Any]):
    """The key/value pairs of a GGUF header, decoded on first access and cached.

    Values: ``int``/``float``/``bool``/``str`` for scalars; for arrays, ``list[str]`` (string
    arrays; invalid UTF-8 kept with ``surrogateescape``) or a 1-D ``np.ndarray`` of the element type
    (numeric and bool arrays, e.g. ``tokenizer.ggml.token_type`` int32, ``scores`` float32); arrays
    of arrays (which llama.cpp refuses) as nested lists.
    gguf-py's pseudo-keys (``GGUF.version``, ...) are not included.
    """

    def __init__(self, reader: _Reader):
        self._r = reader
        self._keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        self._cache: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key in self._cache:
            return self._cache[key]
        f = self._r.fields.get(key)
        if f is None or key.startswith("GGUF."):
            raise KeyError(key)
        span = self._r.arrays.get(key)
        if span is not None:
            v = self._decode_array(span)
        elif f.types[0] == GGUFValueType.STRING:
            v = str(bytes(f.parts[-1]), "utf-8", "surrogateescape")
        else:
            v = f.parts[-1].tolist()[0]
        self._cache[key] = v
        return v

    def __contains__(self, key: object) -> bool:  # without decoding the value
        return key in self._r.fields and isinstance(key, str) and not key.startswith("GGUF.")

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        items = []
        for k in self._keys:
            n = self.array_len(k)
            items.append(f"{k}=[{n} items]" if n is not None else f"{k}={self[k]!r}")
        return "Metadata(" + ", ".join(items) + ")"

    def array_len(self, key: str) -> int | None:
        """Element count of an array value without decoding it; None if absent or not an array."""
        span = self._r.arrays.get(key)
        if span is not None:
            return span.count
        return None

    def value_type(self, key: str) -> tuple[GGUFValueType, ...]:
        """GGUF value type of ``key``: ``(type,)``, or ``(ARRAY, element type)`` for arrays."""
        f = self._r.fields.get(key)
        if f is None:
            raise KeyError(key)
        return tuple(f.types)

    def _decode_array(self, s: _ArraySpan) -> Any:
        if s.item_type == GGUFValueType.ARRAY:  # arrays of arrays: nested lists (depth checked at open)
            return self._decode_nested(s.offset, s.count)[0]
        if s.item_type == GGUFValueType.STRING:
            raw = self._r.data[s.offset:s.end].tobytes()
            out, o, unpack = [], 0, struct.unpack_from
            for _ in range(s.count):
                n = unpack("<Q", raw, o)[0]
                out.append(str(raw[o + 8:o + 8 + n], "utf-8", "surrogateescape"))
                o += 8 + n
            return out
        return np.frombuffer(self._r.data, dtype=_NP_DTYPE[s.item_type], count=s.count, offset=s.offset).copy()

    def _decode_nested(self, o: int, n: int) -> tuple[list, int]:
        """``n`` array items starting at ``o`` (each: u32 type, u64 count, items) -> (lists, end offset)."""
        out = []
        for _ in range(n):
            raw, m = struct.unpack_from("<IQ", self._r.data, o)
            itype = GGUFValueType(raw)
            if itype == GGUFValueType.ARRAY:
                v, o = self._decode_nested(o + 12, m)
            else:
                end = self._r._skip_items(o + 12, itype, m, "", 2)
                v = self._decode_array(_ArraySpan(o + 12, m, itype, end))
                v = v.tolist() if isinstance(v, np.ndarray) else v
                o = end
            out.append(v)
        return out, o


class TokenizerInfo:
    """The ``tokenizer.*`` fields of a GGUF (llama.cpp ``llama-vocab.cpp`` reads the same keys).

    Lists are decoded on first access. Absent fields are None.
    """

    def __init__(self, md: Metadata):
        self._md = md

    def _get(self, key: str) -> Any:
        return self._md.get(key)

    @property
    def model(self) -> str | None:
        """``tokenizer.ggml.model``: ``"gpt2"`` (byte-level BPE), ``"llama"`` (SentencePiece), ..."""
        return self._get("tokenizer.ggml.model")

    @property
    def pre(self) -> str | None:
        """``tokenizer.ggml.pre``: the pre-tokenizer (split regex) name, e.g. ``"qwen2"``."""
        return self._get("tokenizer.ggml.pre")

    @property
    def n_tokens(self) -> int:
        """Length of ``tokenizer.ggml.tokens`` (0 if absent), without decoding it."""
        return self._md.array_len("tokenizer.ggml.tokens") or 0

    @property
    def tokens(self) -> list[str] | None:
        """``tokenizer.ggml.tokens``: the token strings, by id."""
        return self._get("tokenizer.ggml.tokens")

    @property
    def scores(self) -> np.ndarray | None:
        """``tokenizer.ggml.scores``: float32 per token (SentencePiece merge priority)."""
        return self._get("tokenizer.ggml.scores")

    @property
    def token_type(self) -> np.ndarray | None:
        """``tokenizer.ggml.token_type``: int32 per token (1 normal, 2 unknown, 3 control,
        4 user-defined, 5 unused, 6 byte; gguf-py ``TokenType``)."""
        return self._get("tokenizer.ggml.token_type")

    @property
    def merges(self) -> list[str] | None:
        """``tokenizer.ggml.merges``: BPE merges as ``"left right"`` strings, by priority."""
        return self._get("tokenizer.ggml.merges")

    @property
    def bos_id(self) -> int | None:
        """``tokenizer.ggml.bos_token_id``."""
        return self._get("tokenizer.ggml.bos_token_id")

    @property
    def eos_id(self) -> int | None:
        """``tokenizer.ggml.eos_token_id``."""
        return self._get("tokenizer.ggml.eos_token_id")

    @property
    def eot_id(self) -> int | None:
        """``tokenizer.ggml.eot_token_id`` (end of turn)."""
        return self._get("tokenizer.ggml.eot_token_id")

    @property
    def eom_id(self) -> int | None:
        """``tokenizer.ggml.eom_token_id`` (end of message)."""
        return self._get("tokenizer.ggml.eom_token_id")

    @property
    def unk_id(self) -> int | None:
        """``tokenizer.ggml.unknown_token_id``."""
        return self._get("tokenizer.ggml.unknown_token_id")

    @property
    def pad_id(self) -> int | None:
        """``tokenizer.ggml.padding_token_id``."""
        return self._get("tokenizer.ggml.padding_token_id")

    @property
    def add_bos(self) -> bool | None:
        """``tokenizer.ggml.add_bos_token`` (None: not stated; the tokenizer type's default applies)."""
        return self._get("tokenizer.ggml.add_bos_token")

    @property
    def add_eos(self) -> bool | None:
        """``tokenizer.ggml.add_eos_token``."""
        return self._get("tokenizer.ggml.add_eos_token")

    @property
    def chat_template(self) -> str | None:
        """``tokenizer.chat_template`` (Jinja2 source)."""
        return self._get("tokenizer.chat_template")


class GGUFModel:
    """An opened GGUF model: one file, or every shard of a split one. Use :func:`open_gguf`.

    Attributes:
        path: the first shard (the file itself when not split).
        paths: every shard, in ``split.no`` order; :attr:`TensorView.file` indexes it.
        version: GGUF format version of the first shard.
        alignment: ``general.alignment`` (bytes; default 32).
        arch: ``general.architecture``.
        config: hyperparameters.
        metadata: key/value pairs of the first shard.
        tokenizer: the ``tokenizer.*`` fields.
        tensors: name -> TensorView, in file order.
        unexpected_tensors: names present in the file but not in the architecture's table
            (kept in :attr:`tensors`; llama.cpp would refuse some of them).

    Tensor views stay valid after :meth:`close` for as long as the caller holds them (the OS
    mapping is released when the last view is garbage-collected).
    """

    def __init__(self, paths: list[Path], readers: list[_Reader], metadata: Metadata, config: ModelConfig,
                 tensors: dict[str, TensorView], unexpected: tuple[str, ...]):
        self.path = paths[0]
        self.paths = tuple(paths)
        self._readers = readers
        self.version = int(readers[0].fields["GGUF.version"].parts[0][0])
        self.alignment = int(readers[0].alignment)
        self.metadata = metadata
        self.arch = config.arch
        self.config = config
        self.tokenizer = TokenizerInfo(metadata)
        self.tensors = tensors
        self.unexpected_tensors = unexpected

    @property
    def tied_output(self) -> bool:
        """True when ``output.weight`` is absent and the LM head reuses ``token_embd.weight``."""
        return "output.weight" not in self.tensors

    @property
    def n_bytes(self) -> int:
        """Total bytes of tensor data over all shards."""
        return sum(t.n_bytes for t in self.tensors.values())

    def close(self) -> None:
        """Drop this object's tensor views and readers (idempotent). The mapping itself is released
        when nothing references it any more: views a caller still holds, and :attr:`metadata`,
        keep it alive."""
        self.tensors = {}
        self._readers = []

    def __enter__(self) -> GGUFModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        moe = f", {c.n_expert} experts top-{c.n_expert_used}" if c.is_moe else ""
        return (f"GGUFModel({self.path.name}: {c.arch}, {c.n_layer} layers, n_embd {c.n_embd}{moe}, "
                f"{len(self.tensors)} tensors, {self.n_bytes / 2**20:.1f} MiB in {len(self.paths)} file(s))")


def _int_key(r: _Reader, key: str) -> int | None:
    f = r.fields.get(key)
    if f is None:
        return None
    if f.types[0] not in _NP_DTYPE or f.types[0] in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        raise GGUFError(f"{r.path}: key {key} must be an integer")
    return int(f.parts[-1][0])


def _shard_paths(path: Path, r: _Reader, count: int) -> list[Path]:
    m = _SHARD_RE.match(path.name)
    if m is None:
        raise GGUFError(f"{path}: shard {(_int_key(r, 'split.no') or 0) + 1} of a {count}-file split model, but "
                        f"its name does not follow <name>-00001-of-{count:05d}.gguf, so the other shards "
                        f"cannot be found")
    if int(m["count"]) != count:
        raise GGUFError(f"{path}: the name says {int(m['count'])} shards but split.count is {count}")
    return [path.with_name(f"{m['prefix']}-{i + 1:05d}-of-{count:05d}.gguf") for i in range(count)]


def _names(names: list[str], limit: int = 12) -> str:
    s = ", ".join(names[:limit])
    return s + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


_BLOCK_RE = re.compile(r"^blk\.(\d{1,9})\.")


def _check_block_count(path: Path, cfg: ModelConfig, tensors: Mapping[str, TensorView]) -> None:
    """``{arch}.block_count`` against the blocks the file holds (``blk.N.*`` tensors), before the
    expected tensor names are built for every claimed block (work proportional to the count). Every
    other size the config holds is checked through the expected tensor shapes. Raises GGUFError."""
    blocks = {int(m[1]) for n in tensors if (m := _BLOCK_RE.match(n))}  # distinct: blk.999999999 counts once
    if cfg.n_layer > len(blocks):
        held = f"blk.{min(blocks)} .. blk.{max(blocks)}" if blocks else "no blk.N tensors"
        raise GGUFError(f"{path}: {cfg.arch}.block_count is {cfg.n_layer} but the file holds tensors of "
                        f"{len(blocks)} blocks ({held})")


# Largest 1-D float tensor scanned at open, in elements (norm weights, biases, rope factors: n_embd-sized).
MAX_SCANNED_VECTOR = 1 << 20


def _check_finite_vectors(path: Path, tensors: Mapping[str, TensorView]) -> None:
    """Every 1-D F32/F16/BF16 tensor (norm weights, biases, RoPE factors) holds finite values: a NaN
    there reaches every logit. They are small (kilobytes per block), so this costs nothing at open;
    NaNs inside matrices surface as non-finite logits after a forward pass
    (:class:`moecache.errors.NonFiniteError` from the engine). Raises NonFiniteError naming the
    tensor and the first bad element."""
    for name, t in tensors.items():
        if len(t.shape) != 1 or t.shape[0] > MAX_SCANNED_VECTOR:
            continue
        fe = t.format.float_elems
        if fe is None:
            continue
        raw = t.data.reshape(-1)
        if fe == "bf16":  # exponent bits all ones: inf or NaN
            bad = (raw.view("<u2") & 0x7F80) == 0x7F80
        else:
            bad = ~np.isfinite(raw.view("<f4" if fe == "f32" else "<f2"))
        if bad.any():
            i = int(np.argmax(bad))
            raise NonFiniteError(f"{path}: tensor '{name}' holds {int(bad.sum())} non-finite values (NaN or inf; "
                                 f"the first at element {i}): the file is corrupt")


def open_gguf(path: str | Path) -> GGUFModel:
    """Open and validate a GGUF model (any shard's path opens a whole split model).

    Raises:
        GGUFError: no such file / not a file; wrong magic; unsupported version; corrupt or truncated
            header; tensor data past the end of the file; misaligned tensor offset; missing shard;
            missing required keys or tensors; tensor shapes that disagree with the hyperparameters;
            a count the file cannot hold (key/value and tensor counts, array lengths, block_count:
            checked before any work proportional to them); arrays nested more than
            MAX_ARRAY_DEPTH deep; tensor data that overlap or are out of order (llama.cpp gguf.cpp:
            each offset must equal the padded sizes before it).
        NonFiniteError: a norm weight, bias or RoPE factor holds NaN or infinity.
        UnsupportedArchError: ``general.architecture`` is not in :data:`moecache.arch.ARCHS`.
        UnsupportedQuantError: a tensor's GGML type has no kernel here.
    """
    path = Path(path)
    first = _open_reader(path)
    count = _int_key(first, "split.count") or 1
    if count == 1:
        paths, readers = [path], [first]
    else:
        paths = _shard_paths(path, first, count)
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise GGUFError(f"{path}: split model of {count} files is missing shard(s): {', '.join(missing)} "
                            f"(expected in {path.parent})")
        readers = [first if p.name == path.name else _open_reader(p) for p in paths]
        for i, (p, r) in enumerate(zip(paths, readers)):
            no, n = _int_key(r, "split.no"), _int_key(r, "split.count")
            if (no, n) != (i, count):
                raise GGUFError(f"{p}: expected shard {i + 1} of {count}, but its header says split.no={no}, "
                                f"split.count={n} (shards of different models mixed?)")

    tensors: dict[str, TensorView] = {}
    for i, r in enumerate(readers):
        for t in r.tensors:
            if t.name in tensors:
                raise GGUFError(f"{paths[i]}: tensor '{t.name}' also appears in {paths[tensors[t.name].file].name}")
            data = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            tensors[t.name] = TensorView(t.name, int(t.tensor_type), shape, int(t.n_bytes),
                                         data.view(np.ndarray), i, int(t.data_offset))
    total = _int_key(readers[0], "split.tensors.count")
    if count > 1 and total is not None and total != len(tensors):
        raise GGUFError(f"{path}: split.tensors.count says {total} tensors, the {count} shards hold {len(tensors)}")

    md = Metadata(readers[0])
    n_vocab = md.array_len("tokenizer.ggml.tokens") or 0
    if not n_vocab and "token_embd.weight" in tensors:
        n_vocab = tensors["token_embd.weight"].shape[0]
    try:
        cfg = config_from_metadata(md, n_vocab)
    except MoecacheError as e:
        raise type(e)(f"{path}: {e}") from None

    _check_block_count(path, cfg, tensors)
    expected = expected_tensors(cfg)
    missing_t = [n for n, (_, optional) in expected.items() if not optional and n not in tensors]
    if missing_t:
        hint = ""
        if any(n.endswith("_exps.weight") for n in missing_t) and "blk.0.ffn_gate.0.weight" in tensors:
            hint = (" (this file stores each expert as a separate tensor, an old llama.cpp layout; "
                    "re-convert it with a current convert_hf_to_gguf.py)")
        raise GGUFError(f"{path}: missing tensors for {cfg.arch}: {_names(missing_t)}{hint}")
    wrong = [f"{n} expected {shape} got {tensors[n].shape}" for n, (shape, _) in expected.items()
             if n in tensors and tensors[n].shape != shape]
    if wrong:
        raise GGUFError(f"{path}: tensor shapes do not match the hyperparameters: {_names(wrong, 6)}")
    _check_finite_vectors(path, tensors)
    unexpected = tuple(n for n in tensors if n not in expected)
    if unexpected:
        log.info("%s: %d tensors not used by %s: %s", path.name, len(unexpected), cfg.arch, _names(list(unexpected), 5))
    return GGUFModel(paths, readers, md, cfg, tensors, unexpected)
