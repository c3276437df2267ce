"""The prompt MoE's padded activations per chunk, before and after ``moe_prompt_chunks``, on the
CPU: no model, no GPU, the routing process's draws only.

``CupyBackend._moe_prompt`` runs each chunk of used experts as batched GEMMs over a (experts x
largest group x width) block of float32 rows: the gathered input, the gate and up products, the
GLU output, the down product and its gathered copy (3 rows of n_embd and 3 of n_ff per padded
token). This prints, per routing preset, the largest group and the largest chunk's bytes of those
six arrays over every layer of one 512-token ubatch, for chunks of up to ``MOE_SCRATCH_BYTES``
worth of experts in id order (before) and for :func:`moe_prompt_chunks` (after: as the GPU plans them,
rows per expert padded to a multiple of ``MOE_PROMPT_M_ALIGN``; the record of 2026-11 predates the
padding).

It also counts, per layer, the GEMM path's chunks (each ~9 launches: 3 dequantizations, 3 GEMMs,
the gather, the GLU, the cast) over the whole layer and inside the expert cache's prompt groups of
``PROMPT_GROUP_BYTES`` of Q4_K experts (2.65 MB each), and the grouped 8-bit kernels' groups (one
launch pair for all of them).

    python bench/moe_prompt_padding.py   # Qwen3-30B-A3B's shape: 48 layers, 128 experts, top-8
"""

from __future__ import annotations

import argparse

import numpy as np

from moecache.backends.ops import (MOE_ACT_BYTES, MOE_PROMPT_M_ALIGN, MOE_SCRATCH_BYTES, moe_prompt_chunks,
                                   moe_prompt_groups)
from moecache.moe.cache import PROMPT_GROUP_BYTES
from moecache.moe.routing_process import PRESETS, RoutingProcess

Q4_K_EXPERT_BYTES = 2779096  # gate + up + down of one Qwen3-30B-A3B expert in Q4_K (768 x 2048 each)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=768)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("--weights-f32", action="store_true", help="float32 dequantized weights (gpu_act_q8 off)")
    a = ap.parse_args()
    row = 4 * (3 * a.n_embd + 3 * a.n_ff)  # bytes of the six arrays per padded token
    # the dequantized weights are float16 by default (8-bit activations on), float32 with them off
    max_experts = max(1, MOE_SCRATCH_BYTES // ((4 if a.weights_f32 else 2) * a.n_embd * a.n_ff))
    print(f"chunks of <= {max_experts} experts; MOE_ACT_BYTES {MOE_ACT_BYTES >> 20} MiB per widest array")
    per_group = max(1, PROMPT_GROUP_BYTES // Q4_K_EXPERT_BYTES)
    print("| routing | largest group (pairs) | before: largest chunk MiB | after: largest chunk MiB | "
          "GEMM chunks per layer | in the cache's prompt groups | grouped kernels' groups per layer |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("qwen3-moe", "low-locality", "uniform"):
        rp = RoutingProcess(PRESETS[name], a.layers, a.experts, a.k, seed=0)
        largest = before = after = chunks = cache_chunks = groups = 0
        for il in range(a.layers):
            ids = rp.route(il, a.ub).ids
            _, counts = np.unique(ids, return_counts=True)
            largest = max(largest, int(counts.max()))
            for g0 in range(0, counts.size, max_experts):
                c = counts[g0:g0 + max_experts]
                before = max(before, c.size * int(c.max()) * row)
            for ch in moe_prompt_chunks(counts, max_experts, 4 * max(a.n_embd, a.n_ff), MOE_ACT_BYTES,
                                        MOE_PROMPT_M_ALIGN):
                m = -(-int(counts[ch].max()) // MOE_PROMPT_M_ALIGN) * MOE_PROMPT_M_ALIGN  # rows per expert, padded
                after = max(after, ch.size * m * row)
                chunks += 1
            for g0 in range(0, counts.size, per_group):
                cache_chunks += len(moe_prompt_chunks(counts[g0:g0 + per_group], max_experts,
                                                      4 * max(a.n_embd, a.n_ff), MOE_ACT_BYTES, MOE_PROMPT_M_ALIGN))
            groups += moe_prompt_groups(ids, a.experts, 16).groups.shape[0]
        print(f"| {name} | {largest} | {before / 2**20:.0f} | {after / 2**20:.0f} | {chunks / a.layers:.1f} | "
              f"{cache_chunks / a.layers:.1f} | {groups / a.layers:.0f} |")


if __name__ == "__main__":
    main()
