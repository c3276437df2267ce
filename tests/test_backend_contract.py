"""The backend contract (moecache/backends/contract.py): the CPU backend implements both protocols;
the GPU backend's class defines every member too (read from its source and its base class, so the
check runs in CI without CuPy)."""

from __future__ import annotations

import ast
from pathlib import Path

from moecache.backends import NumpyBackend
from moecache.backends.contract import ArrayBackend, CacheBackend, SlotBackend, members
from moecache.backends.ops import ArrayOps

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_backend_implements_both_protocols():
    be = NumpyBackend()
    assert isinstance(be, ArrayBackend) and isinstance(be, SlotBackend) and isinstance(be, CacheBackend)
    assert {"matmul", "attention", "qk_rope_store"} <= members(ArrayBackend)
    assert {"start_slot_copy", "moe_ffn_cached"} <= members(SlotBackend)


def test_the_gpu_backend_defines_every_member():
    tree = ast.parse((ROOT / "moecache" / "backends" / "cupy_backend.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CupyBackend")
    assert [b.id for b in cls.bases if isinstance(b, ast.Name)] == ["ArrayOps"]
    own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    own |= {"device"}  # set in __init__
    inherited = {n for n in dir(ArrayOps) if not n.startswith("__")}
    missing = (members(ArrayBackend) | members(SlotBackend)) - own - inherited
    assert not missing, f"CupyBackend lacks {sorted(missing)}"


def test_the_cuda_token_limit_is_the_python_one():
    """dequant.cu's MAX_TOK (the decode kernels' token loops) defaults to DECODE_MAX_TOKENS, and the
    GPU backend compiles it with -DMAX_TOK from that constant (read from the sources: no CuPy here)."""
    import re

    from moecache.backends.ops import DECODE_MAX_TOKENS

    cu = (ROOT / "moecache" / "quants" / "cuda" / "dequant.cu").read_text()
    assert int(re.search(r"#define MAX_TOK (\d+)", cu).group(1)) == DECODE_MAX_TOKENS
    assert "#ifndef MAX_TOK" in cu
    py = (ROOT / "moecache" / "backends" / "cupy_backend.py").read_text()
    assert 'f"-DMAX_TOK={DECODE_MAX_TOKENS}"' in py
