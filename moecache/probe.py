"""What the machine offers (GPUs, links, RAM, cores), measured, and the defaults resolved from it.

Two probes:

- :func:`full_probe` (``moecache probe-pcie``): every GPU's name, compute capability, PCIe link
  (NVML through ``nvidia-ml-py`` where installed, else Linux sysfs), free/total VRAM and copy
  bandwidths (host->device from pinned and from pageable memory, device->host, device-to-device),
  and the host's CPU, cores, RAM and RAM read bandwidth (one thread and all threads). Medians of
  ``reps`` timed copies of a ``size``-byte buffer.
- :func:`startup_probe` (every command that loads a model): cores, RAM and free VRAM read from the
  system, plus each GPU's pinned host->device bandwidth measured once per boot on a small buffer and
  remembered in ``~/.cache/moecache/probe.json`` (keyed by the kernel's boot id): well under a second.

:func:`resolve_defaults` is a pure function of (model facts, probe, user flags): the defaults a
user did not set, each with its reason. The rules (for MoE models larger than the free VRAM of all
GPUs; everything else keeps llama.cpp's defaults):

- ``-ub`` 2048 / 1024 / 512 when the largest GPU has >= 20 GiB / >= 10 GiB / less free VRAM;
- ``-c`` 32768 (at most the trained context), halved (not below 4096) while its KV cache would take
  more than a quarter of the VRAM left after the dense weights and the reserve: the rest is the
  expert cache's;
- ``-t`` physical cores minus one per GPU (a core feeds each GPU);
- routed experts in host RAM, the VRAM left after dense weights and KV cache as the expert budget;
- prompt processing on the GPU with the fastest measured host link;
- ``--load-mode auto``: pin when the model fits in available RAM with headroom and either its
  routed experts go to host RAM (the expert cache reads decode misses zero-copy from page-locked
  memory: ~8x the decode speed of computing them on the CPU, bench/results/cache-arms-h200.md) or
  the command is ``serve``; otherwise map the file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil

GiB = 1 << 30
CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moecache" / "probe.json"
STARTUP_PROBE_BYTES = 64 << 20
PIN_HEADROOM_BYTES = 4 * GiB  # RAM left free after pinning a whole model (or 10% of RAM if larger)


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


def host_info(measure_bytes: int = 0, reps: int = 3) -> HostInfo:
    """Cores and RAM; with ``measure_bytes`` > 0 also the RAM read bandwidth (1 and all threads)."""
    vm = psutil.virtual_memory()
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
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


# ---- resolution -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the resolution needs to know about a model (bytes)."""

    n_bytes: int
    expert_bytes: int
    context_length: int
    kv_bytes_per_token: int = 0  # the KV cache of one position, all layers (K and V at -ctk/-ctv)

    @property
    def is_moe(self) -> bool:
        return self.expert_bytes > 0


@dataclass(frozen=True)
class UserFlags:
    """The flags the user passed (None = not passed)."""

    command: str = "run"
    n_ubatch: int | None = None
    n_ctx: int | None = None
    n_threads: int | None = None
    load_mode: str | None = None  # None and "auto" both mean: resolve
    n_gpu_layers: int = -1  # -ngl 0: the GPUs are not used (resolved as if there were none)
    vram_budget: int = 0  # --vram-budget: each GPU's free memory counts as at most this
    cache_type: str = "f16"  # -ctk/-ctv: the KV cache's element type (f16 as llama.cpp, or f32)


@dataclass(frozen=True)
class Resolved:
    """Resolved settings; ``reasons[name]`` says where each value came from.

    Attributes:
        n_ubatch, n_ctx, n_threads: ``-ub``, ``-c`` (0 = the trained context), ``-t``.
        load_mode: "mmap" or "pin".
        experts_in_ram: routed experts stay in host RAM (the model does not fit in VRAM).
        prompt_gpu: the GPU prompt ubatches of host experts go to (fastest link), None without GPU.
        big_moe: the automatic rules applied (a MoE model larger than the free VRAM of all GPUs).
    """

    n_ubatch: int
    n_ctx: int
    n_threads: int
    load_mode: str
    experts_in_ram: bool
    prompt_gpu: int | None
    big_moe: bool
    reasons: dict[str, str] = field(default_factory=dict)


def pin_fits(model_bytes: int, ram_available: int, ram_total: int) -> bool:
    """Whether pinning the whole model leaves the headroom (PIN_HEADROOM_BYTES or 10% of RAM)."""
    return model_bytes + max(PIN_HEADROOM_BYTES, ram_total // 10) <= ram_available


def resolve_defaults(model: ModelFacts, probe: Probe, flags: UserFlags) -> Resolved:
    """The settings a command runs with (see the module docstring for the rules).

    Raises:
        ValueError: ``--load-mode`` not one of mmap, pin, auto.
    """
    reasons: dict[str, str] = {}
    gpus = () if flags.n_gpu_layers == 0 else probe.gpus
    if flags.vram_budget:
        from dataclasses import replace

        gpus = tuple(replace(g, vram_free=min(g.vram_free, flags.vram_budget)) for g in gpus)
    free_total = sum(g.vram_free for g in gpus)
    big = bool(gpus) and model.is_moe and model.n_bytes > free_total
    host = probe.host
    # -ub
    if flags.n_ubatch is not None:
        ub, reasons["n_ubatch"] = flags.n_ubatch, "-ub given"
    elif big:
        largest = max(g.vram_free for g in gpus)
        ub = 2048 if largest >= 20 * GiB else 1024 if largest >= 10 * GiB else 512
        reasons["n_ubatch"] = f"largest GPU has {largest / GiB:.0f} GiB free"
    else:
        ub, reasons["n_ubatch"] = 512, "llama.cpp default"
    # -c
    if flags.n_ctx is not None:
        ctx, reasons["n_ctx"] = flags.n_ctx, "-c given"
    elif big:
        ctx = min(32768, model.context_length) if model.context_length else 32768
        reasons["n_ctx"] = "32768 for MoE models larger than VRAM" + (
            f" (capped at the trained {model.context_length})" if ctx < 32768 else "")
        from moecache.placement import RESERVE_BYTES

        left = free_total - (model.n_bytes - model.expert_bytes) - RESERVE_BYTES * len(gpus)
        first = ctx
        while ctx > 4096 and ctx * model.kv_bytes_per_token > left / 4:
            ctx //= 2
        if ctx < first:
            reasons["n_ctx"] += (f", halved to {ctx}: a KV cache of {first * model.kv_bytes_per_token / GiB:.1f} GiB "
                                 f"would take more than a quarter of the {max(0, left) / GiB:.1f} GiB of VRAM left "
                                 f"after the dense weights (the expert cache gets the rest)")
    else:
        ctx, reasons["n_ctx"] = 0, "the model's trained context"
    # -t
    if flags.n_threads not in (None, 0):  # 0 = "physical cores", as before; negatives fail in EngineConfig
        threads, reasons["n_threads"] = flags.n_threads, "-t given"
    elif big:
        threads = max(1, host.physical_cores - len(gpus))
        reasons["n_threads"] = f"{host.physical_cores} physical cores - 1 per GPU"
    else:
        threads, reasons["n_threads"] = host.physical_cores, "physical cores"
    # --load-mode
    mode = (flags.load_mode or "auto").lower()
    if mode not in ("auto", "mmap", "pin"):
        raise ValueError(f"--load-mode must be mmap, pin or auto, got {flags.load_mode!r}")
    if mode != "auto":
        reasons["load_mode"] = "--load-mode given"
    else:
        fits = pin_fits(model.n_bytes, host.ram_available, host.ram_total)
        wants = ("routed experts in host RAM (the expert cache reads misses zero-copy from page-locked RAM)"
                 if big else "serve" if flags.command == "serve" else None)
        if wants and fits:
            mode, reasons["load_mode"] = "pin", f"{wants}, and the model fits in available RAM with headroom"
        elif wants:
            mode, reasons["load_mode"] = "mmap", (f"{wants}, but the model does not fit in available RAM with "
                                                  f"headroom" + ("; the cache computes misses on the CPU" if big else ""))
        else:
            mode, reasons["load_mode"] = "mmap", f"{flags.command} maps the file"
    # experts and prompt GPU
    if big:
        reasons["experts"] = (f"model {model.n_bytes / GiB:.1f} GiB > {free_total / GiB:.1f} GiB free VRAM: "
                              f"routed experts in host RAM, VRAM left over for experts")
    elif model.is_moe and gpus:
        reasons["experts"] = "the model fits in VRAM"
    prompt_gpu = None
    if gpus:
        best = max(gpus, key=lambda g: (g.h2d_pinned, -g.index))
        prompt_gpu = best.index
        reasons["prompt_gpu"] = (f"fastest host link ({best.h2d_pinned / 1e9:.1f} GB/s pinned)"
                                 if best.h2d_pinned else "first GPU (links not measured)")
    return Resolved(ub, ctx, threads, mode, big, prompt_gpu, big, reasons)
