"""OLMoE (GGUF arch ``olmoe``): q/k RMSNorm over the whole projection (before the head split), NeoX
RoPE, softmax top-k routing without renormalisation, SwiGLU experts.

Source: llama.cpp ``src/models/olmoe.cpp``; Muennighoff et al., "OLMoE" (2024).
"""

from __future__ import annotations

from moecache.models.base import DecoderLM


class Olmoe(DecoderLM):
    arch = "olmoe"
    renorm_topk = False

    def block(self, il, x, pos, kv):
        L = self.layers[il]
        h = x + self.attention(il, self.norm(x, L["attn_norm"]), pos, kv, qk_norm="full")
        return h + self.moe(il, self.norm(h, L["ffn_norm"]))
