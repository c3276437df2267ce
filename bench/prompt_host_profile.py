"""The host's time in one prompt, by Python function (cProfile): what keeps the GPU waiting.

Loads the model as ``moecache bench`` does (the library's settings road; every layer and expert on
the GPU unless ``--vram-budget`` is given), evaluates ``-r`` prompts of ``-p`` fresh random tokens
(the first compiles and warms) and prints their times, then evaluates one more under cProfile and
prints the functions by own time and by cumulative time. cProfile slows the host (the profiled
prompt is slower than the timed ones); read it for shares, and the timed prompts for the speed.
The GPU's side of the same prompt: ``bench/prompt_timeline.py``.

    python bench/prompt_host_profile.py -m /tmp/q30.gguf -p 512
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-r", "--reps", type=int, default=4, help="timed prompts before the profiled one")
    ap.add_argument("--vram-budget", default=None, help="with an expert cache (as --vram-budget); default: none")
    ap.add_argument("--routing", default=None, help="--routing preset (with --vram-budget); default: the model's router")
    ap.add_argument("--load-mode", default="pin")
    ap.add_argument("-t", "--threads", type=int, default=15)
    ap.add_argument("--top", type=int, default=45, help="functions printed per order")
    a = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prompt_timeline import timed_prompt

    from moecache.llm import open_llm
    from moecache.settings import Settings

    settings = Settings(n_ctx=a.n_prompt, n_gpu_layers=99, moe_cache=-1 if a.vram_budget else None,
                        vram_budget=a.vram_budget, routing=a.routing, load_mode=a.load_mode, n_threads=a.threads)
    with open_llm(a.model, settings, command="bench", log=lambda m: print(m, file=sys.stderr, flush=True)) as llm:
        eng = llm.engine
        rng = np.random.default_rng(0)
        vocab = eng.gguf.config.n_vocab

        prompt = timed_prompt(eng, a.n_prompt, rng, vocab)
        for i in range(a.reps):
            dt = prompt()
            print(f"prompt {i}: {dt * 1e3:.1f} ms, {a.n_prompt / dt:.0f} t/s")
        prof = cProfile.Profile()
        prof.enable()
        dt = prompt()
        prof.disable()
        print(f"profiled prompt: {dt * 1e3:.1f} ms")
    for order in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(a.top)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
