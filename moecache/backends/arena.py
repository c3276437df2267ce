"""First-fit allocation of byte ranges inside fixed regions: the bookkeeping of the expert cache's
elastic slots (:meth:`moecache.moe.cache.CachedExperts.lend_tail`).

The elastic slots are the last slots of the cache's slot arrays. While a prompt ubatch runs they
hold no expert, and the GPU backend hands their bytes (one contiguous region per slot array: the
gate, up and down tails) to the prompt's temporary arrays (``CupyBackend.tail_arena``: CuPy's
pool on top of a :class:`RangeAllocator`); decode takes them back as slots once no temporary is
left in them. This module holds only the integer arithmetic, so the CPU tests check it
(``tests/test_arena.py``) without CuPy.
"""

from __future__ import annotations

import bisect


class RangeAllocator:
    """Ranges of bytes inside a few regions, first fit, free neighbours merged.

    Args:
        regions: ``(start, nbytes)`` of each region (addresses: plain ints); regions must not overlap.
        align: every range starts at an address that is a multiple of ``align`` (a region's
            first bytes before such an address, and its last bytes after the last whole unit,
            are not used) and its size is rounded up to a multiple of it (CuPy rounds to 512).

    Attributes:
        in_use: bytes handed out and not yet freed (rounded sizes).
        peak: the largest ``in_use`` seen.

    Raises:
        ValueError: overlapping regions, a negative size, or ``align`` < 1.
    """

    def __init__(self, regions: list[tuple[int, int]], align: int = 512):
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        spans = sorted((int(s), int(n)) for s, n in regions)
        if any(n < 0 for _, n in spans):
            raise ValueError(f"negative region size in {regions}")
        for (s0, n0), (s1, _) in zip(spans, spans[1:]):
            if s0 + n0 > s1:
                raise ValueError(f"regions overlap: {spans}")
        self.align = align
        # per region: its free ranges as two sorted lists, starts and ends (exclusive)
        self._regions = []
        for s, n in spans:
            first = -(-s // align) * align
            units = (s + n - first) // align if s + n > first else 0
            if units:
                self._regions.append((first, first + units * align))
        self._free = [([s], [e]) for s, e in self._regions]
        self._taken: dict[int, tuple[int, int]] = {}  # start -> (region index, rounded size)
        self.in_use = 0
        self.peak = 0

    @property
    def capacity(self) -> int:
        """Bytes the regions hold (each cut to whole aligned units)."""
        return sum(e - s for s, e in self._regions)

    def alloc(self, nbytes: int) -> int | None:
        """The start of a free range of ``nbytes`` (rounded up to ``align``), or None when no free
        range is that large. Raises ValueError for a negative size."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = max(self.align, -(-nbytes // self.align) * self.align)
        for ri, (starts, ends) in enumerate(self._free):
            for i, (s, e) in enumerate(zip(starts, ends)):
                if e - s >= size:
                    if e - s == size:
                        del starts[i], ends[i]
                    else:
                        starts[i] = s + size
                    self._taken[s] = (ri, size)
                    self.in_use += size
                    self.peak = max(self.peak, self.in_use)
                    return s
        return None

    def free(self, start: int) -> None:
        """Give back the range that :meth:`alloc` returned at ``start``, merged with free neighbours.
        Raises KeyError for a start that is not handed out."""
        ri, size = self._taken.pop(start)
        self.in_use -= size
        starts, ends = self._free[ri]
        end = start + size
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == end:  # merge with the next free range
            end = ends[i]
            del starts[i], ends[i]
        if i > 0 and ends[i - 1] == start:  # and with the previous one
            ends[i - 1] = end
        else:
            starts.insert(i, start)
            ends.insert(i, end)

    def whole(self) -> bool:
        """True when nothing is handed out and every region is one free range again."""
        return not self._taken and all(list(zip(st, en)) == [r] for (st, en), r in zip(self._free, self._regions))
