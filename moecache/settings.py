"""Settings have one road: a requested-settings record, resolved against the model and the machine.

:class:`Settings` holds what a caller asked for, every flag of ``run``/``perplexity``/``bench``/
``serve`` under its llama.cpp name (``common_params``), None where not given. The CLI fills it from
its flags, :func:`moecache.load` from keyword arguments. :func:`resolve` is a pure function of
(settings, :class:`ModelFacts`, :class:`moecache.probe.Probe`) that gives every value the engine
runs with and the reason for each (:class:`Resolved`). Whether a model fits in VRAM is the
placement's verdict (:func:`moecache.placement.fits_whole`, on the ``--vram-budget``-capped free
memory, with the KV cache of the context the run would use), never a comparison of its own: with
the default placement flags (``-ngl`` auto, no ``--cpu-moe``/``-ncmoe``, the expert cache on)
"experts in host RAM" is then what the placement does. A MoE model that does not fit at its trained
context but does at ``-c`` 32768 runs at 32768 with every expert on the GPUs (the ``-v`` reason
says so). The rules, for MoE models that do not fit
(everything else keeps llama.cpp's defaults):

- ``-ub`` 2048 / 1024 / 512 when the largest GPU has >= 6 GiB / >= 3 GiB / less free VRAM: a
  prompt ubatch copies each layer's used experts from host RAM once, so the copy's cost per token
  falls with the ubatch (H200, 8 GiB budget, the 12620-token prompt: 2459 t/s at -ub 2048, 1144 at
  512, sixteenth session); the budget holds the larger ubatch's transients because the expert
  cache's prompt groups do not grow with it and CuPy's pool gives its free blocks back before it
  would pass the budget (``CupyBackend.budget_guard``). Measured on one model shape (Qwen3-30B-A3B,
  n_embd 2048: 8101 MiB of 8192 at -ub 2048); the reserve stays 1 GiB at every -ub, and a wider
  model's activations at -ub 2048 are larger (not yet measured);
- ``-c`` 32768 (at most the trained context), halved (not below 4096) while its KV cache would take
  more than a quarter of the VRAM left after the dense weights and the reserve: the rest is the
  expert cache's;
- ``-t`` physical cores minus one per GPU (a core feeds each GPU); also with ``--cpu-moe`` /
  ``--n-cpu-moe``, ``--miss-split`` or a layer plan on a GPU;
- routed experts in host RAM, the VRAM left after dense weights and KV cache as the expert budget;
- prompt processing on the GPU with the fastest measured host link;
- ``--load-mode auto``: pin when the model fits in available RAM with headroom and either its
  routed experts go to host RAM (the expert cache reads decode misses zero-copy from page-locked
  memory: ~8x the decode speed of computing them on the CPU, bench/results/cache-arms-h200.md) or
  the command is ``serve`` on a machine with a GPU; otherwise map the file.
- ``--cache-plan auto``: "layer" (:mod:`moecache.moe.layer_plan`: slots per layer, and per layer a
  share of each token's misses computed by the CPU while the GPU reads the rest zero-copy) for
  ``run``, ``bench`` and ``serve`` when the routed experts stay in host RAM, page-locked, behind one GPU's
  expert cache, ``--cpu-moe``/``-ncmoe``/``--miss-split``/``--moe-cache 0`` not given and the Numba
  threads wait actively (the commands set that after resolving: moecache/threads.py); else
  "expert". H200, 8 GiB, tg128 against llama.cpp in one lease: 1.14 / 1.23 at uniform and
  low-locality routing against 0.96 / 0.92 per expert (runs h200-s29d/e); ``serve`` at 8 GiB, with the
  elastic slots, side by side with the per-expert policy without them: 1.13x one stream's t/s and
  1.48x eight streams' (run h200-s32a); two GPUs keep "expert" (not measured);
- ``-b`` is raised to the resolved ``-ub`` when ``-ub`` was not given (a reason says so);
- the expert cache's policy costs (:func:`policy_config`) from the expert size, the threads and the
  measured link (fixed values with ``--deterministic``).

This module imports nothing heavy at load (the CLI's ``--help`` stays instant).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from moecache.sizes import parse_moe_cache, parse_size

if TYPE_CHECKING:
    from moecache.moe.policy import PolicyConfig
    from moecache.placement import ModelSizes, PlacementOptions
    from moecache.probe import GpuInfo, Probe

GiB = 1 << 30
PIN_HEADROOM_BYTES = 4 * GiB  # RAM left free after pinning a whole model (or 10% of RAM if larger)
KV_TYPE_NAMES = ("f32", "f16")  # -ctk/-ctv values (moecache.engine.KV_TYPES maps them to numpy types)
LOAD_MODES = ("mmap", "pin")  # what the engine loads with; "auto" resolves to one of them
FLASH_ATTN = ("on", "off", "auto")
DEFAULT_N_BATCH = 2048  # llama.cpp's -b
DEFAULT_N_UBATCH = 512  # llama.cpp's -ub
DEFAULT_CACHE_TYPE = "f16"  # llama.cpp's -ctk/-ctv
# Numba expert kernel throughput per physical core (Q4_K, one token, bench/results/kernels-h200-cpu-dots.md:
# 35.6 GB/s on 16 cores): the per-expert policy's estimate of a miss's CPU time (its payback rule)
CPU_EXPERT_BYTES_PER_CORE_S = 2.2e9
# The layer plan's costs (moecache/moe/layer_plan.py), from the H200 machine's measurements of the 27th
# and 28th sessions (2.65 MB Q4_K experts, 15 threads; bench/results/miss-split-h200.md, static-h200-s28.md):
# - the CPU's time per expert in a layer's one call, per thread: the 8-bit prefetching kernels took
#   0.29-0.31 ms for a layer's 8 experts (kernels-h200-prefetch.md), ~37 us each, 5.0 GB/s per thread;
CPU_LAYER_BYTES_PER_THREAD_S = 5.0e9
# - the fixed cost of a layer whose misses the CPU computes, per token: the miss split's host compute
#   per miss was 77 us at 2 misses a layer, 63-65 at 3, 50 at 5.6-8, and one miss a layer (qwen3-moe,
#   share 1) ~118 us: ~85 us + ~35 us per expert fits them all;
CPU_LAYER_FIXED_S = 85e-6
# - the GPU's zero-copy reads of missed experts against the pinned host-to-device copy rate: 58-62 us per
#   expert (43-46 GB/s) against 53 GB/s copies (probe-pcie.md).
ZERO_COPY_FRACTION = 0.83
CACHE_PLANS = ("auto", "expert", "layer")  # --cache-plan
DETERMINISTIC_LINK_BYTES_S = 25e9  # --deterministic: a fixed link instead of the measured one
GPU_EXPERT_BYTES_S = 1e12  # the policy's estimate of a hit's GPU time (VRAM read rate)
DEFAULT_WINDOW = 64  # --moe-cache-window when not given


# the integer settings and their flags (check: a str or float there is a ValueError naming the flag)
INT_SETTINGS = {"n_ctx": "-c", "n_batch": "-b", "n_ubatch": "-ub", "n_threads": "-t", "n_gpu_layers": "-ngl",
                "n_cpu_moe": "--n-cpu-moe", "main_gpu": "-mg", "moe_cache_window": "--moe-cache-window",
                "moe_cache_stats": "--moe-cache-stats"}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The settings a caller asked for, under llama.cpp's names (None = not given: resolved).

    Attributes:
        n_ctx: ``-c`` tokens; 0 = the model's trained context.
        n_batch: ``-b`` logical batch (tokens per evaluation call); None = 2048.
        n_ubatch: ``-ub`` physical batch (tokens per forward pass).
        n_threads: ``-t`` CPU threads; 0 = physical cores.
        n_gpu_layers: ``-ngl``; -1 = all that fit, 0 = CPU only.
        cpu_moe, n_cpu_moe: ``--cpu-moe``, ``--n-cpu-moe``: routed experts kept in host RAM.
        split_mode: ``-sm`` "layer" or "none"; tensor_split: ``-ts`` ("3,1" or a tuple of proportions);
        main_gpu: ``-mg``.
        moe_cache: ``--moe-cache``: -1 fill, 0 off, an int (MiB per GPU) or a size text ("8GiB").
        vram_budget: ``--vram-budget``: an int (bytes per GPU) or a size text ("8GiB"; MiB unitless).
        cache_type, cache_type_k, cache_type_v: ``-ctk``/``-ctv``: "f16" (default) or "f32"; one of them
            sets both (different K and V types are an error).
        load_mode: ``--load-mode`` "mmap", "pin" or "auto".
        flash_attn: ``-fa`` "on", "off" or "auto" (accepted; one attention implementation per backend).
        moe_cache_window: ``--moe-cache-window`` tokens of usage history (None = 64).
        moe_cache_stats: ``--moe-cache-stats`` N (the caller prints; kept here as the flag's home).
        routing: ``--routing`` process name or trace file (benchmarks: replaces the router's choice).
        deterministic: ``--deterministic`` cache decisions from fixed costs.
        moe_profile: ``--moe-profile FILE``: the saved expert usage that ``run`` and ``serve`` preload
            into the expert cache at start and add to at exit (None: the model's file under
            ``~/.cache/moecache/profiles/``).
        no_moe_profile: ``--no-moe-profile``: neither load nor save one.
        miss_split: ``--miss-split``: the expert cache's decode graphs hand a share of each layer's
            misses to the CPU (``Engine(miss_split=True)``; opt-in: measured slower on the H200, bench/results/miss-split-h200.md).
        cache_plan: ``--cache-plan``: "expert" (the per-expert policy), "layer" (the slots follow
            a layer plan, which also sets each layer's share of its misses for the CPU, the link
            reading the rest: :mod:`moecache.moe.layer_plan`) or "auto" (:func:`resolve` picks one:
            the module docstring's rule).
        elastic_slots: ``--elastic-slots`` / ``--no-elastic-slots`` (None: not given, on): the
            expert cache takes the part of the reserve that only prompts use as elastic slots
            (:class:`moecache.placement.PlacementOptions`; H200, 8 GiB, in one lease with the layer
            plan: tg128 +9-17%, every peak within the budget, runs h200-s30a-c,
            bench/results/vs-llamacpp-h200.md); ``serve`` too (its requests' prompts lend them).
    """

    n_ctx: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_threads: int | None = None
    n_gpu_layers: int | None = None
    cpu_moe: bool | None = None
    n_cpu_moe: int | None = None
    split_mode: str | None = None
    tensor_split: str | tuple[float, ...] | None = None
    main_gpu: int | None = None
    moe_cache: int | str | None = None
    vram_budget: int | str | None = None
    cache_type: str | None = None
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    load_mode: str | None = None
    flash_attn: str | None = None
    moe_cache_window: int | None = None
    moe_cache_stats: int | None = None
    routing: str | None = None
    deterministic: bool | None = None
    moe_profile: str | None = None
    no_moe_profile: bool = False
    miss_split: bool = False
    elastic_slots: bool | None = None
    cache_plan: str = "auto"

    def check(self) -> None:
        """Every check that needs neither the model nor the machine.

        Raises:
            ValueError: naming the flag of the first bad group of values (the messages the CLI prints).
        """
        if self.flash_attn not in (None, *FLASH_ATTN):
            raise ValueError(f"-fa must be on, off or auto, got {self.flash_attn!r}")
        for name, flag in INT_SETTINGS.items():
            v = getattr(self, name)
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool)):
                raise ValueError(f"{flag} ({name}) must be an integer, got {v!r}")
        self.placement_options()
        self.kv_type()
        bad = []
        if self.n_ctx is not None and self.n_ctx < 0:
            bad.append(f"-c must be >= 0 (0 = the model's context), got {self.n_ctx}")
        if self.n_batch is not None and self.n_batch < 1:
            bad.append(f"-b must be >= 1, got {self.n_batch}")
        if self.n_ubatch is not None and self.n_ubatch < 1:
            bad.append(f"-ub must be >= 1, got {self.n_ubatch}")
        if self.n_threads is not None and self.n_threads < 0:
            bad.append(f"-t must be >= 0 (0 = physical cores), got {self.n_threads}")
        if self.moe_profile is not None and self.no_moe_profile:
            bad.append("--moe-profile and --no-moe-profile exclude each other")
        if bad:
            raise ValueError("; ".join(bad))
        if self.moe_cache_window is not None and self.moe_cache_window < 1:
            raise ValueError(f"--moe-cache-window must be >= 1, got {self.moe_cache_window}")
        if self.cache_plan not in CACHE_PLANS:
            raise ValueError(f"--cache-plan must be {', '.join(CACHE_PLANS[:-1])} or {CACHE_PLANS[-1]}, "
                             f"got {self.cache_plan!r}")
        if self.cache_plan == "layer" and self.miss_split:
            raise ValueError("--cache-plan layer sets each layer's miss path itself: --miss-split goes without it")
        if self.load_mode is not None and self.load_mode.lower() not in ("auto", *LOAD_MODES):
            raise ValueError(f"--load-mode must be mmap, pin or auto, got {self.load_mode!r}")

    def kv_type(self) -> str:
        """The KV cache type (see :func:`kv_cache_type`); ``cache_type`` counts as ``-ctk``."""
        if self.cache_type is not None and self.cache_type_k is None:
            return kv_cache_type(self.cache_type, self.cache_type_v)
        if self.cache_type is not None:
            kv_cache_type(self.cache_type, self.cache_type_k)  # the two names of K must agree
        return kv_cache_type(self.cache_type_k, self.cache_type_v)

    def placement_options(self) -> PlacementOptions:
        """The placement flags as a :class:`moecache.placement.PlacementOptions` (prompt GPU not
        resolved). Raises ValueError naming ``-ts``, ``-sm``, ``--moe-cache`` or ``--vram-budget``."""
        from moecache.placement import PlacementOptions

        ts: tuple[float, ...] = ()
        if isinstance(self.tensor_split, str) and self.tensor_split:
            try:
                ts = tuple(float(v) for v in self.tensor_split.replace("/", ",").split(","))
            except ValueError:
                ts = (float("nan"),)
        elif self.tensor_split:
            ts = tuple(float(v) for v in self.tensor_split)
        if ts and (not all(math.isfinite(v) and v >= 0 for v in ts) or sum(ts) <= 0):
            raise ValueError(f"-ts {self.tensor_split!r}: expected comma-separated proportions >= 0 with a positive "
                             f"sum, e.g. 3,1")
        split = "layer" if self.split_mode is None else self.split_mode
        if split not in ("layer", "none"):
            raise ValueError(f"-sm {split!r}: expected layer or none")
        mc = self.moe_cache
        vb = self.vram_budget
        return PlacementOptions(n_gpu_layers=-1 if self.n_gpu_layers is None else self.n_gpu_layers,
                                cpu_moe=bool(self.cpu_moe), n_cpu_moe=self.n_cpu_moe or 0, split_mode=split,
                                tensor_split=ts, main_gpu=self.main_gpu or 0,
                                moe_cache=mc if isinstance(mc, int) or mc is None else parse_moe_cache(mc),
                                vram_budget=vb if isinstance(vb, int) else parse_size(vb, "--vram-budget"),
                                elastic_slots=self.elastic_slots is not False)


def kv_cache_type(ctk: str | None, ctv: str | None, default: str = DEFAULT_CACHE_TYPE) -> str:
    """``-ctk``/``-ctv`` -> the KV cache type: one of them alone sets both (K and V take the same
    type). Raises ValueError when they differ or are unknown."""
    given = [(f, v.lower()) for f, v in (("-ctk", ctk), ("-ctv", ctv)) if v is not None]
    for flag, v in given:
        if v not in KV_TYPE_NAMES:
            raise ValueError(f"{flag} {v}: supported KV cache types are {', '.join(KV_TYPE_NAMES)}")
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise ValueError(f"-ctk {given[0][1]} -ctv {given[1][1]}: K and V caches of different types are not "
                         f"supported; give both the same type (or one of them: it sets both)")
    return given[0][1] if given else default


@dataclass(frozen=True)
class ModelFacts:
    """What the resolution needs to know about a model (bytes; :func:`model_facts` reads them).

    Attributes:
        n_bytes: every tensor; expert_bytes: the routed experts (0: a dense model).
        context_length: the trained context (tokens).
        kv_bytes_per_token: the KV cache of one position, all layers (K and V at the resolved type).
        expert_each: bytes of one expert's three matrices (a cache slot; 0: a dense model).
        n_expert: routed experts per layer (0: a dense model).
        sizes: the placement's per-layer sizes (:func:`moecache.placement.model_sizes`) with the KV
            cache of one position; the resolution asks the placement whether the model fits with
            them. Required for a MoE model on a GPU.
    """

    n_bytes: int
    expert_bytes: int
    context_length: int
    kv_bytes_per_token: int = 0
    expert_each: int = 0
    n_expert: int = 0
    sizes: ModelSizes | None = None

    @property
    def is_moe(self) -> bool:
        return self.expert_bytes > 0


def model_facts(gguf, cache_type: str) -> ModelFacts:
    """The :class:`ModelFacts` of an opened :class:`moecache.gguf_file.GGUFModel` with a KV cache of
    ``cache_type`` ("f16" or "f32")."""
    import numpy as np

    from moecache.engine import KV_TYPES
    from moecache.placement import model_sizes

    experts = sum(t.n_bytes for n, t in gguf.tensors.items() if n.endswith("_exps.weight"))
    sizes1 = model_sizes(gguf, 1, np.dtype(KV_TYPES[cache_type]).itemsize)
    return ModelFacts(gguf.n_bytes, experts, gguf.config.context_length, sizes1.kv * sizes1.n_layer,
                      sizes1.expert_each, gguf.config.n_expert or 0, sizes1)


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """The settings a command runs with; ``reasons[name]`` says where each value came from.

    Attributes:
        n_ctx: ``-c`` tokens (0 = the model's trained context); n_batch, n_ubatch: ``-b``, ``-ub``;
        n_threads: ``-t``; cache_type: the KV cache type; load_mode: "mmap" or "pin".
        experts_in_ram: routed experts stay in host RAM (a MoE model that does not fit in the free
            VRAM of its GPUs by the placement's verdict: the automatic rules applied).
        prompt_gpu: the GPU prompt ubatches of host experts go to (fastest link), None without GPU.
        placement: the placement flags with the prompt GPU.
        policy: the expert cache's policy costs (None for a dense model).
        routing: ``--routing`` (None: the router decides).
        cache_plan: ``--cache-plan`` resolved: "expert" or "layer".
    """

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int
    cache_type: str
    load_mode: str
    experts_in_ram: bool
    prompt_gpu: int | None
    placement: PlacementOptions
    policy: PolicyConfig | None = None
    routing: str | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    cache_plan: str = "expert"

    def summary_lines(self, probe: Probe, verbose: bool = False) -> list[str]:
        """The ``resolved:`` lines the commands print on stderr: one short table, or (``verbose``)
        every value with its reason and each GPU the probe saw."""
        rows = [("-ub", str(self.n_ubatch), "n_ubatch"), ("-c", str(self.n_ctx or "trained"), "n_ctx"),
                ("-t", str(self.n_threads), "n_threads"), ("--load-mode", self.load_mode, "load_mode")]
        if self.experts_in_ram:
            rows.append(("--cache-plan", self.cache_plan, "cache_plan"))
        if not verbose:
            return ["resolved: " + " | ".join(f"{n} {v}" for n, v, _ in rows)
                    + (" | experts in host RAM" if self.experts_in_ram else "")]
        if "experts" in self.reasons:
            rows.append(("experts", "host RAM" if self.experts_in_ram else "GPU", "experts"))
        if self.experts_in_ram and "elastic_slots" in self.reasons:
            rows.append(("elastic slots", "on" if self.placement.elastic_slots else "off", "elastic_slots"))
        if self.prompt_gpu is not None:
            rows.append(("prompt GPU", str(self.prompt_gpu), "prompt_gpu"))
        for gi in probe.gpus:
            link = f"PCIe {gi.pcie_gen}.0 x{gi.pcie_width}" if gi.pcie_gen else "PCIe link unknown"
            rows.append((f"GPU {gi.index}", f"{gi.name}, {gi.vram_free / 2**30:.1f}/{gi.vram_total / 2**30:.1f} GiB free",
                         f"{link}, pinned H2D {gi.h2d_pinned / 1e9:.1f} GB/s"))
        return [f"resolved: {name:12s} {value:>10s}  ({self.reasons.get(why, why)})" for name, value, why in rows]

    def engine_config(self):
        """The :class:`moecache.engine.EngineConfig` of these values."""
        from moecache.engine import EngineConfig

        return EngineConfig(self.n_ctx, self.n_batch, self.n_ubatch, self.n_threads, self.cache_type)


def pin_fits(model_bytes: int, ram_available: int, ram_total: int) -> bool:
    """Whether pinning the whole model leaves the headroom (PIN_HEADROOM_BYTES or 10% of RAM)."""
    return model_bytes + max(PIN_HEADROOM_BYTES, ram_total // 10) <= ram_available


def policy_config(expert_bytes: int, probe: Probe, *, window: int | None, deterministic: bool, n_threads: int,
                  prompt_gpu: int | None, layer_plan: bool = False) -> PolicyConfig:
    """The cache policy's costs (seconds per expert) from the expert size (bytes), the threads and
    the measured pinned link of the prompt GPU (fixed values when ``deterministic``); ``layer_plan``:
    ``--cache-plan layer``."""
    from moecache.moe.policy import PolicyConfig

    link = 0.0
    if not deterministic and probe.gpus:
        link = probe.gpus[prompt_gpu or 0].h2d_pinned
    link = link or DETERMINISTIC_LINK_BYTES_S
    cores = n_threads if deterministic else max(1, n_threads)
    return PolicyConfig(window=window or DEFAULT_WINDOW, t_cpu=expert_bytes / (CPU_EXPERT_BYTES_PER_CORE_S * cores),
                        t_gpu=expert_bytes / GPU_EXPERT_BYTES_S, t_upload=expert_bytes / link, adaptive=not deterministic,
                        layer_plan=layer_plan, t_link=expert_bytes / (ZERO_COPY_FRACTION * link),
                        t_cpu_layer=expert_bytes / (CPU_LAYER_BYTES_PER_THREAD_S * cores), t_fixed=CPU_LAYER_FIXED_S)


def _cache_plan(settings: Settings, placement: PlacementOptions, big: bool, n_gpus: int, mode: str,
                command: str, omp_active: bool) -> tuple[str, str]:
    """(``--cache-plan`` resolved, its reason): "auto" is "layer" for ``run``, ``bench`` and ``serve`` when the
    routed experts stay in host RAM behind one GPU's expert cache that reads its misses zero-copy
    (``--load-mode pin``), the expert placement and ``--miss-split`` left alone, and the Numba
    threads wait actively (``omp_active``: the plan's fixed cost per CPU layer was measured so;
    sleeping threads take ~0.3 ms to wake, moecache/threads.py); else "expert"."""
    if settings.cache_plan != "auto":
        return settings.cache_plan, "--cache-plan given"
    why = ("the routed experts are in VRAM: no expert cache" if not big else
           "--moe-cache 0: no expert cache" if placement.moe_cache == 0 else
           "--cpu-moe / --n-cpu-moe place the experts" if placement.cpu_moe or placement.n_cpu_moe else
           "--miss-split asked for" if settings.miss_split else
           "mapped weights: the cache computes misses on the CPU, there is no link path to share" if mode != "pin" else
           "measured on one GPU only" if n_gpus != 1 else
           f"{command}: measured for run, bench and serve only" if command not in ("run", "bench", "serve") else
           "the Numba threads do not wait actively between layers (the commands make them when -t leaves a CPU "
           "free for the thread that drives the GPU and, in bench, no combination runs on the CPU alone; a "
           "library caller sets OMP_WAIT_POLICY=ACTIVE and GOMP_SPINCOUNT=30000000 before the first parallel "
           "kernel)" if not omp_active else None)
    if why:
        return "expert", why
    measured = (", costed per decode pass (H200, 8 GiB, with the elastic slots, side by side with the per-expert "
                "policy without them: 1 stream 145.5 t/s against 129.0, 8 streams 278.1 against 187.7, run h200-s32a, "
                "bench/results/serve-h200.md)" if command == "serve" else
                " (H200, 8 GiB, with the elastic slots: tg128 1.25-1.26x llama.cpp at flat routing, run h200-s30b; "
                "0.92-0.96 per expert in h200-s29e, bench/results/vs-llamacpp-h200.md)")
    return "layer", ("experts in host RAM, page-locked, behind one GPU's cache: slots and each layer's CPU share "
                     "of the misses by the layer plan" + measured)


def _big_moe_ctx(model: ModelFacts, free_total: int, n_gpus: int) -> tuple[int, str]:
    """(-c, its reason) for a MoE model whose experts go to host RAM: 32768, at most the trained
    context, halved (not below 4096) while its KV cache would take more than a quarter of the VRAM
    left after the dense weights and the reserve (``free_total``: the GPUs' free bytes, the
    ``--vram-budget`` applied); the expert cache gets the rest."""
    from moecache.placement import RESERVE_BYTES

    ctx = min(32768, model.context_length) if model.context_length else 32768
    why = "32768 for MoE models that do not fit in VRAM" + (
        f" (capped at the trained {model.context_length})" if ctx < 32768 else "")
    left = free_total - (model.n_bytes - model.expert_bytes) - RESERVE_BYTES * n_gpus
    first = ctx
    while ctx > 4096 and ctx * model.kv_bytes_per_token > left / 4:
        ctx //= 2
    if ctx < first:
        why += (f", halved to {ctx}: a KV cache of {first * model.kv_bytes_per_token / GiB:.1f} GiB "
                f"would take more than a quarter of the {max(0, left) / GiB:.1f} GiB of VRAM left "
                f"after the dense weights (the expert cache gets the rest)")
    return ctx, why


def _used(g: GpuInfo) -> int:
    """Bytes already in use on a probed GPU (total - free), which count against ``--vram-budget``."""
    return max(0, g.vram_total - g.vram_free)


def _experts_in_ram(settings: Settings, model: ModelFacts, placement: PlacementOptions,
                    gpu_free: list[int], gpu_used: list[int], lower: int) -> tuple[bool, int]:
    """(routed experts go to host RAM, a -c lowered so that the whole model fits or 0), from the
    placement's verdict (:func:`moecache.placement.fits_whole`) at the context the run would use:
    ``-c`` when given, else the trained context, else (a MoE model that does not fit there) the
    largest of 32768 (at most the trained context) and its halvings down to ``lower`` (the context
    :func:`_big_moe_ctx` gives a big model) at which the whole model fits: -c is lowered to it, and
    the model is not big. Only a MoE model on a GPU can be "big"."""
    if not gpu_free or not model.is_moe:
        return False, 0
    if model.sizes is None:
        raise ValueError("ModelFacts.sizes is needed to place a MoE model on a GPU (model_facts reads it)")
    from moecache.placement import fits_whole

    def fits(n_ctx: int) -> bool:
        return fits_whole(placement, model.sizes.with_context(n_ctx), gpu_free, gpu_used)

    if settings.n_ctx is not None:  # -c given (0 = the trained context)
        return not fits(settings.n_ctx or model.context_length), 0
    if fits(model.context_length):
        return False, 0
    if model.context_length:
        ctx = min(32768, model.context_length)
        while ctx >= lower:
            if ctx < model.context_length and fits(ctx):
                return False, ctx
            if ctx == lower:
                break
            ctx = max(lower, ctx // 2)
    return True, 0


def resolve(settings: Settings, model: ModelFacts, probe: Probe, *, command: str = "run",
            environ: Mapping[str, str] | None = None, omp_active: bool | None = None) -> Resolved:
    """The values a command runs with, each with its reason (the module docstring gives the rules).

    Args:
        settings: what was asked for.
        model: the model's sizes (read with the KV cache type ``settings`` resolves to).
        probe: the machine (:func:`moecache.probe.startup_probe`; no GPUs with ``-ngl 0``).
        command: "run", "perplexity", "bench" or "serve" (``serve`` pins weights when they fit RAM).
        environ: the environment (``MOECACHE_DETERMINISTIC=1`` acts as ``--deterministic``); None = empty.
        omp_active: whether the Numba threads will wait actively when a layer plan gives the CPU
            experts (the commands settle the wait policy after resolving: True); None = whether
            ``environ`` has ``OMP_WAIT_POLICY=ACTIVE``. ``--cache-plan auto`` is "expert" without it.

    Raises:
        ValueError: a flag's value is impossible (the message names the flag).
    """
    settings.check()
    reasons: dict[str, str] = {}
    placement = settings.placement_options()
    if settings.elastic_slots is not None:
        reasons["elastic_slots"] = "--elastic-slots given" if settings.elastic_slots else "--no-elastic-slots given"
    else:
        reasons["elastic_slots"] = "the default: the reserve that only prompts use holds experts while decoding" + (
            " (serve: each request's prompt pass lends them and the second pass after it that is not a prompt pass "
            "takes them back; with the layer plan they made +17% one stream's t/s and +15% 8 streams', H200, "
            "8 GiB, run h200-s32b, with prompts too short to lend them: the lending's cost per request and the "
            "per-expert policy with them are not measured in serve)" if command == "serve" else "")
    gpus = () if placement.n_gpu_layers == 0 else probe.gpus
    if placement.vram_budget:
        from moecache.placement import budgeted_free

        free = budgeted_free([g.vram_free for g in gpus], placement.vram_budget, [_used(g) for g in gpus])
        gpus = tuple(replace(g, vram_free=f) for g, f in zip(gpus, free))
    free_total = sum(g.vram_free for g in gpus)
    # the raw free memory: the plan caps it by --vram-budget itself and splits layers by it, as the
    # engine's plan does
    raw = () if placement.n_gpu_layers == 0 else probe.gpus
    big_ctx, big_ctx_why = _big_moe_ctx(model, free_total, len(gpus))
    big, lowered_ctx = _experts_in_ram(settings, model, placement, [g.vram_free for g in raw], [_used(g) for g in raw],
                                       big_ctx)
    host = probe.host
    # -ub
    if settings.n_ubatch is not None:
        ub, reasons["n_ubatch"] = settings.n_ubatch, "-ub given"
    elif big:
        largest = max(g.vram_free for g in gpus)
        ub = 2048 if largest >= 6 * GiB else 1024 if largest >= 3 * GiB else 512
        reasons["n_ubatch"] = (f"largest GPU has {largest / GiB:.0f} GiB free; routed experts in host RAM: "
                               f"each ubatch copies a layer's used experts once, a larger ubatch shares the copy")
    else:
        ub, reasons["n_ubatch"] = DEFAULT_N_UBATCH, "llama.cpp default"
    # -b: at least the resolved -ub when -ub was not given (a -b below a given -ub clamps -ub instead)
    n_batch = DEFAULT_N_BATCH if settings.n_batch is None else settings.n_batch
    reasons["n_batch"] = "llama.cpp default" if settings.n_batch is None else "-b given"
    if settings.n_ubatch is None and ub > n_batch:
        reasons["n_batch"] = f"raised from {n_batch} to the resolved -ub {ub}"
        n_batch = ub
    # -c
    if settings.n_ctx is not None:
        ctx, reasons["n_ctx"] = settings.n_ctx, "-c given"
    elif lowered_ctx:
        ctx = lowered_ctx
        reasons["n_ctx"] = (f"lowered from the trained {model.context_length} so that the whole model and its KV "
                            f"cache fit in VRAM (the placement's verdict)")
    elif big:
        ctx, reasons["n_ctx"] = big_ctx, big_ctx_why
    else:
        ctx, reasons["n_ctx"] = 0, "the model's trained context"
    if settings.n_ubatch is not None and ub > (ctx or model.context_length or ub):
        ub, reasons["n_ubatch"] = ctx or model.context_length, f"-ub {ub} given, more than the context: lowered to it"
    # --load-mode
    mode = (settings.load_mode or "auto").lower()
    if mode != "auto":
        reasons["load_mode"] = "--load-mode given"
    else:
        fits = pin_fits(model.n_bytes, host.ram_available, host.ram_total)
        wants = ("routed experts in host RAM (the expert cache reads misses zero-copy from page-locked RAM)"
                 if big else "serve" if command == "serve" and gpus else None)
        if wants and fits:
            mode, reasons["load_mode"] = "pin", f"{wants}, and the model fits in available RAM with headroom"
        elif wants:
            mode, reasons["load_mode"] = "mmap", (f"{wants}, but the model does not fit in available RAM with "
                                                  f"headroom" + ("; the cache computes misses on the CPU" if big else ""))
        elif command == "serve":
            mode, reasons["load_mode"] = "mmap", "serve without a GPU maps the file (page-locked RAM is for GPU copies)"
        else:
            mode, reasons["load_mode"] = "mmap", f"{command} maps the file"
    # --cache-plan
    if omp_active is None:
        from moecache.threads import waits_actively

        omp_active = waits_actively(environ or {})
    plan, reasons["cache_plan"] = _cache_plan(settings, placement, big, len(gpus), mode, command, omp_active)
    # -t
    if settings.n_threads not in (None, 0):  # 0 = "physical cores"
        threads, reasons["n_threads"] = settings.n_threads, "-t given"
    elif big or (gpus and model.is_moe and (placement.cpu_moe or placement.n_cpu_moe or settings.miss_split
                                            or plan == "layer")):
        # a core feeds each GPU: with experts on the CPU (or --miss-split, which the command gives
        # the same active waiting) the Numba threads wait actively between layers
        # (moecache/threads.py), and need a core left for the thread that drives the GPU
        threads = max(1, host.physical_cores - len(gpus))
        reasons["n_threads"] = f"{host.physical_cores} physical cores - 1 per GPU"
    else:
        threads, reasons["n_threads"] = host.physical_cores, "physical cores"
    # experts and prompt GPU
    if big:
        reasons["experts"] = (f"the placement: model {model.n_bytes / GiB:.1f} GiB and its KV cache do not fit in "
                              f"{free_total / GiB:.1f} GiB free VRAM (less the reserve and the prompt scratch): "
                              f"routed experts in host RAM, VRAM left over for experts")
    elif model.is_moe and gpus:
        reasons["experts"] = "the placement: the model fits in VRAM"
    prompt_gpu = None
    if gpus:
        best = max(gpus, key=lambda g: (g.h2d_pinned, -g.index))
        prompt_gpu = best.index
        reasons["prompt_gpu"] = (f"fastest host link ({best.h2d_pinned / 1e9:.1f} GB/s pinned)"
                                 if best.h2d_pinned else "first GPU (links not measured)")
        placement = replace(placement, prompt_gpu=prompt_gpu)
    # the expert cache's policy
    policy = None
    if model.expert_each:
        det = bool(settings.deterministic) or (environ or {}).get("MOECACHE_DETERMINISTIC") == "1"
        policy = policy_config(model.expert_each, probe, window=settings.moe_cache_window, deterministic=det,
                               n_threads=threads, prompt_gpu=prompt_gpu, layer_plan=plan == "layer")
        reasons["policy"] = ("fixed costs (--deterministic)" if det else
                             "costs from the expert size, the threads and the measured link")
    return Resolved(n_ctx=ctx, n_batch=n_batch, n_ubatch=ub, n_threads=threads, cache_type=settings.kv_type(),
                    load_mode=mode, experts_in_ram=big, prompt_gpu=prompt_gpu, placement=placement, policy=policy,
                    routing=settings.routing, reasons=reasons, cache_plan=plan)
