"""Qwen3-MoE (GGUF arch ``qwen3moe``): per-head q/k RMSNorm, NeoX RoPE, softmax top-k routing with the
k weights renormalised, SwiGLU experts, no shared expert.

Source: llama.cpp ``src/models/qwen3moe.cpp``; Qwen3 technical report (2025).
"""

from __future__ import annotations

from moecache.models.base import DecoderLM, Pending


class Qwen3Moe(DecoderLM):
    arch = "qwen3moe"
    moe_out_last = True  # the block returns the MoE output untouched (batched steps may run in halves)
    renorm_topk = True  # norm_topk_prob

    def block(self, il, x, fp, kv):
        L = self.layers[il]
        x, xn = self.enter(x, L["attn_norm"])
        a = self.attention(il, xn, fp, kv, qk_norm="head")
        h, y = self.add_norm(x, a, L["ffn_norm"])
        return Pending(h, self.moe(il, y, fp))
