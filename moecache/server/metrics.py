"""Counters of the server's work, rendered as Prometheus text (llama-server's names, ``moecache:``)."""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field
from typing import Any

# upper bounds (seconds) of the step-time histograms: 0.1-0.5 ms for the worker's own time between two decode
# passes, 1 ms apart up to 16 ms (one H200 decode token of the 30B-A3B model at 8 GiB takes ~6 ms), 2 ms apart
# up to 30 ms (an 8-token step ~22 ms; one stream's TPOT p99 19-25 ms), coarser up to 5 s (prompt chunks,
# CUDA graph captures)
STEP_BUCKETS_S = (0.0001, 0.0002, 0.0005, *(i / 1000 for i in range(1, 17)), *(i / 1000 for i in range(18, 31, 2)),
                  0.035, 0.040, 0.050, 0.060, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Histogram:
    """Observations (seconds) counted per bucket, as a Prometheus histogram counts them.

    Attributes:
        bounds: the buckets' upper bounds, increasing (a value ``v`` falls in the first bucket with
            ``v <= bound``, Prometheus's ``le``).
        counts: observations per bucket, not cumulative: ``len(bounds) + 1`` of them, the last for
            values above every bound (``+Inf``).
        total: the observations' sum.

    Written by one thread (the worker's); :meth:`copy` from another reads the counters as they are.
    """

    bounds: tuple[float, ...] = STEP_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        if len(self.counts) != len(self.bounds) + 1 or list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"a histogram needs increasing bounds and one count more than bounds, got "
                             f"{len(self.bounds)} bounds and {len(self.counts)} counts")

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since ``earlier`` (a copy of this histogram taken before). ValueError
        when the buckets differ or a count went down (not an earlier copy: a restarted server's)."""
        if earlier.bounds != self.bounds:
            raise ValueError("histograms with different buckets")
        counts = [a - b for a, b in zip(self.counts, earlier.counts)]
        if min(counts) < 0:
            raise ValueError("a histogram's count went down: not an earlier copy of this one")
        return Histogram(self.bounds, counts, self.total - earlier.total)

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (0 <= q <= 1) as Prometheus's ``histogram_quantile`` estimates it: linear
        within the bucket that holds rank ``q * count`` (the first bucket from 0); the highest bound when
        that rank is in the ``+Inf`` bucket; NaN without observations. ValueError for q outside [0, 1]."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"a quantile is in [0, 1], got {q}")
        n = self.count
        if n == 0:
            return math.nan
        rank = q * n
        below = 0
        for i, c in enumerate(self.counts):
            if below + c >= rank and c > 0:
                if i == len(self.bounds):
                    return self.bounds[-1]
                lo = self.bounds[i - 1] if i else 0.0
                return lo + (self.bounds[i] - lo) * (rank - below) / c
            below += c
        return self.bounds[-1]

    def lines(self, name: str, text: str) -> list[str]:
        """Prometheus text lines: ``# HELP name text``, ``name_bucket`` (cumulative, ``le``),
        ``name_sum``, ``name_count``."""
        out = [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
        cum = 0
        for b, c in zip((*(repr(float(x)) for x in self.bounds), "+Inf"), self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{b}"}} {cum}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {cum}"]


class Metrics:
    """Totals since start: requests by outcome, prompt and generated tokens and their seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.requests = {"ok": 0, "cancelled": 0, "error": 0, "rejected": 0}

    def done(self, n_prompt: int, prompt_s: float, n_predicted: int, predicted_s: float, cancelled: bool) -> None:
        """A request finished in the worker."""
        with self._lock:
            self.prompt_tokens += n_prompt
            self.prompt_seconds += prompt_s
            self.predicted_tokens += n_predicted
            self.predicted_seconds += predicted_s
            self.requests["cancelled" if cancelled else "ok"] += 1

    def count(self, outcome: str) -> None:
        """A request that ended without generating: "error" (4xx/5xx) or "rejected" (queue full)."""
        with self._lock:
            self.requests[outcome] += 1

    def render(self, st: Any) -> str:
        """Prometheus text exposition format (version 0.0.4) of these totals and a worker's
        :class:`moecache.server.worker.WorkerStatus` ``st``: its requests in slots and waiting, its
        decode steps and the tokens they decoded, its seconds inside the engine's (decode, prompt)
        calls, each call once (``prompt_seconds_total`` instead sums every request's prompt time, and
        a pass that serves several slots' prompts counts in each), the histograms of its decode passes
        and of its time between two passes of a batch, and each expert cache's counters."""
        processing, waiting, caches, decode, engine_s = st.n_processing, st.n_waiting, st.caches, st.decode, st.engine_s
        rows: list[tuple[str, str, str, Any]] = [
            ("prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
            ("prompt_seconds_total", "counter", "Prompt processing time.", self.prompt_seconds),
            ("tokens_predicted_total", "counter", "Generated tokens.", self.predicted_tokens),
            ("tokens_predicted_seconds_total", "counter", "Generation time.", self.predicted_seconds),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
             self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
             self.predicted_tokens / self.predicted_seconds if self.predicted_seconds else 0.0),
            ("requests_processing", "gauge", "Requests being processed.", processing),
            ("requests_deferred", "gauge", "Requests waiting in the queue.", waiting),
            ("decode_steps_total", "counter", "Decode forward passes (every generating slot in one).", decode[0]),
            ("decode_step_tokens_total", "counter", "Tokens those passes decoded (per pass: the batch size).",
             decode[1]),
            ("decode_seconds_total", "counter", "Time inside the engine's decode passes.", engine_s[0]),
            ("prompt_eval_seconds_total", "counter",
             "Time inside the engine's prompt evaluations (a pass of several slots' prompts counted once).",
             engine_s[1]),
        ]
        out = []
        for name, kind, help, value in rows:
            out += [f"# HELP moecache:{name} {help}", f"# TYPE moecache:{name} {kind}", f"moecache:{name} {value}"]
        out += ["# HELP moecache:requests_total Requests by outcome.", "# TYPE moecache:requests_total counter"]
        out += [f'moecache:requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
        out += st.decode_pass.lines("moecache:decode_pass_seconds", "Time of each decode pass inside the engine.")
        out += st.between_passes.lines(
            "moecache:decode_between_passes_seconds",
            "The worker's time from a decode pass's end to the next pass of a slot in it (sampling, streaming, "
            "admitting requests, other slots' prompt chunks).")
        if caches:
            out += ["# HELP moecache:expert_cache_hit_rate Expert-cache hit rate since start, per GPU cache.",
                    "# TYPE moecache:expert_cache_hit_rate gauge"]
            out += [f'moecache:expert_cache_hit_rate{{cache="{i}"}} {c.hit_rate}' for i, c in enumerate(caches)]
            out += ["# HELP moecache:expert_cache_hits_total Routed (token, expert) pairs read from the cache's slots.",
                    "# TYPE moecache:expert_cache_hits_total counter"]
            out += [f'moecache:expert_cache_hits_total{{cache="{i}"}} {c.hits}' for i, c in enumerate(caches)]
            out += ["# HELP moecache:expert_cache_misses_total Routed (token, expert) pairs not in the cache.",
                    "# TYPE moecache:expert_cache_misses_total counter"]
            out += [f'moecache:expert_cache_misses_total{{cache="{i}"}} {c.misses}' for i, c in enumerate(caches)]
            out += ["# HELP moecache:expert_cache_uploads_total Experts uploaded into the cache.",
                    "# TYPE moecache:expert_cache_uploads_total counter"]
            out += [f'moecache:expert_cache_uploads_total{{cache="{i}"}} {c.uploads}' for i, c in enumerate(caches)]
        return "\n".join(out) + "\n"
