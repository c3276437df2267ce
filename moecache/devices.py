"""The GPUs this process can use, and the backend of each device id.

Every way of ending up without a GPU (CuPy not installed, no CUDA device, a driver error) comes
back as a reason string for the caller to print once; nothing here raises for a missing GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moecache.backends import NumpyBackend
from moecache.placement import CPU
from moecache.probe import gpu_infos


def gpu_memory() -> tuple[list[int], list[int], str]:
    """(free bytes, bytes already in use) of each visible CUDA device, and a reason when the lists are
    empty (:func:`moecache.probe.gpu_infos` without measuring links). In use = total - free - the
    free blocks CuPy's default pool holds on the device (a new engine reuses those): this process's
    CUDA context, which the query itself creates, live arrays, and whatever else holds the device."""
    gpus, why = gpu_infos(0, 1, full=False)
    cached = _pool_free_bytes(len(gpus))
    return ([g.vram_free for g in gpus],
            [max(0, g.vram_total - g.vram_free - c) for g, c in zip(gpus, cached)], why)


def _pool_free_bytes(n: int) -> list[int]:
    """Bytes of freed blocks CuPy's default memory pool keeps on each of the first ``n`` devices."""
    if not n:
        return []
    import cupy as cp

    pool = cp.get_default_memory_pool()
    out = []
    for i in range(n):
        with cp.cuda.Device(i):
            out.append(int(pool.free_bytes()))
    return out


def gpu_name(device: int) -> str:
    """The CUDA device's name (for notes)."""
    import cupy as cp

    name: Any = cp.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def make_backends(devices: list[int], log: Callable[[str], None], act_q8: bool = True,
                  prompt_q8: bool = False) -> dict[int, Any]:
    """One backend per device id: ``CPU`` -> NumpyBackend, a GPU ordinal -> CupyBackend on it
    (``act_q8``: the GPU's decode products round activations to int8; ``prompt_q8``: its prompt MoE
    runs the grouped 8-bit kernels; see CupyBackend)."""
    out: dict[int, Any] = {CPU: NumpyBackend()}
    if any(d != CPU for d in devices):
        from moecache.backends.cupy_backend import CupyBackend

        for d in devices:
            if d != CPU:
                out[d] = CupyBackend(d, log=log, act_q8=act_q8, prompt_q8=prompt_q8)
    return out
