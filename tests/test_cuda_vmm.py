"""The CPU-checkable half of moecache/backends/cuda_vmm.py: the split of a buffer into the part
mapped for good and the part that comes and goes, and the driver structures' layout against
cuda.h's (CUmemAllocationProp: 32 bytes, CUmemAccessDesc: 12; field offsets as there)."""

import ctypes

import numpy as np
import pytest

from moecache.backends.cuda_vmm import _AccessDesc, _AllocProp, split


@pytest.mark.parametrize("seed", [int(s) for s in np.random.SeedSequence().generate_state(2)])
def test_split_covers_the_head_and_rounds_to_the_granularity(seed):
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    for _ in range(500):
        gran = int(rng.choice([1, 512, 2 << 20]))
        n = int(rng.integers(0, 50 * gran + 1))
        head = int(rng.integers(0, n + 1))
        reserved, tail_at = split(n, head, gran)
        assert reserved % gran == 0 and n <= reserved < n + gran  # the smallest whole range
        assert tail_at % gran == 0 or tail_at == reserved
        assert head <= tail_at <= reserved and tail_at - head < gran  # the head, and less than a unit more
    assert split(10 << 20, 3 << 20, 2 << 20) == (10 << 20, 4 << 20)
    assert split(5, 5, 4) == (8, 8)  # a head that fills the buffer: nothing comes and goes


def test_split_refuses_sizes_out_of_order():
    for args in [(10, 11, 2), (-1, 0, 2), (10, -1, 2), (10, 5, 0)]:
        with pytest.raises(ValueError):
            split(*args)


def test_driver_structures_have_cuda_h_layout():
    assert ctypes.sizeof(_AllocProp) == 32 and ctypes.sizeof(_AccessDesc) == 12
    offsets = {f: getattr(_AllocProp, f).offset for f, _ in _AllocProp._fields_}
    assert offsets == {"type": 0, "requestedHandleTypes": 4, "location": 8, "win32HandleMetaData": 16,
                       "allocFlags": 24}
    assert _AccessDesc.flags.offset == 8


class FakeDriver:
    """The driver calls ElasticBuffer makes, against a model of one GPU: reserved address ranges,
    mappings (a physical allocation lives while it has a handle or a mapping), free memory
    (``capacity``), access set per mapping. ``log`` keeps the calls in order; ``fail`` maps a call
    name to a CUresult it returns once."""

    def __init__(self, capacity: int, granularity: int = 2 << 20):
        self.capacity, self.gran = capacity, granularity
        self.reserved: dict[int, int] = {}  # start -> size
        self.maps: dict[int, tuple[int, int]] = {}  # start -> (size, handle)
        self.handles: dict[int, int] = {}  # handle -> size
        self.refs: dict[int, int] = {}  # handle -> references (the handle itself, its mappings)
        self.access: set[int] = set()
        self.log: list[str] = []
        self.fail: dict[str, int] = {}
        self.ctx: list[int | None] = [77]  # the thread's context stack (77: the one CuPy made)
        self._next_va, self._next_h = 1 << 40, 1

    def used(self) -> int:
        return sum(self.handles.values())

    def _unref(self, h: int) -> None:
        self.refs[h] -= 1
        if not self.refs[h]:
            del self.refs[h], self.handles[h]

    def call(self, name: str, *a) -> None:
        from moecache.backends.cuda_vmm import VmmError

        self.log.append(name)
        if name in self.fail:
            raise VmmError(name, self.fail.pop(name), "FAKE")
        if name == "cuMemGetAllocationGranularity":
            a[0]._obj.value = self.gran
        elif name == "cuMemAddressReserve":
            size, align = a[1], a[2]
            assert size % self.gran == 0 and align == self.gran
            a[0]._obj.value = self._next_va
            self.reserved[self._next_va] = size
            self._next_va += size + (1 << 30)
        elif name == "cuMemCreate":
            size = a[1]
            assert size % self.gran == 0 and size > 0
            if self.used() + size > self.capacity:
                raise VmmError(name, 2, "CUDA_ERROR_OUT_OF_MEMORY")
            h, self._next_h = self._next_h, self._next_h + 1
            self.handles[h], self.refs[h] = size, 1
            a[0]._obj.value = h
        elif name == "cuMemMap":
            ptr, size, offset, h = a[0], a[1], a[2], a[3]
            assert offset == 0 and self.handles[h] == size
            base = max(s for s in self.reserved if s <= ptr)
            assert ptr + size <= base + self.reserved[base] and (ptr - base) % self.gran == 0
            assert all(p + s <= ptr or ptr + size <= p for p, (s, _) in self.maps.items())  # no overlap
            self.maps[ptr] = (size, h)
            self.refs[h] += 1
        elif name == "cuMemRelease":
            self._unref(a[0])
        elif name == "cuMemSetAccess":
            assert a[0] in self.maps and self.maps[a[0]][0] == a[1]
            self.access.add(a[0])
        elif name == "cuMemUnmap":
            size, h = self.maps.pop(a[0])
            assert size == a[1]
            self.access.discard(a[0])
            self._unref(h)
        elif name == "cuMemAddressFree":
            assert not any(a[0] <= p < a[0] + a[1] for p in self.maps)  # unmapped first
            assert self.reserved.pop(a[0]) == a[1]
        elif name == "cuCtxSynchronize":
            assert self.ctx[-1] is not None
        elif name == "cuCtxGetCurrent":
            a[0]._obj.value = self.ctx[-1]
        elif name == "cuCtxPushCurrent":
            self.ctx.append(a[0])
        elif name == "cuCtxPopCurrent":
            a[0]._obj.value = self.ctx.pop()
        else:
            raise AssertionError(name)


@pytest.fixture
def fake(monkeypatch):
    from moecache.backends import cuda_vmm

    def make(capacity: int) -> FakeDriver:
        drv = FakeDriver(capacity)
        monkeypatch.setattr(cuda_vmm.ElasticBuffer, "_drv", drv)
        return drv

    return make


def test_elastic_buffer_gives_its_tail_back_and_maps_it_again(fake):
    from moecache.backends.cuda_vmm import ElasticBuffer

    MiB = 1 << 20
    drv = fake(64 * MiB)
    b = ElasticBuffer(0, 9 * MiB + 5, 3 * MiB)  # head 3 MiB -> 4 MiB mapped for good, 10 MiB reserved
    assert (b.reserved, b.tail_offset, b.tail_bytes) == (10 * MiB, 4 * MiB, 6 * MiB)
    assert drv.used() == 10 * MiB and b.tail_mapped and drv.access == set(drv.maps)
    # created, mapped, the handle released, access granted: for the head, then the tail
    assert drv.log[3:] == ["cuMemCreate", "cuMemMap", "cuMemRelease", "cuMemSetAccess"] * 2
    b.unmap_tail()
    assert drv.used() == 4 * MiB and not b.tail_mapped and list(drv.maps) == [b.ptr]
    b.unmap_tail()  # again: nothing to do
    assert b.map_tail() and drv.used() == 10 * MiB and set(drv.maps) == {b.ptr, b.ptr + 4 * MiB}
    assert drv.access == set(drv.maps)
    drv.capacity = 8 * MiB  # another allocation took the rest: the tail does not fit now
    b.unmap_tail()
    assert not b.map_tail() and not b.tail_mapped and drv.used() == 4 * MiB and len(drv.maps) == 1
    drv.capacity = 64 * MiB
    assert b.map_tail()
    drv.ctx.append(None)  # the last array goes away in a thread without a context: closed in its own
    drv.log.clear()
    b.close()
    b.close()  # idempotent
    assert drv.used() == 0 and not drv.maps and not drv.reserved and drv.ctx == [77, None]
    assert drv.log == ["cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxSynchronize", "cuMemUnmap", "cuMemUnmap",
                       "cuMemAddressFree", "cuCtxPopCurrent"]


def test_elastic_buffer_leaves_nothing_behind_when_it_cannot_be_made(fake):
    from moecache.backends.cuda_vmm import ElasticBuffer, VmmError

    MiB = 1 << 20
    drv = fake(6 * MiB)  # the head fits, the tail does not
    with pytest.raises(VmmError) as e:
        ElasticBuffer(0, 10 * MiB, 4 * MiB)
    assert e.value.code == 2 and drv.used() == 0 and not drv.maps and not drv.reserved
    drv = fake(64 * MiB)
    drv.fail["cuMemSetAccess"] = 1  # a driver error other than out of memory, on the head's mapping
    with pytest.raises(VmmError):
        ElasticBuffer(0, 10 * MiB, 4 * MiB)
    assert drv.used() == 0 and not drv.maps and not drv.reserved
    b = ElasticBuffer(0, 10 * MiB, 4 * MiB)
    b.unmap_tail()
    drv.fail["cuMemMap"] = 1  # not out of memory: raised, and the physical allocation is released
    with pytest.raises(VmmError):
        b.map_tail()
    assert drv.used() == 4 * MiB and not b.tail_mapped
    b.close()
    assert drv.used() == 0 and not drv.reserved
