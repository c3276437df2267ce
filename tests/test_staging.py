"""CPU twin of the GPU's staged expert uploads (issue 24): copies that complete after the call.

A fake device queues each copy and performs it only when its event is waited on (or later), as a
``cudaMemcpyAsync`` from page-locked memory may. Refilling a staging buffer before its copy ran
hands the device the next tensor's bytes; the ring must prevent that."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends.staging import StagingRing, staged_gather_upload


class LateDevice:
    """Copies run in submission order, only when an event at or after them is synchronized."""

    def __init__(self):
        self.queue: list[tuple[np.ndarray, np.ndarray]] = []  # (device array, host view it reads)
        self.done = 0

    def copy_async(self, host: np.ndarray):
        dev = np.full(host.shape, 0xAB, np.uint8)  # garbage until the copy runs
        self.queue.append((dev, host))
        return dev, _Event(self, len(self.queue))

    def run_until(self, n: int) -> None:
        while self.done < n:
            dev, host = self.queue[self.done]
            dev[...] = host  # reads the staging buffer now, not at submission
            self.done += 1

    def finish(self) -> None:
        self.run_until(len(self.queue))


class _Event:
    def __init__(self, device: LateDevice, n: int):
        self.device, self.n = device, n

    def synchronize(self) -> None:
        self.device.run_until(self.n)


def _gather(src, idx, dst):
    dst[...] = src[idx]


def _experts(rng, n_expert=16, rows=8, row_bytes=34):
    return [rng.integers(0, 256, (n_expert, rows, row_bytes), dtype=np.uint8) for _ in range(3)]


def test_staged_uploads_of_gate_up_down_are_exact_with_late_copies():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    dev = LateDevice()
    ring = StagingRing(lambda n: np.empty(n, np.uint8), n_buffers=2)
    outs, refs = [], []
    for _ in range(4):  # four layers of a prompt ubatch, each gate, up, down
        used = np.unique(rng.integers(0, 16, 11))
        for w in _experts(rng):
            outs.append(staged_gather_upload(ring, w, used, _gather, dev.copy_async))
            refs.append(w[used].copy())
    dev.finish()
    for got, ref in zip(outs, refs):
        np.testing.assert_array_equal(got, ref)
    assert ring.waits == len(outs) - 2  # every take after the first two found a copy to wait for


def test_growing_buffers_wait_for_the_copy_of_the_smaller_one():
    dev = LateDevice()
    ring = StagingRing(lambda n: np.empty(n, np.uint8), n_buffers=1)
    rng = np.random.default_rng(1)
    w = rng.integers(0, 256, (16, 4, 10), dtype=np.uint8)
    a = staged_gather_upload(ring, w, np.array([1, 2]), _gather, dev.copy_async)
    b = staged_gather_upload(ring, w, np.arange(16), _gather, dev.copy_async)  # a larger buffer
    dev.finish()
    np.testing.assert_array_equal(a, w[[1, 2]])
    np.testing.assert_array_equal(b, w)


def test_the_twin_reproduces_the_race_without_the_wait():
    """The same uploads through one shared buffer that is refilled at once (the old upload_experts):
    the late copies read the last tensor's bytes. Proves the twin can see the bug the ring fixes."""
    rng = np.random.default_rng(2)
    dev = LateDevice()
    shared = np.empty(1 << 16, np.uint8)
    used = np.array([0, 3, 5, 9])
    ws = _experts(rng)
    outs = []
    for w in ws:
        per = int(np.prod(w.shape[1:]))
        host = shared[:used.size * per].reshape(used.size, per)
        _gather(w.reshape(16, per), used, host)
        outs.append(dev.copy_async(host)[0])
    dev.finish()
    assert not np.array_equal(outs[0].reshape(w[used].shape), ws[0][used])  # gate got down's bytes
    np.testing.assert_array_equal(outs[0], outs[2])


def test_ring_rejects_no_buffers():
    with pytest.raises(ValueError, match="n_buffers"):
        StagingRing(lambda n: np.empty(n, np.uint8), n_buffers=0)


def test_buffers_grow_by_powers_of_two():
    sizes = []
    ring = StagingRing(lambda n: sizes.append(n) or np.empty(n, np.uint8), n_buffers=1)
    for n in (1, 3, 1000, 1024, 1025, 5000):
        i, view = ring.take(n)
        assert view.size == n
    assert sizes == [1, 4, 1024, 2048, 8192]
