"""Counters of the server's work, rendered as Prometheus text (llama-server's names, ``moecache:``)."""

from __future__ import annotations

import threading
from typing import Any


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
        a pass that serves several slots' prompts counts in each), and each expert cache's counters."""
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
