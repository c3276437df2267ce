"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import pytest


def shared_model(name: str) -> Path | None:
    """A file of ../shared/models (beside the checkout, as CI lays it out), or None."""
    for root in (Path(__file__).resolve().parents[2] / "shared", Path.cwd().parent / "shared"):
        p = root / "models" / name
        if p.is_file():
            return p
    return None


@pytest.fixture
def code_moe_tiny() -> Path:
    """../shared/models/code-moe-tiny.gguf: a real trained qwen3moe (skips when absent)."""
    p = shared_model("code-moe-tiny.gguf")
    if p is None:
        pytest.skip("code-moe-tiny.gguf not found under ../shared/models")
    return p
