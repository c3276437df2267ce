"""The grouped MoE kernel (the expert cache's CPU miss path) against a float64 reference built
from gguf-py's dequantization. Same tolerance reasoning as test_quants.py; the chain
gate/up -> activation -> down in float32 gives ~1e-6 relative error, so 1e-5 catches any real bug.
Every random input is fresh each run (conftest's ``rng``: the seed is printed, MOECACHE_TEST_SEED
replays it).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from moecache.quants import cpu
from moecache.quants.formats import FORMATS
from moecache.quants.random_blocks import random_rows


def _experts(fmt_name, n_expert, n_rows, n_in, rng):
    fmt = FORMATS[fmt_name]
    W = random_rows(fmt, n_expert * n_rows, n_in, rng, std=0.05)
    W = W.reshape(n_expert, n_rows, -1)
    ref = gguf_dequantize(W.reshape(n_expert * n_rows, -1), fmt.ggml_type).astype(np.float64)
    return W, fmt.ggml_type, ref.reshape(n_expert, n_rows, n_in)


def _route(n_tok, n_expert, top_k, rng):
    """Random top-k routing as CSR groups by expert."""
    ids = np.stack([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tok)])
    w = rng.random((n_tok, top_k)).astype(np.float32)
    w /= w.sum(1, keepdims=True)
    pairs = sorted((int(ids[t, j]), t, float(w[t, j])) for t in range(n_tok) for j in range(top_k))
    eids = np.array(sorted({p[0] for p in pairs}), np.int32)
    counts = np.array([sum(1 for p in pairs if p[0] == e) for e in eids])
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = np.array([p[1] for p in pairs], np.int32)
    wts = np.array([p[2] for p in pairs], np.float32)
    return eids, offs, rows, wts


# A gated activation this close (in quants) to a quant and a half counts as a tie: the kernel's float32
# activation and the reference's differ by well under 1e-4 quants (3200 seeded layers, the eight
# cases below: none flipped outside 1e-4 nor outside 3e-5, one outside 1e-5).
TIE_WINDOW = 1e-4
# The act_q8 kernels' distance from the rounded reference, relative, besides the ties: measured
# at most 6.9e-6 (Q4_K, 6 tokens, GELU) over the same 3200 layers; the rounding itself moves the
# result 4e-4 to 1.5e-2, so this tolerance also tells a kernel that does not round.
ACT_Q8_RTOL = 2e-5


def _reference(Wg, Wu, Wd, eids, offs, rows, wts, h, act, rounded=None, ties=None):
    """float64 sum of the routed experts; ``rounded``: a rule applied to h and to the gated
    activations (those in float32 first, as the kernel holds them). ``ties``: a one-element list
    that gets the most a kernel's output may differ (in norm) because a gated activation sits on a
    rounding tie (within ``TIE_WINDOW`` of a quant and a half): a float32 value a few ulps off
    rounds to the other quant, a legitimate difference of one quant times that column of the down
    matrix (one in 300 random one-token Q5_K layers hit an exact tie, -10.5 quants)."""
    out = np.zeros((h.shape[0], Wd.shape[1]))
    h = h.astype(np.float64) if rounded is None else rounded(h)
    for g, e in enumerate(eids):
        for p in range(offs[g], offs[g + 1]):
            x = h[rows[p]]
            gate, up = Wg[e] @ x, Wu[e] @ x
            if act == cpu.ACT_SILU:
                a = gate / (1 + np.exp(-gate)) * up
            else:
                a = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
            if rounded is not None:
                a32 = a.astype(np.float32)
                if ties is not None:
                    d = np.repeat(np.abs(a32).reshape(-1, 32).max(1).astype(np.float64) / 127, 32)
                    with np.errstate(divide="ignore", invalid="ignore"):
                        frac = np.abs(np.abs(a32 / np.where(d > 0, d, 1)) % 1 - 0.5)
                    tie = (frac < TIE_WINDOW) & (d > 0)
                    ties[0] += abs(wts[p]) * float(np.sum(d[tie] * np.linalg.norm(Wd[e][:, tie], axis=0)))
                a = rounded(a32)
            out[rows[p]] += wts[p] * (Wd[e] @ a)
    return out


def _layer(types, n_tok, n_ff, rng, n_expert=8, n_embd=256, top_k=3):
    """Random experts of ``types`` (gate, up, down), h, a routing and the output's prior contents:
    (weights, their float64 references, h, the CSR groups, base)."""
    Wg, tg, Rg = _experts(types[0], n_expert, n_ff, n_embd, rng)
    Wu, tu, Ru = _experts(types[1], n_expert, n_ff, n_embd, rng)
    Wd, td, Rd = _experts(types[2], n_expert, n_embd, n_ff, rng)
    h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    groups = _route(n_tok, n_expert, top_k, rng)
    base = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    return (Wg, Wu, Wd, (tg, tu, td)), (Rg, Ru, Rd), h, groups, base


@pytest.mark.parametrize("types,n_tok,act", [
    (("Q4_K", "Q4_K", "Q6_K"), 1, cpu.ACT_SILU),
    (("Q8_0", "Q8_0", "Q8_0"), 5, cpu.ACT_SILU),
    (("Q4_K", "Q4_K", "Q4_K"), 12, cpu.ACT_GELU),
    (("MXFP4", "MXFP4", "BF16"), 3, cpu.ACT_SILU),
    (("Q5_K", "Q4_0", "Q8_0"), 1, cpu.ACT_SILU),  # one token: the fused Q5_K and Q4_0 dots (Q8_0's rows of 96
    # are all tail; the other fused dots over full steps: tests/test_quants.py, 1 token)
])
def test_moe_ffn_matches_reference(types, n_tok, act, rng):
    (Wg, Wu, Wd, tt), refs, h, groups, base = _layer(types, n_tok, 256 if types[2] in ("Q4_K", "Q6_K") else 96, rng)
    out = base.copy()
    cpu.moe_ffn(Wg, Wu, Wd, tt, *groups, h, out=out, act=act)
    ref = base + _reference(*refs, *groups, h, act)
    delta = ref - base
    err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(delta)
    assert np.all(np.isfinite(out)) and err < 1e-5


@pytest.mark.parametrize("n_tok,act_q8", [(1, False), (1, True), (7, False), (7, True)])
def test_moe_ffn_routed_matches_reference(n_tok, act_q8, rng):
    """The routing as the router gives it, (T, k) ids and weights, some pairs marked -1 (the expert
    cache's hits): grouped inside the compiled call, against the float64 reference of the pairs
    that remain. With ``act_q8``: bit-equal to :func:`cpu.moe_ffn` on the CSR groups this test
    builds from the routing, and within 5e-3 of the reference rounded by the GPU's rule (the
    kernel's float32 gated activation can round to the next quant where the reference's does not:
    one such flip moved a 7-token case's largest output by 2e-3)."""
    from test_act_q8 import rule

    types = ("Q4_K", "Q4_K", "Q6_K")
    (Wg, Wu, Wd, tt), refs, h, _, base = _layer(types, n_tok, 256, rng)
    n_expert, top_k = Wg.shape[0], 3
    ids = np.stack([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    w = rng.random((n_tok, top_k)).astype(np.float32)
    first = ids[0, 0]
    ids[rng.random(ids.shape) < 0.3] = -1
    ids[0, 0] = first  # at least one pair (a token's experts stay distinct)
    keep = [(int(ids[t, j]), t, float(w[t, j])) for t in range(n_tok) for j in range(top_k) if ids[t, j] >= 0]
    keep.sort()
    eids = np.array(sorted({p[0] for p in keep}), np.int32)
    offs = np.concatenate([[0], np.cumsum([sum(p[0] == e for p in keep) for e in eids])]).astype(np.int32)
    rows = np.array([p[1] for p in keep], np.int32)
    wts = np.array([p[2] for p in keep], np.float32)
    out = base.copy()
    assert cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids, w, h, out=out, act_q8=act_q8) is out
    delta = _reference(*refs, eids, offs, rows, wts, h, cpu.ACT_SILU, rounded=rule if act_q8 else None)
    err = np.linalg.norm(out.astype(np.float64) - base - delta) / np.linalg.norm(delta)
    assert np.all(np.isfinite(out)) and err < (5e-3 if act_q8 else 1e-5)
    if act_q8:
        assert np.array_equal(out, cpu.moe_ffn(Wg, Wu, Wd, tt, eids, offs, rows, wts, h, out=base.copy(), act_q8=True))
    none = np.full_like(ids, -1)
    assert np.array_equal(cpu.moe_ffn_routed(Wg, Wu, Wd, tt, none, w, h), np.zeros_like(base))


def test_moe_ffn_routed_act_q8_rounds_only_the_rows_with_pairs(rng):
    """A handoff's request carries every token of the step, most with no pair for the CPU: the 8-bit
    kernel rounds only the rows of tokens with a pair, and those rows give the same bits as the
    same tokens computed alone, the other rows (NaN here) leaving no trace. The tokens with pairs
    are the last ones and fewer pairs than tokens, so a row set taken from the pair indices would
    miss them. (This checks the row selection; the old kernel, which rounded every row, passed it
    too: the saving is measured by bench/cpu_call_cost.py.)"""
    types = ("Q4_K", "Q4_K", "Q6_K")
    n_tok = 8
    (Wg, Wu, Wd, tt), _, h, _, base = _layer(types, n_tok, 256, rng)
    ids = np.full((n_tok, 3), -1, np.int32)
    ids[6, 0], ids[7, 1] = rng.choice(Wg.shape[0], 2, replace=False)
    w = rng.random((n_tok, 3)).astype(np.float32)
    h[:6] = np.nan  # rows without a pair
    out = cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids, w, h, out=base.copy(), act_q8=True)
    alone = cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids[6:], w[6:], h[6:], out=base[6:].copy(), act_q8=True)
    assert np.array_equal(out[:6], base[:6]) and np.array_equal(out[6:], alone) and np.isfinite(alone).all()
    assert not np.array_equal(alone, base[6:])


def test_moe_ffn_routed_rejects_bad_routing(rng):
    (Wg, Wu, Wd, tt), _, h, _, _ = _layer(("Q4_K", "Q4_K", "Q4_K"), 2, 256, rng)
    ids = np.array([[0, 1, 2], [3, Wg.shape[0], 4]], np.int32)
    w = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=f"expert id {Wg.shape[0]} out of range"):
        cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids, w, h)
    with pytest.raises(ValueError, match="must be .n_tokens, k."):
        cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids[:1], w[:1], h)
    with pytest.raises(ValueError, match="must be .n_tokens, k."):
        cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids, w[:, :2], h)
    with pytest.raises(ValueError, match="act must be"):
        cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids % Wg.shape[0], w, h, act=7)
    with pytest.raises(ValueError, match="must be integers"):
        cpu.moe_ffn_routed(Wg, Wu, Wd, tt, (ids % Wg.shape[0]).astype(np.float32), w, h)
    big = ids.astype(np.int64)
    big[1, 1] = 2**32 + 1
    with pytest.raises(ValueError, match="out of range"):  # not wrapped to expert 1 by the cast to int32
        cpu.moe_ffn_routed(Wg, Wu, Wd, tt, big, w, h)


def test_moe_ffn_routed_act_q8_non_finite_inputs(rng):
    """With 8-bit activations (integer dots, fastmath kernels compiled in the process): a NaN in h
    makes its token's outputs NaN and leaves the other token's alone; an infinite scale in one
    down row of an expert makes only that output of the tokens routed to it NaN."""
    from test_act_q8 import rule

    (Wg, Wu, Wd, tt), refs, h, _, _ = _layer(("Q4_K",) * 3, 2, 256, rng, n_expert=4)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    w = np.full((2, 2), 0.5, np.float32)
    cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids, w, h, act_q8=True)  # the kernel compiled first
    hb = h.copy()
    hb[1, 40] = np.nan
    out = cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids, w, hb, act_q8=True)
    assert np.isnan(out[1]).all()
    eids, offs = np.array([0, 1], np.int32), np.array([0, 1, 2], np.int32)
    ref = _reference(*refs, eids, offs, np.array([0, 0], np.int32), np.array([0.5, 0.5], np.float32), h,
                     cpu.ACT_SILU, rounded=rule)
    assert np.linalg.norm(out[0] - ref[0]) / np.linalg.norm(ref[0]) < 5e-3
    Wd2 = Wd.copy()
    Wd2[2, 17, 0:2] = (0x00, 0x7C)  # expert 2's down row 17: block scale d = +inf
    out = cpu.moe_ffn_routed(Wg, Wu, Wd2, tt, ids, w, h, act_q8=True)
    assert np.isnan(out[1, 17]) and np.isfinite(np.delete(out[1], 17)).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("types,n_tok,act", [
    (("Q4_K", "Q4_K", "Q4_K"), 1, cpu.ACT_SILU),  # integer dots in every matrix
    (("Q4_K", "Q4_K", "Q4_K"), 6, cpu.ACT_GELU),  # experts shared by several tokens
    (("Q4_K", "Q4_K", "Q6_K"), 1, cpu.ACT_SILU),  # a Q4_K_M file's down matrices: Q6_K's integer dot
    (("Q8_0", "Q8_0", "Q4_K"), 4, cpu.ACT_SILU),  # Q8_0's integer dot (blocks two at a time)
    (("Q5_K", "Q5_K", "Q8_0"), 3, cpu.ACT_GELU),  # Q5_K's integer dot; down: the float kernel
    (("Q5_K", "Q5_K", "Q5_K"), 1, cpu.ACT_SILU),  # a Q5_K_M file's experts
    (("Q8_0", "Q8_0", "Q8_0"), 2, cpu.ACT_SILU),  # a Q8_0 file's experts
    (("Q4_0", "Q4_0", "Q5_0"), 2, cpu.ACT_SILU),  # no integer dot at all
])
def test_moe_ffn_act_q8_matches_reference(types, n_tok, act, rng):
    """``act_q8``: h and the gated activations rounded by the GPU's rule (test_act_q8's ``rule``),
    gguf-py's weights in float64, within ``ACT_Q8_RTOL`` plus the ties' bound (``_reference``).
    The unrounded reference must lie outside that tolerance, so a kernel that skipped the rounding
    would fail (a fixed 1e-3 here failed one seed in 200: the rounding moved one-token Q4_K and
    Q5_K layers by as little as 4.4e-4)."""
    from test_act_q8 import rule

    (Wg, Wu, Wd, tt), refs, h, groups, base = _layer(types, n_tok, 256, rng)
    out = base.copy()
    cpu.moe_ffn(Wg, Wu, Wd, tt, *groups, h, out=out, act=act, act_q8=True)
    ties = [0.0]
    delta = _reference(*refs, *groups, h, act, rounded=rule, ties=ties)
    diff = np.linalg.norm(out.astype(np.float64) - base - delta)
    tol = ACT_Q8_RTOL * np.linalg.norm(delta) + ties[0]
    assert np.all(np.isfinite(out)) and diff < tol
    plain = _reference(*refs, *groups, h, act)
    assert np.linalg.norm(plain - delta) > tol  # the rounding is seen


def test_moe_ffn_act_q8_q8_0_rows_of_an_odd_block_count(rng):
    """Q8_0's integer dot takes a row's blocks two at a time: down rows of 3 blocks (n_ff 96) take
    the float kernel on the rounded values, gate/up rows of 8 blocks the integer dot; both against
    the rounding rule's reference."""
    from test_act_q8 import rule

    (Wg, Wu, Wd, tt), refs, h, groups, base = _layer(("Q8_0",) * 3, 2, 96, rng)
    out = base.copy()
    cpu.moe_ffn(Wg, Wu, Wd, tt, *groups, h, out=out, act=cpu.ACT_SILU, act_q8=True)
    ties = [0.0]
    delta = _reference(*refs, *groups, h, cpu.ACT_SILU, rounded=rule, ties=ties)
    diff = np.linalg.norm(out.astype(np.float64) - base - delta)
    assert np.all(np.isfinite(out)) and diff < ACT_Q8_RTOL * np.linalg.norm(delta) + ties[0]


def test_moe_ffn_act_q8_row_with_an_infinite_scale(rng):
    """A Q4_K gate row whose block scale d is +inf: the token routed to that expert gets NaN outputs
    (the kernels run with fastmath: the flag comes from the integer dot's bits), the other the
    reference's."""
    from test_act_q8 import rule

    (Wg, Wu, Wd, tt), refs, h, _, _ = _layer(("Q4_K",) * 3, 2, 256, rng, n_expert=4)
    Wg = Wg.copy()
    Wg[2, 5, 0:2] = (0x00, 0x7C)  # f16 +inf, little-endian
    eids, offs = np.array([1, 2], np.int32), np.array([0, 1, 2], np.int32)
    rows, wts = np.array([0, 1], np.int32), np.array([0.5, 0.5], np.float32)
    out = cpu.moe_ffn(Wg, Wu, Wd, tt, eids, offs, rows, wts, h, act_q8=True)
    assert np.isnan(out[1]).all()
    ref = _reference(*refs, eids[:1], offs[:2], rows[:1], wts[:1], h, cpu.ACT_SILU, rounded=rule)
    assert np.linalg.norm(out[0] - ref[0]) / np.linalg.norm(ref[0]) < 5e-4


def test_moe_ffn_empty_and_bad_csr(rng):
    Wg, tg, _ = _experts("Q8_0", 4, 32, 64, rng)
    Wd, td, _ = _experts("Q8_0", 4, 64, 32, rng)
    h = rng.standard_normal((2, 64)).astype(np.float32)
    out = cpu.moe_ffn(Wg, Wg, Wd, (tg, tg, td), np.zeros(0, np.int32), np.zeros(1, np.int32),
                      np.zeros(0, np.int32), np.zeros(0, np.float32), h)
    assert np.array_equal(out, np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="CSR"):
        cpu.moe_ffn(Wg, Wg, Wd, (tg, tg, td), np.array([1], np.int32), np.array([0, 2], np.int32),
                    np.array([0], np.int32), np.array([1.0], np.float32), h)
    with pytest.raises(ValueError, match="out must be"):
        cpu.moe_ffn(Wg, Wg, Wd, (tg, tg, td), np.array([1], np.int32), np.array([0, 1], np.int32),
                    np.array([0], np.int32), np.array([1.0], np.float32), h, out=np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="act"):
        cpu.moe_ffn(Wg, Wg, Wd, (tg, tg, td), np.array([1], np.int32), np.array([0, 1], np.int32),
                    np.array([0], np.int32), np.array([1.0], np.float32), h, act=7)
    with pytest.raises(ValueError, match="expert id"):
        cpu.moe_ffn(Wg, Wg, Wd, (tg, tg, td), np.array([7], np.int32), np.array([0, 1], np.int32),
                    np.array([0], np.int32), np.array([1.0], np.float32), h)


def test_expert_runs_cover_the_used_experts(rng):
    """upload_experts copies pinned experts one DMA per run of consecutive ids: for random used sets
    the runs, copied in order, rebuild ``w[used]`` exactly (and a full set is one run)."""
    from moecache.backends.ops import expert_runs

    w = rng.integers(0, 255, (128, 3, 5), dtype=np.uint8)
    for _ in range(50):
        used = np.flatnonzero(rng.random(128) < rng.random())
        runs = expert_runs(used)
        out = np.zeros((used.size, 3, 5), np.uint8)
        for at, first, length in runs:
            out[at:at + length] = w[first:first + length]
        np.testing.assert_array_equal(out, w[used])
        assert all(b[1] > a[1] + a[2] for a, b in zip(runs, runs[1:]))  # runs are maximal
    assert expert_runs(np.arange(128)) == [(0, 0, 128)] and expert_runs(np.array([], np.int64)) == []


def test_moe_prompt_chunks_bound_padding_and_cover_every_expert(rng):
    """The prompt MoE's chunks (CuPy batched GEMMs padded to a chunk's largest group): every used
    expert exactly once, hottest first, at most max_experts per chunk and act_bytes of padded rows
    (unless one expert alone is larger); a chunk's padded rows under ``ratio`` times its real ones
    (twice that with ``pow2``, whose padded rows are the least power of two at least the largest
    count); under a skewed router the padded rows stay near the real ones, where chunks in id order
    padded every expert to the hottest one's count."""
    from moecache.backends.ops import moe_prompt_chunks

    row = 8192
    for trial in range(60):
        n_used = int(rng.integers(1, 129))
        counts = np.maximum(1, (rng.pareto(1.0 + trial % 3, n_used) * 20).astype(np.int64))
        act = int(rng.integers(1, 64)) << 20
        max_experts = int(rng.integers(1, 41))
        ratio, pow2 = (2, False) if trial < 30 else (int(rng.choice([1, 2, 3, 4, 8])), bool(trial % 2))
        chunks = moe_prompt_chunks(counts, max_experts, row, act, ratio=ratio, pow2=pow2)
        flat = np.concatenate(chunks)
        assert sorted(flat.tolist()) == list(range(n_used))
        assert (np.diff(counts[flat]) <= 0).all()

        def m_of(ch):
            big = int(counts[ch].max())
            m = 1 << (big - 1).bit_length() if pow2 else big
            assert big <= m < 2 * big or (m == big == 1)
            return m
        for ch in chunks:
            padded = len(ch) * m_of(ch) * row
            assert len(ch) <= max_experts and (padded <= act or len(ch) == 1)
            assert len(ch) * m_of(ch) <= (2 if pow2 else 1) * ratio * counts[ch].sum()  # the padding's bound
            assert ratio * counts[ch].min() >= counts[ch].max()
        for ch, nxt in zip(chunks, chunks[1:]):  # a chunk stops only at a bound
            assert len(ch) == max_experts or ratio * counts[nxt[0]] < counts[ch[0]] or \
                (len(ch) + 1) * m_of(ch) * row > act
    with pytest.raises(ValueError, match="ratio"):
        moe_prompt_chunks(np.array([3, 1]), 4, row, 1 << 20, ratio=0)
    counts = np.array([3] * 60 + [500] + [3] * 67)  # one hot expert: in id order, 40 experts padded to 500 rows
    chunks = moe_prompt_chunks(counts, 40, row, 64 << 20)
    assert [len(ch) for ch in chunks] == [1, 40, 40, 40, 7] and chunks[0].tolist() == [60]
    assert sum(len(ch) * int(counts[ch].max()) for ch in chunks) == counts.sum()  # no padding at all
    # padded to m_align rows (a largest count <= 16), a chunk takes every expert left: each pads to 16
    # rows in any chunk; above that the ratio splits (40 and 33 pad to 48 rows, 20 to 32)
    counts = np.array([16, 1, 9, 40, 8, 3, 7, 33, 1, 20])
    got = [counts[ch].tolist() for ch in moe_prompt_chunks(counts, 40, row, 64 << 20, m_align=16)]
    assert got == [[40, 33, 20], [16, 9, 8, 7, 3, 1, 1]]
    got = [counts[ch].tolist() for ch in moe_prompt_chunks(counts, 4, row, 64 << 20, m_align=16)]
    assert got == [[40, 33, 20], [16, 9, 8, 7], [3, 1, 1]]  # max_experts still bounds them
    assert [counts[ch].tolist() for ch in moe_prompt_chunks(counts, 40, row, 64 << 20)] == \
        [[40, 33, 20], [16, 9, 8], [7], [3], [1, 1]]  # m_align 1: the ratio alone


def _prompt_moe_case(rng, skew, t, k, n_exp, d_in, d_out):
    """Routing ids (t, k) drawn with expert popularity ~ exp(skew * N(0, 1)), weights, float64 rows h,
    a random matrix per expert, and the direct sum over each token's routed experts."""
    popular = skew * rng.standard_normal(n_exp)
    ids = np.stack([rng.choice(n_exp, k, replace=False, p=np.exp(popular) / np.exp(popular).sum())
                    for _ in range(t)]).astype(np.int32)
    w = rng.dirichlet(np.ones(k), t)
    h = rng.standard_normal((t, d_in))
    mats = rng.standard_normal((n_exp, d_out, d_in))
    ref = np.stack([sum(w[i, s] * mats[ids[i, s]] @ h[i] for s in range(k)) for i in range(t)])
    return ids, w, h, mats, ref


def _run_plan(plan, h, mats):
    """A prompt-MoE plan executed with numpy stand-ins for the GEMMs (a matrix per expert): the
    chunks' padded outputs stacked in order, and the expert ids the chunks read."""
    e_at = r_at = 0
    outs = []
    for n_c, m in plan.chunks:
        e = plan.expert_ids[e_at:e_at + n_c]
        x = h[plan.token_rows[r_at:r_at + n_c * m]].reshape(n_c, m, h.shape[1])
        outs.append(np.einsum("cmi,coi->cmo", x, mats[e]).reshape(n_c * m, mats.shape[1]))
        e_at, r_at = e_at + n_c, r_at + n_c * m
    return np.concatenate(outs), e_at


@pytest.mark.parametrize("skew,m_align,ratio,pow2", [(0.0, 1, 2, False), (3.0, 1, 2, False), (0.0, 16, 2, False),
                                                     (3.0, 16, 2, False), (3.0, 16, 4, False), (3.0, 16, 2, True),
                                                     (0.0, 1, 8, True)])
def test_moe_prompt_plan_executed_in_numpy_gives_every_pairs_sum(rng, skew, m_align, ratio, pow2):
    """The GPU's prompt-MoE plan (moe_prompt_plan: chunks, each chunk's experts and padded token
    rows, each pair's output row) run with numpy stand-ins for the GEMMs (a random matrix per
    expert; the chunks' padded outputs stacked; each token's k rows summed with its weights) equals
    the direct sum over each token's routed experts; the padded rows stay under ``ratio`` times the
    real ones (plus the rounding to ``m_align`` rows per expert, the GPU's MOE_PROMPT_M_ALIGN; twice
    all that with ``pow2``, whose padded rows per expert are a power of two)."""
    from moecache.backends.ops import moe_prompt_plan

    t, k, n_exp, d_in, d_out = 300, 4, 32, 24, 16
    ids, w, h, mats, ref = _prompt_moe_case(rng, skew, t, k, n_exp, d_in, d_out)
    act = 40 * 4 * d_in  # <= 40 padded rows a chunk, unless one expert's alone are more
    plan = moe_prompt_plan(ids, n_exp, 7, 4 * d_in, act, m_align, ratio=ratio, pow2=pow2)  # <= 7 experts
    assert len(plan.chunks) > 2
    assert all(m % m_align == 0 and (n_c * m * 4 * d_in <= act or n_c == 1) for n_c, m in plan.chunks)
    assert not pow2 or all(m & (m - 1) == 0 for _, m in plan.chunks)
    y, e_at = _run_plan(plan, h, mats)
    n_used = np.unique(ids).size
    f = 2 if pow2 else 1
    assert y.shape[0] == plan.n_rows <= f * (ratio * t * k + (m_align - 1) * n_used)
    assert e_at == plan.expert_ids.size == n_used
    got = (w.reshape(-1, 1) * y[plan.row_of_pair]).reshape(t, k, d_out).sum(1)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_moe_prompt_plan_leaves_out_pairs_of_no_expert(rng):
    """A routing with pairs of id -1 (no expert: the expert cache's prompt groups mark the pairs of
    other groups so) plans only the others: those pairs get no row (row_of_pair -1), and the plan
    executed as above, each token's remaining pairs summed, equals the direct sum over them."""
    from moecache.backends.ops import moe_prompt_plan

    t, k, n_exp, d_in, d_out = 200, 4, 32, 24, 16
    ids, w, h, mats, _ = _prompt_moe_case(rng, 2.0, t, k, n_exp, d_in, d_out)
    ids = np.where(rng.random(ids.shape) < 0.6, -1, ids).astype(np.int32)
    ids[0] = -1  # a token of no expert at all
    ref = np.stack([sum((w[i, s] * mats[ids[i, s]] @ h[i] for s in range(k) if ids[i, s] >= 0), np.zeros(d_out))
                    for i in range(t)])
    plan = moe_prompt_plan(ids, n_exp, 7, 4 * d_in, 40 * 4 * d_in, 16)
    valid = ids.reshape(-1) >= 0
    assert (plan.row_of_pair[~valid] == -1).all() and (plan.row_of_pair[valid] >= 0).all()
    assert np.array_equal(plan.expert_ids[np.argsort(plan.expert_ids)], np.unique(ids[ids >= 0]))
    y, e_at = _run_plan(plan, h, mats)
    assert set(plan.token_rows.tolist()) <= set(np.flatnonzero((ids >= 0).any(axis=1)).tolist())
    got = np.zeros((t, d_out))
    for p in np.flatnonzero(valid):
        got[p // k] += w.reshape(-1)[p] * y[plan.row_of_pair[p]]
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    none = moe_prompt_plan(np.full((3, k), -1, np.int32), n_exp, 7, 4 * d_in, 40 * 4 * d_in)
    assert not none.chunks and (none.row_of_pair == -1).all()


def _numpy_plan(ids, n_expert, max_experts, row_bytes, act_bytes, m_align, ratio=2, pow2=False):
    """The prompt-MoE plan's rules written with numpy sorts and masks (the implementation before the
    compiled one, kept as its reference): (chunks, expert_ids, token_rows, row_of_pair)."""
    from moecache.backends.ops import moe_prompt_chunks

    t, k = ids.shape
    flat = ids.reshape(-1)
    sel = np.flatnonzero(flat >= 0)
    order = sel[np.argsort(flat[sel], kind="stable")]
    per_expert = np.bincount(flat[sel], minlength=n_expert)
    eids = np.flatnonzero(per_expert)
    counts = per_expert[eids]
    offs = np.concatenate([[0], np.cumsum(counts)])
    chunks, e_parts, r_parts, n_rows = [], [], [], 0
    row_of_pair = np.full(t * k, -1, np.int32)
    for ch in moe_prompt_chunks(counts, max_experts, row_bytes, act_bytes, m_align, ratio=ratio, pow2=pow2):
        c = counts[ch]
        n_c, m = len(ch), -(-int(c.max()) // m_align) * m_align
        while pow2 and m & (m - 1):  # the least power of two at least that
            m += 1
        slot = np.arange(m)[None, :]
        valid = slot < c[:, None]
        pairs = order[np.where(valid, offs[ch, None] + slot, offs[ch, None])]
        row_of_pair[pairs[valid]] = n_rows + np.flatnonzero(valid.reshape(-1))
        e_parts.append(eids[ch])
        r_parts.append((pairs // k).reshape(-1))
        chunks.append((n_c, m))
        n_rows += n_c * m
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    return chunks, cat(e_parts), cat(r_parts), row_of_pair


def test_compiled_moe_prompt_plan_equals_the_numpy_rules(rng):
    """moe_prompt_plan (compiled, moecache.backends.moe_plan) equals the numpy version of its rules
    element for element, over random routings: skewed and flat, with pairs of no expert, tight and
    loose chunk bounds, m_align 1 and 16, chunk ratios 1-8 and padded rows rounded to powers of two
    or not, an expert twice in a token's row, no pair with an expert at all; and layer_plan's one
    index buffer holds the same expert
    ids and token rows, then each kept pair's row token by token and each token's first pair."""
    from moecache.backends.moe_plan import layer_plan
    from moecache.backends.ops import moe_prompt_chunks, moe_prompt_plan

    for trial in range(40):
        t, k, n_exp = int(rng.integers(1, 300)), int(rng.integers(1, 9)), int(rng.integers(8, 129))
        k = min(k, n_exp)
        popular = float(rng.choice([0.0, 1.0, 3.0])) * rng.standard_normal(n_exp)
        p = np.exp(popular) / np.exp(popular).sum()
        ids = np.stack([rng.choice(n_exp, k, replace=trial % 5 == 1, p=p) for _ in range(t)]).astype(np.int32)
        if trial % 3 == 0:  # pairs of no expert; every fourth such routing has none with an expert
            ids = np.where(rng.random(ids.shape) < (1.0 if trial % 4 == 0 else 0.5), -1, ids).astype(np.int32)
        max_experts, m_align = int(rng.integers(1, 50)), int(rng.choice([1, 16]))
        row_bytes, act_bytes = int(rng.integers(1, 64)) * 4, int(rng.integers(1, 4000)) * 4
        ratio, pow2 = (2, False) if trial % 2 else (int(rng.choice([1, 3, 4, 8])), bool(rng.integers(2)))
        want = _numpy_plan(ids, n_exp, max_experts, row_bytes, act_bytes, m_align, ratio, pow2)
        got = moe_prompt_plan(ids, n_exp, max_experts, row_bytes, act_bytes, m_align, ratio=ratio, pow2=pow2)
        assert got.chunks == want[0], trial
        for a, b in zip((got.expert_ids, got.token_rows, got.row_of_pair), want[1:]):
            np.testing.assert_array_equal(a, b)
        chunks, idx, n_e, n_r, n_p = layer_plan(ids, n_exp, max_experts, row_bytes, act_bytes, m_align, ratio, pow2)
        assert [tuple(c) for c in chunks.tolist()] == want[0] and idx.dtype == np.int32
        np.testing.assert_array_equal(idx[:n_e], want[1])
        np.testing.assert_array_equal(idx[n_e:n_e + n_r], want[2])
        keep = ids >= 0
        np.testing.assert_array_equal(idx[n_e + n_r:n_e + n_r + n_p], want[3][keep.reshape(-1)])
        np.testing.assert_array_equal(idx[n_e + n_r + n_p:], np.concatenate([[0], np.cumsum(keep.sum(1))]))
    with pytest.raises(ValueError, match="out of range"):
        moe_prompt_plan(np.array([[0, 9]], np.int32), 8, 4, 4, 64)
    with pytest.raises(ValueError, match="out of range"):  # not wrapped by the cast to int32
        moe_prompt_plan(np.array([[2**32 + 1, 0]], np.int64), 4, 2, 4, 64)
    with pytest.raises(ValueError, match="integers"):
        moe_prompt_plan(np.array([[0.5, 1.0]]), 4, 2, 4, 64)
    with pytest.raises(ValueError, match="ratio"):
        moe_prompt_plan(np.array([[0, 1]], np.int32), 4, 2, 4, 64, ratio=0)
    for bad in (1.5, True):  # the compiled plan and its numpy twin would treat a fraction apart
        with pytest.raises(ValueError, match="ratio"):
            moe_prompt_plan(np.array([[0, 1]], np.int32), 4, 2, 4, 64, ratio=bad)
        with pytest.raises(ValueError, match="ratio"):
            moe_prompt_chunks(np.array([3, 2, 1]), 4, 4, 64, ratio=bad)


@pytest.mark.parametrize("n_tok,act_q8", [(5, False), (5, True), (40, False), (40, True)])
def test_numpy_moe_ffn_skips_pairs_of_no_expert(rng, n_tok, act_q8):
    """NumpyBackend.moe_ffn (the GPU's twin) with some pairs of id -1 gives the float64 sum over the
    others (the reference above), in both arithmetics (act_q8: its 8-bit and float16 roundings,
    ~1e-2 of the output)."""
    from moecache.backends import NumpyBackend
    from moecache.moe.routing import Routing

    n_expert, n_embd, n_ff, top_k = 8, 256, 256, 3
    Wg, tg, Rg = _experts("Q4_K", n_expert, n_ff, n_embd, rng)
    Wu, tu, Ru = _experts("Q4_K", n_expert, n_ff, n_embd, rng)
    Wd, td, Rd = _experts("Q6_K", n_expert, n_embd, n_ff, rng)
    h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    w = rng.dirichlet(np.ones(top_k), n_tok).astype(np.float32)
    ids[rng.random(ids.shape) < 0.5] = -1
    ids[1] = -1
    got = NumpyBackend(act_q8=act_q8).moe_ffn(Wg, Wu, Wd, (tg, tu, td), Routing(ids, w), h, "silu")
    sel = [(int(ids[t, s]), t, float(w[t, s])) for t in range(n_tok) for s in range(top_k) if ids[t, s] >= 0]
    sel.sort()
    eids = np.array(sorted({e for e, _, _ in sel}), np.int32)
    offs = np.concatenate([[0], np.cumsum([sum(1 for e2, _, _ in sel if e2 == e) for e in eids])])
    ref = _reference(Rg, Ru, Rd, eids, offs, np.array([r for _, r, _ in sel]), np.array([x for _, _, x in sel]),
                     h, cpu.ACT_SILU)
    assert np.all(got[1] == 0)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < (2e-2 if act_q8 else 1e-5), f"{err:.2e}"


def test_host_experts_compute_host_adds_the_layer_to_out(rng):
    """CPUExperts.compute_host (what a cut CUDA-graph decode step runs between segments, on host
    arrays) adds the routed experts' sum to ``out``: against the float64 reference above."""
    from moecache.moe.executor import CPUExperts, ExpertWeights
    from moecache.moe.routing import Routing

    n_expert, n_embd, n_ff, top_k = 8, 256, 256, 2
    Wg, tg, Rg = _experts("Q4_K", n_expert, n_ff, n_embd, rng)
    Wu, tu, Ru = _experts("Q4_K", n_expert, n_ff, n_embd, rng)
    Wd, td, Rd = _experts("Q6_K", n_expert, n_embd, n_ff, rng)
    ex = CPUExperts({3: ExpertWeights(Wg, Wu, Wd, (tg, tu, td))})
    h = rng.standard_normal((1, n_embd)).astype(np.float32)
    ids = np.array([[5, 1]], np.int32)
    w = np.array([[0.7, 0.3]], np.float32)
    base = rng.standard_normal((1, n_embd)).astype(np.float32)
    out = base.copy()
    got = ex.compute_host(3, h, Routing(ids, w), out)
    assert got is out
    ref = base + _reference(Rg, Ru, Rd, np.array([1, 5]), np.array([0, 1, 2]), np.array([0, 0]),
                            np.array([0.3, 0.7]), h, cpu.ACT_SILU)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref - base) < 1e-5


@pytest.mark.parametrize("skew,max_tok", [(0.0, 16), (3.0, 16), (0.0, 1), (3.0, 5)])
def test_moe_prompt_groups_executed_in_numpy_give_every_pairs_sum(rng, skew, max_tok):
    """The grouped 8-bit prompt MoE's plan (moe_prompt_groups: pairs sorted by expert, groups of at
    most max_tok rows of one expert) run with numpy stand-ins for the kernels (each group's rows
    times its expert's matrix, written at its rows; each token's k rows summed with its weights via
    row_of_pair) equals the direct sum over each token's routed experts; every pair is in exactly one
    group, groups never mix experts and never exceed max_tok rows."""
    from moecache.backends.ops import moe_prompt_groups

    t, k, n_exp, d_in, d_out = 300, 4, 32, 24, 16
    ids, w, h, mats, ref = _prompt_moe_case(rng, skew, t, k, n_exp, d_in, d_out)
    pg = moe_prompt_groups(ids, n_exp, max_tok)
    assert pg.groups.dtype == pg.token_of_row.dtype == pg.row_of_pair.dtype == np.int32
    e, first, n = pg.groups.T
    assert (n >= 1).all() and (n <= max_tok).all() and n.sum() == t * k
    assert (first == np.concatenate([[0], np.cumsum(n)[:-1]])).all()  # the groups tile the rows in order
    assert sorted(pg.row_of_pair.tolist()) == list(range(t * k))
    pair_of_row = np.argsort(pg.row_of_pair)
    expert_of_row = np.repeat(e, n)
    assert (ids.reshape(-1)[pair_of_row] == expert_of_row).all() and (pair_of_row // k == pg.token_of_row).all()
    y = np.full((t * k, d_out), np.nan)
    for ex, f, m in pg.groups:
        y[f:f + m] = h[pg.token_of_row[f:f + m]] @ mats[ex].T
    got = (w.reshape(-1, 1) * y[pg.row_of_pair]).reshape(t, k, d_out).sum(1)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="expert ids"):
        moe_prompt_groups(ids, 3, max_tok)
    with pytest.raises(ValueError, match="max_tok"):
        moe_prompt_groups(ids, n_exp, 0)


@pytest.mark.parametrize("act_q8,act", [(False, cpu.ACT_SILU), (True, cpu.ACT_SILU), (True, cpu.ACT_GELU)])
def test_routed_experts_prepared_call_matches_reference(act_q8, act, rng):
    """``cpu.RoutedExperts`` (a layer's weights checked once, the kernel called straight away): within
    the float64 reference's tolerance and bit-equal to ``moe_ffn_routed``, on its fast road (int32 /
    float32 C-contiguous arrays) and on the full call's road (int64 ids, a strided h), which converts."""
    from test_act_q8 import rule

    types = ("Q4_K", "Q4_K", "Q6_K")
    n_tok = 5
    (Wg, Wu, Wd, tt), refs, h, _, base = _layer(types, n_tok, 256, rng)
    n_expert, top_k = Wg.shape[0], 3
    ids = np.stack([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[1, :] = -1  # a token without a pair for the CPU
    w = rng.random((n_tok, top_k)).astype(np.float32)
    call = cpu.RoutedExperts(Wg, Wu, Wd, tt, act, act_q8)
    out = base.copy()
    assert call(ids, w, h, out) is out
    want = cpu.moe_ffn_routed(Wg, Wu, Wd, tt, ids, w, h, out=base.copy(), act=act, act_q8=act_q8)
    assert np.array_equal(out, want)
    keep = sorted((int(ids[t, j]), t, float(w[t, j])) for t in range(n_tok) for j in range(top_k) if ids[t, j] >= 0)
    eids = np.array(sorted({p[0] for p in keep}), np.int32)
    offs = np.concatenate([[0], np.cumsum([sum(p[0] == e for p in keep) for e in eids])]).astype(np.int32)
    delta = _reference(*refs, eids, offs, np.array([p[1] for p in keep], np.int32),
                       np.array([p[2] for p in keep], np.float32), h, act, rounded=rule if act_q8 else None)
    err = np.linalg.norm(out.astype(np.float64) - base - delta) / np.linalg.norm(delta)
    assert err < (5e-3 if act_q8 else 1e-5)
    wide = np.zeros((n_tok, 2 * h.shape[1]), np.float32)
    wide[:, ::2] = h  # a strided view: the full call's road
    out2 = call(ids.astype(np.int64), w, wide[:, ::2], base.copy())
    assert np.array_equal(out2, want)


def test_routed_experts_prepared_call_rejects_what_the_full_call_rejects(rng):
    (Wg, Wu, Wd, tt), _, h, _, _ = _layer(("Q4_K", "Q4_K", "Q4_K"), 2, 256, rng)
    call = cpu.RoutedExperts(Wg, Wu, Wd, tt)
    w = np.ones((2, 3), np.float32)
    out = np.zeros_like(h)
    with pytest.raises(ValueError, match=f"expert id {Wg.shape[0]} out of range"):  # on the fast road
        call(np.array([[0, 1, 2], [3, Wg.shape[0], 4]], np.int32), w, h, out)
    with pytest.raises(ValueError, match="must be .n_tokens, k."):
        call(np.zeros((1, 3), np.int32), w[:1], h, out)
    with pytest.raises(ValueError, match="h must be"):
        call(np.zeros((2, 3), np.int32), w, h[:, :32], out[:, :32])
    with pytest.raises(ValueError, match="act must be"):
        cpu.RoutedExperts(Wg, Wu, Wd, tt, act=7)
    with pytest.raises(ValueError, match="expert tensor shapes disagree"):
        cpu.RoutedExperts(Wg, Wu[:1], Wd, tt)


def test_routed_calls_are_made_again_for_new_weights_or_rounding(rng):
    from moecache.moe.executor import ExpertWeights, RoutedCalls

    (Wg, Wu, Wd, tt), _, _, _, _ = _layer(("Q4_K", "Q4_K", "Q4_K"), 1, 256, rng)
    calls = RoutedCalls()
    e = ExpertWeights(Wg, Wu, Wd, tt, "gelu")
    a = calls.get(3, e, False)
    assert calls.get(3, e, False) is a and a.act == cpu.ACT_GELU and not a.act_q8
    assert calls.get(3, e, True).act_q8
    e2 = ExpertWeights(Wg.copy(), Wu, Wd, tt)
    b = calls.get(3, e2, True)
    assert np.shares_memory(b.gate, e2.gate) and b.act == cpu.ACT_SILU


def test_routed_experts_fast_road_skips_the_full_call_and_other_arrays_take_it(rng, monkeypatch):
    """The handoff's arrays (row slices of its page-locked buffers: int32 ids, float32 h and out) take
    the fast road, which never calls ``moe_ffn_routed``; int64 ids or a read-only ``out`` take the
    full call."""
    from moecache.moe.handoff import HandoffBuffers

    (Wg, Wu, Wd, tt), _, _, _, _ = _layer(("Q4_K", "Q4_K", "Q4_K"), 1, 256, rng)
    call = cpu.RoutedExperts(Wg, Wu, Wd, tt)
    full: list[int] = []
    real = cpu.moe_ffn_routed
    monkeypatch.setattr(cpu, "moe_ffn_routed", lambda *a, **k: (full.append(1), real(*a, **k))[1])
    buf = HandoffBuffers.allocate(4, 8, Wd.shape[1], 3)
    t = 5
    buf.h[:t] = rng.standard_normal((t, Wd.shape[1])).astype(np.float32)
    buf.ids[:t] = rng.integers(-1, Wg.shape[0], (t, 3)).astype(np.int32)
    buf.w[:t] = rng.random((t, 3)).astype(np.float32)
    out = buf.out[:t]
    out[...] = 0.0
    call(buf.ids[:t], buf.w[:t], buf.h[:t], out)
    assert full == []
    want = real(Wg, Wu, Wd, tt, buf.ids[:t], buf.w[:t], buf.h[:t])
    assert np.array_equal(out, want)
    call(buf.ids[:t].astype(np.int64), buf.w[:t], buf.h[:t], np.zeros_like(want))
    assert full == [1]
    frozen = np.zeros_like(want)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):  # the full call's own error
        call(buf.ids[:t], buf.w[:t], buf.h[:t], frozen)
    assert full == [1, 1]
