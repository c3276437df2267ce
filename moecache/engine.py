"""The engine: load a GGUF, evaluate tokens in ubatches, generate, and score perplexity.

Used by the command-line tools (``moecache/cli/``) and the library entry point (``moecache.load``); holds one sequence (one KV cache). Everything here is
backend-neutral: the model and KV cache live on the engine's backend (numpy on the CPU).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np
import psutil

from moecache.backends import NumpyBackend
from moecache.backends.ops import DECODE_MAX_TOKENS
from moecache.errors import InsufficientMemoryError, NonFiniteError
from moecache.gguf_file import GGUFModel, open_gguf
from moecache.kv_cache import ContextFullError, KVCache
from moecache.devices import gpu_memory, make_backends
from moecache.load_mode import pin_model
from moecache.models import build_model, model_class
from moecache.models.base import check_parts, expert_weights
from moecache.moe.cache import CachedExperts
from moecache.moe.executor import placed_experts
from moecache.moe.policy import CachePolicy, PolicyConfig
from moecache.placement import CPU, Placement, PlacementOptions, model_sizes, plan
from moecache.sampling import Sampler
from moecache.settings import LOAD_MODES
from moecache.threads import bind_numba_threads
from moecache.tokenizer import Tokenizer

Log = Callable[[str], None]


KV_TYPES = {"f32": np.float32, "f16": np.float16}  # -ctk/-ctv values -> KV cache element type
KV_RAM_FRACTION = 0.9  # the KV cache's host part may take at most this share of the available RAM
MIN_AUTO_CTX = 256  # without -c, a trained context that does not fit is lowered, but not below this


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (llama.cpp flag names in brackets).

    Attributes:
        n_ctx: context size in tokens [-c]; 0 = the model's trained context.
        n_batch: logical batch [-b]: most tokens handed to one evaluation call.
        n_ubatch: physical batch [-ub]: most tokens in one forward pass.
        n_threads: CPU threads [-t]; 0 = physical cores.
        cache_type: KV cache element type [-ctk/-ctv]: "f32" or "f16" (half the memory; llama.cpp's
            default type, its rounding). The CLI defaults to f16 as llama.cpp does; the library keeps
            f32 so that comparisons with reference implementations see no KV rounding.
    """

    n_ctx: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0
    cache_type: str = "f32"

    def validate(self) -> None:
        """Raise ValueError naming the flag of any impossible value."""
        bad = []
        if self.n_ctx < 0:
            bad.append(f"-c must be >= 0 (0 = the model's context), got {self.n_ctx}")
        if self.n_batch < 1:
            bad.append(f"-b must be >= 1, got {self.n_batch}")
        if self.n_ubatch < 1:
            bad.append(f"-ub must be >= 1, got {self.n_ubatch}")
        if self.n_threads < 0:
            bad.append(f"-t must be >= 0 (0 = physical cores), got {self.n_threads}")
        if self.cache_type not in KV_TYPES:
            bad.append(f"-ctk/-ctv must be one of {', '.join(KV_TYPES)}, got {self.cache_type!r}")
        if bad:
            raise ValueError("; ".join(bad))


@dataclass
class Timings:
    """Prompt processing (pp) and token generation (tg) counts and seconds.

    ``n_eval``/``t_eval`` count and time only the one-token forward passes of generation (as
    llama.cpp's "eval time ... runs"); sampling is not in them. The last sampled token is not
    evaluated, so ``n_eval`` is ``n_gen - 1`` when generation ran to ``-n``.
    """

    n_prompt: int = 0
    t_prompt: float = 0.0
    n_gen: int = 0
    n_eval: int = 0
    t_eval: float = 0.0

    @property
    def pp_tps(self) -> float:
        """Prompt tokens per second (0 if none)."""
        return self.n_prompt / self.t_prompt if self.t_prompt > 0 else 0.0

    @property
    def tg_tps(self) -> float:
        """Generation forward passes per second (0 if none)."""
        return self.n_eval / self.t_eval if self.t_eval > 0 else 0.0


@dataclass
class Generation:
    """What :meth:`Engine.generate` produced.

    Attributes:
        tokens: generated ids (the end-of-generation token excluded).
        stop: why it stopped: ``"eog"`` (end-of-generation token), ``"length"`` (-n reached),
            ``"context"`` (the context is full), ``"interrupted"`` (Ctrl-C), or the str ``stop`` returned.
        timings: pp/tg counts and times.
    """

    tokens: list[int] = field(default_factory=list)
    stop: str = "length"
    timings: Timings = field(default_factory=Timings)


@dataclass(frozen=True)
class PerplexityResult:
    """llama-perplexity's numbers: ``ppl = exp(mean nll)``, ``ppl_err`` its standard error
    (``ppl * sqrt(var(nll) / (count - 1))``, llama.cpp ``tools/perplexity``).

    Attributes:
        ppl, ppl_err: the estimate and its error.
        n_chunks: chunks scored; count: tokens scored; chunk_ppl: running estimate after each chunk.
        seconds: wall time.
    """

    ppl: float
    ppl_err: float
    n_chunks: int
    count: int
    chunk_ppl: list[float]
    seconds: float


def cpu_experts_round(asked: bool | None, has_gpu: bool, gpu_act_q8: bool) -> bool:
    """Whether the CPU's expert kernels round activations to 8 bits (``Engine(cpu_act_q8=...)``):
    ``asked`` when given; by default only beside a GPU whose decode products round by the same rule
    (``gpu_act_q8``): then every routed expert the CPU computes rounds (``--cpu-moe``, ``-ncmoe``,
    the expert cache's CPU misses, and the layers ``-ngl`` leaves on the CPU).
    On the CPU alone, and with ``gpu_act_q8=False``, the experts keep float32: that path is the
    reference the tests hold to transformers and to the CPU engine, and a rounding turns float
    noise (a batch's other summation order) into whole quantization steps."""
    return asked if asked is not None else has_gpu and gpu_act_q8


class Engine:
    """One loaded model, its tokenizer and one sequence's KV cache.

    Args:
        path: GGUF file (first shard of a split model), or one already opened (the engine then owns
            it and closes it).
        config: settings; ValueError if impossible.
        log: where one-line notes go (resolved settings, fallbacks); default: discard.
        backend: one array backend for every layer (routed experts in host RAM); default: as
            ``placement`` decides.
        placement: the placement flags (``-ngl``, ``--cpu-moe``, ``-sm``, ...), resolved against the
            free GPU memory by :func:`moecache.placement.plan`; None with no backend = the CPU.
            The decision and every fallback are logged once.
        cuda_graph: replay one-token decode steps as a CUDA graph when the whole model is on one
            GPU (:mod:`moecache.backends.cuda_graph`); False = op by op.
        batch_graph: also replay batched decode steps of :meth:`sequences` (continuous batching)
            as CUDA graphs, one per batch size (a lone sequence of them takes that path too, so a
            lone slot needs no capture of its own); False = those steps run op by op (H200,
            Qwen3-30B-A3B shape, all on the GPU: 8 sequences 8.5 ms per step against 18.6 ms op by
            op, ``bench/batch_steps.py``).
        graph_handoff: in a decode graph, layers whose routed experts the CPU computes (``--cpu-moe``,
            ``-ncmoe``) hand them over inside the graph (:mod:`moecache.moe.handoff`: the GPU posts
            the layer's input to page-locked memory and waits for the CPU's sum); False = the graph
            ends at each such layer and a new segment starts after it (a sync and copies from
            Python per layer); batched steps with such layers then run op by op.
        miss_split: the expert caches' decode graphs hand a share of each layer's misses to the CPU
            (:class:`moecache.moe.cache.CachedExperts`; needs the zero-copy path); off by default:
            measured slower on the H200 (``--miss-split``; bench/results/miss-split-h200.md).
        load_mode: "mmap" (weights read from the mapped file) or "pin" (copied into page-locked RAM
            at load, :func:`moecache.load_mode.pin_model`; ``pin_progress`` sees the copy).
        policy_config: the expert cache's policy knobs (default :class:`PolicyConfig`; the CLI
            sets the costs from the expert size and the measured link).
        stage_misses: the expert caches stage decode misses in VRAM with a copy kernel before the
            MoE kernels read them (``CachedExperts``'s option; its scratch of ``2 * top_k`` experts
            comes out of the slots). On by default since the twenty-second session: H200, 8 GiB,
            ``bench/cache_profile.py`` (both arms in one process), uniform routing 48.4 -> 54.7 t/s,
            low-locality 51.7 -> 58.3 (54.5 -> 57.9 with uploads frozen), qwen3-moe 156.6 -> 157.3
            (``bench/results/cache-profile-h200.md``).
        gpu_act_q8: the GPU's decode matrix products (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K weights) round
            their activations to int8 per 32 values and multiply in integers, as llama.cpp's CUDA
            MMVQ kernels do (logits move by that rounding); False keeps float32 activations, the
            CPU backend's arithmetic (the tests that compare the two use it).
        gpu_prompt_q8: with ``gpu_act_q8``, the GPU's prompt MoE (ubatches of more than 16 tokens)
            rounds activations to int8 too and reads the quantized experts in place, grouped by
            expert (``CupyBackend.prompt_q8``), instead of float16 tensor-core GEMMs of dequantized
            experts; off by default: it measured slower on the H200 (``bench/prompt_q8.py``,
            ``bench/results/prompt-q8-h200.md``).
        cpu_act_q8: the routed experts computed on the CPU round their activations to int8 per 32
            values, the GPU's rule, and Q8_0, Q4_K, Q5_K and Q6_K experts multiply in integers
            (:mod:`moecache.quants.int_dots`; llama.cpp's CPU kernels round activations too, per
            256 values): on the H200 machine the ``--cpu-moe`` decode step's Numba kernel took 644
            µs per layer against 1078 (``bench/cpu_moe_step.py``). None (default):
            :func:`cpu_experts_round`; True or False forces it.
        prefetch_experts: prompt ubatches whose routed experts stay in host RAM (``--cpu-moe``,
            ``--n-cpu-moe``; op offload) copy the next such layer's experts to the GPU on a copy
            stream while the current layer computes (:mod:`moecache.moe.prefetch`; page-locked
            weights only, ``--load-mode pin``); one more layer of experts in VRAM during a prompt,
            kept by CuPy's pool afterwards and not counted in the placement's reserve or
            ``--vram-budget``. Not used with an expert cache (a note says so). Off by default: +1-3% on
            the H200 (``bench/prompt_q8.py --ab prefetch``, ``bench/results/prompt-q8-h200.md``).

    Raises:
        GGUFError: the file is missing, unreadable or not a valid GGUF; UnsupportedArchError,
            UnsupportedQuantError: it is valid but cannot be run.
        InsufficientMemoryError: the KV cache of ``n_ctx`` tokens does not fit in the available RAM.
        NonFiniteError: NaN/inf in a norm weight, or in the warm-up token's logits.
    """

    def __init__(self, path: str | Path | GGUFModel, config: EngineConfig = EngineConfig(), log: Log | None = None,
                 backend: Any = None, placement: PlacementOptions | None = None, cuda_graph: bool = True,
                 load_mode: str = "mmap", pin_progress: Callable[[int, int, float], None] | None = None,
                 policy_config: PolicyConfig | None = None, stage_misses: bool = True, gpu_act_q8: bool = True,
                 batch_graph: bool = True, gpu_prompt_q8: bool = False, prefetch_experts: bool = False,
                 cpu_act_q8: bool | None = None, graph_handoff: bool = True, miss_split: bool = False):
        config.validate()
        self.log = log or (lambda s: None)
        self.config = config
        n_threads = config.n_threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        if n_threads > numba.config.NUMBA_NUM_THREADS:
            self.log(f"note: -t {n_threads} capped to {numba.config.NUMBA_NUM_THREADS}, the Numba thread pool's size")
            n_threads = numba.config.NUMBA_NUM_THREADS
        # Numba's thread count is the calling thread's own: set here for the load, and again by every
        # entry point below for the thread that calls it (moecache.threads.bind_numba_threads)
        numba.set_num_threads(n_threads)
        self.n_threads = n_threads
        t0 = time.perf_counter()
        self.gguf: GGUFModel = path if isinstance(path, GGUFModel) else open_gguf(path)
        self.pinned = None
        self.caches: list[CachedExperts] = []
        self.policy_config = policy_config or PolicyConfig()
        self.stage_misses = stage_misses
        self.gpu_act_q8 = gpu_act_q8
        self.gpu_prompt_q8 = gpu_prompt_q8
        self.cpu_act_q8 = cpu_act_q8
        self.prefetch_experts = prefetch_experts
        self.miss_split = miss_split
        try:
            if load_mode not in LOAD_MODES:
                raise ValueError(f"load_mode must be {' or '.join(LOAD_MODES)}, got {load_mode!r}")
            self.load_mode = load_mode
            if load_mode == "pin":
                self.pinned = pin_model(self.gguf, pin_progress)
            self.tokenizer = Tokenizer.from_gguf(self.gguf)
            cfg = self.gguf.config
            self.n_ctx = config.n_ctx or cfg.context_length
            if config.n_ctx and config.n_ctx > cfg.context_length:
                self.log(f"note: -c {config.n_ctx} is larger than the model's trained context "
                         f"{cfg.context_length}: quality may drop past it")
            self.placement: Placement | None = None
            if backend is not None or placement is None:
                self.backend = backend if backend is not None else NumpyBackend()
                self.model = build_model(self.gguf, self.backend)
            else:
                self.model = self._place(placement)
                self.backend = self.model.output_be
                if self.placement is not None and self.placement.devices:
                    self._decode_graph(cuda_graph, batch_graph, graph_handoff)
                    # (the CPU twin's inline handoff answers op-by-op passes: nothing is lost there; a
                    # layer plan's caches turn their CPU path off by themselves, CachedExperts._check_plan_paths)
                    if self.miss_split and self.model.decode_graph is None \
                            and any(c.handoff is not None and not c.handoff.inline for c in self.caches):
                        self.log("note: --miss-split ignored: the misses are split inside CUDA-graph decode "
                                 "steps, and this run decodes op by op")
            self.n_ubatch = min(config.n_ubatch, config.n_batch, self.n_ctx)
            if config.n_batch < min(config.n_ubatch, self.n_ctx):
                self.log(f"note: -ub {config.n_ubatch} is more than -b {config.n_batch}: {self.n_ubatch} "
                         f"token{'s' if self.n_ubatch != 1 else ''} per forward pass, as llama.cpp does")
            self._check_kv_memory()
            self.kv = self.model.new_kv_cache(self.n_ctx, KV_TYPES[config.cache_type])
            self.warmup()
        except BaseException:
            self.close()
            raise
        self.load_seconds = time.perf_counter() - t0

    def _check_kv_memory(self) -> None:
        """The KV cache's host part (layers on a CPU backend) against the available RAM, before it
        is allocated: a file's trained context (``{arch}.context_length``, the default ``-c``) or a
        large ``-c`` can ask for terabytes. At most ``KV_RAM_FRACTION`` of the available RAM
        (``psutil``) may go to it. Without ``-c`` the context is lowered to the largest power of two
        that fits, with a note (llama.cpp users get the trained context when it fits); with ``-c``
        InsufficientMemoryError says which ``-c`` fits."""
        c = self.gguf.config
        itemsize = np.dtype(KV_TYPES[self.config.cache_type]).itemsize
        host_layers = sum(1 for be in self.model.layer_be if getattr(be, "xp", np) is np)
        per_token = host_layers * c.n_head_kv * (c.head_dim + c.head_dim_v) * itemsize
        need, avail = per_token * self.n_ctx, psutil.virtual_memory().available
        if need <= KV_RAM_FRACTION * avail:
            return
        fit = int(KV_RAM_FRACTION * avail // max(1, per_token))
        fit = 1 << (fit.bit_length() - 1) if fit >= 1 else 0  # a round number: the largest power of two
        if not self.config.n_ctx and fit >= MIN_AUTO_CTX:
            self.log(f"note: the model's trained context ({c.arch}.context_length = {self.n_ctx}) needs "
                     f"{need / 2**30:.1f} GiB of KV cache in RAM, {avail / 2**30:.1f} GiB is available: "
                     f"context lowered to {fit} tokens (-c sets it)")
            self.n_ctx = fit
            self.n_ubatch = min(self.n_ubatch, fit)
            return
        src = f"-c {self.config.n_ctx}" if self.config.n_ctx else f"the model's trained context, {c.arch}.context_length"
        hint = f"pass -c {fit} or less" if fit >= 1 else "even one token does not fit"
        raise InsufficientMemoryError(
            f"the KV cache of {self.n_ctx} tokens ({src}) needs {need / 2**30:.1f} GiB of RAM "
            f"({self.config.cache_type}, {host_layers} layers), {avail / 2**30:.1f} GiB is available: {hint}")

    def _check_logits(self, lg: np.ndarray, pos: int, warmup: bool = False) -> None:
        """Raise NonFiniteError when the last row of a forward pass's logits holds NaN or inf (a
        corrupt weight or an overflow: sampling would pick garbage or fail). One row per pass is
        cheap, and a NaN spreads to every later position through the KV cache."""
        if lg.shape[0] and not np.isfinite(lg[-1]).all():
            raise NonFiniteError(
                f"{self.gguf.path.name}: the model computed non-finite logits (NaN or inf) at position {pos}"
                f"{' (the warm-up token, at load)' if warmup else ''}: "
                f"its weights hold NaN/inf values or overflow float32 (a corrupt or badly converted file)")

    def _place(self, opts: PlacementOptions) -> Any:
        """Plan the placement on the free GPU memory, build the backends and the model on them."""
        free, used, why = gpu_memory()
        if not free and opts.n_gpu_layers != 0:
            self.log(f"note: no usable GPU: {why}; running on the CPU")
        pl = plan(opts, model_sizes(self.gguf, self.n_ctx, np.dtype(KV_TYPES[self.config.cache_type]).itemsize), free,
                  used)
        for n in pl.notes:
            self.log("note: " + n)
        self.placement = pl
        bes = make_backends(pl.devices + [CPU], self.log, self.gpu_act_q8, self.gpu_prompt_q8)
        layer_bes = [bes[d] for d in pl.layer_device]
        ew = expert_weights(self.gguf, model_class(self.gguf).act)
        cpu_q8 = cpu_experts_round(self.cpu_act_q8, bool(pl.devices), self.gpu_act_q8)
        if self.prefetch_experts and pl.cache_slots:
            self.log("note: prefetch_experts is not used: the expert cache's own prompt path copies the host experts")
        experts = placed_experts(ew, pl.experts_on_device, layer_bes, pl.offload_min_batch,
                                 bes[pl.prompt_gpu] if pl.prompt_gpu is not None else None,
                                 # with an expert cache its own prompt path copies the host experts
                                 self.prefetch_experts and not pl.cache_slots, cpu_q8)
        self.caches = []
        c = self.gguf.config
        for g, slots in pl.cache_slots:
            layers = {il: e for il, e in ew.items() if pl.layer_device[il] == g and not pl.experts_on_device[il]}
            tail = dict(pl.elastic_slots).get(g, 0)
            if self.stage_misses and slots - tail > 4 * c.n_expert_used:
                slots -= 2 * c.n_expert_used  # the staging scratch (2 * top_k experts) comes out of the cache
            cache = CachedExperts(layers, bes[g], slots, CachePolicy(c.n_layer, c.n_expert, slots, self.policy_config),
                                  pl.offload_min_batch, top_k=c.n_expert_used, stage_misses=self.stage_misses,
                                  vram_limit=opts.vram_budget or None, log=self.log, act_q8=cpu_q8,
                                  miss_split=self.miss_split or self.policy_config.layer_plan,
                                  tail=tail if tail < slots else 0)
            if cache.zero_copy:
                self.log(f"note: expert cache on GPU {g}: decode misses are read by the GPU from page-locked "
                         f"host RAM (zero-copy)")
            else:
                self.log(f"note: expert cache on GPU {g}: decode misses are computed on the CPU "
                         f"({cache.zero_copy_why})")
            self.caches.append(cache)
            for il in layers:
                experts.executors[il] = cache
        return build_model(self.gguf, layer_bes[0], experts, layer_bes, bes[pl.output_device], pass_hooks=self.caches)

    def _decode_graph(self, wanted: bool, batched: bool = False, handoff: bool = True) -> None:
        if getattr(self.model.output_be, "name", "") != "cuda":
            return  # graphs are a CUDA feature; nothing to say on other backends
        from moecache.backends.cuda_graph import DecodeGraph, eligible

        why = eligible(self.model) if wanted else "disabled"
        if why is None:
            self.model.decode_graph = DecodeGraph(self.model, self.log, batched=batched, handoff=handoff)
        elif wanted:
            self.log(f"note: decode steps run op by op, not as a CUDA graph ({why})")

    def warmup(self) -> None:
        """One token through the model and back out of the cache: loads the compiled kernels so the
        first prompt's timing is the model's, not the loader's (llama.cpp warms up the same way)."""
        bind_numba_threads(self.n_threads)
        tok = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0
        self._check_logits(self.model.forward(np.array([tok]), self.kv), 0, warmup=True)
        self.kv.clear()
        for c in self.caches:
            c.reset_stats()  # the warm-up token is not the user's
            c.policy.forget_passes()  # (nor a decode pass of theirs: the first one seeds the plan's mean)

    def close(self) -> None:
        """Release the model file, the expert caches (their copies in flight waited for, their
        worker threads stopped) and an expert upload still in flight (dropped)."""
        model = getattr(self, "model", None)  # None when __init__ failed before the model was built
        drop = getattr(getattr(model, "experts", None), "drop_uploads", None)  # placed experts (ExpertsByLayer)
        if drop is not None:
            drop()
        for c in self.caches:
            c.close()
        self.gguf.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- evaluation ------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Tokens in the KV cache."""
        return self.kv.n_past

    def reset(self) -> None:
        """Empty the KV cache (start a new sequence)."""
        self.kv.clear()

    def sequences(self, n: int) -> list[KVCache]:
        """``n`` sequences that share this engine's KV cache memory, as llama-server's slots share
        ``-c``: sequence i holds positions ``i*m .. (i+1)*m - 1`` of it, ``m = n_ctx // n``
        (:meth:`KVCache.slice`); ``n`` = 1 is the engine's own cache. Give them to :meth:`eval`
        (``kv=``) and :meth:`decode` one at a time or together; do not use the engine's own
        sequence (:meth:`generate`, :meth:`eval` without ``kv``) meanwhile.

        Raises:
            ValueError: ``n`` < 1 or more sequences than positions.
        """
        if n < 1 or n > self.n_ctx:
            raise ValueError(f"sequences({n}): between 1 and n_ctx {self.n_ctx}")
        if n == 1:
            return [self.kv]
        m = self.n_ctx // n
        return [self.kv.slice(i * m, m) for i in range(n)]

    def decode(self, tokens: list[int] | np.ndarray, kvs: list[KVCache]) -> np.ndarray:
        """One decode step of several sequences: token i appended to ``kvs[i]`` (from
        :meth:`sequences`), in forward passes of at most ``DECODE_MAX_TOKENS`` (16) sequences
        (continuous batching: the GPU's decode kernels take up to 16 tokens). With batched CUDA
        graphs (``batch_graph``) a pass replays the graph of its batch size where it can
        (``DecodeGraph.takes_seqs``), one sequence too; otherwise one sequence runs as :meth:`eval`
        does (through the one-token CUDA graph where there is one) and several op by op.

        Returns:
            float32 (N, n_vocab): each token's logits.

        Raises:
            ContextFullError: a sequence is full (nothing is evaluated then).
            ValueError: a count mismatch, a cache given twice or an id outside the vocabulary.
            NonFiniteError: rows of the logits hold NaN or inf; its ``rows`` lists them and its
                ``logits`` holds the whole step's (the other sequences' rows are good and their
                tokens are in their caches).
        """
        bind_numba_threads(self.n_threads)
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        graph = self.model.decode_graph
        if len(kvs) == 1 and toks.size == 1 and not (graph is not None and graph.takes_seqs(self.model, kvs)):
            return self.eval(toks, kv=kvs[0])
        if toks.size != len(kvs):
            raise ValueError(f"decode: {toks.size} tokens for {len(kvs)} sequences")
        # every sequence checked before the first pass of DECODE_MAX_TOKENS runs
        check_parts(toks.reshape(-1, 1), kvs, self.gguf.config.n_vocab, "decode")
        step = DECODE_MAX_TOKENS
        parts = [self.model.forward_seqs(toks[i:i + step], list(kvs[i:i + step])) for i in range(0, len(kvs), step)]
        lg = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return self._named_rows(lg, "sequences decoded together")

    @property
    def prompt_pass_min(self) -> int | None:
        """Tokens from which a forward pass computes the routed experts in host RAM the prompt way,
        each used expert copied to the GPU once (``PlacementOptions.offload_min_batch``: the expert
        cache's prompt path, op offload of ``-ncmoe`` layers); None when no expert is in host RAM
        behind a GPU (every pass is computed where the experts are)."""
        mins = []
        for e in getattr(self.model.experts, "executors", {}).values():
            m = getattr(e, "offload_min_batch", None)
            be = getattr(e, "be", None) or getattr(e, "backend", None)
            if m is not None and getattr(be, "device", None) is not None:
                mins.append(m)
        return min(mins) if mins else None

    def shares_pass(self, sizes: list[int]) -> bool:
        """Whether :meth:`eval_seqs` runs parts of these sizes (tokens) in shared passes: always,
        unless experts are in host RAM behind a GPU (:attr:`prompt_pass_min` set) and every part is
        shorter than it. Packed together such parts make either a pass of 32+ tokens, which copies
        every expert it uses to the GPU (measured slower than a pass each: on the H200 machine at
        8 GiB, Qwen3-30B-A3B shape, 8 prompts of 14 tokens took 564-900 ms a round in one pass
        against 369-401 ms in 8 passes), or a shorter pass, not measured against a pass each. Once a
        part reaches it the pass copies the experts anyway, and the other parts ride along (8
        prompts of 256 tokens: 1192-1505 ms a round in shared passes against 3085-3781 one by one;
        ``bench/serve_overhead.py --real``, bench/results/serve-h200.md)."""
        least = self.prompt_pass_min
        return least is None or any(n >= least for n in sizes)

    def eval_seqs(self, parts: list[list[int] | np.ndarray], kvs: list[KVCache]) -> np.ndarray:
        """Append ``parts[i]`` to ``kvs[i]`` (from :meth:`sequences`) for every i, several sequences'
        tokens in each forward pass (serve's prompt chunks of several slots): the parts are packed in
        order into passes of at most ``n_ubatch`` tokens (a part longer than what is left of a pass
        goes on in the next one); a pass with one part runs as :meth:`eval` runs it, one with several
        as :meth:`DecoderLM.forward_parts`.

        Unless :meth:`shares_pass` says no (experts in host RAM, every part shorter than
        :attr:`prompt_pass_min`): then each part starts a pass of its own.

        Returns:
            float32 (N, n_vocab): the logits of each part's last token.

        Raises:
            ContextFullError: a part does not fit its sequence (nothing is evaluated then).
            ValueError: a count mismatch, an empty part, a cache given twice or an id outside the
                vocabulary.
            NonFiniteError: rows of the logits hold NaN or inf; its ``rows`` lists them and its
                ``logits`` holds every part's (the other parts are in their caches).
        """
        bind_numba_threads(self.n_threads)
        toks = check_parts(parts, kvs, self.gguf.config.n_vocab, "eval_seqs")
        shared = self.shares_pass([t.size for t in toks])
        out = np.empty((len(toks), self.gguf.config.n_vocab), np.float32)
        passes: list[list[tuple[int, int, int]]] = [[]]  # per pass: (part, first token, end)
        room = self.n_ubatch
        for i, t in enumerate(toks):
            if not shared and passes[-1]:  # each part starts a pass of its own
                room = 0
            a = 0
            while a < t.size:
                if room == 0:
                    passes.append([])
                    room = self.n_ubatch
                b = min(t.size, a + room)
                passes[-1].append((i, a, b))
                room -= b - a
                a = b
        for ps in passes:
            if len(ps) == 1:
                i, a, b = ps[0]
                lg = self.model.forward(toks[i][a:b], kvs[i], logits="last")
            else:
                lg = self.model.forward_parts([toks[i][a:b] for i, a, b in ps], [kvs[i] for i, _, _ in ps])
            for row, (i, _, b) in enumerate(ps):
                if b == toks[i].size:
                    out[i] = lg[row]
        return self._named_rows(out, "sequences' prompts evaluated together")

    def _named_rows(self, out: np.ndarray, what: str) -> np.ndarray:
        """``out`` (float32 (N, n_vocab), a row per sequence) when every row is finite; else
        NonFiniteError naming the bad rows (``rows``) and holding ``logits`` (serve fails only those
        sequences' requests); ``what`` says what the N sequences were."""
        bad = [i for i in range(out.shape[0]) if not np.isfinite(out[i]).all()]
        if bad:
            err = NonFiniteError(
                f"{self.gguf.path.name}: the model computed non-finite logits (NaN or inf) for {len(bad)} of the "
                f"{out.shape[0]} {what}: its weights hold NaN/inf values or overflow float32")
            err.rows, err.logits = bad, out
            raise err
        return out

    def eval(self, tokens: list[int] | np.ndarray, logits: str | np.ndarray = "last",
             kv: KVCache | None = None) -> np.ndarray:
        """Append ``tokens`` to the sequence (``kv``: one of :meth:`sequences`; default the engine's
        own), ``n_ubatch`` at a time.

        Args:
            tokens: int ids.
            logits: ``"last"`` (float32 (1, n_vocab)), ``"all"`` (float32 (T, n_vocab)), or an
                ascending int array of rows of ``tokens`` (float32 (len(rows), n_vocab)).

        Raises:
            ContextFullError: they do not fit (nothing is evaluated then).
            ValueError: empty input or an id outside the vocabulary.
            NonFiniteError: a forward pass's last logits row holds NaN or inf.
        """
        bind_numba_threads(self.n_threads)
        kv = self.kv if kv is None else kv
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            raise ValueError("no tokens to evaluate")
        kv.check_room(toks.size)
        if isinstance(logits, str):
            rows = np.arange(toks.size) if logits == "all" else np.array([toks.size - 1])
        else:
            rows = np.asarray(logits, dtype=np.int64)
        out = []
        for i in range(0, toks.size, self.n_ubatch):
            part = toks[i:i + self.n_ubatch]
            want = rows[(rows >= i) & (rows < i + part.size)] - i
            lg = self.model.forward(part, kv, logits=want)
            self._check_logits(lg, kv.n_past - part.size + (int(want[-1]) if want.size else 0))
            if want.size:
                out.append(lg)
        if not out:
            return np.empty((0, self.gguf.config.n_vocab), np.float32)
        return np.concatenate(out) if len(out) > 1 else out[0]

    def generate(self, prompt: list[int], sampler: Sampler, n_predict: int,
                 on_token: Callable[[int], None] | None = None,
                 stop: Callable[[int], str | None] | None = None) -> Generation:
        """Evaluate ``prompt`` (appended to the sequence), then sample up to ``n_predict`` tokens.

        Args:
            prompt: ids to append first (at least one).
            sampler: picks each token; every prompt and generated token is ``accept``-ed into it.
            n_predict: most tokens to generate; -1 = until end of generation or a full context.
            on_token: called with each generated id as soon as it is sampled (streaming).
            stop: called after ``on_token`` with each generated id; when it returns a str,
                generation ends there with that ``stop`` reason (a stop string, a cancelled
                request), the token kept.

        Returns:
            a :class:`Generation`. Ctrl-C (KeyboardInterrupt) ends it with stop ``"interrupted"``:
            during generation the tokens so far stay in the sequence; during the prompt the
            sequence is put back as it was (no tokens generated).

        Raises:
            ContextFullError: the prompt itself does not fit.
        """
        res = Generation()
        t0 = time.perf_counter()
        n_before = self.kv.n_past
        try:
            lg = self.eval(prompt)[-1]
        except KeyboardInterrupt:  # Ctrl-C during the prompt: forget its partial evaluation
            self.kv.truncate(n_before)
            res.stop = "interrupted"
            return res
        res.timings.n_prompt, res.timings.t_prompt = len(prompt), time.perf_counter() - t0
        for tok in prompt:
            sampler.accept(tok)
        try:
            while n_predict < 0 or len(res.tokens) < n_predict:
                tok = sampler.sample(lg)
                sampler.accept(tok)
                if self.tokenizer.is_eog(tok):
                    res.stop = "eog"
                    break
                res.tokens.append(tok)
                if on_token is not None:
                    on_token(tok)
                if stop is not None and (why := stop(tok)) is not None:
                    res.stop = why
                    break
                if n_predict >= 0 and len(res.tokens) >= n_predict:
                    break
                if self.kv.n_past >= self.n_ctx:
                    res.stop = "context"
                    break
                t0 = time.perf_counter()
                lg = self.eval([tok])[-1]
                res.timings.t_eval += time.perf_counter() - t0
                res.timings.n_eval += 1
        except KeyboardInterrupt:
            res.stop = "interrupted"
        res.timings.n_gen = len(res.tokens)
        return res

    # ---- perplexity ------------------------------------------------------------------------------
    def perplexity(self, tokens: list[int], n_ctx: int,
                   progress: Callable[[int, int, float], None] | None = None,
                   max_chunks: int = -1) -> PerplexityResult:
        """Perplexity over non-overlapping chunks of ``n_ctx`` tokens, as llama-perplexity computes it.

        Chunk i is ``tokens[i*n_ctx:(i+1)*n_ctx]`` with its first token replaced by BOS when the
        model adds BOS; only the second half is scored: the logits at positions
        ``n_ctx/2 .. n_ctx-2`` predict the next token (llama.cpp ``tools/perplexity/perplexity.cpp``,
        ``perplexity()``). Uses the engine's KV cache (cleared per chunk).

        Args:
            tokens: the whole text, tokenized with BOS as the model says.
            n_ctx: chunk length; at most the engine's context.
            progress: called after each chunk with (chunk index, n_chunks, running ppl).
            max_chunks: score at most this many chunks (llama-perplexity ``--chunks``); -1 = all.

        Raises:
            ValueError: fewer than ``2 * n_ctx`` tokens, or ``n_ctx`` larger than the engine's context.
        """
        if n_ctx > self.n_ctx:
            raise ValueError(f"perplexity chunk size {n_ctx} > the engine's context {self.n_ctx}")
        if n_ctx < 4:
            raise ValueError(f"-c must be >= 4 for perplexity, got {n_ctx}")
        if len(tokens) < 2 * n_ctx:
            raise ValueError(f"the text has {len(tokens)} tokens; perplexity with -c {n_ctx} needs at least "
                             f"{2 * n_ctx} (two chunks)")
        t_start = time.perf_counter()
        toks = np.asarray(tokens, dtype=np.int64)
        n_chunks = toks.size // n_ctx
        if max_chunks >= 0:
            n_chunks = min(n_chunks, max_chunks)
        first = n_ctx // 2
        bos = self.tokenizer.bos_id
        nll = nll2 = 0.0
        count = 0
        running = []
        for ci in range(n_chunks):
            chunk = toks[ci * n_ctx:(ci + 1) * n_ctx].copy()
            if self.tokenizer.add_bos and bos is not None:
                chunk[0] = bos
            self.kv.clear()
            logits = self.eval(chunk, logits=np.arange(first, n_ctx - 1))
            targets = chunk[first + 1:n_ctx]
            tok_nll = np.empty(targets.size)
            for r0 in range(0, targets.size, 32):  # float64 a few rows at a time (a row is n_vocab wide)
                lg = logits[r0:r0 + 32].astype(np.float64)
                m = lg.max(axis=1)
                lse = m + np.log(np.exp(lg - m[:, None]).sum(axis=1))
                tok_nll[r0:r0 + 32] = lse - lg[np.arange(lg.shape[0]), targets[r0:r0 + 32]]
            nll += float(tok_nll.sum())
            nll2 += float(np.square(tok_nll).sum())
            count += targets.size
            running.append(math.exp(nll / count))
            if progress is not None:
                progress(ci, n_chunks, running[-1])
        self.kv.clear()
        mean, mean2 = nll / count, nll2 / count
        ppl = math.exp(mean)
        var = mean2 - mean * mean
        err = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else float("nan")
        return PerplexityResult(ppl, err, n_chunks, count, running, time.perf_counter() - t_start)


__all__ = ["ContextFullError", "Engine", "EngineConfig", "Generation", "PerplexityResult", "Timings"]
