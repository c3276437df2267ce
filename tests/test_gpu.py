"""GPU backend (CuPy) against gguf-py and the CPU backend. Runs on the GPU machine: pytest -m gpu."""

from __future__ import annotations

import contextlib

from dataclasses import replace

import numpy as np
import pytest

from moecache.testing.fidelity import third_of_experts_budget

pytestmark = pytest.mark.gpu

try:  # not a module-level importorskip: CI (no GPU, no CuPy) must still collect this file and
    import cupy as cp  # deselect its tests; a skipped module fails under CI (conftest.py)
except ImportError:
    cp = None


@pytest.fixture(scope="module")
def gpu():
    if cp is None:
        pytest.skip("cupy is not installed")
    from moecache.backends.cupy_backend import CupyBackend, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    return CupyBackend(act_q8=False)  # float32 activations: the CPU twin's arithmetic


@pytest.fixture(scope="module")
def gpu_q8(gpu):
    from moecache.backends.cupy_backend import CupyBackend

    return CupyBackend(act_q8=True)  # the default: decode products with 8-bit activations


ALL_FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]


def poison(shape, dtype=np.float32):
    """Fill a pool block of this size with NaN and free it: the backend's next cp.empty of the
    same size gets it back, so an output the kernel forgets to write stays NaN and fails."""
    a = cp.full(shape, np.nan, dtype)
    del a


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**32)


def _random_moe_case(types, n_tok, rng):
    """Random stacked experts of ``types`` (gate, up, down format names: 16 experts, n_embd 512,
    ff 256), their GGML type ids, n_tok random activations and a top-4 routing."""
    from moecache.moe.routing import topk_routing
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_experts

    fg, fu, fd = (FORMATS[t] for t in types)
    g, u, d = random_experts((fg, fu, fd), 16, 512, 256, rng)
    h = rng.standard_normal((n_tok, 512)).astype(np.float32)
    r = topk_routing(rng.dirichlet(np.ones(16), n_tok).astype(np.float32), 4, True)
    return g, u, d, (fg.ggml_type, fu.ggml_type, fd.ggml_type), h, r


@pytest.mark.parametrize("fmt_name", ALL_FORMATS)
def test_dequant_kernels_match_gguf_py(gpu, fmt_name):
    from gguf.quants import dequantize

    from moecache.backends.numpy_backend import Linear
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    seed = _seed()
    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    n_rows, n_in = 37, 512
    raw = random_rows(fmt, n_rows, n_in, rng)
    ref = dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(n_rows, n_in)
    w = Linear("w", cp.asarray(raw), fmt.ggml_type, n_in)
    poison((n_rows, n_in))
    got = cp.asnumpy(gpu.dequantize(w)).astype(np.float64)
    assert np.isfinite(got).all(), f"seed {seed}"
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-6, f"{fmt_name} seed {seed}: {err:.2e}"
    # a row subset (the embedding path)
    poison((3, n_in))
    sub = cp.asnumpy(gpu.embed(w, np.array([3, 0, 36])))
    np.testing.assert_allclose(sub, ref[[3, 0, 36]], rtol=1e-6, atol=1e-7)


PRESETS = ["tiny", "tiny-qwen2moe", "tiny-olmoe", "tiny-mixtral", "tiny-llama", "tiny-qwen3", "tiny-gemma3"]


@pytest.mark.parametrize("preset", PRESETS)
def test_logits_gpu_equal_cpu_on_every_arch(gpu, preset, tmp_path):
    from moecache.backends import NumpyBackend
    from moecache.gguf_file import open_gguf
    from moecache.models import build_model
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / f"{preset}.gguf"
    write_model(path, P[preset], seed=3)
    with open_gguf(path) as m:
        tokens = np.random.default_rng(4).integers(0, m.config.n_vocab, 20)
        cpu_lm, gpu_lm = build_model(m, NumpyBackend()), build_model(m, gpu)
        ref = cpu_lm.forward(tokens, cpu_lm.new_kv_cache(32), logits="all")
        kv = gpu_lm.new_kv_cache(32)
        got = np.vstack([gpu_lm.forward(tokens[:12], kv, logits="all")] +
                        [gpu_lm.forward(tokens[i:i + 1], kv) for i in range(12, 20)])
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"{preset}: GPU vs CPU max relative logit error {rel:.2e}")
    assert np.isfinite(got).all() and rel < 1e-4


def _flash_presets() -> list[str]:
    """The presets whose prompt attention over a float16 cache takes the tiled kernel (head sizes)."""
    from moecache.backends.flash import FLASH_HEAD_DIMS
    from moecache.testing.synth import PRESETS as P

    return [p for p in PRESETS if P[p].head_dim in FLASH_HEAD_DIMS]


@pytest.mark.parametrize("preset,n_prompt,kv", [(p, n, "f32") for n in (12, 24) for p in PRESETS] +
                         [(p, 80, "f16") for p in _flash_presets()])
def test_logits_gpu_8bit_activations_near_cpu_on_every_arch(gpu_q8, preset, n_prompt, kv, tmp_path):
    """The default GPU arithmetic (8-bit activations in the products of ubatches <= 16 tokens,
    float16 operands in larger ones) gives the logits of its CPU twin (NumpyBackend(act_q8=True):
    the same roundings, float products) on every architecture, prompt (12 tokens: the 8-bit
    kernels too; 24: the float16 GEMMs) and decode steps. A wrong scale, a stale kept quantization
    or a swapped nibble would move them by about the rounding's own size (printed: the distance to
    the float32 CPU logits, 2e-3 .. 8e-2 on these tiny models); what remains is a value landing on
    the other side of a rounding boundary. With a float16 KV cache and 80 tokens the prompt's
    attention is the tiled kernel (two key tiles) against its twin, whose roundings
    NumpyBackend(act_q8=True) repeats: on the presets whose heads it takes (64 or 128: olmoe,
    llama). Elsewhere 80 tokens would test only the GEMMs' flips, which grow with the tokens
    (tiny-gemma3: 0.84 of the rounding, H200, sixteenth session). The float16 roundings are fine (an ulp is 2**-10 of the
    value) and the GPU's float32 sums differ from numpy's in their last bits, so a 24-token prompt
    flips many of them, each moving the next product by an ulp of one input: there the GPU stays
    within 3/4 of the rounding's size (0.06 .. 0.51 of it measured on the H200; the 12-token
    prompt: below 1e-4 of it)."""
    from moecache.backends import NumpyBackend
    from moecache.gguf_file import open_gguf
    from moecache.models import build_model
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / f"{preset}.gguf"
    write_model(path, P[preset], seed=3)
    with open_gguf(path) as m:
        tokens = np.random.default_rng(4).integers(0, m.config.n_vocab, n_prompt + 8)
        lms = [build_model(m, NumpyBackend()), build_model(m, NumpyBackend(act_q8=True)), build_model(m, gpu_q8)]
        outs = []
        for lm in lms:
            cache = lm.new_kv_cache(n_prompt + 8, np.float16 if kv == "f16" else np.float32)
            outs.append(np.vstack([lm.forward(tokens[:n_prompt], cache, logits="all")] +
                                  [lm.forward(tokens[i:i + 1], cache) for i in range(n_prompt, n_prompt + 8)]))
    flt, twin, got = outs
    rel = np.abs(got - twin).max() / np.abs(twin).max()
    rounding = np.abs(twin - flt).max() / np.abs(flt).max()
    print(f"{preset} prompt {n_prompt}: GPU (default arithmetic) vs its CPU twin {rel:.2e}; the rounding moves "
          f"logits {rounding:.2e}")
    assert np.isfinite(got).all() and rel < (rounding / 3 if n_prompt <= 16 else 0.75 * rounding)


def test_attention_output_kept_8bit_rounding(gpu_q8):
    """With 8-bit activations attn_combine also writes its output's rounding for the attn_output
    product: equal to quantize_q8's rule applied to the output it wrote."""
    from moecache.backends import NumpyBackend
    from moecache.backends.cupy_backend import GQA_MIN_KEYS

    seed = _seed()
    rng = np.random.default_rng(seed)
    n_ctx, n_head, n_kv, d = GQA_MIN_KEYS + 100, 32, 4, 128
    k = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    for pos0 in (600, GQA_MIN_KEYS + 50):  # attn_decode's partials, then attn_gqa's
        q = rng.standard_normal((2, n_head, d)).astype(np.float32)
        out = gpu_q8.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0, 0.09)
        ref = NumpyBackend().attention(q, k.astype(np.float32), v.astype(np.float32), pos0, 0.09)
        np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}, pos {pos0}")
        assert gpu_q8._xq[0] is out
        xq, xd, xs = (cp.asnumpy(a) for a in gpu_q8._xq[1])
        deq = xq.reshape(2, -1, 32).astype(np.float64) * xd[..., None]
        np.testing.assert_array_equal(deq.reshape(2, -1), q8_reference(cp.asnumpy(out)), err_msg=f"seed {seed}")
        np.testing.assert_allclose(xs, xd * xq.reshape(2, -1, 32).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("t,pos0,n_head,n_kv,d,window,softcap", [
    (17, 0, 32, 4, 128, None, None),      # the fewest queries the tiled kernel takes
    (512, 0, 32, 4, 128, None, None),     # a whole first ubatch of Qwen3-30B-A3B's shape
    (300, 1000, 32, 4, 128, None, None),  # a later ubatch, blocks and tiles not aligned to pos0
    (130, 77, 16, 16, 64, None, 30.0),    # plain multi-head, head 64, softcap
    (200, 500, 8, 2, 64, 100, None),      # a window of 100 keys: its start mid-tile, moving per row
    (90, 40, 8, 2, 128, 7, None),         # a window shorter than a tile and a block's queries
    (65, 3000, 32, 4, 128, 1024, None)])  # a window of several tiles, one query past a block
def test_prompt_attention_kernel_matches_its_twins(gpu, gpu_q8, t, pos0, n_head, n_kv, d, window, softcap):
    """attn_prompt (tensor cores, key tiles, online softmax) against its CPU twins: the default
    arithmetic (float16 Q and P) against flash_attention_twin, whose roundings it repeats (only a
    P within float32 noise of a float16 rounding boundary may round the other way: 2^-11 of one
    term); the split arithmetic (act_q8 off) against float32 attention (NumpyBackend). Rows of the
    cache past the prompt hold NaN (never read), the output block is poisoned."""
    from moecache.backends import NumpyBackend
    from moecache.backends.flash import flash_attention_twin

    seed = _seed()
    rng = np.random.default_rng(seed)
    n_ctx = pos0 + t + 20
    k = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float16)
    k[pos0 + t:] = np.nan
    v[pos0 + t:] = np.nan
    q = (rng.standard_normal((t, n_head, d)) * 2).astype(np.float32)
    scale = 1 / np.sqrt(d)
    kd, vd = cp.asarray(k), cp.asarray(v)
    poison((t, n_head * d))
    pos = cp.asarray(np.arange(pos0, pos0 + t, dtype=np.int32))
    got = cp.asnumpy(gpu_q8.attention(cp.asarray(q), kd, vd, pos, scale, window, softcap))
    twin = flash_attention_twin(q, k, v, pos0, scale, window, softcap)
    err = np.abs(got - twin)
    print(f"seed {seed}: float16 kernel vs its twin max {err.max():.2e} mean {err.mean():.2e}")
    # on the H200 (fifteenth session) mean <= 5.2e-7: a twin that tiled or summed L otherwise drifts
    # to 2e-6 .. 1e-5 (a review's numpy emulation of the kernel)
    assert np.isfinite(got).all() and err.max() < 3e-3 and err.mean() < 1.5e-6, f"seed {seed}"
    poison((t, n_head * d))
    exact = cp.asnumpy(gpu.attention(cp.asarray(q), kd, vd, pos0, scale, window, softcap))
    ref = NumpyBackend().attention(q, k.astype(np.float32), v.astype(np.float32), pos0, scale, window, softcap)
    np.testing.assert_allclose(exact, ref, rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}")


def test_code_moe_tiny_gpu_equals_cpu(gpu, code_moe_tiny):
    from moecache.backends import NumpyBackend
    from moecache.engine import Engine, EngineConfig

    tokens = np.random.default_rng(6).integers(1, 8000, 64)
    with Engine(code_moe_tiny, EngineConfig(n_ctx=128)) as c, \
            Engine(code_moe_tiny, EngineConfig(n_ctx=128), backend=gpu) as g:
        assert isinstance(c.backend, NumpyBackend) and g.backend is gpu
        ref = c.eval(tokens, logits="all")
        got = g.eval(tokens, logits="all")
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"code-moe-tiny: GPU vs CPU max relative logit error {rel:.2e}")
    assert rel < 1e-4


@pytest.mark.parametrize("fmt_name", ALL_FORMATS)
@pytest.mark.parametrize("n_tok", [1, 3, 16])
def test_fused_gemv_matches_gguf_py(gpu, fmt_name, n_tok):
    from gguf.quants import dequantize

    from moecache.backends.numpy_backend import Linear
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    seed = _seed()
    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    n_rows, n_in = 301, 1024
    raw = random_rows(fmt, n_rows, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(n_rows, n_in).T
    w = Linear("w", cp.asarray(raw), fmt.ggml_type, n_in)
    poison((n_tok, n_rows))
    got = cp.asnumpy(gpu.matmul(w, cp.asarray(x)))
    assert got.shape == (n_tok, n_rows) and np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 2e-6, f"{fmt_name} T={n_tok} seed {seed}: {err:.2e}"


def q8_reference(x: np.ndarray) -> np.ndarray:
    """Activations as quantize_q8 (mmvq.cu) rounds them, in float64: per 32 values d = max|x| / 127
    (float32), q = rint(x / d) (float32 division, ties to even), value q * d."""
    r, n = x.shape
    b = x.reshape(r, n // 32, 32).astype(np.float32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.rint(b / np.where(d > 0, d, 1)), 0)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(r, n)


Q8_FORMATS = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("fmt_name", Q8_FORMATS)
@pytest.mark.parametrize("n_tok", [1, 3, 16])
@pytest.mark.parametrize("n_in", [768, 2048])
def test_q8_activation_gemv_matches_gguf_py(gpu_q8, gpu, fmt_name, n_tok, n_in):
    """gemvq_<fmt> (8-bit activations, integer dot products) against gguf-py's float64 weights times
    the activations rounded as quantize_q8 rounds them (tight), and against the float32-activation
    kernel (the rounding's own error: bounded). 301 rows: the last block of rows is partial; 768
    inputs: 12 or 24 pieces per row, several rows per warp."""
    from gguf.quants import dequantize

    from moecache.backends.numpy_backend import Linear
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    seed = _seed()
    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    n_rows = 301
    raw = random_rows(fmt, n_rows, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block of activations (d = 0)
    w64 = dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(n_rows, n_in)
    ref = q8_reference(x) @ w64.T
    w = Linear("w", cp.asarray(raw), fmt.ggml_type, n_in)
    poison((n_tok, n_rows))
    got = cp.asnumpy(gpu_q8.matmul(w, cp.asarray(x)))
    assert got.shape == (n_tok, n_rows) and np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 2e-6, f"{fmt_name} T={n_tok} n_in {n_in} seed {seed}: {err:.2e}"
    exact = x.astype(np.float64) @ w64.T
    rounding = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    print(f"{fmt_name} T={n_tok} n_in {n_in}: vs quantized-activation reference {err:.1e}, vs float {rounding:.1e}")
    # the rounding moves each activation by at most half its block's step d = amax / 127, so each
    # output by at most sum_j |w_ij| d_j / 2 (a bound that holds for every seed); the relative norm
    # is a statistic: over 3000 seeds on the CPU (T=1, 768 inputs), median 5.3e-3, largest 1.59e-2
    # (Q5_K; Q4_K 1.50e-2: the K formats' rows carry a common offset), so 2.5e-2 catches a gross
    # error without flaking
    step = np.repeat(np.abs(x.reshape(n_tok, -1, 32)).max(axis=-1) / 127.0, 32, axis=1)
    bound = (step / 2) @ np.abs(w64).T
    slack = 1e-5 * np.abs(exact).max()  # float32 sums
    assert (np.abs(got - exact) <= bound * (1 + 1e-3) + slack).all(), \
        f"{fmt_name}: 8-bit activations moved the product beyond half a step (seed {seed})"
    assert rounding < 2.5e-2, f"{fmt_name}: 8-bit activations moved the product by {rounding:.2e} (seed {seed})"


@pytest.mark.parametrize("n_tok,n", [(1, 2048), (5, 256), (16, 4096)])
def test_fused_add_norm_q8_matches_numpy(gpu_q8, n_tok, n):
    """rms_norm_q8 (residual sum + RMSNorm + the 8-bit rounding of the decode products, one launch)
    against numpy's x + r and rms_norm, and its quants against quantize_q8's rule applied to the
    kernel's own normed values (exact: the same float32 inputs)."""
    from moecache.backends import NumpyBackend

    seed = _seed()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, n)).astype(np.float32) * 3
    r = rng.standard_normal((n_tok, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    r[0, 32:64] = -x[0, 32:64]  # a unit whose sum is zero: d = 0, quants 0
    h, y = gpu_q8.add_rms_norm(cp.asarray(x), cp.asarray(r), cp.asarray(w), 1e-6)
    np.testing.assert_array_equal(cp.asnumpy(h), x + r)
    ref = NumpyBackend().rms_norm(x + r, w, 1e-6)
    np.testing.assert_allclose(cp.asnumpy(y), ref, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    xq, xd, xs = (cp.asnumpy(a) for a in gpu_q8._quantized(y))  # kept by the fused kernel: no new launch
    assert gpu_q8._xq[0] is y
    yg = cp.asnumpy(y)
    deq = xq.reshape(n_tok, n // 32, 32).astype(np.float64) * xd[..., None]
    np.testing.assert_array_equal(deq.reshape(n_tok, n), q8_reference(yg))
    np.testing.assert_allclose(xs, xd * xq.reshape(n_tok, n // 32, 32).sum(-1), rtol=1e-6)
    assert (xq[0, 32:64] == 0).all() and xd[0, 1] == 0
    y2 = gpu_q8.rms_norm(cp.asarray(x), None, 1e-6)
    np.testing.assert_allclose(cp.asnumpy(y2), NumpyBackend().rms_norm(x, None, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q5_K", "Q5_K", "Q4_0")])
@pytest.mark.parametrize("n_tok", [1, 4])
def test_q8_activation_moe_matches_reference(gpu_q8, types, n_tok):
    """moeq_glu / moeq_down (the decode MoE with 8-bit activations) against a float64 reference that
    rounds h and the gated activations the same way: gguf-py's weights, SwiGLU, weighted sum."""
    _check_q8_moe(gpu_q8, types, n_tok, 10)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q5_K", "Q5_K", "Q4_0"),
                                   ("Q4_K", "Q4_K", "Q4_K")])
@pytest.mark.parametrize("n_tok,n_exp", [(40, 10), (300, 10), (70, 64)])
def test_grouped_q8_prompt_moe_matches_reference(gpu, types, n_tok, n_exp):
    """The prompt MoE grouped by expert (CupyBackend(prompt_q8=True): moeq_gglu / moeq_gdown, each
    expert's rows read once per group of up to 16 tokens; Q4_K matrices on sm_80+ the tensor-core
    moeq_mma_gglu / moeq_mma_gdown, groups of up to 32) against the same float64 reference as the
    decode kernels: 300 tokens over 10 experts give groups of 16 (32) and a remainder per expert,
    70 tokens over 64 experts groups of 1-16 tokens; Q4_K gate/up and Q4_K down each take the
    tensor-core kernel in one of the type triples."""
    from moecache.backends.cupy_backend import CupyBackend

    _check_q8_moe(CupyBackend(act_q8=True, prompt_q8=True), types, n_tok, n_exp)


def _check_q8_moe(be, types, n_tok, n_exp):
    """``be.moe_ffn`` on random experts of ``types`` (gguf-py's quants) and routing against float64
    with h and the gated activations rounded as quantize_q8 rounds them."""
    from gguf.quants import dequantize

    from moecache.moe.routing import Routing
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_experts

    seed = _seed()
    rng = np.random.default_rng(seed)
    k, n_embd, ff = 4, 512, 768
    fg, fu, fd = (FORMATS[t] for t in types)
    g, u, d = random_experts((fg, fu, fd), n_exp, n_embd, ff, rng)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    wts = rng.dirichlet(np.ones(k), n_tok).astype(np.float32)
    h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    deq = lambda a, f, r, c: [dequantize(x, f.ggml_type).astype(np.float64).reshape(r, c) for x in a]  # noqa: E731
    wg, wu, wd = deq(g, fg, ff, n_embd), deq(u, fu, ff, n_embd), deq(d, fd, n_embd, ff)
    hq = q8_reference(h)
    a = np.zeros((n_tok * k, ff), np.float64)
    for t in range(n_tok):
        for s, e in enumerate(ids[t]):
            gg = wg[e] @ hq[t]
            a[t * k + s] = gg / (1 + np.exp(-gg)) * (wu[e] @ hq[t])
    aq = q8_reference(a.astype(np.float32))
    ref = np.zeros((n_tok, n_embd))
    for t in range(n_tok):
        for s, e in enumerate(ids[t]):
            ref[t] += wts[t, s] * (wd[e] @ aq[t * k + s])
    tt = tuple(FORMATS[x].ggml_type for x in types)
    got = cp.asnumpy(be.moe_ffn(cp.asarray(g), cp.asarray(u), cp.asarray(d), tt,
                                Routing(cp.asarray(ids), cp.asarray(wts)), cp.asarray(h), "silu"))
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # the gated activations are float32 on the GPU: a value within ~1e-6 of a rounding boundary of
    # quantize_q8 may round the other way than in the float64 reference (one quantum of one value,
    # ~3e-4 of the output each); the rounding itself moves the output by ~5e-3 (test above)
    print(f"{types} T={n_tok}: {err:.2e}")
    assert err < 1e-3, f"{types} T={n_tok} seed {seed}: {err:.2e}"


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("MXFP4", "MXFP4", "Q5_0"),
                                   ("IQ4_XS", "Q4_K", "Q3_K")])
@pytest.mark.parametrize("n_tok", [1, 5, 40])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_moe_ffn_gpu_matches_numpy_twin(gpu, types, n_tok, act):
    """Both GPU MoE paths (decode kernels up to 16 tokens, batched cuBLAS beyond) against the CPU
    kernel, itself tested against gguf-py in tests/test_moe_kernel.py."""
    from moecache.backends import NumpyBackend

    seed = _seed()
    g, u, d, tt, h, r = _random_moe_case(types, n_tok, np.random.default_rng(seed))
    ref = NumpyBackend().moe_ffn(g, u, d, tt, r, h, act)
    poison(h.shape)
    got = cp.asnumpy(gpu.moe_ffn(gpu.upload(g), gpu.upload(u), gpu.upload(d), tt, r, cp.asarray(h), act))
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-5, f"{types} T={n_tok} seed {seed}: {err:.2e}"


@pytest.mark.parametrize("fmt_name", ["Q4_K", "Q6_K", "Q8_0", "F16", "BF16", "IQ4_XS"])
def test_prompt_products_in_float16_match_gguf_py(gpu_q8, fmt_name):
    """The prompt path of the default arithmetic (more than 16 tokens): W dequantized to float16
    equals gguf-py's weights rounded to float16 (to an ulp: our float32 value is rounded once), and
    the tensor-core GEMM equals the float64 product of the float16-rounded operands up to float32
    accumulation; against the unrounded product the error stays within float16's rounding."""
    from gguf.quants import dequantize

    from moecache.backends.numpy_backend import Linear
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    seed = _seed()
    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    n_rows, n_in, n_tok = 301, 1024, 40
    raw = random_rows(fmt, n_rows, n_in, rng)
    w64 = dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(n_rows, n_in)
    w = Linear("w", cp.asarray(raw), fmt.ggml_type, n_in)
    h16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float64)  # noqa: E731
    wh = cp.asnumpy(gpu_q8.dequantize(w, dtype=cp.float16)).astype(np.float64)
    np.testing.assert_allclose(wh, h16(w64), rtol=2.0 ** -10, atol=2.0 ** -24, err_msg=f"seed {seed}")
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    poison((n_tok, n_rows))
    got = cp.asnumpy(gpu_q8.matmul(w, cp.asarray(x)))
    assert got.shape == (n_tok, n_rows) and np.isfinite(got).all()
    ref = h16(x) @ h16(w64).T
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 2e-6, f"{fmt_name} seed {seed}: {err:.2e}"
    flt = x.astype(np.float64) @ w64.T
    rounding = np.linalg.norm(got - flt) / np.linalg.norm(flt)
    assert rounding < 2e-3, f"{fmt_name} seed {seed}: {rounding:.2e}"
    print(f"{fmt_name}: vs float16-operand reference {err:.1e}, vs float {rounding:.1e}")


@pytest.mark.parametrize("types,n_tok", [(("Q4_K", "Q4_K", "Q6_K"), 70), (("IQ4_XS", "Q4_K", "Q3_K"), 70),
                                         (("IQ4_XS", "Q4_K", "Q3_K"), 5)])
def test_prompt_moe_in_float16_matches_numpy_twin(gpu_q8, types, n_tok):
    """The default arithmetic's prompt MoE (float16 GEMMs) against its CPU twin
    (NumpyBackend(act_q8=True), itself checked against gguf-py in tests/test_act_q8.py); 5 tokens
    with gate and up of different types take the batched path too, in float32 on both sides."""
    from moecache.backends import NumpyBackend

    seed = _seed()
    g, u, d, tt, h, r = _random_moe_case(types, n_tok, np.random.default_rng(seed))
    ref = NumpyBackend(act_q8=True).moe_ffn(g, u, d, tt, r, h, "silu")
    poison(h.shape)
    got = cp.asnumpy(gpu_q8.moe_ffn(gpu_q8.upload(g), gpu_q8.upload(u), gpu_q8.upload(d), tt, r, cp.asarray(h), "silu"))
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-4, f"{types} seed {seed}: {err:.2e}"


@pytest.mark.parametrize("n_tok", [5, 40])
@pytest.mark.parametrize("arith", ["default", "float32"])
def test_moe_ffn_with_pairs_of_no_expert_matches_numpy_twin(gpu, gpu_q8, n_tok, arith):
    """A routing with pairs of id -1 (the expert cache's prompt groups: the pairs of other groups)
    on the GPU: the batched path plans and sums only the others, at any ubatch size (5 tokens too:
    the decode kernels take no id < 0), against NumpyBackend's twin (itself against float64 in
    tests/test_moe_kernel.py); a token of no expert at all gets zeros."""
    from moecache.backends import NumpyBackend
    from moecache.moe.routing import Routing

    seed = _seed()
    rng = np.random.default_rng(seed)
    g, u, d, tt, h, r = _random_moe_case(("Q4_K", "Q4_K", "Q6_K"), n_tok, rng)
    ids = np.where(rng.random(r.ids.shape) < 0.5, -1, r.ids).astype(np.int32)
    ids[1] = -1
    r = Routing(ids, r.weights)
    be, twin = (gpu_q8, NumpyBackend(act_q8=True)) if arith == "default" else (gpu, NumpyBackend())
    ref = twin.moe_ffn(g, u, d, tt, r, h, "silu")
    poison(h.shape)
    got = cp.asnumpy(be.moe_ffn(be.upload(g), be.upload(u), be.upload(d), tt, r, cp.asarray(h), "silu"))
    assert np.isfinite(got).all() and not got[1].any()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < (1e-4 if arith == "default" and n_tok > 16 else 1e-5), f"T={n_tok} {arith} seed {seed}: {err:.2e}"


@pytest.mark.parametrize("ratio,pow2", [(2, False), (1, False), (4, True), (8, False)])
def test_moe_prompt_chunks_under_a_skewed_router_match_numpy_twin(gpu, monkeypatch, ratio, pow2):
    """The prompt MoE in many chunks (hottest experts first, a small padded-activation bound) under
    a skewed router (a few experts take most tokens) gives the CPU twin's result, with the default
    chunking and with the others bench/prompt_chunks.py A/Bs (``prompt_chunk_ratio``: chunks of
    counts within that ratio of their largest; ``prompt_m_pow2``: padded rows a power of two)."""
    from moecache.backends import NumpyBackend, cupy_backend
    from moecache.moe.routing import topk_routing
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_experts

    seed = _seed()
    rng = np.random.default_rng(seed)
    n_exp, k, n_embd, ff, n_tok = 32, 4, 512, 256, 300
    fmt = FORMATS["Q4_K"]
    g, u, d = random_experts((fmt,) * 3, n_exp, n_embd, ff, rng)
    tt = (fmt.ggml_type,) * 3
    h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)
    hot = rng.choice(n_exp, 3, replace=False)  # three popular experts: nearly every token takes them
    logits = rng.standard_normal((n_tok, n_exp)) + 4.0 * np.isin(np.arange(n_exp), hot)
    r = topk_routing(np.exp(logits).astype(np.float32), k, True)
    counts = np.diff(r.groups()[1])
    assert counts.max() > 4 * np.median(counts)  # skewed
    monkeypatch.setattr(cupy_backend, "MOE_ACT_BYTES", 120 * 4 * n_embd)  # chunks of <= 120 padded rows
    monkeypatch.setattr(gpu, "prompt_chunk_ratio", ratio)
    monkeypatch.setattr(gpu, "prompt_m_pow2", pow2)
    ref = NumpyBackend().moe_ffn(g, u, d, tt, r, h, "silu")
    got = cp.asnumpy(gpu.moe_ffn(gpu.upload(g), gpu.upload(u), gpu.upload(d), tt, r, cp.asarray(h), "silu"))
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-5, f"seed {seed}, ratio {ratio}, pow2 {pow2}: {err:.2e}"


def test_softmax_topk_kernel_matches_numpy(gpu):
    from moecache.backends import NumpyBackend

    seed = _seed()
    rng = np.random.default_rng(seed)
    for n_expert, k, renorm in [(128, 8, True), (60, 4, False), (8, 2, True), (256, 8, True), (200, 6, False),
                                (1000, 8, True)]:
        logits = rng.standard_normal((33, n_expert)).astype(np.float32) * 3
        ref = NumpyBackend().topk_routing(logits, k, renorm)
        got = gpu.topk_routing(cp.asarray(logits), k, renorm).host()
        np.testing.assert_array_equal(got.ids, ref.ids, err_msg=f"seed {seed}")
        np.testing.assert_allclose(got.weights, ref.weights, rtol=1e-5)


def test_softmax_topk_with_nan_logits_gives_valid_ids_and_nan_weights(gpu):
    """A token whose router logits are all NaN (a broken upstream layer) gets ids of real experts and
    NaN weights, so the NaN reaches the logits (which the engine checks) instead of an id past the
    experts (0x7fffffff before: the MoE kernels would have read far outside the weights); the other
    tokens route as the numpy twin does. Every register layout of topk_warp (8, 200, 1000 experts)."""
    from moecache.backends import NumpyBackend

    seed = _seed()
    rng = np.random.default_rng(seed)
    for n_expert, k in [(8, 2), (200, 6), (1000, 8)]:
        logits = rng.standard_normal((3, n_expert)).astype(np.float32)
        logits[1] = np.nan
        got = gpu.topk_routing(cp.asarray(logits), k, True).host()
        assert ((got.ids >= 0) & (got.ids < n_expert)).all(), f"seed {seed}: {got.ids}"
        assert np.isnan(got.weights[1]).all() and np.isfinite(got.weights[[0, 2]]).all()
        ref = NumpyBackend().topk_routing(logits[[0, 2]], k, True)
        np.testing.assert_array_equal(got.ids[[0, 2]], ref.ids, err_msg=f"seed {seed}")


@pytest.mark.parametrize("n_tok", [1, 5, 16])
def test_router_topk_kernel_matches_float64(gpu, n_tok, monkeypatch):
    """router_topk (the float32 router product and softmax top-k in one launch, the last block
    choosing) against numpy in float64: the same ids, weights within float32's rounding. Three calls
    in a row per shape: the blocks' counter must be back at 0 after each launch. Routers of 8 to
    1000 experts (the three register layouts of topk_warp); a width of 36 (not a multiple of the
    block's 512 floats per round)."""
    from moecache.backends.numpy_backend import Linear
    from moecache.moe.routing import softmax, topk_routing

    def unfused(*a, **kw):
        raise AssertionError("route() fell back to matmul + topk_routing")

    monkeypatch.setattr(gpu, "topk_routing", unfused)  # every shape below takes router_topk
    seed = _seed()
    rng = np.random.default_rng(seed)
    for n_expert, n, k, renorm in [(128, 2048, 8, True), (60, 1024, 4, False), (8, 36, 2, True),
                                   (256, 512, 8, False), (1000, 2048, 8, True)]:
        for _ in range(3):
            w = (rng.standard_normal((n_expert, n)) / np.sqrt(n)).astype(np.float32)
            x = rng.standard_normal((n_tok, n)).astype(np.float32) * 3
            logits64 = x.astype(np.float64) @ w.astype(np.float64).T
            ref = topk_routing(softmax(logits64), k, renorm)
            poison((n_tok, k))
            # as CupyBackend.linear keeps an F32 router (raw bytes), and as a float32 matrix
            for data in (cp.asarray(w.view(np.uint8)), cp.asarray(w)):
                got = gpu.route(Linear("ffn_gate_inp", data, 0, n), cp.asarray(x), k, renorm).host()
                np.testing.assert_array_equal(got.ids, ref.ids, err_msg=f"E {n_expert} n {n} seed {seed}")
                np.testing.assert_allclose(got.weights, ref.weights, rtol=2e-5, atol=1e-7,
                                           err_msg=f"E {n_expert} n {n} seed {seed}")
            assert int(gpu._router_done.get()[0]) == 0  # the last block reset the count


@pytest.mark.parametrize("n_tok", [1, 3, 16])
@pytest.mark.parametrize("fmt_name,n_in,rows", [("Q8_0", 256, (301, 37, 63)), ("Q4_K", 1024, (129, 31)),
                                                ("Q6_K", 1024, (65, 63, 7))])
def test_gemvq_stacked_matrices_match_gguf_py(gpu_q8, fmt_name, n_in, rows, n_tok, monkeypatch):
    """matmuls over 2-3 matrices of one format (q, k, v; gate, up) in one gemvq launch: each output
    against gguf-py's float64 weights times the activations rounded as quantize_q8 rounds them
    (the tight bound of the one-matrix test). Rows shorter than a warp's 32 lanes (several rows per
    warp) and odd row counts, so one warp holds rows of two matrices. A list with another format
    groups by format: q and k of one format in one launch, v of another in its own (a Q4_K_M
    file's attn_v), and agrees too."""
    from gguf.quants import dequantize

    from moecache.backends.cupy_backend import lanes_per_row
    from moecache.backends.numpy_backend import Linear
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    seed = _seed()
    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    per_warp = 32 // lanes_per_row(n_in, fmt_name)
    assert per_warp > 1 and any(sum(rows[:i + 1]) % per_warp for i in range(len(rows) - 1))  # a straddling warp
    raws = [random_rows(fmt, r, n_in, rng) for r in rows]
    ws64 = [dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(r, n_in) for raw, r in zip(raws, rows)]
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    ws = [Linear(f"w{i}", cp.asarray(raw), fmt.ggml_type, n_in) for i, raw in enumerate(raws)]
    xg = cp.asarray(x)
    launched = []
    fn = gpu_q8._fn
    monkeypatch.setattr(gpu_q8, "_fn", lambda name: (launched.append(name), fn(name))[1])
    got = gpu_q8.matmuls(ws, xg)
    assert len(got) == len(rows) and launched.count("gemvq_" + fmt_name.lower()) == 1, launched
    for i, (g, w64) in enumerate(zip(got, ws64)):
        g = cp.asnumpy(g)
        ref = q8_reference(x) @ w64.T
        assert g.shape == (n_tok, rows[i]) and np.isfinite(g).all()
        err = np.linalg.norm(g - ref) / np.linalg.norm(ref)
        assert err < 2e-6, f"{fmt_name} matrix {i} T={n_tok} seed {seed}: {err:.2e}"
    other = FORMATS["Q4_0"]
    raw_o = random_rows(other, 33, n_in, rng)
    launched.clear()
    mixed = gpu_q8.matmuls([ws[0], Linear("o", cp.asarray(raw_o), other.ggml_type, n_in), ws[1]], xg)
    assert launched.count("gemvq_" + fmt_name.lower()) == 1 and launched.count("gemvq_q4_0") == 1, launched
    ref_o = q8_reference(x) @ dequantize(raw_o, other.ggml_type).astype(np.float64).reshape(33, n_in).T
    assert np.linalg.norm(cp.asnumpy(mixed[1]) - ref_o) / np.linalg.norm(ref_o) < 2e-6, f"seed {seed}"
    np.testing.assert_array_equal(cp.asnumpy(mixed[0]), cp.asnumpy(got[0]))
    np.testing.assert_array_equal(cp.asnumpy(mixed[2]), cp.asnumpy(got[1]))


@pytest.mark.parametrize("n_ctx", [300, 5000, 16384])
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 4), (16, 1), (24, 1)])
def test_decode_attention_key_runs(gpu, n_ctx, kv, heads):
    """Decode attention splits a query's keys into runs (several per head once the cache holds more
    than 256 positions) and merges them: against the numpy twin at the first, a middle and the last
    position, with and without a window, for several decode batch sizes. Query groups of 4, 8 and 16
    heads per KV head (and 1: plain multi-head attention) take attn_gqa once a query has
    GQA_MIN_KEYS keys (a KV head read once per group; head sizes 64, 128, 256), attn_decode below
    that; what gqa_ok refuses (24 heads per KV head, other head sizes) always takes attn_decode."""
    from moecache.backends import NumpyBackend
    from moecache.backends.cupy_backend import GQA_MIN_KEYS, att_splits, gqa_ok, gqa_splits

    assert att_splits(n_ctx) > 1 and gqa_splits(n_ctx)[0] > 1
    seed = _seed()
    rng = np.random.default_rng(seed)
    (n_head, n_kv), d = heads, 128
    assert gqa_ok(n_head, n_kv, d, d) == (n_head // n_kv <= 16)
    k = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float32)
    dt = np.float16 if kv == "f16" else np.float32
    k, v = k.astype(dt), v.astype(dt)
    cases = [(1, 0, None, None), (1, n_ctx // 2 + 3, None, None), (1, n_ctx - 1, None, 30.0),
             (3, n_ctx - 3, 100, None), (16, n_ctx // 3, None, None), (2, 700 % n_ctx, 9, None)]
    if n_ctx > GQA_MIN_KEYS + 8:  # one decode batch on both sides of the attn_decode / attn_gqa split,
        cases.append((4, GQA_MIN_KEYS - 4, None, None))  # and a window past the split (keys from start > 0)
        cases.append((2, n_ctx - 2, GQA_MIN_KEYS + 900, None))
    for n_tok, pos0, window, softcap in cases:
        q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32)
        ref = NumpyBackend().attention(q, k.astype(np.float32), v.astype(np.float32), pos0, 0.09, window, softcap)
        got = cp.asnumpy(gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0, 0.09, window, softcap))
        # float32-level: the tensor-core attn_gqa splits Q and P into float16 hi + lo parts; a kernel
        # that rounded either to float16 alone is off by 2-5e-4 (emulated in numpy) and fails here
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6,
                                   err_msg=f"seed {seed}, n_ctx {n_ctx}, {kv}, pos0 {pos0}, window {window}")
    # head sizes that are not multiples of 32, K and V of different widths (d 80, dv 48)
    k2 = rng.standard_normal((n_ctx, n_kv, 80)).astype(dt)
    v2 = rng.standard_normal((n_ctx, n_kv, 48)).astype(dt)
    q2 = rng.standard_normal((2, n_head, 80)).astype(np.float32)
    ref = NumpyBackend().attention(q2, k2.astype(np.float32), v2.astype(np.float32), n_ctx - 2, 0.1, None, None)
    got = cp.asnumpy(gpu.attention(cp.asarray(q2), cp.asarray(k2), cp.asarray(v2), n_ctx - 2, 0.1, None, None))
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}, n_ctx {n_ctx}, {kv}, d 80 dv 48")
    # head sizes 64 and 256 (2 and 8 dims per lane in attn_gqa), where the group fits in registers
    for dd in (64, 256):
        k4 = rng.standard_normal((n_ctx, n_kv, dd)).astype(dt)
        v4 = rng.standard_normal((n_ctx, n_kv, dd)).astype(dt)
        q4 = rng.standard_normal((1, n_head, dd)).astype(np.float32)
        ref = NumpyBackend().attention(q4, k4.astype(np.float32), v4.astype(np.float32), n_ctx - 1, 0.06, None, None)
        got = cp.asnumpy(gpu.attention(cp.asarray(q4), cp.asarray(k4), cp.asarray(v4), n_ctx - 1, 0.06, None, None))
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}, n_ctx {n_ctx}, {kv}, d {dd}")
    # d 36, dv 20: refused by gqa_ok, attn_decode
    assert not gqa_ok(n_head, n_kv, 36, 20)
    k3 = rng.standard_normal((n_ctx, n_kv, 36)).astype(dt)
    v3 = rng.standard_normal((n_ctx, n_kv, 20)).astype(dt)
    q3 = rng.standard_normal((1, n_head, 36)).astype(np.float32)
    ref = NumpyBackend().attention(q3, k3.astype(np.float32), v3.astype(np.float32), n_ctx - 1, 0.1, None, None)
    got = cp.asnumpy(gpu.attention(cp.asarray(q3), cp.asarray(k3), cp.asarray(v3), n_ctx - 1, 0.1, None, None))
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}, n_ctx {n_ctx}, {kv}, d 36 dv 20")


@pytest.mark.parametrize("m", [300, 4096])
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("heads", [(32, 4), (24, 1)])
def test_batched_decode_attention_reads_each_sequences_rows(gpu, m, kv, heads):
    """A batched decode step over slices of one cache (serve's slots): qk_rope_store and attention
    with kv_base (one launch for every sequence; query t's rows start at kv_base[t]) against the
    numpy twin on each sequence's own rows: attn_decode (300-row slices) and attn_gqa (4096-row
    slices, queries past GQA_MIN_KEYS) and the 24-heads-per-KV-head shape attn_gqa refuses, the
    sequences' rows out of order; then K and V of different head sizes (d 64, dv 48: attn_decode)
    with a softcap. The KV writes land in each sequence's rows and nowhere else."""
    from moecache.backends import NumpyBackend
    from moecache.backends.cupy_backend import GQA_MIN_KEYS

    seed = _seed()
    rng = np.random.default_rng(seed)
    (n_head, n_kv), d, n_seq = heads, 128, 5
    dt = np.float16 if kv == "f16" else np.float32
    k = rng.standard_normal((n_seq * m, n_kv, d)).astype(dt)
    v = rng.standard_normal((n_seq * m, n_kv, d)).astype(dt)
    base = (np.array([3, 0, 4, 1, 2]) * m).astype(np.int32)  # not in token order: each token's own rows
    pos = np.array([0, m // 2, m - 1, 7, min(m - 1, GQA_MIN_KEYS + 5)], np.int32)
    q = rng.standard_normal((n_seq, n_head, d)).astype(np.float32)
    kn = rng.standard_normal((n_seq, n_kv, d)).astype(np.float32)
    vn = rng.standard_normal((n_seq, n_kv, d)).astype(np.float32)
    ang = rng.uniform(0, 50, (n_seq, d // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    k_dev, v_dev = cp.asarray(k), cp.asarray(v)
    qs = gpu.qk_rope_store(cp.asarray(q), cp.asarray(kn), cp.asarray(vn), None, None, 1e-6, cp.asarray(cos),
                           cp.asarray(sin), True, k_dev, v_dev, cp.asarray(pos), kv_base=cp.asarray(base))
    k_ref, v_ref = k.copy(), v.copy()
    q_ref = NumpyBackend().qk_rope_store(q, kn, vn, None, None, 1e-6, cos, sin, True, k_ref, v_ref, pos, kv_base=base)
    tol = 1e-3 if kv == "f16" else 1e-5
    np.testing.assert_allclose(cp.asnumpy(qs), q_ref, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_allclose(cp.asnumpy(k_dev).astype(np.float32), k_ref.astype(np.float32), rtol=tol, atol=tol,
                               err_msg=f"seed {seed}: K rows")
    np.testing.assert_allclose(cp.asnumpy(v_dev).astype(np.float32), v_ref.astype(np.float32), rtol=tol, atol=tol,
                               err_msg=f"seed {seed}: V rows")
    for window in (None, 100):
        got = cp.asnumpy(gpu.attention(qs, k_dev, v_dev, cp.asarray(pos), 0.09, window, None,
                                       kv_base=cp.asarray(base), n_ctx=m))
        for i in range(n_seq):
            rows = slice(int(base[i]), int(base[i]) + m)
            ref = NumpyBackend().attention(q_ref[i:i + 1], k_ref[rows].astype(np.float32),
                                           v_ref[rows].astype(np.float32), int(pos[i]), 0.09, window, None)
            np.testing.assert_allclose(got[i:i + 1], ref, rtol=2e-4, atol=2e-5,
                                       err_msg=f"seed {seed}, m {m}, {kv}, sequence {i}, window {window}")
    # K and V of different head sizes, softcap: V's rows step by dv, not d
    k2 = rng.standard_normal((n_seq * m, n_kv, 64)).astype(dt)
    v2 = rng.standard_normal((n_seq * m, n_kv, 48)).astype(dt)
    q2 = rng.standard_normal((n_seq, n_head, 64)).astype(np.float32)
    got = cp.asnumpy(gpu.attention(cp.asarray(q2), cp.asarray(k2), cp.asarray(v2), cp.asarray(pos), 0.1, None, 20.0,
                                   kv_base=cp.asarray(base), n_ctx=m))
    for i in range(n_seq):
        rows = slice(int(base[i]), int(base[i]) + m)
        ref = NumpyBackend().attention(q2[i:i + 1], k2[rows].astype(np.float32), v2[rows].astype(np.float32),
                                       int(pos[i]), 0.1, None, 20.0)
        np.testing.assert_allclose(got[i:i + 1], ref, rtol=2e-4, atol=2e-5,
                                   err_msg=f"seed {seed}, m {m}, {kv}, d 64 dv 48, sequence {i}")


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("n_tok,d,dv,n_rot", [(1, 128, 128, 128), (3, 64, 48, 32), (16, 256, 256, 256)])
def test_qk_rope_store_kernel_matches_numpy_twin(gpu, kv, n_tok, d, dv, n_rot):
    """qk_rope_store (per-head q/k RMSNorm + RoPE + KV write in one launch) against the composition
    of the numpy twin's rms_norm, rope and kv_store: with and without norm weights, both pairings,
    a partial rotary (n_rot < head_dim), float32 and float16 caches."""
    from moecache.backends import NumpyBackend

    seed = _seed()
    rng = np.random.default_rng(seed)
    cpu_ = NumpyBackend()
    n_head, n_kv, n_ctx, pos0 = 8, 2, 40, 17
    dt = np.float16 if kv == "f16" else np.float32
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32) * 3
    k = rng.standard_normal((n_tok, n_kv, d)).astype(np.float32) * 3
    v = rng.standard_normal((n_tok, n_kv, dv)).astype(np.float32)
    ang = rng.uniform(0, 50, (n_tok, n_rot // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = np.arange(pos0, pos0 + n_tok, dtype=np.int32)
    for norms, neox in [(True, True), (False, False), (True, False)]:
        qw = rng.standard_normal(d).astype(np.float32) if norms else None
        kw = rng.standard_normal(d).astype(np.float32) if norms else None
        k_ref, v_ref = np.zeros((n_ctx, n_kv, d), dt), np.zeros((n_ctx, n_kv, dv), dt)
        q_ref = cpu_.qk_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, neox, k_ref, v_ref, pos)
        k_all, v_all = cp.zeros((n_ctx, n_kv, d), dt), cp.zeros((n_ctx, n_kv, dv), dt)
        dev = (lambda a: None if a is None else cp.asarray(a))  # noqa: E731
        q_got = gpu.qk_rope_store(cp.asarray(q), cp.asarray(k), cp.asarray(v), dev(qw), dev(kw), 1e-6, cp.asarray(cos),
                                  cp.asarray(sin), neox, k_all, v_all, cp.asarray(pos))
        msg = f"seed {seed}, norms {norms}, neox {neox}"
        np.testing.assert_allclose(cp.asnumpy(q_got), q_ref, rtol=1e-5, atol=1e-5, err_msg=msg)
        tol = 1e-3 if kv == "f16" else 1e-5
        np.testing.assert_allclose(cp.asnumpy(k_all).astype(np.float32), k_ref.astype(np.float32), rtol=tol, atol=tol,
                                   err_msg=msg)
        np.testing.assert_array_equal(cp.asnumpy(v_all), v_ref, err_msg=msg)


@pytest.mark.parametrize("window,softcap", [(None, None), (300, None), (None, 30.0), (5, 20.0)])
def test_prompt_masked_softmax_kernel_matches_numpy_twin(gpu, window, softcap, monkeypatch):
    """masked_softmax (the prompt attention's scale, softcap, causal and window mask and softmax in
    one launch) against ArrayOps._masked_softmax in numpy: 700 keys (rows longer than a block's 256
    threads), queries from position 690 over keys from 40 (a window's first key inside the span)."""
    from moecache.backends import NumpyBackend

    seed = _seed()
    rng = np.random.default_rng(seed)
    h, t, n, pos0, start = 6, 50, 700, 690, 40
    assert pos0 + t - start == n
    s = (rng.standard_normal((h, t, n)) * 8).astype(np.float32)
    ref = s.copy()
    NumpyBackend()._masked_softmax(ref, pos0, start, window, 0.09, softcap)
    launched = []
    fn = gpu._fn
    monkeypatch.setattr(gpu, "_fn", lambda name: (launched.append(name), fn(name))[1])
    got = cp.asarray(s)
    gpu._masked_softmax(got, pos0, start, window, 0.09, softcap)
    assert launched == ["masked_softmax"]
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=2e-5, atol=1e-7, err_msg=f"seed {seed}")


@pytest.mark.parametrize("n_tok", [1, 4, 16, 40])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 30.0)])
def test_layer_ops_match_numpy_twin(gpu, n_tok, window, softcap):
    from moecache.backends import NumpyBackend

    seed = _seed()
    rng = np.random.default_rng(seed)
    cpu_ = NumpyBackend()
    n_ctx, n_head, n_kv, d = 64, 8, 2, 128
    pos0 = 20
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_ctx, n_kv, d)).astype(np.float32)
    ref = cpu_.attention(q, k, v, pos0, 0.09, window, softcap)
    got = cp.asnumpy(gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0, 0.09, window, softcap))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=f"attention seed {seed}")
    x = rng.standard_normal((n_tok, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    np.testing.assert_allclose(cp.asnumpy(gpu.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6)),
                               cpu_.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(gpu.rms_norm(cp.asarray(q), None, 1e-6)), cpu_.rms_norm(q, None, 1e-6),
                               rtol=1e-5, atol=1e-6)
    cos = rng.standard_normal((n_tok, 48)).astype(np.float32)
    sin = rng.standard_normal((n_tok, 48)).astype(np.float32)
    for neox in (True, False):
        np.testing.assert_allclose(cp.asnumpy(gpu.rope(cp.asarray(q), cp.asarray(cos), cp.asarray(sin), neox)),
                                   cpu_.rope(q, cos, sin, neox), rtol=1e-5, atol=1e-5)
    for act in ("silu", "gelu"):
        np.testing.assert_allclose(cp.asnumpy(gpu.glu(cp.asarray(x), cp.asarray(x[::-1].copy()), act)),
                                   cpu_.glu(x, x[::-1].copy(), act), rtol=1e-5, atol=1e-6)


PLACEMENTS = [dict(), dict(n_gpu_layers=2), dict(cpu_moe=True), dict(n_cpu_moe=2), dict(n_gpu_layers=5)]


@pytest.mark.parametrize("opts", PLACEMENTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "auto")
def test_placements_equal_cpu(gpu, opts, tmp_path):
    """Full GPU, partial -ngl, --cpu-moe and --n-cpu-moe (with op offload of the 40-token prompt)
    all give the CPU's logits, prompt and decode."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, P["tiny"], seed=5)
    rng = np.random.default_rng(8)
    with Engine(path, EngineConfig(n_ctx=64)) as c, \
            Engine(path, EngineConfig(n_ctx=64), placement=PlacementOptions(**opts), gpu_act_q8=False) as g:
        tokens = rng.integers(0, c.gguf.config.n_vocab, 44)
        assert g.placement is not None and g.placement.devices == [0]
        ref = np.vstack([c.eval(tokens[:40], logits="all")] + [c.eval(tokens[i:i + 1]) for i in range(40, 44)])
        got = np.vstack([g.eval(tokens[:40], logits="all")] + [g.eval(tokens[i:i + 1]) for i in range(40, 44)])
        offloaded = sum(getattr(e, "offloaded_bytes", 0) for e in g.model.experts.executors.values())
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"{opts or 'auto'}: {g.placement.summary()}; rel {rel:.2e}; offloaded {offloaded} B")
    assert np.isfinite(got).all() and rel < 1e-4
    if opts.get("cpu_moe") or opts.get("n_cpu_moe"):
        assert offloaded > 0  # the 40-token prompt ran the host experts on the GPU


def test_two_backends_on_one_gpu_pass_the_hidden_state(gpu, tmp_path):
    """-sm layer's hand-over between GPU backends (here two on device 0; a second GPU if present)."""
    from moecache.backends import NumpyBackend
    from moecache.backends.cupy_backend import CupyBackend, device_count
    from moecache.gguf_file import open_gguf
    from moecache.models import build_model
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, P["tiny"], seed=6)
    other = CupyBackend(1 if device_count() > 1 else 0, act_q8=False)
    with open_gguf(path) as m:
        tokens = np.random.default_rng(9).integers(0, m.config.n_vocab, 10)
        cpu_lm = build_model(m, NumpyBackend())
        ref = cpu_lm.forward(tokens, cpu_lm.new_kv_cache(16), logits="all")
        bes = [gpu, gpu, other, other]
        lm = build_model(m, gpu, layer_backends=bes, output_backend=other)
        got = lm.forward(tokens, lm.new_kv_cache(16), logits="all")
    gpu.activate()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_cuda_graph_decode_equals_op_by_op(gpu, tmp_path):
    """Decode steps replayed from the captured graph give the op-by-op logits at every position,
    and after a reset (the same KV cache) too."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    for preset in ("tiny", "tiny-gemma3"):
        path = tmp_path / f"{preset}.gguf"
        write_model(path, P[preset], seed=7)
        tokens = np.random.default_rng(3).integers(0, 200, 30)
        with Engine(path, EngineConfig(n_ctx=64), placement=PlacementOptions(), cuda_graph=False) as a, \
                Engine(path, EngineConfig(n_ctx=64), placement=PlacementOptions()) as b:
            assert a.model.decode_graph is None and b.model.decode_graph is not None
            for rep in range(2):
                a.reset()
                b.reset()
                ref = np.vstack([a.eval(tokens[:5])] + [a.eval(tokens[i:i + 1]) for i in range(5, 30)])
                got = np.vstack([b.eval(tokens[:5])] + [b.eval(tokens[i:i + 1]) for i in range(5, 30)])
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=preset)
            assert b.model.decode_graph.failed is None and b.model.decode_graph.replays >= 50


@pytest.mark.parametrize("handoff", [True, False])
@pytest.mark.parametrize("placement", [dict(cpu_moe=True), dict(n_cpu_moe=1)])
@pytest.mark.parametrize("preset", ["tiny", "tiny-olmoe"])
def test_cuda_graph_decode_with_cpu_experts_equals_op_by_op(gpu, tmp_path, preset, placement, handoff):
    """--cpu-moe / -ncmoe: CPU-expert layers handed over inside the decode graph (handoff, the
    default) or the graph cut at each of them (segments replayed around the Numba kernel); either
    gives the op-by-op logits at every position, after a reset too."""
    from moecache.backends.cuda_graph import host_expert_layers
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / f"{preset}.gguf"
    write_model(path, P[preset], seed=11)
    tokens = np.random.default_rng(5).integers(0, 200, 24)
    opts = PlacementOptions(n_gpu_layers=99, moe_cache=0, **placement)
    with Engine(path, EngineConfig(n_ctx=64), placement=opts, cuda_graph=False) as a, \
            Engine(path, EngineConfig(n_ctx=64), placement=opts, graph_handoff=handoff) as b:
        host = host_expert_layers(b.model)
        assert a.model.decode_graph is None and b.model.decode_graph is not None and host
        for rep in range(2):
            a.reset()
            b.reset()
            ref = np.vstack([a.eval(tokens[:4])] + [a.eval(tokens[i:i + 1]) for i in range(4, 24)])
            got = np.vstack([b.eval(tokens[:4])] + [b.eval(tokens[i:i + 1]) for i in range(4, 24)])
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=preset)
        g = b.model.decode_graph
        assert g.failed is None and g.replays >= 38
        if handoff:
            hf = g._cap.handoff
            assert not g._cap.cuts and not g._cap.segments
            assert hf.layers == sorted(host) and hf.seq >= 19
            assert (hf.hf.buf.done[hf.layers] == hf.seq).all() and hf.hf.buf.err[0] == 0
        else:
            assert g._cap.handoff is None and len(g._cap.cuts) == len(g._cap.segments) == len(host)


@pytest.mark.parametrize("handoff", [True, False])
def test_cuda_graph_decode_with_cpu_experts_and_a_routing_process(gpu, tmp_path, handoff):
    """-ncmoe under a routing process (``bench --routing``): the decode graph replays (the CPU-expert
    layers read the drawn routes from the graph's buffers) and gives the op-by-op logits. Before,
    every such step ran op by op without a word."""
    from moecache.engine import Engine, EngineConfig
    from moecache.moe.routing_process import make_routing
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import SynthConfig, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, SynthConfig(**{**P["tiny"].__dict__, "n_expert": 16, "n_expert_used": 4}), seed=23)
    opts = PlacementOptions(n_gpu_layers=99, moe_cache=0, n_cpu_moe=1)
    outs = []
    with Engine(path, EngineConfig(n_ctx=64), placement=opts, cuda_graph=False) as a, \
            Engine(path, EngineConfig(n_ctx=64), placement=opts, graph_handoff=handoff) as b:
        for eng in (a, b):
            c = eng.gguf.config
            eng.model.routing_override = make_routing("uniform", c.n_layer, c.n_expert, c.n_expert_used, seed=4)
            outs.append(np.vstack([eng.eval(list(range(1, 6)))] + [eng.eval([t]) for t in range(20, 40)]))
        g = b.model.decode_graph
        assert a.model.decode_graph is None and g.failed is None and g.replays >= 19
        assert (g._cap.handoff is not None) == handoff and g._cap.routes is not None
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5 * np.abs(outs[0]).max())


@pytest.mark.parametrize("t", [1, 3, 16])
def test_handoff_kernels_split_post_and_add(gpu, t):
    """handoff_post / handoff_wait of ops.cu against the host module's rule (split_pairs) and a
    host answer: the CPU's pairs and rows reach the page-locked buffers, the GPU's pairs come back
    with -1 for the CPU's, and the host's sum is added to (or copied into) the output. A layer with
    no share (ncpu 0 with a map) is not served (as the expert cache does): it posts no flag, counts
    its misses, and leaves the output as it was (or zero)."""
    from moecache.backends.handoff_cuda import CudaHandoff
    from moecache.moe import handoff

    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    be = gpu
    n_layer, n_embd, k, n_exp = 4, 64, 8, 32
    hf = CudaHandoff(be, n_layer, 16, n_embd, k)
    stream = cp.cuda.Stream(non_blocking=True)
    for seq, (il, n_cpu, use_map, add) in enumerate([(1, 2, True, True), (3, 0, True, True), (0, 8, False, False),
                                                      (2, 3, True, False), (1, 0, True, False)], start=1):
        ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
        w = rng.random((t, k)).astype(np.float32)
        h = rng.standard_normal((t, n_embd)).astype(np.float32)
        slot_map = np.where(rng.random(n_exp) < 0.5, rng.integers(0, 9, n_exp), -1).astype(np.int32)
        ncpu = np.full(n_layer, n_cpu, np.int32)
        base = rng.standard_normal((t, n_embd)).astype(np.float32)
        want_cpu, want_gpu = handoff.split_pairs(ids, slot_map if use_map else None, n_cpu)
        got = {}

        def compute(il_, hh, cids, ww, out):
            got.update(il=il_, h=hh.copy(), ids=cids.copy(), w=ww.copy())
            out[...] = hh * 2 + il_

        with stream:
            hf.go(seq, stream)
            gids = hf.post(il, cp.asarray(h), cp.asarray(ids), cp.asarray(w),
                           cp.asarray(slot_map) if use_map else None, cp.asarray(ncpu) if use_map else None)
            out = hf.wait(il, cp.asarray(base), add=add)
            n = handoff.serve(hf.buf, [il], seq, compute, timeout_s=20) if n_cpu or not use_map else 0
            res = out.get()
        handoff.check(hf.buf)
        assert hf.buf.count[il] == (want_cpu >= 0).sum() and hf.buf.n_tok[il] == t
        if use_map:
            assert hf.buf.n_miss[il] == (slot_map[ids] < 0).sum()
        assert (hf.buf.flag[il] == seq) == bool(n_cpu or not use_map)  # a share-0 layer posts no flag
        if use_map:
            np.testing.assert_array_equal(gids.get(), want_gpu)
        else:
            assert gids is None
        if (want_cpu >= 0).any():
            assert n == 1 and got["il"] == il
            np.testing.assert_array_equal(got["ids"], want_cpu)
            np.testing.assert_array_equal(got["w"], w)
            np.testing.assert_array_equal(got["h"], h)
            cpu_part = h * 2 + il
        else:
            assert n == 0 and not got
            cpu_part = np.zeros_like(h)
        np.testing.assert_allclose(res, (base if add else 0) + cpu_part, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset,n_ctx,n_prompt", [("tiny", 600, 280), ("tiny-llama", 1200, 1012)])
def test_cuda_graph_decode_across_key_runs(gpu, tmp_path, preset, n_ctx, n_prompt):
    """Decode attention splits the keys into runs (att_splits > 1): a prompt, then decode steps
    replayed from one captured graph as the positions cross run boundaries give the op-by-op
    logits. tiny-llama (head size 64, 2 query heads per KV head) at -c 1200: the graph is captured
    below GQA_MIN_KEYS keys (attn_decode) and replayed past it (attn_gqa), with 8-bit activations."""
    from moecache.backends.cupy_backend import GQA_MIN_KEYS, att_splits, gqa_ok
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    assert att_splits(n_ctx) > 1
    cfg = P[preset]
    crosses = gqa_ok(cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim) and n_ctx > GQA_MIN_KEYS
    assert crosses == (preset == "tiny-llama")
    assert not crosses or n_prompt < GQA_MIN_KEYS < n_prompt + 40
    path = tmp_path / f"{preset}.gguf"
    write_model(path, cfg, seed=5)
    tokens = np.random.default_rng(4).integers(0, 200, n_prompt + 40)
    with Engine(path, EngineConfig(n_ctx=n_ctx), placement=PlacementOptions(), cuda_graph=False) as a, \
            Engine(path, EngineConfig(n_ctx=n_ctx), placement=PlacementOptions()) as b:
        steps = range(n_prompt, n_prompt + 40)
        ref = np.vstack([a.eval(tokens[:n_prompt])] + [a.eval(tokens[i:i + 1]) for i in steps])
        got = np.vstack([b.eval(tokens[:n_prompt])] + [b.eval(tokens[i:i + 1]) for i in steps])
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert b.model.decode_graph.failed is None and b.model.decode_graph.replays >= 39


def test_pinned_weights_give_the_same_logits(gpu, tmp_path):
    """--load-mode pin: weights copied to page-locked memory, host experts offloaded from there by
    one DMA copy per tensor (a 40-token prompt uses every expert of the tiny model)."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, P["tiny"], seed=12)
    tokens = np.random.default_rng(13).integers(0, 200, 42)
    opts = PlacementOptions(cpu_moe=True)
    with Engine(path, EngineConfig(n_ctx=64)) as c, \
            Engine(path, EngineConfig(n_ctx=64), placement=opts, load_mode="pin", gpu_act_q8=False) as g:
        assert g.pinned is not None and g.pinned.nbytes >= g.gguf.n_bytes
        ref = np.vstack([c.eval(tokens[:40], logits="all"), c.eval(tokens[40:41]), c.eval(tokens[41:])])
        got = np.vstack([g.eval(tokens[:40], logits="all"), g.eval(tokens[40:41]), g.eval(tokens[41:])])
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("load_mode", ["pin", "mmap"])
def test_prefetched_host_expert_layers_give_the_same_logits(gpu, tmp_path, load_mode):
    """Engine(prefetch_experts=True) with --cpu-moe: each offloaded prompt ubatch copies the next
    layer's experts on the copy stream while the current layer computes (moecache/moe/prefetch.py).
    Three 40-token ubatches and decode steps give the CPU's logits and the plain offload's; with
    pinned weights every layer after the first computes from the upload begun during the layer
    before; a mapped file cannot be copied asynchronously and uploads as before. The copy stream
    is held up by a 300 ms spin kernel before the prompt, so every upload lands long after the
    compute stream reaches its layer: only the compute stream's wait for the copy's event
    (finish_upload) keeps the logits right."""
    import cupy as cp

    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, P["tiny"], seed=14)
    tokens = np.random.default_rng(15).integers(0, 200, 124)
    cfg = EngineConfig(n_ctx=160, n_batch=120, n_ubatch=40)
    opts = PlacementOptions(cpu_moe=True)
    outs = {}
    with Engine(path, cfg) as c:
        ref = np.vstack([c.eval(tokens[:120], logits="all")] + [c.eval(tokens[i:i + 1]) for i in range(120, 124)])
    for prefetch in (False, True):
        with Engine(path, cfg, placement=opts, load_mode=load_mode, gpu_act_q8=False, prefetch_experts=prefetch) as g:
            if prefetch:
                be = next(e.offload_backend for e in g.model.experts.executors.values() if hasattr(e, "prefetch"))
                with cp.cuda.Device(be.device):
                    cp.get_default_memory_pool().free_all_blocks()  # no block still holding the other engine's experts
                    spin = cp.RawKernel('extern "C" __global__ void spin(long long n) '
                                        '{ long long t0 = clock64(); while (clock64() - t0 < n) {} }', "spin")
                    with be._copies():  # RawKernel launches on the current stream
                        spin((1,), (1,), (np.int64(600_000_000),))  # ~300 ms at ~2 GHz
            outs[prefetch] = np.vstack([g.eval(tokens[:120], logits="all")]
                                       + [g.eval(tokens[i:i + 1]) for i in range(120, 124)])
            shared = {id(e.prefetch): e.prefetch for e in g.model.experts.executors.values()
                      if getattr(e, "prefetch", None) is not None}
            n_host = sum(1 for e in g.model.experts.executors.values() if hasattr(e, "offloaded_bytes"))
    assert len(shared) == 1 and n_host >= 2
    pf = next(iter(shared.values()))
    print(f"{load_mode}: started {pf.started}, used {pf.used}, dropped {pf.dropped}, {pf.bytes} B")
    assert pf.started == pf.used == (3 * (n_host - 1) if load_mode == "pin" else 0) and pf.dropped == 0
    for got in outs.values():
        assert np.isfinite(got).all() and np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    np.testing.assert_allclose(outs[True], outs[False], rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@contextlib.contextmanager
def _cache_pair(tmp_path, seed: int, load_mode: str, policy_config, synth: dict | None = None, n_ctx: int = 128,
                **engine_kw):
    """A tiny qwen3moe of 16 experts (top-4) written with ``seed`` (``synth``: SynthConfig fields
    changed): a CPU engine, and a GPU engine whose --vram-budget leaves its expert cache a third of
    the experts (taken after the first engine's start), float32 activations; both at ``-c n_ctx``."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import SynthConfig, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, SynthConfig(**{**P["tiny"].__dict__, "n_expert": 16, "n_expert_used": 4, **(synth or {})}),
                seed=seed)
    with Engine(path, EngineConfig(n_ctx=n_ctx)) as ref, \
            Engine(path, EngineConfig(n_ctx=n_ctx), placement=PlacementOptions(vram_budget=third_of_experts_budget(path, n_ctx)),
                   load_mode=load_mode, policy_config=policy_config, gpu_act_q8=False, **engine_kw) as eng:
        yield ref, eng


CHURN = dict(window=4, min_residency=1, hysteresis=0.0, t_upload=1e-9)  # admit eagerly: the cache churns


@pytest.mark.parametrize("load_mode", ["mmap", "pin", "pin-staged", "pin-ahead", "pin-split", "pin-plan"])
def test_expert_cache_on_the_gpu_matches_cpu_while_churning(gpu, tmp_path, load_mode):
    """The expert cache with real streams: a --vram-budget that leaves room for a third of the
    experts; every decode step's logits equal the CPU's while experts are uploaded and evicted.
    mmap: misses on the CPU (hybrid, op by op); pin: misses read zero-copy, decode as a CUDA graph;
    pin-staged: misses copied into a VRAM scratch by stage_misses first. Prompt ubatches bring their
    experts three at a time (the groups, the default: each group one call on the whole ubatch with
    the other pairs marked -1, its copy on the copy stream while the group before computes (pin);
    the opt-in prompt_stacks are test_prompt_stacks_on_the_gpu_match_cpu's); pin: without
    prompt_group_ahead; pin-ahead: with it (on by default since the eighteenth session: the next
    layer's first group copied during this layer, into the group buffer kept free for it); the
    first decode step after the prompt fills the empty slots with the prompt's most-used experts; a
    last prompt reads the resident experts in their slots. pin-split: miss_split, with the CPU held
    at two misses per token (never judged late), so the graph's handoffs run on every layer.
    pin-plan: --cache-plan layer, the link priced out so that every layer with misses sends them
    all to the CPU through the graph's handoff, the plan remade every 4 tokens."""
    stage = load_mode == "pin-staged"
    ahead = load_mode == "pin-ahead"
    split = load_mode == "pin-split"
    planned = load_mode == "pin-plan"
    load_mode = load_mode.removesuffix("-staged").removesuffix("-ahead").removesuffix("-split").removesuffix("-plan")
    from moecache.moe.policy import PolicyConfig

    rng = np.random.default_rng(5)
    cfg = PolicyConfig(**CHURN, layer_plan=True, t_link=1e-3) if planned else PolicyConfig(**CHURN)
    with _cache_pair(tmp_path, 21, load_mode, cfg, stage_misses=stage, miss_split=split) as (ref, eng):
        cache = eng.caches[0]
        assert (cache.handoff is not None) == (split or planned) and cache.policy.layer_plan == planned
        if split:
            cache.split.ncpu[:] = 2
            cache.split.late_ns = 10**15
            cache._ncpu_dirty = True
        cache.prompt_stacks = False  # the groups, the default (the stacks: test_prompt_stacks_on_the_gpu_match_cpu)
        cache.prompt_group_bytes = 3 * cache._expert_bytes(next(iter(cache.layers.values())))
        cache.prompt_group_ahead = ahead
        cache.prompt_keep = False  # the fill after the prompt from empty slots (keeps: test_prompt_keeps_on_the_gpu_match_cpu)
        assert (cache.scratch is not None) == stage
        assert len(eng.caches) == 1 and eng.placement.cache_slots[0][1] > 0
        assert cache.zero_copy == (load_mode == "pin")
        assert (eng.model.decode_graph is not None) == (load_mode == "pin")
        # the warm-up token's eager admissions may have filled every slot: start from empty slots (a
        # start-up preload with no usage), so the first decode step after the prompt has slots to fill
        cache.preload(np.zeros_like(cache.policy.usage))
        assert cache.policy.n_resident == 0 and (cache.slot_of < 0).all()
        toks = rng.integers(0, 200, 40)
        np.testing.assert_allclose(eng.eval(toks), ref.eval(toks), rtol=1e-4, atol=1e-4)
        used = int((cache.policy.usage > 0).sum())  # experts the prompt used (its ubatch admitted none)
        assert used > 0 and cache.policy.n_resident == 0
        for step in range(50):
            t = [int(rng.integers(0, 200))] if step % 7 != 1 else list(rng.integers(0, 200, 3))
            a, b = eng.eval(t), ref.eval(t)
            assert np.isfinite(a).all()
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=f"step {step}")
            if step == 0:  # the first decode step after the prompt (one token: on pin, the graph's capture
                # step) filled the empty slots with the prompt's most-used experts
                print(f"{load_mode}: {eng.placement.cache_slots[0][1]} slots, the prompt used {used} experts, "
                      f"{cache.prompt_fills} loaded after it")
                if planned:  # the plan made from the prompt's usage, in slots
                    assert cache.prompt_fills == cache.policy.plan.target.sum() > 0
                else:
                    assert cache.prompt_fills == min(used, eng.placement.cache_slots[0][1])
        s = cache.stats
        assert s.hits > 0 and s.misses > 0
        assert planned or s.uploads > eng.placement.cache_slots[0][1]
        if planned:  # the plan's CPU layers' misses went to the CPU inside the replayed graphs
            print(f"plans {cache.policy.plans}, slots {cache.policy.plan.slots.tolist()}, cpu misses {s.cpu_misses}")
            assert cache.policy.plans >= 1 and cache.split.planned and s.cpu_misses > 0
            np.testing.assert_array_equal(cache.split.ncpu, cache.policy.plan.share)
            assert set(cache.policy.plan.share.tolist()) <= {0, 4}  # the link priced out: all or nothing
            assert cache.handoff.buf.err[0] == 0
        if stage:  # the scratch starts zeroed: staged misses wrote into it
            assert bool(cache.scratch[0].any()) and bool(cache.scratch[2].any())
        if split:  # the replays handed misses to the CPU on every cached layer
            assert s.cpu_misses > 0 and cache._split_layers == sorted(cache.cached_layers)
            assert cache.handoff.buf.err[0] == 0
        if load_mode == "pin":
            assert eng.model.decode_graph.failed is None and eng.model.decode_graph.replays >= 40
        # a new sequence's prompt with the resident experts read in their slots (the cache
        # keeps its residents across reset())
        reads, resident = cache.prompt_slot_reads, int((cache.slot_of >= 0).sum())
        ref.reset()
        eng.reset()
        toks = rng.integers(0, 200, 40)
        b = ref.eval(toks)
        np.testing.assert_allclose(eng.eval(toks), b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
        assert resident > 0 and cache.prompt_slot_reads > reads
        if ahead:  # every prompt layer after a pass's first took its first group from a copy ahead
            started, used, dropped = cache.group_prefetch
            assert started > 0 and used == started and dropped == 0


@pytest.mark.parametrize("load_mode", ["mmap", "pin"])
def test_elastic_slots_on_the_gpu_match_cpu(gpu, tmp_path, load_mode, monkeypatch):
    """Elastic slots over CUDA virtual memory: the last sixth of the experts' worth of slots gives
    its memory back to the driver for each prompt pass and maps it again for decode. Logits equal
    the CPU's through prompt, decode, prompt, decode (on pin: the decode graph, captured while the
    slots are held, replayed after their memory went and came back at the same addresses)."""
    import moecache.placement as placement_mod
    from moecache.moe.cache import LENT
    from moecache.moe.policy import PolicyConfig

    orig = placement_mod._elastic_slots
    box = {}

    def sized(opts, sizes, dev, on_dev, cache, reserve, notes):  # a sixth of the experts, not the whole reserve
        box["want"] = want = sum(sizes.experts) // sizes.expert_each // 6
        keep = placement_mod.DECODE_KEEP_BYTES
        return orig(replace(opts, elastic_slots=True), sizes, dev, on_dev, cache,
                    {g: keep + want * sizes.expert_each for g in reserve}, notes)

    monkeypatch.setattr(placement_mod, "_elastic_slots", sized)
    rng = np.random.default_rng(8)
    # experts of 272 KiB (Q8_0, 1024 x 256): ten of them are more than the driver's 2 MiB granularity,
    # so memory really goes and comes back (a tiny model's whole slot array is less than one unit)
    big = dict(n_embd=256, expert_ff=1024, expert_type="Q8_0")
    with _cache_pair(tmp_path, 23, load_mode, PolicyConfig(**CHURN), synth=big) as (ref, eng):
        cache = eng.caches[0]
        # a sixth of the experts, or every expert the plain slots left out (the budget is taken from
        # the memory free after the first engine's start, which earlier tests' pools may shrink)
        assert 0 < cache.tail <= box["want"] and eng.placement.elastic_slots == ((0, cache.tail),)
        n = len(cache.pool.owner)
        lo = n - cache.tail

        def step(toks):
            a, b = eng.eval(toks), ref.eval(toks)
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())

        for round_ in range(2):
            before = cache.tail_reclaims
            step(rng.integers(0, 200, 40))
            assert cache._tail_lent and all(o is LENT for o in cache.pool.owner[lo:])
            assert not (cache.slot_of >= lo).any()
            for _ in range(16):
                step([int(rng.integers(0, 200))])
            # taken back, all or (under the pair's budget, less the decode margin) the first ones
            live = cache._live
            assert live > 0 and cache.tail_reclaims > before and cache._elastic.live == live
            assert all(o is LENT for o in cache.pool.owner[lo + live:])
            assert any(o not in (None, LENT) for o in cache.pool.owner[lo:lo + live])
        el = cache._elastic
        print(f"{load_mode}: {cache.tail} elastic of {n} slots, {el.bytes} bytes come and go, {live} came back")
        # (the set counts memory that went and came; the cache also counts the slots the head's rounding keeps)
        assert el.lends >= 2 and cache.tail_lends >= 2 and el.take_backs >= 2 and el.bytes > 0
        assert cache.stats.uploads > 0


def test_serves_pattern_with_the_layer_plan_and_elastic_slots_on_the_gpu(gpu, tmp_path, monkeypatch):
    """serve's defaults on the GPU (pin: the layer plan's CPU shares through the graphs' handoff,
    elastic slots over CUDA virtual memory, batched decode graphs): three slots whose new requests'
    prompts arrive while the others decode in passes of 1-3 tokens (SERVE_STEPS); every prompt's and
    pass's logits equal the CPU engine's on the same schedule; the prompts lent the elastic slots and
    later passes took them back; the batched graphs replayed without a failure."""
    import moecache.placement as placement_mod
    from moecache.moe.policy import PolicyConfig
    from moecache.testing.fidelity import serve_steps

    orig = placement_mod._elastic_slots

    def sized(opts, sizes, dev, on_dev, cache, reserve, notes):  # a sixth of the experts (as the test above)
        want = sum(sizes.experts) // sizes.expert_each // 6
        return orig(replace(opts, elastic_slots=True), sizes, dev, on_dev, cache,
                    {g: placement_mod.DECODE_KEEP_BYTES + want * sizes.expert_each for g in reserve}, notes)

    monkeypatch.setattr(placement_mod, "_elastic_slots", sized)
    seed = _seed()
    big = dict(n_embd=256, expert_ff=1024, expert_type="Q8_0")
    cfg = PolicyConfig(**CHURN, layer_plan=True, t_link=1e-3)  # the link priced out: the plan gives the CPU shares
    with _cache_pair(tmp_path, 29, "pin", cfg, synth=big, n_ctx=240) as (ref, eng):
        cache = eng.caches[0]
        graph = eng.model.decode_graph
        assert cache.tail > 0 and cache.handoff is not None and graph is not None and graph.batched

        def check(a, b, what):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=what)
        lends, reclaims, replays = cache.tail_lends, cache.tail_reclaims, graph.batched_replays
        assert serve_steps((eng, ref), np.random.default_rng(seed), 200, check) == 19
        cache.flush()
        print(f"seed {seed}: lends {cache.tail_lends - lends}, take-backs {cache.tail_reclaims - reclaims}, batched replays "
              f"{graph.batched_replays}, replays {graph.replays}, cpu misses {cache.stats.cpu_misses}")
        assert cache.tail_lends - lends >= 3 and cache.tail_reclaims - reclaims >= 3
        # every pass of 1-3 slots replayed its batch size's graph (19 of 19 on the H200, h200-s32b)
        assert not graph.batched_failed and graph.failed is None and graph.batched_replays - replays == 19
        assert cache.stats.cpu_misses > 0 and cache.handoff.buf.err[0] == 0


@pytest.mark.parametrize("mode", ["plan", "split"])
def test_batched_decode_in_halves_on_the_gpu_matches_cpu(gpu, tmp_path, mode):
    """Batched decode graphs of 4-6 slots with the CPU's share of the misses run in two halves
    (DecoderLM._body_halves: each half posts to its own handoff, the host answers them in turn):
    every step's logits equal the CPU engine's while the cache churns; the graphs were captured in
    halves and the second half's handoff was answered; with decode_halves off the next steps
    recapture in one pass and still agree. plan: --cache-plan layer with the link priced out;
    split: --miss-split held at two misses per token on every layer."""
    from moecache.moe.cache import HALVES_MIN_TOKENS
    from moecache.moe.policy import PolicyConfig

    seed = _seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    cfg = PolicyConfig(**CHURN, layer_plan=True, t_link=1e-3) if mode == "plan" else PolicyConfig(**CHURN)
    with _cache_pair(tmp_path, 23, "pin", cfg, n_ctx=6 * 40, miss_split=mode == "split") as (ref, eng):
        cache = eng.caches[0]
        graph = eng.model.decode_graph
        assert cache.handoff_b is not None and graph is not None and graph.batched and not cache.decode_halves
        cache.decode_halves = True  # (opt-in)
        if mode == "split":
            cache.split.ncpu[:] = 2
            cache.split.late_ns = 10**15
            cache._ncpu_dirty = True
        seqs = [e.sequences(6) for e in (eng, ref)]
        for i in range(6):
            p = rng.integers(0, 200, int(rng.integers(2, 6)))
            for e, q in zip((eng, ref), seqs):
                e.eval(p, kv=q[i])
        slots_of = [tuple(range(6)), (0, 1, 2, 3), (1, 2, 3, 4, 5), tuple(range(6)), (0, 2, 4, 5)] * 3
        last = [tuple(range(6)), (0, 1, 2, 3), tuple(range(6))]  # one pass: a new capture per batch size
        for j, slots in enumerate(slots_of + last):
            if j == len(slots_of):
                assert {b: c.halves for b, c in graph._batched.items()} == {6: True, 4: True, 5: True}
                hb = cache.handoff_b.buf  # the last pass's second half: posted, and answered where it had pairs
                answered = hb.count > 0
                assert hb.flag.max() > 0 and answered.any() and (hb.done[answered] == hb.flag[answered]).all()
                cache.decode_halves = False
            toks = rng.integers(0, 200, len(slots))
            a, b = (e.decode(toks, [q[s] for s in slots]) for e, q in zip((eng, ref), seqs))
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=f"step {j} {slots}")
        cache.flush()
        assert not graph.batched_failed and graph.batched_replays == len(slots_of) + len(last)
        assert {b: c.halves for b, c in graph._batched.items()} == {6: False, 4: False, 5: True}
        assert HALVES_MIN_TOKENS <= 4 and cache.stats.cpu_misses > 0
        assert cache.handoff.buf.err[0] == 0 and cache.handoff_b.buf.err[0] == 0
        print(f"{mode}: cpu misses {cache.stats.cpu_misses}, hits {cache.stats.hits}, misses {cache.stats.misses}")


def test_elastic_slot_arrays_give_memory_back_at_the_same_addresses(gpu):
    """CupyBackend.elastic_slot_arrays: lending gives the tail's memory to the driver (free memory
    grows by its bytes) and the head keeps its bytes; taking it back maps memory at the same
    addresses (kernels write and read there again); a take-back under a limit maps the first
    slots that fit."""
    import cupy as cp

    be = gpu
    slot = (1 << 20) + 4096  # slot sizes need not be multiples of the granularity
    (a, b), el = be.elastic_slot_arrays(((40, slot), (40, 3 * 4096)), 20)
    assert a.shape == (40, slot) and int(a.sum()) == 0 and b.flags.c_contiguous
    ptr = a.data.ptr
    a[:20] = 7
    a[20:] = 9
    assert el.bytes >= 20 * slot - (4 << 20)
    cp.cuda.Device().synchronize()
    free0 = cp.cuda.runtime.memGetInfo()[0]
    el.lend()
    assert not el.mapped and cp.cuda.runtime.memGetInfo()[0] - free0 >= el.bytes - (2 << 20)
    assert int((a[:19] == 7).all()) == 1  # the head keeps its bytes
    low = el.live  # the slots the head's rounding to 2 MiB covers
    free, total = cp.cuda.runtime.memGetInfo()
    live = el.take_back(total - free + el.bytes // 2)  # room for about half: the first pieces that fit
    assert low < live < 20 and not el.mapped and el.take_backs == 1
    assert free - cp.cuda.runtime.memGetInfo()[0] <= el.bytes // 2
    a[20:20 + live] = 3  # the slots taken back are memory again
    assert int((a[20:20 + live] == 3).all()) == 1
    assert el.take_back(None) == 20 and el.mapped and el.take_backs == 2 and a.data.ptr == ptr
    a[20:] = 5
    assert int((a[20:] == 5).all()) == 1 and int((a[:19] == 7).all()) == 1
    del a, b, el


def _hold_copy_stream(be) -> None:
    """Queue a spin kernel of ~300 ms (at ~2 GHz) on backend ``be``'s copy stream: copies queued
    after it land late, so only the compute stream's waits keep a test's reads right."""
    import cupy as cp

    spin = cp.RawKernel('extern "C" __global__ void spin(long long n) '
                        '{ long long t0 = clock64(); while (clock64() - t0 < n) {} }', "spin")
    with cp.cuda.Device(be.device), be._copies():
        spin((1,), (1,), (np.int64(600_000_000),))


@pytest.mark.parametrize("load_mode", ["pin", "mmap"])
@pytest.mark.parametrize("stacks", [2, 1, 0, "halves"])
def test_prompt_stacks_on_the_gpu_match_cpu(gpu, tmp_path, load_mode, stacks):
    """The expert cache's prompt ubatches on the GPU: with prompt_stacks (opt-in) each layer is
    computed from a stack of its experts (residents copied from their slots on the device, the rest
    from the host); with two stack buffers the next layer's non-resident experts are copied on the
    copy stream ahead (pin only: a mapped file copies each layer's own), with one (the stacks'
    default) each layer copies its own; without stacks (0, the default), the groups of three experts
    (pin: two group buffers, the next group copied on the copy stream while one computes); with one buffer in
    halves (prompt_stack_halves, opt-in) the next layer's half is copied while the other half
    computes. Two 40-token prompts and decode steps give the CPU's logits. The copy stream is held
    up by a 300 ms spin kernel before each prompt, so only the compute stream's wait for the copy
    keeps them right."""
    from moecache.moe.policy import PolicyConfig

    rng = np.random.default_rng(7)
    with _cache_pair(tmp_path, 23, load_mode, PolicyConfig(**CHURN)) as (ref, eng):
        cache = eng.caches[0]
        halves = stacks == "halves"
        stacks = 1 if halves else stacks
        cache.prompt_stacks = stacks > 0
        cache.prompt_stack_buffers = max(stacks, 1)
        cache.prompt_stack_halves = halves
        cache.prompt_group_bytes = 3 * cache._expert_bytes(next(iter(cache.layers.values())))
        be = cache.be
        for rep in range(2):
            ref.reset()
            eng.reset()
            _hold_copy_stream(be)
            toks = rng.integers(0, 200, 40)
            b = ref.eval(toks)
            np.testing.assert_allclose(eng.eval(toks), b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
            for i in range(3):
                t = [int(rng.integers(0, 200))]
                b = ref.eval(t)
                np.testing.assert_allclose(eng.eval(t), b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
        started, used, dropped = cache.stack_prefetch
        n = len(cache.cached_layers)
        print(f"{load_mode} stacks={stacks}: copies ahead started {started}, used {used}, dropped {dropped}; "
              f"{cache.prompt_slot_reads} slot reads")
        assert (len(cache._bufs) == stacks) if stacks else cache._bufs is None  # the stacks did run
        assert started == used and dropped == 0
        assert (0 < started <= 2 * (n - 1) * (1 + halves)) if (stacks == 2 or halves) and load_mode == "pin" \
            else started == 0
        assert cache.prompt_slot_reads > 0


@pytest.mark.parametrize("load_mode", ["pin", "mmap"])
def test_prompt_keeps_on_the_gpu_match_cpu(gpu, tmp_path, load_mode):
    """prompt_keep (on by default) on the GPU: from empty slots, a 40-token prompt leaves experts it
    copied in the slots (copied on the device from the group buffers after each group's call; pin:
    the groups' copies on the copy stream, held up by a 300 ms spin kernel, so only the compute
    stream's waits keep the order); each kept slot then holds its expert's bytes; a second prompt
    right after it reads them from their slots; both prompts and the decode steps after them (the
    first of which chooses the slots again by usage) give the CPU's logits."""
    import cupy as cp

    from moecache.moe.policy import PolicyConfig

    rng = np.random.default_rng(29)
    with _cache_pair(tmp_path, 23, load_mode, PolicyConfig(**CHURN)) as (ref, eng):
        cache = eng.caches[0]
        assert cache.prompt_keep
        cache.prompt_group_bytes = 3 * cache._expert_bytes(next(iter(cache.layers.values())))
        cache.preload(np.zeros_like(cache.policy.usage))  # every slot empty
        be = cache.be
        for rep in range(2):
            ref.reset()
            eng.reset()
            _hold_copy_stream(be)
            reads = cache.prompt_slot_reads
            toks = rng.integers(0, 200, 40)
            b = ref.eval(toks)
            np.testing.assert_allclose(eng.eval(toks), b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
            if rep == 0:
                kept = [(int(il), int(x)) for il, x in zip(*np.nonzero(cache._kept))]
                assert cache.prompt_keeps == len(kept) > 0 and reads == cache.prompt_slot_reads == 0
                for il, x in kept:
                    sl = int(cache.slot_of[il, x])
                    e = cache.layers[il]
                    for pool_arr, w in zip((cache.pool.gate, cache.pool.up, cache.pool.down), (e.gate, e.up, e.down)):
                        assert np.array_equal(cp.asnumpy(pool_arr[sl]), w[x])
            else:
                assert cache.prompt_slot_reads > reads  # the second prompt read the kept experts' slots
        for i in range(3):
            t = [int(rng.integers(0, 200))]
            b = ref.eval(t)
            np.testing.assert_allclose(eng.eval(t), b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
        assert not cache._kept.any()  # the first decode pass chose the slots again


def test_routing_process_in_the_decode_graph_matches_op_by_op(gpu, tmp_path):
    """--routing with graph decode: the process is drawn per replay in the op-by-op order, so graph and
    op-by-op decoding give the same logits at every step (on the zero-copy path a hit and a miss run
    the same arithmetic, so copy timings cannot change them). The graph engine's process also
    draws its prompt passes ahead on a worker thread (``draw_passes_ahead``, as moecache.load sets
    it on a GPU): the same logits too."""
    from moecache.engine import Engine, EngineConfig
    from moecache.moe.routing_process import make_routing
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import SynthConfig, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, SynthConfig(**{**P["tiny"].__dict__, "n_expert": 16, "n_expert_used": 4}), seed=22)
    engines = [Engine(path, EngineConfig(n_ctx=64),
                      placement=PlacementOptions(vram_budget=third_of_experts_budget(path, 64)),  # after the first's start
                      load_mode="pin", cuda_graph=g) for g in (False, True)]
    try:
        outs = []
        for eng in engines:
            c = eng.gguf.config
            eng.model.routing_override = make_routing("qwen3-moe", c.n_layer, c.n_expert, c.n_expert_used, seed=3)
            eng.model.routing_override.draw_passes_ahead = eng is engines[1]
            outs.append(np.vstack([eng.eval(list(range(1, 9))), eng.eval(list(range(9, 17)))]
                                  + [eng.eval([int(t)]) for t in range(20, 45)]))
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5 * np.abs(outs[0]).max())
        assert engines[1].model.decode_graph.replays >= 20 and engines[0].model.decode_graph is None
    finally:
        for eng in engines:
            eng.close()


def test_the_rope_table_outlives_a_recaptured_decode_graph(gpu, tmp_path):
    """The RoPE table (made at the first step, which is the decode graph's warm-up in Engine's own
    warm-up, under that graph's private memory pool) stays valid after the graph is captured again
    (here: a routing process set afterwards) and the first graph's pool is gone: its memory comes
    from the default pool. Before, the table pointed into freed memory from then on."""
    import gc

    from moecache.engine import Engine, EngineConfig
    from moecache.moe.routing_process import make_routing
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import SynthConfig, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, SynthConfig(**{**P["tiny"].__dict__, "n_expert": 16, "n_expert_used": 4}), seed=25)
    with Engine(path, EngineConfig(n_ctx=64), placement=PlacementOptions(vram_budget=third_of_experts_budget(path, 64)),
                load_mode="pin", cuda_graph=True) as eng:
        c = eng.gguf.config
        eng.model.routing_override = make_routing("qwen3-moe", c.n_layer, c.n_expert, c.n_expert_used, seed=3)
        eng.eval([1, 2, 3])
        for t in range(4, 8):
            eng.eval([t])
        gc.collect()
        bes = {id(b): b for b in eng.model.layer_be}.values()
        tables = [a for be in bes for a in getattr(be, "_inv_freq", {}).values()]
        assert tables and eng.model.decode_graph.replays >= 3
        assert all(a.data.mem.pool() is not None for a in tables)  # its pool is alive


def test_a_closed_cache_leaves_no_slot_copy_in_flight(gpu, tmp_path):
    """Engine.close waits for the expert cache's slot copies still queued on the copy stream (held up
    here by a ~0.5 s spin kernel), so once the engine is gone the slots' memory, which CuPy's pool
    hands to the next arrays of the compute stream, is not written afterwards. Before, the copies
    landed in whatever was allocated there next: a later test's engine went wrong in the whole
    suite only (session 13)."""
    import gc

    import cupy as cp

    from moecache.engine import Engine, EngineConfig
    from moecache.moe.policy import Admission
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import SynthConfig, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, SynthConfig(**{**P["tiny"].__dict__, "n_expert": 16, "n_expert_used": 4}), seed=26)
    cp.get_default_memory_pool().free_all_blocks()  # the slots get blocks of their own, not pieces of older ones
    # op by op: freeing a decode graph's pool (cudaFree) would wait for the device and hide the race
    budget = third_of_experts_budget(path, 64)
    eng = Engine(path, EngineConfig(n_ctx=64), placement=PlacementOptions(vram_budget=budget), load_mode="pin",
                 cuda_graph=False)
    cache = eng.caches[0]
    be, pool = cache.be, cache.pool
    sizes = [int(a.nbytes) for a in (pool.gate, pool.up, pool.down)]
    ptrs = {a.data.ptr for a in (pool.gate, pool.up, pool.down)}
    il = min(cache.cached_layers)
    absent = [int(e) for e in np.flatnonzero(cache.slot_of[il] < 0)][:3]
    spin = cp.RawKernel('extern "C" __global__ void spin(long long n) '
                        '{ long long t0 = clock64(); while (clock64() - t0 < n) {} }', "spin")
    with cp.cuda.Device(be.device), be._copies():
        spin((1,), (1,), (np.int64(1_000_000_000),))  # ~0.5 s at ~2 GHz
    victims = [own for own in pool.owner if own is not None][:len(absent)]
    fill = victims + [None] * (len(absent) - len(victims))
    cache._apply([Admission(il, e, v) for e, v in zip(absent, fill)])
    assert cache._pending and not be._copies().done  # copies queued behind the spin
    eng.close()
    assert be._copies().done  # the copies (and the spin before them) finished before close returned
    del eng, cache, pool
    gc.collect()
    with cp.cuda.Device(be.device):
        new = [cp.zeros(n, cp.uint8) for n in sizes]  # the compute stream's free blocks: the slots'
        cp.cuda.Device(be.device).synchronize()
        reused = sum(a.data.ptr in ptrs for a in new)
        print(f"{reused} of {len(new)} new arrays took a slot array's memory")
        assert all(not bool(a.any()) for a in new)


def _pinned_q4k_layer(rng, n_exp: int, ff: int, d: int):
    """A layer's Q4_K experts (gate, up (n_exp, ff, d); down (n_exp, d, ff)) in page-locked memory,
    five of them resident in the first slots of a pool with two garbage slots after: (host arrays,
    slot map int32 (n_exp,), pool as device arrays, the resident experts)."""
    import cupy as cp
    import cupyx

    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    host = []
    for rows, n_in in ((ff, d), (ff, d), (d, ff)):
        w = np.stack([random_rows(FORMATS["Q4_K"], rows, n_in, rng, std=0.05) for _ in range(n_exp)])
        pinned = cupyx.empty_pinned(w.shape, np.uint8)
        pinned[...] = w
        host.append(pinned)
    slot_map = np.full(n_exp, -1, np.int32)
    resident = rng.choice(n_exp, 5, replace=False)
    slot_map[resident] = np.arange(5)
    pool = tuple(cp.asarray(np.concatenate([a[resident], np.full((2, *a.shape[1:]), 0xFF, np.uint8)])) for a in host)
    return host, slot_map, pool, resident


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("act_q8", [False, True])
def test_pairs_of_no_expert_add_nothing_in_moe_ffn_cached(gpu, act_q8, staged):
    """moe_ffn_cached with some pairs of id -1 (the host handoff gives those to the CPU): the result
    equals the same routing with those pairs' weights 0, hits and misses among the rest, and the
    CPU twin (NumpyBackend.moe_ffn_cached) agrees."""
    import cupy as cp

    from moecache.backends import NumpyBackend
    from moecache.backends.cupy_backend import CupyBackend
    from moecache.moe.routing import Routing
    from moecache.quants.formats import FORMATS

    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    fmt, n_exp, ff, d, k, t = FORMATS["Q4_K"], 12, 256, 512, 4, 3
    host, slot_map, pool, _ = _pinned_q4k_layer(rng, n_exp, ff, d)
    be = CupyBackend(0, act_q8=act_q8)
    scratch = tuple(cp.full((t * k, *a.shape[1:]), 0xFF, cp.uint8) for a in host) if staged else None
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.dirichlet(np.ones(k), t).astype(np.float32)
    none = rng.random((t, k)) < 0.4
    none[0, 0] = True
    h = rng.standard_normal((t, d)).astype(np.float32)
    types = (fmt.ggml_type,) * 3
    smap = cp.asarray(slot_map)

    def run(i, w_):
        return be.moe_ffn_cached(pool, types, Routing(cp.asarray(i), cp.asarray(w_)), cp.asarray(h), "silu", smap,
                                 tuple(host), scratch).get()

    got = run(np.where(none, -1, ids).astype(np.int32), wts)
    want = run(ids, np.where(none, 0.0, wts).astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    twin = NumpyBackend(act_q8=act_q8).moe_ffn_cached(
        tuple(np.asarray(a.get()) for a in pool), types, Routing(np.where(none, -1, ids).astype(np.int32), wts), h,
        "silu", slot_map, tuple(host), tuple(np.zeros(a.shape, np.uint8) for a in scratch) if staged else None)
    assert np.linalg.norm(got - twin) / np.linalg.norm(twin) < (1e-3 if act_q8 else 1e-4)


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("act_q8", [False, True])
def test_staged_misses_give_the_same_output_as_direct_reads(gpu, t, act_q8):
    """moe_ffn_cached with the stage_misses copy kernel against direct zero-copy reads and the CPU:
    Qwen3-30B-shaped Q4_K experts (2048 x 768) in page-locked memory, a random slot map."""
    import cupy as cp

    from moecache.backends.cupy_backend import CupyBackend
    from moecache.moe.routing import Routing
    from moecache.quants import cpu
    from moecache.quants.formats import FORMATS

    rng = np.random.default_rng(40 + t)
    fmt, n_exp, ff, d, k = FORMATS["Q4_K"], 12, 768, 2048, 4
    host, slot_map, pool, resident = _pinned_q4k_layer(rng, n_exp, ff, d)
    be = CupyBackend(0, act_q8=act_q8)
    scratch = tuple(cp.full((2 * k, *a.shape[1:]), 0xFF, cp.uint8) for a in host)
    others = np.setdiff1d(np.arange(n_exp), resident)
    ids = np.stack([rng.permutation(np.concatenate([rng.choice(resident, 2, replace=False),
                                                    rng.choice(others, 2, replace=False)])) for _ in range(t)]).astype(np.int32)
    wts = rng.dirichlet(np.ones(k), t).astype(np.float32)
    h = rng.standard_normal((t, d)).astype(np.float32)
    r = Routing(cp.asarray(ids), cp.asarray(wts))
    smap = cp.asarray(slot_map)
    direct = be.moe_ffn_cached(pool, (fmt.ggml_type,) * 3, r, cp.asarray(h), "silu", smap, tuple(host)).get()
    staged = be.moe_ffn_cached(pool, (fmt.ggml_type,) * 3, r, cp.asarray(h), "silu", smap, tuple(host), scratch).get()
    np.testing.assert_array_equal(staged, direct)  # the same bytes through the same arithmetic
    if act_q8:  # against the CPU twin of the 8-bit arithmetic (a gated value on a rounding boundary may differ)
        from moecache.backends import NumpyBackend

        ref = NumpyBackend(act_q8=True).moe_ffn(*host, (fmt.ggml_type,) * 3, Routing(ids, wts), h, "silu")
        assert np.linalg.norm(staged - ref) / np.linalg.norm(ref) < 1e-3
    else:
        eids, offs, rows, w = Routing(ids, wts).groups()
        ref = cpu.moe_ffn(*host, (fmt.ggml_type,) * 3, eids, offs, rows, w, h)
        np.testing.assert_allclose(staged, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def test_f16_kv_cache_on_the_gpu_matches_the_cpu_twin(gpu, tmp_path):
    """-ctk/-ctv f16 on the GPU (kv_store_f16, attn_decode_f16, the graph) against the CPU with the
    same float16 cache: same rounding of the stored keys and values, so the logits agree tightly."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, P["tiny"], seed=33)
    toks = np.random.default_rng(4).integers(0, 200, 30)
    with Engine(path, EngineConfig(n_ctx=48, cache_type="f16")) as c, \
            Engine(path, EngineConfig(n_ctx=48, cache_type="f16"), placement=PlacementOptions(), gpu_act_q8=False) as g:
        assert g.kv.k[0].dtype == np.float16 and g.model.decode_graph is not None
        # a 20-token prompt: attention over the float16 cache through the prompt path (> 16 tokens)
        ref = np.vstack([c.eval(toks[:20], logits="all")] + [c.eval([int(t)]) for t in toks[20:]])
        got = np.vstack([g.eval(toks[:20], logits="all")] + [g.eval([int(t)]) for t in toks[20:]])
        assert g.model.decode_graph.failed is None and g.model.decode_graph.replays >= 9
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("preset,placement", [("tiny", {}), ("tiny-gemma3", {}),
                                              ("tiny", {"n_gpu_layers": 99, "cpu_moe": True, "moe_cache": 1}),
                                              ("tiny", {"n_gpu_layers": 99, "cpu_moe": True, "moe_cache": 0})])
def test_batched_decode_graphs_equal_each_sequence_alone(gpu, tmp_path, preset, placement):
    """Batched decode steps replayed as CUDA graphs (Engine batch_graph=True; one graph per batch
    size, any slots): slots join and leave between steps (batches of 3, 2, 1 and 3 again, in other
    slots), and every row equals that sequence's logits alone; the graphs replayed (one capture per
    batch size) with every expert on the GPU and behind a zero-copy expert cache."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / f"{preset}.gguf"
    write_model(path, P[preset], seed=7)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 200, n) for n in (5, 9, 3, 4)]
    steps = rng.integers(0, 200, (8, 4))
    # which slots decode at each step: joins and leaves between steps
    plan = [(0, 1, 2), (0, 1, 2), (0, 2), (2,), (1, 2, 3), (1, 2, 3), (0, 3), (0, 1, 2, 3)]
    with Engine(path, EngineConfig(n_ctx=128), placement=PlacementOptions(**placement), gpu_act_q8=False,
                batch_graph=True, load_mode="pin") as eng:
        graph = eng.model.decode_graph
        assert graph is not None and graph.batched
        ref = []  # each sequence alone on the engine's own cache, its tokens as the plan feeds them
        for i, p in enumerate(prompts):
            eng.reset()
            rows = [eng.eval(p)[-1]]
            rows += [eng.eval([steps[j, i]])[-1] for j, slots in enumerate(plan) if i in slots]
            ref.append(np.array(rows))
        eng.reset()
        kvs = eng.sequences(4)
        got = [[eng.eval(p, kv=k)[-1]] for p, k in zip(prompts, kvs)]
        for j, slots in enumerate(plan):
            lg = eng.decode([steps[j, i] for i in slots], [kvs[i] for i in slots])
            for r, i in enumerate(slots):
                got[i].append(lg[r])
        assert not graph.batched_failed, graph.batched_failed
        assert graph.batched_replays == len(plan) and sorted(graph._batched) == [1, 2, 3, 4]
    for i in range(4):
        np.testing.assert_allclose(np.array(got[i]), ref[i], rtol=0, atol=1e-3 * np.abs(ref[i]).max(),
                                   err_msg=f"sequence {i}")


@pytest.mark.parametrize("preset,placement", [("tiny", {}), ("tiny-gemma3", {}), ("tiny", {"cpu_moe": True}),
                                              ("tiny", {"n_gpu_layers": 99, "cpu_moe": True, "moe_cache": 1})])
def test_batched_decode_on_the_gpu_equals_each_sequence_alone(gpu, tmp_path, preset, placement):
    """Continuous batching on the GPU op by op (Engine.sequences/decode, as serve's slots run, with
    batch_graph=False; the graphs have the test above): three slot sequences decoded together give
    each one's logits alone; a lone slot goes through the one-token CUDA graph (captured for that
    slot's cache); with every expert on the GPU, on the CPU, and behind an expert cache (-ngl 99
    --cpu-moe --moe-cache 1 MiB: the cache's decode kernels with 3 tokens)."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / f"{preset}.gguf"
    write_model(path, P[preset], seed=7)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 200, n) for n in (5, 9, 3)]
    steps = rng.integers(0, 200, (6, 3))
    with Engine(path, EngineConfig(n_ctx=96), placement=PlacementOptions(**placement), gpu_act_q8=False,
                batch_graph=False) as eng:
        ref = []  # each sequence alone on the engine's own cache
        for i, p in enumerate(prompts):
            eng.reset()
            ref.append(np.array([eng.eval(p)[-1]] + [eng.eval([t])[-1] for t in steps[:, i]]))
        eng.reset()
        kvs = eng.sequences(3)
        graph = eng.model.decode_graph
        replays = graph.replays if graph is not None else 0
        lone = [eng.eval(prompts[2], kv=kvs[2])[-1]] + [eng.decode([t], [kvs[2]])[0] for t in steps[:, 2]]
        np.testing.assert_allclose(np.array(lone), ref[2], rtol=0, atol=1e-3 * np.abs(ref[2]).max())
        if graph is not None and graph.failed is None and not placement:
            assert graph.replays > replays  # a lone slot decodes through the graph (captured for its cache)
        kvs[2].clear()
        got = [[eng.eval(p, kv=k)[-1]] for p, k in zip(prompts, kvs)]
        for step in steps:
            lg = eng.decode(step, kvs)
            for i in range(3):
                got[i].append(lg[i])
    for i in range(3):
        np.testing.assert_allclose(np.array(got[i]), ref[i], rtol=0, atol=1e-3 * np.abs(ref[i]).max())


@pytest.mark.parametrize("preset,placement", [("tiny", {}), ("tiny-gemma3", {}), ("tiny", {"cpu_moe": True}),
                                              ("tiny", {"n_gpu_layers": 99, "cpu_moe": True, "moe_cache": 1})])
def test_prompt_chunks_of_several_sequences_in_one_pass_on_the_gpu(gpu, tmp_path, preset, placement):
    """Engine.eval_seqs on the GPU (serve's prompt chunks of several slots in one pass,
    DecoderLM.forward_parts): three sequences' prompts in two chunks each (69 tokens in the first
    pass: with experts in host RAM, the prompt way, 32+ tokens; 21 in the second, on top of the
    first: one pass with every expert on the GPU, a pass per part with experts in host RAM, as each
    part is below 32) give each part's last logits as the sequence alone gets them; with every
    expert on the GPU, on the CPU, and behind an expert cache (-ngl 99 --cpu-moe --moe-cache 1 MiB)."""
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import write_model

    path = tmp_path / f"{preset}.gguf"
    write_model(path, P[preset], seed=7)
    rng = np.random.default_rng(8)
    firsts = [rng.integers(0, 200, n) for n in (20, 9, 40)]
    seconds = [rng.integers(0, 200, n) for n in (3, 17, 1)]
    with Engine(path, EngineConfig(n_ctx=192), placement=PlacementOptions(**placement), gpu_act_q8=False) as eng:
        assert eng.prompt_pass_min == (32 if placement else None)
        ref = []
        for a, b in zip(firsts, seconds):
            eng.reset()
            ref.append(np.array([eng.eval(a)[-1], eng.eval(b)[-1]]))
        eng.reset()
        kvs = eng.sequences(3)
        merged = []
        real = eng.model.forward_parts
        eng.model.forward_parts = lambda ps, ks: merged.append([len(p) for p in ps]) or real(ps, ks)
        got1 = eng.eval_seqs(firsts, kvs)
        got2 = eng.eval_seqs(seconds, kvs)
        assert [k.n_past for k in kvs] == [23, 26, 41]
        assert merged == ([[20, 9, 40]] if placement else [[20, 9, 40], [3, 17, 1]])
    for i in range(3):
        np.testing.assert_allclose(np.array([got1[i], got2[i]]), ref[i], rtol=0, atol=1e-3 * np.abs(ref[i]).max(),
                                   err_msg=f"sequence {i}")


def test_budget_guard_gives_the_pools_free_blocks_back_before_passing_the_limit(gpu):
    """CupyBackend.budget_guard: with the pool holding a free 256 MiB block, a 512 MiB request (no
    free block serves it) that would take the GPU's memory in use past the limit first gives the
    free block back (the memory in use grows by 256 MiB, not 512); without the guard the pool keeps
    it. stop() unregisters the hook; a second start() in the same thread does not register twice."""
    from cupy.cuda.memory_hook import get_memory_hooks

    pool = cp.get_default_memory_pool()
    for guarded in (False, True):
        pool.free_all_blocks()
        a = cp.empty(256 << 20, cp.uint8)
        del a  # a free 256 MiB block in the pool
        used = gpu.memory_in_use()
        g = gpu.budget_guard(used + (300 << 20))
        if guarded:
            g.start()
            g.start()
        try:
            b = cp.empty(512 << 20, cp.uint8)
            grew = gpu.memory_in_use() - used
        finally:
            g.stop()
        assert g.name not in get_memory_hooks()
        del b
        print(f"guarded {guarded}: memory in use grew {grew >> 20} MiB, releases {g.releases}")
        assert g.releases == int(guarded)
        assert (grew < 400 << 20) if guarded else (grew >= 512 << 20)
    pool.free_all_blocks()
    stale, fresh = gpu.budget_guard(1 << 40), gpu.budget_guard(1 << 40)
    stale.start()  # left registered (a pass an exception cut short): a new guard of this GPU takes its place
    fresh.start()
    assert get_memory_hooks()[fresh.name] is fresh and fresh.name.endswith(str(gpu.device))
    stale.stop()  # not its registration any more
    assert get_memory_hooks()[fresh.name] is fresh
    fresh.stop()
    assert fresh.name not in get_memory_hooks()
