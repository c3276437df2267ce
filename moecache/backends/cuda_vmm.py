"""CUDA virtual memory for the expert cache's elastic slots: a device buffer whose last part's
physical memory can be given back to the driver and mapped again later at the same addresses, so
the arrays over it, the kernels' pointers and captured CUDA graphs stay valid while the memory
itself serves other allocations (a prompt ubatch's, through CuPy's ordinary pool) in between.

The calls and structures are the CUDA Driver API's virtual memory management
(``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``,
``cuMemRelease``, ``cuMemAddressFree``, ``cuMemGetAllocationGranularity``; ``CUmemAllocationProp``
and ``CUmemAccessDesc`` as cuda.h defines them since CUDA 11), called through ctypes on
``libcuda.so.1``, which CuPy has loaded already. :func:`split` is the arithmetic alone, tested on
the CPU; the rest needs a GPU (``tests/test_gpu.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any

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
    (rounded up to the allocation granularity) mapped for good, the rest mapped at creation and
    given back / mapped again by :meth:`unmap_tail` / :meth:`map_tail`. Bytes of the tail are
    undefined after a new mapping. Whoever calls :meth:`unmap_tail` must make sure no queued or
    later GPU work touches the tail until :meth:`map_tail` returns True (an access faults).

    Attributes:
        ptr: the range's first address (int); ``nbytes`` usable from it.
        tail_offset, tail_bytes: where the part that comes and goes starts, and its size (bytes).
        tail_mapped: whether it is mapped now.

    Raises:
        VmmError: a driver call failed (e.g. code 2, out of memory) while making it; nothing is left
            reserved or mapped then.
    """

    _drv: _Driver | None = None

    def __init__(self, device: int, nbytes: int, head_bytes: int):
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
        self.nbytes = nbytes
        va = ctypes.c_ulonglong()
        drv.call("cuMemAddressReserve", ctypes.byref(va), self.reserved, self.granularity, 0, 0)
        self.ptr = int(va.value)
        self.tail_mapped = False
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

    def map_tail(self) -> bool:
        """Map memory behind the tail again (its bytes undefined); False when the GPU has not that
        much free (nothing mapped then). True at once when it is mapped already."""
        if self.tail_mapped or not self.tail_bytes:
            self.tail_mapped = True
            return True
        try:
            self._map(self.tail_offset, self.tail_bytes)
        except VmmError as e:
            if e.code == CUDA_ERROR_OUT_OF_MEMORY:
                return False
            raise
        self.tail_mapped = True
        return True

    def unmap_tail(self) -> None:
        """Give the tail's memory back to the driver (the caller has waited for the GPU's work)."""
        if self.tail_mapped and self.tail_bytes:
            self._drv.call("cuMemUnmap", self.ptr + self.tail_offset, self.tail_bytes)
        self.tail_mapped = False

    def close(self) -> None:
        """In the context it was made in (made current for the call when another is, e.g. the last
        array went away in a thread of its own), after that context's queued work (a kernel may
        still read the buffer; unmapping does not wait as ``cudaFree`` does): unmap everything and
        free the address range (idempotent). The last array over the buffer going away calls it."""
        if getattr(self, "ptr", None) is None:
            return
        drv = self._drv
        cur = ctypes.c_void_p()
        drv.call("cuCtxGetCurrent", ctypes.byref(cur))
        pushed = self._ctx is not None and cur.value != self._ctx
        if pushed:
            drv.call("cuCtxPushCurrent", self._ctx)
        try:
            drv.call("cuCtxSynchronize")
            self.unmap_tail()
            if self._head_mapped and self.tail_offset:
                drv.call("cuMemUnmap", self.ptr, self.tail_offset)
            drv.call("cuMemAddressFree", self.ptr, self.reserved)
        finally:
            self.ptr = None
            if pushed:
                drv.call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone already
            pass
