"""Llama (GGUF arch ``llama``, no experts): RMSNorm, RoPE on adjacent pairs (GGUF q/k rows are
permuted by the converter for it), optional llama3 ``rope_freqs`` factors, SwiGLU FFN.

Source: llama.cpp ``src/models/llama.cpp``; Touvron et al., "LLaMA" (2023).
"""

from __future__ import annotations

from moecache.models.base import DecoderLM, Pending


class Llama(DecoderLM):
    arch = "llama"

    def block(self, il, x, fp, kv):
        L = self.layers[il]
        x, xn = self.enter(x, L["attn_norm"])
        h, y = self.add_norm(x, self.attention(il, xn, fp, kv), L["ffn_norm"])
        return Pending(h, self.dense_ffn(il, y))
