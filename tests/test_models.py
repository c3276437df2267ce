"""Model forward passes against independent implementations and llama.cpp's recorded outputs.

- code-moe-tiny (a real trained qwen3moe): logits and routing against the float64 numpy reference
  (:mod:`moecache.testing.reference`, written separately from the model code).
- gemma3-270m and code-moe-tiny: greedy tokens against llama.cpp b11434 (tests/data/llamacpp/greedy.json).
- KV cache: prefill in one pass = prefill in pieces = token-by-token decode; a full context stops cleanly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moecache.backends import NumpyBackend
from moecache.gguf_file import open_gguf
from moecache.kv_cache import ContextFullError
from moecache.models import build_model
from moecache.testing import reference

DATA = Path(__file__).parent / "data" / "llamacpp"
# Two candidates closer than this (in logits) are a near-tie: llama.cpp quantizes activations to 8
# bits inside its matmuls, we do not, so such a pair may rank either way.
NEAR_TIE = 0.05


def _greedy_runs(model_name: str) -> list[dict]:
    runs = json.loads((DATA / "greedy.json").read_text())["runs"]
    return [r for r in runs if r["model"] == model_name]


@pytest.fixture(scope="module")
def tiny_lm(code_moe_tiny):
    m = open_gguf(code_moe_tiny)
    yield build_model(m, NumpyBackend())
    m.close()


@pytest.fixture(scope="module")
def gemma_lm(gemma3_270m):
    m = open_gguf(gemma3_270m)
    yield build_model(m, NumpyBackend())
    m.close()


def test_code_moe_tiny_logits_and_routing_match_float64_reference(tiny_lm, code_moe_tiny):
    tokens = np.array([0, 474, 2465, 198, 474, 25, 99, 100, 7, 8, 9, 4000, 17, 3], dtype=np.int64)
    ref = reference.forward(code_moe_tiny, tokens)
    seen: dict[int, np.ndarray] = {}
    tiny_lm.route_observers.append(lambda il, r: seen.__setitem__(il, r.ids.copy()))
    try:
        kv = tiny_lm.new_kv_cache(64)
        logits = tiny_lm.forward(tokens, kv, logits="all")
    finally:
        tiny_lm.route_observers.clear()
    rel = np.abs(logits - ref.logits).max() / np.abs(ref.logits).max()
    print(f"code-moe-tiny: max |logit - ref| / max |ref| = {rel:.2e}")
    assert rel < 1e-5
    for il in range(tiny_lm.cfg.n_layer):
        # same experts per token; the order inside the top-k may differ only on exact ties
        assert np.array_equal(np.sort(seen[il], axis=1), np.sort(ref.expert_ids[il], axis=1)), f"layer {il}"


def test_residual_sum_is_taken_by_the_next_blocks_norm(code_moe_tiny):
    """A block returns its residual sum untaken (models.base.Pending) and the next block's first
    RMSNorm takes it (one add_rms_norm: one launch on the GPU): 2 * n_layer - 1 sums-with-norm per
    forward pass, and the same logits as the float64 reference (which adds, then norms)."""
    class Counting(NumpyBackend):
        n_add_norm = 0

        def add_rms_norm(self, x, r, w, eps):
            Counting.n_add_norm += 1
            return super().add_rms_norm(x, r, w, eps)

    tokens = np.array([0, 474, 2465, 198, 474, 25], dtype=np.int64)
    with open_gguf(code_moe_tiny) as m:
        lm = build_model(m, Counting())
        logits = lm.forward(tokens, lm.new_kv_cache(16), logits="all")
    assert Counting.n_add_norm == 2 * lm.cfg.n_layer - 1
    ref = reference.forward(code_moe_tiny, tokens)
    assert np.abs(logits - ref.logits).max() / np.abs(ref.logits).max() < 1e-5


def test_prefill_in_pieces_and_decode_equal_one_pass(tiny_lm):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, tiny_lm.cfg.n_vocab, 40)
    full = tiny_lm.forward(tokens, tiny_lm.new_kv_cache(64), logits="all")
    kv = tiny_lm.new_kv_cache(64)
    parts = [tiny_lm.forward(tokens[:17], kv, logits="all"), tiny_lm.forward(tokens[17:30], kv, logits="all")]
    parts += [tiny_lm.forward(tokens[i:i + 1], kv) for i in range(30, 40)]
    got = np.vstack(parts)
    assert kv.n_past == 40
    assert np.abs(got - full).max() / np.abs(full).max() < 1e-5


def test_context_full_raises_before_touching_the_cache(tiny_lm):
    kv = tiny_lm.new_kv_cache(8)
    tiny_lm.forward(np.arange(1, 7), kv)
    before = [k.copy() for k in kv.k]
    with pytest.raises(ContextFullError, match="context full"):
        tiny_lm.forward(np.arange(1, 4), kv)
    assert kv.n_past == 6
    assert all(np.array_equal(a, b) for a, b in zip(before, kv.k))
    tiny_lm.forward(np.arange(1, 3), kv)  # exactly fills it
    assert kv.n_past == 8


def test_bad_tokens_are_rejected(tiny_lm):
    kv = tiny_lm.new_kv_cache(8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_lm.forward(np.array([1, tiny_lm.cfg.n_vocab]), kv)
    with pytest.raises(ValueError, match="no tokens"):
        tiny_lm.forward(np.array([], dtype=np.int64), kv)
    assert kv.n_past == 0


def _check_greedy(lm, run: dict) -> None:
    """llama.cpp's greedy tokens, teacher-forced: each must be our argmax, or a near-tie with it
    (gap printed); free-running greedy must reproduce them up to the first near-tie."""
    prompt, want = run["prompt_ids"], run["generated_ids_inferred"]
    assert len(want) == 16 and None not in want
    seq = np.array(prompt + want)
    n = len(prompt)
    logits = lm.forward(seq, lm.new_kv_cache(len(seq) + 1), logits=np.arange(n - 1, len(seq) - 1))
    first_tie = len(want)
    for i, row in enumerate(logits):
        top = int(np.argmax(row))
        gap = float(row[top] - row[want[i]])
        if top != want[i]:
            print(f"{run['prompt']!r} token {i}: llama.cpp {want[i]}, ours {top}, gap {gap:.4f} logits")
            assert gap < NEAR_TIE, f"token {i}: not a near-tie (gap {gap:.3f})"
            first_tie = min(first_tie, i)
    kv = lm.new_kv_cache(len(seq) + 1)
    row = lm.forward(np.array(prompt), kv)[0]
    got = []
    for _ in range(first_tie):
        got.append(int(np.argmax(row)))
        row = lm.forward(np.array(got[-1:]), kv)[0]
    assert got == want[:first_tie]


@pytest.mark.parametrize("i", [0, 1, 2, 3])
def test_gemma3_greedy_matches_llamacpp(gemma_lm, i):
    _check_greedy(gemma_lm, _greedy_runs("gemma-3-270m-q4_k_m.gguf")[i])


@pytest.mark.parametrize("i", [0, 1])
def test_code_moe_tiny_greedy_matches_llamacpp(tiny_lm, i):
    _check_greedy(tiny_lm, _greedy_runs("code-moe-tiny.gguf")[i])


def test_gemma3_sliding_window_layers(gemma_lm):
    # gemma3: 5 of every 6 layers slide over 512 tokens with RoPE base 10000; layers 5, 11, 17 are global
    swa = [il for il in range(gemma_lm.cfg.n_layer) if gemma_lm.window(il) is not None]
    assert [il for il in range(18) if il not in swa] == [5, 11, 17]
    assert gemma_lm.window(0) == 512
    assert gemma_lm.rope_spec(0).base == 10000.0 and gemma_lm.rope_spec(5).base == 1_000_000.0


def test_gemma3_query_scale_27b_rule(gemma_lm):
    import dataclasses

    from moecache.models.gemma3 import attention_scale

    c = gemma_lm.cfg
    assert attention_scale(c) == 1 / 16  # 270m: head_dim 256
    big = dataclasses.replace(c, n_layer=62, n_embd=5376, n_head=32, head_dim=128)  # gemma3 27B's shape
    assert attention_scale(big) == pytest.approx(1 / 168 ** 0.5)


def test_sliding_window_masks_old_positions():
    be = NumpyBackend()
    rng = np.random.default_rng(3)
    n, w = 12, 4
    k = rng.standard_normal((n, 1, 8)).astype(np.float32)
    v = rng.standard_normal((n, 1, 8)).astype(np.float32)
    q = rng.standard_normal((n, 2, 8)).astype(np.float32)
    out = be.attention(q, k, v, 0, 0.35, window=w)
    # brute force: query p sees keys j with p - w < j <= p
    for p in range(n):
        for h in range(2):
            js = [j for j in range(n) if p - w < j <= p]
            s = np.array([q[p, h] @ k[j, 0] * 0.35 for j in js])
            a = np.exp(s - s.max())
            a /= a.sum()
            ref = sum(a_i * v[j, 0] for a_i, j in zip(a, js))
            np.testing.assert_allclose(out[p, h * 8:(h + 1) * 8], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0)])
def test_prompt_attention_in_query_chunks(monkeypatch, window, softcap):
    """Prompt attention splits its queries so the float32 scores stay under ATTENTION_SCORE_BYTES:
    with a budget of a few queries per chunk, every query still matches a float64 brute force
    (grouped-query heads, a float16 cache, queries after earlier positions)."""
    from moecache.backends import ops

    rng = np.random.default_rng(11)
    n_ctx, pos0, t, n_head, n_kv, d = 40, 9, 23, 4, 2, 16
    k = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    q = rng.standard_normal((t, n_head, d)).astype(np.float32)
    monkeypatch.setattr(ops, "ATTENTION_SCORE_BYTES", 4 * n_head * (pos0 + t) * 3)  # 3 queries per chunk
    be = NumpyBackend()
    chunks = []
    inner = be._attention
    monkeypatch.setattr(be, "_attention", lambda q_, *a: chunks.append(q_.shape[0]) or inner(q_, *a))
    out = be.attention(q, k, v, pos0, 0.3, window, softcap)
    assert chunks == [3] * 7 + [2]
    kd, vd = k.astype(np.float64), v.astype(np.float64)
    for i in range(t):
        p = pos0 + i
        js = np.array([j for j in range(p + 1) if window is None or p - window < j])
        for h in range(n_head):
            s = kd[js, h // 2] @ q[i, h].astype(np.float64) * 0.3
            if softcap:
                s = softcap * np.tanh(s / softcap)
            a = np.exp(s - s.max())
            ref = (a / a.sum()) @ vd[js, h // 2]
            np.testing.assert_allclose(out[i, h * d:(h + 1) * d], ref, rtol=1e-4, atol=1e-5)


def test_prompt_attention_asks_for_few_block_sizes():
    """A prompt's attention spans grow with every ubatch; its transient arrays come in power-of-two
    blocks, so a memory pool (CuPy's keeps freed blocks) sees the same few sizes again instead of a
    new, larger one per ubatch. Recorded on numpy: every block size a power of two, few distinct
    sizes over 24 ubatches, and the results equal to a float64 brute force at the last ubatch."""
    sizes = []

    class Recording:  # numpy, with every xp.empty recorded
        def __getattr__(self, name):
            return getattr(np, name)

        def empty(self, shape, dtype=float):
            sizes.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
            return np.empty(shape, dtype)

    be = NumpyBackend()
    be.xp = Recording()
    rng = np.random.default_rng(5)
    n_head, n_kv, d, ub, n_ub = 4, 2, 16, 32, 24
    k = rng.standard_normal((ub * n_ub, n_kv, d)).astype(np.float16)
    v = rng.standard_normal((ub * n_ub, n_kv, d)).astype(np.float16)
    for i in range(n_ub):
        q = rng.standard_normal((ub, n_head, d)).astype(np.float32)
        out = be.attention(q, k, v, i * ub, 0.25)
    assert all(s & (s - 1) == 0 for s in sizes), sorted(set(sizes))
    assert len(set(sizes)) <= 12 < 3 * n_ub, sorted(set(sizes))
    p = (n_ub - 1) * ub + ub - 1  # the last query
    for h in range(n_head):
        sc = k[:p + 1, h // 2].astype(np.float64) @ q[-1, h].astype(np.float64) * 0.25
        a = np.exp(sc - sc.max())
        np.testing.assert_allclose(out[-1, h * d:(h + 1) * d], (a / a.sum()) @ v[:p + 1, h // 2].astype(np.float64),
                                   rtol=1e-4, atol=1e-5)
