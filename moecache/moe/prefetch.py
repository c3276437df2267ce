"""The next host-expert layer's experts on their way to the GPU while this layer computes.

A prompt ubatch whose routed experts stay in host RAM (``--cpu-moe``, ``--n-cpu-moe``) copies the
experts it uses to the GPU, layer by layer (op offload, :class:`~moecache.moe.executor.CPUExperts`).
Without this module the copy and the compute of a layer run one after the other on one stream: on
the H200 machine the ``pinned-*`` cases of ``../shared/vs-llamacpp.md`` (every expert in page-locked
host RAM) make 3797 t/s at pp2048 (-ub 2048), while copying the 16.3 GB of experts alone takes
~330 ms of a ubatch's ~540 (``bench/results/vs-llamacpp-h200.md``, run ``h200-s9m``). (The expert
cache, the 8 GiB cases, can copy ahead on its own with its opt-in ``prompt_stacks`` given
two buffers (``prompt_stack_buffers = 2``; one, the default, copies no layer ahead):
:meth:`CachedExperts._prompt_stack <moecache.moe.cache.CachedExperts._prompt_stack>` copies only
the next layer's experts not resident in its slots, through the same ``start_upload`` /
``finish_upload``; this module does not apply there.) The next layer's routing is unknown until
its router runs, but a ubatch of T tokens with k experts each uses nearly every expert of a layer
once T * k is a few times the layer's experts (1 - exp(-T * k / n_expert) of them under uniform
routing): so while layer il computes, all of layer il+1's experts are copied on the GPU's copy
stream, and layer il+1 computes from them without a copy of its own. The cost: one more layer of
experts in VRAM while a prompt runs (CuPy's pool keeps the blocks afterwards; not counted in the
placement's reserve or in ``--vram-budget``), and the bytes of the experts the ubatch does not use.
An upload left in flight when a forward pass stops early (an exception) holds its layer's memory
until the next offloaded ubatch drops it.

:class:`LayerPrefetch` is shared by the host-expert layers of a placement (one upload in flight at
a time); the backends' ``start_upload`` / ``finish_upload`` do the copying (the CPU twin's arrays
hold NaN bytes until finished, so a use before the copy shows in the CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moecache.moe.executor import ExpertWeights

# prefetch when a ubatch's (token, expert) pairs are at least this many times the experts of a
# layer: under uniform routing 1 - exp(-2) = 86% of them are then used
MIN_PAIRS_PER_EXPERT = 2


@dataclass
class _Flight:
    layer: int
    upload: Any  # the backend's handle (start_upload)
    backend: Any
    tag: Any = None  # what the caller of begin() keeps with it


class LayerPrefetch:
    """Copies the next host-expert layer's experts to its GPU during the current layer's compute.

    Args:
        layers: layer index -> (its host experts, the backend its offloaded ubatches run on); the
            layers whose prompt ubatches copy their experts to a GPU.
        min_pairs_per_expert: prefetch only for ubatches with at least this many (token, expert)
            pairs per expert of the next layer.

    Attributes:
        started, used, dropped: uploads begun, uploads a layer computed from, uploads discarded (the
            next call was not the layer they were for, or a ubatch too small to offload).
        bytes: expert bytes copied by the uploads begun.
    """

    def __init__(self, layers: dict[int, tuple[ExpertWeights, Any]],
                 min_pairs_per_expert: float = MIN_PAIRS_PER_EXPERT):
        self.layers = layers
        self.order = sorted(layers)
        self._next = {il: nxt for il, nxt in zip(self.order, self.order[1:])}
        self.min_pairs_per_expert = min_pairs_per_expert
        self._flight: _Flight | None = None
        self.started = self.used = self.dropped = 0
        self.bytes = 0

    def holds(self, il: int) -> bool:
        """Whether the upload in flight is layer ``il``'s."""
        return self._flight is not None and self._flight.layer == il

    def take(self, il: int) -> tuple[Any, Any, Any] | None:
        """Layer ``il``'s experts (gate, up, down), whole stacks on its offload backend, if an upload of
        them is in flight; None otherwise. Any other upload in flight is dropped (:meth:`drop`)."""
        got = self.take_tagged(il)
        return None if got is None else got[0]

    def take_tagged(self, il: int) -> tuple[tuple[Any, ...], Any] | None:
        """:meth:`take`, with the ``tag`` given to :meth:`begin`: (arrays, tag) or None. The compute
        stream waits for the copy (``finish_upload``, no host wait)."""
        f = self._flight
        if f is not None and f.layer == il:
            self._flight = None
            self.used += 1
            return f.backend.finish_upload(f.upload), f.tag
        self.drop()
        return None

    def take_unfinished(self, il: int) -> tuple[Any, Any] | None:
        """:meth:`take_tagged` without the wait: (the upload, its tag) or None; the caller calls
        ``finish_upload`` when it needs the arrays (work it queues before then does not wait for the
        copy). Any other upload in flight is dropped."""
        f = self._flight
        if f is not None and f.layer == il:
            self._flight = None
            self.used += 1
            return f.upload, f.tag
        self.drop()
        return None

    def begin(self, il: int, backend: Any, upload: Any, nbytes: int, tag: Any = None) -> None:
        """Count an upload of layer ``il``'s experts that the caller began (``backend.start_upload``:
        ``nbytes`` bytes) as the one in flight, with ``tag`` kept for :meth:`take_tagged`; one in
        flight before it is dropped. The expert cache's prompt stacks start their own uploads (the
        next layer's non-resident experts, into a buffer of theirs) and keep them here."""
        self.drop()
        self._flight = _Flight(il, upload, backend, tag)
        self.started += 1
        self.bytes += nbytes

    def start_after(self, il: int, n_pairs: int) -> bool:
        """Begin the upload of the host-expert layer after ``il`` (in layer order) for a ubatch of
        ``n_pairs`` (token, expert) pairs; call it before queueing layer ``il``'s compute. Returns
        whether an upload began (not for the last layer, a small ubatch, or a backend that cannot
        copy asynchronously from these weights)."""
        nxt = self._next.get(il)
        if nxt is None:
            return False
        e, be = self.layers[nxt]
        if n_pairs < self.min_pairs_per_expert * e.gate.shape[0]:
            return False
        up = be.start_upload((e.gate, e.up, e.down))
        if up is None:
            return False
        self.begin(nxt, be, up, int(e.gate.nbytes + e.up.nbytes + e.down.nbytes))
        return True

    def drop(self) -> None:
        """Discard the upload in flight (a ubatch that will not reach its layer, or one an exception
        cut short). The compute stream first waits for its copy (``finish_upload``, no host wait):
        its arrays go back to the compute stream's memory pool, and the next allocation there must
        not get memory the copy stream is still writing."""
        f, self._flight = self._flight, None
        if f is not None:
            f.backend.finish_upload(f.upload)
            self.dropped += 1
