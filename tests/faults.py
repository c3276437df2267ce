"""Faults injected into a forward pass for the tests of its error paths, and a stand-in for the
engine's process stuck in its load."""

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


def engine_child_that_loads_forever(conn: Any, path: str, settings: Any, n_parallel: int, verbose: bool) -> None:
    """A stand-in for the engine's process (``EngineProcess(target=...)``) stuck in its load: it
    ignores SIGINT and SIGTERM as the real one does, touches ``path`` to say so, and never answers."""
    import signal
    import time
    from pathlib import Path

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    Path(path).touch()
    time.sleep(600)


def engine_child_that_dies_when_asked(conn: Any, path: str, settings: Any, n_parallel: int, verbose: bool) -> None:
    """A stand-in for the engine's process that says it is ready (256 positions, 64 a slot), drops
    the first job it gets without an answer and ends with exit code 3, as a crash would."""
    import os

    conn.send(("ready", 256, 64))
    conn.recv()
    os._exit(3)
