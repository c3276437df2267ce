"""Layer placement: which device holds each layer's dense weights, KV cache and routed experts.

The semantics are llama.cpp's (``common/arg.cpp``, ``src/llama-model.cpp``):

- ``-ngl N``: the *last* N layers run on the GPU(s); with N > n_layer the output layer too. The
  default (``-1`` here) places every layer that fits.
- ``--cpu-moe``: every layer's routed experts stay in host RAM; ``--n-cpu-moe N``: those of the
  first N layers do. Host experts are computed on the CPU, except prompt ubatches of
  ``offload_min_batch``+ tokens, which copy the experts they use to the GPU (op offload).
- Without either flag the experts of every GPU layer go to the GPU when they all fit. When they do
  not, every routed expert stays in host RAM and the VRAM left over becomes the expert cache
  (``--moe-cache``, :mod:`moecache.moe.cache`); with ``--moe-cache 0`` the experts of the first
  layers stay in host RAM instead (the smallest ``--n-cpu-moe`` that fits). Notes say which.
  ``--vram-budget`` caps the memory used per GPU.
- ``-sm layer`` (default) splits the GPU layers over the GPUs in contiguous ranges, in proportion to
  ``-ts`` (default: each GPU's free memory); ``-sm none`` uses ``-mg`` only. Without ``-ts`` a model
  that fits on one GPU stays on the one with the most free memory, and a GPU too small to hold
  anything is left out (notes say so; llama.cpp splits over every GPU).

:func:`plan` is pure (sizes and free memory in, a :class:`Placement` out), so CI checks it without a
GPU; :func:`model_sizes` measures a GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moecache.gguf_file import GGUFModel

CPU = -1  # device id of the host in Placement.layer_device

RESERVE_BYTES = 1 << 30  # per GPU: activations, cuBLAS workspace, the prompt-MoE scratch, CUDA context
USABLE_FRACTION = 0.95  # of each GPU's free memory
# the part of a GPU's reserve (the margin above, RESERVE_BYTES, the prompt scratch) that decoding keeps
# when the expert cache takes the rest as elastic slots (PlacementOptions.elastic_slots): twice the memory
# an 8 GiB decode held beyond the plan (H200, Qwen3-30B-A3B-shaped: peak 6745 MiB with the 526 MiB CUDA
# context and 6033 MiB planned, run h200-s21a: 186 MiB of kernel modules, cuBLAS and CUDA graphs). At
# -c 12948 -ub 2048 decode held ~370 MiB beside the plan (run h200-s24a): the slots that do not fit
# then stay lent (the expert cache's take-back measures, moecache.moe.cache.TAKE_BACK_MARGIN_BYTES)
DECODE_KEEP_BYTES = 384 << 20
# a CUDA context's device memory, as a process finds it in use before loading anything (526 MiB on the
# H200 with CuPy, bench/results/vram-peak-h200.txt): the what-if of `profile` assumes it, a run measures it
CUDA_CONTEXT_BYTES = 526 << 20


class PlacementError(ValueError):
    """Impossible placement flags (the message names the flag)."""


@dataclass(frozen=True)
class PlacementOptions:
    """The placement flags (llama.cpp names).

    Attributes:
        n_gpu_layers: ``-ngl``; -1 = auto (all layers that fit), 0 = CPU only.
        cpu_moe: ``--cpu-moe``.
        n_cpu_moe: ``--n-cpu-moe``/``-ncmoe``.
        split_mode: ``-sm``: "layer" or "none".
        tensor_split: ``-ts``: proportions per GPU; empty = by free memory.
        main_gpu: ``-mg``: the GPU of ``-sm none``.
        offload_min_batch: prompt ubatches of at least this many tokens compute host experts on the
            GPU (llama.cpp's op offload threshold, 32).
        prompt_gpu: the GPU those ubatches run on (the startup probe picks the fastest host link);
            None = each layer's own GPU.
        moe_cache: ``--moe-cache``: None = not given (auto), -1 = fill free VRAM, 0 = off, N = at most
            N MiB per GPU.
        vram_budget: ``--vram-budget`` in bytes per GPU (0 = none): the program uses at most this
            much of each GPU (emulates a smaller card; the KV cache and every buffer count).
        elastic_slots: an expert cache that fills the free VRAM also takes the part of the reserve
            that only prompt ubatches use, as elastic slots whose memory goes back to the driver for
            each prompt pass (:class:`moecache.moe.cache.CachedExperts`' ``tail``; one GPU's cache
            only; ``--elastic-slots``, on by default through :class:`moecache.settings.Settings`;
            False here, the engine's own default). Within an 8 GiB ``--vram-budget`` in every case
            measured (H200, runs h200-s24b/c and h200-s30b/c, bench/results/vs-llamacpp-h200.md),
            where decode takes back only the slots that fit (at -c 12948 -ub 2048, 432-448 of 501).
    """

    n_gpu_layers: int = -1
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    offload_min_batch: int = 32
    prompt_gpu: int | None = None
    moe_cache: int | None = None
    vram_budget: int = 0
    elastic_slots: bool = False

    def validate(self, n_gpus: int) -> None:
        """Raise PlacementError naming the flag of any impossible value."""
        if self.n_gpu_layers < -1:
            raise PlacementError(f"-ngl must be >= 0 (or -1 for auto), got {self.n_gpu_layers}")
        if self.n_cpu_moe < 0:
            raise PlacementError(f"--n-cpu-moe must be >= 0, got {self.n_cpu_moe}")
        if self.split_mode not in ("layer", "none"):
            raise PlacementError(f"-sm {self.split_mode!r}: supported split modes are 'layer' and 'none'")
        if any(v < 0 for v in self.tensor_split) or (self.tensor_split and sum(self.tensor_split) <= 0):
            raise PlacementError(f"-ts {self.tensor_split}: proportions must be >= 0 with a positive sum")
        if n_gpus and len(self.tensor_split) > n_gpus:
            raise PlacementError(f"-ts has {len(self.tensor_split)} values but {n_gpus} GPU(s) are visible")
        if self.moe_cache is not None and self.moe_cache < -1:
            raise PlacementError(f"--moe-cache must be -1 (fill VRAM), 0 (off) or a size in MiB, got {self.moe_cache}")
        if self.vram_budget < 0:
            raise PlacementError(f"--vram-budget must be >= 0, got {self.vram_budget}")
        if n_gpus and not 0 <= self.main_gpu < n_gpus:
            raise PlacementError(f"-mg {self.main_gpu}: {n_gpus} GPU(s) are visible (0..{n_gpus - 1})")


@dataclass(frozen=True)
class ModelSizes:
    """Bytes a model needs per part (as the GPU backend stores them).

    Attributes:
        dense: per layer, the non-expert weights.
        experts: per layer, the routed experts (0 for dense layers).
        kv: per layer, the KV cache at the chosen n_ctx.
        output: output norm + output matrix (the token embeddings when tied).
        largest_matrix_f32: the largest dense matrix dequantized to float32 (the prompt-path scratch).
        expert_each: bytes of one expert's three matrices (one cache slot).
        token_embd: the token embeddings, on layer 0's device.
    """

    dense: tuple[int, ...]
    experts: tuple[int, ...]
    kv: int
    output: int
    largest_matrix_f32: int = 0
    expert_each: int = 0  # bytes of one expert (gate + up + down): a cache slot
    token_embd: int = 0  # kept with layer 0 (and counted again on the output GPU when tied)

    @property
    def n_layer(self) -> int:
        return len(self.dense)

    def with_context(self, n_ctx: int) -> ModelSizes:
        """These sizes with the KV cache of ``n_ctx`` positions, from sizes measured at one position."""
        return replace(self, kv=self.kv * n_ctx)


@dataclass(frozen=True)
class Placement:
    """Where everything lives.

    Attributes:
        layer_device: per layer, ``CPU`` or a GPU ordinal (dense weights + KV cache).
        experts_on_device: per layer, True if its routed experts are resident on that layer's GPU.
        output_device: ``CPU`` or a GPU ordinal for the output norm and matrix.
        offload_min_batch: op-offload threshold of host experts on GPU layers (None: never).
        prompt_gpu: the GPU offloaded prompt ubatches run on (None: each layer's own).
        cache_slots: ``(GPU, slots)`` of each GPU's expert cache over its host-expert layers.
        elastic_slots: ``(GPU, slots)``: of those slots, how many are elastic (the last ones: they
            hold experts while decoding and are lent to prompt passes' arrays; see
            :data:`DECODE_KEEP_BYTES`).
        notes: what was decided and why (printed once).
    """

    layer_device: tuple[int, ...]
    experts_on_device: tuple[bool, ...]
    output_device: int
    offload_min_batch: int | None = 32
    notes: tuple[str, ...] = field(default=(), compare=False)
    prompt_gpu: int | None = None
    cache_slots: tuple[tuple[int, int], ...] = ()  # (GPU, slots) of the expert cache; empty = off
    elastic_slots: tuple[tuple[int, int], ...] = ()  # (GPU, slots): the last of those slots, elastic

    @property
    def devices(self) -> list[int]:
        """GPU ordinals in use, ascending."""
        return sorted({d for d in (*self.layer_device, self.output_device, self.prompt_gpu)
                       if d is not None and d != CPU})

    @property
    def n_gpu_layers(self) -> int:
        return sum(d != CPU for d in self.layer_device)

    def summary(self) -> str:
        """One line: GPU layers per device, host-expert layers."""
        n = len(self.layer_device)
        if not self.devices:
            return f"all {n} layers on the CPU"
        parts = []
        for d in self.devices:
            ls = [i for i, x in enumerate(self.layer_device) if x == d]
            if ls:
                parts.append(f"GPU {d}: layers {ls[0]}-{ls[-1]}")
        host = sum(1 for i in range(n) if self.layer_device[i] != CPU and not self.experts_on_device[i])
        out = "GPU %d" % self.output_device if self.output_device != CPU else "CPU"
        moe = f"; experts of {host} GPU layers in host RAM" if host else ""
        cache = "".join(f"; expert cache GPU {g}: {s} slots" for g, s in self.cache_slots)
        return f"{self.n_gpu_layers}/{n} layers on GPU ({', '.join(parts)}); output on {out}{moe}{cache}"


def model_sizes(model: GGUFModel, n_ctx: int, kv_itemsize: int = 4) -> ModelSizes:
    """Measure ``model``: weight bytes per layer (1-D tensors as float32) and the KV cache at
    ``kv_itemsize`` bytes per element (4: float32, 2: float16)."""
    c = model.config
    dense = [0] * c.n_layer
    experts = [0] * c.n_layer
    output = 0
    embd = 0
    largest = 0
    for name, t in model.tensors.items():
        n_elem = int(np.prod(t.shape))
        nbytes = 4 * n_elem if len(t.shape) == 1 else int(t.n_bytes)
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if name.endswith("_exps.weight"):
                experts[il] += nbytes
            else:
                dense[il] += nbytes
        elif name == "token_embd.weight":
            embd = nbytes
        else:
            output += nbytes
        if len(t.shape) == 2:
            largest = max(largest, 4 * n_elem)
    kv = n_ctx * c.n_head_kv * (c.head_dim + c.head_dim_v) * kv_itemsize
    each = max(experts) // c.n_expert if c.n_expert else 0
    if "output.weight" not in model.tensors:
        output += embd  # tied: the output device holds its own copy
    return ModelSizes(tuple(dense), tuple(experts), kv, output, largest, each, embd)


def _split(layers: list[int], gpus: list[int], weights: list[float], n_total: int | None = None) -> dict[int, int]:
    """Contiguous ranges of ``layers`` over ``gpus`` in proportion to ``weights`` (llama.cpp -sm layer):
    layer j of ``n_total`` offloaded layers (the output layer counts when it is offloaded) goes to the
    first GPU whose cumulative share exceeds j / n_total."""
    total = sum(weights)
    cum, acc = [], 0.0
    for w in weights:
        acc += w / total
        cum.append(acc)
    out = {}
    n = n_total or len(layers)
    for j, il in enumerate(layers):
        frac = j / n if n else 0.0
        g = next((i for i, c in enumerate(cum) if frac < c - 1e-12), len(gpus) - 1)
        out[il] = gpus[g]
    return out


def budgeted_free(gpu_free: list[int] | tuple[int, ...], vram_budget: int,
                  gpu_used: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Free bytes per GPU as a run may use them: ``--vram-budget`` (bytes, 0 = none) caps what the
    run holds on each GPU (an emulated smaller GPU), so what is already in use there when the GPU is
    probed (``gpu_used``, bytes per GPU, None = nothing: this process's own CUDA context, ~0.5 GiB
    on the H200, and any other process) counts against it: min(free, budget - used). The budget is
    checked against the measured device memory, context included (``../shared/vs-llamacpp.md``);
    before this the context was left out and a long prompt ran 200-290 MiB over an 8 GiB budget
    (bench/results/vs-llamacpp-h200.md, run ``h200-s9m``). The one place the budget is applied: the
    placement and the resolution of defaults both read it."""
    used = list(gpu_used) if gpu_used is not None else [0] * len(gpu_free)
    if len(used) != len(gpu_free):
        raise ValueError(f"gpu_used has {len(used)} entries for {len(gpu_free)} GPUs")
    return [max(0, min(int(f), vram_budget - int(u))) if vram_budget else int(f) for f, u in zip(gpu_free, used)]


def plan(opts: PlacementOptions, sizes: ModelSizes, gpu_free: list[int],
         gpu_used: list[int] | None = None) -> Placement:
    """Place the model (see the module docstring for the rules), in three steps: the dense layers
    (:func:`_fit_dense`), the routed experts (:func:`_place_experts`), the expert caches
    (:func:`_cache_slots`).

    Args:
        opts: the flags.
        sizes: what the model needs (:func:`model_sizes`).
        gpu_free: free bytes of each visible GPU (empty: no GPU).
        gpu_used: bytes already in use on each GPU when it was probed (:func:`budgeted_free`: they
            count against ``--vram-budget``); None = nothing.

    Raises:
        PlacementError: impossible flags, or dense layers asked for with ``-ngl N`` that do not fit.
    """
    n = sizes.n_layer
    opts.validate(len(gpu_free))
    notes: list[str] = []
    if not gpu_free or opts.n_gpu_layers == 0:
        return Placement((CPU,) * n, (False,) * n, CPU, None, tuple(notes))
    gpus, weights = _split_gpus(opts, gpu_free)
    free = budgeted_free(gpu_free, opts.vram_budget, gpu_used)
    if opts.vram_budget:
        notes.append(f"--vram-budget {opts.vram_budget / 2**30:.1f} GiB per GPU")
    budget = {g: int(free[g] * USABLE_FRACTION) - RESERVE_BYTES - sizes.largest_matrix_f32 for g in gpus}
    if opts.split_mode == "layer" and not opts.tensor_split and len(gpus) > 1:
        gpus, weights = _fewest_gpus(opts, sizes, gpus, weights, budget, notes)
    fit = _fit_dense(opts, sizes, gpus, weights, budget, notes)
    if fit is None:
        return Placement((CPU,) * n, (False,) * n, CPU, None, tuple(notes))
    dev, out_dev, use = fit
    explicit = bool(opts.cpu_moe or opts.n_cpu_moe)
    on_dev, fits = _place_experts(opts, sizes, dev, use, budget, gpus, explicit, notes)
    layer_device = tuple(dev.get(il, CPU) for il in range(n))
    cache = _cache_slots(opts, sizes, dev, on_dev, use, budget, gpus, explicit, fits, notes)
    cache, elastic = _elastic_slots(opts, sizes, dev, on_dev, cache, {g: free[g] - budget[g] for g in gpus}, notes)
    used = {d for d in layer_device if d != CPU}
    prompt = opts.prompt_gpu if opts.prompt_gpu in used and len(used) > 1 else None
    return Placement(layer_device, tuple(on_dev), out_dev, opts.offload_min_batch, tuple(notes), prompt, cache,
                     elastic)


def fits_whole(opts: PlacementOptions, sizes: ModelSizes, gpu_free: list[int],
               gpu_used: list[int] | None = None) -> bool:
    """The plan's verdict on whether the whole model fits: with ``-ngl`` auto and no ``--cpu-moe`` /
    ``--n-cpu-moe`` / expert cache, :func:`plan` puts every layer, the output and every routed expert
    on the GPUs (``opts``' split, main GPU and ``--vram-budget`` kept). The resolution of defaults
    (:func:`moecache.settings.resolve`) reads this instead of comparing sizes itself, so with the
    default flags "experts in host RAM" is what the placement then does (``-ngl N``,
    ``--moe-cache 0`` and ``--cpu-moe``/``-ncmoe`` place experts their own way). False without a
    GPU."""
    if not gpu_free:
        return False
    whole = plan(replace(opts, n_gpu_layers=-1, cpu_moe=False, n_cpu_moe=0, moe_cache=0), sizes, gpu_free, gpu_used)
    return (whole.output_device != CPU and whole.n_gpu_layers == sizes.n_layer
            and all(on or not e for on, e in zip(whole.experts_on_device, sizes.experts)))


def _fewest_gpus(opts: PlacementOptions, sizes: ModelSizes, gpus: list[int], weights: list[float],
                 budget: dict[int, int], notes: list[str]) -> tuple[list[int], list[float]]:
    """The default split (``-sm layer`` without ``-ts``) on the GPUs that help: a GPU whose free
    memory cannot hold even the reserve and the prompt scratch is left out (it would drag layers
    to the CPU), and when everything this run puts on a GPU fits on one, it stays on that one (the
    one with the most usable memory): a decode step on one device is one CUDA graph, and over two
    it was measured 1.9x slower (issue 23). Notes say which; ``-ts`` splits anyway."""
    usable = [g for g in gpus if budget[g] > 0]
    for g in gpus:
        if g not in usable:
            notes.append(f"GPU {g} left out of the split: its free memory holds less than the reserve and the "
                         f"prompt scratch")
    if not usable:
        return gpus, weights
    n = sizes.n_layer
    n_gl = n + 1 if opts.n_gpu_layers == -1 else opts.n_gpu_layers
    best = max(usable, key=lambda g: (budget[g], -g))
    dev = {il: best for il in range(n - min(n_gl, n), n)}  # the layers -ngl puts on a GPU (the last ones)
    whole = _dense_use(sizes, [best], dev, best if n_gl > n else CPU)[best]
    whole += sum(sizes.experts[il] for il in dev if not opts.cpu_moe and il >= opts.n_cpu_moe)
    if whole <= budget[best]:
        if len(usable) > 1:
            notes.append(f"the model fits on GPU {best} alone: it stays there (one device, one CUDA graph; -ts "
                         f"splits it)")
        return [best], [1.0]
    return usable, [weights[gpus.index(g)] for g in usable]


def _split_gpus(opts: PlacementOptions, gpu_free: list[int]) -> tuple[list[int], list[float]]:
    """The GPUs the layers go to and their shares (``-sm none``: the main GPU; ``-ts``: its
    proportions, GPUs of share 0 left out; else each GPU's free memory)."""
    gpus = [opts.main_gpu] if opts.split_mode == "none" else list(range(len(gpu_free)))
    weights = list(opts.tensor_split) + [0.0] * (len(gpu_free) - len(opts.tensor_split)) if opts.tensor_split \
        else [float(f) for f in gpu_free]
    if opts.split_mode == "none":
        weights = [1.0]
    elif opts.tensor_split:
        keep = [i for i, w in enumerate(weights) if w > 0]
        gpus, weights = [gpus[i] for i in keep], [weights[i] for i in keep]
    return gpus, weights


def _dense_use(sizes: ModelSizes, gpus: list[int], dev: dict[int, int], out_dev: int) -> dict[int, int]:
    """Bytes per GPU of the dense layers ``dev`` puts there (weights + KV cache), the token
    embeddings with layer 0 and the output on ``out_dev``."""
    use = {g: 0 for g in gpus}
    for il, g in dev.items():
        use[g] += sizes.dense[il] + sizes.kv
    if 0 in dev:
        use[dev[0]] += sizes.token_embd
    if out_dev != CPU:
        use[out_dev] += sizes.output
    return use


def _fit_dense(opts: PlacementOptions, sizes: ModelSizes, gpus: list[int], weights: list[float],
               budget: dict[int, int], notes: list[str]) -> tuple[dict[int, int], int, dict[int, int]] | None:
    """The dense layers on the GPUs: the last ``-ngl`` layers (all that fit with ``-ngl -1``), their
    KV cache, the token embeddings with layer 0 and the output with the last GPU when ``-ngl``
    exceeds the layers. Returns (layer -> GPU, output device, bytes used per GPU), or None when no
    layer fits (a note says so). Raises PlacementError for an explicit ``-ngl`` that does not fit."""
    n = sizes.n_layer

    def layout(n_gl: int) -> tuple[dict[int, int], int]:
        gl = list(range(n - min(n_gl, n), n))
        # the output layer takes a share of the split when it is on the GPU (llama.cpp: act_gpu_layers)
        return _split(gl, gpus, weights, len(gl) + (1 if n_gl > n else 0)), (gpus[-1] if n_gl > n else CPU)

    auto_ngl = opts.n_gpu_layers == -1
    n_gl = n + 1 if auto_ngl else opts.n_gpu_layers
    while True:
        dev, out_dev = layout(n_gl)
        use = _dense_use(sizes, gpus, dev, out_dev)
        if all(use[g] <= budget[g] for g in gpus):
            break
        if not auto_ngl:
            g = next(g for g in gpus if use[g] > budget[g])
            raise PlacementError(
                f"-ngl {opts.n_gpu_layers}: the dense weights and KV cache need {use[g] / 2**30:.2f} GiB on GPU {g}, "
                f"{max(budget[g], 0) / 2**30:.2f} GiB usable: lower -ngl or -c")
        n_gl -= 1
        if n_gl == 0:
            notes.append("no layer fits in GPU memory: running on the CPU")
            return None
    if auto_ngl and n_gl <= n:
        notes.append(f"-ngl auto: {n_gl} of {n} layers fit in GPU memory (dense weights + KV cache)")
    return dev, out_dev, use


def _place_experts(opts: PlacementOptions, sizes: ModelSizes, dev: dict[int, int], use: dict[int, int],
                   budget: dict[int, int], gpus: list[int], explicit: bool,
                   notes: list[str]) -> tuple[list[bool], bool]:
    """Which GPU layers keep their routed experts in VRAM. ``--cpu-moe`` / ``--n-cpu-moe`` decide
    (explicit: PlacementError when what they leave on a GPU does not fit); otherwise all of them
    when they fit, none when they do not and an expert cache can take their place, else the first
    layers' experts go to host RAM until every GPU fits. Returns (per layer: experts on the GPU,
    whether all experts fitted)."""
    n = sizes.n_layer
    on_dev = [il in dev and not opts.cpu_moe and il >= opts.n_cpu_moe and sizes.experts[il] > 0 for il in range(n)]

    def expert_use() -> dict[int, int]:
        u = dict(use)
        for j, g in dev.items():
            if on_dev[j]:
                u[g] += sizes.experts[j]
        return u

    fits = all(v <= budget[g] for g, v in expert_use().items())
    if not explicit and not fits and opts.moe_cache != 0 and sizes.expert_each:
        # the model does not fit: every routed expert in host RAM, free VRAM becomes the cache
        on_dev = [False] * n
    elif not explicit:
        moved = 0
        for il in range(n):  # first layers' experts to host until every GPU fits
            over = [g for g, v in expert_use().items() if v > budget[g]]
            if not over:
                break
            if on_dev[il] and dev[il] in over:
                on_dev[il] = False
                moved += 1
        if moved:
            notes.append(f"routed experts of {moved} layer(s) do not fit in GPU memory: they stay in host RAM and "
                         f"run on the CPU (as --n-cpu-moe {moved}; --moe-cache 0)")
    else:
        u = expert_use()
        over = [g for g in gpus if u[g] > budget[g]]
        if over:
            g = over[0]
            raise PlacementError(f"the experts placed on GPU {g} need {u[g] / 2**30:.2f} GiB with the dense "
                                 f"weights, {max(budget[g], 0) / 2**30:.2f} GiB usable: raise --n-cpu-moe")
    return on_dev, fits


def _cache_slots(opts: PlacementOptions, sizes: ModelSizes, dev: dict[int, int], on_dev: list[bool],
                 use: dict[int, int], budget: dict[int, int], gpus: list[int], explicit: bool, fits: bool,
                 notes: list[str]) -> tuple[tuple[int, int], ...]:
    """Slots of each GPU's expert cache (its host-expert layers, its VRAM left after the dense
    weights, KV cache and resident experts), with the note saying what was requested and granted."""
    host_layers = {g: [il for il, d in dev.items() if d == g and not on_dev[il] and sizes.experts[il]] for g in gpus}
    if not any(host_layers.values()) or not sizes.expert_each:
        return ()
    if opts.moe_cache == 0:
        notes.append("expert cache off (--moe-cache 0): host experts run on the CPU")
        return ()
    if explicit and opts.moe_cache is None:
        notes.append("expert cache off: --cpu-moe / --n-cpu-moe place experts explicitly (add --moe-cache to cache)")
        return ()
    out = []
    for g in gpus:
        if not host_layers[g]:
            continue
        left = budget[g] - use[g] - sum(sizes.experts[il] for il, d in dev.items() if d == g and on_dev[il])
        want = left if opts.moe_cache in (None, -1) else min(left, opts.moe_cache << 20)
        slots = max(0, want) // sizes.expert_each
        slots = min(slots, sum(sizes.experts[il] for il in host_layers[g]) // sizes.expert_each)  # all of them at most
        requested = "fill free VRAM" if opts.moe_cache in (None, -1) else f"{opts.moe_cache} MiB"
        if slots == 0:
            notes.append(f"expert cache off on GPU {g}: no VRAM left after the dense weights and KV cache "
                         f"(requested {requested}, {max(left, 0) / 2**20:.0f} MiB left)")
            continue
        why = "" if fits or explicit else " (the model does not fit in VRAM)"
        notes.append(f"expert cache on GPU {g}{why}: requested {requested}, granted "
                     f"{slots * sizes.expert_each / 2**20:.0f} MiB = {slots} slots of {sizes.expert_each / 2**20:.2f} MiB")
        out.append((g, slots))
    return tuple(out)


def _elastic_slots(opts: PlacementOptions, sizes: ModelSizes, dev: dict[int, int], on_dev: list[bool],
                   cache: tuple[tuple[int, int], ...], reserve: dict[int, int],
                   notes: list[str]) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """The expert cache's elastic slots: the reserve less :data:`DECODE_KEEP_BYTES` (``reserve``:
    each GPU's free memory less its budget, i.e. the margin, :data:`RESERVE_BYTES` and the prompt
    scratch), in slots, added to a cache that fills the free VRAM (``--moe-cache`` not a size) when
    every GPU layer is on that one GPU (layers on the CPU use no VRAM; several GPUs are not tried)
    and prompt ubatches run on it. Returns the caches
    with those slots added and ``(GPU, elastic slots)``."""
    if not (opts.elastic_slots and len(cache) == 1 and opts.moe_cache in (None, -1)
            and opts.offload_min_batch is not None):
        return cache, ()
    g, slots = cache[0]
    if set(dev.values()) != {g}:  # one GPU only: not tried with layers spread over several
        return cache, ()
    every = sum(sizes.experts[il] for il, d in dev.items() if d == g and not on_dev[il]) // sizes.expert_each
    extra = min(max(0, reserve[g] - DECODE_KEEP_BYTES) // sizes.expert_each, every - slots)
    if extra <= 0:
        return cache, ()
    notes.append(f"expert cache on GPU {g}: + {extra} elastic slots ({extra * sizes.expert_each / 2**20:.0f} MiB "
                 f"of the reserve: experts while decoding, lent to each prompt ubatch's arrays)")
    return ((g, slots + extra),), ((g, extra),)

