"""Qwen2-MoE (GGUF arch ``qwen2moe``): q/k/v projection biases, NeoX RoPE, softmax top-k routing
without renormalisation, plus a shared expert scaled by ``sigmoid(ffn_gate_inp_shexp . x)``.

Source: llama.cpp ``src/models/qwen2moe.cpp``; Qwen1.5-MoE / Qwen2 technical report (2024).
"""

from __future__ import annotations

import numpy as np

from moecache.models.base import DecoderLM, Pending


class Qwen2Moe(DecoderLM):
    arch = "qwen2moe"
    renorm_topk = False
    # moe_out_last stays False: the block adds the shared expert to the routed output (no halves)

    def block(self, il, x, fp, kv):
        L = self.layers[il]
        x, xn = self.enter(x, L["attn_norm"])
        h, y = self.add_norm(x, self.attention(il, xn, fp, kv), L["ffn_norm"])
        out = self.moe(il, y, fp)
        if "ffn_gate_shexp" in L:
            # ffn_gate_inp_shexp is one float row (n_embd,): a plain dot product, (T, 1), written with
            # operators numpy and CuPy share (no BLAS call: the GPU decode step is graph-captured)
            gate = (y * L["ffn_gate_inp_shexp"]).sum(axis=-1, keepdims=True)
            shared = self.dense_ffn(il, y, suffix="_shexp")
            out = out + shared / (np.float32(1.0) + self.be.xp.exp(-gate))
        return Pending(h, out)
