"""Load a script of ``bench/`` as a module by its path, without putting ``bench/`` on ``sys.path``.

``bench/`` is a folder of scripts, not a package, and some of its names are also names of installed
packages (``bench/kernels.py`` against Hugging Face's ``kernels``, which transformers imports when
it finds it): a ``sys.path`` entry for ``bench/`` would hand transformers our script, and the
reference tests that build transformers models would fail with an ImportError.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``moecache_bench_<name>`` (registered in ``sys.modules``, as
    dataclasses need, under a name no installed package has); loaded once per process."""
    key = f"moecache_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[key]
        raise
    if any(Path(e or ".").resolve() == BENCH for e in sys.path):  # a script put its folder there itself
        raise AssertionError(f"bench/{name}.py put bench/ on sys.path: load it otherwise (see this module)")
    return mod
