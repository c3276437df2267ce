"""The host handoff's protocol (moecache/moe/handoff.py) with a thread in the GPU's role: it posts
requests the way handoff_post does (data, then count and n_tok, then the flag) and waits for each
answer the way handoff_wait does. The GPU kernels themselves are checked in tests/test_gpu.py."""

import threading
import time

import numpy as np
import pytest

from moecache.errors import MoecacheError
from moecache.moe import handoff


def _gpu_role(buf, layers, seq, reqs, got, count_of):
    """Post each layer's request (rows of its own values), wait for the answer when it has pairs."""
    for il in layers:
        h, ids, w = reqs[il]
        t = h.shape[0]
        buf.h[:t], buf.ids[:t], buf.w[:t] = h, ids, w
        buf.count[il] = count_of(ids)
        buf.n_tok[il] = t
        buf.flag[il] = seq
        if buf.count[il]:
            t_end = time.monotonic() + 10
            while buf.done[il] < seq:
                assert time.monotonic() < t_end, "no answer"
            got[il] = buf.out[:t].copy()


def _requests(rng, layers, k=4, n_embd=8):
    reqs = {}
    for il in layers:
        t = int(rng.integers(1, 4))
        ids = rng.integers(-1, 6, size=(t, k)).astype(np.int32)
        reqs[il] = (rng.standard_normal((t, n_embd)).astype(np.float32), ids,
                    rng.random((t, k)).astype(np.float32))
    return reqs


def _compute(il, h, ids, w, out):
    """A stand-in for the experts: out[t] += sum over the CPU's pairs of w * (il + id) * h[t]."""
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            if ids[t, j] >= 0:
                out[t] += w[t, j] * (il + ids[t, j]) * h[t]


def _fresh_rng() -> np.random.Generator:
    """A generator from a fresh seed, printed (a failure names its seed)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    return np.random.default_rng(seed)


def _count_of(ids: np.ndarray) -> int:
    """The CPU's pairs in a request (handoff_post's count)."""
    return int((ids >= 0).sum())


def test_serve_answers_every_request_in_order_over_passes():
    rng = _fresh_rng()
    layers = [0, 2, 3, 5]
    buf = handoff.HandoffBuffers.allocate(6, 4, 8, 4)
    for seq in (1, 2, 3):
        reqs = _requests(rng, layers)
        reqs[2][1][...] = -1  # a layer with nothing for the CPU: no answer, no wait
        got = {}
        th = threading.Thread(target=_gpu_role, args=(buf, layers, seq, reqs, got, _count_of))
        th.start()
        n = handoff.serve(buf, layers, seq, _compute, timeout_s=10)
        th.join(10)
        assert not th.is_alive()
        assert n == 3 and sorted(got) == [0, 3, 5]
        for il in got:
            h, ids, w = reqs[il]
            ref = np.zeros_like(h)
            _compute(il, h, ids, w, ref)
            np.testing.assert_allclose(got[il], ref, rtol=1e-6)
        assert buf.done[2] < seq  # never answered


def test_serve_runs_idle_work_before_the_first_wait_and_after_each_answer_until_done():
    rng = _fresh_rng()
    layers = [0, 1, 3, 4]
    buf = handoff.HandoffBuffers.allocate(5, 4, 8, 4)
    reqs = _requests(rng, layers)
    for il in layers:
        reqs[il][1][0, 0] = 1  # every layer has a pair for the CPU
    calls = []  # the layers answered when each idle call came

    def idle():
        calls.append([il for il in layers if buf.done[il] >= 1])
        return len(calls) < 3  # two calls with work, the third says none is left

    got = {}
    th = threading.Thread(target=_gpu_role, args=(buf, layers, 1, reqs, got, _count_of))
    th.start()
    assert handoff.serve(buf, layers, 1, _compute, timeout_s=10, idle=idle) == 4
    th.join(10)
    assert calls == [[], [0], [0, 1]]  # none after it returned False
    for il in layers:
        h, ids, w = reqs[il]
        ref = np.zeros_like(h)
        _compute(il, h, ids, w, ref)
        np.testing.assert_allclose(got[il], ref, rtol=1e-6)


def test_serve_releases_the_gpu_when_idle_work_fails():
    buf = handoff.HandoffBuffers.allocate(3, 1, 4, 2)
    buf.flag[:] = 7
    buf.count[:] = 1
    buf.n_tok[:] = 1
    n = [0]

    def idle():
        n[0] += 1
        if n[0] == 2:
            raise RuntimeError("boom")
        return True

    with pytest.raises(RuntimeError, match="boom"):
        handoff.serve(buf, [0, 1, 2], 7, _compute, idle=idle)
    assert list(buf.done) == [7, 7, 7]


def test_serve_times_out_when_no_request_comes():
    buf = handoff.HandoffBuffers.allocate(2, 1, 4, 2)
    t0 = time.perf_counter()
    with pytest.raises(MoecacheError, match="did not hand over layer 0"):
        handoff.serve(buf, [0, 1], 1, _compute, timeout_s=0.2)
    assert time.perf_counter() - t0 < 5
    assert list(buf.done) == [1, 1]  # the pass's waits released


def test_serve_releases_the_gpu_when_compute_fails():
    buf = handoff.HandoffBuffers.allocate(3, 1, 4, 2)
    buf.flag[:] = 7
    buf.count[:] = 1
    buf.n_tok[:] = 1

    def bad(il, h, ids, w, out):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        handoff.serve(buf, [0, 1, 2], 7, bad)
    assert list(buf.done) == [7, 7, 7]


def test_check_raises_once_for_a_gpu_timeout():
    buf = handoff.HandoffBuffers.allocate(2, 1, 4, 2)
    handoff.check(buf)  # nothing recorded
    buf.err[0] = 2
    with pytest.raises(MoecacheError, match="layer 1"):
        handoff.check(buf)
    handoff.check(buf)


def test_wait_flag_sees_a_store_made_while_it_spins():
    flag = np.zeros(3, np.int64)

    def later():
        time.sleep(0.05)
        flag[1] = 5

    th = threading.Thread(target=later)
    th.start()
    assert handoff.wait_flag(flag, 1, 5, timeout_s=10)
    th.join()
    assert not handoff.wait_flag(flag, 2, 1, timeout_s=0.05)


def test_split_pairs_takes_the_last_misses_of_each_token():
    ids = np.array([[3, 1, 4, 0], [2, 5, -1, 1]], np.int32)
    slot_map = np.array([0, -1, -1, 7, -1, 2], np.int32)  # misses: experts 1, 2, 4
    cpu, gpu = handoff.split_pairs(ids, slot_map, 1)
    assert cpu.tolist() == [[-1, -1, 4, -1], [-1, -1, -1, 1]]
    assert gpu.tolist() == [[3, 1, -1, 0], [2, 5, -1, -1]]
    cpu, gpu = handoff.split_pairs(ids, slot_map, 8)
    assert cpu.tolist() == [[-1, 1, 4, -1], [2, -1, -1, 1]]
    assert gpu.tolist() == [[3, -1, -1, 0], [-1, 5, -1, -1]]
    cpu, gpu = handoff.split_pairs(ids, slot_map, 0)
    assert (cpu == -1).all() and (gpu == ids).all()
    cpu, gpu = handoff.split_pairs(ids, None, 0)  # no map: every pair is the CPU's
    assert (cpu == ids).all() and (gpu == -1).all()


def test_numpy_moe_ffn_cached_skips_pairs_of_no_expert():
    """The CPU twin of the decode kernels: a pair of id -1 adds nothing, hit or miss around it."""
    from moecache.backends import NumpyBackend
    from moecache.moe.routing import Routing
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    rng = _fresh_rng()
    fmt, n_exp, ff, d, k, t = FORMATS["Q4_K"], 6, 256, 256, 3, 4
    host = [np.stack([random_rows(fmt, rows, n_in, rng, std=0.05) for _ in range(n_exp)])
            for rows, n_in in ((ff, d), (ff, d), (d, ff))]
    slot_map = np.array([1, -1, 0, -1, -1, 2], np.int32)
    pool = tuple(a[[2, 0, 5]].copy() for a in host)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    none = rng.random((t, k)) < 0.4
    none[0, 0] = True
    h = rng.standard_normal((t, d)).astype(np.float32)
    types = (fmt.ggml_type,) * 3
    be = NumpyBackend()
    for scratch in (None, tuple(np.zeros((t * k, *a.shape[1:]), np.uint8) for a in host)):
        got = be.moe_ffn_cached(pool, types, Routing(np.where(none, -1, ids).astype(np.int32), w), h, "silu",
                                slot_map, tuple(host), scratch)
        want = be.moe_ffn(*host, types, Routing(ids, np.where(none, 0.0, w).astype(np.float32)), h, "silu")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_split_control_backs_off_a_late_share_and_probes_a_calm_one():
    sc = handoff.SplitControl(n_layer=3, k=8, late_ns=20_000, calm_ns=5_000, probe_every=2, max_probe_every=8)
    count = np.zeros(3, np.int32)
    n_miss = np.array([3, 0, 3], np.int32)
    wait = np.zeros(3, np.int64)
    # layer 0: misses left to the GPU and no wait: one more after probe_every passes; layer 1: no misses
    assert not sc.update([0, 1], count, n_miss, wait)
    assert sc.update([0, 1], count, n_miss, wait) and sc.ncpu.tolist() == [1, 0, 0]
    # the probe made the GPU wait: back to 0, and the next probe waits twice as long
    count[0], wait[0] = 1, 50_000
    assert sc.update([0], count, n_miss, wait) and sc.ncpu[0] == 0 and sc.every[0] == 4
    count[0], wait[0] = 0, 0
    assert not any(sc.update([0], count, n_miss, wait) for _ in range(3))
    assert sc.update([0], count, n_miss, wait) and sc.ncpu[0] == 1
    # a share that keeps the GPU calm grows to cover every miss, then stops (nothing left to take)
    for _ in range(40):
        count[0] = min(sc.ncpu[0], n_miss[0])
        sc.update([0], count, n_miss, wait)
    assert sc.ncpu[0] == 3
    # a wait in between (not late, not calm) holds the share
    wait[0] = 10_000
    count[0] = 2
    assert not any(sc.update([0], count, n_miss, wait) for _ in range(10))
    assert sc.ncpu[0] == 3


def test_split_control_fixed_share_holds_until_released():
    sc = handoff.SplitControl(n_layer=2, k=8, probe_every=1)
    late = np.array([50_000, 50_000], np.int64)
    sc.fix(3)
    assert sc.ncpu.tolist() == [3, 3]
    assert not sc.update([0, 1], np.array([3, 3], np.int32), np.array([5, 5], np.int32), late)
    assert sc.ncpu.tolist() == [3, 3]  # a late GPU does not move a pinned share
    sc.fix(None)
    assert sc.ncpu.tolist() == [0, 0]
    # adaptive again: a calm layer with misses left probes one more at once (probe_every 1)
    assert sc.update([0], np.zeros(2, np.int32), np.array([5, 5], np.int32), np.zeros(2, np.int64))
    assert sc.ncpu.tolist() == [1, 0]
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="fixed share"):
            sc.fix(bad)



def test_inline_handoff_share_zero_layer_posts_counts_only():
    """The CPU twin of handoff_post: with a slot map and ncpu 0 a layer writes its counts (no pairs
    for the CPU, every miss counted) but no rows and no flag, as the GPU kernel does; a layer with a
    share posts its rows and its flag, and its answer is added."""
    hf = handoff.InlineHandoff(2, 4, 8, 4, lambda il, h, ids, w, out: out.__setitem__(Ellipsis, 1.0))
    hf.go(3)
    slot_map = np.array([0, -1, 1, -1, -1, 2], np.int32)  # experts 1, 3, 4 are misses
    ids = np.array([[0, 1, 3, 5]], np.int32)
    h = np.full((1, 8), 7.0, np.float32)
    w = np.ones((1, 4), np.float32)
    gpu = hf.post(0, h, ids, w, slot_map, np.array([0, 2], np.int32))
    b = hf.buf
    np.testing.assert_array_equal(gpu, ids)  # every pair stays the GPU's
    assert b.count[0] == 0 and b.n_miss[0] == 2 and b.n_tok[0] == 1 and b.flag[0] < 3 and not b.h.any()
    np.testing.assert_array_equal(hf.wait(0, np.zeros((1, 8), np.float32), add=True), 0.0)
    gpu = hf.post(1, h, ids, w, slot_map, np.array([0, 2], np.int32))
    np.testing.assert_array_equal(gpu, [[0, -1, -1, 5]])  # the last two misses are the CPU's
    assert b.count[1] == 2 and b.n_miss[1] == 2 and b.flag[1] == 3 and (b.h[0] == 7.0).all()
    np.testing.assert_array_equal(hf.wait(1, np.zeros((1, 8), np.float32), add=True), 1.0)


def _two_halves_gpu(bufs, layers, seq, reqs, got):
    """The GPU's side of a step in two halves: per layer it posts half 0's request, then half 1's,
    then waits for half 0's answer before half 0's next post (and half 1's before half 1's), as
    DecoderLM._body_halves orders the kernels; ``reqs[(half, il)]`` are the requests, answers go
    to ``got[(half, il)]``."""
    owed = [None, None]

    def wait(half):
        if owed[half] is None:
            return
        il, t = owed[half]
        t_end = time.monotonic() + 10
        while bufs[half].done[il] < seq:
            assert time.monotonic() < t_end, "no answer"
        got[(half, il)] = bufs[half].out[:t].copy()
        owed[half] = None

    for il in layers:
        for half in (0, 1):
            wait(half)  # the layer before's answer of this half
            h, ids, w = reqs[(half, il)]
            b, t = bufs[half], h.shape[0]
            b.h[:t], b.ids[:t], b.w[:t] = h, ids, w
            b.count[il] = _count_of(ids)
            b.n_tok[il] = t
            b.flag[il] = seq
            if b.count[il]:
                owed[half] = (il, t)
    for half in (0, 1):
        wait(half)


def test_serve_answers_two_halves_buffer_by_buffer():
    """serve with two buffers (a step in halves): each layer's request of half 0, then half 1's,
    answered with that half's rows while the other half's post is already there; a request with
    nothing for the CPU is skipped; the answers equal each request's own computation."""
    rng = _fresh_rng()
    layers = [0, 1, 3]
    bufs = [handoff.HandoffBuffers.allocate(4, 4, 8, 4) for _ in range(2)]
    reqs = {(half, il): r for half in (0, 1) for il, r in _requests(rng, layers).items()}
    reqs[(1, 1)][1][...] = -1  # half 1 has nothing for the CPU at layer 1
    order = []

    def compute(il, h, ids, w, out):
        order.append((il, h.copy()))
        _compute(il, h, ids, w, out)

    got = {}
    th = threading.Thread(target=_two_halves_gpu, args=(bufs, layers, 1, reqs, got))
    th.start()
    n = handoff.serve(bufs, layers, 1, compute, timeout_s=10)
    th.join(10)
    assert not th.is_alive()
    want = [(half, il) for il in layers for half in (0, 1) if (half, il) != (1, 1)]
    assert n == 5 and sorted(got) == sorted(want)
    assert [il for il, _ in order] == [il for _, il in want]
    for (half, il), (il2, h) in zip(want, order):
        np.testing.assert_array_equal(h, reqs[(half, il)][0])  # that half's own rows
    for key in want:
        h, ids, w = reqs[key]
        ref = np.zeros_like(h)
        _compute(key[1], h, ids, w, ref)
        np.testing.assert_allclose(got[key], ref, rtol=1e-6)
    assert bufs[1].done[1] < 1  # never answered


def test_serve_releases_every_buffer_when_compute_fails():
    """An error answering one half releases both halves' waits on the GPU (done = seq in every
    buffer), so neither sits out its timeout."""
    bufs = [handoff.HandoffBuffers.allocate(3, 2, 8, 4) for _ in range(2)]
    for b in bufs:
        b.count[:] = 1
        b.n_tok[:] = 1
        b.ids[0, 0] = 0
        b.flag[:] = 4

    def bad(il, h, ids, w, out):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        handoff.serve(bufs, [0, 1, 2], 4, bad, timeout_s=5)
    assert all((b.done == 4).all() for b in bufs)
