"""Page-locked staging buffers for host-to-device copies that finish after the call that queued them.

A copy from page-locked host memory (``cudaMemcpyAsync``; CuPy 14's ``ndarray.set`` without a
stream queues one on the current stream) returns before its bytes have moved. A staging buffer may
therefore be refilled only once the copy that reads it has completed: refilling it earlier hands
the device the next tensor's bytes (the cause of issue 24: ``--cpu-moe`` on a mapped file, prompt
ubatches of 32+ tokens, gave ``ffn_gate_exps`` bytes that were partly ``ffn_up_exps``'s).

:class:`StagingRing` keeps a few buffers and, for each, the completion event of the copy that last
read it; :func:`staged_gather_upload` is the one way a backend moves a gather of host rows through
it. Both are backend-agnostic: the GPU backend passes CuPy's pinned allocator, copy and events; the
CPU twin test passes a fake device whose copies run only when their event is waited on.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np


class CopyEvent(Protocol):
    """The completion of a queued copy (``cupy.cuda.Event`` on the GPU)."""

    def synchronize(self) -> None:
        """Block until the copy has completed."""
        ...


class StagingRing:
    """Host staging buffers reused in turn; a buffer is refilled only after its last copy completed.

    Args:
        alloc: ``nbytes -> uint8 (nbytes,)`` host array (page-locked on a GPU backend:
            ``cupyx.empty_pinned``).
        n_buffers: buffers in the ring (>= 1). Two let the CPU fill one while the other is copied.

    Attributes:
        waits: how many :meth:`take` calls found a copy still recorded on their buffer and waited
            for it (a count of reuses that would have raced without the wait).
    """

    def __init__(self, alloc: Callable[[int], np.ndarray], n_buffers: int = 2):
        if n_buffers < 1:
            raise ValueError(f"n_buffers must be >= 1, got {n_buffers}")
        self._alloc = alloc
        self._bufs: list[np.ndarray | None] = [None] * n_buffers
        self._events: list[CopyEvent | None] = [None] * n_buffers
        self._next = 0
        self.waits = 0

    def take(self, nbytes: int) -> tuple[int, np.ndarray]:
        """The next buffer, as a uint8 view of ``nbytes``, once no copy reads it any more.

        Returns:
            (index to pass to :meth:`submitted`, uint8 (nbytes,) host view).
        """
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        ev = self._events[i]
        if ev is not None:
            self.waits += 1
            ev.synchronize()  # the copy that read this buffer (or its smaller predecessor) is done
            self._events[i] = None
        buf = self._bufs[i]
        if buf is None or buf.size < nbytes:
            # a power of two: a pinned memory pool keeps every size it gave out, so growing by
            # doubling holds less than twice the largest buffer, not the sum of every size reached
            buf = self._bufs[i] = self._alloc(1 << max(int(nbytes) - 1, 0).bit_length())
        return i, buf[:nbytes]

    def submitted(self, i: int, event: CopyEvent) -> None:
        """Record that a copy reading buffer ``i`` was queued; it completes when ``event`` does."""
        self._events[i] = event

    def drain(self) -> None:
        """Wait for every recorded copy (before the buffers are freed)."""
        for i, ev in enumerate(self._events):
            if ev is not None:
                ev.synchronize()
                self._events[i] = None


def staged_gather_upload(ring: StagingRing, w: np.ndarray, used: np.ndarray,
                         gather: Callable[[np.ndarray, np.ndarray, np.ndarray], None],
                         copy_async: Callable[[np.ndarray], tuple[Any, CopyEvent]]) -> Any:
    """``w[used]`` on the device through a staging buffer: gather the rows on the CPU, queue one copy.

    Args:
        ring: the backend's staging buffers.
        w: uint8 (n_expert, ...) stacked experts in pageable host memory (a mapped GGUF).
        used: int (n,) expert ids, ascending.
        gather: ``(src (n_expert, per), idx int64 (n,), dst (n, per))``: ``dst[i] = src[idx[i]]``.
        copy_async: host uint8 (n, per) -> (device array of those bytes, the copy's completion
            event); it may return before the bytes have moved.

    Returns:
        The device array, uint8 (n,) + w.shape[1:].
    """
    n = int(used.size)
    per = int(np.prod(w.shape[1:]))
    i, host = ring.take(n * per)
    host = host.reshape(n, per)
    gather(w.reshape(w.shape[0], per), np.ascontiguousarray(used, np.int64), host)
    out, event = copy_async(host)
    ring.submitted(i, event)
    return out.reshape((n,) + tuple(w.shape[1:]))
