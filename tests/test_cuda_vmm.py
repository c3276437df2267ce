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
