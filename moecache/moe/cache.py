"""The expert cache: slots of hot experts on a GPU, hybrid hit/miss execution, uploads.

A **pool** is ``n_slots`` slots on one backend; each slot holds one expert's gate, up and down
matrices in their GGUF format (stacked arrays ``(n_slots, rows, row_bytes)``) for the expert
signature (shapes and types) most layers share; layers of another signature run uncached. The **map**
``slot_of[layer][expert]`` says which slot holds an expert (-1: none); an expert becomes visible in
the map only after its upload completed, and leaves it before its slot is overwritten.

Decode ubatches take one of two miss paths:

**Zero-copy** (``zero_copy``: the host experts are page-locked, ``--load-mode pin``). The map also lives
on the device; one ``moe_ffn_cached`` launch pair computes every routed pair, reading a hit from
its slot in VRAM and a miss from host RAM over PCIe: with ``stage_misses`` (the engine's default;
ubatches of 1-2 tokens) a copy kernel first stages the misses into a VRAM scratch of ``2 * top_k``
slots, else the MoE kernels read them in place. Nothing waits for the host, so a
decode step stays one CUDA graph (:mod:`moecache.backends.cuda_graph`). The layer's expert ids are
logged on the device; the pass hooks (:meth:`CachedExperts.begin_pass`, :meth:`launched`,
:meth:`end_pass`, called by the model around every forward pass) bring them to the host after
the pass, and while the *next* pass runs on the GPU the host counts hits and misses against the
map that pass used, feeds the policy and starts the uploads. Map changes reach the device at the
start of a pass, on the compute stream: a victim leaves the device map before any later pass, and
its slot's copy waits for the pass that could still read it.

**Hybrid** (pageable host experts, or ubatches of 17-31 tokens). Per MoE layer:

1. the routing comes to the host (the layer's one sync point) and the routed pairs split into hits
   (expert in a visible slot) and misses;
2. the misses run on the CPU (Numba, in a worker thread: the kernels release the GIL) while the
   hits run on the backend from the slots (one ``moe_ffn`` over the slot arrays; a miss pair rides
   along with weight 0 on one of the visible hit slots: wasted work, never a torn read), and the CPU
   partial sum is added on the backend;
3. the policy (:mod:`moecache.moe.policy`) sees the routing and may admit missed experts; their
   uploads start (on the GPU: a separate copy stream ordered after the compute stream, so no kernel
   still reads a victim's slot) and land in the map at a later call, when complete.

Prompt ubatches (``offload_min_batch`` tokens or more) compute every used expert on the backend.
With ``prompt_stacks`` (opt-in; off by default since its measured gain went with the tiled
prompt attention) each layer is one call on a stack of its experts on the device: resident ones
copied from their slots on the device, the others from the host (op offload), and, with two
buffers, the next cached layer's non-resident experts copied on the copy stream while this layer
computes (the same copy-stream ordering as :mod:`moecache.moe.prefetch`).
With ``prompt_stack_halves`` (opt-in too) one buffer serves in two halves of
the expert ids, the next layer's half copied while this layer's other half computes
(:meth:`CachedExperts._prompt_halves`).
The stacks are up to ``prompt_stack_buffers`` (1 by default) buffers of one layer's experts each,
allocated at the first prompt while the GPU's memory in use leaves room for them under
``--vram-budget`` (without one: the GPU's memory), and given back when a prompt's memory nears it.
Without a stack (the default), the resident experts' pairs are computed from their slots in one
call, the others in groups of ``prompt_group_bytes`` of experts, each group one call on the whole
ubatch with the other pairs marked as none (id -1); with page-locked weights two group buffers
alternate, the next group copied on the copy stream while this one computes
(:meth:`CachedExperts._prompt_groups`). Under ``--vram-budget`` a prompt pass runs under the
backend's ``budget_guard``: CuPy's pool gives its free blocks back before it would pass the budget.
A prompt's expert usage counts, but it admits nothing (a long prompt's flat routing is a poor
guide to decode's hot set; routing.md).

**Elastic slots** (``tail``): a prompt ubatch's transient arrays (activations, attention blocks,
the prompt groups, dequantized scratch) need VRAM that a decode step does not. The last slots of the
pool hold experts while decoding; before a prompt pass they are emptied and their memory goes back
to the driver (on the GPU the slot arrays are CUDA virtual memory, :mod:`moecache.backends.cuda_vmm`),
where CuPy's ordinary pool may hand it to the pass's arrays (:meth:`CachedExperts.lend_tail`; they
start lent too); the second decode pass after it maps memory behind as many of them as fit under
the budget, less a margin, again at the same addresses (:meth:`CachedExperts.reclaim_tail`: the
first ones first, in pieces of a few slots), and fills them with the prompt's most used experts.
The placement sizes them (:func:`moecache.placement.plan`'s ``elastic_slots``); what decoding
really keeps beside the plan decides how many come back.

The backend supplies ``upload``, ``moe_ffn``, ``moe_ffn_cached``, ``zero_copy_ok``,
``to_host``/``asarray`` and ``start_slot_copy`` (a copy of host bytes into ``pool[slot]`` returning
an object with ``done()`` and ``wait()``); NumpyBackend is the CPU twin, where copies complete one poll later so
the in-flight rules are exercised in CI, and where the device map is a separate array.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numba
import numpy as np

from moecache.backends.contract import CacheBackend
from moecache.backends.ops import ATTENTION_SCORE_BYTES, DECODE_MAX_TOKENS, MOE_ACT_BYTES, MOE_SCRATCH_BYTES
from moecache.moe.executor import CPUExperts, ExpertWeights, RoutedCalls
from moecache.moe.handoff import InlineHandoff, SplitControl, check, serve
from moecache.moe.policy import Admission, CachePolicy
from moecache.moe.prefetch import MIN_PAIRS_PER_EXPERT, LayerPrefetch
from moecache.moe.routing import Routing
from moecache.placement import USABLE_FRACTION
from moecache.threads import bind_numba_threads


PROMPT_GROUP_BYTES = 128 << 20  # a prompt ubatch brings its used experts to the device this much at a time (two
# such buffers alternate with page-locked weights: H200, 8 GiB, qwen3-moe, the 12620-token prompt at -ub 512
# 1144 t/s against 848 with one copy-then-compute group at a time, run h200-s16a/c)
MAX_ZERO_COPY_TOKENS = DECODE_MAX_TOKENS  # the zero-copy path's ubatch limit (the fused decode kernels')
HALVES_MIN_TOKENS = 4  # with decode_halves, batched decode steps of this many tokens or more run in two halves
PRELOAD_BATCH = 64  # experts a preload copies at a time (each through its own page-locked buffer)
# prompt keeps (CachedExperts.prompt_keep): experts copied from a group buffer into their slots this many at a
# time (the device gather's temporary: 8 experts of Qwen3-30B-A3B's gate, up or down, 7 MiB)
KEEP_COPY_EXPERTS = 8
# prompt stacks (CachedExperts.prompt_stacks): a layer's stack is filled this many experts at a time (the
# device gather from the slots and a mapped file's staged upload hold one such piece as a temporary)
STACK_FILL_EXPERTS = 32
# room the stack buffers leave under --vram-budget when they are allocated (CachedExperts._stack_buffers;
# later ubatches: _keep_room): the prompt MoE's scratch of dequantized weights and two of its activation
# blocks (MOE_SCRATCH_BYTES, MOE_ACT_BYTES of moecache/backends/ops.py), and a fill's temporary
# (STACK_FILL_EXPERTS experts of Qwen3-30B-A3B: 81 MiB). Not a bound: a chunk may hold six activation
# blocks; 480 MiB is the whole prompt's pool growth with the groups at 8 GiB (482 MiB, pp512, H200,
# bench/results/prompt-q8-h200.md); the 8g-pp512 runs since peaked within the budget with it
STACK_MARGIN_BYTES = MOE_SCRATCH_BYTES + 2 * MOE_ACT_BYTES + (96 << 20)
# the least growth of a prompt ubatch's transient memory over the ubatch before that
# CachedExperts._keep_room allows for. Measured (run h200-s13c, Qwen3-30B-A3B, -ub 512, a trace of
# the 12620-token prompt): the transients grew by 322 MiB from the ubatch ending at 1536 positions
# to the next, and that ubatch peaked 22 MiB under the 8 GiB budget, against a floor of 192 MiB
# then (half a scores block plus 64 MiB of K/V copies: too little); that growth was a scores block
# doubling from 128 to 256 MiB. The attention's blocks are powers of two (ops._scratch), its scores
# at most ATTENTION_SCORE_BYTES (64 MiB since): the floor is two scores blocks plus 128 MiB (the
# K/V copies and the mask doubling at the same ubatch), 256 MiB. Run h200-s14b (64 MiB scores): the
# 12620-token prompt gave its buffer back with 528 MiB of transients and this floor, 16 MiB short
ROOM_FLOOR_BYTES = 2 * ATTENTION_SCORE_BYTES + (128 << 20)


RECLAIM_RETRY_PASSES = 8  # decode passes without a try after the elastic slots could not all be taken back
RECLAIM_RETRY_MAX_PASSES = 256  # ... doubled after each try that took none back, up to this (each try syncs)
# decode passes after a lend (a prompt, or the cache's creation) before the take-back: the first decode
# pass allocates what decoding keeps (a CUDA graph's capture, kernel modules, cuBLAS) while the slots
# are lent, so the take-back measures it. Run h200-s24a (8 GiB, Qwen3-30B-A3B, -c 12948, -ub 2048):
# with every slot mapped at creation 16 MiB stayed free, and after the 12620-token prompt all 501
# elastic slots stayed lent (the all-or-nothing take-back did not fit)
TAKE_BACK_DELAY_PASSES = 1
# what a take-back leaves free under --vram-budget (or the usable share of the GPU) for decode's
# later growth: op-by-op passes' transients (CuPy's cached blocks are given back before each try) and
# the captures of other batch sizes; the decode peak measured ~186 MiB over the plan in all (run
# h200-s21a), of which most exists before the take-back (TAKE_BACK_DELAY_PASSES)
TAKE_BACK_MARGIN_BYTES = 128 << 20
PATH_CHECK_PASSES = 64  # decode passes between two checks of a layer plan's CPU path (_check_plan_paths)
PATH_SWITCH = 0.75  # ... which switches it only when this share of those passes ran the other way
LENT = ("lent",)  # the owner of an elastic slot lent to a prompt's arrays (CachedExperts.lend_tail)


@dataclass
class CacheStats:
    """Counters since the start (or the last :meth:`reset`)."""

    tokens: int = 0
    hits: int = 0
    misses: int = 0
    uploads: int = 0
    uploaded_bytes: int = 0
    cpu_misses: int = 0  # misses the CPU computed through the miss split (counted in misses too)
    cpu_wait_ns: int = 0  # how long the GPU waited for the CPU's answers (the handoff's wait_ns, summed)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    def reset(self) -> None:
        """Zero the counters."""
        self.tokens = self.hits = self.misses = self.uploads = self.uploaded_bytes = self.cpu_misses = self.cpu_wait_ns = 0


@dataclass
class _Pool:
    """Slots of one expert signature: stacked (n_slots, rows, row_bytes) gate, up, down on the backend."""

    gate: Any
    up: Any
    down: Any
    types: tuple[int, int, int]
    owner: list = field(default_factory=list)  # slot -> (layer, expert) or None
    _where: dict = field(default_factory=dict)  # (layer, expert) -> slot: a hint that owner confirms

    def slot_held_by(self, key: tuple[int, int]) -> int:
        """The slot that ``key`` (layer, expert) owns (ValueError when none): the hint when ``owner``
        confirms it, else a search (a slot written straight into ``owner``), O(1) per admission's
        victim instead of a scan of every slot."""
        s = self._where.get(key)
        if s is None or s >= len(self.owner) or self.owner[s] != key:
            s = self.owner.index(key)
            self._where[key] = s
        return s

    def set_owner(self, slot: int, key: tuple[int, int] | None) -> None:
        """Give ``slot`` to ``key`` (None: empty), keeping the hint."""
        old = self.owner[slot]
        if old is not None and self._where.get(old) == slot:
            del self._where[old]
        self.owner[slot] = key
        if key is not None:
            self._where[key] = slot


class CachedExperts:
    """Routed experts in host RAM with a cache of hot ones in slots on ``backend``.

    Args:
        layers: layer index -> that layer's experts (host views; pinned with ``--load-mode pin``).
        backend: where the slots live and hits are computed (a CupyBackend; NumpyBackend as the
            CPU twin): a :class:`~moecache.backends.contract.CacheBackend`.
        n_slots: slots per signature pool (the budget divided by the bytes of one expert).
        policy: decides admissions (its pool size must equal the total slots).
        offload_min_batch: prompt ubatches of this many tokens go the op-offload way.
        zero_copy: the zero-copy miss path; None: when the backend is a GPU that can read the host
            experts in place (``zero_copy_ok``). ``zero_copy_why`` says why not, when not.
        top_k: experts per token (the routing log's width), the model's ``expert_used_count``;
            required for the zero-copy path (ValueError without it).
        stage_misses: on the zero-copy path, copy a decode ubatch's missed experts into a VRAM
            scratch of ``2 * top_k`` experts with one copy kernel (16-byte loads over PCIe) before
            the MoE kernels read them, instead of the kernels reading host RAM directly (ubatches
            of 1-2 tokens; larger ones read directly). False here; the engine turns it on by
            default (``Engine(stage_misses=True)``: 8 GiB, H200, one process, +13% decode at uniform
            routing, +6-13% at low-locality: +6% with uploads frozen).
        prompt_group_bytes: a prompt ubatch (without ``prompt_stacks``, or when there is no room for
            a stack buffer or it was given back) brings its non-resident used experts to the device
            this many bytes at a time (None: :data:`PROMPT_GROUP_BYTES`; each group is one MoE call
            on the backend; with page-locked weights two buffers of this size alternate).
        vram_limit: ``--vram-budget`` in bytes (None: none, and the GPU's own memory is the limit):
            the prompt stacks' buffers are allocated only while the GPU's memory in use leaves room
            under it for them and for :data:`STACK_MARGIN_BYTES` more (the backend's ``room_for``),
            and given back when a prompt's memory nears it (:meth:`_keep_room`).
        log: where a one-time note goes (the engine's log); None: nowhere.
        act_q8: misses computed on the CPU (and ubatches below ``offload_min_batch`` without the
            zero-copy path) round activations to 8 bits in the Numba kernel (``cpu.moe_ffn_routed``'s
            ``act_q8``), as the GPU's hits do with ``CupyBackend(act_q8=True)``.
        tail: elastic slots: the pool's last ``tail`` of its ``n_slots`` slots hold experts while
            decoding; their memory is given back to the driver for each prompt pass and mapped
            again for decode (:meth:`lend_tail`, :meth:`reclaim_tail`; the backend's
            ``elastic_slot_arrays``), so the VRAM a prompt ubatch needs for its transients holds
            experts the rest of the time; as many come back as the memory in use leaves room for
            (lent from the start). 0: none; plain slots, said once, where the backend cannot make
            them. Needs a prompt path (``offload_min_batch``); ValueError unless
            0 < ``tail`` < ``n_slots``.
        miss_split: on the zero-copy path, decode steps captured in a CUDA graph hand a share of
            each layer's misses to the CPU inside the graph (:mod:`moecache.moe.handoff`): the GPU
            posts the layer's input and the pairs the CPU takes (up to ``split.ncpu[il]`` misses per
            token, refit after every replay from the GPU's measured wait, :class:`SplitControl`),
            computes the hits and the other misses meanwhile, then adds the CPU's sum; the host
            answers in :meth:`launched`. Op-by-op passes do not split (they would queue launches
            while the GPU waits for the host); the CPU twin answers inline. Off by default: measured
            slower on the H200 (bench/results/miss-split-h200.md). Ignored (said once) without the zero-copy path.

    Attributes:
        prompt_stacks: prompt ubatches compute each layer from one stack of its experts on the device
            (:meth:`_prompt_stack`: residents copied from their slots on the device, the others from
            the host). False by default since the fifteenth session (the groups of
            ``prompt_group_bytes`` instead): with the tiled prompt attention the stack gained no speed
            and cost memory. H200, 8 GiB, pin, qwen3-moe, ``moecache bench`` with NVML peaks: stacks
            on, pp12620 614 t/s at **8275 MiB (over the budget: the check gave the buffer back one
            ubatch late)**, pp512 646 t/s at 8007 MiB; off, pp12620 598 t/s at 7641 MiB, pp512 705
            t/s at 7441 MiB (``bench/results/attn-prompt-h200.md``). Opt-in (True) for measurement.
        prompt_stack_buffers: the stack buffers wanted (1, default: each layer copies its own; 2: the
            next layer copied ahead, twice the memory). One by measurement: ``bench/prompt_q8.py --ab
            cache`` (H200, 8 GiB, pp512, empty slots, session 13) ran 1110 t/s with two and 1123 with
            one, whose pool grew 618 MiB against 1169 (``bench/results/prompt-q8-h200.md``).
        prompt_stack_halves: with one buffer, each layer in two calls, one per half of the expert
            ids, the next layer's half copied while the other half computes
            (:meth:`_prompt_halves`; with ``prompt_stacks`` only). False by default: its GPU tests
            pass (H200, fifteenth session), but ``bench/prompt_q8.py --ab cache`` there gave it 547
            t/s against the groups' 780, every stack arm having given its buffer back after the
            warm-up prompt (its overlap was not measured in isolation).
        prompt_group_ahead: with page-locked weights, before a prompt layer's last group call is
            queued, the next cached layer's first group is copied into the other group buffer: its
            first ``prompt_group_bytes`` of non-resident experts by id, chosen before its routing is
            known (a ubatch of :data:`~moecache.moe.prefetch.MIN_PAIRS_PER_EXPERT` pairs per expert
            or more uses nearly all of them). The copy then runs during the last group's call, the
            next layer's attention and router, the host's plan and the next layer's resident call
            (the compute stream waits for it only before that group's call), where the copy stream
            otherwise idles. On the H200 the 8 GiB pp512 left the GPU idle 191 of 530 ms (6e8b9af,
            seventeenth session; that timeline did not locate the idle time by layer). Cost: the
            two group buffers (2 x ``prompt_group_bytes``) stay allocated from a prompt layer to the
            next and across prompt passes, until a decode pass (``begin_pass``), ``close`` or the
            flag switched off; without it they go back to CuPy's pool between layers. True by
            default since the eighteenth session: ``bench/prompt_q8.py --ab cache`` (H200, 8 GiB,
            pin, qwen3-moe routing, pp512, empty slots) ran 1152 t/s against the groups' 989
            without it (``bench/results/prompt-q8-h200.md``).
        prompt_keep: a prompt ubatch's groups leave experts they copied in the pool's empty slots
            (:meth:`_keep_choice`): each cached layer takes its share of the slots still empty when
            the pass reaches it (the empty slots divided by the cached layers left), filled with the
            used, non-resident experts of most routed pairs in this ubatch, copied on the device from
            the group buffer after the group's call (no extra copy from the host, no upload credit);
            from the next layer call on they are read in their slots. Only empty slots: a resident
            expert is never evicted for a keep (a warm cache, decode's hot set, stays as it is). The
            first decode pass after the prompt (:meth:`fill_after_prompt`) chooses the slots'
            experts by the policy's usage as it would from empty slots, keeping the kept experts it
            chooses in place and evicting others only for the slots its choice needs. True by
            default: without it, prompts into empty slots (``bench -p N -r R`` with no decode, a
            server's first requests) copied every used expert from the host each time.
        prompt_keeps: experts prompt ubatches left in empty slots (``prompt_keep``).
        account_in_gaps: a replayed decode graph whose layers hand misses to the CPU runs the last
            pass's accounting a unit at a time in the gaps between the handoff's answers
            (:meth:`launched`); False: all of it after the last answer, as before the thirty-fourth
            session. True by default: a decode step of 8 slots at 8 GiB on the H200 machine took 2-11%
            less time in two side-by-side runs (``bench/decode_profile.py --gaps on,off,on``).
        decode_halves: with the miss split, a batched decode step of ``HALVES_MIN_TOKENS`` tokens
            or more runs as two halves interleaved block by block
            (:meth:`moecache.models.base.DecoderLM._body_halves`), each half posting its CPU share
            to its own handoff (``handoff``, ``handoff_b``), so that the host computes one half's
            misses while the GPU runs the other half (:meth:`halves`, :meth:`settle`). False by
            default: at 8 tokens, 8 GiB on the H200 machine, from 7% faster to 8% slower a step in
            four side-by-side runs (``bench/decode_profile.py --halves on,off,on,off``): each half
            pays the CPU kernel's fixed cost per call (``bench/cpu_call_cost.py``) and the GPU's
            launches of a layer's products, attention and router. A captured graph keeps
            the layout it was captured with; a change captures the batch size again.
        group_prefetch: [started, used, dropped] copies of a next layer's first group.
        stack_prefetch: [started, used, dropped] copies of a next layer's experts (a
            :class:`~moecache.moe.prefetch.LayerPrefetch` keeps the one in flight; one per half).
        prompt_fills, prompt_slot_reads: experts loaded into empty slots after a prompt, experts
            prompt ubatches read from slots.
    """

    def __init__(self, layers: dict[int, ExpertWeights], backend: CacheBackend, n_slots: int, policy: CachePolicy,
                 offload_min_batch: int | None = 32, zero_copy: bool | None = None, top_k: int | None = None,
                 stage_misses: bool = False, prompt_group_bytes: int | None = None, vram_limit: int | None = None,
                 log: Callable[[str], None] | None = None, act_q8: bool = False, miss_split: bool = False,
                 tail: int = 0):
        prompt_group_bytes = PROMPT_GROUP_BYTES if prompt_group_bytes is None else prompt_group_bytes
        if prompt_group_bytes < 1:
            raise ValueError(f"prompt_group_bytes must be >= 1, got {prompt_group_bytes}")
        self.layers = layers
        self._calls = RoutedCalls()  # the CPU's calls for the layers' misses, prepared once
        self.be = backend
        self.policy = policy
        self.prompt_group_bytes = prompt_group_bytes
        # off since session 15 (on in sessions 13-14): no measured gain, and a 12620-token prompt with the
        # stack peaked 83 MiB over an 8 GiB budget (see prompt_stacks in the class docstring)
        self.prompt_stacks = False
        self.prompt_stack_buffers = 1
        # opt-in (with prompt_stacks): one buffer used in two halves of the expert ids (_prompt_halves),
        # the next layer's half copied while this layer's other half computes
        self.prompt_stack_halves = False
        self.account_in_gaps = True  # see the class docstring
        self.decode_halves = False  # see the class docstring (no gain measured: opt-in)
        self.vram_limit = vram_limit
        self._ahead = LayerPrefetch({})  # the next layer's copy into a stack buffer, tagged (buffer, experts copied)
        self._ahead_halves = (LayerPrefetch({}), LayerPrefetch({}))  # the same per half (_prompt_halves)
        # the next cached layer's first prompt group copied while this layer's groups compute
        # (_prompt_groups), before that layer's routing is known: its first non-resident experts by id
        self.prompt_group_ahead = True
        self.prompt_keep = True  # see the class docstring
        self.prompt_keeps = 0
        self._free_slots: list[int] | None = None  # this pass's empty slots for keeps (made at its first keep)
        self._group_ahead = LayerPrefetch({})  # that copy, tagged (buffer, experts copied)
        self._gbufs: list[tuple[Any, ...]] | None = None  # the two group buffers kept across layers (group ahead)
        self._copy_ok = True  # False once a copy ahead could not start (weights not page-locked)
        self._bufs: list[tuple[Any, Any, Any]] | None = None  # the prompt stacks' buffers (_stack_buffers)
        self._turn = 0  # the buffer the next prompt layer without a copy ahead uses
        self._trans_seen: int | None = None  # the last prompt ubatch's transient bytes (_keep_room)
        self._guard = None  # the backend's budget_guard, started for prompt passes under a --vram-budget
        self._growth = 0  # the largest growth of those from one prompt ubatch to the next
        self.log = log if log is not None else (lambda msg: None)
        self.act_q8 = act_q8
        self.offload = CPUExperts(layers, backend, offload_min_batch, act_q8=act_q8)
        self.offload_min_batch = offload_min_batch
        self.stats = CacheStats()  # tokens of every pass; hits and misses of decode ubatches
        self.prompt_slot_reads = 0  # experts prompt ubatches read from slots instead of copying
        # one pool, for the expert signature (shapes, types) most layers share; layers with another
        # signature (rare mixed-type models) run uncached
        sigs = {il: (e.gate.shape[1:], e.up.shape[1:], e.down.shape[1:], e.types) for il, e in layers.items()}
        main = max(set(sigs.values()), key=list(sigs.values()).count) if sigs else None
        self.cached_layers = {il for il, sg in sigs.items() if sg == main}
        if policy.n_slots != n_slots:
            raise ValueError(f"policy has {policy.n_slots} slots, the pool {n_slots}")
        # the elastic slots: the pool's last `tail` slots, whose memory prompt passes borrow (lend_tail)
        self.tail = 0
        self._elastic = None
        self._live = 0  # the elastic slots in use (the first ones); the others are lent
        self._take_back_due = False  # a lend waits for its take-back: the fill after a prompt follows it
        self._tail_noted = False
        self._reclaim_in = 0  # decode passes before the next take-back try
        self._retry_passes = RECLAIM_RETRY_PASSES  # the wait after a try that left some lent
        self.tail_lends = self.tail_reclaims = 0
        if tail and main is not None and offload_min_batch is not None and not 0 < tail < n_slots:
            raise ValueError(f"tail must be in [1, {n_slots - 1}] (the pool has {n_slots} slots), got {tail}")
        self.pool = None
        if main is not None:
            g, u, d, types = main
            shapes = ((n_slots, *g), (n_slots, *u), (n_slots, *d))
            arrays = None
            if tail and offload_min_batch is not None:
                try:
                    arrays, self._elastic = backend.elastic_slot_arrays(shapes, tail)
                    self.tail = tail
                except Exception as e:  # noqa: BLE001 - e.g. a driver without virtual memory
                    # the elastic slots' memory is the prompts' reserve: without them, no slots there
                    n_slots -= tail
                    shapes = tuple((n_slots, *sh[1:]) for sh in shapes)
                    policy.resize(n_slots)
                    self.log(f"note: the expert cache's {tail} elastic slots are left out: the slot memory "
                             f"cannot be given back to prompts here ({type(e).__name__}: {e})")
            if arrays is None:
                arrays = tuple(backend.zeros_u8(sh) for sh in shapes)
            self.pool = _Pool(*arrays, types, [None] * n_slots)
        n_expert = max(e.gate.shape[0] for e in layers.values()) if layers else 0
        n_layer = max(layers) + 1 if layers else 0
        self.slot_of = np.full((n_layer, n_expert), -1, np.int32)
        self._kept = np.zeros((n_layer, n_expert), bool)  # resident by a prompt's keep (fill_after_prompt may replace)
        self._pending: list[tuple[Any, int, int, int]] = []  # (copy, layer, expert, slot)
        self._retired: list[Any] = []  # copies of evicted experts still in flight
        self._pass_start: float | None = None  # decode pass timing (the adaptive upload budget)
        self._token_s: float | None = None
        self._last = max(self.cached_layers) if self.cached_layers else -1
        self.cpu_s = np.zeros(n_layer)  # per layer: CPU time of the misses (worker thread)
        self.wait_s = np.zeros(n_layer)  # per layer: time the caller waited for the CPU part
        self._first = min(self.cached_layers) if self.cached_layers else 0
        self._cached_order = np.array(sorted(self.cached_layers), np.int64)
        self._workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moecache-miss")
        # the zero-copy path: device map, routing log, pending routings of finished passes
        self.zero_copy_why = self._zero_copy_why(backend, main)
        self.zero_copy = (self.zero_copy_why is None and backend.device is not None) if zero_copy is None \
            else bool(zero_copy and self.zero_copy_why is None)
        if self.zero_copy and top_k is None:
            raise ValueError("CachedExperts: the zero-copy path needs top_k (the model's expert_used_count)")
        self._map_dev = backend.asarray(self.slot_of.copy()) if self.zero_copy else None
        self._map_live = self.slot_of.copy()  # what the device map holds now
        self._map_dirty = False
        self._ids_log = backend.asarray(np.zeros((n_layer, MAX_ZERO_COPY_TOKENS, top_k), np.int32)) \
            if self.zero_copy else None
        self._expect = 0  # tokens of this pass whose routing the device logs (0: not a zero-copy pass)
        self._pending_routes: list[tuple[np.ndarray, np.ndarray, int]] = []  # (ids, live map, T)
        self.prompt_fills = 0  # experts loaded into empty slots after prompts (:meth:`fill_after_prompt`)
        self._prompt_seen = False  # a prompt ubatch ran since the last decode pass
        # miss_split: the host handoff (moecache.moe.handoff) inside decode graphs, a CPU share of the misses
        self.handoff = None
        self.split: SplitControl | None = None
        self._split_layers: list[int] = []  # cached layers a captured graph hands over, in step order
        self._posted: list[int] = []  # layers this pass posted op by op (the CPU twin's inline handoff)
        self._zc_calls = 0  # zero-copy layer calls in this pass (none: a replayed graph)
        self._seq = 0
        self._ncpu_dirty = False
        self._serve: list[int] = []  # of those, the ones whose share this pass can be non-zero
        # steps in halves (halves()): the second half's handoff, each half's wait not yet queued
        # (settle), whether the pass in flight runs in halves, and per token count whether its
        # captured graph does (a replay posts as its capture did)
        self.handoff_b = None
        self._deferred: list[tuple[Any, int, Any] | None] = [None, None]
        self._two = False
        self._halves_by_t: dict[int, bool] = {}
        if miss_split and not self.zero_copy:
            if not policy.layer_plan:  # (a layer plan's own note says so below)
                self.log(f"note: --miss-split ignored: it splits the zero-copy path's misses, which is off "
                         f"({self.zero_copy_why or 'not a GPU'})")
        elif miss_split:
            n_embd = layers[self._first].down.shape[1]
            self.split = SplitControl(n_layer, top_k)
            if getattr(backend, "name", "") == "cuda":
                from moecache.backends.handoff_cuda import CudaHandoff

                self.handoff = CudaHandoff(backend, n_layer, MAX_ZERO_COPY_TOKENS, n_embd, top_k)
                self.handoff_b = CudaHandoff(backend, n_layer, MAX_ZERO_COPY_TOKENS, n_embd, top_k)
            else:
                self.handoff = InlineHandoff(n_layer, MAX_ZERO_COPY_TOKENS, n_embd, top_k, self._split_compute)
                self.handoff_b = InlineHandoff(n_layer, MAX_ZERO_COPY_TOKENS, n_embd, top_k, self._split_compute)
            self._ncpu_dev = backend.asarray(self.split.ncpu.copy())
            # compile the CPU kernel now: a first share compiling while the GPU waits would read as late
            ids = np.full((1, top_k), -1, np.int32)
            ids[0, 0] = 0
            self._split_compute(self._first, np.zeros((1, n_embd), np.float32), ids, np.ones((1, top_k), np.float32),
                                np.zeros((1, n_embd), np.float32))
            self.cpu_s[self._first] = 0.0
        # a layer plan's CPU shares need replayed decode graphs (op-by-op passes do not split): passes of
        # each kind since the last check (end_pass), and whether this pass handed a layer over
        self._graph_passes = self._op_passes = 0
        self._split_seen = False
        self._op_noted = False
        if policy.layer_plan and self.split is not None:
            self.split.set_shares(np.zeros(n_layer, np.int32))  # the plan sets them (link until it exists)
            policy.max_share = policy.top_k = int(top_k)
        if policy.layer_plan and self.split is None:
            # the plan's CPU path is the handoff inside decode graphs: without it, per-expert admissions
            why = (self.zero_copy_why or "not a GPU") if not self.zero_copy else "no host handoff"
            self.log(f"note: --cache-plan layer ignored: the layer plan sends misses to the CPU through the "
                     f"zero-copy path's host handoff, which is off ({why}); per-expert admissions instead")
            policy.layer_plan = False
        self.scratch = None  # stage_misses: (gate, up, down) arrays of 2 * top_k experts on the backend
        if stage_misses and self.zero_copy:
            g, u, d, _ = main
            host = [a for il in self.cached_layers for a in (layers[il].gate, layers[il].up, layers[il].down)]
            # the copy kernel moves 16-byte words: every matrix a multiple of 16 bytes, every host
            # expert 16-byte aligned (pin_model aligns tensors to 64)
            if all(int(np.prod(sh)) % 16 == 0 for sh in (g, u, d)) and all(a.ctypes.data % 16 == 0 for a in host):
                self.scratch = tuple(backend.zeros_u8((2 * top_k, *sh)) for sh in (g, u, d))
        if self.tail:  # lent from the start: decode takes back what fits once its own memory is there
            self.lend_tail()

    @property
    def _tail_lent(self) -> bool:
        """Some elastic slots are lent (not all taken back)."""
        return self._live < self.tail

    def _zero_copy_why(self, backend: Any, main: Any) -> str | None:
        if main is None:
            return "no cached layers"
        if main[3][0] != main[3][1]:
            return "gate and up experts of different types"
        arrays = [a for il in self.cached_layers for a in (self.layers[il].gate, self.layers[il].up, self.layers[il].down)]
        return backend.zero_copy_ok(arrays)

    # ---- uploads ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Publish the slots whose copies completed; forget retired copies once they are done."""
        self._retired = [c for c in self._retired if not c.done()]
        still = []
        for copy, layer, e, slot in self._pending:
            if copy.done():
                self.slot_of[layer, e] = slot
                self._map_dirty = True
            else:
                still.append((copy, layer, e, slot))
        self._pending = still

    def _apply(self, adm: list[Admission]) -> None:
        pool = self.pool
        for a in adm:
            if a.victim is None:
                slot = pool.owner.index(None)
            else:
                vl, ve = a.victim
                slot = pool.slot_held_by((vl, ve))
                self.slot_of[vl, ve] = -1  # unmapped before its slot is overwritten
                self._kept[vl, ve] = False
                self._map_dirty = True
                # a victim whose own copy is still in flight: keep that copy (and its pinned source
                # buffers) alive until it completes; the new copy is queued after it on the stream
                self._retired += [p[0] for p in self._pending if (p[1], p[2]) == (vl, ve)]
                self._pending = [p for p in self._pending if (p[1], p[2]) != (vl, ve)]
            pool.set_owner(slot, (a.layer, a.expert))
            e = self.layers[a.layer]
            copy = self.be.start_slot_copy((pool.gate, pool.up, pool.down), slot,
                                           (e.gate[a.expert], e.up[a.expert], e.down[a.expert]))
            self._pending.append((copy, a.layer, a.expert, slot))
            self.stats.uploads += 1
            self.stats.uploaded_bytes += self._expert_bytes(e)

    def preload(self, usage: np.ndarray, timeout_s: float = 120.0) -> int:
        """Fill the empty slots with the most used experts of this cache's layers before the first
        token (a saved profile: float (n_layer, n_expert) uses per token), wait for their copies and
        publish them; the usage becomes the policy's starting statistics. Returns the experts
        loaded. Rows of layers this cache does not hold are ignored."""
        if self.pool is None:
            return 0
        t_end = time.perf_counter() + timeout_s
        self._settle(t_end)  # the warm-up token's admissions: their slots are emptied for the profile's
        # copies still in flight are retired (kept alive, never published): the preload's copies into
        # the same slots queue after them
        self._retired += [p[0] for p in self._pending]
        self._pending = []
        for slot, own in enumerate(self.pool.owner):
            if own is not None and own is not LENT:
                self.slot_of[own] = -1
                self.pool.set_owner(slot, None)
        self._map_dirty = True
        self.policy.clear_residents()
        self._kept[...] = False
        mine = np.zeros_like(self.policy.usage)
        rows = sorted(il for il in self.cached_layers if il < usage.shape[0])
        mine[rows] = usage[rows, :mine.shape[1]]
        adm = self.policy.preload(mine)
        self._plan_paths()
        self._load(adm, t_end)
        return len(adm)

    def _load(self, adm: list[Admission], t_end: float) -> None:
        """Copy the admitted experts into their slots and publish them, :data:`PRELOAD_BATCH` at a
        time (bounded page-locked staging), waiting for each batch (until ``t_end``)."""
        for i in range(0, len(adm), PRELOAD_BATCH):
            self._apply(adm[i:i + PRELOAD_BATCH])
            self._settle(t_end)

    def _settle(self, t_end: float) -> None:
        """Poll until every upload in flight is published (or ``t_end``, perf_counter seconds)."""
        while (self._pending or self._retired) and time.perf_counter() < t_end:
            self.poll()
            if self._pending or self._retired:
                time.sleep(0.001)

    def fill_after_prompt(self, timeout_s: float = 120.0) -> int:
        """The first decode pass after a prompt (with elastic slots: the pass that takes them back,
        :meth:`reclaim_tail`, and each later one that takes more back): the empty slots take the
        experts the prompt used most (the policy's usage after the prompt,
        :meth:`CachePolicy.preload`); their copies are
        waited for, so the decode reads them at once. Returns the experts loaded (0 when no slot is
        empty: a warm cache keeps its residents, which decode admissions replace as usual).

        Why (``bench/results/prompt-warm.md``, the policy replayed on the routing presets at
        Qwen3-30B-A3B's shape, a 4096-token prompt into empty slots): decode's hit rate over its first
        64 tokens 26.7% -> 84.8% (qwen3-moe, a quarter of the experts in slots), 12.6% -> 35.8%
        (low-locality), 10.0% -> 24.9% (uniform), because decode admissions are rationed by the upload
        budget; on code-moe-tiny's real trace (16 experts, top-4) 1-2 points lower over the first 64
        tokens, the same over 256.

        The wait (the copies of every empty slot, once) is paid by the first decode pass after the
        prompt: in ``serve`` by every slot of that step; when other slots decode between a long
        prompt's chunks, the fill follows its first chunk.

        Experts a prompt kept in empty slots (``prompt_keep``) count as empty slots for the choice:
        those it chooses stay where they are (not copied again), the others stay too unless their
        slots are needed for the chosen ones (least used evicted first); so the slots hold what a
        fill from empty slots would put there, plus kept experts in slots it would leave empty."""
        self._prompt_seen = False
        if self.pool is None:
            return 0
        pol = self.policy
        kept = self._kept & pol.resident
        self._kept[...] = False
        if not kept.any() and pol.n_resident >= pol.n_slots:
            return 0
        t_end = time.perf_counter() + timeout_s
        if kept.any():
            pol.forget(kept)
        adm = pol.preload(pol.usage.copy())
        chosen = np.zeros_like(kept)
        for a in adm:
            chosen[a.layer, a.expert] = True
        loads = [a for a in adm if not kept[a.layer, a.expert]]
        spare = kept & ~chosen  # kept, not chosen: they stay while there are slots for them
        if spare.any():
            n_free = sum(o is None for o in self.pool.owner)
            flat = np.flatnonzero(spare)
            flat = flat[np.argsort(pol.usage.reshape(-1)[flat], kind="stable")]  # least used first
            n_out = max(0, len(loads) - n_free)
            for f in flat[:n_out].tolist():
                key = divmod(f, kept.shape[1])
                self.pool.set_owner(self.pool.slot_held_by(key), None)
                self.slot_of[key] = -1
            self._map_dirty = True
            stay = flat[n_out:]
            for il in np.unique(stay // kept.shape[1]).tolist():
                pol.keep(il, (stay[stay // kept.shape[1] == il] % kept.shape[1]))
        self._plan_paths()
        self._load(loads, t_end)
        self.prompt_fills += len(loads)
        return len(loads)

    # ---- pass hooks (the zero-copy path) ----------------------------------------------------------
    def note_decode(self, n_seqs: int) -> None:
        """The model's next pass is a decode step of ``n_seqs`` sequences (one token each; ``serve``'s
        batched steps carry several): the policy's tokens per decode pass (a layer plan's costs)."""
        self.policy.note_pass(n_seqs)

    def begin_pass(self, n_tokens: int) -> None:
        """Before a forward pass is queued: a prompt pass lends the elastic slots, a decode pass
        takes them back when due (:meth:`lend_tail`, :meth:`reclaim_tail`); the first decode pass
        after a prompt fills the empty slots (:meth:`fill_after_prompt`; with elastic slots, the one
        that takes them back); publish completed uploads and bring the device map up to
        date (on the current stream, so the pass reads it). A pass that will not take the zero-copy
        path accounts the earlier passes first (it feeds the policy itself, in order)."""
        self._drop_flight()  # a copy started for a pass an exception cut short
        self._group_ahead.drop()
        prompt = self.offload_min_batch is not None and n_tokens >= self.offload_min_batch
        if not prompt:
            self.drop_group_buffers()  # not a prompt pass: the kept group buffers go back
        if self._elastic is not None:
            if prompt:
                self.lend_tail()
            elif self._tail_lent:
                if self._reclaim_in:
                    self._reclaim_in -= 1
                else:
                    self.reclaim_tail()
        if self.vram_limit is not None and self.offload_min_batch is not None and n_tokens >= self.offload_min_batch:
            # a prompt pass: CuPy's pool gives its free blocks back before it grows past the budget
            if self._guard is None:
                self._guard = self.be.budget_guard(self.vram_limit)
            self._guard.start()
        elif self._guard is not None:
            self._guard.stop()  # left started by a prompt pass an exception cut short (a decode graph's
            # capture must not give blocks back, a device synchronisation)
        if self._prompt_seen and not prompt and not self._take_back_due:
            # (elastic slots lent: the decode pass that tries to take them back fills them, with the rest)
            self.fill_after_prompt()
        if not self.zero_copy:
            return
        self._expect = n_tokens if self.takes_zero_copy(n_tokens) else 0
        if not self._expect:
            self.flush()
        self.poll()
        if self._map_dirty:
            self.be.set_from_host(self._map_dev, self.slot_of)
            self._map_live = self.slot_of.copy()
            self._map_dirty = False
        if self._expect:
            self.be.fill(self._ids_log, -1)  # rows of layers this pass does not route stay -1 (skipped)
            self._pass_start = time.perf_counter()
        self._zc_calls = 0
        self._split_seen = False
        self._posted = []
        self._deferred = [None, None]
        self._two = self._halves_by_t.get(n_tokens, False)  # a replay's (an op-by-op pass sets its own)
        if self.handoff is not None and self._expect:
            self._seq += 1
            self.handoff.go(self._seq)
            if self._two or self.decode_halves:  # (a pass that may post to the second half's handoff)
                self.handoff_b.go(self._seq)
            if self._ncpu_dirty:
                self.be.set_from_host(self._ncpu_dev, self.split.ncpu)
                self._ncpu_dirty = False
            # a layer with no share can have nothing for the host: its post is not waited for
            self._serve = [il for il in self._split_layers if self.split.ncpu[il] > 0]

    def lend_tail(self) -> None:
        """Before a prompt pass (and at the cache's creation): the elastic slots (the pool's last
        ``tail``) hold no expert while it runs, and their memory goes back to the driver (the
        backend's ``elastic_slot_arrays`` handle), where CuPy's pool may hand it to the pass's
        arrays. The experts in them leave the map and the policy (which has ``n_slots - tail``
        slots until :meth:`reclaim_tail`); copies into them are waited for first. The take-back
        waits :data:`TAKE_BACK_DELAY_PASSES` decode passes. Lent already (a prompt pass after a
        prompt pass): only the wait starts again."""
        if self.pool.owner[-1] is LENT and not self._live:
            self._after_lend()
            self._elastic.lend()  # (a no-op: all went already, unless a take-back cut short left some)
            return
        pool = self.pool
        lo = len(pool.owner) - self.tail
        for copy in self._retired + [p[0] for p in self._pending if p[3] >= lo]:
            copy.wait()  # every byte a copy writes lands before the memory goes
        self.poll()
        evicted = []
        for slot in range(lo, len(pool.owner)):
            own = pool.owner[slot]
            if own is not None and own is not LENT:
                self.slot_of[own] = -1
                evicted.append(own)
                pool.set_owner(slot, None)
            pool.owner[slot] = LENT
        self._map_dirty = True  # uploaded at this pass's start: no later kernel looks there
        self.policy.resize(lo, evicted)
        self._live = 0  # first: a lend cut short leaves the slots lent, and the take-back maps whatever went
        self._after_lend()
        self.tail_lends += 1
        self._elastic.lend()  # after the GPU's queued work, which may still read those slots

    def _after_lend(self) -> None:
        self._take_back_due = True
        self._reclaim_in = TAKE_BACK_DELAY_PASSES
        self._retry_passes = RECLAIM_RETRY_PASSES

    def reclaim_tail(self) -> bool:
        """A decode pass after a lend (:data:`TAKE_BACK_DELAY_PASSES` later): the prompt's leftovers
        (the backend's kept input conversions, prompt stack buffers) and CuPy's cached blocks go
        back to the driver, then the memory of as many elastic slots as keep the GPU's memory in
        use :data:`TAKE_BACK_MARGIN_BYTES` under ``vram_limit`` (without one: the share of the GPU
        the placement plans with, :meth:`_limit`) is mapped again, the first slots first; they come
        back empty (this pass's :meth:`fill_after_prompt` fills them). Returns whether all are back.
        Said once when some stay lent (too little room, or the driver refuses); after
        :data:`RECLAIM_RETRY_PASSES` decode passes without a try, the next one tries for the rest,
        and after a try that took none back twice as many, up to :data:`RECLAIM_RETRY_MAX_PASSES`
        (each try waits for the GPU and gives CuPy's cached blocks back, which op-by-op passes
        would then allocate anew)."""
        self.be.drop_input_caches()
        self.drop_stacks()
        self.be.release_cached()
        before, limit = self._live, self._limit()
        try:
            live, why = self._elastic.take_back(limit - TAKE_BACK_MARGIN_BYTES), "would not fit"
        except Exception as e:  # noqa: BLE001 - a driver error: decode goes on with what is mapped
            live, why = self._elastic.live, f"could not be mapped ({type(e).__name__}: {e})"
        self._take_back_due = False
        if live > before:
            lo = len(self.pool.owner) - self.tail
            for slot in range(lo + before, lo + live):
                self.pool.owner[slot] = None
            self.policy.resize(lo + live)
            self._live = live
            self._prompt_seen = True  # this pass fills the slots that came back (fill_after_prompt)
            self.tail_reclaims += 1
        if live < self.tail:
            if not self._tail_noted:
                self._tail_noted = True
                self.log(f"note: the expert cache's elastic slots: {live} of {self.tail} taken back; the other "
                         f"{self.tail - live} stay lent: their memory {why} "
                         f"({'--vram-budget' if self.vram_limit is not None else 'the usable share of the GPU'} "
                         f"{limit >> 20} MiB less a {TAKE_BACK_MARGIN_BYTES >> 20} MiB margin for decode); "
                         f"tried again after {RECLAIM_RETRY_PASSES} decode passes, then less often")
            if live > before:
                self._retry_passes = RECLAIM_RETRY_PASSES
            self._reclaim_in = self._retry_passes
            if live == before:
                self._retry_passes = min(2 * self._retry_passes, RECLAIM_RETRY_MAX_PASSES)
            return False
        return True

    def fix_split(self, share: int | None) -> None:
        """Pin the miss split's share on every layer (:meth:`SplitControl.fix`; None: adaptive again),
        from the next pass on. Raises ValueError without the miss split, or for a share outside
        [0, top_k]."""
        if self.split is None:
            raise ValueError("fix_split: this expert cache has no miss split (Engine(miss_split=True), zero-copy)")
        self.split.fix(share)
        self._ncpu_dirty = True

    def _check_plan_paths(self) -> None:
        """After a zero-copy pass under a layer plan: count it as replayed (or captured) with the
        handoff, or as op by op (no CPU share: every miss over the link); every
        :data:`PATH_CHECK_PASSES` passes the plan's CPU path follows a :data:`PATH_SWITCH` majority
        (``max_share`` ``top_k`` or 0, the plan made again), said once when it goes."""
        if self.split is None or not self.policy.layer_plan or self.handoff.inline:
            return
        if self._zc_calls and not self._split_seen:
            self._op_passes += 1
        else:
            self._graph_passes += 1
        n = self._op_passes + self._graph_passes
        if n < PATH_CHECK_PASSES:
            return
        # (a clear majority either way: a mix near half and half keeps the path it has)
        want = 0 if self._op_passes >= PATH_SWITCH * n else self.split.k if self._graph_passes >= PATH_SWITCH * n \
            else self.policy.max_share
        if want != self.policy.max_share:
            if not want and not self._op_noted:
                self._op_noted = True
                self.log(f"note: --cache-plan layer: {self._op_passes} of the last "
                         f"{self._op_passes + self._graph_passes} decode passes ran op by op, where the CPU takes no "
                         f"share of the misses: the plan reads every miss over PCIe until decode graphs replay again")
            self.policy.max_share = want
            self.policy.replan_soon()
        self._graph_passes = self._op_passes = 0

    def _plan_paths(self) -> None:
        """The layer plan's shares to the split: up to ``plan.share[il]`` of each token's misses of
        layer ``il`` go to the CPU, the others over the link (from the next pass on)."""
        plan = self.policy.plan
        if self.split is None or plan is None:
            return
        self.split.set_shares(np.minimum(plan.share[:self.split.n_layer], self.split.k).astype(np.int32))
        self._ncpu_dirty = True

    def launched(self) -> None:
        """While a pass runs on the device: account the finished passes (:meth:`flush`), which feeds
        the policy and starts the admitted uploads while the device is busy. A replayed decode graph
        with the miss split and a share on some layer has those layers' handoffs answered (the CPU's
        share of the misses: the GPU waits for each), and the accounting runs in their gaps, a unit
        after each answer (:func:`moecache.moe.handoff.serve`'s ``idle``; ``account_in_gaps``), its
        rest after the last one, beside the rest of the pass (the layers after it, the output head).
        Run after the answers instead, the accounting took 2.5 ms of a 22.7 ms step of 8 tokens at
        8 GiB on the H200 machine, the GPU idle meanwhile (``bench/decode_profile.py --host-times``).
        When answering fails (Ctrl-C included), the accounting stops at a consistent point (a
        decision's admissions all applied, the passes not begun kept for the next call) before the
        error propagates."""
        work, end = self._flush_units(), object()
        if self._replayed_split() and self._serve:
            try:
                serve(self._pass_bufs(), self._serve, self._seq, self._split_compute,
                      idle=(lambda: next(work, end) is not end) if self.account_in_gaps else None)
            except BaseException:
                work.close()
                raise
        for _ in work:
            pass

    def _pass_bufs(self) -> list[Any]:
        """The handoff buffers the pass in flight posts to: the second half's too when it runs in
        halves."""
        return [self.handoff.buf, self.handoff_b.buf] if self._two else [self.handoff.buf]

    def halves(self, n_seqs: int) -> bool:
        """Whether a batched decode step of ``n_seqs`` sequences runs in two halves
        (:meth:`moecache.models.base.DecoderLM.halves_for`): with the miss split (the halves' gain is
        the host computing one half's CPU share while the GPU runs the other half), ``decode_halves``
        on, and from ``HALVES_MIN_TOKENS`` tokens up to the zero-copy path's limit."""
        return (self.decode_halves and self.split is not None and n_seqs >= HALVES_MIN_TOKENS
                and self.takes_zero_copy(n_seqs))

    def settle(self, index: int) -> None:
        """Queue half ``index``'s wait for the CPU's share of its last MoE layer, added in place into
        that layer's output (:meth:`_zero_copy` left it owed); nothing when none is owed."""
        d = self._deferred[index]
        if d is not None:
            self._deferred[index] = None
            hf, il, out = d
            hf.wait(il, out, add=True)

    def _replayed_split(self) -> bool:
        """Whether the pass in flight is a replayed graph whose layers hand misses to the host (no
        layer was called op by op in it, and a capture recorded handed-over layers)."""
        return (self.handoff is not None and not self.handoff.inline and bool(self._expect)
                and self._zc_calls == 0 and bool(self._split_layers))

    def _split_compute(self, il: int, h: np.ndarray, ids: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        """The CPU's share of layer ``il``'s misses (the handoff's answer) into ``out``, timed into ``cpu_s``."""
        e = self.layers[il]
        self._timed_cpu(il, e, ids, w, h, out)

    def flush(self, admit: bool = True) -> None:
        """Account the routing of finished zero-copy passes: hits and misses against the map each pass
        used, the policy's observe/decide, the admitted uploads (none with ``admit`` False: at exit).
        Counters read after a run call this first (the last pass is otherwise accounted at the next
        launch)."""
        for _ in self._flush_units(admit):
            pass

    def _flush_units(self, admit: bool = True) -> Iterator[None]:
        """:meth:`flush` as a generator that yields after each short unit of its work (a pass's
        counters and usage; the layer plan made again when due, the one unit that can take longer;
        an upload started), so that :meth:`launched` can put the units into the gaps of a pass's
        handoff; exhausted, it has done what ``flush`` does. The passes to account are taken at the
        first unit. Closed early (an error where the units run), it leaves the policy and the slots
        agreeing: the admissions of the decision in progress are all applied (the policy counts
        them resident at once), and the passes not begun go back to the pending list."""
        pending, self._pending_routes = self._pending_routes, []
        begun = 0
        try:
            for ids, live, t in pending:
                begun += 1
                self.policy.new_tokens(t)
                self.stats.tokens += t
                layers = self._cached_order[ids[self._cached_order, 0, 0] >= 0]  # the layers that pass routed
                if not layers.size:
                    continue
                lids = ids[layers, :t]
                hit = np.take_along_axis(live[layers], lids.reshape(layers.size, -1), axis=1).reshape(lids.shape) >= 0
                n_hit = int(hit.sum())
                self.stats.hits += n_hit
                self.stats.misses += hit.size - n_hit
                self.policy.observe_all(layers, lids)  # every layer first: decide compares across layers
                yield
                if self.policy.replan():
                    self._plan_paths()
                yield
                if not admit:
                    continue
                flat, missed = lids.reshape(layers.size, -1), ~hit.reshape(layers.size, -1)
                for i in np.flatnonzero(self.policy.may_admit(layers, flat, missed)).tolist():
                    yield from self._apply_units(self.policy.decide(int(layers[i]), flat[i][missed[i]]))
                # a layer plan's experts not missed yet (none without one)
                yield from self._apply_units(self.policy.fill_plan())
        finally:
            self._pending_routes[:0] = pending[begun:]

    def _apply_units(self, adm: list[Admission]) -> Iterator[None]:
        """:meth:`_apply` of one decision, yielding after each upload started; closed early, it
        applies the rest of the decision first (the policy already counts all of it resident)."""
        done = 0
        try:
            for a in adm:
                done += 1
                self._apply([a])
                yield
        finally:
            self._apply(adm[done:])

    def end_pass(self) -> None:
        """After a pass's output reached the host: bring its routing log to the host (processed by the
        next :meth:`launched`) and time the pass for the adaptive upload budget (the whole pass here;
        the hybrid path times its MoE stretch, first to last cached layer)."""
        if self._guard is not None:
            self._guard.stop()
        t = self._expect
        if not self.zero_copy or not t:
            return
        layers = []
        if self.handoff is not None:
            layers = self._posted or (self._split_layers if self._replayed_split() else [])
            if layers:
                bufs = self._pass_bufs()
                count = sum(b.count.astype(np.int64) for b in bufs)
                n_miss = sum(b.n_miss.astype(np.int64) for b in bufs)
                wait_ns = np.maximum.reduce([b.wait_ns for b in bufs])  # a half late: the layer's share is late
                self.stats.cpu_misses += int(count[layers].sum())
                self.stats.cpu_wait_ns += int(sum(b.wait_ns[layers].sum() for b in bufs))
                if self.split.update(layers, count, n_miss, wait_ns):
                    self._ncpu_dirty = True
        self._check_plan_paths()
        self._pending_routes.append((np.array(self.be.to_host(self._ids_log[:, :t])), self._map_live, t))
        self._expect = 0
        if self._pass_start is not None:
            per_token = (time.perf_counter() - self._pass_start) / t
            self._token_s = per_token if self._token_s is None else 0.8 * self._token_s + 0.2 * per_token
            self.policy.set_budget(self._token_s)
            self._pass_start = None
        if layers:  # last: a GPU that gave up waiting made this pass's output wrong (either half's)
            check((self.handoff.buf, self.handoff_b.buf))

    def abort_pass(self) -> None:
        """Instead of :meth:`end_pass` when an exception (Ctrl-C included) cut a pass short: the
        budget guard stops, and the pass's routing log is not accounted (the device may not have
        written it)."""
        if self._guard is not None:
            self._guard.stop()
        self._expect = 0
        self._pass_start = None
        self._deferred = [None, None]  # (a half's output held for its wait: not kept past the pass)

    # ---- execution --------------------------------------------------------------------------------
    def __call__(self, il: int, h: Any, routing: Routing, part: Any = None) -> Any:
        """Layer ``il``'s routed experts on ``h`` float32 (T, n_embd) -> (T, n_embd) on the backend.
        ``part``: the :class:`moecache.models.base.Half` of a batched step in halves these rows are
        (the zero-copy path then logs them at the half's rows, posts to the half's handoff and
        leaves the wait for the CPU's share to :meth:`settle`)."""
        e = self.layers[il]
        t = routing.ids.shape[0]
        if il in self.cached_layers and self.takes_zero_copy(t):
            return self._zero_copy(il, e, h, routing, t, part)
        r = routing.host()
        if il == self._first:
            self._pass_start = time.perf_counter()
            self.policy.new_tokens(t)
            self.stats.tokens += t
            self._free_slots = None  # a new pass: its keeps take the slots empty now
        self.poll()
        if il not in self.cached_layers:
            return self.offload(il, h, r)
        if self.offload_min_batch is not None and t >= self.offload_min_batch:
            out = self._prompt(il, e, h, r)
            self.policy.observe(il, r.ids)
            self._prompt_seen = True
            return out
        slots = self.slot_of[il][r.ids]
        hit = slots >= 0
        n_hit = int(hit.sum())
        self.stats.hits += n_hit
        self.stats.misses += hit.size - n_hit
        be = self.be
        cpu_part = None
        if n_hit < hit.size:  # misses: CPU, in the worker thread, while the backend computes hits
            hh = be.to_host(h)
            # on the calling thread's Numba thread count (the pool's thread has its own: all CPUs)
            cpu_part = self._workers.submit(self._timed_cpu, il, e, np.where(hit, -1, r.ids), r.weights, hh, None,
                                            numba.get_num_threads())
        out = None
        if n_hit:
            pool = self.pool
            # a miss pair rides along with weight 0 on a slot that is visible (fully copied), never
            # on one whose copy may be in flight
            fill = int(slots[hit][0])
            local = Routing(np.where(hit, slots, fill).astype(np.int32), np.where(hit, r.weights, 0.0).astype(np.float32))
            out = be.moe_ffn(pool.gate, pool.up, pool.down, pool.types, local, h, e.act)
        if cpu_part is not None:
            t0 = time.perf_counter()
            res_cpu = cpu_part.result()
            self.wait_s[il] += time.perf_counter() - t0
            part = be.asarray(res_cpu)
            out = part if out is None else out + part
        self.policy.observe(il, r.ids)
        missed = r.ids[~hit]
        self._apply(self.policy.decide(il, missed))
        if il == self._last and self._pass_start is not None:
            # the adaptive upload budget: the MoE stretch of this decode pass (first to last cached
            # layer), so idle time between calls never counts as token time
            per_token = (time.perf_counter() - self._pass_start) / t
            self._token_s = per_token if self._token_s is None else 0.8 * self._token_s + 0.2 * per_token
            self.policy.set_budget(self._token_s)
            self._pass_start = None
        return out

    def _zero_copy(self, il: int, e: ExpertWeights, h: Any, routing: Routing, t: int, part: Any = None) -> Any:
        """A decode ubatch (or a half of one: ``part``) on the zero-copy path: no host sync
        (CUDA-graph capturable)."""
        pool = self.pool
        # (a half's misses are read in place as its whole step's would be: the halves share one scratch)
        scratch = self.scratch if self.scratch is not None and routing.ids.size <= self.scratch[0].shape[0] \
            and part is None else None
        self._zc_calls += 1
        hf = self.handoff if part is None or part.index == 0 else self.handoff_b
        # the miss split runs inside captured graphs only (an op-by-op pass would queue launches while
        # the GPU waits for the host) and in the CPU twin, which answers inline
        split = hf is not None and (hf.inline or self.be.capturing())
        if hf is not None:
            self._two = part is not None
            if not hf.inline and self.be.capturing():  # what a replay of this capture posts to
                self._halves_by_t[t if part is None else part.n] = part is not None
        gpu_pairs = routing
        if split:  # the GPU's pairs: the CPU's ids -1
            gpu_pairs = Routing(hf.post(il, h, routing.ids, routing.weights, self._map_dev[il], self._ncpu_dev),
                                routing.weights)
        out = self.be.moe_ffn_cached((pool.gate, pool.up, pool.down), pool.types, gpu_pairs, h, e.act,
                                     self._map_dev[il], (e.gate, e.up, e.down), scratch)
        if split:
            self._split_seen = True
            if part is None:
                out = hf.wait(il, out, add=True)
            else:  # queued just before this half's next block (settle): the other half runs meanwhile
                self._deferred[part.index] = (hf, il, out)
            if hf.inline:
                if part is None or part.index == 0:
                    self._posted.append(il)
            elif il not in self._split_layers:
                self._split_layers.append(il)
        a = 0 if part is None else part.start
        self._ids_log[il, a:a + t] = self.be.asarray(routing.ids)
        return out

    def graph_capturable(self) -> str | None:
        """None when its one-token decode steps take the zero-copy path on every layer (no host
        synchronisation: CUDA-graph capturable), else the reason."""
        if not self.zero_copy:
            return f"the expert cache computes its misses on the CPU ({self.zero_copy_why or 'not a GPU'})"
        if self.cached_layers != set(self.layers) or not self.takes_zero_copy(1):
            return "the expert cache has layers of another expert signature (computed on the CPU)"
        return None

    def takes_zero_copy(self, t: int) -> bool:
        """Whether a ubatch of ``t`` tokens runs on the zero-copy path."""
        return self.zero_copy and t <= MAX_ZERO_COPY_TOKENS and (self.offload_min_batch is None or t < self.offload_min_batch)

    def reset_stats(self) -> None:
        """Zero the counters and the per-layer CPU / wait times (after a warm-up); routings of
        finished passes not yet accounted are accounted first (they belong to the warm-up)."""
        self.flush()
        self.stats.reset()
        self.cpu_s[:] = 0.0
        self.wait_s[:] = 0.0
        self._pass_start = None

    def _timed_cpu(self, il, e, ids, weights, hh, out=None, n_threads: int | None = None):
        """Layer ``il``'s pairs ``ids`` (-1: not the CPU's) of host rows ``hh`` on the CPU, added into
        ``out`` (zeros when None), timed into ``cpu_s``; on ``n_threads`` Numba threads when given
        (:func:`moecache.threads.bind_numba_threads`)."""
        if n_threads is not None:
            bind_numba_threads(n_threads)
        t0 = time.perf_counter()
        if out is None:
            out = np.zeros((hh.shape[0], e.down.shape[1]), np.float32)
        out = self._calls.get(il, e, self.act_q8)(ids, weights, hh, out)
        self.cpu_s[il] += time.perf_counter() - t0
        return out

    def _prompt(self, il: int, e: ExpertWeights, h: Any, r: Routing) -> Any:
        """A prompt ubatch: every used expert computed on the backend; the resident ones are read from
        their slots, only the others are copied from the host.

        The non-resident experts' weights are brought to the device ``prompt_group_bytes`` at a time,
        so a prompt's VRAM peak does not grow with the experts it touches (a 111-token low-locality
        prompt uses ~120 of 128 experts per layer: 300+ MiB at once otherwise); the resident ones
        are read in their slots (:meth:`_prompt_groups`). With ``prompt_stacks`` the layer is one
        call on a stack of its experts: :meth:`_prompt_stack`."""
        if self.prompt_stacks:
            out = self._prompt_stack(il, e, h, r)
            if out is not None:
                return out
        used = np.unique(r.ids)
        return self._prompt_groups(il, e, h, r, used)

    def _prompt_stack(self, il: int, e: ExpertWeights, h: Any, r: Routing) -> Any | None:
        """A prompt ubatch's layer computed in one backend call from a stack of the layer's experts on
        the device (arrays of the host stacks' shape, indexed by expert id: the routing as it is;
        positions of experts the ubatch does not use are never read; the copy ahead writes every
        non-resident expert of its layer, used or not). The stacks are
        ``prompt_stack_buffers`` buffers allocated once (:meth:`_stack_buffers`). With one (the
        default) each layer fills it: resident experts from their slots on the device, the others
        from the host. With two, used in turn, this layer's holds what the layer before copied into
        it on the copy stream (:meth:`_start_flight`: this layer's experts that were not resident
        then), the used experts it still lacks are filled here, and before this layer's compute is
        queued the next cached layer's copy into the other buffer starts, so the two overlap.

        On the H200 (run ``h200-s11p``, ``bench/results/vs-llamacpp-h200.md``) stacks took the 8 GiB
        pp512 case from 0.20x to 0.41x of llama.cpp and pp12620 from 0.25x to 0.43x; that version
        allocated a stack per layer, and CuPy's pool grew ~1 GiB (about three stacks) past the two
        in use, taking pp12620 455 MiB over its budget: hence the two fixed buffers.

        Returns None, for the caller's groups, when not even one buffer had room."""
        if il == self._first:
            self._keep_room()
        if not self._stack_buffers(e):
            return None
        if self._halves_now(il, r.ids.size):
            return self._prompt_halves(il, e, h, r)
        f = self._take_flight(il)
        if f is not None:
            b, have = f
        else:
            b, have = self._turn, np.zeros(self.slot_of.shape[1], bool)
        stacks = self._bufs[b]
        self._fill_stack(il, e, stacks, np.unique(r.ids), have)
        self._turn = (b + 1) % len(self._bufs)
        if len(self._bufs) > 1:
            self._start_flight(il, r.ids.size, self._turn)  # queued before this layer's compute: they overlap
        return self.be.moe_ffn(*stacks, e.types, Routing(np.ascontiguousarray(r.ids, dtype=np.int32), r.weights), h,
                               e.act)

    def _fill_stack(self, il: int, e: ExpertWeights, stacks: tuple[Any, Any, Any], used: np.ndarray,
                    have: np.ndarray) -> None:
        """Put layer ``il``'s ``used`` experts (ascending) that ``have`` (bool (n_expert,): copied ahead)
        lacks into ``stacks`` at their ids, on the compute stream: resident ones from their slots on
        the device, the others from the host, :data:`STACK_FILL_EXPERTS` at a time."""
        be, pool = self.be, self.pool
        slots = self.slot_of[il][used]
        res = (slots >= 0) & ~have[used]
        up = used[(slots < 0) & ~have[used]]
        ids, rows = used[res], slots[res]
        for st, pool_arr, w in zip(stacks, (pool.gate, pool.up, pool.down), (e.gate, e.up, e.down)):
            for i in range(0, max(ids.size, up.size), STACK_FILL_EXPERTS):  # bounded temporaries
                be.gather_into(st, ids[i:i + STACK_FILL_EXPERTS], pool_arr, rows[i:i + STACK_FILL_EXPERTS])
                be.upload_experts_into(st, w, up[i:i + STACK_FILL_EXPERTS])
        self.prompt_slot_reads += int(res.sum())
        self.offload.offloaded_bytes += int(up.size) * self._expert_bytes(e)

    def _halves_now(self, il: int, n_pairs: int) -> bool:
        """Whether layer ``il`` computes in halves (:meth:`_prompt_halves`): ``prompt_stack_halves``
        with one buffer, and either the layer before began this layer's copies, or this layer can
        begin the next one's (not the last cached layer, a ubatch of at least
        :data:`~moecache.moe.prefetch.MIN_PAIRS_PER_EXPERT` pairs per expert, weights a copy can
        start from): otherwise the two calls would cost more than the one and overlap nothing."""
        if not (self.prompt_stack_halves and self._bufs is not None and len(self._bufs) == 1):
            return False
        if any(f.holds(il) for f in self._ahead_halves):
            return True
        return self._copy_ok and self._next_to_copy(il, n_pairs) is not None

    def _prompt_halves(self, il: int, e: ExpertWeights, h: Any, r: Routing) -> Any:
        """A prompt layer from the one stack buffer in two halves of the expert ids (``[0, n/2)``,
        ``[n/2, n)``; ``prompt_stack_halves``): per half, the copy of its non-resident experts begun
        during the layer before (:meth:`_start_flight`; the compute stream waits for it), the
        used experts it lacks filled here (:meth:`_fill_stack`), one backend call on the whole ubatch
        with the other half's pairs marked as none (id -1, as the prompt groups do), its output
        added, then the next cached layer's copy into this half begins on the copy stream. So the
        copy of one half overlaps the compute of the other and of the attention between the layers,
        in the memory of one buffer; with two buffers a whole layer is copied ahead instead."""
        be = self.be
        n = self.slot_of.shape[1]
        stacks = self._bufs[0]
        used = np.unique(r.ids)
        out = None
        for half, (lo, hi) in enumerate(((0, n // 2), (n // 2, n))):
            got = self._ahead_halves[half].take_tagged(il)
            have = got[1][1] if got is not None else np.zeros(n, bool)
            mine = used[(used >= lo) & (used < hi)]
            if mine.size:
                self._fill_stack(il, e, stacks, mine, have)
                ids = np.where((r.ids >= lo) & (r.ids < hi), r.ids, -1).astype(np.int32)
                y = be.moe_ffn(*stacks, e.types, Routing(ids, r.weights), h, e.act)
                if out is None:
                    out = y
                else:
                    out += y
            self._start_flight(il, r.ids.size, 0, lo, hi, self._ahead_halves[half])  # after this half's compute
        return out

    def _stack_buffers(self, e: ExpertWeights) -> int:
        """The prompt stacks' buffers (each a (gate, up, down) of every expert of a layer), allocated
        at the first prompt ubatch that wants them and kept: ``prompt_stack_buffers`` (1 or 2) if the
        GPU's memory in use leaves room under the limit (:meth:`_limit`) for them and for
        :data:`STACK_MARGIN_BYTES` (what the layer's MoE call and the stack fills allocate after
        them; ``room_for``), else fewer (noted once). The memory a prompt adds later is checked at
        each ubatch (:meth:`_keep_room`). Returns how many."""
        if self._bufs is None:
            shapes = [(self.slot_of.shape[1], *w.shape[1:]) for w in (e.gate, e.up, e.down)]
            nbytes = sum(int(np.prod(sh)) for sh in shapes)
            self._bufs = []
            want = self.prompt_stack_buffers
            if want not in (1, 2):
                raise ValueError(f"prompt_stack_buffers must be 1 or 2, got {want!r}")
            limit = self._limit()
            for _ in range(want):
                if not self.be.room_for(nbytes + STACK_MARGIN_BYTES, limit):
                    break
                try:
                    self._bufs.append(tuple(self.be.empty_u8(sh) for sh in shapes))
                except MemoryError:  # cupy's OutOfMemoryError is one
                    break
            if len(self._bufs) < want:
                self.log(f"note: prompt stacks: room for {len(self._bufs)} of {want} buffers of {nbytes >> 20} MiB"
                         + (f" under --vram-budget {limit >> 20} MiB" if self.vram_limit is not None
                            else f" in the GPU's {limit >> 20} MiB")
                         + (": no layer's experts copied ahead" if self._bufs else
                            ": prompts bring their experts in groups"))
        return len(self._bufs)

    def drop_stacks(self) -> None:
        """Give the stack buffers back (any copy into them finished first); the next prompt ubatch
        that wants them allocates ``prompt_stack_buffers`` anew."""
        self._drop_flight()
        self._bufs = None
        self._turn = 0
        self._trans_seen, self._growth = None, 0

    def _keep_room(self) -> None:
        """At a prompt ubatch's first cached layer, with stack buffers: CuPy's
        cached blocks go back to the driver (``release_cached``), so each ubatch's transient arrays
        are allocated anew and no trail of smaller blocks that a longer context outgrew stays in the
        pool (read after run h200-s12c, whose 12620-token prompt went 27 MiB over its budget: the
        prompt attention's blocks are powers of two, and the pool kept each outgrown one). The
        memory in use (``memory_in_use``: what ``--vram-budget`` and nvidia-smi count) before that
        less after it is the ubatch before's transients. While the memory in use now, those
        transients and their growth to come (the largest growth from one ubatch to the next seen so
        far, at least :data:`ROOM_FLOOR_BYTES`) pass the limit (:meth:`_limit`: ``vram_limit``, else
        the GPU's memory), a stack buffer goes back (the
        second first: no more copies ahead; then the groups), noted once each; a buffer given back
        stays so for the engine's life. The release waits for the GPU's queued work and the
        ubatch's arrays come from the driver again: a cost per ubatch not yet measured."""
        if not self._bufs:
            return
        limit = self._limit()
        before = self.be.memory_in_use()
        self.be.release_cached()
        live = self.be.memory_in_use()
        trans = max(0, before - live)
        if self._trans_seen is not None:
            self._growth = max(self._growth, trans - self._trans_seen)
        self._trans_seen = trans
        near, cap = ("--vram-budget", "budget") if self.vram_limit is not None else ("the GPU memory", "GPU memory")
        while self._bufs and live + trans + max(self._growth, ROOM_FLOOR_BYTES) > limit:
            why = (f"in use {live >> 20} MiB, the ubatch before's transients {trans >> 20} MiB, growth allowed "
                   f"{max(self._growth, ROOM_FLOOR_BYTES) >> 20} MiB, {cap} {limit >> 20} MiB")
            self._drop_flight()
            self._bufs.pop()
            self._turn = 0
            self.be.release_cached()
            live = self.be.memory_in_use()
            self.log(f"note: prompt stacks: the prompt's memory grew near {near} ({why}): {len(self._bufs)} "
                     f"buffer(s) left" + (" (no copy ahead)" if self._bufs else " (its experts come in groups)"))

    def _limit(self) -> int:
        """The bytes the prompt stacks keep the GPU's memory in use within: ``vram_limit``, or without
        one the share of the GPU's memory (``memory_total``) that the placement plans with
        (:data:`~moecache.placement.USABLE_FRACTION`): a stack should not run the GPU out of memory
        where the groups would not."""
        return self.vram_limit if self.vram_limit is not None else int(self.be.memory_total() * USABLE_FRACTION)

    def _next_to_copy(self, il: int, n_pairs: int) -> int | None:
        """The cached layer after ``il`` whose experts a ubatch of ``n_pairs`` (token, expert) pairs
        copies ahead: None after the last one, or below
        :data:`~moecache.moe.prefetch.MIN_PAIRS_PER_EXPERT` pairs per expert of it."""
        i = int(np.searchsorted(self._cached_order, il)) + 1
        if i >= self._cached_order.size:
            return None
        nxt = int(self._cached_order[i])
        return nxt if n_pairs >= MIN_PAIRS_PER_EXPERT * self.layers[nxt].gate.shape[0] else None

    def _start_flight(self, il: int, n_pairs: int, b: int, lo: int = 0, hi: int | None = None,
                      flights: LayerPrefetch | None = None) -> None:
        """Begin copying the next cached layer's non-resident experts with ids in ``[lo, hi)`` (default:
        all) into that range of buffer ``b`` on the copy stream (for a ubatch of ``n_pairs`` (token,
        expert) pairs, when they are at least :data:`~moecache.moe.prefetch.MIN_PAIRS_PER_EXPERT` per
        expert: nearly every expert is then used), kept in ``flights`` (default: the whole-layer
        copies', tagged (b, the copied-experts mask)). The copy waits for the compute stream's work
        queued so far, which includes the last reads of that range; its source and destination are
        the range's views (the CPU twin's copy in flight poisons that range only). Weights a copy
        cannot start from (a mapped file: the backend notes why) stop the copies ahead."""
        nxt = self._next_to_copy(il, n_pairs)
        if nxt is None or not self._copy_ok:
            return
        e = self.layers[nxt]
        hi = self.slot_of.shape[1] if hi is None else hi
        sel = np.flatnonzero(self.slot_of[nxt][lo:hi] < 0)
        if not sel.size:
            return
        upl = self.be.start_upload(tuple(w[lo:hi] for w in (e.gate, e.up, e.down)), sel,
                                   out=tuple(a[lo:hi] for a in self._bufs[b]))
        if upl is None:
            self._copy_ok = False
            return
        have = np.zeros(self.slot_of.shape[1], bool)
        have[lo + sel] = True
        nbytes = int(sel.size) * self._expert_bytes(e)
        (self._ahead if flights is None else flights).begin(nxt, self.be, upl, nbytes, (b, have))
        self.offload.offloaded_bytes += nbytes

    def _take_flight(self, il: int) -> tuple[int, np.ndarray] | None:
        """The buffer holding layer ``il``'s copy and its copied-experts mask, if that copy is in flight
        (the compute stream then waits for it); any other copy is dropped."""
        got = self._ahead.take_tagged(il)
        return None if got is None else got[1]

    def _drop_flight(self) -> None:
        """Discard the copies in flight; the compute stream first waits for them (no host wait), so no
        later write into their buffer on the compute stream races them."""
        for f in (self._ahead, *self._ahead_halves):
            f.drop()

    @property
    def stack_prefetch(self) -> list[int]:
        """[started, used, dropped] copies of a next layer's experts into a stack buffer (a half's
        counts as one with ``prompt_stack_halves``)."""
        fs = (self._ahead, *self._ahead_halves)
        return [sum(f.started for f in fs), sum(f.used for f in fs), sum(f.dropped for f in fs)]

    def _prompt_groups(self, il: int, e: ExpertWeights, h: Any, r: Routing, used: np.ndarray) -> Any:
        """The pairs of ``r`` (``used``: its experts, ascending): the resident experts' pairs in one
        backend call on the slots where they are, then the others ``prompt_group_bytes`` of experts
        at a time, each group one call on a buffer of its experts, the calls' outputs summed in that
        order (the same sums on every run).

        Every call takes the whole ubatch's routing with the pairs of other experts marked as none
        (id -1): no per-pair copies of the activations, so the transients do not grow with the pairs
        (at -ub 2048 the per-pair copies and their sum were ~0.5 GiB of a prompt's peak, H200,
        ``bench/vram_peak.py``). With page-locked weights two group buffers alternate: the next
        group's experts are copied on the copy stream while the resident pairs or the group before
        compute (:meth:`~moecache.backends.cupy_backend.CupyBackend.start_upload`, ``compact``);
        otherwise each group is uploaded (a page-locked staging gather), then computed. With
        ``prompt_group_ahead`` the first group may be one copied during the layer before (experts
        chosen before this layer's routing: the unused ones are not computed, a group of which none
        is used makes no call)."""
        be = self.be
        slots = self.slot_of[il][used]
        res = slots >= 0
        up = used[~res]
        per = self._expert_bytes(e)
        keep_x, keep_s = self._keep_choice(il, up, r.ids)
        if keep_x.size:
            keep_at = np.full(self.slot_of.shape[1], -1, np.int64)  # expert -> the empty slot it is kept in
            keep_at[keep_x] = keep_s
        # buffers of one size for every layer and ubatch: CuPy's pool serves each from the last one's
        # blocks (sizes that change per layer leave free blocks behind that the pool keeps)
        size = self._group_size(e)
        ws = (e.gate, e.up, e.down)
        if not self.prompt_group_ahead and self._gbufs is not None:
            self.drop_group_buffers()  # (kept from when it was on)
        # each group: (its experts, their positions in its buffer, the buffer's experts in use)
        pieces: list[tuple[np.ndarray, np.ndarray, int]] = []
        b0, flight = 0, None
        ahead = self._group_ahead.take_unfinished(il) if self.prompt_group_ahead else None
        if ahead is not None:  # this layer's first group is being copied since the layer before (the
            flight, (b0, copied) = ahead  # compute stream waits for it only before that group's call)
            keep = self.slot_of[il][copied] < 0  # made resident since: its slot serves it (not twice)
            pieces.append((copied[keep], np.flatnonzero(keep).astype(np.int32), copied.size))
            up = np.setdiff1d(up, copied, assume_unique=True)
        pieces += [(x, np.arange(x.size, dtype=np.int32), x.size)
                   for x in (up[i:i + size] for i in range(0, up.size, size))]
        n_groups = len(pieces)
        # page-locked weights: asynchronous copies (asked only when something may be copied)
        pinned = (n_groups > 0 or self.prompt_group_ahead) and be.zero_copy_ok(list(ws)) is None
        bufs: list[tuple[Any, ...]] = []
        if pieces and pinned:
            bufs = (self._group_buffers(e, size) if self.prompt_group_ahead
                    else self._new_group_buffers(e, size, min(2, n_groups)))
            if flight is None:
                flight = be.start_upload(ws, pieces[0][0], bufs[0], compact=True)
        local = np.full(self.slot_of.shape[1], -1, np.int32)
        out = None
        try:
            if res.any():
                pool = self.pool
                loc = self.slot_of[il][r.ids]  # slot, or -1 for an expert not resident
                out = be.moe_ffn(pool.gate, pool.up, pool.down, pool.types,
                                 Routing(loc.astype(np.int32), r.weights), h, e.act)
                self.prompt_slot_reads += int(res.sum())
            for g, (ids, pos, n_buf) in enumerate(pieces):
                if bufs:
                    arrays = be.finish_upload(flight)  # the compute stream waits for this group's copy
                    flight = None
                    if g + 1 < n_groups:  # the next group's copy, after the calls that read its buffer
                        flight = be.start_upload(ws, pieces[g + 1][0], bufs[(b0 + g + 1) % 2], compact=True)
                    elif self.prompt_group_ahead:  # the next layer's first group, queued before this
                        # last call (after the calls that read its buffer), so the copy overlaps it
                        self._start_group_ahead(il, r.ids.size, (b0 + n_groups) % 2)
                    parts = tuple(a[:n_buf] for a in arrays)
                else:
                    parts = tuple(be.upload_experts(w, ids) for w in ws)
                if not (g == 0 and ahead is not None):
                    self.offload.offloaded_bytes += int(ids.size * per)  # (a copy ahead counted when begun)
                local[ids] = pos
                routed = local[r.ids]
                local[ids] = -1
                if not (routed >= 0).any():  # a group copied ahead that this ubatch does not use
                    continue
                y = be.moe_ffn(*parts, e.types, Routing(routed, r.weights), h, e.act)
                if out is None:
                    out = y
                else:
                    out += y
                if keep_x.size:  # after the call, before a later copy into this buffer is queued
                    sel = keep_at[ids] >= 0
                    if sel.any():
                        self._keep_copy(parts, pos[sel], keep_at[ids[sel]])
            if self.prompt_group_ahead and pinned and not bufs:  # no group here: after the residents' call
                self._start_group_ahead(il, r.ids.size, b0)
            if keep_x.size:
                self._publish_keeps(il, keep_x, keep_s)
        finally:
            if flight is not None:  # an exception: the buffers go back to the pool only after the copy
                be.finish_upload(flight)
        return out  # (a group is skipped only when none of its experts is used: every used one is computed)

    def _keep_choice(self, il: int, up: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts layer ``il``'s prompt groups leave in empty slots (``prompt_keep``) and their
        slots: (int64 experts, int64 slots), both empty when none. ``up``: the layer's used experts
        not in a slot (of those, the ones the policy holds already, admitted with their copy in
        flight, are not kept: their slot is taken); ``ids``: the ubatch's routed ids (int (T, k)).
        The layer takes the empty slots of this pass (those empty at its first keep, and room in
        the policy) divided by the cached layers from ``il`` on (rounded down), the experts of most
        pairs first (ties: the lower id)."""
        none = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        if not self.prompt_keep or not up.size or self.pool is None:
            return none
        owner = self.pool.owner
        if self._free_slots is None:
            room = self.policy.n_slots - self.policy.n_resident
            self._free_slots = [s for s, o in enumerate(owner) if o is None][:room] if room > 0 else []
        elif self._free_slots:  # listed at the pass's first keep: checked again (a pass cut short leaves its list)
            self._free_slots = [s for s in self._free_slots if owner[s] is None]
        if not self._free_slots:  # (a full cache: the usual prompt pass of a warm server)
            return none
        up = up[~self.policy.resident[il, up]]  # an admission whose copy is in flight has its slot already
        left = self._cached_order.size - int(np.searchsorted(self._cached_order, il))
        n = min(int(up.size), len(self._free_slots) // max(left, 1))
        if n <= 0:
            return none
        flat = ids.reshape(-1)
        pairs = np.bincount(flat[flat >= 0], minlength=self.slot_of.shape[1])
        pick = up[np.argsort(-pairs[up], kind="stable")[:n]].astype(np.int64)
        slots = np.array(self._free_slots[:n], np.int64)
        del self._free_slots[:n]
        return pick, slots

    def _keep_copy(self, parts: tuple[Any, ...], pos: np.ndarray, slots: np.ndarray) -> None:
        """Copy the experts at positions ``pos`` of a prompt group's arrays ``parts`` (gate, up, down)
        into the pool's ``slots``, on the device (the compute stream), :data:`KEEP_COPY_EXPERTS` at a
        time."""
        pool = self.pool
        for dst, src in zip((pool.gate, pool.up, pool.down), parts):
            for i in range(0, slots.size, KEEP_COPY_EXPERTS):
                self.be.gather_into(dst, slots[i:i + KEEP_COPY_EXPERTS], src, pos[i:i + KEEP_COPY_EXPERTS])

    def _publish_keeps(self, il: int, experts: np.ndarray, slots: np.ndarray) -> None:
        """Layer ``il``'s kept ``experts`` are in ``slots`` from now (their copies are queued on the
        compute stream, before anything that reads them): the map, the pool, the policy. Raises
        RuntimeError when a slot is no longer empty or an expert became resident meanwhile (its
        bytes would be in two slots)."""
        owner, resident = self.pool.owner, self.policy.resident
        if any(owner[sl] is not None for sl in slots.tolist()) or resident[il, experts].any():
            raise RuntimeError(f"prompt keep of layer {il}: a slot was taken or an expert made resident "
                               f"while its copy was queued")
        for x, sl in zip(experts.tolist(), slots.tolist()):
            self.pool.set_owner(sl, (il, x))
            self.slot_of[il, x] = sl
        self.policy.keep(il, experts)
        self._kept[il, experts] = True
        self.prompt_keeps += int(experts.size)
        self._map_dirty = True

    def _group_size(self, e: ExpertWeights) -> int:
        """Experts per prompt group of layer experts ``e``: ``prompt_group_bytes`` of them, at least
        one, at most the layer's."""
        return min(max(1, self.prompt_group_bytes // self._expert_bytes(e)), e.gate.shape[0])

    def _group_buffers(self, e: ExpertWeights, size: int) -> list[tuple[Any, ...]]:
        """The two group buffers kept across a prompt pass's layers (``prompt_group_ahead``), made on
        first use: (gate, up, down) arrays of ``size`` experts each (every cached layer shares one
        expert signature)."""
        if self._gbufs is None or self._gbufs[0][0].shape[0] != size:
            self._group_ahead.drop()
            self._gbufs = self._new_group_buffers(e, size, 2)
        return self._gbufs

    def _new_group_buffers(self, e: ExpertWeights, size: int, n: int) -> list[tuple[Any, ...]]:
        """``n`` group buffers on the backend: (gate, up, down) arrays of ``size`` experts of ``e``'s shapes."""
        return [tuple(self.be.empty_u8((size,) + tuple(w.shape[1:])) for w in (e.gate, e.up, e.down)) for _ in range(n)]

    def drop_group_buffers(self) -> None:
        """Give the group buffers kept for ``prompt_group_ahead`` back (a copy into one in flight is
        dropped first: the compute stream waits for it)."""
        self._group_ahead.drop()
        self._gbufs = None

    def _start_group_ahead(self, il: int, n_pairs: int, b: int) -> None:
        """Before layer ``il``'s last group call is queued (or after its residents' call when it has no
        group): begin copying the next cached layer's first group (its first non-resident experts by
        id, one group's worth) into group buffer ``b`` (not the last group's) on the copy stream, for
        a ubatch of ``n_pairs`` (token, expert) pairs (none below
        :data:`~moecache.moe.prefetch.MIN_PAIRS_PER_EXPERT` per expert, none after the last layer).
        The copy waits for the compute stream's work queued so far, which holds the last reads of
        buffer ``b``."""
        nxt = self._next_to_copy(il, n_pairs)
        if nxt is None:
            return
        e = self.layers[nxt]
        size = self._group_size(e)
        copied = np.flatnonzero(self.slot_of[nxt] < 0)[:size]
        if not copied.size:
            return
        upl = self.be.start_upload((e.gate, e.up, e.down), copied, self._group_buffers(e, size)[b], compact=True)
        if upl is None:
            return
        nbytes = int(copied.size) * self._expert_bytes(e)
        self._group_ahead.begin(nxt, self.be, upl, nbytes, (b, copied))
        self.offload.offloaded_bytes += nbytes

    @property
    def group_prefetch(self) -> list[int]:
        """[started, used, dropped] copies of a next layer's first prompt group (``prompt_group_ahead``)."""
        f = self._group_ahead
        return [f.started, f.used, f.dropped]

    @staticmethod
    def _expert_bytes(e: ExpertWeights) -> int:
        """Bytes of one expert's three matrices (stacked (n_expert, ...) arrays: nbytes per expert)."""
        return e.gate.nbytes // e.gate.shape[0] + e.up.nbytes // e.up.shape[0] + e.down.nbytes // e.down.shape[0]

    def close(self) -> None:
        """Wait for the slot copies in flight, give the stack buffers back, stop the miss worker.

        The wait matters on the GPU: a slot copy is queued on the copy stream, which nothing else
        waits for, while the slots' memory goes back to CuPy's pool (to the compute stream's free
        blocks) once the cache is dropped; a copy still queued would then write into whatever the
        pool hands those blocks to next (in the GPU suite, a later test's engine: its logits went
        wrong after a test that had held the copy stream up)."""
        if self._guard is not None:
            self._guard.stop()
        try:
            for copy in self._retired + [p[0] for p in self._pending]:  # retired first: each precedes
                copy.wait()  # any pending copy into its slot
        finally:
            self._pending, self._retired = [], []
            self.drop_group_buffers()
            self.drop_stacks()
            self._workers.shutdown(wait=True)
