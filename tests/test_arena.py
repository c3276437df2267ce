"""The range allocator under the expert cache's elastic slots (moecache/backends/arena.py), against a
unit-by-unit occupancy model: random allocations and frees, each answer checked."""

import numpy as np
import pytest

from moecache.backends.arena import RangeAllocator


def _free_runs(occ: np.ndarray) -> list[int]:
    """Lengths of the runs of free units in one region's occupancy row."""
    runs, n = [], 0
    for v in occ:
        if v:
            runs.append(n)
            n = 0
        else:
            n += 1
    return runs + [n]


@pytest.mark.parametrize("seed", [int(s) for s in np.random.SeedSequence().generate_state(3)])
def test_range_allocator_against_an_occupancy_model(seed):
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    align = 512
    units = [int(u) for u in rng.integers(4, 40, 3)]
    # not in address order (the allocator sorts them); the first two start off an aligned address:
    # their first aligned unit begins at the next multiple of align, and the bytes before it go unused
    offs = [int(rng.integers(1, align)), int(rng.integers(1, align)), 0]
    spans = [((1 << 20) + offs[0], (units[0] + 1) * align - offs[0] + int(rng.integers(0, align))),
             ((8 << 20) + offs[1], (units[1] + 1) * align - offs[1] + int(rng.integers(0, align))),
             (3 << 20, units[2] * align + int(rng.integers(0, align)))]
    starts = [-(-s // align) * align for s, _ in spans]  # each region's first aligned address
    r = RangeAllocator(spans, align)
    assert r.capacity == sum(units) * align
    occ = {s: np.zeros(u, bool) for s, u in zip(starts, units)}
    live: dict[int, int] = {}  # start -> units
    for _ in range(400):
        if live and rng.random() < 0.45:
            p = list(live)[int(rng.integers(0, len(live)))]
            r.free(p)
            s = max(x for x in starts if x <= p)
            occ[s][(p - s) // align:(p - s) // align + live.pop(p)] = False
        else:
            n = int(rng.integers(0, 12 * align))
            want = max(1, -(-n // align))
            p = r.alloc(n)
            fits = any(max(_free_runs(o)) >= want for o in occ.values())
            assert (p is not None) == fits, (n, p)
            if p is None:
                continue
            s = max(x for x in starts if x <= p)
            i = (p - s) // align
            assert p % align == 0 and i + want <= len(occ[s]) and not occ[s][i:i + want].any()
            occ[s][i:i + want] = True
            live[p] = want
        assert r.in_use == sum(live.values()) * align
        assert r.peak >= r.in_use
    for p in list(live):
        r.free(p)
    assert r.in_use == 0 and r.whole()
    assert r.alloc(max(units) * align) is not None  # merged again: the largest region in one piece


def test_range_allocator_refuses_bad_input():
    with pytest.raises(ValueError, match="overlap"):
        RangeAllocator([(0, 4096), (2048, 4096)])
    with pytest.raises(ValueError, match="align"):
        RangeAllocator([(0, 4096)], align=0)
    r = RangeAllocator([(0, 4096)])
    with pytest.raises(ValueError, match="nbytes"):
        r.alloc(-1)
    with pytest.raises(KeyError):
        r.free(512)
    p = r.alloc(0)  # a zero-byte request still takes one aligned unit
    assert p == 0 and r.in_use == 512 and not r.whole()
