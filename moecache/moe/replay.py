"""Policy replay: the real cache policy driven by a routing process or a recorded trace, no model.

Reports hit rate, uploads per token and the **modelled time per token** (the issue's cost model):
``misses x t_cpu + hits x t_gpu + uploads x t_upload`` (uploads counted as if they did not overlap
compute: conservative for a cache that uploads). A copy admitted at a token is usable from the next
token on; an evicted slot is unusable at once. The baseline is per-layer LRU with the same total
slots that uploads every miss (what a plain LRU cache does).

    python -m moecache.moe.replay --routing qwen3-moe --layers 48 --experts 128 -k 8 --tokens 256 \\
        --slots 0.06,0.19,0.38,0.64
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from moecache.moe.policy import CachePolicy, PolicyConfig
from moecache.moe.routing_process import make_routing


@dataclass(frozen=True)
class ReplayStats:
    """Counts over the measured tokens (after the warm-up)."""

    policy: str
    n_slots: int
    tokens: int
    hits: int
    misses: int
    uploads: int
    modelled_s: float

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    @property
    def uploads_per_token(self) -> float:
        return self.uploads / max(1, self.tokens)

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.modelled_s / max(1, self.tokens)


def _cost(cfg: PolicyConfig, hits: int, misses: int, uploads: int) -> float:
    return misses * cfg.t_cpu + hits * cfg.t_gpu + uploads * cfg.t_upload


def replay_policy(source: Any, n_layer: int, n_expert: int, n_tokens: int, n_slots: int,
                  cfg: PolicyConfig = PolicyConfig(), warmup: int = 0) -> ReplayStats:
    """Our policy (:class:`CachePolicy`) over ``warmup + n_tokens`` decode tokens of ``source``
    (anything with ``route(layer, n_tokens) -> Routing``)."""
    pol = CachePolicy(n_layer, n_expert, n_slots, cfg)
    visible = np.zeros((n_layer, n_expert), bool)
    hits = misses = uploads = 0
    for t in range(warmup + n_tokens):
        pol.new_tokens(1)
        pending = []
        for layer in range(n_layer):
            ids = source.route(layer, 1).ids
            hit = visible[layer, ids[0]]
            pol.observe(layer, ids)
            adm = pol.decide(layer, ids[0][~hit])
            for a in adm:
                if a.victim is not None:
                    visible[a.victim] = False
                pending.append((a.layer, a.expert))
            if t >= warmup:
                hits += int(hit.sum())
                misses += int((~hit).sum())
                uploads += len(adm)
        for layer, e in pending:
            visible[layer, e] = True
    return ReplayStats("ours", n_slots, n_tokens, hits, misses, uploads, _cost(cfg, hits, misses, uploads))


def replay_lru(source: Any, n_layer: int, n_tokens: int, n_slots: int, cfg: PolicyConfig = PolicyConfig(),
               warmup: int = 0) -> ReplayStats:
    """Per-layer LRU, ``n_slots // n_layer`` slots each, uploading every miss."""
    per = n_slots // n_layer
    caches = [OrderedDict() for _ in range(n_layer)]
    hits = misses = uploads = 0
    for t in range(warmup + n_tokens):
        for layer in range(n_layer):
            c = caches[layer]
            h = m = u = 0
            for e in source.route(layer, 1).ids[0]:
                e = int(e)
                if e in c:
                    c.move_to_end(e)
                    h += 1
                else:
                    m += 1
                    if per:
                        if len(c) >= per:
                            c.popitem(last=False)
                        c[e] = True
                        u += 1
            if t >= warmup:
                hits, misses, uploads = hits + h, misses + m, uploads + u
    return ReplayStats("lru", per * n_layer, n_tokens, hits, misses, uploads, _cost(cfg, hits, misses, uploads))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routing", default="qwen3-moe", help="preset or .npz trace")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("-k", type=int, default=8, help="experts per token (a trace's own: code-moe-tiny's is 4, "
                    "with --layers 8 --experts 16)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--slots", default="0.06,0.19,0.38,0.64", help="fractions of all experts (or counts > 1)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cfg = PolicyConfig(window=a.window)
    print("| routing | slots | policy | hit rate | uploads/token | modelled us/token |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for f in (float(s) for s in a.slots.split(",")):
        src = make_routing(a.routing, a.layers, a.experts, a.k, a.seed)
        n_layer = getattr(src, "n_layer", a.layers)
        n_slots = int(f) if f > 1 else int(round(f * a.experts)) * n_layer
        rows = [replay_lru(make_routing(a.routing, a.layers, a.experts, a.k, a.seed), n_layer, a.tokens, n_slots,
                           cfg, a.warmup),
                replay_policy(src, n_layer, a.experts, a.tokens, n_slots, cfg, a.warmup)]
        for r in rows:
            print(f"| {a.routing} | {r.n_slots} | {r.policy} | {100 * r.hit_rate:.1f}% | {r.uploads_per_token:.2f} | "
                  f"{r.us_per_token:.0f} |")


if __name__ == "__main__":
    main()
