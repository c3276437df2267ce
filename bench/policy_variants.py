"""Cache-policy variants side by side on one cache-on engine: decode speed, hit rate and uploads.

Loads the model once at ``--vram-budget`` (zero-copy misses, CUDA-graph decode) and, for each
routing of ``--routing``, decodes ``-n`` tokens under each variant in turn (the first after
``--warmup`` tokens, the others after 16), timed as in ``bench/cache_profile.py`` (medians per
token; every timed run starts a fresh 8-token context, so attention costs the same). The variants
change the policy's settings in place, so each starts from the cache the previous one left:

- ``adaptive``: the policy as the CLI runs it (adaptive upload budget, <= 16 per token, burst 128),
  priced with the zero-copy path's costs (a miss 102 us: 2.65 MB at ~26 GB/s; an upload 50 us at
  ~53 GB/s; the CLI derives its prices from the probe instead);
- ``frozen``: no uploads (what the misses alone cost);
- ``burst2`` / ``burst4``: at most 2 / 4 uploads in one token;
- ``debias``: a candidate's own triggering use does not count toward its payback (its usage less
  ``1 / window``): the selection bias of admitting right after a use; ``debias burst4`` with at
  most 4 uploads in one token, ``debias hyst1`` with hysteresis 1.0 (a challenger needs 2x its
  victim's usage, 1.5x by default);
- ``tup4``: an upload priced at 4x its link time;
- ``cap1``: a fixed budget of one upload per token;
- ``adaptive again``: the first variant repeated (drift over the run).

    python bench/policy_variants.py -m /tmp/q30.gguf --vram-budget 8GiB --routing qwen3-moe,low-locality
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_profile import decode_args, profile  # noqa: E402

from moecache.moe.policy import CachePolicy  # noqa: E402


class DebiasedPolicy(CachePolicy):
    """:class:`CachePolicy` whose candidates' usage excludes the use that made them candidates."""

    def decide(self, layer, missed):
        cand = np.unique(missed)
        saved = self.usage[layer, cand].copy()
        self.usage[layer, cand] = np.maximum(0.0, saved - (1.0 - self.beta))
        self._vc = False
        try:
            return super().decide(layer, missed)
        finally:
            self.usage[layer, cand] = saved
            self._vc = False


def main() -> None:
    from moecache.sizes import parse_size
    from moecache.engine import Engine, EngineConfig
    from moecache.moe.policy import PolicyConfig
    from moecache.moe.routing_process import make_routing
    from moecache.placement import PlacementOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_args(ap, "qwen3-moe,low-locality", 256)
    a = ap.parse_args()
    r = dataclasses.replace
    # the zero-copy path's costs: a miss read over the link (~26 GB/s), an upload at ~53 GB/s
    base = PolicyConfig(adaptive=True, t_cpu=102e-6, t_upload=50e-6)
    variants = [("adaptive", base, CachePolicy),
                ("frozen", r(base, adaptive=False, uploads_per_token=0, burst=0), CachePolicy),
                ("burst2", r(base, burst=2), CachePolicy), ("burst4", r(base, burst=4), CachePolicy),
                ("debias", base, DebiasedPolicy), ("debias burst4", r(base, burst=4), DebiasedPolicy),
                ("debias hyst1", r(base, hysteresis=1.0), DebiasedPolicy), ("tup4", r(base, t_upload=200e-6), CachePolicy),
                ("cap1", r(base, adaptive=False, uploads_per_token=1, burst=1), CachePolicy),
                ("adaptive again", base, CachePolicy)]
    print("| routing | variant | t/s | wall ms | GPU replay ms | flush ms | hit rate | uploads/token |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    with Engine(a.model, EngineConfig(n_ctx=a.c, n_threads=a.t, cache_type="f16"),
                placement=PlacementOptions(vram_budget=parse_size(a.vram_budget, "--vram-budget")), load_mode="pin",
                policy_config=base) as eng:
        c = eng.gguf.config
        for routing in a.routing.split(","):
            eng.model.routing_override = make_routing(routing, c.n_layer, c.n_expert, c.n_expert_used, seed=0)
            rng = np.random.default_rng(0)
            for i, (name, cfg, cls) in enumerate(variants):
                for cc in eng.caches:
                    cc.flush()
                    p = cc.policy
                    p.__class__, p.cfg, p.uploads_per_token = cls, cfg, cfg.uploads_per_token
                    p.credit = min(p.credit, cfg.burst)
                res = profile(eng, a.n, a.warmup if i == 0 else 16, rng)
                for cc in eng.caches:
                    cc.flush()
                hr = ", ".join(f"{100 * cc.stats.hit_rate:.1f}%" for cc in eng.caches)
                up = ", ".join(f"{cc.stats.uploads / max(1, cc.stats.tokens):.2f}" for cc in eng.caches)
                print(f"| {routing} | {name} | {1e3 / res['wall']:.1f} | {res['wall']:.2f} | {res['gpu']:.2f} | "
                      f"{res['flush']:.2f} | {hr} | {up} |", flush=True)


if __name__ == "__main__":
    main()
