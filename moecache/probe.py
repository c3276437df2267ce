"""What the machine offers (GPUs, links, RAM, cores), measured.

Two probes:

- :func:`full_probe` (``moecache probe-pcie``): every GPU's name, compute capability, PCIe link
  (NVML through ``nvidia-ml-py`` where installed, else Linux sysfs), free/total VRAM and copy
  bandwidths (host->device from pinned and from pageable memory, device->host, device-to-device),
  and the host's CPU, cores, RAM and RAM read bandwidth (one thread and all threads). Medians of
  ``reps`` timed copies of a ``size``-byte buffer.
- :func:`startup_probe` (every command that loads a model): cores, RAM and free VRAM read from the
  system, plus each GPU's pinned host->device bandwidth measured once per boot on a small buffer and
  remembered in ``~/.cache/moecache/probe.json`` (keyed by the kernel's boot id): well under a second.

The defaults resolved from a probe live in :mod:`moecache.settings` (:func:`moecache.settings.resolve`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil

GiB = 1 << 30
CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moecache" / "probe.json"
STARTUP_PROBE_BYTES = 64 << 20


@dataclass(frozen=True)
class HostInfo:
    """The host. Bandwidths in bytes/s (0 = not measured)."""

    cpu_model: str
    physical_cores: int
    logical_cores: int
    ram_total: int
    ram_available: int
    ram_read_1t: float = 0.0
    ram_read_all: float = 0.0


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device. Bytes and bytes/s; 0 = not measured; pcie fields None when unknown."""

    index: int
    name: str
    compute_capability: str
    vram_free: int
    vram_total: int
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_source: str = ""
    h2d_pinned: float = 0.0
    h2d_pageable: float = 0.0
    d2h_pinned: float = 0.0
    d2h_pageable: float = 0.0
    d2d_copy: float = 0.0  # bytes read + written per second


@dataclass(frozen=True)
class Probe:
    """The probe result: host, GPUs, and why there are none when ``gpus`` is empty."""

    host: HostInfo
    gpus: tuple[GpuInfo, ...] = ()
    no_gpu_reason: str = ""

    def to_json(self) -> dict:
        return {"host": asdict(self.host), "gpus": [asdict(g) for g in self.gpus], "no_gpu_reason": self.no_gpu_reason}


# ---- host -----------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores(cpus: set[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")) -> tuple[int, int] | None:
    """(physical cores, logical CPUs) among the CPUs this process may run on (``cpus``, default its
    affinity: ``taskset``, a cpuset, a batch job's share), the cores told apart by sysfs topology
    (``cpuN/topology/physical_package_id`` and ``core_id``); a CPU without them counts as its own
    core. None where the affinity is unknown (not Linux). CPU quotas (a container's ``--cpus``)
    leave the affinity as it is and are not seen."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:
            return None
    cores = set()
    for c in cpus:
        topo = sysfs / f"cpu{c}" / "topology"
        try:
            cores.add((int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())))
        except (OSError, ValueError):
            cores.add(("cpu", c))
    return len(cores), len(cpus)


def host_info(measure_bytes: int = 0, reps: int = 3) -> HostInfo:
    """Cores and RAM; with ``measure_bytes`` > 0 also the RAM read bandwidth (1 and all threads).
    The cores are those this process may run on (:func:`usable_cores`), at most the machine's."""
    vm = psutil.virtual_memory()
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    usable = usable_cores()
    if usable is not None:
        physical, logical = min(physical, max(1, usable[0])), min(logical, max(1, usable[1]))
    r1 = ra = 0.0
    if measure_bytes:
        r1, ra = ram_read_bandwidth(measure_bytes, reps)
    return HostInfo(cpu_model(), physical, logical, vm.total, vm.available, r1, ra)


def ram_read_bandwidth(n_bytes: int, reps: int) -> tuple[float, float]:
    """Median bytes/s a Numba ``prange`` sum reads from an ``n_bytes`` host array, with one thread and
    with all of Numba's threads."""
    from moecache.quants import _numba_setup  # noqa: F401 - the project's Numba settings, before numba loads

    import numba

    x = np.ones(max(n_bytes // 4, 1 << 20), np.float32)
    saved = numba.get_num_threads()
    out = []
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            _sum(x)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                _sum(x)
                times.append(time.perf_counter() - t0)
            out.append(x.nbytes / statistics.median(times))
    finally:
        numba.set_num_threads(saved)
    return out[0], out[1]


def _sum(x: np.ndarray) -> float:
    return _sum_kernel()(x)


_SUM = []


def _sum_kernel():
    if not _SUM:
        import numba

        @numba.njit(parallel=True, cache=True, fastmath=True)  # fastmath: a vectorized sum, not one
        def total(x):  # dependent add per element (which measured ~4 GB/s on one thread: latency, not RAM)
            s = 0.0
            for i in numba.prange(x.size):
                s += x[i]
            return s

        _SUM.append(total)
    return _SUM[0]


# ---- GPUs -----------------------------------------------------------------------------------------
def _pcie_link(cp, index: int) -> tuple[int | None, int | None, str]:
    """(generation, width, source) of a device's current PCIe link: NVML if importable, else sysfs."""
    props = cp.cuda.runtime.getDeviceProperties(index)
    bus = f"{props['pciDomainID']:04x}:{props['pciBusID']:02x}:{props['pciDeviceID']:02x}.0"
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
        return (int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)), int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
                "nvml")
    except Exception:  # noqa: BLE001 - NVML absent or failing: try sysfs
        pass
    base = Path("/sys/bus/pci/devices") / bus
    try:
        speed = (base / "current_link_speed").read_text().split()[0]  # "32.0 GT/s PCIe"
        width = int((base / "current_link_width").read_text().strip())
        gen = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}.get(speed)
        return gen, width, "sysfs"
    except (OSError, ValueError):
        return None, None, "unknown"


def _timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_bandwidths(cp, index: int, n_bytes: int, reps: int, full: bool = True) -> dict[str, float]:
    """Copy bandwidths of one device in bytes/s (median of ``reps``): pinned host->device always;
    with ``full`` also pageable, device->host and device-to-device (read + written bytes)."""
    import cupyx

    out = {}
    with cp.cuda.Device(index):
        dev = cp.empty(n_bytes, cp.uint8)
        pinned = cupyx.empty_pinned(n_bytes, np.uint8)
        pinned[:] = 1
        sync = cp.cuda.Device(index).synchronize

        def h2d(src):
            dev.data.copy_from_host(src.ctypes.data, n_bytes)
            sync()

        def d2h(dst):
            dev.data.copy_to_host(dst.ctypes.data, n_bytes)
            sync()

        out["h2d_pinned"] = n_bytes / _timed(lambda: h2d(pinned), reps)
        if full:
            pageable = np.ones(n_bytes, np.uint8)
            out["h2d_pageable"] = n_bytes / _timed(lambda: h2d(pageable), reps)
            out["d2h_pinned"] = n_bytes / _timed(lambda: d2h(pinned), reps)
            out["d2h_pageable"] = n_bytes / _timed(lambda: d2h(pageable), reps)
            other = cp.empty_like(dev)

            def d2d():
                other.data.copy_from_device(dev.data, n_bytes)
                sync()

            out["d2d_copy"] = 2 * n_bytes / _timed(d2d, reps)
    return out


def _import_cupy():
    try:
        import cupy as cp
    except ImportError as e:
        return None, f"CuPy is not installed ({e.name}; pip install -e '.[cuda]' for the GPU)"
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return None, f"CUDA unavailable: {e}"
    if n == 0:
        return None, "no CUDA device"
    return cp, ""


def gpu_infos(measure_bytes: int, reps: int, full: bool, cached: dict | None = None) -> tuple[list[GpuInfo], str]:
    """Every visible GPU; bandwidths measured (``measure_bytes`` > 0) or taken from ``cached``
    (keyed by PCI bus id)."""
    cp, why = _import_cupy()
    if cp is None:
        return [], why
    try:
        return _gpu_infos(cp, measure_bytes, reps, full, cached), ""
    except Exception as e:  # noqa: BLE001 - a busy, full or faulty GPU: say why, run without it
        return [], f"GPU probe failed: {type(e).__name__}: {e}"


def _gpu_infos(cp, measure_bytes: int, reps: int, full: bool, cached: dict | None) -> list[GpuInfo]:
    out = []
    for i in range(cp.cuda.runtime.getDeviceCount()):
        props = cp.cuda.runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        with cp.cuda.Device(i):
            free, total = cp.cuda.runtime.memGetInfo()
        gen, width, src = _pcie_link(cp, i)
        key = f"{props['pciDomainID']:04x}:{props['pciBusID']:02x}:{props['pciDeviceID']:02x}"
        bw = (cached or {}).get(key)
        if bw is None and measure_bytes:
            bw = gpu_bandwidths(cp, i, measure_bytes, reps, full)
            if cached is not None:
                cached[key] = bw
        bw = bw or {}
        out.append(GpuInfo(i, name, f"{props['major']}.{props['minor']}", int(free), int(total), gen, width, src,
                           **{k: float(v) for k, v in bw.items()}))
    return out


def full_probe(size: int = 256 << 20, reps: int = 5) -> Probe:
    """Everything ``probe-pcie`` shows (takes a few seconds per GPU)."""
    host = host_info(size, reps)
    gpus, why = gpu_infos(size, reps, full=True)
    return Probe(host, tuple(gpus), why)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"boot-{int(psutil.boot_time())}"


def startup_probe(cache_file: Path | None = None, with_gpus: bool = True) -> Probe:
    """The fast probe of a command's startup: system counters, plus pinned host->device bandwidth per
    GPU measured once per boot (then read from ``cache_file``); ``with_gpus`` False (``-ngl 0``)
    leaves the GPUs alone."""
    if not with_gpus:
        return Probe(host_info(), (), "-ngl 0")
    path = cache_file or CACHE_FILE
    cached: dict = {}
    try:
        data = json.loads(path.read_text())
        if data.get("boot_id") == _boot_id():
            cached = data.get("links", {})
    except (OSError, ValueError):
        pass
    before = dict(cached)
    gpus, why = gpu_infos(STARTUP_PROBE_BYTES, 3, full=False, cached=cached)
    if cached != before:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"boot_id": _boot_id(), "links": cached}))
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return Probe(host_info(), tuple(gpus), why)
