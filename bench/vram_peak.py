"""Device memory of a cache-on engine at ``--vram-budget``: after load, after one prompt ubatch and
after decoding, with the arrays alive at the prompt's peak, by the line of moecache that made them.

Shows what the placement planner's reserve must cover beyond the planned weights, KV cache and
expert slots: the CUDA context (before loading), kernel modules and cuBLAS (outside CuPy's pool)
and the transient blocks of a prompt ubatch (CuPy's pool total minus its used bytes), and which
allocations make the prompt's peak (:class:`LiveBytes`: every pool allocation and free of the
prompt, its call site the innermost frame in ``moecache/``).

    python bench/vram_peak.py -m /tmp/q30.gguf --vram-budget 8GiB --routing low-locality
    python bench/vram_peak.py -m /tmp/q30.gguf --vram-budget 8GiB --routing qwen3-moe -p 2048 -ub 2048 -c 4096
"""

from __future__ import annotations

import argparse
import traceback
from collections import Counter
from pathlib import Path

import numpy as np

MOECACHE = str(Path(__file__).resolve().parents[1] / "moecache")


class LiveBytes:
    """Pool allocations alive, and a snapshot of them by call site at their largest total.

    ``malloc(ptr, nbytes, site)`` / ``free(ptr)`` as the pool reports them; ``peak`` is the largest
    total of live bytes seen, ``at_peak`` a Counter site -> bytes alive then (``counts``: how many
    blocks)."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, str]] = {}
        self.total = 0
        self.peak = 0
        self.at_peak: Counter = Counter()
        self.counts: Counter = Counter()

    def malloc(self, ptr: int, nbytes: int, site: str) -> None:
        self.live[ptr] = (nbytes, site)
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak, self.counts = Counter(), Counter()
            for n, s in self.live.values():
                self.at_peak[s] += n
                self.counts[s] += 1

    def free(self, ptr: int) -> None:
        n, _ = self.live.pop(ptr, (0, ""))
        self.total -= n

    def report(self, top: int = 15) -> str:
        lines = [f"peak of the arrays alive: {self.peak / 2**20:.1f} MiB; by site:"]
        for s, n in self.at_peak.most_common(top):
            lines.append(f"  {n / 2**20:9.1f} MiB in {self.counts[s]:4d} block(s)  {s}")
        return "\n".join(lines)


def call_site() -> str:
    """The innermost frame in moecache/ of the current stack ("file:line function"), else "?"."""
    for fr in reversed(traceback.extract_stack(limit=40)[:-2]):
        if fr.filename.startswith(MOECACHE):
            return f"{Path(fr.filename).relative_to(Path(MOECACHE).parent)}:{fr.lineno} {fr.name}"
    return "?"


def main() -> None:
    import cupy as cp
    from cupy.cuda.memory_hook import MemoryHook

    from moecache.engine import Engine, EngineConfig
    from moecache.moe.routing_process import make_routing
    from moecache.placement import PlacementOptions
    from moecache.sizes import parse_size

    class Hook(MemoryHook):
        name = "LiveBytes"

        def __init__(self, live: LiveBytes):
            self.live = live

        def malloc_postprocess(self, **kw):
            self.live.malloc(kw["mem_ptr"], kw["mem_size"], call_site())

        def free_postprocess(self, **kw):
            self.live.free(kw["mem_ptr"])

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default="low-locality")
    ap.add_argument("-p", type=int, default=111, help="prompt tokens")
    ap.add_argument("-ub", type=int, default=512, help="tokens per ubatch (-b too)")
    ap.add_argument("-n", type=int, default=32, help="decoded tokens")
    ap.add_argument("-c", type=int, default=4096)
    ap.add_argument("-ctk", "--cache-type", default="f16")
    a = ap.parse_args()
    pool = cp.get_default_memory_pool()

    def report(tag: str) -> None:
        free, total = cp.cuda.runtime.memGetInfo()
        print(f"{tag}: device used {(total - free) >> 20} MiB, pool used {pool.used_bytes() >> 20} MiB, "
              f"pool total {pool.total_bytes() >> 20} MiB", flush=True)

    report("before loading (CUDA context)")
    cfg = EngineConfig(n_ctx=a.c, n_batch=max(a.ub, 1), n_ubatch=a.ub, cache_type=a.cache_type)
    with Engine(a.model, cfg, placement=PlacementOptions(vram_budget=parse_size(a.vram_budget, "--vram-budget")),
                load_mode="pin", log=print) as eng:
        report("loaded")
        c = eng.gguf.config
        eng.model.routing_override = make_routing(a.routing, c.n_layer, c.n_expert, c.n_expert_used, seed=0)
        rng = np.random.default_rng(0)
        live = LiveBytes()
        base = pool.used_bytes()
        with Hook(live):
            eng.eval(rng.integers(0, c.n_vocab, a.p))
        report(f"after pp{a.p} at -ub {a.ub}")
        print(f"(the pool held {base >> 20} MiB before the prompt; its arrays' peak above that:)")
        print(live.report())
        for _ in range(a.n):
            eng.eval([int(rng.integers(0, c.n_vocab))])
        report(f"after {a.n} decoded tokens")
        pool.free_all_blocks()
        report("after returning CuPy's cached blocks")


if __name__ == "__main__":
    main()
