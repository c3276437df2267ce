"""Numba settings that must be in place before anything compiles. Imported first by the kernels.

- Threading layer ``threadsafe`` (TBB or OpenMP, whichever is installed): the expert cache calls
  the kernels from a worker thread while the main thread drives the GPU, and the ``workqueue``
  layer aborts when two threads enter parallel code at once.
- On AVX-512 machines, LLVM's ``prefer-256-bit`` tuning is switched off so the dequant-dot loops
  use 512-bit vectors (measured +25% on the GPU machine's Xeon, ../shared/style.md). This goes
  through ``NUMBA_CPU_FEATURES`` and only takes effect if numba was not configured yet; a user's
  own ``NUMBA_CPU_FEATURES`` always wins.
- OpenMP spin time is a process setting the commands choose: see ``moecache/threads.py``
  (dequantize-then-sgemm ran 3.5x slower on 2 cores with libgomp's default spin: 8.9 ms vs 2.6 ms
  per 2048x640 matrix).
- Compiled kernels are cached under ``~/.cache/moecache/numba/<hash of the kernel sources>``
  (``$XDG_CACHE_HOME`` respected; a user's ``NUMBA_CACHE_DIR`` wins). Numba checks only the
  timestamp of the file that *defines* a function, so an edit to an inlined block decoder
  (blocks32.py, ...) would otherwise keep serving stale machine code.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


def _configure() -> None:
    if "NUMBA_CPU_FEATURES" not in os.environ and "numba" not in sys.modules:
        try:
            import llvmlite.binding as llvm

            feats = llvm.get_host_cpu_features().flatten()
            if "+avx512f" in feats.split(","):
                os.environ["NUMBA_CPU_FEATURES"] = feats + ",-prefer-256-bit"
        except Exception:  # pragma: no cover - llvmlite without host feature query
            pass
    import numba

    if os.environ.get("NUMBA_THREADING_LAYER") is None:
        numba.config.THREADING_LAYER = "threadsafe"
    if not os.environ.get("NUMBA_CACHE_DIR"):
        numba.config.CACHE_DIR = str(kernel_cache_dir())


def kernel_cache_dir() -> Path:
    """Where the compiled kernels of this exact kernel source live."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "moecache" / "numba" / h.hexdigest()[:16]


_configure()
