"""Process-wide thread settings a command applies before any OpenMP runtime loads.

:func:`short_openmp_spin` makes idle OpenMP (GNU libgomp) threads spin 10k rounds, not the default
300k, before they sleep. With the default, Numba's worker threads keep spinning after each parallel
kernel and starve the OpenBLAS threads of the next call: on 2 cores, gemma3-270m's prefill
(dequantize a weight tile, then sgemm) ran at 36 instead of ~100 t/s; fully passive threads
(``OMP_WAIT_POLICY=PASSIVE``) cost decode 15% instead. It changes the process environment, so the
commands (``moecache/cli/main.py``, ``bench/``) call it, not the library; a user's own setting wins. It has
no effect once an OpenMP runtime is loaded (``gguf`` may load one through sentencepiece: call it
first).
"""

from __future__ import annotations

import os

SPINCOUNT = "10000"


def short_openmp_spin() -> None:
    """Set ``GOMP_SPINCOUNT`` unless ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is already set."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)
