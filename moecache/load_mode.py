"""``--load-mode``: where the weights live in host memory.

- ``mmap``: tensors are views of the memory-mapped file (the page cache holds them; nothing is
  copied at load; uploads to the GPU go through pageable memory or a staging buffer).
- ``pin``: every tensor is copied once, at load, into page-locked (pinned) host memory, so expert
  uploads and prompt processing read by DMA. :func:`pin_model` refuses, before allocating anything,
  a model that would not leave :data:`moecache.settings.PIN_HEADROOM_BYTES` (or 10% of RAM) free:
  nothing here makes the machine swap.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import psutil

from moecache.errors import MoecacheError
from moecache.gguf_file import GGUFModel
from moecache.settings import GiB, PIN_HEADROOM_BYTES, pin_fits


ALIGN = 64  # tensor starts in the pinned buffer (GGUF aligns to 32; kernels read words)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def check_pin_fits(n_bytes: int) -> None:
    """Raise MoecacheError (naming the sizes) if pinning ``n_bytes`` would leave too little RAM."""
    vm = psutil.virtual_memory()
    if not pin_fits(n_bytes, vm.available, vm.total):
        head = max(PIN_HEADROOM_BYTES, vm.total // 10)
        raise MoecacheError(f"--load-mode pin: the model needs {n_bytes / GiB:.1f} GiB of pinned RAM + "
                            f"{head / GiB:.1f} GiB headroom, {vm.available / GiB:.1f} GiB is available: "
                            f"use --load-mode mmap")


def pin_model(model: GGUFModel, progress: Callable[[int, int, float], None] | None = None) -> np.ndarray:
    """Copy every tensor of ``model`` into one page-locked buffer and point the tensor views at it.

    Args:
        model: the opened GGUF; its ``tensors`` are replaced by views of the pinned copy.
        progress: called as ``(bytes done, bytes total, seconds)`` after each tensor.

    Returns:
        The pinned uint8 buffer (keep it alive as long as the model).

    Raises:
        MoecacheError: the model does not fit in available RAM with headroom, or CuPy / a GPU
            (which allocates page-locked memory) is missing.
    """
    total = sum(_aligned(t.n_bytes) for t in model.tensors.values())
    check_pin_fits(total)
    try:
        import cupyx
    except ImportError as e:
        raise MoecacheError(f"--load-mode pin needs CuPy and a GPU ({e.name} is not installed): "
                            f"use --load-mode mmap") from None
    try:
        buf = cupyx.empty_pinned((total,), np.uint8)
    except Exception as e:  # noqa: BLE001 - CUDA out of memory / no device
        raise MoecacheError(f"--load-mode pin: could not allocate {total / GiB:.1f} GiB of pinned memory ({e})") from None
    t0 = time.perf_counter()
    off = 0
    for name, t in list(model.tensors.items()):
        n = t.n_bytes
        dst = buf[off:off + n]
        dst[:] = t.data.reshape(-1).view(np.uint8)
        view = dst.view(t.data.dtype).reshape(t.data.shape)
        view.flags.writeable = False
        model.tensors[name] = dataclasses.replace(t, data=view)
        off += _aligned(n)
        if progress is not None:
            progress(off, total, time.perf_counter() - t0)
    return buf
