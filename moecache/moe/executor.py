"""Expert execution: the one interface a MoE layer calls to compute its routed experts.

The model computes the router on its own (architecture-specific gating) and hands the result, a
:class:`Routing`, to an :class:`ExpertExecutor`. :class:`CPUExperts` computes every routed expert
with the Numba kernel :func:`moecache.quants.cpu.moe_ffn` (the plain CPU path, and the miss path of
the expert cache). The expert-cache executor replaces it with the same call signature: split the
routed pairs into hits (resident in VRAM slots, computed on the GPU) and misses (computed here),
run both at once and sum them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from moecache.moe.prefetch import LayerPrefetch
from moecache.moe.routing import Routing
from moecache.quants import cpu


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts, stacked as in the GGUF (``blk.N.ffn_{gate,up,down}_exps``).

    Attributes:
        gate, up: uint8 (n_expert, expert_ff, row_bytes); down: uint8 (n_expert, n_embd, row_bytes).
        types: GGML type ids of (gate, up, down).
        act: "silu" (SwiGLU) or "gelu" (GeGLU).
    """

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    types: tuple[int, int, int]
    act: str = "silu"


class RoutedCalls:
    """The layers' CPU expert calls prepared once (:class:`moecache.quants.cpu.RoutedExperts`: the
    weights' checks and the kernel's lookup out of the per-call road), made at a layer's first call
    and made again when the layer's :class:`ExpertWeights` or ``act_q8`` changes."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[ExpertWeights, cpu.RoutedExperts]] = {}

    def get(self, il: int, e: ExpertWeights, act_q8: bool) -> cpu.RoutedExperts:
        c = self._calls.get(il)
        if c is None or c[0] is not e or c[1].act_q8 != bool(act_q8):
            c = (e, cpu.RoutedExperts(e.gate, e.up, e.down, e.types, cpu.act_code(e.act), act_q8))
            self._calls[il] = c
        return c[1]


class ExpertExecutor(Protocol):
    """Computes ``sum_k w[t,k] * expert_{ids[t,k]}(h[t])`` for every token t of one layer."""

    def __call__(self, il: int, h: Any, routing: Routing) -> Any:
        """``h``: float32 (T, n_embd) backend array -> float32 (T, n_embd) backend array."""
        ...

    def graph_capturable(self) -> str | None:
        """None if a one-token decode step through this executor can be captured in a CUDA graph
        (no host synchronisation, no host-side work per step), else the reason it cannot."""
        ...


class CPUExperts:
    """Routed experts kept in host RAM, computed on the CPU (Numba) from the host copy of the weights.

    With ``offload_min_batch`` set, ubatches of that many tokens or more instead copy the experts
    they use to the layer's backend and compute there (llama.cpp's op offload of host-resident
    experts for prompt processing: one copy of each used expert serves many tokens).

    Args:
        layers: layer index -> that layer's experts.
        backend: the layer's backend, for moving h to the host and the result back (a no-op on
            the CPU backend) and for offloaded ubatches; None = numpy arrays in and out.
        offload_min_batch: tokens from which a ubatch is offloaded; None = never.
        offload_backend: the GPU offloaded ubatches run on (the one with the fastest host link);
            default: the layer's backend. h moves there and the result comes back.
        act_q8: the Numba kernel rounds activations to 8 bits per 32 values and takes integer dots
            for Q4_K and Q6_K experts (``cpu.moe_ffn_routed(act_q8=True)``, the GPU's rounding rule); False = float32.
    """

    def __init__(self, layers: dict[int, ExpertWeights], backend: Any = None, offload_min_batch: int | None = None,
                 offload_backend: Any = None, prefetch: LayerPrefetch | None = None, act_q8: bool = False):
        self.layers = layers
        self.act_q8 = act_q8
        self.backend = backend
        self.offload_min_batch = offload_min_batch
        self.offload_backend = offload_backend if offload_backend is not None else backend
        self.offloaded_bytes = 0  # expert bytes copied to the backend so far (op offload)
        # offloaded ubatches: the next host-expert layer's experts copied while this one computes
        # (shared by the layers of a placement); None = each layer copies its own used experts
        self.prefetch = prefetch
        self.calls = RoutedCalls()

    def __call__(self, il: int, h: Any, routing: Routing) -> Any:
        e = self.layers[il]
        r = routing.host()
        be = self.backend
        if be is not None and self.offload_min_batch is not None and r.ids.shape[0] >= self.offload_min_batch:
            return self._offload(il, e, h, r)
        if self.prefetch is not None:
            self.prefetch.drop()  # a ubatch computed here never reaches an upload's layer
        hh = np.ascontiguousarray(be.to_host(h) if be is not None else h, dtype=np.float32)
        out = self.compute_host(il, hh, r, np.zeros((hh.shape[0], e.down.shape[1]), np.float32))
        return be.asarray(out) if be is not None else out

    def compute_host(self, il: int, h: np.ndarray, routing: Routing, out: np.ndarray) -> np.ndarray:
        """Layer ``il``'s routed experts on host arrays, accumulated into ``out`` (what a CUDA-graph
        decode step runs between its segments: :mod:`moecache.backends.cuda_graph`).

        Args:
            h: float32 (T, n_embd); routing: host arrays; out: float32 (T, n_embd), added to.
        Returns ``out``."""
        r = routing.host()
        return self.calls.get(il, self.layers[il], self.act_q8)(r.ids, r.weights, h, out)

    def _offload(self, il: int, e: ExpertWeights, h: Any, r: Routing) -> Any:
        ob = self.offload_backend
        moved = ob is not self.backend
        if moved:
            ob.activate()
            h = ob.adopt(h)
        whole = self.prefetch.take(il) if self.prefetch is not None else None
        if whole is not None:  # every expert of the layer, copied while the layer before computed
            parts, local = list(whole), Routing(np.ascontiguousarray(r.ids, dtype=np.int32), r.weights)
        else:
            used = np.unique(r.ids)
            parts = [ob.upload_experts(w, used) for w in (e.gate, e.up, e.down)]
            local = Routing(np.searchsorted(used, r.ids).astype(np.int32), r.weights)
        self.offloaded_bytes += sum(int(p.nbytes) for p in parts)
        if self.prefetch is not None:
            self.prefetch.start_after(il, r.ids.size)  # queued before this layer's compute: they overlap
        out = ob.moe_ffn(*parts, e.types, local, h, e.act)
        if moved:
            self.backend.activate()
            out = self.backend.adopt(out)
        return out

    def graph_capturable(self) -> str | None:
        return "routed experts in host RAM"  # computed by the CPU (host synchronisation every step)


class DeviceExperts:
    """Routed experts resident on a backend (all of them, for the layers given): the full-GPU path.

    Args:
        layers: layer index -> that layer's experts (host views; copied to ``backend`` here).
        backend: where they live and are computed (its ``upload`` and ``moe_ffn``).
    """

    def __init__(self, layers: dict[int, ExpertWeights], backend: Any):
        self.backend = backend
        self.layers = {il: (backend.upload(e.gate), backend.upload(e.up), backend.upload(e.down), e.types, e.act)
                       for il, e in layers.items()}

    def __call__(self, il: int, h: Any, routing: Routing) -> Any:
        g, u, d, types, act = self.layers[il]
        return self.backend.moe_ffn(g, u, d, types, routing, h, act)

    def graph_capturable(self) -> str | None:
        return None  # one backend call per layer, routing read on the device


class ExpertsByLayer:
    """One executor per layer (the placement: host experts on some layers, resident on others).

    Args:
        executors: layer index -> the executor of that layer's experts.
    """

    def __init__(self, executors: dict[int, ExpertExecutor]):
        self.executors = executors

    def __call__(self, il: int, h: Any, routing: Routing, part: Any = None) -> Any:
        ex = self.executors[il]
        return ex(il, h, routing) if part is None or not hasattr(ex, "settle") else ex(il, h, routing, part=part)

    def halves(self, n_seqs: int) -> bool:
        """Whether a batched decode step of ``n_seqs`` sequences should run in two halves
        (:meth:`moecache.models.base.DecoderLM.halves_for`): some layer's executor asks for it (its
        ``halves``: the expert cache with the miss split). The other executors compute a half's
        rows as they would any rows."""
        for e in self._each():
            ask = getattr(e, "halves", None)
            if ask is not None and ask(n_seqs):
                return True
        return False

    def settle(self, index: int) -> None:
        """Queue what half ``index`` of a step in halves still owes its last MoE output (the expert
        cache's wait for the CPU's share: ``CachedExperts.settle``; each executor once)."""
        for e in self._each():
            s = getattr(e, "settle", None)
            if s is not None:
                s(index)

    def _each(self) -> Iterator[ExpertExecutor]:
        """The executors, each once (one expert cache serves many layers), without building a list."""
        seen = set()
        for e in self.executors.values():
            if id(e) not in seen:
                seen.add(id(e))
                yield e

    def offloaded_bytes(self) -> int:
        """Host expert bytes copied to a device so far (int, bytes) by the layers' op offload
        (``CPUExperts.offloaded_bytes``) and the expert caches' prompt path (each cache's ``offload``),
        each counter once however many layers share it."""
        seen, total = set(), 0
        for e in self.executors.values():
            src = getattr(e, "offload", e)
            if id(src) not in seen:
                seen.add(id(src))
                total += int(getattr(src, "offloaded_bytes", 0))
        return total

    def drop_uploads(self) -> None:
        """Drop an upload of a next layer's experts still in flight (the host-expert layers' shared
        prefetch; one a prompt cut short by an exception leaves), so that its arrays go back to the
        pool only after the compute stream has waited for the copy (:meth:`LayerPrefetch.drop`)."""
        for e in self.executors.values():
            p = getattr(e, "prefetch", None)
            if p is not None:
                p.drop()

    def graph_capturable(self) -> str | None:
        """The first layer executor's reason, if any has one."""
        for e in self.executors.values():
            why = e.graph_capturable()
            if why is not None:
                return why
        return None


def placed_experts(layers: dict[int, ExpertWeights], on_device: list[bool] | tuple[bool, ...],
                   layer_backends: list[Any], offload_min_batch: int | None,
                   offload_backend: Any = None, prefetch: bool = False, act_q8: bool = False) -> ExpertsByLayer:
    """The executor of a placement: each MoE layer's experts resident on its backend
    (:class:`DeviceExperts`) where ``on_device[il]``, else in host RAM (:class:`CPUExperts`, op
    offload from ``offload_min_batch`` tokens to ``offload_backend``, default the layer's GPU;
    never on a CPU layer). With ``prefetch`` the host-expert GPU layers share one
    :class:`~moecache.moe.prefetch.LayerPrefetch`: an offloaded ubatch copies the next such layer's
    experts while the current one computes. ``act_q8``: the host-expert layers' Numba kernels round
    activations to 8 bits (:class:`CPUExperts`)."""
    ex: dict[int, ExpertExecutor] = {}
    host: dict[int, tuple[ExpertWeights, Any]] = {}
    for il, e in layers.items():
        be = layer_backends[il]
        if on_device[il]:
            ex[il] = DeviceExperts({il: e}, be)
        else:
            gpu = be.device is not None
            ex[il] = CPUExperts({il: e}, be, offload_min_batch if gpu else None, offload_backend if gpu else None,
                                act_q8=act_q8)
            if gpu and offload_min_batch is not None:
                host[il] = (e, ex[il].offload_backend)
    if prefetch and host:
        shared = LayerPrefetch(host)
        for il in host:
            ex[il].prefetch = shared
    return ExpertsByLayer(ex)
