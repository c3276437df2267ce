"""One-token decode steps replayed as a CUDA graph.

A decode step launches a few hundred small kernels; issued one by one from Python each costs ~5 us
of launch plus the Python around it, far more than the GPU's work (../shared/anchors.md measures
~1 us per node in a replayed graph). When the whole model sits on one GPU (dense weights, KV
cache, and routed experts either resident or behind a zero-copy expert cache, so routing never
leaves the device), :class:`DecodeGraph` captures
:meth:`DecoderLM.body` + the output head for one token once per KV cache, with the token id and
the position in persistent device buffers that every kernel reads (RoPE tables, KV write and
attention take positions from device memory), and replays it for every later step. Allocations
made during capture come from a private memory pool that lives as long as the graph, so nothing
outside it can reuse the graph's buffers.

Routed experts in host RAM fit in the graph when an expert cache reads its misses zero-copy
(:mod:`moecache.moe.cache`): the model's pass hooks run around each replay (the map upload before
the launch on the graph's stream, the host's policy work while the graph runs). A routing process
(``--routing``, benchmarks) gives each replay a whole pass (every MoE layer's choices, the ones
op-by-op decoding would get), copied into persistent device buffers the captured layers read; the
next pass is drawn on the host while the current replay runs (``draw_ahead``). CPU-expert layers
(below) take their routing from those buffers too in one-token steps (batched steps with both still
run op by op: not tested on a GPU): before, a routing process with ``-ncmoe`` made
every step run op by op, unsaid (``bench --routing``'s static arm at ``-ncmoe 36`` on the H200,
Qwen3-30B-A3B shape: 13.65 t/s op by op, 70.66 in the graph; ``bench/results/static-h200-s28.md``).

Routed experts computed on the CPU (``--cpu-moe``, ``-ncmoe``: :class:`CPUExperts` layers) stay
inside the graph by default (``handoff``, :mod:`moecache.moe.handoff`): such a layer is captured as
two kernels, one posting the layer's input and routing to page-locked host buffers and raising a
flag, one waiting for the host's flag and copying the experts' sum back. A replay launches the whole
graph, and the launching thread answers the posts in step order with the Numba kernel. H200
machine, Qwen3-30B-A3B-shaped model, ``bench/cpu_moe_step.py``: 25.25 ms per token against 28.35
ms with cuts, the host's time outside the kernel 65 us per layer against 84, and most of those 65
us is the GPU's own work on the layer (attention, router), which the host waits for either way.
With ``handoff=False`` the step is cut into segments instead: the capture ends where such a layer's
experts are called and a new one begins after them, reading the experts' sum from a persistent
device buffer; a replay launches segment k, copies the layer's input and routing to page-locked
host buffers (one synchronisation), runs the Numba kernel into a page-locked result buffer, queues
its upload and launches segment k+1. Batched steps with CPU-expert layers replay graphs only with
the handoff.

A capture that fails (an operation that needs the host mid-step) is said once and the steps run op
by op from then on.

Batched decode steps (``batched=True``; continuous batching of serve's slots): B sequences that are
slices of one KV cache (:meth:`moecache.engine.Engine.sequences`), one token each, replay a graph
captured once per B for any B of those sequences: the token ids, positions and each token's first
KV row (``kv_base``) are persistent device buffers, so slots may join and leave between steps
without a new capture (a new one when the slots are cut to another size). Batches the decode
kernels or the expert cache's zero-copy path do not take run op by op, and so do batches with
CPU-expert layers when the handoff is off. Each batch size's graph keeps a private memory pool (its activations and logits, a few MB
per token); these are not counted in ``--vram-budget``. On by default (``Engine(batch_graph=...)``);
H200, Qwen3-30B-A3B shape, all on the GPU, distinct tokens: 8 sequences take 8.5 ms per step
against 18.6 ms op by op (``bench/batch_steps.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import cupy as cp
import cupyx
import numpy as np

from moecache.moe import handoff
from moecache.moe.routing import Routing


@dataclass
class _Captured:
    kv: Any
    graph: Any
    stream: cp.cuda.Stream
    pool: cp.cuda.MemoryPool
    tok: cp.ndarray
    pos: cp.ndarray
    out: cp.ndarray
    staged: np.ndarray  # (token, position) of the next replay, host side
    routes: "_Routes | None"  # a routing process's per-replay choices
    segments: list = None  # graphs after the first, one per cut (CPU-expert layer), in step order
    cuts: list = None  # _Cut per CPU-expert layer, in step order
    base: cp.ndarray | None = None  # batched steps: each token's first KV row, int32 (B,)
    n_ctx: int = 0  # batched steps: the rows of each sequence (the attention grids follow it)
    handoff: "_HandoffExperts | None" = None  # CPU-expert layers handed over inside the graph
    halves: bool = False  # batched steps: captured in two halves (DecoderLM.halves_for)


@dataclass
class _Cut:
    """A CPU-expert layer between two captured segments: the device arrays the segment before it
    leaves (the experts' input and routing), page-locked host copies of them, and the device buffer
    the segment after it reads the experts' sum from (filled from ``host_out``)."""

    il: int
    executor: Any  # a CPUExperts (its compute_host)
    h: cp.ndarray
    ids: cp.ndarray
    weights: cp.ndarray
    out: cp.ndarray
    host_h: np.ndarray
    host_ids: np.ndarray
    host_w: np.ndarray
    host_out: np.ndarray

    def run(self, stream: cp.cuda.Stream) -> None:
        """After the segment before it was launched on ``stream``: fetch, compute on the CPU, queue
        the result's upload on ``stream`` (the next segment, launched after, reads it). The copies
        are plain ``cudaMemcpyAsync`` calls where the device array is contiguous (the host sides are
        page-locked arrays of the same shape and dtype, and ``out`` is made contiguous; CuPy's
        ``get``/``set`` cost several microseconds of checks each, four times per layer per token)."""
        rt = cp.cuda.runtime
        for dev, host in ((self.h, self.host_h), (self.ids, self.host_ids), (self.weights, self.host_w)):
            if dev.flags.c_contiguous:
                rt.memcpyAsync(host.ctypes.data, dev.data.ptr, dev.nbytes, rt.memcpyDeviceToHost, stream.ptr)
            else:
                dev.get(stream=stream, out=host, blocking=False)
        stream.synchronize()
        # host_out's previous upload finished: this step's sync above came after it in stream order
        self.host_out[...] = 0.0
        self.executor.compute_host(self.il, self.host_h, Routing(self.host_ids, self.host_w), self.host_out)
        rt.memcpyAsync(self.out.data.ptr, self.host_out.ctypes.data, self.out.nbytes, rt.memcpyHostToDevice,
                       stream.ptr)


class _CutExperts:
    """The experts' executor while a step is captured: CPU-expert layers end the current capture
    (their :class:`_Cut` records what the next replay needs) and begin the next one; every other
    layer is captured as usual."""

    def __init__(self, experts: Any, host: dict[int, Any], stream: cp.cuda.Stream):
        self.experts, self.host, self.stream = experts, host, stream
        self.graphs: list = []
        self.cuts: list[_Cut] = []

    def __call__(self, il: int, h: Any, routing: Any) -> Any:
        ex = self.host.get(il)
        if ex is None:
            return self.experts(il, h, routing)
        self.graphs.append(self.stream.end_capture())
        ids, w = routing.ids, routing.weights
        pinned = lambda a: cupyx.empty_pinned(a.shape, a.dtype)  # noqa: E731
        out = cp.empty(h.shape, cp.float32)
        self.cuts.append(_Cut(il, ex, h, ids, w, out, pinned(h), pinned(ids), pinned(w),
                              cupyx.empty_pinned(h.shape, np.float32)))
        self.stream.begin_capture()
        return out


class _HandoffExperts:
    """The experts' executor while a step is captured with the host handoff
    (:mod:`moecache.moe.handoff`): a CPU-expert layer becomes two kernels in the graph (post the
    layer's input and routing to page-locked buffers, wait for the CPU's sum); the replay's host
    answers the posts (:meth:`serve`). Every other layer is captured as usual."""

    def __init__(self, experts: Any, host: dict[int, Any], be: Any, n_tok: int, cfg: Any):
        from moecache.backends.handoff_cuda import CudaHandoff

        self.experts, self.host = experts, host
        # made before the capture: its device counters are zeroed by kernels a capture would record
        self.hf = CudaHandoff(be, cfg.n_layer, n_tok, cfg.n_embd, cfg.n_expert_used)
        self.layers: list[int] = []  # CPU-expert layers in step order
        self.seq = 0

    def __call__(self, il: int, h: Any, routing: Any) -> Any:
        if il not in self.host:
            return self.experts(il, h, routing)
        self.hf.post(il, h, routing.ids, routing.weights)
        self.layers.append(il)
        return self.hf.wait(il, cp.empty(h.shape, cp.float32), add=False)

    def go(self, stream: cp.cuda.Stream) -> None:
        """Before a replay's launch: the next pass number, on ``stream``."""
        self.seq += 1
        self.hf.go(self.seq, stream)

    def serve(self) -> None:
        """After the launch: answer the pass's posts in step order (raises MoecacheError when the
        GPU does not post within the timeout)."""
        handoff.serve(self.hf.buf, self.layers, self.seq, self._compute)

    def _compute(self, il: int, h: np.ndarray, ids: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        self.host[il].compute_host(il, h, Routing(ids, w), out)

    def check(self) -> None:
        """After the pass's end: raise when the GPU stopped waiting for an answer."""
        handoff.check(self.hf.buf)


class _Routes:
    """A routing process's choices for one decode step of ``n`` tokens, in persistent device buffers
    that the captured graph reads: ids int32 and weights float32, (n_layer, n, k)."""

    def __init__(self, process: Any, layers: list[int], n_layer: int, k: int, n: int = 1):
        self.process, self.layers, self.n = process, layers, n
        self.ids = cp.zeros((n_layer, n, k), cp.int32)
        self.weights = cp.zeros((n_layer, n, k), cp.float32)
        self.host_ids = np.zeros((n_layer, n, k), np.int32)
        self.host_w = np.zeros((n_layer, n, k), np.float32)

    def draw(self, stream: cp.cuda.Stream) -> None:
        """The next step's choices for every MoE layer, layer order (as op-by-op decoding draws them)."""
        nxt = getattr(self.process, "next_token", None)
        if self.n == 1 and nxt is not None and len(self.layers) == self.host_ids.shape[0] == \
                getattr(self.process, "n_layer", -1):
            self.host_ids[:], self.host_w[:] = nxt()
        else:
            for il in self.layers:
                r = self.process.route(il, self.n)
                self.host_ids[il] = r.ids
                self.host_w[il] = r.weights
        self.ids.set(self.host_ids, stream=stream)
        self.weights.set(self.host_w, stream=stream)

    def draw_ahead(self) -> None:
        """Let the process draw the next step's choices while the device runs this one (one-token
        steps: a process draws ahead for those only)."""
        ahead = getattr(self.process, "draw_ahead", None)
        if ahead is not None and self.n == 1:
            ahead()

    def route(self, il: int, n_tokens: int) -> Any:
        """What the captured layers see in place of the process (device slices; ``n_tokens`` is ``n``)."""
        return Routing(self.ids[il], self.weights[il])


class DecodeGraph:
    """Replays decode steps of ``model`` (all on one CupyBackend) as a CUDA graph.

    Args:
        model: a DecoderLM whose layers, output and experts (resident, or a zero-copy cache) are all
            on ``model.output_be``.
        log: where the one-line note of a failed capture goes.
        batched: also replay batched steps (:meth:`run_seqs`, the module docstring says how).
        handoff: CPU-expert layers are handed to the host inside the graph; False = the graph is
            cut at each of them (segments).
    """

    def __init__(self, model: Any, log: Callable[[str], None] | None = None, batched: bool = False,
                 handoff: bool = True):
        self.be = model.output_be
        self.handoff = handoff  # CPU-expert layers inside the graph (else: cuts between segments)
        self.log = log or (lambda s: None)
        self.failed: str | None = None
        self._cap: _Captured | None = None
        self.replays = 0
        self.host_layers = host_expert_layers(model)  # handed to the host (or cuts, without the handoff)
        self.batched = batched
        self.batched_failed: dict[int, str] = {}  # B -> why its capture failed (that B runs op by op)
        self._batched: dict[int, _Captured] = {}  # B -> the capture of B-token steps
        self.batched_replays = 0

    def run(self, model: Any, tokens: np.ndarray, pos: np.ndarray, kv: Any) -> np.ndarray | None:
        """Logits float32 (1, n_vocab) of one token at ``pos`` (KV written), or None when the step must
        run op by op (route observers attached, capture failed). The model's pass hooks run around
        the replay, on the graph's stream."""
        if self.failed is not None or model.route_observers:
            return None
        if self.host_layers and model.pass_hooks:
            return None  # see eligible()
        cap = self._cap
        if cap is None or cap.kv is not kv or _stale_routes(cap, model):
            cap = self._capture(model, tokens, pos, kv)
            if cap is None:
                return None
        cap.staged[0] = int(tokens[0])
        cap.staged[1] = int(pos[0])
        out = self._replay(model, cap, 1)
        self.replays += 1
        return out

    def takes_seqs(self, model: Any, kvs: list[Any]) -> bool:
        """Whether :meth:`run_seqs` replays (or captures) a graph for one token of each of ``kvs``:
        batched graphs on, no failed capture of this batch size (nor of the one-token step), no
        route observers, CPU-expert layers only with the handoff (and then no routing process or
        pass hooks), caches that are slices of one cache, a batch the decode kernels and every pass
        hook's zero-copy path take."""
        return self._shared_if_taken(model, kvs) is not None

    def _shared_if_taken(self, model: Any, kvs: list[Any]) -> tuple | None:
        """``shared_cache(kvs)`` when :meth:`takes_seqs` holds, else None."""
        from moecache.backends.ops import DECODE_MAX_TOKENS
        from moecache.models.base import shared_cache

        b = len(kvs)
        if not self.batched or b > DECODE_MAX_TOKENS or b in self.batched_failed or self.failed is not None \
                or model.route_observers:
            return None
        # a routing process with CPU-expert layers: one-token steps only (batched ones not tested on a GPU)
        if self.host_layers and (not self.handoff or model.routing_override is not None or model.pass_hooks):
            return None
        if not all(getattr(hk, "takes_zero_copy", lambda n: True)(b) for hk in model.pass_hooks):
            return None
        return shared_cache(kvs)

    def run_seqs(self, model: Any, tokens: np.ndarray, kvs: list[Any]) -> np.ndarray | None:
        """Logits float32 (B, n_vocab) of one token per sequence (token i appended to ``kvs[i]``
        at its ``n_past``; KV written), or None when the step must run op by op (see
        :meth:`takes_seqs`; a capture that fails). The caller advances the caches."""
        shared = self._shared_if_taken(model, kvs)
        if shared is None:
            return None
        b = len(kvs)
        cap = self._batched.get(b)
        if cap is None or cap.kv is not shared[0] or cap.n_ctx != shared[2] or _stale_routes(cap, model) \
                or cap.halves != model.halves_for(b):
            cap = self._capture_seqs(model, tokens, kvs, shared)
            if cap is None:
                return None
        cap.staged[0] = tokens
        cap.staged[1] = [k.n_past for k in kvs]
        cap.staged[2] = shared[1]
        out = self._replay(model, cap, b)
        self.batched_replays += 1
        return out

    def _replay(self, model: Any, cap: _Captured, n: int) -> np.ndarray:
        """One replay of ``cap`` (``n`` tokens) with the pass hooks around it; the inputs are in
        ``cap.staged`` (rows: token ids, positions, and for batched steps the first KV rows)."""
        with cap.stream:
            # order after everything queued on the default stream (eager passes: KV writes, map uploads)
            cap.stream.wait_event(cp.cuda.Stream.null.record())
            with model.hooked_pass(n):
                if cap.routes is not None:
                    cap.routes.draw(cap.stream)
                if cap.base is None:
                    cap.tok.set(cap.staged[:1].astype(np.int64), stream=cap.stream)
                    cap.pos.set(cap.staged[1:].astype(np.int32), stream=cap.stream)
                else:
                    cap.tok.set(cap.staged[0].astype(np.int64), stream=cap.stream)
                    cap.pos.set(cap.staged[1].astype(np.int32), stream=cap.stream)
                    cap.base.set(cap.staged[2].astype(np.int32), stream=cap.stream)
                if cap.handoff is not None:
                    cap.handoff.go(cap.stream)
                cap.graph.launch(cap.stream)
                for cut, seg in zip(cap.cuts or (), cap.segments or ()):
                    cut.run(cap.stream)
                    seg.launch(cap.stream)
                if cap.handoff is not None:
                    cap.handoff.serve()
                for hk in model.pass_hooks:
                    hk.launched()
                if cap.routes is not None:
                    cap.routes.draw_ahead()
                out = cap.out.get(stream=cap.stream)
                if cap.handoff is not None:
                    cap.handoff.check()
        return out

    def _capture_seqs(self, model: Any, tokens: np.ndarray, kvs: list[Any], shared: tuple) -> _Captured | None:
        be = self.be
        be.activate()
        whole, base, n_ctx = shared
        b = len(kvs)
        pos = np.array([k.n_past for k in kvs], np.int64)
        tok = be.asarray(np.asarray(tokens, np.int64))
        posb = be.positions(pos)
        baseb = be.positions(base)

        def step() -> cp.ndarray:
            # the graph reads the token, position and KV-row buffers; any B of the sequences replay it
            x = model.body(tok, pos, None, {id(be): posb}, shared=(whole, base, n_ctx), base_inputs={id(be): baseb})
            return model.head(x)

        cap = self._record(model, step, whole, tok, posb, b, batched=True)
        if cap is not None:
            cap.base, cap.n_ctx, cap.halves = baseb, n_ctx, model.halves_for(b)
            cap.staged = np.zeros((3, b), np.int64)
            self._batched[b] = cap
        return cap

    def _capture(self, model: Any, tokens: np.ndarray, pos: np.ndarray, kv: Any) -> _Captured | None:
        be = self.be
        be.activate()
        tok = be.asarray(np.asarray(tokens[:1], np.int64))
        posb = be.positions(pos[:1])

        def step() -> cp.ndarray:
            x = model.body(tok, pos[:1], kv, {id(be): posb})
            return model.head(x[-1:])

        cap = self._record(model, step, kv, tok, posb, 1)
        if cap is not None:
            self._cap = cap
        return cap

    def _record(self, model: Any, step: Callable[[], cp.ndarray], kv: Any, tok: cp.ndarray, posb: cp.ndarray,
                n: int, batched: bool = False) -> _Captured | None:
        """Warm up and capture ``step`` (``n`` tokens) on a new stream and memory pool; None when the
        capture fails, said once: one-token steps (and batched ones) then run op by op for good;
        after a failed batched capture (``batched``) only steps of that batch size do."""
        stream = cp.cuda.Stream(non_blocking=True)
        pool = cp.cuda.MemoryPool()
        process = model.routing_override
        routes = None
        if process is not None:
            c = model.cfg
            routes = _Routes(process, moe_layers(model), c.n_layer, c.n_expert_used, n)

        host = self.host_layers
        experts = model.experts
        cutter = handing = None
        if host and self.handoff:
            handing = _HandoffExperts(experts, host, self.be, n, model.cfg)
        elif host:
            cutter = _CutExperts(experts, host, stream)
        model.routing_override = routes  # the captured layers read the persistent buffers
        try:
            with cp.cuda.using_allocator(pool.malloc), stream:
                stream.wait_event(cp.cuda.Stream.null.record())
                # the map upload before the warm-up step; the step's routing log is not accounted
                # (no end_pass): the replay that follows logs the same token again
                for hk in model.pass_hooks:
                    hk.begin_pass(n)
                step()  # warm-up on this stream: loads kernels, fills caches (writes this step's KV)
                stream.synchronize()
                stream.begin_capture()
                if cutter is not None or handing is not None:
                    model.experts = cutter or handing
                try:
                    out = step()
                finally:
                    model.experts = experts
                    # a failure between two segments' captures leaves none open: ending it again
                    # would replace the real error with "not capturing"
                    graph = stream.end_capture() if _capturing(stream) else None
        except Exception as e:  # noqa: BLE001 - any failure means: run op by op
            why = f"{type(e).__name__}: {e}"
            if batched:
                self.batched_failed[n] = why
                self.log(f"note: CUDA graph capture of a decode step of {n} sequences failed ({why}); such steps "
                         f"run op by op")
            else:
                self.failed = why
                self.log(f"note: CUDA graph capture of the decode step failed ({why}); decoding op by op")
            return None
        finally:
            model.routing_override = process
        graphs = [*cutter.graphs, graph] if cutter is not None else [graph]
        return _Captured(kv, graphs[0], stream, pool, tok, posb, out, np.zeros(2, np.int64), routes,
                         graphs[1:], cutter.cuts if cutter is not None else [],
                         handoff=handing if handing is not None and handing.layers else None)


def _stale_routes(cap: _Captured, model: Any) -> bool:
    """Whether ``cap`` was captured with another routing process (or none) than the model has now."""
    return (cap.routes is None) != (model.routing_override is None) or \
        (cap.routes is not None and cap.routes.process is not model.routing_override)


def moe_layers(model: Any) -> list[int]:
    """The layers whose routing a routing process draws (those with routed experts), ascending."""
    ex = getattr(model.experts, "executors", None)
    return sorted(ex) if ex is not None else list(range(model.cfg.n_layer))


def _capturing(stream: cp.cuda.Stream) -> bool:
    """Whether ``stream`` is capturing (True where CuPy cannot say: ending the capture is then tried
    as before)."""
    try:
        return bool(stream.is_capturing())
    except AttributeError:
        return True


def host_expert_layers(model: Any) -> dict[int, Any]:
    """Layer -> its :class:`CPUExperts` executor, for the layers whose routed experts the CPU
    computes (handed to the host inside the graph, or cuts between captured segments without the
    handoff); empty when there are none."""
    from moecache.moe.executor import CPUExperts

    ex = getattr(model.experts, "executors", None) or {}
    return {il: e for il, e in sorted(ex.items()) if isinstance(e, CPUExperts)}


def eligible(model: Any) -> str | None:
    """None if ``model`` can replay decode steps as a graph, else the reason it cannot (the
    experts' executor says for itself: ``graph_capturable``; CPU-expert layers are handed to the
    host inside the graph, or cut it into segments, not a reason)."""
    be = model.output_be
    if getattr(be, "name", "") != "cuda":
        return "output not on a GPU"
    if any(b is not be for b in model.layer_be):
        return "layers on more than one device"
    host = host_expert_layers(model)
    if host:
        if model.pass_hooks:
            return "pass hooks with routed experts on the CPU"
        from moecache.moe.executor import ExpertsByLayer

        rest = {il: e for il, e in model.experts.executors.items() if il not in host}
        return ExpertsByLayer(rest).graph_capturable()
    says = getattr(model.experts, "graph_capturable", None)
    return says() if says is not None else f"{type(model.experts).__name__} does not say whether it can be captured"
