"""The 8-bit activation rounding of the GPU's decode products and its CPU twin (runs in CI).

References are independent of moecache's code: the rounding rule written out per element in
float64 from its statement (llama.cpp's quantize_q8_1 scale: max|x| / 127 per 32 values), the
weights dequantized by gguf-py in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from moecache.backends import NumpyBackend
from moecache.moe.routing import Routing
from moecache.quants.act_q8 import Q8_ACT, q8_round
from moecache.quants.formats import FORMATS
from moecache.quants.random_blocks import random_experts, random_rows


@pytest.fixture
def seed() -> int:
    s = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {s}")
    return s


def rule(x: np.ndarray) -> np.ndarray:
    """The rounding, element by element: d = float32(max|x| / 127) over each 32 values, q the
    nearest integer to float32(x / d) (ties to even), value q * d."""
    out = np.zeros(x.shape, np.float64)
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        for u in range(0, row.size, 32):
            blk = row[u:u + 32].astype(np.float32)
            amax = float(np.max(np.abs(blk)))
            d = np.float32(np.float32(amax) / np.float32(127))
            for i, v in enumerate(blk):
                out[idx + (u + i,)] = 0.0 if amax == 0 else round(float(np.float32(v / d))) * float(d)
    return out


def test_q8_round_follows_the_rule(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 128)) * rng.uniform(0.01, 100, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0  # a unit of zeros: scale 0, values 0
    x[2, 0] = 1e30  # one huge value: its unit's others round to 0
    got = q8_round(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got.astype(np.float64), rule(x), rtol=6e-8, atol=0)  # q * d rounded to float32
    err = np.abs(got - x).reshape(3, 4, 32).max(-1)
    assert (err <= np.abs(x).reshape(3, 4, 32).max(-1) / 127 / 2 * 1.0001).all()  # half a quantum at most
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_round(np.zeros((2, 40), np.float32))


@pytest.mark.parametrize("fmt_name", sorted(Q8_ACT))
@pytest.mark.parametrize("n_tok", [1, 5])
def test_twin_products_round_their_activations(fmt_name, n_tok, seed):
    """NumpyBackend(act_q8=True).matmul of a Q8_ACT format: gguf-py's float64 weights times the rule's
    activations; ubatches beyond 16 tokens round weights and activations to float16 instead (the
    GPU's prompt GEMMs): against gguf-py's weights and x rounded to float16 by numpy, in float64."""
    from moecache.backends.numpy_backend import Linear

    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    raw = random_rows(fmt, 40, 512, rng)
    w64 = gguf_dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(40, 512)
    w = Linear("w", raw, fmt.ggml_type, 512)
    twin = NumpyBackend(act_q8=True)
    x = rng.standard_normal((n_tok, 512)).astype(np.float32)
    got = twin.matmul(w, x)
    ref = rule(x) @ w64.T
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-6
    flt = x.astype(np.float64) @ w64.T
    assert np.linalg.norm(got - flt) / np.linalg.norm(flt) > 1e-4  # the rounding is there
    big = rng.standard_normal((17, 512)).astype(np.float32)
    h16 = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731
    ref16 = h16(big) @ h16(w64).T
    got16 = twin.matmul(w, big)
    assert np.linalg.norm(got16 - ref16) / np.linalg.norm(ref16) < 2e-6
    flt = big.astype(np.float64) @ w64.T
    assert 1e-5 < np.linalg.norm(got16 - flt) / np.linalg.norm(flt) < 2e-3  # float16's rounding, no more


def test_twin_moe_rounds_input_and_gated_activations(seed):
    """The twin of the GPU's decode MoE: h rounded, then each pair's SwiGLU output rounded before
    its down product: against a float64 reference built from gguf-py's weights and the rule."""
    rng = np.random.default_rng(seed)
    n_exp, k, n_embd, ff, t = 6, 2, 256, 256, 3
    fq, fd = FORMATS["Q4_K"], FORMATS["Q8_0"]
    g, u, d = random_experts((fq, fq, fd), n_exp, n_embd, ff, rng)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.dirichlet(np.ones(k), t).astype(np.float32)
    h = rng.standard_normal((t, n_embd)).astype(np.float32)
    deq = lambda a, f, r, c: gguf_dequantize(a, f.ggml_type).astype(np.float64).reshape(r, c)  # noqa: E731
    hq = rule(h)
    ref = np.zeros((t, n_embd))
    for i in range(t):
        for s, e in enumerate(ids[i]):
            gg = deq(g[e], fq, ff, n_embd) @ hq[i]
            a = (gg / (1 + np.exp(-gg)) * (deq(u[e], fq, ff, n_embd) @ hq[i])).astype(np.float32)
            ref[i] += wts[i, s] * (deq(d[e], fd, n_embd, ff) @ rule(a[None])[0])
    types = (fq.ggml_type, fq.ggml_type, fd.ggml_type)
    got = NumpyBackend(act_q8=True).moe_ffn(g, u, d, types, Routing(ids, wts), h, "silu")
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-3, f"{err:.2e}"  # a gated value on a rounding boundary may round the other way
    flt = NumpyBackend().moe_ffn(g, u, d, types, Routing(ids, wts), h, "silu")
    assert np.linalg.norm(got - flt) / np.linalg.norm(flt) > 1e-4


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q4_0"), ("F16", "F16", "F16")])
def test_twin_prompt_moe_rounds_to_float16(types, seed):
    """The twin of the GPU's prompt MoE (more than 16 tokens): h, the weights and each pair's gated
    activations rounded to float16, float32 products: against a float64 reference from gguf-py's
    weights rounded by numpy, and near (not equal to) the float32 result."""
    rng = np.random.default_rng(seed)
    n_exp, k, n_embd, ff, t = 8, 3, 256, 256, 24
    fg, fu, fd = (FORMATS[x] for x in types)
    g, u, d = random_experts((fg, fu, fd), n_exp, n_embd, ff, rng)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.dirichlet(np.ones(k), t).astype(np.float32)
    h = rng.standard_normal((t, n_embd)).astype(np.float32)
    h16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float64)  # noqa: E731
    deq = lambda a, f, r, c: h16(gguf_dequantize(a, f.ggml_type).reshape(r, c))  # noqa: E731
    ref = np.zeros((t, n_embd))
    for i in range(t):
        for s, e in enumerate(ids[i]):
            gg = deq(g[e], fg, ff, n_embd) @ h16(h[i])
            a = gg / (1 + np.exp(-gg)) * (deq(u[e], fu, ff, n_embd) @ h16(h[i]))
            ref[i] += wts[i, s] * (deq(d[e], fd, n_embd, ff) @ h16(a))
    tt = tuple(FORMATS[x].ggml_type for x in types)
    got = NumpyBackend(act_q8=True).moe_ffn(g, u, d, tt, Routing(ids, wts), h, "silu")
    err = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)  # per token
    # per token 2.5e-7 .. 3.5e-7 (median) measured; leaving out any one of the roundings (h, the
    # weights, the gated activations) moves every token to 1.9e-4 .. 5e-4. A value computed in float32
    # (a dequantized weight, a gated activation) that lies on a float16 rounding boundary may round
    # the other way than its float64 twin: one or two tokens in 24, up to 5e-4, in ~1% of the seeds
    # (a whole-output norm then failed at random, 300 cases replayed)
    assert np.median(err) < 5e-6 and (err > 5e-5).sum() <= 4 and err.max() < 2e-3, \
        f"median {np.median(err):.2e}, {(err > 5e-5).sum()} tokens > 5e-5, max {err.max():.2e}"
    flt = NumpyBackend().moe_ffn(g, u, d, tt, Routing(ids, wts), h, "silu")
    assert 1e-5 < np.linalg.norm(got - flt) / np.linalg.norm(flt) < 3e-3


def test_twin_model_logits_move_by_the_rounding_only(tmp_path):
    """A whole model (tiny-qwen3) under the twin: finite logits near the float32 ones, not equal."""
    from moecache.gguf_file import open_gguf
    from moecache.models import build_model
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "m.gguf"
    write_model(path, PRESETS["tiny-qwen3"], seed=3)
    with open_gguf(path) as m:
        toks = np.random.default_rng(4).integers(0, m.config.n_vocab, 8)
        a, b = build_model(m, NumpyBackend()), build_model(m, NumpyBackend(act_q8=True))
        la = a.forward(toks, a.new_kv_cache(16), logits="all")
        lb = b.forward(toks, b.new_kv_cache(16), logits="all")
    rel = np.abs(la - lb).max() / np.abs(la).max()
    assert np.isfinite(lb).all() and 1e-5 < rel < 5e-2, rel


def test_grouped_prompt_ok_takes_gate_and_up_of_one_8bit_format():
    """The grouped 8-bit prompt MoE runs on experts whose gate and up share a format and whose three
    formats all have 8-bit kernels (Q8_ACT); anything else takes the float16 GEMMs."""
    from moecache.quants.act_q8 import grouped_prompt_ok
    from moecache.quants.formats import FORMATS

    def t(*names):
        return tuple(FORMATS[n].ggml_type for n in names)

    assert grouped_prompt_ok(t("Q4_K", "Q4_K", "Q6_K")) and grouped_prompt_ok(t("Q8_0", "Q8_0", "Q4_0"))
    assert not grouped_prompt_ok(t("Q4_K", "Q5_K", "Q6_K"))  # gate and up differ
    assert not grouped_prompt_ok(t("IQ4_XS", "IQ4_XS", "Q6_K")) and not grouped_prompt_ok(t("Q4_K", "Q4_K", "Q3_K"))
