"""Mixtral (GGUF arch ``llama`` with ``expert_count`` > 0): Llama attention, softmax top-k routing
with the k weights renormalised (= softmax over the k selected logits), SwiGLU experts.

Source: llama.cpp ``src/models/llama.cpp`` (the MoE branch); Jiang et al., "Mixtral of Experts" (2024).
"""

from __future__ import annotations

from moecache.models.base import DecoderLM, Pending


class Mixtral(DecoderLM):
    arch = "llama"
    renorm_topk = True
    moe_out_last = True  # the block returns the MoE output untouched (batched steps may run in halves)

    def block(self, il, x, fp, kv):
        L = self.layers[il]
        x, xn = self.enter(x, L["attn_norm"])
        h, y = self.add_norm(x, self.attention(il, xn, fp, kv), L["ffn_norm"])
        return Pending(h, self.moe(il, y, fp) if "ffn_gate_inp" in L else self.dense_ffn(il, y))
