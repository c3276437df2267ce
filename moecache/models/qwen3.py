"""Qwen3 dense (GGUF arch ``qwen3``): per-head q/k RMSNorm, NeoX RoPE, SwiGLU FFN.

Source: llama.cpp ``src/models/qwen3.cpp``; Qwen3 technical report (2025).
"""

from __future__ import annotations

from moecache.models.base import DecoderLM, Pending


class Qwen3(DecoderLM):
    arch = "qwen3"

    def block(self, il, x, fp, kv):
        L = self.layers[il]
        x, xn = self.enter(x, L["attn_norm"])
        a = self.attention(il, xn, fp, kv, qk_norm="head")
        h, y = self.add_norm(x, a, L["ffn_norm"])
        return Pending(h, self.dense_ffn(il, y))
