"""CUDA virtual memory for the expert cache's elastic slots: a device buffer whose last part's
physical memory can be given back to the driver and mapped again later at the same addresses, so
the arrays over it, the kernels' pointers and captured CUDA graphs stay valid while the memory
itself serves other allocations (a prompt ubatch's, through CuPy's ordinary pool) in between.

The calls and structures are the CUDA Driver API's virtual memory management
(``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``,
``cuMemRelease``, ``cuMemAddressFree``, ``cuMemGetAllocationGranularity``; ``CUmemAllocationProp``
and ``CUmemAccessDesc`` as cuda.h defines them since CUDA 11), called through ctypes on
``libcuda.so.1``, which CuPy has loaded already. :func:`split` and :func:`pieces` are the arithmetic
alone; :class:`ElasticBuffer` and :class:`ElasticSet` are tested on the CPU against a model of the
driver (``tests/test_cuda_vmm.py``) and on a GPU (``tests/test_gpu.py``).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Any, Iterator

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CUDA_ERROR_OUT_OF_MEMORY = 2


class VmmError(RuntimeError):
    """A driver call failed: ``code`` is its CUresult (2: out of memory)."""

    def __init__(self, what: str, code: int, name: str):
        super().__init__(f"{what} failed: {name} ({code})")
        self.code = code


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp: 32 bytes
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc: 12 bytes
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def split(nbytes: int, head_bytes: int, granularity: int) -> tuple[int, int]:
    """``(reserved, head)``: the address range reserved for a buffer of ``nbytes`` (a multiple of
    ``granularity``) and the mapped-for-good part that covers its first ``head_bytes`` (rounded up
    to ``granularity``, at most the range); the rest, ``reserved - head`` bytes, is the part that
    is given back and mapped again. Raises ValueError for sizes out of order or granularity < 1."""
    if granularity < 1 or nbytes < 0 or not 0 <= head_bytes <= nbytes:
        raise ValueError(f"split({nbytes}, {head_bytes}, {granularity})")
    up = lambda n: -(-n // granularity) * granularity  # noqa: E731
    reserved = up(nbytes)
    return reserved, min(up(head_bytes), reserved)


def pieces(tail_offset: int, reserved: int, cuts: tuple[int, ...] | list[int], granularity: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of each piece of a buffer's tail ``[tail_offset, reserved)`` that is mapped
    and given back on its own: cut at each of ``cuts`` (byte offsets from the buffer's start,
    rounded up to ``granularity``; those outside the tail are ignored), in order. No cut: one
    piece (none when the tail is empty)."""
    up = lambda n: -(-n // granularity) * granularity  # noqa: E731
    bounds = sorted({tail_offset, reserved} | {up(c) for c in cuts if tail_offset < up(c) < reserved})
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


class _Driver:
    """The few driver entry points, typed; ``call`` raises :class:`VmmError` on a failure."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size, p = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.POINTER
        sig = {
            "cuMemGetAllocationGranularity": [p(size), p(_AllocProp), ctypes.c_int],
            "cuMemAddressReserve": [p(u64), size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [p(u64), size, p(_AllocProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, p(_AccessDesc), size],
            "cuGetErrorName": [ctypes.c_int, p(ctypes.c_char_p)],
            "cuCtxSynchronize": [],
            "cuCtxGetCurrent": [p(ctypes.c_void_p)],
            "cuCtxPushCurrent": [ctypes.c_void_p],
            "cuCtxPopCurrent": [p(ctypes.c_void_p)],
            "cuMemGetInfo_v2": [p(size), p(size)],
        }
        self.fn = {}
        for name, args in sig.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
            self.fn[name] = f

    def call(self, name: str, *args: Any) -> None:
        res = self.fn[name](*args)
        if res != 0:
            s = ctypes.c_char_p()
            self.fn["cuGetErrorName"](res, ctypes.byref(s))
            raise VmmError(name, int(res), (s.value or b"?").decode())


class ElasticBuffer:
    """``nbytes`` of device memory on GPU ``device`` at one address range: the first ``head_bytes``
    (rounded up to the allocation granularity) mapped for good, the rest (the tail) mapped at
    creation and given back / mapped again by :meth:`unmap_tail` / :meth:`map_tail`, in pieces cut
    at ``cuts`` (:func:`pieces`; each its own physical allocation), so that a prefix of the tail
    can be mapped when the whole would not fit. Bytes of the tail are undefined after a new
    mapping. Whoever calls :meth:`unmap_tail` must make sure no queued or later GPU work touches
    the part given back until :meth:`map_tail` has mapped it again (an access faults).

    Attributes:
        ptr: the range's first address (int); ``nbytes`` usable from it.
        tail_offset, tail_bytes: where the part that comes and goes starts, and its size (bytes).
        mapped_end: where the mapped prefix of the range ends (``tail_offset``: no piece of the
            tail mapped; ``reserved``: all).
        tail_mapped: whether all of the tail is mapped now.

    Raises:
        VmmError: a driver call failed (e.g. code 2, out of memory) while making it; nothing is left
            reserved or mapped then.
    """

    _drv: _Driver | None = None

    def __init__(self, device: int, nbytes: int, head_bytes: int, cuts: tuple[int, ...] = ()):
        if ElasticBuffer._drv is None:
            ElasticBuffer._drv = _Driver()
        drv = self._drv
        self.device = device
        ctx = ctypes.c_void_p()
        drv.call("cuCtxGetCurrent", ctypes.byref(ctx))
        self._ctx = ctx.value  # the context it is made in: closed in it too, from whatever thread
        self._prop = _AllocProp(type=CU_MEM_ALLOCATION_TYPE_PINNED, requestedHandleTypes=CU_MEM_HANDLE_TYPE_NONE,
                                location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device))
        gran = ctypes.c_size_t()
        drv.call("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self._prop),
                 CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.granularity = int(gran.value)
        self.reserved, self.tail_offset = split(nbytes, head_bytes, self.granularity)
        self.tail_bytes = self.reserved - self.tail_offset
        self.pieces = pieces(self.tail_offset, self.reserved, cuts, self.granularity)
        self._n_mapped = 0  # the tail's pieces mapped: always a prefix
        self.nbytes = nbytes
        va = ctypes.c_ulonglong()
        drv.call("cuMemAddressReserve", ctypes.byref(va), self.reserved, self.granularity, 0, 0)
        self.ptr = int(va.value)
        self._head_mapped = False
        try:
            if self.tail_offset:
                self._map(0, self.tail_offset)
            self._head_mapped = True
            self.map_tail()
            if self.tail_bytes and not self.tail_mapped:
                raise VmmError("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY")
        except BaseException:
            self.close()
            raise

    def _map(self, offset: int, size: int) -> None:
        """Physical memory created, mapped at ``ptr + offset`` for ``size`` bytes, made readable and
        writable by this GPU; the handle is released at once (the mapping keeps the memory until
        it is unmapped)."""
        drv = self._drv
        h = ctypes.c_ulonglong()
        drv.call("cuMemCreate", ctypes.byref(h), size, ctypes.byref(self._prop), 0)
        try:
            drv.call("cuMemMap", self.ptr + offset, size, 0, h.value, 0)
        finally:
            drv.call("cuMemRelease", h.value)
        try:
            acc = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, self.device), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            drv.call("cuMemSetAccess", self.ptr + offset, size, ctypes.byref(acc), 1)
        except BaseException:
            drv.call("cuMemUnmap", self.ptr + offset, size)
            raise

    @property
    def mapped_end(self) -> int:
        return self.pieces[self._n_mapped - 1][0] + self.pieces[self._n_mapped - 1][1] if self._n_mapped \
            else self.tail_offset

    @property
    def tail_mapped(self) -> bool:
        return self._n_mapped == len(self.pieces)

    def bytes_to_map(self, upto: int | None = None) -> int:
        """The bytes :meth:`map_tail` (``upto``) would map now."""
        end = self.reserved if upto is None else upto
        return sum(size for off, size in self.pieces[self._n_mapped:] if off < end)

    def map_tail(self, upto: int | None = None) -> bool:
        """Map memory behind the tail's pieces again, in order, until the mapped prefix covers the
        range's first ``upto`` bytes (None: all of it); their bytes undefined. False when the GPU
        ran out of memory on the way (the pieces mapped before that stay mapped)."""
        end = self.reserved if upto is None else upto
        while self._n_mapped < len(self.pieces) and self.pieces[self._n_mapped][0] < end:
            try:
                self._map(*self.pieces[self._n_mapped])
            except VmmError as e:
                if e.code == CUDA_ERROR_OUT_OF_MEMORY:
                    return False
                raise
            self._n_mapped += 1
        return True

    def unmap_tail(self, keep: int | None = None) -> None:
        """Give back to the driver the tail's mapped pieces that the range's first ``keep`` bytes do
        not reach (None: all of them), last first (the caller has waited for the GPU's work)."""
        end = self.tail_offset if keep is None else keep
        while self._n_mapped and self.pieces[self._n_mapped - 1][0] >= end:
            off, size = self.pieces[self._n_mapped - 1]
            self._drv.call("cuMemUnmap", self.ptr + off, size)
            self._n_mapped -= 1

    def close(self) -> None:
        """In the context it was made in (made current for the call when another is, e.g. the last
        array went away in a thread of its own), after that context's queued work (a kernel may
        still read the buffer; unmapping does not wait as ``cudaFree`` does): unmap everything and
        free the address range (idempotent). The last array over the buffer going away calls it."""
        if getattr(self, "ptr", None) is None:
            return
        drv = self._drv
        try:
            with self.in_context():
                drv.call("cuCtxSynchronize")
                self.unmap_tail()
                if self._head_mapped and self.tail_offset:
                    drv.call("cuMemUnmap", self.ptr, self.tail_offset)
                drv.call("cuMemAddressFree", self.ptr, self.reserved)
        finally:
            self.ptr = None

    @contextmanager
    def in_context(self) -> Iterator[None]:
        """The context this buffer was made in, current for the block (pushed when another or none
        is current in this thread, popped after)."""
        drv = self._drv
        cur = ctypes.c_void_p()
        drv.call("cuCtxGetCurrent", ctypes.byref(cur))
        pushed = self._ctx is not None and cur.value != self._ctx
        if pushed:
            drv.call("cuCtxPushCurrent", self._ctx)
        try:
            yield
        finally:
            if pushed:
                drv.call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone already
            pass


class ElasticSet:
    """The expert cache's elastic slots over several :class:`ElasticBuffer` (one per slot array,
    all of ``head + tail`` slots, made in one context, cut into pieces at the same slot
    boundaries): the arrays' last ``tail`` slots go back to the driver together (:meth:`lend`) and
    come back, all of them or the first ones that fit (:meth:`take_back`).

    Args:
        buffers: the buffers, one per slot array.
        per_slot: the bytes of one slot in each buffer.
        head, tail: the slots mapped for good, and those that come and go after them.

    Attributes:
        bytes: the memory that comes and goes (all buffers).
        live: the tail's slots usable now (mapped in every buffer), 0 to ``tail``; the first ones.
            A slot that the head's rounding to the granularity covers is always usable.
        lends, take_backs: how many times memory went and came back (a partial take-back counts).
    """

    def __init__(self, buffers: tuple[ElasticBuffer, ...], per_slot: tuple[int, ...], head: int, tail: int):
        self._buffers, self._per, self.head, self.tail = buffers, per_slot, head, tail
        self.bytes = sum(b.tail_bytes for b in buffers)
        self.lends = self.take_backs = 0

    @property
    def live(self) -> int:
        return min(min(self.tail, max(0, b.mapped_end // per - self.head)) for b, per in zip(self._buffers, self._per))

    @property
    def mapped(self) -> bool:
        """Whether every buffer's tail is mapped now."""
        return all(b.tail_mapped for b in self._buffers)

    @property
    def closed(self) -> bool:
        """Whether a buffer has been closed (its last array went away): its memory and address
        range are the driver's again, so nothing can be lent or taken back."""
        return any(b.ptr is None for b in self._buffers)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"ElasticSet.{what}: the elastic slots' buffers are closed (their last array went away)")

    def lend(self) -> None:
        """After the context's queued work (a kernel may still read a slot there), the tail's memory
        goes back to the driver, where CuPy's pool may hand it to a prompt's arrays. Nothing may
        read or write the tail's slots past ``live`` until :meth:`take_back` maps them again.
        Raises RuntimeError once a buffer is closed (a use after close: a bug)."""
        self._check_open("lend")
        if not any(b.mapped_end > b.tail_offset for b in self._buffers):
            return
        with self._buffers[0].in_context():
            ElasticBuffer._drv.call("cuCtxSynchronize")
            for b in self._buffers:
                b.unmap_tail()
        self.lends += 1

    def bytes_for(self, slots: int) -> int:
        """The bytes that mapping the tail's first ``slots`` slots would map now (whole pieces)."""
        return sum(b.bytes_to_map((self.head + slots) * per) for b, per in zip(self._buffers, self._per))

    def take_back(self, limit: int | None) -> int:
        """Map the memory of as many of the tail's slots as keeps the GPU's memory in use
        (``cuMemGetInfo``: every process's) within ``limit`` bytes (None: as many as the driver
        has), the first ones first; their bytes undefined (they hold no expert). A buffer left
        mapped past the others (the driver ran out on the way) gives that part back. Returns
        ``live`` (unchanged when no more fit). Raises :class:`VmmError` for a driver error other
        than out of memory; RuntimeError once a buffer is closed."""
        self._check_open("take_back")
        before = self.live
        if before == self.tail:
            return before
        drv = ElasticBuffer._drv
        with self._buffers[0].in_context():
            want = self.tail
            if limit is not None:
                free, total = ctypes.c_size_t(), ctypes.c_size_t()
                drv.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
                room = limit - (total.value - free.value)
                lo, hi = before, self.tail  # the most slots whose pieces fit in the room (bytes_for grows with them)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self.bytes_for(mid) <= room else (lo, mid - 1)
                want = lo
            try:
                if want > before:
                    for b, per in zip(self._buffers, self._per):
                        if not b.map_tail((self.head + want) * per):
                            break
            finally:  # also after a driver error: no buffer keeps memory past the slots usable in all
                live = self.live
                for b, per in zip(self._buffers, self._per):
                    b.unmap_tail((self.head + live) * per)
        if live > before:
            self.take_backs += 1
        return live
