"""CPU backend: numpy arrays, quantized matrices through the Numba kernels of :mod:`moecache.quants.cpu`.

Every method takes and returns float32 numpy arrays. Shapes use T for the tokens of the ubatch.
The GPU backend mirrors these signatures on CuPy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moecache.backends.flash import flash_attention_twin, flash_ok
from moecache.backends.ops import DECODE_MAX_TOKENS, ArrayOps
from moecache.gguf_file import TensorView
from moecache.moe.routing import Routing, softmax, topk_routing
from moecache.quants import cpu
from moecache.quants.act_q8 import Q8_ACT, q8_round
from moecache.quants.formats import format_for

# From this many tokens on, a quantized matmul dequantizes row tiles of W to float32 and calls BLAS
# (compute-bound prefill); below it the Numba kernel streams the quantized rows (memory-bound decode).
BLAS_MIN_TOKENS = 16
# Elements of one dequantized float32 tile of W on the BLAS path (16 MiB).
TILE_ELEMS = 4 << 20


@dataclass(frozen=True)
class Linear:
    """A weight matrix as stored in the GGUF: ``y = x @ W.T``.

    Attributes:
        name: GGUF tensor name (for error messages).
        data: uint8 ``(n_out, row_bytes)`` raw blocks, or for float32 tensors the float32
            ``(n_out, n_in)`` matrix itself; experts add a leading ``n_expert`` axis.
        ggml_type: GGML type id.
        n_in: row length in elements.
    """

    name: str
    data: np.ndarray
    ggml_type: int
    n_in: int

    @property
    def n_out(self) -> int:
        return self.data.shape[-2]

    @property
    def is_f32(self) -> bool:
        return self.data.dtype == np.float32


class NumpyBackend(ArrayOps):
    """Array operations on the CPU (numpy + Numba kernels).

    Args:
        act_q8: run the GPU's default arithmetic (the CPU twin of ``CupyBackend(act_q8=True)``):
            the products of ubatches of up to :data:`DECODE_MAX_TOKENS` tokens with weights of a
            :data:`Q8_ACT` format see their activations rounded by :func:`q8_round`; larger
            ubatches' products of quantized weights see weights and activations rounded to float16
            (:func:`f16_round`; the GPU's tensor-core GEMMs, :mod:`moecache.backends.gemm`), float32
            sums; a prompt's attention over a float16 KV cache rounds as the GPU's tiled kernel
            (:func:`~moecache.backends.flash.flash_attention_twin`). Default False: float32
            activations and weights.
    """

    name = "cpu"
    xp = np
    device = None  # no GPU
    act_q8 = False

    def __init__(self, act_q8: bool = False):
        self.act_q8 = act_q8
        self.in_use = 0  # device bytes in use, as a test sets them (room_for)
        self.total = 1 << 62  # the device's bytes, as a test sets them (memory_total)
        self.input_drops = 0  # calls of drop_input_caches (a test checks the expert cache makes them)

    def _q8(self, ggml_type: int, name: str | None, n_tok: int) -> bool:
        return self.act_q8 and n_tok <= DECODE_MAX_TOKENS and format_for(ggml_type, name).name in Q8_ACT

    def _f16(self, n_tok: int) -> bool:
        return self.act_q8 and n_tok > DECODE_MAX_TOKENS

    def activate(self) -> None:
        """Make this backend's device current (nothing to do on the CPU)."""

    def adopt(self, a) -> np.ndarray:
        """An array of any backend as a numpy array (copied from a GPU if it lives on one)."""
        return a if isinstance(a, np.ndarray) else a.get()

    def zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """Zeros (the KV cache's buffers: float32, or float16 with ``-ctk/-ctv f16``)."""
        return np.zeros(shape, dtype)

    def upload_experts(self, w: np.ndarray, used: np.ndarray) -> np.ndarray:
        """``w[used]`` of stacked experts as this backend keeps them (a host copy here)."""
        return np.take(w, used, axis=0)

    def start_upload(self, ws: tuple[np.ndarray, ...], experts: np.ndarray | None = None,
                     out: tuple[np.ndarray, ...] | None = None, compact: bool = False) -> "TwinUpload":
        """Begin copying host arrays ``ws`` (a layer's stacked experts, uint8 (n_expert, rows,
        row_bytes)), or only the ``experts`` given (ascending ids, each to its own position), to this
        backend; :meth:`finish_upload` gives them. The CPU twin of the GPU's copy-stream upload: the
        arrays it will give are filled with 0xFF bytes (NaN scales) until then, and stay so where
        no expert was copied, so a caller that reads them too early or reads an expert not copied
        gets NaNs, as it could read half-copied bytes on the GPU. ``out``: arrays to copy into
        instead (all of them 0xFF until finished, stale data gone); ``compact`` (with ``experts``
        and ``out``): ``experts[i]`` goes to position i."""
        if compact and (experts is None or out is None or any(o.shape[0] < len(experts) for o in out)):
            raise ValueError("a compact upload needs experts and out arrays that hold them")
        return TwinUpload(ws, experts, out, compact)

    def room_for(self, nbytes: int, limit: int | None) -> bool:
        """The twin of the GPU's check (:meth:`CupyBackend.room_for`) against ``in_use``, the bytes a
        test says are in use (0 by default); None: no limit."""
        return limit is None or self.in_use + nbytes <= limit

    def memory_in_use(self) -> int:
        """The twin of :meth:`CupyBackend.memory_in_use`: ``in_use``, as a test sets it (the arrays
        this backend allocates are not counted: a test models them)."""
        return self.in_use

    def memory_total(self) -> int:
        """The twin of :meth:`CupyBackend.memory_total`: ``total``, as a test sets it."""
        return self.total

    def release_cached(self) -> None:
        """The twin of :meth:`CupyBackend.release_cached`: nothing is cached."""

    def budget_guard(self, limit: int) -> "TwinGuard":
        """The twin of :meth:`CupyBackend.budget_guard`: nothing is cached, so nothing to give back;
        the guard counts its starts and stops (the expert cache starts it for prompt passes)."""
        return TwinGuard(limit)

    def drop_input_caches(self) -> None:
        """The twin of :meth:`CupyBackend.drop_input_caches`: nothing is kept; the calls are counted
        (``input_drops``)."""
        self.input_drops += 1

    def elastic_slot_arrays(self, shapes: tuple[tuple[int, ...], ...], tail: int) -> tuple[tuple[np.ndarray, ...], "TwinTail"]:
        """The twin of :meth:`CupyBackend.elastic_slot_arrays`: uint8 zeros; a lend overwrites the
        last ``tail`` slots with 0xFF bytes (NaN scales), as the GPU's lost memory would hold
        anything, so a lent slot read before it is taken back and filled shows in the logits."""
        arrays = tuple(np.zeros(sh, np.uint8) for sh in shapes)
        return arrays, TwinTail(tuple(a[a.shape[0] - tail:] for a in arrays))

    def empty_u8(self, shape: tuple[int, ...]) -> np.ndarray:
        """uint8 "uninitialized" (0xFF bytes: NaN scales, so a read of a position never written shows)."""
        return np.full(shape, 0xFF, np.uint8)

    def upload_experts_into(self, dst: np.ndarray, w: np.ndarray, ids: np.ndarray) -> None:
        """``dst[ids] = w[ids]``."""
        dst[ids] = w[ids]

    def gather_into(self, dst: np.ndarray, ids: np.ndarray, src: np.ndarray, rows: np.ndarray) -> None:
        """``dst[ids] = src[rows]`` (resident experts from their slots into a prompt's stack)."""
        dst[ids] = src[rows]

    def finish_upload(self, up: "TwinUpload") -> tuple[np.ndarray, ...]:
        """The arrays of :meth:`start_upload`, ready to read."""
        return up.finish()

    def start_slot_copy(self, dsts: tuple[np.ndarray, ...], slot: int, srcs: tuple[np.ndarray, ...]) -> "TwinCopy":
        """Copy ``srcs[i]`` into ``dsts[i][slot]`` (an expert into a cache slot). The CPU twin of the
        GPU's asynchronous copy: the slot holds garbage (0xFF bytes: NaN scales) from the start and
        the expert lands at the second ``done()`` poll, so a caller that reads a slot in flight, or
        a victim's slot after its eviction, gets NaNs, as it could on the GPU."""
        for d in dsts:
            d[slot] = 0xFF
        return TwinCopy(dsts, slot, srcs)

    def zeros_u8(self, shape: tuple[int, ...]) -> np.ndarray:
        """uint8 zeros (expert-cache slots)."""
        return np.zeros(shape, np.uint8)

    def upload(self, a: np.ndarray) -> np.ndarray:
        """Raw weight bytes as this backend keeps them: host arrays stay where they are (no copy)."""
        return a

    # ---- weights -------------------------------------------------------------------------------
    def linear(self, t: TensorView) -> Linear:
        """Wrap a matrix (or stacked experts) without copying: F32 as float32, others as raw blocks."""
        fmt = format_for(t.ggml_type, t.name)
        if fmt.name == "F32":
            return Linear(t.name, t.data.view(np.float32), t.ggml_type, t.shape[-1])
        return Linear(t.name, t.data, t.ggml_type, t.shape[-1])

    def vector(self, t: TensorView) -> np.ndarray:
        """A 1-D tensor (norm weight, bias) as a float32 array, dequantized if it is F16/BF16/..."""
        if format_for(t.ggml_type, t.name).name == "F32":
            return np.array(t.data.view(np.float32).reshape(-1))
        return cpu.dequantize(t.data.reshape(1, -1), t.ggml_type, t.shape[-1], t.name).reshape(-1)

    def dequantize_rows(self, rows: np.ndarray, ggml_type: int, n_in: int, name: str | None = None) -> np.ndarray:
        """uint8 (n, row_bytes) blocks of any supported type -> float32 (n, n_in)."""
        if format_for(ggml_type, name).name == "F32":
            return np.array(rows.view(np.float32))
        return cpu.dequantize(rows, ggml_type, n_in, name)

    def asarray(self, a: np.ndarray) -> np.ndarray:
        """Host array -> backend array (float32 stays float32; a no-op here)."""
        return np.ascontiguousarray(a)

    def to_host(self, a: np.ndarray) -> np.ndarray:
        """Backend array -> numpy array (a no-op here)."""
        return a

    # ---- operations ----------------------------------------------------------------------------
    def matmul(self, w: Linear, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: float32 (T, n_in) -> (T, n_out)."""
        if w.is_f32:
            return x @ w.data.T
        if self._q8(w.ggml_type, w.name, x.shape[0]):
            x = q8_round(x)
        f16 = self._f16(x.shape[0])
        if x.shape[0] < BLAS_MIN_TOKENS and not f16:
            return cpu.matmul(w.data, w.ggml_type, x, name=w.name)
        if f16:
            x = f16_round(x)
        out = np.empty((x.shape[0], w.n_out), np.float32)
        rows = max(1, TILE_ELEMS // w.n_in)
        for r0 in range(0, w.n_out, rows):
            tile = cpu.dequantize(w.data[r0:r0 + rows], w.ggml_type, w.n_in, w.name)
            np.matmul(x, f16_round(tile).T if f16 else tile.T, out=out[:, r0:r0 + rows])
        return out

    def attention(self, q: np.ndarray, k_all: np.ndarray, v_all: np.ndarray, pos0: Any, scale: float,
                  window: int | None = None, softcap: float | None = None, kv_base: Any = None,
                  n_ctx: int | None = None) -> np.ndarray:
        """:meth:`ArrayOps.attention`; with ``act_q8``, a prompt that the GPU computes in key tiles
        (:func:`~moecache.backends.flash.flash_ok`) is computed by that kernel's twin."""
        if self.act_q8 and flash_ok(q.shape[0], q.shape[2], v_all.shape[2], k_all.dtype, v_all.dtype, kv_base):
            return flash_attention_twin(q, k_all, v_all, int(pos0) if np.ndim(pos0) == 0 else int(pos0[0]), scale,
                                        window, softcap)
        return super().attention(q, k_all, v_all, pos0, scale, window, softcap, kv_base, n_ctx)

    def topk_routing(self, logits: np.ndarray, k: int, renorm: bool) -> Routing:
        """Softmax top-k routing of router logits float32 (T, n_expert) (see :func:`topk_routing`)."""
        return topk_routing(softmax(np.asarray(logits, np.float32)), k, renorm)

    def moe_ffn(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray, types: tuple[int, int, int],
                routing: Routing, h: np.ndarray, act: str) -> np.ndarray:
        """``sum_s w[t,s] * down_e(act(gate_e h_t) * up_e h_t)`` over each token's routed experts e = ids[t, s].

        Args:
            gate, up: uint8 (n_expert, expert_ff, row_bytes); down: uint8 (n_expert, n_embd, row_bytes).
            types: GGML type ids of (gate, up, down).
            routing: ids into the stacked experts and weights, (T, k); a pair of id < 0 has no
                expert and adds nothing (the expert cache computes a prompt ubatch's experts group
                by group on the same routing).
            h: float32 (T, n_embd). act: "silu" or "gelu".

        Returns:
            float32 (T, n_embd).
        """
        ids = np.asarray(routing.host().ids)
        some = bool(ids.size) and ids.min() < 0
        if (types[0] == types[1] and self._q8(types[0], None, h.shape[0]) and self._q8(types[2], None, 1)
                and not some):  # the GPU takes the GEMM path for a routing with pairs of no expert
            return self._moe_ffn_q8(gate, up, down, types, routing, h, act)
        if self._f16(h.shape[0]):
            return self._moe_ffn_f16(gate, up, down, types, routing.groups(ids >= 0 if some else None), h, act)
        return cpu.moe_ffn_routed(gate, up, down, types, ids, routing.host().weights, h,
                                  act=cpu.act_code(act))

    def _moe_ffn_f16(self, gate, up, down, types, groups, h: np.ndarray, act: str) -> np.ndarray:
        """The GPU's prompt MoE with float16 operands (CupyBackend._moe_prompt): per used expert, h
        and the dequantized weights rounded to float16, float32 products; the gated activations
        rounded to float16 before the down product; each token's outputs summed with its weights."""
        eids, offs, rows, wts = groups
        n_embd = h.shape[1]
        hh = f16_round(np.ascontiguousarray(h, np.float32))
        y = np.zeros((h.shape[0], down.shape[1]), np.float32)
        for g, e in enumerate(eids):
            r = rows[offs[g]:offs[g + 1]]
            x = hh[r]
            wg, wu = (f16_round(cpu.dequantize(m[e], t, n_embd)) for m, t in ((gate, types[0]), (up, types[1])))
            a = f16_round(self.glu(x @ wg.T, x @ wu.T, act))
            wd = f16_round(cpu.dequantize(down[e], types[2], gate.shape[1]))
            np.add.at(y, r, wts[offs[g]:offs[g + 1], None] * (a @ wd.T))
        return y

    def _moe_ffn_q8(self, gate, up, down, types, routing: Routing, h: np.ndarray, act: str) -> np.ndarray:
        """The GPU's decode MoE with 8-bit activations (moeq_glu, moeq_down of mmvq.cu): h rounded by
        :func:`q8_round`, then each pair's gated activations rounded before the down product."""
        ids = np.asarray(routing.ids)
        w = np.asarray(routing.weights, np.float32)
        t, k = ids.shape
        hq = q8_round(np.ascontiguousarray(h, np.float32))
        a = np.empty((t * k, gate.shape[1]), np.float32)
        for p, e in enumerate(ids.reshape(-1)):
            x = hq[p // k:p // k + 1]
            g = cpu.matmul(gate[e], types[0], x)
            a[p] = self.glu(g, cpu.matmul(up[e], types[1], x), act)[0]
        aq = q8_round(a)
        y = np.zeros((t, down.shape[1]), np.float32)
        for p, e in enumerate(ids.reshape(-1)):
            y[p // k] += w.flat[p] * cpu.matmul(down[e], types[2], aq[p:p + 1])[0]
        return y

    def fill(self, dst: np.ndarray, value: int) -> None:
        """``dst[...] = value`` (the twin of :meth:`CupyBackend.fill`)."""
        dst.fill(value)

    def set_from_host(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[...] = src`` (the twin of :meth:`CupyBackend.set_from_host`)."""
        dst[...] = src

    def zero_copy_ok(self, arrays: list[np.ndarray]) -> str | None:
        """The twin of :meth:`CupyBackend.zero_copy_ok`: host arrays are always readable here."""
        return None

    def moe_ffn_cached(self, pool: tuple[np.ndarray, np.ndarray, np.ndarray], types: tuple[int, int, int],
                       routing: Routing, h: np.ndarray, act: str, slot_map: np.ndarray,
                       host: tuple[np.ndarray, np.ndarray, np.ndarray],
                       scratch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The CPU twin of :meth:`CupyBackend.moe_ffn_cached`: pairs whose expert has a slot
        (``slot_map[e] >= 0``) are computed from ``pool[slot]``, the others from ``host[e]``, or,
        with a ``scratch``, from ``scratch[p]`` after copying expert e of pair p there; a pair of id
        -1 adds nothing."""
        ids = np.asarray(routing.ids)
        w = np.asarray(routing.weights, np.float32)
        pair = ids >= 0  # id -1: no pair (the host handoff's CPU pairs)
        slots = np.where(pair, np.asarray(slot_map)[np.maximum(ids, 0)], -1)
        hit = slots >= 0
        w = np.where(pair, w, 0.0).astype(np.float32)
        if scratch is not None:
            if scratch[0].shape[0] < ids.size:
                raise ValueError(f"moe_ffn_cached: a scratch of {scratch[0].shape[0]} experts cannot stage {ids.size} pairs")
            missed = np.flatnonzero((~hit & pair).reshape(-1))
            for p in missed:
                for dst, src in zip(scratch, host):
                    dst[p] = src[ids.flat[p]]
            out = np.zeros((h.shape[0], host[2].shape[1]), np.float32)
            if missed.size:  # hit pairs (and no-pairs) ride along on a staged row with weight 0 (never a stale row)
                rows = np.where(hit | ~pair, missed[0], np.arange(ids.size).reshape(ids.shape)).astype(np.int32)
                out = self.moe_ffn(*scratch, types, Routing(rows, np.where(hit, 0.0, w).astype(np.float32)), h, act)
        else:
            out = self.moe_ffn(*host, types, Routing(np.where(pair, ids, 0).astype(np.int32),
                                                     np.where(hit, 0.0, w).astype(np.float32)), h, act)
        if hit.any():
            fill = int(slots[hit][0])  # misses ride along on a mapped slot with weight 0
            local = Routing(np.where(hit, slots, fill).astype(np.int32), np.where(hit, w, 0.0).astype(np.float32))
            out = out + self.moe_ffn(*pool, types, local, h, act)
        return out

    def embed(self, w: Linear, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of an embedding matrix, dequantized: int (T,) -> float32 (T, n_in)."""
        if w.is_f32:
            return w.data[ids]
        return cpu.dequantize(w.data[ids], w.ggml_type, w.n_in, w.name)


def f16_round(a: np.ndarray) -> np.ndarray:
    """float32 ``a`` rounded to the nearest float16 (IEEE round-to-nearest-even, as CUDA's
    ``__float2half_rn`` and CuPy's ``astype(float16)``), returned as float32."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


class TwinCopy:
    """An expert copy into a slot that completes at its second :meth:`done` poll (see
    :meth:`NumpyBackend.start_slot_copy`)."""

    def __init__(self, dsts, slot, srcs):
        self.dsts, self.slot, self.srcs = dsts, slot, srcs
        self.polls = 0

    def done(self) -> bool:
        self.polls += 1
        if self.polls < 2:
            return False
        if self.srcs is not None:
            for d, s in zip(self.dsts, self.srcs):
                d[self.slot] = s
            self.srcs = None
        return True

    def wait(self) -> None:
        """Complete the copy now (the twin of waiting for the GPU's copy)."""
        self.polls = max(self.polls, 1)
        self.done()


class TwinGuard:
    """:meth:`NumpyBackend.budget_guard`'s guard: ``on`` while started; ``starts`` counts the starts."""

    def __init__(self, limit: int):
        self.limit, self.on, self.starts, self.releases = limit, False, 0, 0

    def start(self) -> None:
        self.on = True
        self.starts += 1

    def stop(self) -> None:
        self.on = False


class TwinTail:
    """:meth:`NumpyBackend.elastic_slot_arrays`' handle: ``live``, ``mapped``, ``lends`` and
    ``take_backs`` as on the GPU; ``room`` (set by a test; None: all) stands for the GPU's free
    memory: the most of the tail's slots a take-back may have live; ``limits`` records the limit
    each take-back was asked under. A lend overwrites the tail with 0xFF bytes."""

    def __init__(self, regions: tuple[np.ndarray, ...]):
        self.regions, self.room = regions, None
        self.tail = regions[0].shape[0]
        self.live = self.tail
        self.bytes = sum(r.nbytes for r in regions)
        self.lends = self.take_backs = 0
        self.limits: list[int | None] = []

    @property
    def mapped(self) -> bool:
        return self.live == self.tail

    def lend(self) -> None:
        if self.live:
            for r in self.regions:
                r[...] = 0xFF
            self.live = 0
            self.lends += 1

    def take_back(self, limit: int | None) -> int:
        if self.live == self.tail:
            return self.live
        self.limits.append(limit)
        live = max(self.live, self.tail if self.room is None else min(self.tail, self.room))
        if live > self.live:
            self.live = live
            self.take_backs += 1
        return self.live


class TwinUpload:
    """An upload in flight (see :meth:`NumpyBackend.start_upload`): its arrays hold 0xFF bytes until
    :meth:`finish`, and afterwards wherever no expert was copied."""

    def __init__(self, ws: tuple[np.ndarray, ...], experts: np.ndarray | None = None,
                 out: tuple[np.ndarray, ...] | None = None, compact: bool = False):
        self.srcs = ws
        self.experts = experts
        self.compact = compact
        if out is not None:
            for o in out:
                o[...] = 0xFF
        self.arrays = out if out is not None else tuple(np.full(w.shape, 0xFF, np.uint8) for w in ws)

    def finish(self) -> tuple[np.ndarray, ...]:
        if self.srcs is not None:
            sel = slice(None) if self.experts is None else self.experts
            to = slice(0, len(self.experts)) if self.compact else sel
            for d, s in zip(self.arrays, self.srcs):
                d[to] = s[sel]
            self.srcs = None
        return self.arrays
