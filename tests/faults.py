"""Faults injected into a forward pass for the tests of its error paths."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def bad_row(forward: Callable[..., np.ndarray], row: int, value: float = np.nan) -> Callable[..., np.ndarray]:
    """``forward`` (any call returning float32 logits (N, n_vocab)) with entry 0 of logits row ``row``
    set to ``value`` (NaN or inf): as if the model had computed a non-finite row for that sequence."""
    def poisoned(*args: Any, **kwargs: Any) -> np.ndarray:
        lg = forward(*args, **kwargs)
        lg[row, 0] = value
        return lg
    return poisoned
