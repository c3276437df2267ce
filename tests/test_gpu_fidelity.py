"""Issue 24: every placement x load mode x -ub gives the CPU's perplexity and greedy tokens on the
real trained MoE (code-moe-tiny), and on a synthetic MoE whose prompt experts span several upload
groups. GPU machine: pytest -m gpu."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.testing import fidelity as F

pytestmark = pytest.mark.gpu

N_CTX, CHUNKS, N_GREEDY = 256, 6, 24


@pytest.fixture(scope="module")
def gpu_ok():
    try:  # no module-level importorskip: CI (no CuPy) collects this file and deselects its tests
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("cupy is not installed")
    from moecache.backends.cupy_backend import available

    ok, why = available()
    if not ok:
        pytest.skip(why)


@pytest.fixture(scope="module")
def real(code_moe_tiny):
    from conftest import require_shared
    from moecache.engine import Engine, EngineConfig

    text = require_shared("heldout-b.py.txt").read_text()
    with Engine(code_moe_tiny, EngineConfig(n_ctx=N_CTX)) as e:
        tokens = e.tokenizer.encode(text, parse_special=False)
    prompt = tokens[100:170]  # 70 tokens: ubatches of 32+ run the host experts on the GPU
    ref = F.cpu_reference(code_moe_tiny, tokens, N_CTX, CHUNKS, prompt, N_GREEDY)
    print(f"CPU: ppl {ref[0]:.4f}, greedy {ref[1]}")
    return tokens, prompt, ref


@pytest.mark.parametrize("ub", F.UBATCHES)
@pytest.mark.parametrize("load_mode", F.LOAD_MODES)
@pytest.mark.parametrize("placement", list(F.PLACEMENTS))
def test_code_moe_tiny_placements_equal_cpu(gpu_ok, code_moe_tiny, real, placement, load_mode, ub):
    tokens, prompt, (ppl, ref_toks, gaps) = real
    c = F.run_cell(code_moe_tiny, placement, load_mode, ub, tokens, N_CTX, CHUNKS, prompt, N_GREEDY)
    rel = abs(c.ppl - ppl) / ppl
    print(f"{placement} {load_mode} -ub {ub}: ppl {c.ppl:.4f} (CPU {ppl:.4f}, {rel:.2e}); "
          f"offloaded {c.offloaded_bytes} B; {c.summary}")
    assert rel < 1e-3
    bad = F.first_real_divergence(ref_toks, c.tokens, gaps)
    assert bad is None, f"greedy token {bad}: {c.tokens[bad]} vs CPU {ref_toks[bad]} (gap {gaps[bad]:.3f})"
    if placement != "-ngl 99":  # host experts: ubatches of 32+ copy them to the GPU, smaller ones do not
        assert (c.offloaded_bytes > 0) == (ub >= 32)


@pytest.mark.parametrize("ub", F.UBATCHES)
@pytest.mark.parametrize("load_mode", F.LOAD_MODES)
@pytest.mark.parametrize("placement", ["--cpu-moe", "--n-cpu-moe 4", "cache"])
def test_synthetic_moe_prompt_experts_in_several_groups(gpu_ok, tmp_path_factory, monkeypatch, placement,
                                                        load_mode, ub):
    """64 experts of a few hundred KiB each (Q4_K/Q6_K); the cache's prompt groups (the default; its
    opt-in prompt stacks explicitly off) move them 5 at a time (PROMPT_GROUP_BYTES lowered), so one ubatch's
    used experts span many upload groups."""
    from moecache.gguf_file import open_gguf
    from moecache.testing.synth import PRESETS as P
    from moecache.testing.synth import SynthConfig, write_model

    path = tmp_path_factory.getbasetemp() / "moe64.gguf"
    if not path.exists():
        write_model(path, SynthConfig(**{**P["tiny"].__dict__, "n_expert": 64, "n_expert_used": 8, "n_embd": 256,
                                         "head_dim": 64, "expert_ff": 512, "expert_type": "Q4_K"}), seed=31)
    with open_gguf(path) as m:
        n_vocab = m.config.n_vocab
        per = sum(m.tensors[f"blk.0.ffn_{p}_exps.weight"].data[0].nbytes for p in ("gate", "up", "down"))
    monkeypatch.setattr("moecache.moe.cache.PROMPT_GROUP_BYTES", 5 * per)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, n_vocab, 4 * 128)]
    prompt = tokens[:90]
    ppl, ref_toks, gaps = F.cpu_reference(path, tokens, 128, 4, prompt, 8)
    c = F.run_cell(path, placement, load_mode, ub, tokens, 128, 4, prompt, 8,
                   prompt_stacks=False if placement == "cache" else None)
    rel = abs(c.ppl - ppl) / ppl
    print(f"{placement} {load_mode} -ub {ub}: ppl {c.ppl:.4f} (CPU {ppl:.4f}, {rel:.2e}); {c.summary}")
    assert rel < 1e-3
    assert F.first_real_divergence(ref_toks, c.tokens, gaps) is None
    assert (c.offloaded_bytes > 0) == (ub >= 32)


LLAMACPP_PPL = 3.8860  # llama-perplexity -f heldout-b.py.txt -c 256 -b 256, b11434 CPU (../shared/models/README.md)


@pytest.mark.parametrize("ub", [16, 256])
def test_code_moe_tiny_8bit_activations_perplexity_near_llamacpp(gpu_ok, code_moe_tiny, ub):
    """The default GPU arithmetic (8-bit activations in every product of a ubatch of <= 16 tokens,
    as llama.cpp's MMVQ; float16 operands in the tensor-core GEMMs of larger ones, as llama.cpp's
    cuBLAS path): code-moe-tiny's perplexity over the whole held-out text at -c 256 within 0.5% of
    llama.cpp's recorded value (-ub 16: every ubatch takes the 8-bit kernels; -ub 256: the float16
    GEMMs), and within 0.5% of this GPU's float32 perplexity."""
    from conftest import require_shared
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions

    text = require_shared("heldout-b.py.txt").read_text()
    cfg = EngineConfig(n_ctx=256, n_batch=256, n_ubatch=ub)
    ppl = {}
    for q8 in (True, False):
        with Engine(code_moe_tiny, cfg, placement=PlacementOptions(n_gpu_layers=99), gpu_act_q8=q8) as e:
            assert e.backend.act_q8 == q8
            tokens = e.tokenizer.encode(text, parse_special=False)
            ppl[q8] = e.perplexity(tokens, 256).ppl
    print(f"-ub {ub}: ppl 8-bit activations {ppl[True]:.4f}, float32 {ppl[False]:.4f}, llama.cpp {LLAMACPP_PPL}")
    assert abs(ppl[True] - LLAMACPP_PPL) / LLAMACPP_PPL < 5e-3
    assert abs(ppl[True] - ppl[False]) / ppl[False] < 5e-3
    assert ppl[True] != ppl[False]  # the rounding kernels ran


def test_code_moe_tiny_grouped_8bit_prompt_moe_perplexity_near_llamacpp(gpu_ok, code_moe_tiny):
    """The grouped 8-bit prompt MoE (Engine(gpu_prompt_q8=True): every prompt ubatch's experts read
    quantized, tokens grouped by expert, activations rounded to int8 as llama.cpp's MMQ does):
    code-moe-tiny's perplexity over the held-out text at -c 256 -ub 256 within 0.5% of llama.cpp's
    recorded value, and different from the float16-GEMM path's (the grouped kernels ran)."""
    from conftest import require_shared
    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions

    text = require_shared("heldout-b.py.txt").read_text()
    cfg = EngineConfig(n_ctx=256, n_batch=256, n_ubatch=256)
    ppl = {}
    for grouped in (True, False):
        with Engine(code_moe_tiny, cfg, placement=PlacementOptions(n_gpu_layers=99), gpu_prompt_q8=grouped) as e:
            assert e.backend.prompt_q8 == grouped
            tokens = e.tokenizer.encode(text, parse_special=False)
            ppl[grouped] = e.perplexity(tokens, 256).ppl
    print(f"-ub 256: ppl grouped 8-bit prompt MoE {ppl[True]:.4f}, float16 GEMMs {ppl[False]:.4f}, "
          f"llama.cpp {LLAMACPP_PPL}")
    assert abs(ppl[True] - LLAMACPP_PPL) / LLAMACPP_PPL < 5e-3
    assert ppl[True] != ppl[False]
