"""``moecache`` CLI with the prompt passes' VRAM budget guard counted: how often CuPy's pool was asked
to grow under ``--vram-budget`` (``calls``), how often the guard gave the pool's free blocks back
first (``releases``, each a device synchronisation), and the host seconds both took (``pre_s``,
``release_s``). One line ``GUARD <package> {...}`` at exit, after the command's own output.

Used to tell whether the guard slows a long prompt down (``bench/results/pp12620-ab-h200.md``); run it
with ``PYTHONPATH`` pointing at the tree to measure, so older trees can be compared in one lease:

    PYTHONPATH=TREE python bench/guard_count.py bench -m MODEL -p 12620 -n 0 -r 3 -o jsonl \\
        -ngl 99 --moe-cache -1 --vram-budget 8192MiB --routing qwen3-moe --load-mode pin

Needs CuPy (the guard is ``CupyBackend.budget_guard``'s); the arguments are ``moecache``'s.
"""

from __future__ import annotations

import atexit
import sys
import time


def main() -> None:
    import moecache
    from moecache.backends import cupy_backend as cb
    from moecache.cli.main import app

    stats = {"calls": 0, "releases": 0, "release_s": 0.0, "pre_s": 0.0}
    inner = cb._BudgetGuard.alloc_preprocess

    def counted(self, **kw):
        t, before = time.perf_counter(), self.releases
        inner(self, **kw)
        dt = time.perf_counter() - t
        stats["calls"] += 1
        stats["pre_s"] += dt
        if self.releases != before:
            stats["releases"] += 1
            stats["release_s"] += dt

    cb._BudgetGuard.alloc_preprocess = counted
    atexit.register(lambda: print("GUARD", moecache.__file__, stats, flush=True))
    sys.argv = ["moecache", *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
