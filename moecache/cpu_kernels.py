"""The CPU kernels a run needs: which ones, which are not compiled yet (Numba's on-disk cache), and
the warm-up that loads the prompt path's kernels before anything is timed."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def cpu_kernel_names(model) -> set[str]:
    """The Numba kernels (moecache.quants.cpu's names) a CPU run of ``model`` (a path, or an opened
    :class:`moecache.gguf_file.GGUFModel`) calls: matmul and dequantize per quantized weight type,
    the grouped MoE kernel per (gate, up, down) type triple."""
    from moecache.gguf_file import GGUFModel, open_gguf

    if not isinstance(model, GGUFModel):
        with open_gguf(model) as g:
            return cpu_kernel_names(g)
    names: set[str] = set()
    exps: dict[str, dict[str, str]] = {}
    for n, t in model.tensors.items():
        tn = t.type_name.lower()
        if "_exps." in n:
            parts = n.split(".")
            exps.setdefault(parts[1], {})[parts[2]] = tn
        elif len(t.shape) >= 2 and tn != "f32":  # F32 matrices go to BLAS
            names |= {f"matmul_{tn}", f"dequant_{tn}"}
    for d in exps.values():
        if {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"} <= d.keys():
            names.add(f"moe_ffn_{d['ffn_gate_exps']}_{d['ffn_up_exps']}_{d['ffn_down_exps']}")
    return names


def uncompiled_kernels(names: set[str]) -> set[str]:
    """The kernels of ``names`` with no entry in Numba's on-disk cache for this checkout's kernel
    sources (``<kernel_cache_dir>/<numba's subpath of moecache/quants>/cpu.<name>-<line>.py3X.nbi``):
    these compile on first use (seconds each)."""
    import hashlib
    import sys

    from moecache.quants import _numba_setup

    src_dir = Path(_numba_setup.__file__).resolve().parent
    root = Path(os.environ.get("NUMBA_CACHE_DIR") or _numba_setup.kernel_cache_dir())
    # numba.core.caching._CacheLocator.get_suitable_cache_subpath: "<dir name>_<sha1 of the dir path>"
    sub = root / f"{src_dir.name}_{hashlib.sha1(str(src_dir).encode()).hexdigest()}"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    have = {p.name.split("-")[0].removeprefix("cpu.") for p in sub.glob(f"cpu.*.{py}.nbi")} if sub.is_dir() else set()
    return {n for n in names if n not in have}


@dataclass
class Compiles:
    """The Numba compilations of moecache's kernels inside a :func:`count_compiles` block (set when
    the block ends)."""

    count: int = 0


@contextmanager
def count_compiles(prefix: str = "moecache."):
    """Count the kernels (module names starting with ``prefix``) Numba compiles inside the ``with``
    block: its ``numba:compile`` event fires for a real compilation only, not for a kernel loaded
    from the on-disk cache. :func:`uncompiled_kernels` sees whether a kernel has a cache entry at
    all; this also sees a kernel cached for other argument types only (a test run's), which
    compiles again for the run's own. Yields a :class:`Compiles`."""
    from numba.core import event

    out = Compiles()
    with event.install_recorder("numba:compile") as rec:
        try:
            yield out
        finally:
            mods = (getattr(getattr((ev.data or {}).get("dispatcher"), "py_func", None), "__module__", "") or ""
                    for _, ev in rec.buffer if ev.is_start)
            out.count = sum(m.startswith(prefix) for m in mods)


def warm_prompt_path(eng) -> None:
    """Evaluate one prompt-sized ubatch and forget it: a CPU prompt of BLAS_MIN_TOKENS+ tokens calls
    the dequantize kernels (the engine's own one-token warm-up does not), so without this their
    loading (or compiling) lands in the first prompt's timing."""
    from moecache.backends.numpy_backend import BLAS_MIN_TOKENS

    n = min(BLAS_MIN_TOKENS, eng.n_ubatch, eng.n_ctx)
    if n < BLAS_MIN_TOKENS:
        return  # every prompt ubatch is smaller: the decode kernels, warmed by the engine, serve it
    tok = eng.tokenizer.bos_id if eng.tokenizer.bos_id is not None else 0
    eng.eval([tok] * n)
    eng.reset()
    for c in eng.caches:
        c.reset_stats()
