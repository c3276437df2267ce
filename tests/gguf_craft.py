"""Rewrite a valid GGUF's raw bytes into hostile ones: the crafting helper of tests/test_hostile_gguf.py.

:class:`Crafted` parses a GGUF (a file ``python -m moecache.testing.synth`` wrote) with its own
few lines of ``struct`` code, independent of moecache's and gguf-py's readers, into

- ``kvs``: ``[key, value type, raw value bytes]`` in file order (the raw bytes are what follows the
  type field: a scalar, a string with its u64 length, or an array's item type, count and items);
- ``tensors``: ``{"name", "dims" (ggml order, innermost first), "type", "offset"}`` per tensor info;
- ``data``: the tensor data section (from the aligned data start to the end of the file).

Edit those (:meth:`set`, :meth:`set_raw`, :meth:`tensor`, plain list and dict edits) and
:meth:`write` a file: header, key/values and tensor infos as they now stand, padding to the
alignment, then the data unchanged (tensor offsets are relative to the data start, so a longer or
shorter header moves nothing). Nothing is validated: writing nonsense is the point.

Layout reference: ggml ``docs/gguf.md``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

# GGUF value types (ggml docs/gguf.md, gguf_type)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
           BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


def gguf_str(s: str | bytes) -> bytes:
    """A GGUF string: u64 byte length, then the bytes (no terminator)."""
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def array_head(item_type: int, count: int) -> bytes:
    """The start of an array value: u32 item type, u64 element count (the items follow)."""
    return struct.pack("<IQ", item_type, count)


def nested_array(depth: int, inner_type: int = UINT32) -> bytes:
    """Raw bytes of an ARRAY value nested ``depth`` deep: ``depth`` arrays of one array each, the
    innermost an empty array of ``inner_type``. 12 bytes per level."""
    return array_head(ARRAY, 1) * (depth - 1) + array_head(inner_type, 0)


class Crafted:
    """A GGUF file taken apart into editable pieces (see the module docstring)."""

    def __init__(self, version: int, kvs: list[list[Any]], tensors: list[dict[str, Any]], alignment: int,
                 data: bytes):
        self.version = version
        self.kvs = kvs
        self.tensors = tensors
        self.alignment = alignment
        self.data = data

    # ---- reading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Crafted:
        buf = Path(path).read_bytes()
        assert buf[:4] == b"GGUF", path
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        o = 24
        kvs = []
        for _ in range(n_kv):
            key, o = cls._str(buf, o)
            (vtype,) = struct.unpack_from("<I", buf, o)
            o += 4
            end = cls._skip(buf, o, vtype)
            kvs.append([key, vtype, buf[o:end]])
            o = end
        tensors = []
        for _ in range(n_tensors):
            name, o = cls._str(buf, o)
            (nd,) = struct.unpack_from("<I", buf, o)
            dims = list(struct.unpack_from(f"<{nd}Q", buf, o + 4))
            o += 4 + 8 * nd
            ttype, off = struct.unpack_from("<IQ", buf, o)
            o += 12
            tensors.append({"name": name, "dims": dims, "type": ttype, "offset": off})
        alignment = 32
        for k, t, raw in kvs:
            if k == "general.alignment":
                alignment = struct.unpack("<I", raw)[0]
        o += -o % alignment
        return cls(version, kvs, tensors, alignment, buf[o:])

    @staticmethod
    def _str(buf: bytes, o: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, o)
        return buf[o + 8:o + 8 + n].decode(), o + 8 + n

    @classmethod
    def _skip(cls, buf: bytes, o: int, vtype: int) -> int:
        if vtype in _SCALAR:
            return o + struct.calcsize(_SCALAR[vtype])
        if vtype == STRING:
            return o + 8 + struct.unpack_from("<Q", buf, o)[0]
        assert vtype == ARRAY, vtype
        itype, n = struct.unpack_from("<IQ", buf, o)
        o += 12
        if itype in _SCALAR:
            return o + n * struct.calcsize(_SCALAR[itype])
        for _ in range(n):
            o = cls._skip(buf, o, itype)
        return o

    # ---- editing -----------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.get("general.architecture")

    def get(self, key: str) -> Any:
        """A scalar or string value (arrays: the raw bytes)."""
        for k, t, raw in self.kvs:
            if k == key:
                if t in _SCALAR:
                    return struct.unpack(_SCALAR[t], raw)[0]
                return raw[8:].decode() if t == STRING else raw
        raise KeyError(key)

    def set_raw(self, key: str, vtype: int, raw: bytes) -> Crafted:
        """Set ``key`` to value type ``vtype`` with these raw value bytes (appended when absent)."""
        for kv in self.kvs:
            if kv[0] == key:
                kv[1], kv[2] = vtype, raw
                return self
        self.kvs.append([key, vtype, raw])
        return self

    def set(self, key: str, value: Any, vtype: int | None = None) -> Crafted:
        """Set a scalar or string; the type defaults to the key's present one (else INT/FLOAT/STRING)."""
        if vtype is None:
            vtype = next((t for k, t, _ in self.kvs if k == key), None)
            if vtype is None:
                vtype = STRING if isinstance(value, str) else FLOAT32 if isinstance(value, float) else UINT32
        raw = gguf_str(value) if vtype == STRING else struct.pack(_SCALAR[vtype], value)
        return self.set_raw(key, vtype, raw)

    def remove(self, key: str) -> Crafted:
        self.kvs = [kv for kv in self.kvs if kv[0] != key]
        return self

    def tensor(self, name: str) -> dict[str, Any]:
        """The tensor info of ``name`` (a live dict: edit it)."""
        return next(t for t in self.tensors if t["name"] == name)

    def tensor_bytes(self, name: str) -> slice:
        """Where ``name``'s bytes lie in :attr:`data` (needs its byte size: F32 only)."""
        t = self.tensor(name)
        assert t["type"] == 0, "tensor_bytes: F32 tensors only"
        n = 4
        for d in t["dims"]:
            n *= d
        return slice(t["offset"], t["offset"] + n)

    def patch_data(self, at: int, new: bytes) -> Crafted:
        """Overwrite bytes of the data section at ``at`` (relative to the data start)."""
        self.data = self.data[:at] + new + self.data[at + len(new):]
        return self

    # ---- writing -----------------------------------------------------------------------------------
    def header(self, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
        """The header bytes; ``n_tensors``/``n_kv`` replace the true counts in the fixed part."""
        n_tensors = len(self.tensors) if n_tensors is None else n_tensors
        n_kv = len(self.kvs) if n_kv is None else n_kv
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, n_tensors, n_kv))
        for k, t, raw in self.kvs:
            out += gguf_str(k) + struct.pack("<I", t) + raw
        for t in self.tensors:
            out += gguf_str(t["name"]) + struct.pack("<I", len(t["dims"]))
            out += struct.pack(f"<{len(t['dims'])}Q", *t["dims"]) + struct.pack("<IQ", t["type"], t["offset"])
        return bytes(out)

    def write(self, path: str | Path, n_tensors: int | None = None, n_kv: int | None = None) -> Path:
        """Write the file (with the counts :meth:`header` takes); returns ``path``."""
        head = self.header(n_tensors, n_kv)
        path = Path(path)
        with open(path, "wb") as f:
            f.write(head)
            f.write(b"\0" * (-len(head) % self.alignment))
            f.write(self.data)
        return path
