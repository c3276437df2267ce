"""GPU backend: the model's operations on CuPy arrays, on one CUDA device.

Weights are uploaded in their GGUF quant format and dequantized inside the CUDA kernels of
``moecache/quants/cuda/dequant.cu`` (every format of :mod:`moecache.quants.formats`, F16/BF16/F32
included). Up to :data:`GEMV_MAX_TOKENS` tokens a matmul is one fused kernel that reads each
quantized row once (a warp per output row); larger ubatches dequantize W to a scratch matrix and
call cuBLAS: float16 operands on the tensor cores with float32 results by default (``act_q8``),
float32 operands without it (:mod:`.gemm`). The layer operations (RMSNorm, RoPE, gated activation, decode attention,
softmax top-k routing) are one launch each from ``moecache/backends/cuda/ops.cu``. Routed experts
resident on the device run through :meth:`CupyBackend.moe_ffn`: two kernels for decode-sized
ubatches (routing read from device memory, no host round trip), batched cuBLAS over the used
experts (float16 operands) for prompt ubatches.

Requires CuPy (``pip install -e '.[cuda]'``); importing this module without it raises ImportError.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import cupy as cp
import numba
import numpy as np

from moecache.backends.flash import flash_ok
from moecache.backends.gemm import rows_times_weights_t, run as run_gemm
from moecache.backends.moe_plan import layer_plan
from moecache.backends.numpy_backend import Linear, NumpyBackend
from moecache.backends.staging import StagingRing, staged_gather_upload
from moecache.backends.ops import (DECODE_MAX_TOKENS, MOE_ACT_BYTES, MOE_PROMPT_CHUNK_RATIO, MOE_PROMPT_M_ALIGN,
                                   MOE_SCRATCH_BYTES, ArrayOps, expert_runs, moe_prompt_groups)
from moecache.gguf_file import TensorView
from moecache.moe.routing import Routing
from moecache.quants.act_q8 import Q8_ACT, grouped_prompt_ok  # formats with 8-bit-activation kernels in mmvq.cu
from moecache.quants.formats import FORMATS, format_for

QUANT_SRC = Path(__file__).resolve().parents[1] / "quants" / "cuda" / "dequant.cu"
MMVQ_SRC = QUANT_SRC.with_name("mmvq.cu")  # compiled after dequant.cu, in the same module
OPS_SRC = Path(__file__).resolve().parent / "cuda" / "ops.cu"
# format name -> kernel suffix in dequant.cu (deq_<s>, gemv_<s>, moe_glu_<s>, moe_down_<s>, deq_experts_<s>)
SUFFIX = {name: name.lower() for name in FORMATS}
THREADS = 256  # DEQ_THREADS of dequant.cu (the dequantize kernels rely on it)
MMVQ_WARPS = 4  # MMVQ_WARPS of mmvq.cu
MMQ_TOK = 32  # MMQ_TOK of mmvq.cu: rows (pairs) per group of the tensor-core prompt MoE (moeq_mma_*)
MMQ_WARPS = 4  # MMQ_WARPS of mmvq.cu
MMQ_ROWS = 16 * MMQ_WARPS  # weight rows per block of moeq_mma_*
# the elastic slots' memory is mapped in pieces of this many slots (each array's piece rounded to the
# driver's 2 MiB granularity), so a take-back maps the first slots that fit when all would not: at
# Qwen3-30B-A3B's shape a piece is ~7-8 MiB of each of the three arrays, ~190 pieces for 500 slots
ELASTIC_PIECE_SLOTS = 8
MMQ_FORMATS = ("Q4_K",)  # weight formats with a moeq_mma_* kernel (sm_80+)
GEMV_MAX_TOKENS = DECODE_MAX_TOKENS  # MAX_TOK of dequant.cu: up to this many tokens the fused kernels, more: dequantize + cuBLAS
WARPS_PER_BLOCK = 4  # GEMV / MoE kernels: output rows (one warp each) per CUDA block
ATT_MAX_TOKENS = 16  # queries from which attention uses the batched-matmul path instead of attn_decode
ATT_MAX_HEAD_DIM = 256
ATT_WARPS = 4  # ATT_WARPS of ops.cu: warps per (head, query, key run) block of attn_decode
# attn_decode: one key run per this many positions of the KV cache, at least ATT_MIN_SPLITS and at
# most ATT_MAX_SPLITS runs (a 16k context: 64 runs of <= 256 keys). A block's keys are a serial chain
# of loads, so a short cache needs several runs too: tg128 of Qwen3-30B-A3B at -c 137 went 206 -> 280
# t/s from 1 run to 8; more runs cost the merge at early positions (-c 4096: 278 t/s with 16, 257 with
# 64) (H200, bench/results/decode-attn-splits-h200.md)
ATT_KEYS_PER_SPLIT = 256
ATT_MIN_SPLITS = 8
ATT_MAX_SPLITS = 64
GQA_THREADS = 128  # GQA_THREADS of ops.cu: threads of an attn_gqa block
GQA_MAX_G = 16  # GQA_MAX_G of ops.cu: most query heads per KV head attn_gqa takes
GQA_MAX_SPLITS = 256  # attn_gqa: at most this many key runs per query (COMBINE_MAX_S of ops.cu) ...
GQA_MIN_RUN = 64  # ... of at least this many keys
COMBINE_THREADS = 512  # COMBINE_THREADS of ops.cu: threads of an attn_combine block
ROUTER_THREADS = 128  # ROUTER_THREADS of ops.cu: threads of a router_topk block (one per expert)
SOFTMAX_THREADS = 256  # SOFTMAX_THREADS of ops.cu: threads of a masked_softmax block (one per row)
# decode queries with at least this many keys take attn_gqa, fewer attn_decode (per head, many short
# runs: the lower latency while the keys are few). H200, Qwen3-30B-A3B's layer, f16 cache, µs per
# layer with the merge (bench/attn_variants.py, bench/results/attn-gqa-h200.md): attn_decode 27.2 /
# 55.7 / 217.7 at 1024 / 4096 / 16000 keys; attn_gqa (K and V staged in shared memory, runs >= 64)
# 20.3 / 28.2 / 68.9 (the kernel before it 29.5 / 35.5 / 133.9). Chosen with the kernel before it;
# the new kernel also wins at 1024 keys. With 512-thread merges and GQA_MIN_BLOCKS 1 (session of
# 2026-12-01): attn_gqa 12.5 / 16.1 / 49.7 at 1024 / 4096 / 16000 keys, attn_decode 19.9 / 48.5 /
# 211.6 in the same run; at 0 keys (the run with 4 blocks per SM) attn_decode 7.3, attn_gqa 15.3
GQA_MIN_KEYS = 1024
PA_THREADS = 128  # 32 * PA_WARPS of ops.cu: threads of an attn_prompt block
PA_BQ = 64  # PA_BQ of ops.cu: queries per attn_prompt block


@numba.njit(parallel=True, nogil=True, cache=True)
def _gather_rows(src, idx, dst):  # dst[i] = src[idx[i]], rows split over the CPU threads
    n, per = dst.shape
    chunk = 1 << 16
    n_chunks = (per + chunk - 1) // chunk
    for j in numba.prange(n * n_chunks):
        i = j // n_chunks
        c0 = (j % n_chunks) * chunk
        c1 = min(per, c0 + chunk)
        dst[i, c0:c1] = src[idx[i], c0:c1]


def att_splits(n_ctx: int) -> int:
    """Key runs per (head, query) of decode attention for a KV cache of ``n_ctx`` positions: one per
    :data:`ATT_KEYS_PER_SPLIT` positions, :data:`ATT_MIN_SPLITS` .. :data:`ATT_MAX_SPLITS`."""
    return max(ATT_MIN_SPLITS, min(ATT_MAX_SPLITS, -(-n_ctx // ATT_KEYS_PER_SPLIT)))


def gqa_splits(n_ctx: int) -> tuple[int, int]:
    """(runs S, min_run) of grouped decode attention (``attn_gqa``) for a KV cache of ``n_ctx``
    positions. The grid holds S runs per (KV head, query), fixed by the cache's capacity (a captured
    graph replays at every position); the kernel cuts the query's n keys into runs of
    max(min_run, ceil(n / S)) keys rounded up to a multiple of min_run (whole 64-key chunks), so short
    contexts use many short runs (one block's serial latency is small) and long ones at most
    :data:`GQA_MAX_SPLITS` runs (the merge stays small)."""
    return max(1, min(GQA_MAX_SPLITS, -(-n_ctx // GQA_MIN_RUN))), GQA_MIN_RUN


def gqa_ok(n_head: int, n_head_kv: int, d: int, dv: int) -> bool:
    """Whether ``attn_gqa`` takes this shape: a whole query group of <= :data:`GQA_MAX_G` heads per KV
    head; K and V rows of one size, 64, 128 or 256 elements; group size x row size <= 2048 (the
    group's queries in the kernel's shared memory, and the sums a thread holds: 2048 / D heads of
    one dim pair)."""
    g = n_head // n_head_kv if n_head % n_head_kv == 0 else 0
    return 0 < g <= GQA_MAX_G and d == dv and dv in (64, 128, 256) and g * (dv // 32) <= 64


def lanes_per_row(n_in: int, fmt_name: str) -> int:
    """Lanes of a warp that share one row in the ``mmvq.cu`` kernels: the pieces of a row
    (:data:`Q8_ACT`), rounded up to a power of two, at most 32 (a 768-wide Q4_K row has 12 pieces:
    16 lanes, two rows per warp)."""
    ppb, qk = Q8_ACT[fmt_name]
    pieces = n_in // qk * ppb
    return min(32, 1 << max(0, pieces - 1).bit_length())


class _SlotCopy:
    """An expert upload in flight: its completion event and the pinned buffers it reads."""

    def __init__(self, event: cp.cuda.Event, keep: list):
        self.event, self.keep = event, keep

    def done(self) -> bool:
        if self.event.done:
            self.keep = []  # the pinned buffers go back to CuPy's pool
            return True
        return False

    def wait(self) -> None:
        """Block the host until the copy has completed (a CUDA error of the copy is raised here)."""
        self.event.synchronize()
        self.keep = []


class _BudgetGuard(cp.cuda.memory_hook.MemoryHook):
    """:meth:`CupyBackend.budget_guard`: ``start()`` / ``stop()`` register the hook in the calling
    thread under a name per GPU (one guard per GPU, each for its own device); a start finds a guard
    of its GPU left registered by a pass an exception cut short (or by an engine closed since) and
    takes its place. ``releases`` counts the times it gave the pool's free blocks back."""

    def __init__(self, device: int, limit: int):
        self.device, self.limit, self.releases = device, int(limit), 0
        self.name = f"moecache_vram_budget_{device}"

    def start(self) -> None:
        hooks = cp.cuda.memory_hook.get_memory_hooks()
        if hooks.get(self.name) is not self:
            hooks.pop(self.name, None)
            self.__enter__()

    def stop(self) -> None:
        hooks = cp.cuda.memory_hook.get_memory_hooks()
        if hooks.get(self.name) is self:
            del hooks[self.name]

    def alloc_preprocess(self, **kw: Any) -> None:
        """Before the pool's cudaMalloc of ``mem_size`` bytes on the current device."""
        if kw.get("device_id", self.device) != self.device:
            return
        free, total = cp.cuda.runtime.memGetInfo()
        if total - free + int(kw.get("mem_size", 0)) > self.limit:
            cp.get_default_memory_pool().free_all_blocks()
            self.releases += 1


class _Upload:
    """A whole-array upload on the copy stream: the device arrays and the copy's completion event."""

    def __init__(self, arrays: tuple[cp.ndarray, ...], event: cp.cuda.Event):
        self.arrays, self.event = arrays, event


def _pinned_bytes(nbytes: int) -> np.ndarray:
    """A uint8 (nbytes,) host array in page-locked memory (CuPy's pinned pool)."""
    import cupyx

    return cupyx.empty_pinned((nbytes,), np.uint8)


def _dma_in_place(dst: cp.ndarray, w: np.ndarray, runs: list[tuple[int, int, int]], stream: cp.cuda.Stream,
                  compact: bool = False) -> None:
    """``dst[first:first + length] = w[first:first + length]`` for each run ``(at, first, length)``
    (``expert_runs``), asynchronously on ``stream``: page-locked host experts ``w`` into device
    experts ``dst`` of the same shape; with ``compact`` into ``dst[at:at + length]`` (``dst`` holds
    at least the runs' experts). One ``cudaMemcpyAsync`` per run on raw pointers when both are
    C-contiguous (a prompt layer's non-resident experts make tens of runs; a slice and
    ``ndarray.set`` each cost more host time than the call itself), else ``ndarray.set``."""
    same = dst.shape[1:] == w.shape[1:] and (compact or dst.shape[0] == w.shape[0])
    if not same or not (dst.flags.c_contiguous and w.flags.c_contiguous):
        for at, first, length in runs:
            d = at if compact else first
            dst[d:d + length].set(w[first:first + length], stream=stream)
        return
    if compact and runs and runs[-1][0] + runs[-1][2] > dst.shape[0]:
        raise ValueError(f"a compact upload of {runs[-1][0] + runs[-1][2]} experts into {dst.shape[0]}")
    per = int(w.strides[0])  # bytes of one expert
    d0, s0 = int(dst.data.ptr), int(w.ctypes.data)
    for at, first, length in runs:
        cp.cuda.runtime.memcpyAsync(d0 + (at if compact else first) * per, s0 + first * per, length * per,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)


def _is_pinned(a: np.ndarray) -> bool:
    """Whether a host array lives in page-locked memory (``--load-mode pin``)."""
    try:
        return int(cp.cuda.runtime.pointerGetAttributes(a.ctypes.data).type) == 1  # cudaMemoryTypeHost
    except Exception:  # noqa: BLE001 - pageable memory may raise on older runtimes
        return False


NULL = np.uint64(0)  # a null pointer argument of a kernel


def _i64(v: int) -> np.int64:
    return np.int64(v)


def _kv_suffix(kv: cp.ndarray) -> str:
    """The kernel variant of a KV cache buffer's element type: float32 or float16."""
    if kv.dtype == cp.float32:
        return ""
    if kv.dtype == cp.float16:
        return "_f16"
    raise ValueError(f"KV cache element type {kv.dtype} is not supported (float32, float16)")


class CupyBackend(ArrayOps):
    """Array operations on one GPU.

    Args:
        device: CUDA device ordinal.
        log: where one-line notes go; default: discard.
    """

    name = "cuda"
    xp = cp

    def __init__(self, device: int = 0, log: Callable[[str], None] | None = None, act_q8: bool = True,
                 prompt_q8: bool = False):
        self.device = device
        # with act_q8, the prompt MoE of Q8_ACT experts runs the grouped 8-bit kernels (moeq_gglu,
        # moeq_gdown: each expert's rows read once per group of up to DECODE_MAX_TOKENS tokens, no
        # dequantized weights, no GEMM) instead of float16 GEMMs; off until measured on a GPU
        self.prompt_q8 = prompt_q8
        # the float16 prompt MoE's chunking (moecache.backends.ops.moe_prompt_chunks): a chunk's
        # experts of at least 1 / prompt_chunk_ratio of its largest count, their padded rows rounded
        # up to a power of two with prompt_m_pow2 (fewer GEMM shapes); bench/prompt_chunks.py A/Bs them
        self.prompt_chunk_ratio = MOE_PROMPT_CHUNK_RATIO
        self.prompt_m_pow2 = False
        # the decode products of Q8_ACT formats round their activations to int8 per 32 values (as
        # llama.cpp's MMVQ kernels do) and prompt products round weights and activations to float16
        # (tensor-core GEMMs, as llama.cpp's cuBLAS path); False keeps float32 (the CPU twin's
        # arithmetic). NumpyBackend(act_q8=True) is the CPU twin of both roundings.
        self.act_q8 = act_q8
        self._xq: tuple[Any, tuple] | None = None  # the last activation quantized, and its quants
        self._x16: tuple[Any, Any] | None = None  # the last prompt activation converted, and its copy
        self.log = log or (lambda s: None)
        self._noted: set[str] = set()
        self._cpu = NumpyBackend()
        self._fns: dict[str, Any] = {}
        self._inv_freq: dict[bytes, cp.ndarray] = {}
        self._staging = StagingRing(_pinned_bytes)  # page-locked buffers of upload_experts (a mapped file)
        self._copy_stream: cp.cuda.Stream | None = None  # expert-cache uploads
        # router_topk's count of finished blocks (0 between launches; one router launch at a time:
        # this backend's layers run in order on one stream); made here, never inside a graph's capture
        with cp.cuda.Device(device):
            self._router_done = cp.zeros(1, cp.uint32)

    def gemm_dtype(self, n_tok: int) -> Any:
        """The operands' dtype of the cuBLAS products of a ``n_tok``-token ubatch: float16 with
        ``act_q8`` for prompts (more than GEMV_MAX_TOKENS tokens), else float32; the rule of the
        CPU twin's ``NumpyBackend._f16``."""
        return cp.float16 if self.act_q8 and n_tok > GEMV_MAX_TOKENS else cp.float32

    def activate(self) -> None:
        """Make this backend's GPU the current CUDA device (before running a layer placed on it)."""
        cp.cuda.Device(self.device).use()

    # ---- kernels -------------------------------------------------------------------------------
    @cached_property
    def _modules(self) -> tuple[cp.RawModule, cp.RawModule]:
        with cp.cuda.Device(self.device):
            return (cp.RawModule(code=QUANT_SRC.read_text() + "\n" + MMVQ_SRC.read_text(),
                                 options=("-std=c++17", f"-DMAX_TOK={DECODE_MAX_TOKENS}")),
                    cp.RawModule(code=OPS_SRC.read_text(), options=("-std=c++17", f"-DMAX_TOK={DECODE_MAX_TOKENS}")))

    def _fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            quant, ops = self._modules
            with cp.cuda.Device(self.device):
                try:
                    f = ops.get_function(name)
                except cp.cuda.driver.CUDADriverError:
                    f = quant.get_function(name)
            self._fns[name] = f
        return f

    # ---- weights and arrays ------------------------------------------------------------------------
    def _put(self, a: np.ndarray) -> cp.ndarray:
        with cp.cuda.Device(self.device):
            return cp.asarray(a)

    def linear(self, t: TensorView) -> Linear:
        """Upload a matrix (or stacked experts) in its GGUF format; F32 as a float32 matrix."""
        fmt = format_for(t.ggml_type, t.name)
        if t.shape[-1] % 32 == 0:  # every format, F32 included, as raw rows for the kernels (no cuBLAS
            # in the decode step: a CUDA graph cannot capture CuPy's cuBLAS calls)
            return Linear(t.name, self._put(t.data), t.ggml_type, t.shape[-1])
        if fmt.name == "F32":
            return Linear(t.name, self._put(t.data.view(np.float32)), t.ggml_type, t.shape[-1])
        # only the float formats allow rows that are not a multiple of 32
        self._note(f"{t.name}: rows of {t.shape[-1]} elements (not a multiple of 32) are kept as float32 on the GPU")
        rows = t.data.reshape(-1, t.data.shape[-1])
        dense = self._cpu.dequantize_rows(rows, t.ggml_type, t.shape[-1], t.name)
        return Linear(t.name, self._put(dense.reshape(*t.shape)), t.ggml_type, t.shape[-1])

    def _note(self, msg: str) -> None:
        if msg not in self._noted:
            self._noted.add(msg)
            self.log("note: " + msg)

    def vector(self, t: TensorView) -> cp.ndarray:
        """A 1-D tensor as float32 on the GPU."""
        return self._put(self._cpu.vector(t))

    def upload(self, a: np.ndarray) -> cp.ndarray:
        """Raw weight bytes (e.g. stacked experts) copied to this GPU as they are."""
        return self._put(np.ascontiguousarray(a))

    def upload_experts(self, w: np.ndarray, used: np.ndarray) -> cp.ndarray:
        """``w[used]`` (stacked experts, uint8 (n_expert, rows, row_bytes); ``used`` ascending) copied to
        this GPU: from pinned weights one DMA copy per run of consecutive experts (``expert_runs``;
        a long prompt uses them all: one run); otherwise CPU threads gather the experts into a
        page-locked buffer of a :class:`StagingRing`, then one asynchronous copy
        (:func:`staged_gather_upload`)."""
        n = int(used.size)
        if n and _is_pinned(w):
            # --load-mode pin: the experts are DMA-able where they are (a CPU gather of a layer's
            # ~90 missing experts would copy ~240 MB through the CPU first). The copies are queued on
            # the current stream without a host wait (nothing writes the weights; the kernels queued
            # after them read the experts in order); CuPy >= 13's set() does so without a stream
            # argument too, the explicit stream keeps it so on any version
            with cp.cuda.Device(self.device):
                stream = cp.cuda.get_current_stream()
                out = cp.empty((n,) + tuple(w.shape[1:]), cp.uint8)
                for at, first, length in expert_runs(used):
                    out[at:at + length].set(w[first:first + length], stream=stream)
            return out
        # a mapped file: CPU threads gather the experts into a page-locked staging buffer, then one copy
        # at pinned speed (pageable copies run ~8x slower, ../shared/anchors.md). The copy is
        # asynchronous: the ring refills a buffer only after the copy that read it completed.
        with cp.cuda.Device(self.device):
            stream = cp.cuda.get_current_stream()

            def copy_async(host: np.ndarray) -> tuple[cp.ndarray, cp.cuda.Event]:
                out = cp.empty(host.shape, cp.uint8)
                out.set(host, stream=stream)
                return out, stream.record()

            return staged_gather_upload(self._staging, w, used, _gather_rows, copy_async)

    def _copies(self) -> cp.cuda.Stream:
        """This GPU's copy stream (made on first use; call with the device current)."""
        if self._copy_stream is None:
            self._copy_stream = cp.cuda.Stream(non_blocking=True)
        return self._copy_stream

    def start_upload(self, ws: tuple[np.ndarray, ...], experts: np.ndarray | None = None,
                     out: tuple[cp.ndarray, ...] | None = None, compact: bool = False) -> "_Upload | None":
        """Begin copying page-locked host arrays ``ws`` (a layer's stacked experts, uint8 (n_expert,
        rows, row_bytes)) to this GPU on its copy stream, so that the copy runs while the compute
        stream works (the next layer of a prompt while this one computes: :mod:`moecache.moe.prefetch`,
        and the expert cache's prompt stacks). ``experts`` (ascending ids; None: all): only those
        experts are copied, each to its own position of arrays of the full shape (one DMA per run
        of consecutive ids; the other positions keep what they held). :meth:`finish_upload` makes the
        compute stream wait for the copy and gives the arrays. None when a source is not
        page-locked (``--load-mode mmap``: an asynchronous copy needs pinned memory) or when the
        GPU has no room; the caller uploads as before. ``out``: device arrays of the same shapes
        to copy into instead (nothing allocated; the caller orders their earlier readers before
        this call on the compute stream). ``compact`` (with ``experts`` and ``out``): expert
        ``experts[i]`` goes to position i of ``out`` (arrays of at least ``len(experts)`` experts: a
        prompt group's buffer, :meth:`CachedExperts._prompt_groups`).

        The arrays are allocated on the compute stream (CuPy's pool is per stream), and the copy
        waits for the compute stream's work queued so far: the memory may have been freed by
        arrays that kernels queued before still read."""
        if not all(_is_pinned(w) for w in ws):
            self._note("the next layer's experts are not prefetched during a prompt: they are not in "
                       "page-locked memory (--load-mode pin); each layer copies its own")
            return None
        nbytes = sum(int(w.nbytes) for w in ws)
        with cp.cuda.Device(self.device):
            cs = self._copies()
            try:
                outs = out if out is not None else tuple(cp.empty(w.shape, cp.uint8) for w in ws)
            except cp.cuda.memory.OutOfMemoryError:
                self._note(f"GPU {self.device} has no room for the next layer's experts ({nbytes >> 20} MiB): "
                           f"those prompt layers copy their own, after the layer before")
                return None
            cs.wait_event(cp.cuda.get_current_stream().record(cp.cuda.Event(disable_timing=True)))
            runs = [(0, 0, ws[0].shape[0])] if experts is None else expert_runs(experts)
            for o, w in zip(outs, ws):
                _dma_in_place(o, w, runs, cs, compact)
            return _Upload(outs, cs.record(cp.cuda.Event(disable_timing=True)))

    def room_for(self, nbytes: int, limit: int | None) -> bool:
        """Whether ``nbytes`` more can be allocated without the GPU's memory in use (every process,
        our CUDA context included: ``cudaMemGetInfo``, what ``--vram-budget`` counts) passing
        ``limit`` bytes; None: no limit. The blocks CuPy's pool holds free count as in use (a new
        array may not fit in them: counting them free let the prompt stacks take the 12620-token
        prompt of run ``h200-s11p`` 455 MiB past its 8 GiB budget, ``bench/results/vs-llamacpp-h200.md``);
        when only they stand in the way they go back to the driver first (``free_all_blocks``,
        which waits for the GPU's queued work)."""
        if limit is None:
            return True
        used = self.memory_in_use()
        if used + nbytes <= limit:
            return True
        with cp.cuda.Device(self.device):
            if used - cp.get_default_memory_pool().free_bytes() + nbytes > limit:
                return False
        self.release_cached()
        return self.memory_in_use() + nbytes <= limit

    def memory_in_use(self) -> int:
        """Bytes of this GPU's memory in use by every process (``cudaMemGetInfo``): our CUDA context
        and CuPy's pool, its cached free blocks included; what ``--vram-budget`` and nvidia-smi count."""
        with cp.cuda.Device(self.device):
            free, total = cp.cuda.runtime.memGetInfo()
        return int(total - free)

    def memory_total(self) -> int:
        """Bytes of this GPU's memory (``cudaMemGetInfo``'s total): the limit the expert cache's prompt
        stacks keep within when no ``--vram-budget`` is given."""
        with cp.cuda.Device(self.device):
            return int(cp.cuda.runtime.memGetInfo()[1])

    def release_cached(self) -> None:
        """Give CuPy's cached free blocks back to the driver (waits for the GPU's queued work)."""
        with cp.cuda.Device(self.device):
            cp.get_default_memory_pool().free_all_blocks()

    def budget_guard(self, limit: int) -> "_BudgetGuard":
        """A guard that keeps CuPy's pool from growing this GPU's memory in use past ``limit`` bytes
        with blocks it holds free: while started (in the calling thread: CuPy's memory hooks are
        per thread), a request the pool cannot serve from its free blocks first gives those blocks
        back to the driver (``free_all_blocks``) when ``cudaMalloc`` would pass the limit.

        Why: a prompt ubatch's transient arrays change size from layer to layer, and the pool keeps
        every freed block; a new request larger than each free one takes new memory. At -ub 2048 a
        prompt's pool grew 1312 MiB for 653 MiB of arrays alive at its peak (H200, 8 GiB,
        ``bench/vram_peak.py``), taking the 12620-token prompt ~700 MiB past an 8 GiB budget.
        Giving the blocks back costs a device synchronisation, only when near the limit."""
        return _BudgetGuard(self.device, limit)

    def elastic_slot_arrays(self, shapes: tuple[tuple[int, ...], ...], tail: int) -> tuple[tuple[cp.ndarray, ...], Any]:
        """uint8 zeros of each shape (``(n_slots, ...)``: the expert cache's gate, up and down
        slots) on this GPU, each over CUDA virtual memory whose part behind the last ``tail`` slots
        can be given back to the driver while prompt ubatches run and mapped again for decode,
        in pieces of :data:`ELASTIC_PIECE_SLOTS` slots (the returned
        :class:`~moecache.backends.cuda_vmm.ElasticSet`). The arrays keep their buffers alive. Raises :class:`~moecache.backends.cuda_vmm.VmmError` when the driver refuses (the
        caller falls back to plain slots)."""
        from moecache.backends.cuda_vmm import ElasticBuffer, ElasticSet

        arrays, buffers = [], []
        with cp.cuda.Device(self.device):
            for shape in shapes:
                n = int(np.prod(shape))
                per = n // shape[0]
                cuts = tuple((shape[0] - tail + k) * per for k in range(ELASTIC_PIECE_SLOTS, tail, ELASTIC_PIECE_SLOTS))
                buf = ElasticBuffer(self.device, n, (shape[0] - tail) * per, cuts)
                mem = cp.cuda.UnownedMemory(buf.ptr, n, buf, self.device)
                a = cp.ndarray(shape, cp.uint8, cp.cuda.MemoryPointer(mem, 0))
                a.fill(0)
                arrays.append(a)
                buffers.append(buf)
        pers = tuple(int(np.prod(sh)) // sh[0] for sh in shapes)
        return tuple(arrays), ElasticSet(tuple(buffers), pers, shapes[0][0] - tail, tail)

    def empty_u8(self, shape: tuple[int, ...]) -> cp.ndarray:
        """uint8 (uninitialized) on this GPU, on the current stream: a prompt's stack of one layer's
        experts, of which only the positions a ubatch uses are written and read."""
        with cp.cuda.Device(self.device):
            return cp.empty(shape, cp.uint8)

    def upload_experts_into(self, dst: cp.ndarray, w: np.ndarray, ids: np.ndarray) -> None:
        """``dst[ids] = w[ids]`` (host experts ``w`` uint8 (n_expert, rows, row_bytes), ``ids``
        ascending) on the current stream: from page-locked weights one DMA per run of consecutive
        ids straight into place; otherwise through :meth:`upload_experts` (a page-locked staging
        gather) and a device scatter."""
        if not ids.size:
            return
        if _is_pinned(w):
            with cp.cuda.Device(self.device):
                _dma_in_place(dst, w, expert_runs(ids), cp.cuda.get_current_stream())
            return
        dst[self.asarray(np.asarray(ids, np.int64))] = self.upload_experts(w, ids)

    def gather_into(self, dst: cp.ndarray, ids: np.ndarray, src: cp.ndarray, rows: np.ndarray) -> None:
        """``dst[ids] = src[rows]`` on this GPU (resident experts copied from their cache slots into a
        prompt's stack), queued on the current stream."""
        if not ids.size:
            return
        with cp.cuda.Device(self.device):
            dst[self.asarray(np.asarray(ids, np.int64))] = src[self.asarray(np.asarray(rows, np.int64))]

    def finish_upload(self, up: "_Upload") -> tuple[cp.ndarray, ...]:
        """The arrays of :meth:`start_upload`; the work queued after this on the compute stream runs
        once the copy has completed (no host wait)."""
        with cp.cuda.Device(self.device):
            cp.cuda.get_current_stream().wait_event(up.event)
        return up.arrays

    def start_slot_copy(self, dsts: tuple[cp.ndarray, ...], slot: int, srcs: tuple[np.ndarray, ...]) -> "_SlotCopy":
        """Copy host ``srcs[i]`` into ``dsts[i][slot]`` on this GPU's copy stream, asynchronously; the
        copy waits for the work already queued on the compute stream (a kernel may still read the
        slot's previous expert). Pageable sources go through pinned buffers from CuPy's pinned pool.
        ``done()`` of the result says when the slot may be read. Each copy is one ``cudaMemcpyAsync``
        on raw pointers where both sides are C-contiguous of one shape and dtype (``ndarray.set``'s
        checks cost more host time than the call: a decode step of 8 tokens starts ~23 of these
        copies, three arrays each); otherwise ``ndarray.set``, which raises on a shape mismatch."""
        rt = cp.cuda.runtime
        with cp.cuda.Device(self.device):
            cs = self._copies()
            cs.wait_event(cp.cuda.get_current_stream().record())
            keep = []
            for dst, src in zip(dsts, srcs):
                if not _is_pinned(src):
                    mem = cp.cuda.alloc_pinned_memory(src.nbytes)
                    buf = np.frombuffer(mem, np.uint8, src.nbytes).reshape(src.shape)
                    buf[...] = src
                    keep.append(mem)
                    src = buf
                d = dst[slot]
                if d.flags.c_contiguous and src.flags.c_contiguous and d.shape == src.shape and d.dtype == src.dtype:
                    rt.memcpyAsync(d.data.ptr, src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, cs.ptr)
                else:
                    d.set(src, stream=cs)
            return _SlotCopy(cs.record(), keep)

    def asarray(self, a: np.ndarray) -> cp.ndarray:
        """Host array -> GPU array."""
        return self._put(a)

    def adopt(self, a: Any) -> cp.ndarray:
        """An array of any backend as an array on this GPU (copied from the host or another GPU)."""
        if isinstance(a, np.ndarray):
            return self._put(a)
        if a.device.id == self.device:
            return a
        with cp.cuda.Device(self.device):
            out = cp.empty_like(a)
            out.data.copy_from_device(a.data, a.nbytes)
        return out

    def to_host(self, a: cp.ndarray) -> np.ndarray:
        """GPU array -> numpy array (a device-to-host copy)."""
        return cp.asnumpy(a)

    def zeros_u8(self, shape: tuple[int, ...]) -> cp.ndarray:
        """uint8 zeros allocated on this GPU (expert-cache slots; nothing staged through host memory)."""
        with cp.cuda.Device(self.device):
            return cp.zeros(shape, cp.uint8)

    def zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> cp.ndarray:
        """Zeros on this GPU (the KV cache's buffers: float32, or float16 with ``-ctk/-ctv f16``)."""
        with cp.cuda.Device(self.device):
            return cp.zeros(shape, dtype)

    # ---- quantized operations ----------------------------------------------------------------------
    def _suffix(self, w: Linear) -> str:
        return SUFFIX[format_for(w.ggml_type, w.name).name]

    def dequantize(self, w: Linear, idx: cp.ndarray | None = None, dtype: Any = cp.float32) -> cp.ndarray:
        """``dtype`` (float32, or float16 rounded to nearest) (n, n_in) of W's rows: all of them, or
        rows ``idx`` (int64 device array)."""
        if w.is_f32:
            out = w.data if idx is None else w.data[idx]
            return out if dtype == cp.float32 else out.astype(dtype)
        n_rows = w.data.shape[0] if idx is None else idx.shape[0]
        out = cp.empty((n_rows, w.n_in), dtype)
        units = n_rows * (w.n_in // 32)
        self._fn("deq_" + self._suffix(w))(
            ((units + THREADS - 1) // THREADS,), (THREADS,),
            (w.data, NULL if idx is None else idx, out, _i64(n_rows), _i64(w.data.shape[1]), _i64(w.n_in),
             np.int32(out.dtype == cp.float16)))
        return out

    def matmul(self, w: Linear, x: cp.ndarray) -> cp.ndarray:
        """``x @ W.T``: float32 (T, n_in) -> (T, n_out). Up to GEMV_MAX_TOKENS tokens a fused kernel
        reads the quantized rows once; more: W dequantized, one cuBLAS GEMM into float32 (:mod:`.gemm`),
        with W and x rounded to float16 (tensor cores) unless ``act_q8`` is off."""
        if w.is_f32:
            return x @ w.data.T
        if x.shape[0] > GEMV_MAX_TOKENS:
            y = cp.empty((x.shape[0], w.data.shape[0]), cp.float32)
            run_gemm(rows_times_weights_t(1, x.shape[0], w.data.shape[0], w.n_in),
                     self.dequantize(w, dtype=self.gemm_dtype(x.shape[0])), self._prompt_operand(x), y)
            return y
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n_rows, row_bytes = w.data.shape
        if self._gemvq_ok(w):
            return self._gemvq([w], x)[0]
        y = cp.empty((x.shape[0], n_rows), cp.float32)
        self._fn("gemv_" + self._suffix(w))(
            ((n_rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,), (32 * WARPS_PER_BLOCK,),
            (w.data, x, y, _i64(n_rows), _i64(row_bytes), _i64(w.n_in), np.int32(x.shape[0])))
        return y

    def matmuls(self, ws: list[Linear], x: cp.ndarray) -> list[cp.ndarray]:
        """``[x @ W.T for W in ws]`` (the products that read one input: q, k and v; gate and up).
        Up to GEMV_MAX_TOKENS tokens, with 8-bit activations, the matrices that share a
        :data:`Q8_ACT` format and row size take one ``gemvq`` launch per group of up to three (a
        decode step's launches are latency-bound: a Q4_K_M file's Q6_K attn_v goes apart from its
        Q4_K q and k); the others one :meth:`matmul` each."""
        if x.shape[0] > GEMV_MAX_TOKENS or not self.act_q8:
            return [self.matmul(w, x) for w in ws]
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        groups: dict[tuple, list[int]] = {}
        for i, w in enumerate(ws):
            key = (format_for(w.ggml_type, w.name).name, w.data.shape[1:], w.n_in) if self._gemvq_ok(w) else ("-", i)
            groups.setdefault(key, []).append(i)
        out: list[Any] = [None] * len(ws)
        for idx in groups.values():
            for a in range(0, len(idx), 3):
                part = idx[a:a + 3]
                ys = self._gemvq([ws[i] for i in part], x) if len(part) > 1 else [self.matmul(ws[part[0]], x)]
                for i, y in zip(part, ys):
                    out[i] = y
        return out

    def _gemvq_ok(self, w: Linear) -> bool:
        """Whether ``gemvq`` takes ``w``: 8-bit activations on, quantized weights of a :data:`Q8_ACT`
        format (:meth:`matmuls` stacks only matrices of one format, row size and width)."""
        return self.act_q8 and not w.is_f32 and format_for(w.ggml_type, w.name).name in Q8_ACT

    def _gemvq(self, ws: list[Linear], x: cp.ndarray) -> list[cp.ndarray]:
        """``gemvq_<fmt>`` of mmvq.cu over 1-3 matrices of one format, row size and width
        (:meth:`_gemvq_ok` each) for float32 x (T <=
        GEMV_MAX_TOKENS, C-contiguous): float32 (T, n_out) each."""
        w0 = ws[0]
        fmt = format_for(w0.ggml_type, w0.name).name
        xq, xd, xs = self._quantized(x)
        ys = [cp.empty((x.shape[0], w.data.shape[0]), cp.float32) for w in ws]
        lpr = lanes_per_row(w0.n_in, fmt)
        rows_per_block = 32 * MMVQ_WARPS // lpr
        total = sum(w.data.shape[0] for w in ws)
        pad = 3 - len(ws)
        wts = [w.data for w in ws] + [NULL] * pad
        outs = list(ys) + [NULL] * pad
        counts = [_i64(w.data.shape[0]) for w in ws] + [_i64(0)] * pad
        self._fn("gemvq_" + SUFFIX[fmt])(
            ((total + rows_per_block - 1) // rows_per_block,), (32 * MMVQ_WARPS,),
            (*wts, xq, xd, xs, *outs, *counts, _i64(w0.data.shape[1]), _i64(w0.n_in), np.int32(x.shape[0]),
             np.int32(lpr)))
        return ys

    def drop_input_caches(self) -> None:
        """Forget the kept conversions of the last input (:meth:`_prompt_operand`,
        :meth:`_quantized`): they and the input they key on are arrays of the last pass, held until
        the next product replaces them (a prompt's 2048 x n_embd and its copies: the expert cache
        lets them go before it maps its elastic slots again,
        :meth:`moecache.moe.cache.CachedExperts.reclaim_tail`)."""
        self._x16 = self._xq = None

    def _prompt_operand(self, x: cp.ndarray) -> cp.ndarray:
        """x as a C-contiguous :meth:`gemm_dtype` array, converted once for the products that read
        the same input (q, k and v; gate and up), keyed by identity as :meth:`_quantized` is."""
        if self._x16 is not None and self._x16[0] is x:
            return self._x16[1]
        xc = cp.ascontiguousarray(x, dtype=self.gemm_dtype(x.shape[0]))
        self._x16 = (x, xc)
        return xc

    def _quantized(self, x: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray, cp.ndarray]:
        """``quantize_q8`` of mmvq.cu: x float32 (R, n), n % 32 == 0 -> (int8 (R, n), scales float32
        (R, n / 32), scale * quant sums float32 (R, n / 32)). The last input's quants are kept: q, k
        and v (and an MoE layer's router and experts) read the same normed activations, quantized
        once. The kept input is referenced, so its memory cannot be reused for another array.
        The key is the array's identity: this relies on activations never being written in place
        after a product read them (true of every model here: each op returns a new array), and on a
        captured decode step starting from arrays made inside the capture."""
        if self._xq is not None and self._xq[0] is x:
            return self._xq[1]
        out = self._quantize_rows(x)
        self._xq = (x, out)
        return out

    def _quantize_rows(self, x: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray, cp.ndarray]:
        """``quantize_q8`` of x float32 (R, n) (C-contiguous, n % 32 == 0, else ValueError), nothing
        kept (:meth:`_quantized` keeps the last input's quants)."""
        r, n = x.shape
        if n % 32:
            raise ValueError(f"quantize_q8: rows of {n} values are not a multiple of 32")
        units = r * n // 32
        out = (cp.empty((r, n), cp.int8), cp.empty((r, n // 32), cp.float32), cp.empty((r, n // 32), cp.float32))
        self._fn("quantize_q8")(((units + 7) // 8,), (256,), (x, *out, _i64(units)))
        return out

    def embed(self, w: Linear, ids: Any) -> cp.ndarray:
        """Rows ``ids`` of an embedding matrix, dequantized: int (T,) (host, or int64 on this GPU) ->
        float32 (T, n_in)."""
        if not isinstance(ids, cp.ndarray):
            ids = self._put(np.asarray(ids, dtype=np.int64))
        return self.dequantize(w, ids)

    # ---- layer operations (ops.cu; the numpy twins are in ArrayOps) ---------------------------------
    def _fused_norm_ok(self, x: cp.ndarray) -> bool:
        """Whether ``rms_norm_q8`` (norm + 8-bit rounding for the decode products) takes x."""
        return (self.act_q8 and x.ndim == 2 and x.shape[0] <= GEMV_MAX_TOKENS and x.shape[1] % 256 == 0
                and x.shape[1] <= 8192)

    def _rms_norm_q8(self, x: cp.ndarray, r: cp.ndarray | None, w: cp.ndarray | None,
                     eps: float) -> tuple[cp.ndarray | None, cp.ndarray]:
        """(x + r or None, the norm) by ``rms_norm_q8`` of ops.cu; the norm's 8-bit quants are kept
        for the products that read it (:meth:`_quantized`)."""
        t, n = x.shape
        h = cp.empty_like(x) if r is not None else None
        y = cp.empty_like(x)
        q = (cp.empty((t, n), cp.int8), cp.empty((t, n // 32), cp.float32), cp.empty((t, n // 32), cp.float32))
        self._fn("rms_norm_q8")((t,), (n // 8,), (x, NULL if r is None else r, NULL if w is None else w,
                                                  NULL if h is None else h, y, *q, np.int32(n), np.float32(eps)))
        self._xq = (y, q)
        return h, y

    def add_rms_norm(self, x: cp.ndarray, r: cp.ndarray, w: cp.ndarray | None, eps: float):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        r = cp.ascontiguousarray(r, dtype=cp.float32)
        if self._fused_norm_ok(x) and r.shape == x.shape:
            return self._rms_norm_q8(x, r, w, eps)
        return super().add_rms_norm(x, r, w, eps)

    def rms_norm(self, x: cp.ndarray, w: cp.ndarray | None, eps: float) -> cp.ndarray:
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if self._fused_norm_ok(x):
            return self._rms_norm_q8(x, None, w, eps)[1]
        n = x.shape[-1]
        y = cp.empty_like(x)
        threads = 32 * min(8, max(1, (n + 127) // 128))
        self._fn("rms_norm")((x.size // n,), (threads,), (x, NULL if w is None else w, y, _i64(n), np.float32(eps)))
        return y

    def rope(self, x: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, neox: bool) -> cp.ndarray:
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        t, h, d = x.shape
        y = cp.empty_like(x)
        n = t * h * (d // 2)
        self._fn("rope")(((n + THREADS - 1) // THREADS,), (THREADS,),
                         (x, y, cp.ascontiguousarray(cos), cp.ascontiguousarray(sin), np.int32(t), np.int32(h),
                          np.int32(d), np.int32(cos.shape[1]), np.int32(bool(neox))))
        return y

    def glu(self, gate: cp.ndarray, up: cp.ndarray, act: str, dtype: Any = cp.float32) -> cp.ndarray:
        """``act(gate) * up`` of float32 arrays of one shape, as ``dtype`` (float32, or float16
        rounded to nearest: one launch for the prompt MoE's down operand)."""
        gate = cp.ascontiguousarray(gate, dtype=cp.float32)
        up = cp.ascontiguousarray(up, dtype=cp.float32)
        half = cp.dtype(dtype) == cp.float16
        out = cp.empty(gate.shape, cp.float16 if half else cp.float32)
        self._fn("glu_f16" if half else "glu")(((gate.size + THREADS - 1) // THREADS,), (THREADS,),
                                               (gate, up, out, _i64(gate.size), np.int32(act != "silu")))
        return out

    def positions(self, pos: np.ndarray) -> cp.ndarray:
        return self._put(np.asarray(pos, dtype=np.int32))

    def rope_tables(self, inv_freq: np.ndarray, pos: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
        key = inv_freq.tobytes()
        inv = self._inv_freq.get(key)
        if inv is None:  # once per RoPE, never while a CUDA graph is being captured
            # from the default pool: the first call may come in a decode graph's warm-up step, under
            # that graph's private pool, which frees its memory when the graph is captured again
            # (another routing process, another KV cache) while this table lives on
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
                inv = self._inv_freq[key] = self._put(np.asarray(inv_freq, np.float64))
        t, half = pos.shape[0], inv.shape[0]
        cs = cp.empty((t, half), cp.float32)
        sn = cp.empty((t, half), cp.float32)
        self._fn("rope_table")(((t * half + 127) // 128,), (128,), (inv, pos, cs, sn, np.int32(t), np.int32(half)))
        return cs, sn

    def kv_store(self, k_all: cp.ndarray, v_all: cp.ndarray, pos: cp.ndarray, k: cp.ndarray, v: cp.ndarray) -> None:
        t = k.shape[0]
        rk, rv = k_all.shape[1] * k_all.shape[2], v_all.shape[1] * v_all.shape[2]
        self._fn("kv_store" + _kv_suffix(k_all))(((max(rk, rv) + 127) // 128, t), (128,),
                             (cp.ascontiguousarray(k), cp.ascontiguousarray(v), k_all, v_all, pos, np.int32(t),
                              np.int32(rk), np.int32(rv)))

    def qk_rope_store(self, q, k, v, q_norm, k_norm, eps, cos, sin, neox, k_all, v_all, pos, kv_base=None):
        """:meth:`ArrayOps.qk_rope_store` in one launch (``qk_rope_store`` of ops.cu); head sizes up to 256."""
        t, n_head, d = q.shape
        n_kv, dv = v.shape[1], v.shape[2]
        if d > 256 or d % 2 or (pos is not None and not isinstance(pos, cp.ndarray)):
            return super().qk_rope_store(q, k, v, q_norm, k_norm, eps, cos, sin, neox, k_all, v_all, pos, kv_base)
        q, k, v = (cp.ascontiguousarray(a, dtype=cp.float32) for a in (q, k, v))
        qo = cp.empty_like(q)
        self._fn("qk_rope_store" + _kv_suffix(k_all))(
            (n_head + 2 * n_kv, t), (128,),
            (q, k, v, NULL if q_norm is None else q_norm, NULL if k_norm is None else k_norm, np.float32(eps),
             cp.ascontiguousarray(cos), cp.ascontiguousarray(sin), np.int32(cos.shape[1]), np.int32(bool(neox)),
             qo, k_all, v_all, pos, np.int32(n_head), np.int32(n_kv), np.int32(d), np.int32(dv),
             _device_i32(kv_base)))
        return qo

    def attention(self, q: cp.ndarray, k_all: cp.ndarray, v_all: cp.ndarray, pos0: Any, scale: float,
                  window: int | None = None, softcap: float | None = None, kv_base: Any = None,
                  n_ctx: int | None = None) -> cp.ndarray:
        t, n_head, d = q.shape
        dv = v_all.shape[2]
        if self._mma and flash_ok(t, d, dv, k_all.dtype, v_all.dtype, kv_base) and _flat16(k_all) and _flat16(v_all):
            first = self.positions([int(pos0)]) if np.ndim(pos0) == 0 else pos0  # the kernel reads pos[0]
            return self._attention_prompt(q, k_all, v_all, first, scale, window, softcap)
        if t > ATT_MAX_TOKENS or d > ATT_MAX_HEAD_DIM or dv > ATT_MAX_HEAD_DIM:
            return super().attention(q, k_all, v_all, pos0, scale, window, softcap, kv_base, n_ctx)
        pos = self.positions(np.arange(int(pos0), int(pos0) + t)) if np.ndim(pos0) == 0 else pos0
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        out = cp.empty((t, n_head * dv), cp.float32)
        # the grids follow the cache's capacity, not the position: a captured graph replays at every
        # position; each kernel reads the positions from device memory and takes its own queries:
        # attn_decode those with fewer than GQA_MIN_KEYS keys, attn_gqa the others
        # with kv_base, each query's keys are its sequence's n_ctx rows (the grids follow those)
        cap = k_all.shape[0] if kv_base is None or n_ctx is None else n_ctx
        n_kv = k_all.shape[1]
        kvb = _device_i32(kv_base)
        args = (q, k_all, v_all, pos, np.int32(n_head), np.int32(n_kv), np.int32(d), np.int32(dv),
                np.float32(scale), np.int32(window or 0), np.float32(softcap or 0.0))
        use_gqa = gqa_ok(n_head, n_kv, d, dv) and cap >= GQA_MIN_KEYS and (not window or window >= GQA_MIN_KEYS)
        s_a = att_splits(cap)
        part_a = cp.empty((t, n_head, s_a, dv + 2), cp.float32)
        self._fn("attn_decode" + _kv_suffix(k_all))((n_head, t, s_a), (32 * ATT_WARPS,),
                                                    args[:3] + (part_a,) + args[3:] +
                                                    (np.int32(GQA_MIN_KEYS if use_gqa else 0), kvb))
        s_b, min_run, part_b = 0, 0, NULL
        if use_gqa:  # each KV head read once for its query group
            s_b, min_run = gqa_splits(cap)
            part_b = cp.empty((t, n_head, s_b, dv + 2), cp.float32)
            self._fn(f"attn_gqa_d{dv // 32}" + _kv_suffix(k_all))((n_kv, t, s_b), (GQA_THREADS,),
                                                                  args[:3] + (part_b,) + args[3:] +
                                                                  (np.int32(min_run), np.int32(GQA_MIN_KEYS), kvb))
        quant = (NULL, NULL, NULL)
        if self.act_q8 and dv % 32 == 0:  # the attn_output product reads out's 8-bit rounding: made here
            quant = (cp.empty((t, n_head * dv), cp.int8), cp.empty((t, n_head * dv // 32), cp.float32),
                     cp.empty((t, n_head * dv // 32), cp.float32))
        self._fn("attn_combine")((n_head, t), (COMBINE_THREADS,), (part_a, part_b, out, np.int32(n_head), np.int32(s_a),
                                                      np.int32(s_b), np.int32(dv), pos, np.int32(window or 0),
                                                      np.int32(min_run), np.int32(GQA_MIN_KEYS), *quant))
        if quant[0] is not NULL:
            self._xq = (out, quant)
        return out

    @cached_property
    def _mma(self) -> bool:
        """Whether the GPU has mma.m16n8k16 and mma.m16n8k32 (sm_80+), which ``attn_prompt_*`` and
        ``moeq_mma_*`` need."""
        return int(cp.cuda.Device(self.device).compute_capability) >= 80

    def _attention_prompt(self, q: cp.ndarray, k_all: cp.ndarray, v_all: cp.ndarray, pos: cp.ndarray, scale: float,
                          window: int | None, softcap: float | None) -> cp.ndarray:
        """A prompt's attention in one ``attn_prompt`` launch (ops.cu; the scheme and its CPU twin:
        :mod:`moecache.backends.flash`): float16 Q and P by default; without ``act_q8`` Q and P as
        split float16 pairs, float32 attention to float rounding. q float32 (T, n_head, D) at the
        positions ``pos`` (device int32, only the first is read); returns float32 (T, n_head * D)."""
        t, n_head, d = q.shape
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        out = cp.empty((t, n_head * d), cp.float32)
        name = f"attn_prompt_d{d // 32}_f16" + ("" if self.act_q8 else "_x")
        self._fn(name)((-(-t // PA_BQ), n_head), (PA_THREADS,),
                       (q, k_all, v_all, out, _device_i32(pos), np.int32(t), np.int32(n_head), np.int32(k_all.shape[1]),
                        np.float32(scale), np.int32(window or 0), np.float32(softcap or 0.0)))
        return out

    def route(self, w: Linear, x: cp.ndarray, k: int, renorm: bool) -> Routing:
        """Router product and softmax top-k (:meth:`ArrayOps.route`). A float32 router of up to
        1024 experts on up to GEMV_MAX_TOKENS tokens is one ``router_topk`` launch (ops.cu); else
        :meth:`matmul` then :meth:`topk_routing`."""
        # F32 routers: a float32 matrix, or (as linear() keeps them) its raw bytes
        wf = w.data if w.is_f32 else None
        raw_f32 = w.data.ndim == 2 and w.data.flags.c_contiguous and format_for(w.ggml_type, w.name).name == "F32"
        if wf is None and raw_f32:
            wf = w.data.view(cp.float32)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        t = x.shape[0]
        n_expert, n = wf.shape if wf is not None else (0, 0)
        if not (0 < n_expert <= 1024 and t <= GEMV_MAX_TOKENS and n % 4 == 0 and n == w.n_in == x.shape[1]
                and wf.flags.c_contiguous and wf.data.ptr % 16 == 0 and x.data.ptr % 16 == 0):
            return super().route(w, x, k, renorm)
        logits = cp.empty((t, n_expert), cp.float32)
        ids = cp.empty((t, k), cp.int32)
        wts = cp.empty((t, k), cp.float32)
        self._fn("router_topk")((n_expert,), (ROUTER_THREADS,), (wf, x, logits, ids, wts, np.int32(n_expert),
                                                               np.int32(n), np.int32(t), np.int32(k),
                                                               np.int32(renorm), self._router_done))
        return Routing(ids, wts)

    def _masked_softmax(self, s: cp.ndarray, pos0: int, start: int, window: int | None, scale: float,
                        softcap: float | None) -> None:
        """:meth:`ArrayOps._masked_softmax` in one ``masked_softmax`` launch (ops.cu) instead of ~10
        CuPy calls (the prompt is host-bound: bench/results/decode-profile-h200.md)."""
        if not s.flags.c_contiguous or s.dtype != cp.float32:
            return super()._masked_softmax(s, pos0, start, window, scale, softcap)
        h, t, n = s.shape
        self._fn("masked_softmax")((h * t,), (SOFTMAX_THREADS,), (s, np.int32(t), _i64(n), np.int32(pos0),
                                                                 np.int32(start), np.int32(window or 0),
                                                                 np.float32(scale), np.float32(softcap or 0.0)))

    def topk_routing(self, logits: cp.ndarray, k: int, renorm: bool) -> Routing:
        """Softmax top-k routing on the GPU (ties: lower id first); ids and weights stay on the device."""
        logits = cp.ascontiguousarray(logits, dtype=cp.float32)
        t, n_expert = logits.shape
        if n_expert > 1024:
            return self._cpu.topk_routing(cp.asnumpy(logits), k, renorm)
        ids = cp.empty((t, k), cp.int32)
        w = cp.empty((t, k), cp.float32)
        self._fn("softmax_topk")((t,), (32,), (logits, ids, w, np.int32(n_expert), np.int32(k), np.int32(renorm)))
        return Routing(ids, w)

    def moe_ffn(self, gate: cp.ndarray, up: cp.ndarray, down: cp.ndarray, types: tuple[int, int, int],
                routing: Routing, h: cp.ndarray, act: str) -> cp.ndarray:
        """Routed experts on the GPU; the same contract as :meth:`NumpyBackend.moe_ffn` (weights here
        are device arrays of raw blocks, (n_expert, rows, row_bytes))."""
        h = cp.ascontiguousarray(h, dtype=cp.float32)
        t, n_embd = h.shape
        if t > GEMV_MAX_TOKENS or (routing.on_host and routing.ids.size and routing.ids.min() < 0):
            return self._moe_prompt(gate, up, down, types, routing, h, act)  # the decode kernels take no id < 0
        ids = cp.ascontiguousarray(cp.asarray(routing.ids), dtype=cp.int32)
        w = cp.ascontiguousarray(cp.asarray(routing.weights), dtype=cp.float32)
        if types[0] != types[1]:
            return self._moe_prompt(gate, up, down, types, routing, h, act)
        return self._moe_decode(gate, up, down, types, ids, w, h, act)

    def _moe_decode(self, gate, up, down, types, ids, w, h, act, slot_map=NULL, host=(NULL, NULL, NULL),
                    scratch=(NULL, NULL, NULL)) -> cp.ndarray:
        """The two fused decode launches (moe_glu, then moe_down with the weighted sum): ids int32 and
        w float32 (T, k), h float32 (T, n_embd) on this GPU; with a slot map, misses are read from
        ``host`` (pointers) or the staged ``scratch``."""
        t, n_embd = h.shape
        k = ids.shape[1]
        _, ff, rb = gate.shape
        rbd = down.shape[2]
        fmt_g, fmt_d = (format_for(tp).name for tp in (types[0], types[2]))
        fg, fd = SUFFIX[fmt_g], SUFFIX[fmt_d]
        a = cp.empty((t * k, ff), cp.float32)
        if self.act_q8 and fmt_g in Q8_ACT and fmt_d in Q8_ACT:
            xq, xd, xs = self._quantized(h)
            lpr = lanes_per_row(n_embd, fmt_g)
            rpb = 32 * MMVQ_WARPS // lpr
            self._fn("moeq_glu_" + fg)(
                ((ff + rpb - 1) // rpb, t * k), (32 * MMVQ_WARPS,),
                (gate, up, ids, xq, xd, xs, a, np.int32(k), _i64(ff), _i64(rb), _i64(ff * rb), _i64(n_embd),
                 np.int32(act != "silu"), slot_map, host[0], host[1], scratch[0], scratch[1], np.int32(lpr)))
            aq, ad, as_ = self._quantized(a)
            lpr = lanes_per_row(ff * k, fmt_d)  # a row's lanes take the pieces of all k experts
            rpb = 32 * MMVQ_WARPS // lpr
            y = cp.empty((t, n_embd), cp.float32)
            self._fn("moeq_down_" + fd)(
                ((n_embd + rpb - 1) // rpb, t), (32 * MMVQ_WARPS,),
                (down, ids, w, aq, ad, as_, y, np.int32(k), _i64(n_embd), _i64(rbd), _i64(n_embd * rbd), _i64(ff),
                 slot_map, host[2], scratch[2], np.int32(lpr)))
            return y
        self._fn("moe_glu_" + fg)(
            ((ff + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, t * k), (32 * WARPS_PER_BLOCK,),
            (gate, up, ids, h, a, np.int32(k), _i64(ff), _i64(rb), _i64(ff * rb), _i64(n_embd),
             np.int32(act != "silu"), slot_map, host[0], host[1], scratch[0], scratch[1]))
        y = cp.empty((t, n_embd), cp.float32)
        self._fn("moe_down_" + fd)(
            ((n_embd + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, t), (32 * WARPS_PER_BLOCK,),
            (down, ids, w, a, y, np.int32(k), _i64(n_embd), _i64(rbd), _i64(n_embd * rbd), _i64(ff),
             slot_map, host[2], scratch[2]))
        return y

    def fill(self, dst: cp.ndarray, value: int) -> None:
        """``dst[...] = value`` on this GPU, queued on its current stream."""
        with cp.cuda.Device(self.device):
            dst.fill(value)

    def set_from_host(self, dst: cp.ndarray, src: np.ndarray) -> None:
        """Copy host ``src`` into device ``dst`` (same shape and dtype), queued on the current stream;
        ``src`` may be changed as soon as this returns: the driver stages a pageable source before
        returning; a page-locked one is read by the queued copy itself, so that copy is waited for."""
        with cp.cuda.Device(self.device):
            src = np.ascontiguousarray(src, dtype=dst.dtype)
            stream = cp.cuda.get_current_stream()
            dst.set(src, stream=stream)
            if _is_pinned(src):
                stream.synchronize()

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (False where CuPy cannot say)."""
        try:
            return bool(cp.cuda.get_current_stream().is_capturing())
        except AttributeError:
            return False

    def zero_copy_ok(self, arrays: list[np.ndarray]) -> str | None:
        """None if the GPU can read every host array in place (page-locked: ``--load-mode pin``),
        else the reason it cannot."""
        bad = [a for a in arrays if not _is_pinned(a)]
        if bad:
            return "host experts are not in page-locked memory (--load-mode pin makes them so)"
        if any(a.ctypes.data % 16 for a in arrays):  # the kernels read weights as 16-byte words
            return "host experts are not 16-byte aligned in memory (the file's general.alignment)"
        return None

    def moe_ffn_cached(self, pool: tuple[cp.ndarray, cp.ndarray, cp.ndarray], types: tuple[int, int, int],
                       routing: Routing, h: cp.ndarray, act: str, slot_map: cp.ndarray,
                       host: tuple[np.ndarray, np.ndarray, np.ndarray],
                       scratch: tuple[cp.ndarray, cp.ndarray, cp.ndarray] | None = None) -> cp.ndarray:
        """Routed experts of a decode ubatch from an expert cache, in two launches and no host sync
        (so a CUDA graph can capture it): expert e of the layer is read from slot ``slot_map[e]`` of
        the pool when that is >= 0, else straight from its page-locked host copy over PCIe
        (zero-copy; ~36 GB/s for Q4_K on the H200 machine's PCIe 5.0 x16, bench/results).

        Args:
            pool: (gate, up, down) slot arrays, uint8 (n_slots, rows, row_bytes) on this GPU.
            types: GGML type ids of (gate, up, down); gate and up must match.
            routing: ids and weights (T, k), T <= 16 (host or device arrays); a pair of id -1 adds
                nothing (the host handoff's CPU pairs: moecache/moe/handoff.py).
            h: float32 (T, n_embd) on this GPU. act: "silu" or "gelu".
            slot_map: int32 (n_expert,) on this GPU: the slot of each expert of this layer, or -1.
            host: the layer's (gate, up, down) stacked experts, uint8 (n_expert, rows, row_bytes),
                page-locked (see :meth:`zero_copy_ok`).
            scratch: optional (gate, up, down) arrays of at least T * k experts on this GPU: the
                misses are first copied there by ``stage_misses`` (whole 16-byte words over PCIe,
                not the kernels' scattered reads), then read from VRAM. Every matrix's bytes must
                be a multiple of 16.

        Returns:
            float32 (T, n_embd). Raises ValueError for T > 16, gate/up of different types, or a
            scratch too small.
        """
        gate, up, down = pool
        h = cp.ascontiguousarray(h, dtype=cp.float32)
        t, n_embd = h.shape
        if t > GEMV_MAX_TOKENS or types[0] != types[1]:
            raise ValueError(f"moe_ffn_cached: needs T <= {GEMV_MAX_TOKENS} and one gate/up type, got T={t}, types {types}")
        ids = cp.ascontiguousarray(cp.asarray(routing.ids), dtype=cp.int32)
        w = cp.ascontiguousarray(cp.asarray(routing.weights), dtype=cp.float32)
        k = ids.shape[1]
        _, ff, rb = gate.shape
        rbd = down.shape[2]
        ptrs = tuple(np.uint64(a.ctypes.data) for a in host)
        staged = (NULL, NULL, NULL)
        if scratch is not None:
            if scratch[0].shape[0] < t * k or (ff * rb) % 16 or (n_embd * rbd) % 16:
                raise ValueError(f"moe_ffn_cached: a scratch of {scratch[0].shape[0]} experts cannot stage {t * k} "
                                 f"pairs of {ff * rb}/{n_embd * rbd}-byte matrices")
            n_gu, n_d = ff * rb // 16, n_embd * rbd // 16
            chunk = 4096  # uint4 per block: 64 KiB
            self._fn("stage_misses")(
                ((max(n_gu, n_d) + chunk - 1) // chunk, t * k, 3), (256,),
                (ids, slot_map, *ptrs, *scratch, _i64(n_gu), _i64(n_d), _i64(chunk)))
            staged = scratch
        return self._moe_decode(gate, up, down, types, ids, w, h, act, slot_map, ptrs, staged)

    def _deq_experts(self, w: cp.ndarray, ggml_type: int, eids: cp.ndarray, n_in: int, out: cp.ndarray) -> cp.ndarray:
        """Experts ``eids`` of stacked raw ``w`` dequantized into the front of flat ``out`` (float32
        or float16): a view (n_used, rows, n_in)."""
        n_used = eids.shape[0]
        _, n_rows, rb = w.shape
        units = n_used * n_rows * (n_in // 32)
        self._fn("deq_experts_" + SUFFIX[format_for(ggml_type).name])(
            ((units + THREADS - 1) // THREADS,), (THREADS,),
            (w, eids, out, _i64(n_used), _i64(n_rows), _i64(rb), _i64(n_rows * rb), _i64(n_in),
             np.int32(out.dtype == cp.float16)))
        return out[:n_used * n_rows * n_in].reshape(n_used, n_rows, n_in)

    def _moe_prompt(self, gate, up, down, types, routing: Routing, h: cp.ndarray, act: str) -> cp.ndarray:
        """Prompt-sized ubatches: per chunk of used experts (:func:`moe_prompt_chunks`: hottest first,
        bounded weights and padded activations), dequantize their weights (to :meth:`gemm_dtype`)
        and run batched cuBLAS GEMMs (float32 results, :mod:`.gemm`) over their tokens (padded to the
        chunk's largest group), then sum each token's k outputs with its weights in one pass.

        The host plans the whole layer from the routing's ids (copied to the host; weights already on
        the device stay there) in one compiled pass (:func:`~moecache.backends.moe_plan.layer_plan`)
        and uploads every index it needs in one array; each chunk's down product writes its padded
        rows straight into one buffer that ``moe_combine`` reads through each pair's row (no
        scatter); the gated product is rounded to the GEMM's float16 in the same launch (``glu_f16``).
        Host work per layer is the all-GPU prompt's bottleneck (cProfile on the H200: ~13 uploads, 3
        argsorts and a scatter per layer for ~2 ms of Python against ~1.9 ms of kernels, first;
        then, 2026-12-02, the GPU busy 69 of 135 ms of a pp512 and the numpy plan 23 of the host's
        168 ms)."""
        if self.prompt_q8 and self.act_q8:
            out = self._moe_prompt_grouped(gate, up, down, types, routing, h, act)
            if out is not None:
                return out
        on_dev = isinstance(routing.weights, cp.ndarray)  # the weights stay there; only the ids come to the host
        ids_h = routing.host_ids() if on_dev else routing.host().ids
        t, k = ids_h.shape
        n_embd = h.shape[1]
        n_expert, ff, _ = gate.shape
        dt = self.gemm_dtype(t)  # a decode-sized ubatch comes here too when gate and up differ in type
        per_expert = cp.dtype(dt).itemsize * ff * n_embd  # bytes of one dequantized matrix
        max_experts = max(1, MOE_SCRATCH_BYTES // per_expert)
        chunks, idx_h, n_e, n_r, n_p = layer_plan(ids_h, n_expert, max_experts, 4 * max(n_embd, ff), MOE_ACT_BYTES,
                                                  MOE_PROMPT_M_ALIGN, self.prompt_chunk_ratio, self.prompt_m_pow2)
        if not len(chunks):  # every pair of no expert (id < 0)
            return cp.zeros((t, n_embd), cp.float32)
        # the weighted sum's pairs: all T * k, or those of an expert (ids >= 0)
        sel = None if n_p == t * k else np.flatnonzero(ids_h.reshape(-1) >= 0)
        if on_dev:
            idx = cp.asarray(idx_h)  # every index of the layer in one upload
            wts = cp.ascontiguousarray(routing.weights, dtype=cp.float32).reshape(-1)
            wts = wts if sel is None else wts[cp.asarray(sel)]
        else:
            w_host = np.asarray(routing.host().weights, np.float32).reshape(-1)
            idx = cp.asarray(np.concatenate([idx_h, (w_host if sel is None else w_host[sel]).view(np.int32)]))
            wts = idx[idx.size - n_p:].view(cp.float32)
        scratch = cp.empty(min(max_experts, n_e) * ff * n_embd, dt)
        hx = self._prompt_operand(h)  # a shared expert reading h converts it once too
        y_rows = cp.empty((n_r, n_embd), cp.float32)  # each chunk's padded outputs, one after another
        e_at, r_at = 0, n_e
        for n_c, m in chunks.tolist():
            e_dev, tok = idx[e_at:e_at + n_c], idx[r_at:r_at + n_c * m]
            y_at = r_at - n_e  # a chunk's outputs sit where its token rows sit in token_rows
            e_at, r_at = e_at + n_c, r_at + n_c * m
            xp_ = hx[tok].reshape(n_c, m, n_embd)
            up_in, down_in = rows_times_weights_t(n_c, m, ff, n_embd), rows_times_weights_t(n_c, m, n_embd, ff)
            gg, uu = cp.empty((n_c, m, ff), cp.float32), cp.empty((n_c, m, ff), cp.float32)
            run_gemm(up_in, self._deq_experts(gate, types[0], e_dev, n_embd, scratch), xp_, gg)
            run_gemm(up_in, self._deq_experts(up, types[1], e_dev, n_embd, scratch), xp_, uu)
            a = self.glu(gg, uu, act, dt)
            run_gemm(down_in, self._deq_experts(down, types[2], e_dev, ff, scratch), a, y_rows[y_at:y_at + n_c * m])
        at = n_e + n_r
        return self._combine(y_rows, idx[at:at + n_p], wts, idx[at + n_p:at + n_p + t + 1], t)

    def _moe_prompt_grouped(self, gate, up, down, types, routing: Routing, h: cp.ndarray, act: str) -> cp.ndarray | None:
        """The prompt MoE with 8-bit activations, grouped by expert (``prompt_q8``; llama.cpp's MMQ
        idea of reading quantized weights directly, as MMVQ-style kernels: our own code): the pairs
        sorted by expert (:func:`moe_prompt_groups`), h quantized (quantize_q8) and its quants gathered
        in that order, ``moeq_gglu`` reads each expert's gate and up rows once per group of up
        to DECODE_MAX_TOKENS rows, the gated activations are quantized, ``moeq_gdown`` likewise, and
        ``moe_combine`` sums each token's k rows with its weights: 8 launches and one upload a layer,
        no dequantized weights. Q4_K matrices on sm_80+ take ``moeq_mma_gglu`` / ``moeq_mma_gdown``
        instead: the same groups cut at MMQ_TOK rows, each 32-weight unit's integer dot an int8
        tensor-core MMA (mma.m16n8k32; seventeenth session, H200, every expert on the GPU: pp512 3366
        t/s against the float16 GEMMs' 3906, the dp4a kernels' 1707 against 3799 before;
        ``bench/results/prompt-q8-h200.md``). The arithmetic of the decode kernels (moeq_glu /
        moeq_down) for every pair: h (T, n_embd) float32 C-contiguous -> float32 (T, n_embd). None (the caller takes
        the GEMM path) when a pair has no expert (id < 0), gate and up differ in type, a type has no 8-bit kernel, or the groups
        exceed the grid's 65535 rows."""
        hr = routing.host()
        if hr.ids.size and hr.ids.min() < 0:
            self._note("the grouped 8-bit prompt MoE (gpu_prompt_q8) does not take a routing with pairs of no "
                       "expert (the expert cache's prompt groups and slots): those calls use the float16 GEMMs")
            return None
        if not grouped_prompt_ok(types):
            return None
        fmt_g, fmt_d = format_for(types[0]).name, format_for(types[2]).name
        t, k = hr.ids.shape
        n_embd = h.shape[1]
        n_expert, ff, rb = gate.shape
        rbd = down.shape[2]
        # Q4_K on sm_80+: the tensor-core kernels (moeq_mma_*, groups of MMQ_TOK rows); others dp4a's
        mma_g, mma_d = (self._mma and f in MMQ_FORMATS for f in (fmt_g, fmt_d))
        pg = moe_prompt_groups(hr.ids, n_expert, DECODE_MAX_TOKENS)
        pgm = moe_prompt_groups(hr.ids, n_expert, MMQ_TOK) if mma_g or mma_d else pg
        grp_g, grp_d = (pgm if mma_g else pg).groups, (pgm if mma_d else pg).groups
        p = t * k
        if max(grp_g.shape[0], grp_d.shape[0]) > 65535:
            return None
        n_gg, n_gd = grp_g.shape[0], grp_d.shape[0]
        w_host = None if isinstance(routing.weights, cp.ndarray) else np.asarray(hr.weights, np.float32).reshape(-1)
        pieces = [pg.token_of_row, pg.row_of_pair, np.arange(0, p + 1, k, dtype=np.int32), grp_g.reshape(-1),
                  grp_d.reshape(-1)]
        if w_host is not None:
            pieces.append(w_host.view(np.int32))
        idx = cp.asarray(np.concatenate(pieces))  # every index of the layer in one upload
        tok_rows, pair_rows, starts = idx[:p], idx[p:2 * p], idx[2 * p:2 * p + t + 1]
        at = 2 * p + t + 1
        gg, gd = idx[at:at + 3 * n_gg], idx[at + 3 * n_gg:at + 3 * n_gg + 3 * n_gd]
        wts = (cp.ascontiguousarray(routing.weights, dtype=cp.float32).reshape(-1) if w_host is None
               else idx[idx.size - p:].view(cp.float32))
        # h quantized once (T rows), its quants gathered in pair order: row i = pair i's token (the
        # same values as quantizing the gathered float rows, a k-th of the work, a quarter of the bytes)
        xq, xd, xs = (cp.take(q, tok_rows, axis=0)
                      for q in self._quantize_rows(cp.ascontiguousarray(h, dtype=cp.float32)))
        a = cp.empty((p, ff), cp.float32)
        if mma_g:
            self._fn("moeq_mma_gglu_" + SUFFIX[fmt_g])(
                ((ff + MMQ_ROWS - 1) // MMQ_ROWS, n_gg), (32 * MMQ_WARPS,),
                (gate, up, gg, xq, xd, xs, a, _i64(ff), _i64(rb), _i64(ff * rb), _i64(n_embd), np.int32(act != "silu")))
        else:
            lpr = lanes_per_row(n_embd, fmt_g)
            rpb = 32 * MMVQ_WARPS // lpr
            self._fn("moeq_gglu_" + SUFFIX[fmt_g])(
                ((ff + rpb - 1) // rpb, n_gg), (32 * MMVQ_WARPS,),
                (gate, up, gg, xq, xd, xs, a, _i64(ff), _i64(rb), _i64(ff * rb), _i64(n_embd),
                 np.int32(act != "silu"), np.int32(lpr)))
        aq, ad, as_ = self._quantize_rows(a)
        y_rows = cp.empty((p, n_embd), cp.float32)
        if mma_d:
            self._fn("moeq_mma_gdown_" + SUFFIX[fmt_d])(
                ((n_embd + MMQ_ROWS - 1) // MMQ_ROWS, n_gd), (32 * MMQ_WARPS,),
                (down, gd, aq, ad, as_, y_rows, _i64(n_embd), _i64(rbd), _i64(n_embd * rbd), _i64(ff)))
        else:
            lpr = lanes_per_row(ff, fmt_d)
            rpb = 32 * MMVQ_WARPS // lpr
            self._fn("moeq_gdown_" + SUFFIX[fmt_d])(
                ((n_embd + rpb - 1) // rpb, n_gd), (32 * MMVQ_WARPS,),
                (down, gd, aq, ad, as_, y_rows, _i64(n_embd), _i64(rbd), _i64(n_embd * rbd), _i64(ff), np.int32(lpr)))
        return self._combine(y_rows, pair_rows, wts, starts, t)

    def _combine(self, y_rows: cp.ndarray, pair_rows: cp.ndarray, wts: cp.ndarray, starts: cp.ndarray,
                 t: int) -> cp.ndarray:
        """``moe_combine``: out[i] = sum over pairs p in starts[i] .. starts[i + 1] of wts[p] *
        y_rows[pair_rows[p]], float32 (t, n_embd); a launch per 65535 tokens (the grid's y limit),
        each given its tokens' slice of ``starts`` and of the output."""
        n_embd = y_rows.shape[1]
        out = cp.empty((t, n_embd), cp.float32)
        for t0 in range(0, t, 65535):
            n = min(65535, t - t0)
            self._fn("moe_combine")(((n_embd + THREADS - 1) // THREADS, n), (THREADS,),
                                    (y_rows, pair_rows, wts, starts[t0:], out[t0:], np.int32(n), _i64(n_embd)))
        return out


__all__ = ["CupyBackend", "GEMV_MAX_TOKENS", "available"]


def _flat16(a: cp.ndarray) -> bool:
    """A C-contiguous array at a 16-byte aligned address (the kernels' uint4 row loads need both)."""
    return a.flags.c_contiguous and a.data.ptr % 16 == 0


def _device_i32(a: Any) -> Any:
    """An optional int32 index array for a kernel: NULL for None, else a contiguous device int32 array."""
    return NULL if a is None else cp.ascontiguousarray(cp.asarray(a), dtype=cp.int32)


def available() -> tuple[bool, str]:
    """(True, device 0's name) when a CUDA device answers, else (False, the reason)."""
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any CUDA error means no usable GPU
        return False, f"CUDA unavailable: {e}"
    if n == 0:
        return False, "no CUDA device"
    props: Any = cp.cuda.runtime.getDeviceProperties(0)
    return True, props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def device_count() -> int:
    """CUDA devices visible (0 when CUDA does not answer)."""
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001
        return 0
