"""moecache: run Mixture-of-Experts GGUF models larger than GPU memory.

Layout (../shared/design.md): ``gguf_file`` and ``arch`` read and validate GGUF files;
``quants`` holds the block-format table and the Numba CPU kernels; ``testing`` the synthetic GGUF
writer and a float64 reference forward pass used by the tests.
"""

import os as _os

# Before any OpenMP runtime loads (gguf may pull one in through sentencepiece): idle OpenMP (GNU
# libgomp) threads spin 10k rounds, not the default 300k, then sleep, so Numba's parallel kernels
# don't starve the OpenBLAS threads of the next call (measured on 2 cores, gemma3-270m: prefill
# 36 -> ~100 t/s; fully passive threads cost decode 15%). A user's own setting wins.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"
