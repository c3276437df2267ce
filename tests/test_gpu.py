"""GPU backend (CuPy) against gguf-py and the CPU backend. Runs on the GPU machine: pytest -m gpu."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def gpu():
    from moecache.backends.cupy_backend import CupyBackend, available

    ok, why = available()
    if not ok:
        pytest.skip(why)
    return CupyBackend()


@pytest.mark.parametrize("fmt_name", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K", "F16", "BF16"])
def test_dequant_kernels_match_gguf_py(gpu, fmt_name):
    from gguf.quants import dequantize

    from moecache.backends.numpy_backend import Linear
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    n_rows, n_in = 37, 512
    raw = random_rows(fmt, n_rows, n_in, rng)
    ref = dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(n_rows, n_in)
    w = Linear("w", cp.asarray(raw), fmt.ggml_type, n_in)
    got = cp.asnumpy(gpu.dequantize(w)).astype(np.float64)
    assert np.isfinite(got).all(), f"seed {seed}"
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-6, f"{fmt_name} seed {seed}: {err:.2e}"
    # a row subset (the embedding path)
    sub = cp.asnumpy(gpu.dequantize(w, w.data[cp.asarray([3, 0, 36])]))
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


@pytest.mark.parametrize("fmt_name", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("n_tok", [1, 3, 16])
def test_fused_gemv_matches_gguf_py(gpu, fmt_name, n_tok):
    from gguf.quants import dequantize

    from moecache.backends.numpy_backend import Linear
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_rows

    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    fmt = FORMATS[fmt_name]
    n_rows, n_in = 301, 1024
    raw = random_rows(fmt, n_rows, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(raw, fmt.ggml_type).astype(np.float64).reshape(n_rows, n_in).T
    w = Linear("w", cp.asarray(raw), fmt.ggml_type, n_in)
    got = cp.asnumpy(gpu.matmul(w, cp.asarray(x)))
    assert got.shape == (n_tok, n_rows) and np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 2e-6, f"{fmt_name} T={n_tok} seed {seed}: {err:.2e}"
