"""OLMoE (GGUF arch ``olmoe``): q/k RMSNorm over the whole projection (before the head split), NeoX
RoPE, softmax top-k routing without renormalisation, SwiGLU experts.

Source: llama.cpp ``src/models/olmoe.cpp``; Muennighoff et al., "OLMoE" (2024).
"""

from __future__ import annotations

from moecache.models.base import DecoderLM, Pending


class Olmoe(DecoderLM):
    arch = "olmoe"
    renorm_topk = False
    moe_out_last = True  # the block returns the MoE output untouched (batched steps may run in halves)

    def block(self, il, x, fp, kv):
        L = self.layers[il]
        x, xn = self.enter(x, L["attn_norm"])
        a = self.attention(il, xn, fp, kv, qk_norm="full")
        h, y = self.add_norm(x, a, L["ffn_norm"])
        return Pending(h, self.moe(il, y, fp))
