"""The prompt MoE's padded activations per chunk, before and after ``moe_prompt_chunks``, on the
CPU: no model, no GPU, the routing process's draws only.

``CupyBackend._moe_prompt`` runs each chunk of used experts as batched GEMMs over a (experts x
largest group x width) block of float32 rows: the gathered input, the gate and up products, the
GLU output, the down product and its gathered copy (3 rows of n_embd and 3 of n_ff per padded
token). This prints, per routing preset, the largest group and the largest chunk's bytes of those
six arrays over every layer of one 512-token ubatch, for chunks of up to ``MOE_SCRATCH_BYTES``
worth of experts in id order (before) and for :func:`moe_prompt_chunks` (after).

    python bench/moe_prompt_padding.py   # Qwen3-30B-A3B's shape: 48 layers, 128 experts, top-8
"""

from __future__ import annotations

import argparse

import numpy as np

from moecache.backends.ops import MOE_ACT_BYTES, MOE_SCRATCH_BYTES, moe_prompt_chunks
from moecache.moe.routing_process import PRESETS, RoutingProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=768)
    ap.add_argument("-ub", type=int, default=512)
    a = ap.parse_args()
    row = 4 * (3 * a.n_embd + 3 * a.n_ff)  # bytes of the six arrays per padded token
    max_experts = max(1, MOE_SCRATCH_BYTES // (4 * a.n_embd * a.n_ff))
    print(f"chunks of <= {max_experts} experts; MOE_ACT_BYTES {MOE_ACT_BYTES >> 20} MiB per widest array")
    print("| routing | largest group (pairs) | before: largest chunk MiB | after: largest chunk MiB |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("qwen3-moe", "low-locality", "uniform"):
        rp = RoutingProcess(PRESETS[name], a.layers, a.experts, a.k, seed=0)
        largest = before = after = 0
        for il in range(a.layers):
            ids = rp.route(il, a.ub).ids
            _, counts = np.unique(ids, return_counts=True)
            largest = max(largest, int(counts.max()))
            for g0 in range(0, counts.size, max_experts):
                c = counts[g0:g0 + max_experts]
                before = max(before, c.size * int(c.max()) * row)
            for ch in moe_prompt_chunks(counts, max_experts, 4 * max(a.n_embd, a.n_ff), MOE_ACT_BYTES):
                after = max(after, ch.size * int(counts[ch].max()) * row)
        print(f"| {name} | {largest} | {before / 2**20:.0f} | {after / 2**20:.0f} |")


if __name__ == "__main__":
    main()
