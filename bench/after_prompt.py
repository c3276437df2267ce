"""Decode before and after a prompt in one process: where does the after-prompt slowdown live?

On the H200 machine (twenty-eighth session, ``bench/results/static-h200-s28.md``) the static
placement at 8 GiB (``--n-cpu-moe 36 --moe-cache 0``) decoded tg128 at 63.2 t/s in a process that
ran no prompt and at 51.6-59.1 after ``bench``'s pp512 test in the same process. This script loads
one engine as ``moecache bench`` does and runs a sequence of tests in that one process (``tg``: ``-n``
one-token steps, ``pp``: one ``-p``-token prompt; each from an empty KV cache, as llama-bench does),
so the decode before and after each prompt is measured side by side. ``--after-prompt`` does one
thing after every prompt, to test a cause:

- ``none``: nothing;
- ``gc``: ``gc.collect()`` then ``gc.freeze()`` (Python's collector over the prompt's objects);
- ``pools``: CuPy's default and page-locked memory pools give their free blocks back;
- ``sleep``: 2 s idle (anything the prompt left running in the background finishes).

Per test, one JSON line: t/s, the steps the decode graph replayed, the process's CPU seconds per
second of wall time during the test
(about the threads busy: spinning OpenMP workers show here), the threads of the process and those
running when the test ended, Python's tracked objects (frozen ones included), and the bytes CuPy's default pool holds.
The OpenMP wait policy is the ``moecache`` command's for the same flags
(:func:`moecache.threads.openmp_wait_for_args`).

    python bench/after_prompt.py -m /tmp/q30.gguf --vram-budget 8GiB --n-cpu-moe 36 --routing uniform
    python bench/after_prompt.py -m /tmp/q30.gguf --vram-budget 8GiB --moe-cache -1 --routing uniform --after-prompt gc
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

ACTIONS = ("none", "gc", "pools", "sleep")


def thread_states() -> tuple[int, int]:
    """(threads of this process, those running now) from /proc; (0, 0) where there is none."""
    try:
        tasks = os.listdir(f"/proc/{os.getpid()}/task")
    except OSError:
        return 0, 0
    running = 0
    for t in tasks:
        try:
            with open(f"/proc/{os.getpid()}/task/{t}/stat") as f:
                running += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:
            continue
    return len(tasks), running


def after_prompt(action: str) -> None:
    """Do ``action`` (one of :data:`ACTIONS`) after a prompt."""
    if action == "gc":
        gc.collect()
        gc.freeze()
    elif action == "pools":
        cp = sys.modules.get("cupy")
        if cp is not None:
            cp.get_default_memory_pool().free_all_blocks()
            cp.get_default_pinned_memory_pool().free_all_blocks()
    elif action == "sleep":
        time.sleep(2.0)


def pool_bytes() -> int | None:
    """Bytes CuPy's default memory pool holds (None without CuPy loaded)."""
    cp = sys.modules.get("cupy")
    return None if cp is None else int(cp.get_default_memory_pool().total_bytes())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--n-cpu-moe", type=int, default=0, help="static placement: the first N layers' experts on the CPU")
    ap.add_argument("--moe-cache", type=int, default=0, help="-1: the expert cache fills the free VRAM; 0: off")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens of a pp test")
    ap.add_argument("-n", type=int, default=128, help="one-token steps of a tg test")
    ap.add_argument("-c", type=int, default=4096)
    ap.add_argument("-t", type=int, default=15)
    ap.add_argument("--load-mode", default="pin")
    ap.add_argument("--sequence", default="tg,tg,pp,tg,tg,pp,tg", help="tests in order, comma list of tg and pp")
    ap.add_argument("--after-prompt", default="none", choices=ACTIONS)
    a = ap.parse_args(argv)
    seq = a.sequence.split(",")
    if not seq or any(s not in ("tg", "pp") for s in seq):
        ap.error(f"--sequence {a.sequence!r}: a comma list of tg and pp")
    if max(a.p, a.n) + 8 > a.c:
        ap.error(f"-c {a.c} is too small for -p {a.p} / -n {a.n}")

    from moecache.threads import openmp_wait_for_args

    flags = ["-t", str(a.t)] + (["--n-cpu-moe", str(a.n_cpu_moe)] if a.n_cpu_moe else [])
    print("OpenMP wait:", openmp_wait_for_args(flags), file=sys.stderr)
    from moecache.cli.common import load_engine
    from moecache.settings import Settings
    from moecache.sizes import parse_size

    settings = Settings(n_ctx=a.c, n_threads=a.t, n_cpu_moe=a.n_cpu_moe, moe_cache=a.moe_cache,
                        vram_budget=parse_size(a.vram_budget, "--vram-budget"), load_mode=a.load_mode,
                        routing=a.routing or None)
    eng = load_engine(a.model, settings, "bench").engine
    try:
        run_sequence(eng, seq, a)
    finally:
        eng.close()


def run_sequence(eng, seq: list[str], a: argparse.Namespace) -> None:
    """The tests of ``seq`` on ``eng``, one JSON row each on stdout (see the module docstring)."""
    rng = np.random.default_rng(0)
    vocab = eng.gguf.config.n_vocab
    eng.reset()
    eng.eval([1])  # the graph's capture and the kernels' first calls, outside every test
    for i, kind in enumerate(seq):
        eng.reset()
        g = getattr(eng.model, "decode_graph", None)
        r0 = g.replays if g is not None else 0
        c0, t0 = os.times(), time.perf_counter()
        if kind == "pp":
            eng.eval(rng.integers(0, vocab, a.p))
        else:
            for _ in range(a.n):
                eng.eval([int(rng.integers(0, vocab))])
        dt = time.perf_counter() - t0
        c1 = os.times()
        threads, running = thread_states()
        row = {"i": i, "test": f"pp{a.p}" if kind == "pp" else f"tg{a.n}",
               "t_s": round((a.p if kind == "pp" else a.n) / dt, 2),
               "cpu_per_wall": round((c1.user - c0.user + c1.system - c0.system) / dt, 2),
               "threads": threads, "running": running, "gc_objects": len(gc.get_objects()) + gc.get_freeze_count(),
               "cupy_pool_mib": None if pool_bytes() is None else round(pool_bytes() / 2**20),
               "graph_steps": (g.replays - r0) if g is not None else None, "after_prompt": a.after_prompt}
        print(json.dumps(row), flush=True)
        if kind == "pp":
            after_prompt(a.after_prompt)


if __name__ == "__main__":
    main()
