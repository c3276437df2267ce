"""The one thread that owns the engine: requests wait in a bounded queue and run one at a time.

The engine is not thread-safe, so only :class:`Worker`'s thread touches it. A request is a
:class:`Job`; the worker sends its events (text pieces, then the end or an error) to the asyncio
loop that serves the client. A job's ``cancelled`` flag (the client left, the server stops) is
checked before it starts and at every generated token. Decode batching across requests is not
built yet: this is the one-at-a-time version.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from moecache.server.schemas import ApiError, GenRequest
from moecache.server.stops import StopMatcher


@dataclass
class Result:
    """How a job ended. ``finish_reason``: "stop" (end of generation or a stop string),
    "length" (max_tokens or the context), "cancelled"."""

    text: str
    n_tokens: int
    finish_reason: str
    timings: Any
    predicted_s: float
    cache: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's natural-log probability under the model (its logits' log-softmax, before
    the sampler's temperature, penalties and truncations, and before ``ignore_eos``'s mask) and the
    ``top`` most likely tokens of that step as (id, log-probability), most likely first; ``offset``:
    where the token's text starts in the completion's text (characters)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    offset: int = 0


def token_logprob(logits: Any, token: int, n_top: int) -> TokenLogprob:
    """:class:`TokenLogprob` of ``token`` from one step's float (n_vocab,) logits (float32 values,
    the exponentials summed in float64)."""
    import numpy as np

    x = np.asarray(logits, np.float32)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - np.float32(m)).sum(dtype=np.float64)))
    top: tuple[tuple[int, float], ...] = ()
    if n_top:
        k = min(n_top, x.shape[0])
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]  # most likely first, ties by id
        top = tuple((int(i), float(x[i]) - lse) for i in idx)
    return TokenLogprob(int(token), float(x[token]) - lse, top)


class Job:
    """One request: prompt ids and settings in, events out to ``loop``.

    Events (``await job.events.get()``): ``("text", str)``, then ``("done", Result)`` or
    ``("error", ApiError)``.
    """

    def __init__(self, ids: list[int], gen: GenRequest, loop: asyncio.AbstractEventLoop):
        self.ids = ids
        self.gen = gen
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.n_decoded = 0

    def emit(self, kind: str, value: Any) -> None:
        """Hand an event to the client's loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()

    def cancel(self) -> None:
        """Stop this job at its next token (or before it starts)."""
        self.cancelled.set()


class Worker:
    """Runs jobs on ``llm`` (a :class:`moecache.llm.LLM`) one at a time, in its own thread.

    Args:
        llm: the loaded model.
        n_parallel: most jobs waiting beyond the running one; :meth:`submit` refuses more (503).
        on_done: called in the worker thread with (job, Result) after each finished job (metrics).
        log: one line per unexpected error (stderr).
    """

    def __init__(self, llm, n_parallel: int, on_done: Callable[[Job, Result], None], log: Callable[[str], None]):
        self.llm = llm
        self.n_parallel = n_parallel
        self.on_done = on_done
        self.log = log
        self.stopping = threading.Event()
        self.current: Job | None = None
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread = threading.Thread(target=self._run, name="moecache-engine", daemon=True)
        self._thread.start()

    @property
    def n_waiting(self) -> int:
        """Jobs admitted and not started."""
        return self._waiting

    def submit(self, job: Job) -> None:
        """Queue ``job``; ApiError 503 when the server stops or the queue is full."""
        with self._lock:
            if self.stopping.is_set():
                raise ApiError(503, "the server is shutting down")
            if self._waiting >= self.n_parallel:
                raise ApiError(503, f"the server is busy: {self._waiting} requests already wait (-np {self.n_parallel})")
            self._waiting += 1
        self._q.put(job)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every job (running and waiting) and end the thread."""
        self.stopping.set()
        cur = self.current
        if cur is not None:
            cur.cancel()
        self._q.put(None)
        self._thread.join(timeout)

    def alive(self) -> bool:
        """Whether the engine's thread is still running (a :meth:`stop` that timed out)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                break
            with self._lock:
                self._waiting -= 1
            if job.cancelled.is_set() or self.stopping.is_set():
                job.emit("error", ApiError(503, "the request was cancelled before it started"))
                continue
            self.current = job
            try:
                res = self._generate(job)
            except ApiError as e:
                job.emit("error", e)
                continue
            except Exception as e:  # a request's failure must not end the server
                self.log(f"error: request failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                job.emit("error", ApiError(500, f"generation failed: {type(e).__name__}: {str(e)[:300]}"))
                continue
            finally:
                self.current = None
            try:
                self.on_done(job, res)
            except Exception as e:  # pragma: no cover - metrics must never break serving
                self.log(f"error: metrics: {e}")
            job.emit("done", res)
        while True:  # shutting down: say so to whoever still waits
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", ApiError(503, "the server is shutting down"))

    def _generate(self, job: Job) -> Result:
        from moecache.kv_cache import ContextFullError
        from moecache.sampling import Sampler

        eng = self.llm.engine
        before = [(c.stats.hits, c.stats.misses, c.stats.uploads) for c in eng.caches]
        sampler = Sampler(job.gen.sampling, eng.n_ctx)
        if job.gen.ignore_eos and eng.tokenizer.eog_ids:
            sampler.sample = _without(sampler.sample, sorted(eng.tokenizer.eog_ids))
        logprobs: list[TokenLogprob] | None = None
        if job.gen.logprobs is not None:
            logprobs, n_top, pick = [], job.gen.logprobs, sampler.sample

            def sample_and_score(logits):  # the model's distribution: the raw logits of the step
                tok = pick(logits)
                logprobs.append(token_logprob(logits, tok, n_top))
                return tok
            sampler.sample = sample_and_score
        stream = eng.tokenizer.streamer(skip_special=True)
        stops = StopMatcher(job.gen.stop)
        parts: list[str] = []
        offsets: list[int] = []  # per kept token: characters of decoded text before it
        decoded = [0]

        def on_token(t: int) -> str | None:
            job.n_decoded += 1
            if job.cancelled.is_set() or self.stopping.is_set():
                return "cancelled"
            raw = stream.push(t)
            offsets.append(decoded[0])
            decoded[0] += len(raw)
            piece = stops.push(raw)
            if piece:
                parts.append(piece)
                job.emit("text", piece)
            return "stop" if stops.hit is not None else None

        eng.reset()
        t0 = time.perf_counter()
        try:
            res = eng.generate(job.ids, sampler, job.gen.max_tokens, stop=on_token)
        except ContextFullError as e:
            raise ApiError(400, str(e)) from None
        finally:
            eng.reset()
        predicted_s = time.perf_counter() - t0 - res.timings.t_prompt
        if res.stop != "cancelled":
            tail = stops.push(stream.flush()) + stops.flush()
            if tail:
                parts.append(tail)
                job.emit("text", tail)
        reason = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}.get(res.stop, "cancelled")
        cache = []
        for c, (h, m, u) in zip(eng.caches, before):
            c.flush()
            cache.append({"hits": c.stats.hits - h, "misses": c.stats.misses - m, "uploads": c.stats.uploads - u})
        text = "".join(parts)
        if logprobs is not None:
            del logprobs[len(res.tokens):]  # an end-of-generation token was sampled but not kept
            logprobs = [replace(lp, offset=o) for lp, o in zip(logprobs, offsets)]
            if stops.hit is not None:  # the tokens of the stop string are not the client's text
                logprobs = [lp for lp in logprobs if lp.offset < len(text)]
        return Result(text, res.timings.n_gen, reason, res.timings, predicted_s, cache, logprobs)


def _without(sample: Callable[[Any], int], ids: list[int]) -> Callable[[Any], int]:
    """``sample`` that never picks ``ids`` (their logits set to -inf: llama-server's ``ignore_eos``)."""
    import numpy as np

    def masked(logits):
        x = np.array(logits, dtype=np.float32, copy=True)
        x[[i for i in ids if i < x.shape[0]]] = -np.inf
        return sample(x)
    return masked
