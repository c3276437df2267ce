"""ModelFacts for the resolution's table tests: a model of given totals spread evenly over its layers,
with the per-layer sizes the placement reads (moecache.placement.ModelSizes at one KV position)."""

from __future__ import annotations

from moecache.placement import ModelSizes
from moecache.settings import ModelFacts

GiB = 1 << 30
OUTPUT = GiB // 2  # output norm + matrix
LARGEST_F32 = int(1.16 * GiB)  # a 151936 x 2048 output matrix in float32 (Qwen3-30B-A3B's)


def moe_facts(n_bytes: int, expert_bytes: int, context_length: int, kv_bytes_per_token: int = 0, *,
              n_layer: int = 48, n_expert: int = 128) -> ModelFacts:
    """A model of ``n_bytes`` (``expert_bytes`` of them routed experts, 0 = dense) and a KV cache of
    ``kv_bytes_per_token`` per position (all layers)."""
    dense = (n_bytes - expert_bytes - OUTPUT) // n_layer
    experts = expert_bytes // n_layer
    each = experts // n_expert if expert_bytes else 0
    sizes = ModelSizes((dense,) * n_layer, (experts,) * n_layer, kv_bytes_per_token // n_layer, OUTPUT,
                       LARGEST_F32, each, 0)
    return ModelFacts(n_bytes, expert_bytes, context_length, kv_bytes_per_token, each,
                      n_expert if expert_bytes else 0, sizes)
