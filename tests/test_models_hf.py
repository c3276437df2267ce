"""Every architecture's forward pass against Hugging Face transformers (an independent implementation).

Tiny synthetic GGUFs of each architecture (``moecache.testing.synth`` presets, mixed quant types)
are run by moecache and by transformers (:mod:`moecache.testing.hf_reference`: the HF model class
configured from the GGUF's raw keys as gguf-py reads them, not through moecache's parser, so a
parsing bug cannot be shared by both sides; weights dequantized by gguf-py, float32 on CPU torch). Also checks
that decoding token by token through the KV cache gives the one-pass logits (gemma3's preset
slides an 8-token window over 24 tokens).
"""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends import NumpyBackend
from moecache.gguf_file import open_gguf
from moecache.models import build_model
from moecache.testing.synth import PRESETS, write_model

ARCH_PRESETS = ["tiny", "tiny-qwen2moe", "tiny-olmoe", "tiny-mixtral", "tiny-llama", "tiny-qwen3", "tiny-gemma3"]
N_TOKENS = 24
MAX_REL = 1e-5  # float32 on both sides, same dequantized weights (measured: 3e-7 .. 1.3e-6)


@pytest.fixture(scope="module", params=ARCH_PRESETS)
def synth_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / f"{request.param}.gguf"
    write_model(path, PRESETS[request.param], seed=11)
    m = open_gguf(path)
    tokens = np.random.default_rng(5).integers(0, m.config.n_vocab, N_TOKENS)
    yield request.param, path, build_model(m, NumpyBackend()), tokens
    m.close()


def test_logits_match_transformers(synth_model, hf):
    name, path, lm, tokens = synth_model
    ours = lm.forward(tokens, lm.new_kv_cache(64), logits="all")
    ref = hf.hf_logits(path, tokens.tolist())
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"{name} ({lm.cfg.arch}): max relative logit error vs transformers {rel:.2e}")
    assert ours.shape == ref.shape
    assert rel < MAX_REL
    # and the ranking agrees where it is not a near-tie
    assert np.mean(np.argmax(ours, 1) == np.argmax(ref, 1)) == 1.0


def test_token_by_token_decode_equals_one_pass(synth_model):
    name, _, lm, tokens = synth_model
    full = lm.forward(tokens, lm.new_kv_cache(64), logits="all")
    kv = lm.new_kv_cache(64)
    rows = [lm.forward(tokens[:5], kv, logits="all")] + [lm.forward(tokens[i:i + 1], kv) for i in range(5, N_TOKENS)]
    got = np.vstack(rows)
    assert np.abs(got - full).max() / np.abs(full).max() < 1e-5, name
