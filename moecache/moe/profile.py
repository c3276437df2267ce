"""Routing profiles: record a model's expert routing, summarise its skew, and ask "what if the cache
had N GiB?" by replaying the policy on the recorded trace.

- :class:`RouteRecorder` is a route observer (``DecoderLM.route_observers``): it copies every MoE
  layer's routing (ids and weights) and changes nothing in the forward pass.
- :class:`Trace` is the recorded routing in the format ``--routing FILE.npz`` replays
  (:class:`moecache.moe.routing_process.TraceRouting`): ``routes`` [layer, token, k] expert ids,
  ``weights`` [layer, token, k]; plus ``n_expert``, ``expert_bytes`` and ``tokens`` (the ids fed).
- :func:`usage_counts`, :func:`layer_skew`: per-expert counts and a one-line skew per layer.
- :func:`what_if`: hit rate per cache budget (our policy and per-layer LRU, through
  :mod:`moecache.moe.replay`) and a predicted decode speed from :class:`CostModel`.
- :class:`UsageProfile`: usage counts saved per model (``profile --save``), keyed by
  :func:`model_key`; a profile of another model is refused when loaded.

The speed prediction is uncalibrated (a placeholder step time) unless :func:`calibrate` fits the
:class:`CostModel` to ``moecache bench`` runs of this machine (``profile --calibrate FILE``); the
validation on the H200 is ``bench/results/what-if-h200.md``.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moecache.moe.policy import PolicyConfig
from moecache.moe.replay import ReplayStats, replay_lru, replay_policy
from moecache.moe.routing import Routing

DEFAULT_STEP_MS = 10.0  # placeholder GPU step time per decode token without --calibrate (see CostModel)
DEFAULT_LINK_GBPS = 25.0  # placeholder host->GPU link rate when no GPU was probed (PCIe 4.0 x16 pinned, roughly)


@dataclass(frozen=True)
class Trace:
    """A recorded routing trace.

    Attributes:
        routes: int32 (n_layer, n_tokens, k) expert ids per layer and token, best first.
        weights: float32 (n_layer, n_tokens, k) routing weights.
        n_expert: experts per layer of the model (ids are < n_expert).
        expert_bytes: bytes of one expert (gate + up + down of one layer; 0 = unknown).
        tokens: int32 (n_tokens,) the token ids fed, in order (empty when unknown).
    """

    routes: np.ndarray
    weights: np.ndarray
    n_expert: int
    expert_bytes: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def n_layer(self) -> int:
        return self.routes.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.routes.shape[1]

    def save(self, path: str | Path) -> None:
        """Write the ``.npz`` that ``--routing FILE`` and ``profile --trace-in FILE`` read."""
        dtype = np.uint8 if self.n_expert <= 256 else np.int32
        with open(path, "wb") as f:
            np.savez(f, routes=self.routes.astype(dtype), weights=self.weights.astype(np.float32),
                     n_expert=np.int64(self.n_expert), expert_bytes=np.int64(self.expert_bytes),
                     tokens=np.asarray(self.tokens, np.int32))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace (ours, or any ``.npz`` that ``--routing FILE`` accepts, e.g.
        ``code-moe-tiny.routes.npz``). Raises ValueError on a malformed file."""
        from moecache.moe.routing_process import TraceRouting

        tr = TraceRouting(path)
        n_expert, expert_bytes, tokens = tr.n_expert, 0, np.zeros(0, np.int32)
        with np.load(path) as f:
            if "n_expert" in f:
                n_expert = int(f["n_expert"])
                if n_expert < tr.n_expert:
                    raise ValueError(f"{path}: expert ids up to {tr.n_expert - 1} but n_expert {n_expert}")
            if "expert_bytes" in f:
                expert_bytes = int(f["expert_bytes"])
            if "tokens" in f and f["tokens"].size == tr.n_tokens:
                tokens = np.asarray(f["tokens"], np.int32)
        if tr.routes.min(initial=0) < 0:
            raise ValueError(f"{path}: negative expert ids")
        weights = tr.weights if tr.weights is not None else np.full(tr.routes.shape, 1.0 / tr.k, np.float32)
        return cls(tr.routes, weights, n_expert, expert_bytes, tokens)

    def head(self, n_tokens: int) -> Trace:
        """The first ``n_tokens`` tokens of the trace."""
        return Trace(self.routes[:, :n_tokens], self.weights[:, :n_tokens], self.n_expert, self.expert_bytes,
                     self.tokens[:n_tokens] if self.tokens.size else self.tokens)


class RouteRecorder:
    """Records every MoE layer's routing: append it to ``model.route_observers``.

    Each forward pass calls it once per MoE layer with host arrays (ids int (T, k), weights float32
    (T, k)); it only copies them, so the pass's results are unchanged. Dense layers (no routing)
    are not recorded; the trace's layer axis is the model's MoE layers in order.
    """

    def __init__(self) -> None:
        self._ids: dict[int, list[np.ndarray]] = {}
        self._w: dict[int, list[np.ndarray]] = {}

    def __call__(self, il: int, r: Routing) -> None:
        self._ids.setdefault(il, []).append(np.array(r.ids, np.int32, copy=True))
        self._w.setdefault(il, []).append(np.array(r.weights, np.float32, copy=True))

    @property
    def layers(self) -> list[int]:
        return sorted(self._ids)

    def trace(self, n_expert: int, expert_bytes: int = 0, tokens: Any = None) -> Trace:
        """What was recorded as a :class:`Trace` (every MoE layer saw the same tokens)."""
        if not self._ids:
            raise ValueError("no routing was recorded (a model without routed experts?)")
        routes = np.stack([np.concatenate(self._ids[il]) for il in self.layers])
        weights = np.stack([np.concatenate(self._w[il]) for il in self.layers])
        toks = np.zeros(0, np.int32) if tokens is None else np.asarray(tokens, np.int32)
        if toks.size != routes.shape[1]:
            toks = np.zeros(0, np.int32)
        return Trace(routes, weights, n_expert, expert_bytes, toks)


def usage_counts(routes: np.ndarray, n_expert: int) -> np.ndarray:
    """int64 (n_layer, n_expert): how many routed (token, expert) pairs each expert got per layer,
    from routes int (n_layer, n_tokens, k)."""
    routes = np.asarray(routes)
    out = np.zeros((routes.shape[0], n_expert), np.int64)
    for il in range(routes.shape[0]):
        out[il] = np.bincount(routes[il].reshape(-1).astype(np.int64), minlength=n_expert)[:n_expert]
    return out


@dataclass(frozen=True)
class LayerSkew:
    """How concentrated one layer's routing is.

    Attributes:
        layer: index in the trace's layer axis.
        top10_share: share of routed pairs that go to the most used 10% of experts (0.1 = uniform).
        entropy: entropy of the usage distribution over experts divided by log(n_expert)
            (1 = uniform, 0 = one expert takes everything).
        experts_90: fewest experts covering 90% of routed pairs, as a share of the layer's experts.
        top_expert: the most used expert id.
    """

    layer: int
    top10_share: float
    entropy: float
    experts_90: float
    top_expert: int


def layer_skew(counts: np.ndarray) -> list[LayerSkew]:
    """One :class:`LayerSkew` per row of ``counts`` int (n_layer, n_expert)."""
    out = []
    n_expert = counts.shape[1]
    top = max(1, math.ceil(0.1 * n_expert))
    for il, row in enumerate(np.asarray(counts, np.float64)):
        total = row.sum()
        if total <= 0:
            out.append(LayerSkew(il, 0.0, 0.0, 0.0, 0))
            continue
        srt = np.sort(row)[::-1]
        p = row[row > 0] / total
        ent = float(-(p * np.log(p)).sum() / math.log(n_expert)) if n_expert > 1 else 0.0
        n90 = int(np.searchsorted(np.cumsum(srt) / total, 0.9 - 1e-12) + 1)
        out.append(LayerSkew(il, float(srt[:top].sum() / total), ent, n90 / n_expert, int(np.argmax(row))))
    return out


class ArrayRouting:
    """A trace held in memory as a routing source for :mod:`moecache.moe.replay` (``route(layer, n)``,
    each layer reading on from where it stopped)."""

    def __init__(self, trace: Trace):
        self.t = trace
        self.pos = np.zeros(trace.n_layer, np.int64)

    def route(self, layer: int, n_tokens: int) -> Routing:
        i = self.pos[layer]
        self.pos[layer] += n_tokens
        idx = (i + np.arange(n_tokens)) % self.t.n_tokens
        return Routing(self.t.routes[layer, idx], self.t.weights[layer, idx])


@dataclass(frozen=True)
class CostModel:
    """The what-if's decode-speed model:
    ``seconds per token = step_s + misses/token x miss_s + uploads/token x upload_s``.

    A miss is an expert the GPU reads from page-locked host RAM over the link (zero-copy), an upload
    is the policy copying an expert into a slot over the same link; both are counted at the link,
    not overlapped with the step (they share it). :meth:`from_link` is the uncalibrated model (a
    placeholder step time, misses and uploads at the probe's pinned copy rate); :func:`calibrate`
    fits ``step_s`` and ``miss_s`` to measured ``moecache bench`` runs on this machine.

    Attributes:
        step_s: seconds of a decode step whose experts are all hits.
        miss_s: seconds each miss adds; upload_s: seconds each upload adds.
        source: where the numbers come from (printed with the table).
    """

    step_s: float
    miss_s: float
    upload_s: float
    source: str = "uncalibrated"

    @classmethod
    def from_link(cls, step_s: float, link_bytes_per_s: float, expert_bytes: int,
                  source: str = "uncalibrated") -> CostModel:
        """Misses and uploads each cost one expert's bytes at ``link_bytes_per_s`` (bytes/s)."""
        per = expert_bytes / link_bytes_per_s
        return cls(step_s, per, per, source)

    def seconds_per_token(self, misses_per_token: float, uploads_per_token: float = 0.0) -> float:
        return self.step_s + misses_per_token * self.miss_s + uploads_per_token * self.upload_s


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured decode run with an expert cache (a ``moecache bench -o jsonl`` tg row).

    Attributes:
        seconds_per_token: 1 / avg_ts.
        misses_per_token: (1 - hit_rate) x MoE layers x experts per token.
        uploads_per_token: the row's ``uploads_per_token``.
    """

    seconds_per_token: float
    misses_per_token: float
    uploads_per_token: float


def calibration_points(rows: list[dict], n_moe_layers: int, k: int) -> list[CalibrationPoint]:
    """The decode rows of ``moecache bench -o jsonl`` records that ran with an expert cache
    (``n_prompt`` 0, ``n_gen`` > 0, no depth, a ``hit_rate``); others are skipped.

    Raises:
        ValueError: such a row whose ``avg_ts`` is not a finite number > 0, whose ``hit_rate`` is
            not in [0, 1] or whose ``uploads_per_token`` is not a number >= 0 (it names the row).
    """
    def number(r: dict, key: str, i: int, ok: Any, what: str) -> float:
        v = r.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise ValueError(f"record {i}: {key} must be {what}, got {v!r}")
        return float(v)

    out = []
    for i, r in enumerate(rows, 1):
        if r.get("n_prompt") or not r.get("n_gen") or r.get("n_depth") or r.get("hit_rate") is None:
            continue
        ts = number(r, "avg_ts", i, lambda v: v > 0, "a number > 0")
        hit = number(r, "hit_rate", i, lambda v: 0 <= v <= 1, "between 0 and 1")
        up = number({"uploads_per_token": r.get("uploads_per_token") or 0.0}, "uploads_per_token", i,
                    lambda v: v >= 0, "a number >= 0")
        out.append(CalibrationPoint(1.0 / ts, (1.0 - hit) * n_moe_layers * k, up))
    return out


def calibrate(points: list[CalibrationPoint], expert_bytes: int, link_bytes_per_s: float) -> CostModel:
    """A :class:`CostModel` fitted to measured runs: ``upload_s`` is one expert at the link rate;
    with one point ``miss_s`` is too and ``step_s`` is what the run leaves; with two or more,
    ``step_s`` and ``miss_s`` are the least-squares line of (seconds per token less the uploads)
    against misses per token.

    Raises:
        ValueError: no point, or a fit that is not physical (a step or a miss cost <= 0: the runs'
            miss counts are too close to tell them apart).
    """
    if not points:
        raise ValueError("no decode run with an expert cache to calibrate from (moecache bench -o jsonl rows with "
                         "-p 0 -n N and a hit_rate)")
    upload_s = expert_bytes / link_bytes_per_s
    y = np.array([p.seconds_per_token - p.uploads_per_token * upload_s for p in points])
    m = np.array([p.misses_per_token for p in points])
    if len(points) == 1 or np.ptp(m) == 0:
        miss_s = upload_s
        step_s = float(np.mean(y - m * miss_s))
        how = f"step time from {len(points)} measured run(s), misses at the link rate"
        if step_s <= 0:
            raise ValueError(f"calibration is not physical: the run(s) leave {step_s * 1e3:.3f} ms for the step once "
                             f"their misses and uploads are paid at the link rate (is the link rate right?)")
    else:
        miss_s, step_s = (float(v) for v in np.polyfit(m, y, 1))
        how = f"step and miss times fitted to {len(points)} measured runs"
    if step_s <= 0 or miss_s <= 0:
        raise ValueError(f"calibration is not physical (step {step_s * 1e3:.3f} ms, miss {miss_s * 1e6:.1f} us): "
                         f"give runs whose hit rates differ more")
    return CostModel(step_s, miss_s, upload_s, how)


@dataclass(frozen=True)
class WhatIfRow:
    """One budget of :func:`what_if`.

    Attributes:
        budget_bytes: the expert cache's size in bytes.
        n_slots: experts it holds (budget // expert bytes, at most every expert).
        ours, lru: the replay's counts for our policy and per-layer LRU.
        static_hit_rate: hit rate of the best static placement for this trace (:func:`static_hit_rate`).
        tokens_per_s: predicted decode tokens/s of our policy by the :class:`CostModel`.
        cost: the model that predicted it.
    """

    budget_bytes: int
    n_slots: int
    ours: ReplayStats
    lru: ReplayStats
    static_hit_rate: float
    tokens_per_s: float
    cost: CostModel | None = None


def slots_for(budget_bytes: int, expert_bytes: int, n_layer: int, n_expert: int) -> int:
    """Experts a cache of ``budget_bytes`` holds (capped at all ``n_layer x n_expert``)."""
    if expert_bytes <= 0:
        raise ValueError("the expert size is unknown: give -m MODEL (or --expert-mib) for a what-if in bytes")
    return int(min(budget_bytes // expert_bytes, n_layer * n_expert))


def replay_at(trace: Trace, n_slots: int, cfg: PolicyConfig = PolicyConfig(),
              warmup: int = 0) -> tuple[ReplayStats, ReplayStats]:
    """Our policy and per-layer LRU over the tokens of ``trace`` (each replayed as one decode step)
    with ``n_slots`` slots in all; the first ``warmup`` tokens fill the cache and are not counted."""
    n = trace.n_tokens - warmup
    if n <= 0:
        raise ValueError(f"the trace has {trace.n_tokens} tokens: nothing is left after a warm-up of {warmup}")
    ours = replay_policy(ArrayRouting(trace), trace.n_layer, trace.n_expert, n, n_slots, cfg, warmup)
    lru = replay_lru(ArrayRouting(trace), trace.n_layer, n, n_slots, cfg, warmup)
    return ours, lru


def static_hit_rate(counts: np.ndarray, n_slots: int) -> float:
    """Hit rate of the best static placement: the ``n_slots`` most used (layer, expert) pairs of
    ``counts`` int (n_layer, n_expert) kept resident. Chosen with hindsight on the same tokens, so it
    is an upper bound for any fixed placement (e.g. ``--n-cpu-moe`` style or a saved hot set)."""
    flat = np.sort(np.asarray(counts, np.int64).reshape(-1))[::-1]
    return float(flat[:max(0, n_slots)].sum() / max(1, flat.sum()))


def what_if(trace: Trace, budgets: list[int], cost: CostModel, cfg: PolicyConfig = PolicyConfig(),
            expert_bytes: int | None = None, warmup: int = 0) -> list[WhatIfRow]:
    """Hit rates and predicted decode t/s for each expert-cache budget (bytes), in the order given;
    ``warmup`` tokens of the trace fill the cache first (not counted, as ``bench --n-gen-warmup``)."""
    eb = expert_bytes or trace.expert_bytes
    rows = []
    for b in budgets:
        n = slots_for(b, eb, trace.n_layer, trace.n_expert)
        ours, lru = replay_at(trace, n, cfg, warmup)
        per = max(1, ours.tokens)
        tps = 1.0 / cost.seconds_per_token(ours.misses / per, ours.uploads / per)
        counted = usage_counts(trace.routes[:, warmup:], trace.n_expert)  # the tokens the hit rates count
        rows.append(WhatIfRow(b, n, ours, lru, static_hit_rate(counted, n), tps, cost))
    return rows


@dataclass(frozen=True)
class VramCache:
    """The expert cache a GPU of ``vram_bytes`` gives a model (:func:`cache_at_vram`).

    Attributes:
        vram_bytes: the GPU's usable memory (as ``--vram-budget``).
        cache_bytes: the expert cache's slots x bytes of one expert; every expert's bytes when the
            whole model fits (then every routed pair is a hit).
        n_ctx: the context the run resolves to (its KV cache is counted).
        fits: the whole model fits on the GPU (no cache: every expert resident).
        on_gpu: any layer is on the GPU (False: the run is on the CPU, no cache).
    """

    vram_bytes: int
    cache_bytes: int
    n_ctx: int
    fits: bool
    on_gpu: bool = True


def cache_at_vram(facts: Any, vram_bytes: int, settings: Any, host: Any) -> VramCache:
    """What ``run --vram-budget VRAM`` would place: :func:`moecache.settings.resolve` and
    :func:`moecache.placement.plan` (the one authority on what fits) for a GPU of ``vram_bytes``
    free, with ``settings`` (``-c`` and the KV type) and ``host`` (a
    :class:`moecache.probe.HostInfo`). ``facts``: the model's :class:`moecache.settings.ModelFacts`."""
    from dataclasses import replace

    from moecache.placement import CUDA_CONTEXT_BYTES, plan
    from moecache.probe import GpuInfo, Probe
    from moecache.settings import resolve

    # a run finds its own CUDA context in use, and it counts against the budget
    gpu = GpuInfo(0, "what-if", "", int(vram_bytes) - CUDA_CONTEXT_BYTES, int(vram_bytes))
    res = resolve(replace(settings, vram_budget=int(vram_bytes)), facts, Probe(host, (gpu,)))
    ctx = res.n_ctx or facts.context_length
    pl = plan(res.placement, facts.sizes.with_context(ctx), [gpu.vram_free], [CUDA_CONTEXT_BYTES])
    if not pl.n_gpu_layers:
        return VramCache(int(vram_bytes), 0, ctx, False, on_gpu=False)
    on = [e for e, d in zip(pl.experts_on_device, facts.sizes.experts) if d]
    if on and all(on):
        return VramCache(int(vram_bytes), facts.expert_bytes, ctx, True)
    slots = sum(n for _, n in pl.cache_slots)
    return VramCache(int(vram_bytes), slots * facts.expert_each, ctx, False)


def hit_rate_curve(trace: Trace, fractions: list[float],
                   cfg: PolicyConfig = PolicyConfig()) -> list[tuple[float, float, float]]:
    """(fraction of all experts cached, our hit rate, LRU hit rate) at each fraction."""
    out = []
    for f in fractions:
        n = int(round(f * trace.n_layer * trace.n_expert))
        ours, lru = replay_at(trace, n, cfg)
        out.append((f, ours.hit_rate, lru.hit_rate))
    return out


# ---- the model's identity and persisted usage ------------------------------------------------------
def expert_bytes_of(gguf: Any) -> int:
    """Bytes of one routed expert (gate + up + down) of the first MoE layer of a GGUFModel; 0 if none."""
    c = gguf.config
    for il in range(c.n_layer):
        names = [f"blk.{il}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        if all(n in gguf.tensors for n in names):
            return sum(gguf.tensors[n].n_bytes for n in names) // max(1, c.n_expert)
    return 0


def model_key(gguf: Any) -> str:
    """``<file name>-<file size in bytes>-<12 hex digits>`` (the shards' sizes summed). The hash covers
    every tensor's name, type, shape and offset, so a re-quantized or re-shaped file with the same name
    gets another key; two files of the same name, size and layout (e.g. re-trained weights) share one."""
    h = hashlib.sha256()
    for t in gguf.tensors.values():
        h.update(f"{t.name}:{t.ggml_type}:{','.join(map(str, t.shape))}:{t.file}:{t.offset};".encode())
    size = sum(Path(p).stat().st_size for p in getattr(gguf, "paths", [gguf.path]))
    return f"{gguf.path.name}-{size}-{h.hexdigest()[:12]}"


def profiles_dir() -> Path:
    """``$XDG_CACHE_HOME/moecache/profiles`` (default ``~/.cache/moecache/profiles``)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moecache" / "profiles"


@dataclass(frozen=True)
class UsageProfile:
    """Per-expert usage counts of one model.

    Attributes:
        key: :func:`model_key` of the model they were counted on.
        counts: int64 (n_layer, n_expert) routed pairs per expert (MoE layers in order).
        tokens: tokens counted.
    """

    key: str
    counts: np.ndarray
    tokens: int

    def save(self, path: str | Path | None = None) -> Path:
        """Write to ``path`` (default ``profiles_dir()/<key>.npz``, made if missing); returns it."""
        p = Path(path) if path is not None else profiles_dir() / f"{self.key}.npz"
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, key=np.array(self.key), counts=self.counts.astype(np.int64), tokens=np.int64(self.tokens))
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> UsageProfile:
        """Read a saved profile; ValueError on anything else."""
        try:
            with np.load(path, allow_pickle=False) as f:
                return cls(str(f["key"]), np.asarray(f["counts"], np.int64), int(f["tokens"]))
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a moecache usage profile ({e})") from None

    def check_model(self, key: str, shape: tuple[int, int]) -> str | None:
        """None if this profile fits the model of ``key`` with counts of ``shape``; else why not."""
        if self.key != key:
            return f"it is a profile of {self.key}, not of this model ({key})"
        if self.counts.shape != shape:
            return f"its counts are {self.counts.shape}, the model's layers x experts are {shape}"
        return None


@dataclass
class HotSet:
    """A run's saved expert usage (``run``/``serve`` with an expert cache): loaded and preloaded into
    the slots at start (:meth:`start`), this run's counts added and written back at exit (:meth:`save`).

    Attributes:
        path: the profile file (default ``profiles_dir()/<model_key>.npz``).
        key: :func:`model_key` of the model.
        moe_layers: the model's layers with routed experts, in order (the profile's rows).
        base: the profile loaded at start (None: none, or refused).
        counts0: the caches' policy counts at start (the warm-up token is not the user's).
        refused: why the file at ``path`` was not loaded (another model's, unreadable); such a file
            is left as it is at exit (nothing is saved).
    """

    path: Path
    key: str
    moe_layers: list[int]
    base: UsageProfile | None
    counts0: list[np.ndarray]
    refused: str | None = None

    @classmethod
    def start(cls, eng: Any, path: str | Path | None, log: Any) -> HotSet | None:
        """Load ``path`` (or the model's default profile) into ``eng``'s expert caches; None when the
        engine has no expert cache. A missing default file is not an error (the first run writes
        it); an unreadable file or another model's profile is refused with a note."""
        caches = eng.caches
        if not caches:
            return None
        gguf = eng.gguf
        c = gguf.config
        moe_layers = [il for il in range(c.n_layer) if f"blk.{il}.ffn_gate_exps.weight" in gguf.tensors]
        key = model_key(gguf)
        p = Path(path) if path is not None else profiles_dir() / f"{key}.npz"
        hs = cls(p, key, moe_layers, None, [cache.policy.counts.copy() for cache in caches])
        if not p.exists():
            if path is not None:
                log(f"note: --moe-profile {p}: no such file yet; this run's expert usage is written there at exit")
            return hs
        try:
            prof = UsageProfile.load(p)
        except ValueError as e:
            hs.refused = str(e)
            log(f"note: expert profile not loaded: {e}; it is left as it is (this run's usage is not saved)")
            return hs
        why = prof.check_model(key, (len(moe_layers), c.n_expert))
        if why:
            hs.refused = why
            log(f"note: expert profile {p} not loaded: {why}; it is left as it is (this run's usage is not saved)")
            return hs
        hs.base = prof
        usage = np.zeros((c.n_layer, c.n_expert))
        usage[moe_layers] = prof.counts / max(1, prof.tokens)  # uses per token: the policy's statistic
        n = sum(cache.preload(usage) for cache in caches)
        for cache in caches:
            cache.reset_stats()
        log(f"note: expert cache: {n} experts preloaded from {p} ({prof.tokens} tokens of saved usage)")
        return hs

    def counts(self, eng: Any) -> tuple[np.ndarray, int]:
        """This run's routed pairs per expert (MoE layers x experts) and tokens, from the caches'
        policies (every token a cached layer routed)."""
        c = eng.gguf.config
        total = np.zeros((c.n_layer, c.n_expert), np.int64)
        for cache, c0 in zip(eng.caches, self.counts0):
            n = cache.policy.counts - c0
            total[:n.shape[0], :n.shape[1]] += n
        rows = total[self.moe_layers]
        k = max(1, c.n_expert_used)
        tokens = int(rows.sum(axis=1).max() // k) if rows.size else 0
        return rows, tokens

    def save(self, eng: Any, log: Any) -> Path | None:
        """Add this run's counts to the loaded profile's and write the file; None when the run routed
        no tokens through a cache or the file was refused at start (nothing is written). An
        unwritable path is noted, not raised."""
        if self.refused is not None:
            return None
        for cache in eng.caches:
            cache.flush(admit=False)  # the last zero-copy pass is accounted at the next launch otherwise
        rows, tokens = self.counts(eng)
        if tokens == 0:
            return None
        if self.base is not None:
            rows, tokens = rows + self.base.counts, tokens + self.base.tokens
        try:
            p = UsageProfile(self.key, rows, tokens).save(self.path)
        except OSError as e:
            log(f"note: expert usage not saved: {self.path}: {e.strerror or e}")
            return None
        log(f"note: expert usage of {tokens} tokens saved to {p} (preloaded at the next start)")
        return p
