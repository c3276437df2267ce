"""The expert cache's host work per decode token: ``CachedExperts.flush`` (the finished pass's
routing accounted, the policy's observe and decide, the uploads started), on the CPU twin.

On a GPU, ``flush`` runs on the thread that launched the step, while the step runs
(``CachedExperts.launched``). Where the step hands misses to the CPU (the layer plan's shares, or
``--miss-split``), that thread answers the handoffs first, and since the thirty-fourth session the
accounting runs a unit at a time in the gaps between the answers, the rest after the last one. Its cost depends on the cache's shape (layers, experts,
top-k, slots) and the routing, not on the experts' sizes: this script builds a synthetic model of
Qwen3-30B-A3B's MoE shape (48 layers, 128 experts, top-8) with tiny matrices, a cache of ``--slots``
slots on the numpy backend (the zero-copy path's CPU twin), runs ``--warmup`` one-token passes, then
times ``flush`` over ``-n`` passes (the layer calls themselves are not timed).

``--batch B`` times passes of B tokens (serve's decode steps of B slots). (A layer plan needs the
miss split's handoff, which the numpy twin does not have: the per-expert rule admits here.)

    python bench/cache_host.py [--routing uniform,qwen3-moe] [--slots 1900] [-n 300] [--batch 1,8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--routing", default="uniform,low-locality,qwen3-moe", help="routing presets, a comma list (../shared/routing.md)")
    ap.add_argument("--slots", type=int, default=1900, help="the cache's slots (1900: about an 8 GiB budget)")
    ap.add_argument("--n-layer", type=int, default=48, help="MoE layers of the synthetic model")
    ap.add_argument("--n-expert", type=int, default=128, help="experts per layer")
    ap.add_argument("-k", type=int, default=8, help="experts per token (top-k)")
    ap.add_argument("-n", type=int, default=300, help="timed passes")
    ap.add_argument("--warmup", type=int, default=300, help="untimed passes first (the cache fills)")
    ap.add_argument("--batch", default="1", help="tokens per decode pass (serve's slots stepping together); "
                    "a comma list times each")
    a = ap.parse_args()

    from moecache.backends import NumpyBackend
    from moecache.gguf_file import open_gguf
    from moecache.models.base import expert_weights
    from moecache.moe.cache import CachedExperts
    from moecache.moe.policy import CachePolicy, PolicyConfig
    from moecache.moe.routing_process import make_routing

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "wide.gguf"
        subprocess.run([sys.executable, "-m", "moecache.testing.synth", "--preset", "tiny", "--set", f"n_layer={a.n_layer}",
                        "--set", f"n_expert={a.n_expert}", "--set", f"n_expert_used={a.k}", "-o", str(path)],
                       check=True, capture_output=True)
        with open_gguf(path) as m:
            c = m.config
            ew = expert_weights(m, "silu")
            for preset, b in [(p, int(b)) for p in a.routing.split(",") for b in a.batch.split(",")]:
                pol = CachePolicy(c.n_layer, c.n_expert, a.slots, PolicyConfig())
                cache = CachedExperts(ew, NumpyBackend(), a.slots, pol, 32, zero_copy=True, top_k=c.n_expert_used)
                src = make_routing(preset, c.n_layer, c.n_expert, c.n_expert_used, 0)
                h = np.random.default_rng(0).standard_normal((b, c.n_embd)).astype(np.float32)
                spent = [0.0]

                def step(timed: bool) -> None:
                    cache.note_decode(b)
                    cache.begin_pass(b)
                    for il in range(c.n_layer):
                        cache(il, h, src.route(il, b))
                    t0 = time.perf_counter()
                    cache.launched()  # the previous pass's flush
                    if timed:
                        spent[0] += time.perf_counter() - t0
                    cache.end_pass()

                for _ in range(a.warmup):
                    step(False)
                s0 = (cache.stats.uploads, cache.stats.hits, cache.stats.misses)
                for _ in range(a.n):
                    step(True)
                cache.flush()
                up, hits, misses = (x - y for x, y in zip((cache.stats.uploads, cache.stats.hits, cache.stats.misses), s0))
                print(f"{preset}, passes of {b}: flush {1e3 * spent[0] / a.n:.3f} ms per pass | hit rate "
                      f"{hits / max(1, hits + misses):.3f} | {up / a.n:.1f} uploads per pass | {a.n_layer} layers x "
                      f"{a.n_expert} experts, top-{a.k}, {a.slots} slots",
                      flush=True)
                cache.close()


if __name__ == "__main__":
    main()
