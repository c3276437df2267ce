"""The prompt MoE's plan in one compiled pass (Numba): which experts go into which batched GEMM
chunk, each chunk's padded token rows, and each routed pair's output row.

:func:`moecache.backends.ops.moe_prompt_plan` returns it as a :class:`~moecache.backends.ops.MoePromptPlan`;
:func:`layer_plan` also lays out the weighted sum's indices (each kept pair's row, each token's
first pair) in the same int32 buffer, the one array the GPU's prompt MoE uploads per layer.

Why compiled: a prompt ubatch plans every MoE layer on the host between the router's copy to the
host and the first expert GEMM, while the GPU waits. The numpy version (argsorts, masks, one
fancy-indexing pass per chunk) took ~0.37 ms per 512 x 8 routing; with every expert on the GPU
the prompt is host-bound (torch profiler, H200, 2026-12-02: GPU busy 69 of 135 ms at pp512), and
the plan was 23 of the host's 168 ms (cProfile). The numpy version is kept in the tests as the
reference this one must equal.

Rules (the numpy version's, exactly):
- pairs of an expert id < 0 have no expert: no row, ``row_of_pair`` -1;
- used experts go in descending pair count, ties by ascending id (a stable sort);
- a chunk starts at the hottest expert left, holds at most ``max_experts`` experts and
  ``act_bytes`` of padded rows (``chunk size * m * row_bytes``, m = its largest count rounded up to
  ``m_align``, then with ``pow2`` to a power of two; one expert at least), and only experts of at
  least 1 / ``ratio`` of its largest count, unless m is ``m_align`` (every expert left pads to
  that many rows in any chunk: one chunk takes them, fewer launches for the same rows);
- an expert's rows are its pairs in flat order (tokens ascending), padded to m with its first
  pair's token.
"""

from __future__ import annotations

import numpy as np

from moecache.quants import _numba_setup  # noqa: F401 - numba's settings before it compiles anything
from numba import njit

from moecache.backends.ops import MOE_PROMPT_CHUNK_RATIO, chunk_ratio


@njit(cache=True)
def _plan(ids, n_expert, max_experts, row_bytes, act_bytes, m_align, ratio, pow2):  # pragma: no cover - compiled
    n_pairs = ids.size
    flat = ids.reshape(-1)
    counts = np.zeros(n_expert, np.int64)
    for p in range(n_pairs):
        e = flat[p]
        if e >= 0:
            counts[e] += 1
    n_used = 0
    for e in range(n_expert):
        if counts[e] > 0:
            n_used += 1
    used = np.empty(n_used, np.int64)
    j = 0
    for e in range(n_expert):
        if counts[e] > 0:
            used[j] = e
            j += 1
    # descending count, ties by id (insertion sort: stable; at most n_expert entries)
    for a in range(1, n_used):
        v = used[a]
        b = a - 1
        while b >= 0 and counts[used[b]] < counts[v]:
            used[b + 1] = used[b]
            b -= 1
        used[b + 1] = v
    # each expert's pairs in flat order (CSR over expert ids)
    start = np.zeros(n_expert + 1, np.int64)
    for e in range(n_expert):
        start[e + 1] = start[e] + counts[e]
    fill = start[:n_expert].copy()
    pairs = np.empty(start[n_expert], np.int64)
    for p in range(n_pairs):
        e = flat[p]
        if e >= 0:
            pairs[fill[e]] = p
            fill[e] += 1
    # chunks
    chunks = np.empty((max(n_used, 1), 2), np.int64)
    n_chunks = 0
    n_rows = 0
    i = 0
    while i < n_used:
        largest = max(1, counts[used[i]])
        m = -(-largest // m_align) * m_align
        if pow2:
            p2 = 1
            while p2 < m:
                p2 *= 2
            m = p2
        n = max(1, min(max_experts, act_bytes // (m * row_bytes)))
        n = min(n, n_used - i)
        c = 0
        while c < n and (ratio * counts[used[i + c]] >= largest or m <= m_align):
            c += 1
        chunks[n_chunks, 0] = c
        chunks[n_chunks, 1] = m
        n_chunks += 1
        n_rows += c * m
        i += c
    token_rows = np.empty(n_rows, np.int32)
    row_of_pair = np.full(n_pairs, -1, np.int32)
    k = ids.shape[1]
    at = 0
    i = 0
    for ci in range(n_chunks):
        c = chunks[ci, 0]
        m = chunks[ci, 1]
        for x in range(c):
            e = used[i + x]
            s0 = start[e]
            cnt = counts[e]
            first = pairs[s0] // k
            for s in range(m):
                if s < cnt:
                    p = pairs[s0 + s]
                    token_rows[at + s] = p // k
                    row_of_pair[p] = at + s
                else:
                    token_rows[at + s] = first
            at += m
        i += c
    return chunks[:n_chunks], used.astype(np.int32), token_rows, row_of_pair


@njit(cache=True)
def _sum_index(ids, row_of_pair):  # pragma: no cover - compiled
    """(pair_rows, starts): the rows of the pairs with an expert, token by token, and each token's
    first entry in them (T + 1)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    n = 0
    for p in range(flat.size):
        if flat[p] >= 0:
            n += 1
    pair_rows = np.empty(n, np.int32)
    starts = np.empty(t + 1, np.int32)
    j = 0
    for i in range(t):
        starts[i] = j
        for s in range(k):
            p = i * k + s
            if flat[p] >= 0:
                pair_rows[j] = row_of_pair[p]
                j += 1
    starts[t] = j
    return pair_rows, starts


def plan_arrays(ids: np.ndarray, n_expert: int, max_experts: int, row_bytes: int, act_bytes: int,
                m_align: int = 1, ratio: int = MOE_PROMPT_CHUNK_RATIO, pow2: bool = False
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The plan of routing ``ids`` (int (T, k), values < ``n_expert``; < 0: no expert) as arrays:
    (chunks int64 (C, 2) of (experts, padded rows per expert), expert_ids int32, token_rows int32,
    row_of_pair int32 (T * k,)); the arguments as :func:`moecache.backends.ops.moe_prompt_plan`'s.
    Raises ValueError for ids that are not integers (T, k), an id >= n_expert or a size argument or
    ``ratio`` < 1."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"routing ids must be integers (T, k), got {ids.dtype} {ids.shape}")
    ratio = chunk_ratio(ratio)
    if min(n_expert, max_experts, row_bytes, act_bytes, m_align) < 1:
        raise ValueError("moe prompt plan: n_expert, max_experts, row_bytes, act_bytes and m_align must be >= 1")
    if ids.size and int(ids.max()) >= n_expert:  # checked before the cast to int32, which could wrap
        raise ValueError(f"expert id {int(ids.max())} out of range [0, {n_expert})")
    return _plan(np.ascontiguousarray(ids, np.int32), n_expert, max_experts, row_bytes, act_bytes, m_align,
                 ratio, bool(pow2))


def layer_plan(ids: np.ndarray, n_expert: int, max_experts: int, row_bytes: int, act_bytes: int,
               m_align: int = 1, ratio: int = MOE_PROMPT_CHUNK_RATIO,
               pow2: bool = False) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """:func:`plan_arrays` and the weighted sum's indices in one int32 buffer, as the GPU's prompt
    MoE uploads them: ``idx = [expert_ids (n_e), token_rows (n_r), pair_rows (n_p), starts (T + 1)]``
    where ``pair_rows`` lists the output row of each pair with an expert, token by token, and token
    i's pairs are ``pair_rows[starts[i]:starts[i + 1]]``. Returns (chunks (C, 2), idx, n_e, n_r, n_p)."""
    chunks, eids, rows, row_of_pair = plan_arrays(ids, n_expert, max_experts, row_bytes, act_bytes, m_align,
                                                  ratio, pow2)
    pair_rows, starts = _sum_index(np.ascontiguousarray(ids, np.int32), row_of_pair)
    idx = np.concatenate([eids, rows, pair_rows, starts])
    return chunks, idx, eids.size, rows.size, pair_rows.size


__all__ = ["layer_plan", "plan_arrays"]
