"""The CPU-checkable half of moecache/backends/cuda_vmm.py: the split of a buffer into the part
mapped for good and the part that comes and goes, and the driver structures' layout against
cuda.h's (CUmemAllocationProp: 32 bytes, CUmemAccessDesc: 12; field offsets as there)."""

import ctypes

import numpy as np
import pytest

from moecache.backends.cuda_vmm import _AccessDesc, _AllocProp, pieces, split


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


@pytest.mark.parametrize("seed", [int(s) for s in np.random.SeedSequence().generate_state(1)])
def test_pieces_tile_the_tail_at_the_cuts_rounded_up(seed):
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    for _ in range(300):
        gran = int(rng.choice([1, 512, 2 << 20]))
        reserved = gran * int(rng.integers(0, 40))
        tail_at = gran * int(rng.integers(0, reserved // gran + 1)) if reserved else 0
        cuts = [int(c) for c in rng.integers(0, reserved + 2 * gran, int(rng.integers(0, 12)))]
        ps = pieces(tail_at, reserved, cuts, gran)
        # contiguous, in order, each a whole number of units, covering exactly the tail
        assert [o for o, _ in ps] == sorted(o for o, _ in ps)
        assert all(size > 0 and o % gran == 0 and size % gran == 0 for o, size in ps)
        assert all(a + sa == b for (a, sa), (b, _) in zip(ps, ps[1:]))
        assert (ps[0][0], ps[-1][0] + ps[-1][1]) == (tail_at, reserved) if ps else tail_at == reserved
        # a piece starts at the tail or at a cut rounded up to a unit, and every such cut starts one
        up = {-(-c // gran) * gran for c in cuts}
        assert {o for o, _ in ps} == {tail_at} | {u for u in up if tail_at < u < reserved} if ps else True
    assert pieces(4, 10, [5, 7, 12], 2) == [(4, 2), (6, 2), (8, 2)]
    assert pieces(4, 10, [], 2) == [(4, 6)] and pieces(10, 10, [5], 2) == []


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
        self.other = 0  # memory in use that is not this driver model's (another allocation, a context)
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
            if self.used() + self.other + size > self.capacity:
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
        elif name == "cuMemGetInfo_v2":
            assert self.ctx[-1] is not None
            a[0]._obj.value, a[1]._obj.value = self.capacity - self.used() - self.other, self.capacity
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


def test_elastic_buffer_maps_a_prefix_of_its_pieces(fake):
    """Cut into pieces: map_tail(upto) maps the pieces that begin below ``upto`` (each its own
    physical allocation), stops at out of memory keeping the prefix it mapped, unmap_tail(keep)
    gives back the pieces that begin at or past ``keep`` (last first), close unmaps each one."""
    from moecache.backends.cuda_vmm import ElasticBuffer

    MiB = 1 << 20
    drv = fake(64 * MiB)
    b = ElasticBuffer(0, 19 * MiB, 3 * MiB, cuts=(7 * MiB, 9 * MiB, 13 * MiB + 1))  # cuts -> 8, 10, 14 MiB
    assert b.pieces == [(4 * MiB, 4 * MiB), (8 * MiB, 2 * MiB), (10 * MiB, 4 * MiB), (14 * MiB, 6 * MiB)]
    assert b.tail_mapped and b.mapped_end == 20 * MiB and drv.used() == 20 * MiB and len(drv.maps) == 5
    b.unmap_tail(9 * MiB)  # the pieces from 10 MiB on go; the one holding byte 9 MiB - 1 stays
    assert b.mapped_end == 10 * MiB and drv.used() == 10 * MiB and not b.tail_mapped
    assert drv.log[-2:] == ["cuMemUnmap", "cuMemUnmap"]
    b.unmap_tail()
    assert b.mapped_end == b.tail_offset == 4 * MiB and drv.used() == 4 * MiB and list(drv.maps) == [b.ptr]
    assert b.bytes_to_map(8 * MiB + 1) == 6 * MiB and b.bytes_to_map() == 16 * MiB
    assert b.map_tail(8 * MiB) and b.mapped_end == 8 * MiB and drv.used() == 8 * MiB  # the first piece only
    drv.capacity = 13 * MiB  # room for the next piece (2 MiB), not the one after (4 MiB)
    assert not b.map_tail() and b.mapped_end == 10 * MiB and drv.used() == 10 * MiB
    assert drv.access == set(drv.maps)
    drv.capacity = 64 * MiB
    assert b.map_tail() and b.tail_mapped and drv.used() == 20 * MiB and b.bytes_to_map() == 0
    drv.log.clear()
    b.close()
    assert drv.used() == 0 and not drv.maps and not drv.reserved
    assert drv.log == ["cuCtxGetCurrent", "cuCtxSynchronize"] + ["cuMemUnmap"] * 5 + ["cuMemAddressFree"]


def test_elastic_set_takes_back_the_slots_that_fit(fake):
    """ElasticSet over three buffers cut at the same slot boundaries: lend gives every tail piece
    back (after the context's work); take_back(limit) maps the most slots whose whole pieces keep
    the memory in use (cuMemGetInfo) within the limit, the first ones first, and ``live`` is the
    slots mapped in every buffer; a buffer that mapped past the others (out of memory on the way)
    gives that part back; None maps all that the driver has."""
    from moecache.backends.cuda_vmm import ElasticBuffer, ElasticSet

    MiB = 1 << 20
    drv = fake(256 * MiB)
    head, tail, group = 10, 30, 8
    per = (MiB + 4096, MiB // 2, 3 * MiB)  # slots need not be multiples of the granularity
    bufs = tuple(ElasticBuffer(0, (head + tail) * p, head * p,
                               tuple((head + k) * p for k in range(group, tail, group))) for p in per)
    es = ElasticSet(bufs, per, head, tail)
    assert es.mapped and es.live == tail and es.bytes == sum(b.tail_bytes for b in bufs)
    full = drv.used()
    drv.log.clear()
    es.lend()  # the context's work first, then every piece
    assert drv.log == ["cuCtxGetCurrent", "cuCtxSynchronize"] + ["cuMemUnmap"] * sum(len(b.pieces) for b in bufs)
    assert es.lends == 1
    assert drv.used() == full - es.bytes and not es.mapped
    low = es.live  # slots the heads' rounding covers: usable while lent
    assert low == min(b.tail_offset // p - head for b, p in zip(bufs, per)) and low < group

    for room in (0, 5 * MiB, 40 * MiB, 70 * MiB):
        es.lend()
        used = drv.used()
        need = [es.bytes_for(n) for n in range(tail + 1)]  # whole pieces of each buffer, before mapping
        assert need == sorted(need) and need[tail] == es.bytes
        best = max([low] + [n for n in range(tail + 1) if need[n] <= room])
        live = es.take_back(used + room)
        assert live == best and drv.used() - used == need[live] <= room and (live == tail or need[live + 1] > room)
        assert all(b.mapped_end >= (head + live) * p for b, p in zip(bufs, per))  # usable in every buffer
    assert 0 < best < tail  # the rooms above took some, not all
    assert es.take_back(None) == tail and es.mapped and drv.used() == full
    # memory in use by others counts; the driver running out on the way: what a buffer mapped past
    # the others goes back
    es.lend()
    drv.other = 120 * MiB  # room for all of two buffers, a piece of the third
    assert es.take_back(None) < tail
    live = es.live
    assert low < live and all(b.mapped_end >= (head + live) * p for b, p in zip(bufs, per))
    assert all(not b._n_mapped or b.pieces[b._n_mapped - 1][0] < (head + live) * p for b, p in zip(bufs, per))
    drv.other = 0
    assert es.take_back(None) == tail and es.take_backs >= 5
    for b in bufs:
        b.close()
    assert drv.used() == 0 and not drv.reserved


def test_elastic_set_works_in_its_own_context_and_cleans_up_after_a_driver_error(fake):
    """ElasticSet's lend and take_back from a thread with no context current run in the buffers'
    own (pushed, popped after); a driver error other than out of memory in the middle of a
    take-back is raised, and no buffer keeps memory mapped past the slots usable in all."""
    from moecache.backends.cuda_vmm import ElasticBuffer, ElasticSet, VmmError

    MiB = 1 << 20
    drv = fake(256 * MiB)
    head, tail, per = 4, 24, (MiB, 2 * MiB)
    bufs = tuple(ElasticBuffer(0, (head + tail) * p, head * p, tuple((head + k) * p for k in range(8, tail, 8)))
                 for p in per)
    es = ElasticSet(bufs, per, head, tail)
    drv.ctx.append(None)  # another thread, no context current
    drv.log.clear()
    es.lend()
    assert drv.log[:3] == ["cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxSynchronize"]
    assert drv.log[-1] == "cuCtxPopCurrent" and drv.ctx == [77, None]
    heads = drv.used()
    drv.fail["cuMemSetAccess"] = 1  # the first piece of the second buffer: after the first buffer mapped all
    calls = 0
    orig = drv.call

    def call(name, *a):
        nonlocal calls
        if name == "cuMemSetAccess":
            calls += 1
            if calls <= len(bufs[0].pieces):
                drv.fail.pop("cuMemSetAccess", None)
                r = orig(name, *a)
                drv.fail["cuMemSetAccess"] = 1
                return r
        return orig(name, *a)

    drv.call = call
    with pytest.raises(VmmError):
        es.take_back(None)
    drv.call = orig
    drv.fail.clear()
    assert es.live == 0 and drv.used() == heads and drv.ctx == [77, None]  # the first buffer's pieces went back
    assert es.take_back(None) == tail and es.mapped and drv.ctx == [77, None]
    drv.ctx.pop()
    for b in bufs:
        b.close()
    assert drv.used() == 0


def test_elastic_set_refuses_to_lend_or_take_back_once_a_buffer_is_closed(fake):
    """Once a buffer's last array went away (closed: its memory and address range are the
    driver's again), lend and take_back raise one clear error instead of mapping at a freed address,
    and make no driver call."""
    from moecache.backends.cuda_vmm import ElasticBuffer, ElasticSet

    MiB = 1 << 20
    drv = fake(64 * MiB)
    head, tail, per = 2, 8, (MiB, MiB)
    bufs = tuple(ElasticBuffer(0, (head + tail) * p, head * p, (6 * p,)) for p in per)
    es = ElasticSet(bufs, per, head, tail)
    es.lend()
    assert not es.closed
    bufs[1].close()
    assert es.closed
    drv.log.clear()
    for call in (es.lend, lambda: es.take_back(None), lambda: es.take_back(32 * MiB)):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert drv.log == [] and drv.used() == bufs[0].tail_offset
    bufs[0].close()
    assert drv.used() == 0 and not drv.reserved
