"""Array operations written once for numpy and CuPy: the backends' shared, non-quantized ops.

A backend subclasses :class:`ArrayOps`, sets ``xp`` (the array module) and adds the quantized
parts (weights, ``matmul``, ``embed``). Everything here is float32 in, float32 out; T is the
number of tokens in the ubatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# decode ubatches: up to this many tokens the GPU's fused kernels run a product or an MoE layer in
# one launch (their MAX_TOK; the 8-bit activation path, the expert cache's zero-copy path and its
# routing log are sized by it too); more tokens take the prompt path
DECODE_MAX_TOKENS = 16
# prompt attention here (the CPU's, and the GPU's where its tiled kernel does not apply: a float32
# cache, heads other than 64 and 128, moecache.backends.flash.flash_ok) computes its float32 scores
# (n_head x queries x keys) for at most this many bytes of them at a time: the queries go in chunks,
# so the transient stays bounded at any context length.
# 64 MiB (256 before): behind an expert cache a long prompt's attention blocks crowded out the prompt
# stack (run h200-s13c: 740 MiB of a ubatch's transients at ~2.5k positions, a 256 MiB scores block
# among them, and the stack given back at the fifth ubatch of the 12620-token prompt); a chunk of
# 64 MiB still holds 41 queries of 32 heads at 12620 keys (328 rows per KV head's product)
ATTENTION_SCORE_BYTES = 64 << 20
# the GPU's prompt MoE (CupyBackend._moe_prompt) takes its used experts in chunks of at most
# MOE_SCRATCH_BYTES of dequantized weights (float16 by default, float32 with act_q8 off) and
# MOE_ACT_BYTES of padded float32 rows of its widest activation (moe_prompt_chunks); a chunk holds
# six such arrays at once. The layer's padded down outputs (at most 2 * T * k rows of n_embd float32,
# plus MOE_PROMPT_M_ALIGN - 1 rows per used expert: 79 MiB for Qwen3-30B-A3B at -ub 512, 271 MiB at
# -ub 2048) stay until the weighted sum; all of it
# comes out of placement's RESERVE_BYTES
MOE_SCRATCH_BYTES = 256 << 20
MOE_ACT_BYTES = 64 << 20
# the GPU prompt MoE pads each chunk's rows per expert to a multiple of this (moe_prompt_plan): the
# batched GEMMs' shapes then repeat. With the exact largest count each ubatch brought new shapes, and
# cuBLAS loaded a kernel for ~10 of them per 512-token prompt, the GPU idle 3-5 ms each (torch
# profiler, run h200-s14a, 8 GiB pp512: 210 distinct nvjet kernels in one prompt; 156 after). The cost:
# a chunk's six arrays at most 175 MiB instead of 134 under uniform routing, 62 instead of 60 under
# qwen3-moe (bench/moe_prompt_padding.py, 512-token ubatch, Qwen3-30B-A3B's shape)
MOE_PROMPT_M_ALIGN = 16
# a chunk of the GPU prompt MoE holds only experts of at least 1 / MOE_PROMPT_CHUNK_RATIO of its
# largest count (moe_prompt_chunks), so its padded rows stay under RATIO times its real ones plus the
# rounding (a chunk padded to MOE_PROMPT_M_ALIGN rows takes every expert left: see there). A larger
# ratio makes fewer chunks (launches: 5.6 a layer at 2, 3.9 at 4 for a 512-token ubatch under
# qwen3-moe routing, every expert on the GPU) with more padded rows (1.58 per pair at 2, 2.15 at 4),
# and the layer's padded down outputs grow with it (the bound above scales with the ratio; twice with
# padded rows rounded to powers of two, which cut the distinct GEMM shapes from 305 to 119 over six
# such prompts): `python bench/prompt_chunks.py --count`, bench/results/prompt-chunks-count.md. Both
# are CupyBackend attributes (prompt_chunk_ratio, prompt_m_pow2) so that bench/prompt_chunks.py can
# A/B them on a GPU; the defaults stay the measured road until then.
MOE_PROMPT_CHUNK_RATIO = 2


def _scratch(xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised ``shape`` array at the start of a block of a power-of-two element count.

    A prompt's spans grow with every ubatch; CuPy's memory pool keeps each freed block for reuse,
    but a request larger than every free block gets a new one, so exact sizes that grow by a few
    MiB per ubatch would leave a trail of blocks (a 12k-token prompt at -c 16384: ~1.5 GiB beyond
    the planned VRAM, bench/results/cache-arms-h200.md). Rounded sizes repeat, and are reused."""
    n = int(np.prod(shape))
    return xp.empty(1 << max(0, n - 1).bit_length(), dtype)[:n].reshape(shape)


def moe_prompt_chunks(counts: np.ndarray, max_experts: int, row_bytes: int, act_bytes: int,
                      m_align: int = 1, ratio: int = MOE_PROMPT_CHUNK_RATIO, pow2: bool = False) -> list[np.ndarray]:
    """Chunks of a prompt ubatch's used experts for batched GEMMs padded to a chunk's largest group.

    Args:
        counts: (n_used,) int, tokens routed to each used expert.
        max_experts: at most this many experts per chunk (their dequantized weights share a scratch).
        row_bytes: bytes of one padded token row of the widest activation (4 * max(n_embd, n_ff)).
        act_bytes: at most this many bytes of padded rows (``len(chunk) * m * row_bytes``, m the
            chunk's padded rows per expert: :func:`padded_rows`) per chunk, unless one expert alone
            is larger.
        m_align: the padded rows per expert are a multiple of this (:data:`MOE_PROMPT_M_ALIGN`; with
            ``pow2`` the least power of two at least that multiple: :func:`padded_rows`).
        ratio: a chunk holds only counts of at least 1 / ``ratio`` of its largest (>= 1;
            :data:`MOE_PROMPT_CHUNK_RATIO`).
        pow2: the padded rows per expert are also rounded up to a power of two (fewer GEMM shapes).

    Returns:
        Index arrays into ``counts``, every used expert once. Experts go in descending count and a
        chunk holds only counts of at least 1 / ``ratio`` of its largest, so its padded rows are
        fewer than ``ratio`` times its real ones (twice that with ``pow2``), plus ``m_align - 1``
        per expert for the rounding; except a chunk padded to ``m_align`` rows, which takes every
        expert left (within the bounds above): each of them pads to ``m_align`` rows in any chunk,
        so one chunk makes the same rows in fewer launches (512-token ubatches under qwen3-moe
        routing: 28-33% fewer chunks, ``bench/results/prompt-chunks-count.md``). Raises ValueError
        for a ``ratio`` that is not an integer >= 1 (:func:`chunk_ratio`). (Chunks in id order, as
        before, padded every expert to the hottest one's count: under a skewed router, one expert
        taking up to 506 of a 512-token ubatch's pairs, 685 MiB of activations at once;
        bench/results/moe-prompt-padding.md.)
    """
    ratio = chunk_ratio(ratio)
    counts = np.asarray(counts, np.int64)
    order = np.argsort(-counts, kind="stable")
    out, i = [], 0
    while i < order.size:
        largest = max(1, int(counts[order[i]]))
        m = padded_rows(largest, m_align, pow2)
        n = min(order.size - i, max(1, min(max_experts, act_bytes // (m * row_bytes))))
        if m > m_align:  # (at m_align rows, every expert left pads to that many in any chunk)
            n = int(np.sum(ratio * counts[order[i:i + n]] >= largest))  # >= 1 (the largest itself); sorted: a prefix
        out.append(order[i:i + n])
        i += n
    return out


def chunk_ratio(ratio: Any) -> int:
    """The prompt MoE plan's chunk ratio as an int, checked once for both plans (this module's
    :func:`moe_prompt_chunks` and the compiled :mod:`moe_plan`, which would truncate a fraction).
    Raises ValueError unless ``ratio`` is an integer >= 1 (a bool is not)."""
    if isinstance(ratio, bool) or int(ratio) != ratio or ratio < 1:
        raise ValueError(f"moe prompt plan: chunk ratio must be an integer >= 1, got {ratio}")
    return int(ratio)


def _round_up(n: int, align: int) -> int:
    """The least multiple of ``align`` (>= 1) that is >= ``n``."""
    return -(-n // align) * align


def padded_rows(largest: int, m_align: int, pow2: bool = False) -> int:
    """A prompt-MoE chunk's padded rows per expert for its ``largest`` count (>= 1): the least
    multiple of ``m_align`` at least that, with ``pow2`` the least power of two at least that
    (a multiple of ``m_align`` too when ``m_align`` is a power of two)."""
    m = _round_up(largest, m_align)
    return 1 << (m - 1).bit_length() if pow2 else m


@dataclass(frozen=True)
class MoePromptPlan:
    """How a prompt ubatch's routed pairs go through batched GEMMs (:func:`moe_prompt_plan`).

    Attributes:
        chunks: (C experts, m padded rows per expert) of each chunk, in order.
        expert_ids: int32, each chunk's C expert ids, concatenated.
        token_rows: int32, each chunk's C * m token rows (expert-major; an expert with fewer than m
            tokens repeats its first one), concatenated.
        row_of_pair: int32 (T * k,), pair ``t * k + s`` (token t's s-th expert) -> its row among the
            chunks' outputs stacked in order (``sum(C * m)`` rows); -1 for a pair of no expert.
    """
    chunks: list[tuple[int, int]]
    expert_ids: np.ndarray
    token_rows: np.ndarray
    row_of_pair: np.ndarray

    @property
    def n_rows(self) -> int:
        return int(sum(c * m for c, m in self.chunks))


def _pairs_by_expert(ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, used expert ids ascending, their pair counts) of routing ``ids`` int (T, k): ``order``
    lists the flat pair indices grouped by expert, each expert's tokens ascending (a stable sort; ids
    as uint16 take numpy's radix sort, one pass per byte: 38 -> 7 µs for 512 x 8 pairs on the
    development VM). Ids in [0, n_expert): its caller, :func:`moe_prompt_groups`, checks them (the
    prompt plan, whose routings may hold pairs of no expert, is :mod:`moecache.backends.moe_plan`)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat.astype(np.uint16) if n_expert <= 1 << 16 else flat, kind="stable")
    per_expert = np.bincount(flat, minlength=n_expert)
    eids = np.flatnonzero(per_expert)
    return order, eids, per_expert[eids]


def moe_prompt_plan(ids: np.ndarray, n_expert: int, max_experts: int, row_bytes: int,
                    act_bytes: int, m_align: int = 1, ratio: int = MOE_PROMPT_CHUNK_RATIO,
                    pow2: bool = False) -> MoePromptPlan:
    """The GPU's prompt-MoE plan for routing ``ids`` (int (T, k), values < ``n_expert``; a pair of id
    < 0 has no expert: it gets no row and ``row_of_pair`` -1): used experts chunked as
    :func:`moe_prompt_chunks` does (``max_experts``, ``row_bytes``, ``act_bytes``, ``m_align``,
    ``ratio``, ``pow2`` as there), each expert's tokens in increasing order, each chunk's experts
    padded to :func:`padded_rows` of its largest count. Compiled (:mod:`moecache.backends.moe_plan`); the
    CPU tests run it against a direct per-pair sum and against a numpy version of the same rules."""
    from moecache.backends.moe_plan import plan_arrays

    chunks, eids, rows, row_of_pair = plan_arrays(ids, n_expert, max_experts, row_bytes, act_bytes, m_align,
                                                  ratio, pow2)
    return MoePromptPlan([(int(c), int(m)) for c, m in chunks], eids, rows, row_of_pair)


@dataclass(frozen=True)
class MoeGroups:
    """A prompt ubatch's routed pairs grouped by expert for the grouped 8-bit kernels
    (:func:`moe_prompt_groups`; ``moeq_gglu`` / ``moeq_gdown`` of mmvq.cu).

    Attributes:
        token_of_row: int32 (T * k,), the token each row reads: the pairs sorted by expert (stable:
            an expert's tokens ascending); row i holds one pair.
        row_of_pair: int32 (T * k,), pair ``t * k + s`` (token t's s-th expert) -> its row.
        groups: int32 (G, 3), (expert, first row, rows): each expert's rows cut into runs of at most
            ``max_tok``; a group's rows are read with the expert's weights once.
    """
    token_of_row: np.ndarray
    row_of_pair: np.ndarray
    groups: np.ndarray


def moe_prompt_groups(ids: np.ndarray, n_expert: int, max_tok: int) -> MoeGroups:
    """The grouped prompt-MoE plan for routing ``ids`` (int (T, k), values in [0, ``n_expert``)):
    pairs sorted by expert, each expert's run of rows cut into groups of at most ``max_tok`` (the
    kernels' accumulators per lane, DECODE_MAX_TOKENS). Plain numpy; the CPU tests run it against a
    direct per-pair sum.

    Raises:
        ValueError: an id outside [0, n_expert), or ``max_tok`` < 1.
    """
    ids = np.asarray(ids)
    if max_tok < 1:
        raise ValueError(f"max_tok must be >= 1, got {max_tok}")
    t, k = ids.shape
    flat = ids.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise ValueError(f"expert ids must lie in [0, {n_expert}), got {flat.min()}..{flat.max()}")
    order, eids, counts = _pairs_by_expert(ids, n_expert)
    row_of_pair = np.empty(t * k, np.int32)
    row_of_pair[order] = np.arange(t * k, dtype=np.int32)
    first_row = np.cumsum(counts) - counts
    n_g = -(-counts // max_tok)  # groups per used expert
    j = np.arange(int(n_g.sum())) - np.repeat(np.cumsum(n_g) - n_g, n_g)  # a group's index within its expert
    groups = np.stack([np.repeat(eids, n_g), np.repeat(first_row, n_g) + j * max_tok,
                       np.minimum(max_tok, np.repeat(counts, n_g) - j * max_tok)], axis=1).astype(np.int32)
    return MoeGroups((order // k).astype(np.int32), row_of_pair, groups.reshape(-1, 3))


def expert_runs(used: np.ndarray) -> list[tuple[int, int, int]]:
    """The runs of consecutive ids in ``used`` (int, ascending, unique) as (position in ``used``,
    first id, length): copying ``w[id:id + length]`` to ``out[position:position + length]`` for
    each run gives ``out == w[used]`` with one copy per run (a DMA from page-locked weights)."""
    used = np.asarray(used, np.int64)
    if used.size == 0:
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(used) != 1) + 1])
    ends = np.concatenate([starts[1:], [used.size]])
    return [(int(a), int(used[a]), int(b - a)) for a, b in zip(starts, ends)]


class ArrayOps:
    """RMSNorm, RoPE, attention and gated activations on ``self.xp`` arrays."""

    xp: Any = np

    def matmuls(self, ws: list[Any], x: Any) -> list[Any]:
        """``[self.matmul(w, x) for w in ws]``: the products that read one input (q, k and v; gate
        and up), which a backend may run as one launch (CupyBackend's decode products)."""
        return [self.matmul(w, x) for w in ws]

    def route(self, w: Any, x: Any, k: int, renorm: bool) -> Any:
        """Top-k softmax routing of x float32 (T, n_embd) through the router ``w``
        (``ffn_gate_inp``, (n_expert, n_embd)): ``topk_routing(matmul(w, x), k, renorm)``, a
        :class:`~moecache.moe.routing.Routing` of (T, k) ids and weights; a backend may fuse the two
        (CupyBackend's ``router_topk``)."""
        return self.topk_routing(self.matmul(w, x), k, renorm)

    def rms_norm(self, x: Any, w: Any | None, eps: float) -> Any:
        """``x / sqrt(mean(x^2) + eps) * w`` over the last axis (Zhang & Sennrich 2019)."""
        xp = self.xp
        ms = xp.mean(xp.square(x), axis=-1, keepdims=True)
        y = x * (1.0 / xp.sqrt(ms + np.float32(eps))).astype(np.float32)
        return y * w if w is not None else y

    def add_rms_norm(self, x: Any, r: Any, w: Any | None, eps: float) -> tuple[Any, Any]:
        """``h = x + r`` and ``rms_norm(h, w, eps)``: (h, normed), float32 like x."""
        h = x + r
        return h, self.rms_norm(h, w, eps)

    def rope(self, x: Any, cos: Any, sin: Any, neox: bool) -> Any:
        """Rotary position embedding (Su et al. 2021) of the first ``2 * cos.shape[1]`` dims of each head.

        Args:
            x: float32 (T, n_heads, head_dim).
            cos, sin: float32 (T, n_rot / 2), the angles ``pos * inv_freq``.
            neox: pairs ``(x[i], x[i + n_rot/2])`` (GPT-NeoX, ggml ``ROPE_TYPE_NEOX``) if True, else
                adjacent pairs ``(x[2i], x[2i+1])`` (ggml ``ROPE_TYPE_NORM``, llama).
        """
        half = cos.shape[1]
        c = cos[:, None, :]
        s = sin[:, None, :]
        out = x.copy()
        if neox:
            a, b = x[..., :half], x[..., half:2 * half]
            out[..., :half] = a * c - b * s
            out[..., half:2 * half] = a * s + b * c
        else:
            a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
            out[..., 0:2 * half:2] = a * c - b * s
            out[..., 1:2 * half:2] = a * s + b * c
        return out

    def positions(self, pos: np.ndarray) -> Any:
        """A pass's positions (int (T,), host) as this backend's int32 array."""
        return self.xp.asarray(np.asarray(pos, dtype=np.int32))

    def rope_tables(self, inv_freq: np.ndarray, pos: Any) -> tuple[Any, Any]:
        """cos and sin, float32 (T, n_rot/2), of the angles ``pos[t] * inv_freq[i]`` computed in float64
        (``inv_freq``: :meth:`moecache.models.base.RopeSpec.inv_freq`)."""
        xp = self.xp
        a = xp.asarray(pos).astype(np.float64)[:, None] * xp.asarray(inv_freq, dtype=np.float64)[None, :]
        return xp.cos(a).astype(np.float32), xp.sin(a).astype(np.float32)

    def kv_store(self, k_all: Any, v_all: Any, pos: Any, k: Any, v: Any) -> None:
        """Write keys/values (T, n_head_kv, head_dim[_v]) of contiguous positions ``pos`` into one
        layer's cache (n_ctx, ...). The caller checked that they fit (KVCache.check_room)."""
        p0 = int(pos[0])
        t = k.shape[0]
        k_all[p0:p0 + t] = k
        v_all[p0:p0 + t] = v

    def qk_rope_store(self, q: Any, k: Any, v: Any, q_norm: Any | None, k_norm: Any | None, eps: float,
                      cos: Any, sin: Any, neox: bool, k_all: Any, v_all: Any, pos: Any, kv_base: Any = None) -> Any:
        """The attention inputs of a block in one step: per-head RMSNorm of q and k (when ``q_norm`` /
        ``k_norm`` are given: float32 (head_dim,), qwen3's and gemma3's ``attn_q_norm``/``attn_k_norm``),
        RoPE of both, and k, v written into the layer's KV cache at ``pos``.

        Args:
            q: float32 (T, n_head, head_dim); k: (T, n_head_kv, head_dim); v: (T, n_head_kv, head_dim_v).
            cos, sin: float32 (T, n_rot / 2) (:meth:`rope_tables`); neox: as :meth:`rope`.
            k_all, v_all, pos: as :meth:`kv_store`.
            kv_base: None, or int32 (T,): token t's sequence starts at row ``kv_base[t]`` of
                ``k_all``/``v_all`` (several sequences in one buffer: a batched decode step), and
                its k, v go to row ``kv_base[t] + pos[t]`` (``pos`` per token, any order).

        Returns:
            q after norm and RoPE, float32 (T, n_head, head_dim). The same arithmetic as
            :meth:`rms_norm`, :meth:`rope` and :meth:`kv_store` one after another (this is their
            composition; the GPU backend runs it as one kernel).
        """
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)
        if k_norm is not None:
            k = self.rms_norm(k, k_norm, eps)
        q = self.rope(q, cos, sin, neox)
        k = self.rope(k, cos, sin, neox)
        if kv_base is None:
            self.kv_store(k_all, v_all, pos, k, v)
        else:
            rows = self.xp.asarray(kv_base, dtype=np.int64) + self.xp.asarray(pos, dtype=np.int64)
            k_all[rows] = k
            v_all[rows] = v
        return q

    def attention(self, q: Any, k_all: Any, v_all: Any, pos0: Any, scale: float,
                  window: int | None = None, softcap: float | None = None, kv_base: Any = None,
                  n_ctx: int | None = None) -> Any:
        """Causal multi-head attention of T new queries over the cached positions, grouped-query.

        Args:
            q: float32 (T, n_head, head_dim), positions ``pos0 .. pos0 + T - 1``; ``pos0`` an int or
                the pass's positions array (its first element is used).
            k_all, v_all: the layer's cache, float32 or float16 (n_ctx, n_head_kv, head_dim[_v]); positions
                ``0 .. pos0 + T - 1`` must be filled. Query head h reads KV head ``h // (n_head / n_head_kv)``.
            scale: multiplies q.k (usually ``1/sqrt(head_dim)``).
            window: sliding window: query at p sees keys at ``p - window < j <= p`` (llama.cpp
                ``LLAMA_SWA_TYPE_STANDARD``); None = all previous positions.
            softcap: ``softcap * tanh(s / softcap)`` on the scores (gemma2) if set.
            kv_base: None, or int32 (T,) (a batched decode step): query t belongs to the sequence
                whose ``n_ctx`` rows start at row ``kv_base[t]`` of ``k_all``/``v_all``; it is at
                position ``pos0[t]`` (the positions array, one per query) and sees that sequence's
                keys only, rows ``kv_base[t] + start .. kv_base[t] + pos0[t]``.
            n_ctx: the rows of each sequence with ``kv_base`` (the kernels size their key runs by
                it); default all of ``k_all``.

        Returns:
            float32 (T, n_head * head_dim_v).

        The queries go in chunks whose float32 scores fit :data:`ATTENTION_SCORE_BYTES` (a 512-token
        ubatch at position 12k would otherwise hold ~0.8 GB of them per copy).
        """
        if kv_base is not None:  # one query per sequence, each over its own rows
            base = np.asarray(self.to_host(kv_base), np.int64)
            pos = np.asarray(self.to_host(pos0), np.int64)
            n = k_all.shape[0] if n_ctx is None else n_ctx
            return self.xp.concatenate([
                self._attention(q[i:i + 1], k_all[base[i]:base[i] + n], v_all[base[i]:base[i] + n], int(pos[i]),
                                scale, window, softcap) for i in range(q.shape[0])])
        pos0 = int(pos0) if np.ndim(pos0) == 0 else int(pos0[0])
        t, n_head = q.shape[0], q.shape[1]
        chunk = max(1, ATTENTION_SCORE_BYTES // (4 * n_head * (pos0 + t)))
        if t <= chunk:
            return self._attention(q, k_all, v_all, pos0, scale, window, softcap)
        return self.xp.concatenate([self._attention(q[i:i + chunk], k_all, v_all, pos0 + i, scale, window, softcap)
                                    for i in range(0, t, chunk)])

    def _attention(self, q: Any, k_all: Any, v_all: Any, pos0: int, scale: float, window: int | None,
                   softcap: float | None) -> Any:
        """:meth:`attention` of one chunk of queries. Its transient arrays (the float32 copy of the
        key span per KV head, the scores, the mask) live in blocks of power-of-two sizes
        (:func:`_scratch`) and the scores are updated in place."""
        xp = self.xp
        t, n_head, d = q.shape
        end = pos0 + t
        start = 0 if not window else max(0, pos0 - window + 1)  # window 0 or None: all keys (as the kernels)
        n, n_kv, dv = end - start, k_all.shape[1], v_all.shape[2]
        g = n_head // n_kv
        # the span per KV head as float32 (a float16 cache is converted here; the decode kernels of
        # the GPU backend read float16 directly)
        k = _scratch(xp, (n_kv, n, d), np.float32)
        k[...] = k_all[start:end].transpose(1, 0, 2)
        v = _scratch(xp, (n_kv, n, dv), np.float32)
        v[...] = v_all[start:end].transpose(1, 0, 2)
        qh = q.reshape(t, n_kv, g, d).transpose(1, 2, 0, 3).reshape(n_kv, g * t, d)
        s = _scratch(xp, (n_kv, g * t, n), np.float32)
        xp.matmul(qh, k.transpose(0, 2, 1), out=s)
        self._masked_softmax(s.reshape(n_kv * g, t, n), pos0, start, window, scale, softcap)
        o = xp.matmul(s, v)  # (n_kv, g*t, dv)
        return xp.ascontiguousarray(o.reshape(n_kv, g, t, dv).transpose(2, 0, 1, 3)).reshape(t, n_head * dv)

    def _masked_softmax(self, s: Any, pos0: int, start: int, window: int | None, scale: float,
                        softcap: float | None) -> None:
        """In place on the scores s float32 (heads, T, n) of T queries at positions ``pos0 ..`` over
        the keys at ``start .. start + n - 1``: ``x = s * scale``, then ``softcap * tanh(x /
        softcap)`` if set, keys after the query (or before its window) to -inf, softmax over each
        row."""
        xp = self.xp
        t, n = s.shape[1], s.shape[2]
        end = start + n
        s *= np.float32(scale)
        if softcap:
            s /= np.float32(softcap)
            xp.tanh(s, out=s)
            s *= np.float32(softcap)
        qpos = xp.arange(pos0, pos0 + t)[:, None]
        kpos = xp.arange(start, end)[None, :]
        allowed = _scratch(xp, (t, n), np.bool_)
        xp.less_equal(kpos, qpos, out=allowed)
        if window:  # 0 or None: no window (the kernels read 0 so)
            near = _scratch(xp, (t, n), np.bool_)
            xp.greater(kpos, qpos - window, out=near)
            allowed &= near
        mask = _scratch(xp, (t, n), np.float32)
        mask.fill(np.float32(-np.inf))
        xp.copyto(mask, np.float32(0), where=allowed)
        s += mask
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)

    def glu(self, gate: Any, up: Any, act: str) -> Any:
        """``act(gate) * up``; act "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation as ggml_gelu)."""
        xp = self.xp
        if act == "silu":
            with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0 gives the right limit, 0
                return gate / (np.float32(1.0) + xp.exp(-gate)) * up
        c = np.float32(0.7978845608028654)
        return np.float32(0.5) * gate * (1.0 + xp.tanh(c * (gate + np.float32(0.044715) * gate ** 3))) * up

