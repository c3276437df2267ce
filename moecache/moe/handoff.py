"""The host handoff: a captured GPU decode step gives a layer's routed experts to the CPU and takes
their sum back without ending the CUDA graph.

Per layer the step runs two small kernels (``handoff_post`` and ``handoff_wait`` of
``moecache/backends/cuda/ops.cu``) around whatever else the GPU computes for that layer:

1. ``handoff_post`` writes the layer's input rows ``h`` and the pairs the CPU takes (ids and routing
   weights; the others' ids -1) into page-locked host buffers, sets ``count[il]`` and ``n_tok[il]``,
   and then ``flag[il]`` = the pass number (system-scope fences between data and flag).
2. The host, spinning on ``flag[il]`` (:func:`serve`, in the thread that launched the graph),
   computes the pairs with the Numba kernels into ``out`` and sets ``done[il]`` = the pass number.
3. ``handoff_wait`` spins on ``done[il]`` (only when ``count[il]`` > 0) and copies or adds ``out``
   into the layer's output on the device.

A layer whose share is 0 (the expert cache's split, ``ncpu[il]`` = 0) posts only its counts: no rows,
no system-scope fences and no flag, and the host does not serve it (the cache lists the layers with a
share), so a layer plan's GPU-only layers cost one short kernel each, not two PCIe round trips.

Against ending the graph at each such layer (a stream synchronisation, four copies and a launch from
Python per layer: ~77-107 us per layer on the H200 machine, ``bench/cpu_moe_step.py``), the handoff
costs the two kernels and the PCIe round trips of the flags.

The pass number comes from the host (``go[0]``, copied to the device before the launch), so a
replayed graph needs no new parameters. Both spins are bounded: the host raises
:class:`moecache.errors.MoecacheError` when no request comes within ``timeout_s``; the GPU stops
waiting after its own timeout, records the layer in ``err`` and counts the CPU's part as zero
(:func:`check` raises after the pass). A host that fails while the GPU waits releases every layer of
the pass (``done[:] = seq``) before the error propagates, so the GPU does not sit out its timeout.

The buffers are plain numpy arrays here; the CUDA side allocates them page-locked
(``moecache.backends.handoff_cuda.CudaHandoff``). The CPU tests drive :func:`serve` with a thread in the GPU's
role.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from moecache.quants import _numba_setup  # noqa: F401  (configures numba before any @njit)

import numpy as np
from numba import errors, njit, types
from numba.extending import intrinsic

from moecache.errors import MoecacheError

SPIN_ITERS = 1 << 16  # flag reads per compiled spin before Python looks at the clock (~0.1-1 ms)


@dataclass
class HandoffBuffers:
    """The host side of one handoff (page-locked on a GPU machine). Per layer ``il``:

    - ``flag`` int64 (n_layer,): the pass number of the layer's last request (written by the GPU);
    - ``done`` int64 (n_layer,): the pass number of the layer's last answer (written by the host);
    - ``count`` int32 (n_layer,): pairs for the CPU in the last request (0: nothing to compute);
    - ``n_tok`` int32 (n_layer,): tokens (rows) of the last request;
    - ``n_miss`` int32 (n_layer,): the last request's misses (pairs whose expert has no slot; every
      pair without a slot map), the CPU's among them;
    - ``wait_ns`` int64 (n_layer,): how long the GPU waited for the last answer (0: no pairs).

    One request at a time (the GPU waits for an answered layer before it posts the next one):
    ``h`` float32 (max_tok, n_embd) input rows, ``ids`` int32 (max_tok, k) the CPU's experts
    (-1: not the CPU's pair), ``w`` float32 (max_tok, k) routing weights, ``out`` float32
    (max_tok, n_embd) the CPU's sum. ``go`` int64 (1,): the pass number the host sets before a
    launch; ``err`` int32 (1,): 1 + the layer whose answer the GPU stopped waiting for (0: none).
    """

    flag: np.ndarray
    done: np.ndarray
    count: np.ndarray
    n_tok: np.ndarray
    n_miss: np.ndarray
    wait_ns: np.ndarray
    h: np.ndarray
    ids: np.ndarray
    w: np.ndarray
    out: np.ndarray
    go: np.ndarray
    err: np.ndarray

    @classmethod
    def allocate(cls, n_layer: int, max_tok: int, n_embd: int, k: int,
                 empty: Callable[..., np.ndarray] = np.empty) -> "HandoffBuffers":
        """Zeroed buffers from ``empty(shape, dtype)`` (numpy's, or a page-locked allocator)."""
        def z(shape, dtype):
            a = empty(shape, dtype)
            a[...] = 0
            return a

        return cls(z((n_layer,), np.int64), z((n_layer,), np.int64), z((n_layer,), np.int32),
                   z((n_layer,), np.int32), z((n_layer,), np.int32), z((n_layer,), np.int64),
                   z((max_tok, n_embd), np.float32), z((max_tok, k), np.int32),
                   z((max_tok, k), np.float32), z((max_tok, n_embd), np.float32), z((1,), np.int64),
                   z((1,), np.int32))


@intrinsic
def _load_acquire_i64(typingctx, arr, i):
    """``arr[i]`` as an atomic acquire load: read from memory on every call (a plain load in a loop
    may be hoisted out of it by LLVM), and no later load moves before it."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1 and arr.layout == "C"):
        raise errors.TypingError(f"_load_acquire_i64: expected a C-contiguous 1-D int64 array, got {arr}")
    if not isinstance(i, types.Integer):
        raise errors.TypingError(f"_load_acquire_i64: expected an integer index, got {i}")

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        a = context.make_array(aty)(context, builder, args[0])
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = builder.gep(a.data, [idx])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, i), codegen


@intrinsic
def _store_release_i64(typingctx, arr, i, v):
    """``arr[i] = v`` as an atomic release store: every earlier store (the answer's rows) is visible
    before it, on any CPU (x86 keeps stores in order anyway; aarch64 does not)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1 and arr.layout == "C"):
        raise errors.TypingError(f"_store_release_i64: expected a C-contiguous 1-D int64 array, got {arr}")
    if not (isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        raise errors.TypingError(f"_store_release_i64: expected integer index and value, got {i}, {v}")

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(val, builder.gep(a.data, [idx]), "release", 8)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


@njit(nogil=True, cache=True)
def _release(flag, i, value):  # pragma: no cover - compiled
    _store_release_i64(flag, i, value)


@njit(nogil=True, cache=True)
def _spin(flag, i, want, iters):  # pragma: no cover - compiled
    """True once ``flag[i] >= want``; False after ``iters`` reads without it (the GIL is released)."""
    for _ in range(iters):
        if _load_acquire_i64(flag, i) >= want:
            return True
    return False


def wait_flag(flag: np.ndarray, i: int, want: int, timeout_s: float) -> bool:
    """Spin until ``flag[i] >= want`` (int64 1-D ``flag``, written by another agent); False after
    ``timeout_s`` seconds without it."""
    t_end = None
    while not _spin(flag, i, want, SPIN_ITERS):
        now = time.perf_counter()
        if t_end is None:
            t_end = now + timeout_s
        elif now > t_end:
            return False
    return True


# compute(il, h (T, n_embd), ids (T, k) with -1 = not the CPU's pair, w (T, k), out (T, n_embd) zeroed)
Compute = Callable[[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]


def serve(buf: HandoffBuffers | Sequence[HandoffBuffers], layers: list[int], seq: int, compute: Compute,
          timeout_s: float = 30.0, idle: Callable[[], bool] | None = None) -> int:
    """Answer one pass's requests: for each of ``layers`` in step order wait for ``flag[il] >= seq``,
    and when the request has pairs for the CPU, run ``compute`` on them into ``out`` (zeroed first)
    and set ``done[il] = seq`` (a release store, after ``out``'s).

    ``buf``: one handoff's buffers, or several (a batched step run in halves, each half posting to
    its own handoff: :meth:`moecache.models.base.DecoderLM.halves_for`); each layer's requests are
    then answered buffer by buffer, in the order given, which is the order the GPU posts them in.

    ``idle``: short host work put into the pass's gaps: called once before the first wait and once
    after each answer, until it returns False (no work left). After an answer the GPU still has the
    layer's tail and the next layer's attention and router to run before it posts again (~0.1 ms a
    layer at 8 tokens on the H200 machine, ``bench/decode_profile.py --host-times``), time this
    thread otherwise spins through; a call longer than that delays the next answer. The caller
    keeps each call short; the first comes before the GPU's first post, ~0.1 ms after the launch.

    Returns the requests computed. Raises MoecacheError when a request does not come within
    ``timeout_s`` (the GPU step failed or was never launched); any error (``idle``'s too) releases
    the pass's remaining waits on the GPU first (``done[:] = seq`` in every buffer).
    """
    bufs = (buf,) if isinstance(buf, HandoffBuffers) else tuple(buf)
    n = 0
    try:
        busy = idle is not None and idle()
        for il in layers:
            for b in bufs:
                if not wait_flag(b.flag, il, seq, timeout_s):
                    raise MoecacheError(f"the GPU step did not hand over layer {il}'s experts within {timeout_s:.0f} s "
                                        f"(pass {seq}): the step failed on the GPU")
                if b.count[il] == 0:
                    continue
                t = int(b.n_tok[il])
                out = b.out[:t]
                out[...] = 0.0
                compute(il, b.h[:t], b.ids[:t], b.w[:t], out)
                _release(b.done, il, seq)  # after out's stores
                n += 1
                if busy:
                    busy = idle()
    except BaseException:
        for b in bufs:
            b.done[...] = seq
        raise
    return n


def split_pairs(ids: np.ndarray, slot_map: np.ndarray | None, n_cpu: int) -> tuple[np.ndarray, np.ndarray]:
    """Which routed pairs the CPU takes (``handoff_post``'s rule, its CPU twin): every pair when
    ``slot_map`` is None; else up to ``n_cpu`` of each token's misses (``slot_map[e] < 0``), the last
    ones in pair order. ``ids`` int32 (T, k), -1 = no pair.

    Returns (cpu_ids, gpu_ids), int32 (T, k) each: the pair's expert where that side computes it,
    else -1."""
    ids = np.asarray(ids, np.int32)
    cpu = np.zeros(ids.shape, bool)
    cap = ids.shape[1] if slot_map is None else n_cpu
    for t in range(ids.shape[0]):
        taken = 0
        for j in range(ids.shape[1] - 1, -1, -1):
            e = ids[t, j]
            if e >= 0 and taken < cap and (slot_map is None or slot_map[e] < 0):
                cpu[t, j] = True
                taken += 1
    return np.where(cpu, ids, -1).astype(np.int32), np.where(cpu, -1, ids).astype(np.int32)


def check_request(max_tok: int, n_embd: int, k: int, h_shape: tuple, ids_shape: tuple, slot_map, ncpu) -> None:
    """A post's arguments against its handoff's buffers (ValueError otherwise): ``h`` (T, n_embd)
    with T <= ``max_tok``, ``ids`` (T, k), a slot map only with ``ncpu``."""
    if (slot_map is None) != (ncpu is None):
        raise ValueError("handoff: a slot map and ncpu go together")
    t = h_shape[0]
    if t > max_tok or h_shape[1] != n_embd or tuple(ids_shape) != (t, k):
        raise ValueError(f"handoff: a request of {tuple(h_shape)} / {tuple(ids_shape)} does not fit buffers of "
                         f"({max_tok}, {n_embd}) / ({max_tok}, {k})")


def check(buf: HandoffBuffers | Sequence[HandoffBuffers]) -> None:
    """Raise MoecacheError when the GPU gave up waiting for an answer in the pass just finished
    (its output is then wrong); resets the record. ``buf``: one handoff's buffers or several (a
    step in halves, as :func:`serve` takes them): every record is reset, the first one set named."""
    bufs = (buf,) if isinstance(buf, HandoffBuffers) else tuple(buf)
    errs = [int(b.err[0]) for b in bufs]
    for b in bufs:
        b.err[0] = 0
    e = next((e for e in errs if e), 0)
    if e:
        raise MoecacheError(f"the GPU stopped waiting for the CPU's experts of layer {e - 1}: that step's "
                            f"output is wrong (the host did not answer in time)")


class InlineHandoff:
    """The CPU twin of ``CudaHandoff`` (:mod:`moecache.backends.handoff_cuda`), for a backend without
    a device: :meth:`post` splits the pairs by the same rule (:func:`split_pairs`) and fills the same
    buffers; :meth:`wait` answers at once by calling ``compute`` (no other thread, no spin)."""

    inline = True

    def __init__(self, n_layer: int, max_tok: int, n_embd: int, k: int, compute: Compute):
        self.max_tok, self.n_embd, self.k, self.compute = max_tok, n_embd, k, compute
        self.buf = HandoffBuffers.allocate(n_layer, max_tok, n_embd, k)
        self.seq = 0

    def go(self, seq: int, stream: Any = None) -> None:
        self.seq = seq

    def post(self, il: int, h: np.ndarray, ids: np.ndarray, w: np.ndarray, slot_map: np.ndarray | None = None,
             ncpu: np.ndarray | None = None) -> np.ndarray | None:
        check_request(self.max_tok, self.n_embd, self.k, h.shape, ids.shape, slot_map, ncpu)
        t = h.shape[0]
        ids = np.asarray(ids, np.int32)
        cap = int(ncpu[il]) if ncpu is not None else 0
        cpu, gpu = split_pairs(ids, slot_map, cap)
        b = self.buf
        b.count[il] = int((cpu >= 0).sum())
        b.n_miss[il] = int(((ids >= 0) & (np.asarray(slot_map)[np.maximum(ids, 0)] < 0)).sum()) \
            if slot_map is not None else int((ids >= 0).sum())
        b.n_tok[il] = t
        if slot_map is None or cap > 0:  # as handoff_post: a layer without a share posts no rows and no flag
            b.h[:t], b.ids[:t], b.w[:t] = h, cpu, w
            b.flag[il] = self.seq
        return gpu if slot_map is not None else None

    def wait(self, il: int, out: np.ndarray, add: bool) -> np.ndarray:
        b = self.buf
        part = np.zeros(out.shape, np.float32)
        if b.count[il]:
            t = int(b.n_tok[il])
            self.compute(il, b.h[:t], b.ids[:t], b.w[:t], part)
            b.done[il] = self.seq
        b.wait_ns[il] = 0
        if add:  # in place, as the GPU's wait adds into ``out``: a caller may hold it already
            out += part
            return out
        return part


@dataclass
class SplitControl:
    """How many of each token's misses the CPU takes, per layer (``ncpu``, int32 (n_layer,), from 0:
    every miss read by the GPU over PCIe, to ``k``: every miss on the CPU), refit after every pass
    from what the handoff measured (:meth:`update`).

    The signal is the GPU's wait for the CPU's answer (``wait_ns``): a wait over ``late_ns`` means
    the CPU's share took longer than the GPU's own work on the layer (hits and the remaining misses),
    so the share shrinks by one miss per token. A layer whose GPU still read misses itself and did
    not wait (at most ``calm_ns``: the flag's PCIe round trip) for ``probe_every`` passes in a row
    tries one more; a probe that turns out late doubles that layer's wait before the next probe (up
    to ``max_probe_every``), one that holds restores it. Shares 0 and ``k`` are the two single
    paths. One share per layer serves every batch size (a batch's tokens each take up to ``ncpu``).

    :meth:`fix` pins every layer's share (a benchmark's sweep, ``bench/miss_split.py``): ``update``
    then changes nothing until ``fix(None)``. :meth:`set_shares` sets each layer's share from the
    expert cache's layer plan (``--cache-plan layer``: 0 to ``k`` per layer); ``update`` then changes
    nothing, and ``fix(None)`` gives the plan's shares back.
    """

    n_layer: int
    k: int
    late_ns: int = 20_000
    calm_ns: int = 5_000
    probe_every: int = 8
    max_probe_every: int = 512
    ncpu: np.ndarray = field(init=False)
    calm: np.ndarray = field(init=False)
    every: np.ndarray = field(init=False)
    probed: np.ndarray = field(init=False)
    fixed: int | None = field(init=False, default=None)
    plan_shares: np.ndarray | None = field(init=False, default=None)  # set_shares' (None: no plan)

    def __post_init__(self):
        self.ncpu = np.zeros(self.n_layer, np.int32)
        self.calm = np.zeros(self.n_layer, np.int64)
        self.every = np.full(self.n_layer, self.probe_every, np.int64)
        self.probed = np.zeros(self.n_layer, bool)

    @property
    def planned(self) -> bool:
        """The shares come from a plan (:meth:`set_shares`), not from :meth:`update`."""
        return self.plan_shares is not None

    def update(self, layers: list[int], count: np.ndarray, n_miss: np.ndarray, wait_ns: np.ndarray) -> bool:
        """After a pass: ``layers`` that posted, and per layer (arrays indexed by layer) the CPU's
        pairs, the misses and the GPU's wait in ns. Returns whether ``ncpu`` changed."""
        if self.fixed is not None or self.planned:
            return False
        changed = False
        for il in layers:
            late = wait_ns[il] > self.late_ns
            if late and self.ncpu[il] > 0:
                self.ncpu[il] -= 1
                if self.probed[il]:  # the last probe was one too many: wait longer before the next
                    self.every[il] = min(2 * self.every[il], self.max_probe_every)
                self.calm[il] = 0
                changed = True
            elif not late and wait_ns[il] <= self.calm_ns and n_miss[il] > count[il] and self.ncpu[il] < self.k:
                self.calm[il] += 1
                if self.calm[il] >= self.every[il]:
                    self.ncpu[il] += 1
                    self.calm[il] = 0
                    self.probed[il] = True
                    changed = True
                    continue
                if self.probed[il]:  # the probe held: the next one comes at the usual pace
                    self.every[il] = self.probe_every
            else:
                self.calm[il] = 0
            self.probed[il] = False
        return changed

    def set_shares(self, ncpu: np.ndarray) -> None:
        """Each layer's share from a plan (int (n_layer,), each in [0, k], else ValueError); the
        shares stay until the next call (``update`` does not refit them)."""
        ncpu = np.asarray(ncpu)
        if ncpu.shape != self.ncpu.shape or (ncpu < 0).any() or (ncpu > self.k).any():
            raise ValueError(f"set_shares: expected {self.ncpu.shape[0]} shares in [0, {self.k}], got {ncpu}")
        self.plan_shares = ncpu.astype(np.int32)
        if self.fixed is None:  # a benchmark's pinned share (fix) holds until fix(None)
            self.ncpu[:] = ncpu

    def fix(self, share: int | None) -> None:
        """Pin every layer's share to ``share`` misses per token (0 to ``k``, else ValueError), or
        give the shares back (None): to a layer plan's (:meth:`set_shares`), else to :meth:`update`,
        starting again from 0."""
        if share is not None and not 0 <= share <= self.k:
            raise ValueError(f"a fixed share must be in [0, {self.k}], got {share}")
        self.fixed = share
        if share is None and self.plan_shares is not None:
            self.ncpu[:] = self.plan_shares
        else:
            self.ncpu[:] = 0 if share is None else share
        self.calm[:] = 0
        self.every[:] = self.probe_every
        self.probed[:] = False
