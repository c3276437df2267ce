"""Gemma 3 (GGUF arch ``gemma3``, text): embeddings scaled by sqrt(n_embd), per-head q/k RMSNorm,
pre- and post-norms around attention and FFN ("sandwich"), GeGLU (tanh GELU), sliding-window
attention on 5 of every 6 layers with RoPE base 10000 there, the model's base on the global ones,
query scale 1/sqrt(head_dim), tied output.

Norm weights in a GGUF already include Gemma's ``1 +`` (the converter adds it), so they are used
as is. Sources: llama.cpp ``src/models/gemma3.cpp`` (``load_arch_hparams``: SWA pattern 6,
``rope_freq_base_train_swa`` 10000, ``f_attention_scale``); Gemma 3 technical report (2025).
"""

from __future__ import annotations

import math

from moecache.arch import ModelConfig
from moecache.models.base import DecoderLM, Pending, RopeSpec

SWA_PATTERN = 6          # default of attention.sliding_window_pattern: layer il is global when il % 6 == 5
SWA_ROPE_BASE = 10000.0  # default of rope.freq_base_swa


def attention_scale(c: ModelConfig) -> float:
    """Query scale: 1/sqrt(n_embd / n_head) for gemma3 27B (62 layers), else 1/sqrt(head_dim)
    (llama.cpp ``gemma3.cpp`` ``load_arch_hparams``, after gemma_pytorch's config)."""
    return 1.0 / math.sqrt(c.n_embd / c.n_head if c.n_layer == 62 else c.head_dim)


class Gemma3(DecoderLM):
    arch = "gemma3"
    act = "gelu"
    final_softcap = True  # llama.cpp's gemma3 reads final_logit_softcapping (0 = none)

    def is_swa(self, il: int) -> bool:
        """True for the sliding-window layers (none when the GGUF sets no window)."""
        c = self.cfg
        if not c.sliding_window:
            return False
        n = c.sliding_window_pattern if c.sliding_window_pattern is not None else SWA_PATTERN
        return n == 0 or il % n < n - 1

    def window(self, il):
        return self.cfg.sliding_window if self.is_swa(il) else None

    def rope_spec(self, il):
        if not self.is_swa(il):
            return super().rope_spec(il)
        c = self.cfg
        base = c.rope_freq_base_swa if c.rope_freq_base_swa is not None else SWA_ROPE_BASE
        return RopeSpec(c.rope_dim, base, 1.0, True, self.rope_factors)

    def embed_scale(self):
        return math.sqrt(self.cfg.n_embd)

    def block(self, il, x, fp, kv):
        L = self.layers[il]
        scale = attention_scale(self.cfg)
        x, xn = self.enter(x, L["attn_norm"])
        a = self.attention(il, xn, fp, kv, qk_norm="head", scale=scale)
        h = x + self.norm(a, L["post_attention_norm"])
        f = self.dense_ffn(il, self.norm(h, L["ffn_norm"]))
        return Pending(h, self.norm(f, L["post_ffw_norm"]))
