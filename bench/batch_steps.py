"""Time of one decode step of B sequences decoded together (continuous batching: Engine.sequences /
Engine.decode, as serve's slots run), against one sequence through the CUDA graph and op by op.

Each of 8 slot sequences (``-c 8192`` split in 8) holds a 4-token prompt; every step appends the
same token to each of B sequences (so the routed experts of the B tokens are alike: the step's
host and launch cost, not the experts' bytes); ``--distinct`` gives each sequence its own token.
Batched steps replay CUDA graphs (``DecodeGraph.batched``, the engine's default);
``--no-batch-graph`` runs them op by op. ``--vram-budget`` and ``--routing`` are ``run``'s flags
(an expert cache and a routing process). ``--profile`` adds a cProfile of three B=2 steps.

    python bench/batch_steps.py -m /tmp/q30.gguf -t 15 [--distinct] [--no-batch-graph] \
        [--vram-budget 8GiB --routing qwen3-moe]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import numpy as np

import moecache


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-r", "--reps", type=int, default=8, help="steps timed per case")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--distinct", action="store_true", help="a different token for each sequence")
    ap.add_argument("--no-batch-graph", action="store_true", help="batched steps op by op")
    ap.add_argument("--vram-budget", default=None, help="as run's --vram-budget (e.g. 8GiB)")
    ap.add_argument("--routing", default=None, help="as run's --routing (e.g. qwen3-moe)")
    a = ap.parse_args(argv)
    kw = {"n_ctx": 8192} | ({"n_threads": a.threads} if a.threads else {})
    kw |= {k: v for k, v in (("vram_budget", a.vram_budget), ("routing", a.routing)) if v is not None}
    with moecache.load(a.model, log=lambda s: print(s, file=sys.stderr), **kw) as llm:
        eng = llm.engine
        seqs = eng.sequences(8)
        for s in seqs:
            eng.eval([1, 2, 3, 4], kv=s)
        gpu = eng.model.be.device is not None
        if a.no_batch_graph and eng.model.decode_graph is not None:
            eng.model.decode_graph.batched = False

        def toks(b: int) -> list[int]:
            return [5 + 7 * i for i in range(b)] if a.distinct else [5] * b

        def sync() -> None:
            if gpu:
                import cupy

                cupy.cuda.Device().synchronize()

        def timeit(label: str, fn) -> None:
            fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(a.reps):
                fn()
            sync()
            print(f"{label}: {(time.perf_counter() - t0) / a.reps * 1e3:.2f} ms/step", flush=True)

        timeit("B=1 eval (the CUDA graph where there is one)", lambda: eng.eval([5], kv=seqs[0]))
        timeit("B=1 forward_seqs", lambda: eng.model.forward_seqs(np.array([5]), [seqs[0]]))
        for b in (2, 4, 8):
            timeit(f"B={b} decode", lambda: eng.decode(toks(b), seqs[:b]))
        if a.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(3):
                eng.decode([5, 6], seqs[:2])
            sync()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
