"""The one thread that owns the engine: up to ``-np`` requests run at once in slots, more wait.

The engine is not thread-safe, so only :class:`Worker`'s thread touches it. A request is a
:class:`Job`; the worker sends its events (text pieces, then the end or an error) to the asyncio
loop that serves the client. Each of the ``-np`` slots is a sequence with its own part of the KV
cache (``-c`` split evenly, as llama-server splits it: :meth:`moecache.engine.Engine.sequences`).

Continuous batching: the thread loops over steps. A step takes waiting jobs into free slots,
evaluates prompt chunks of the slots still reading their prompts (slots take turns; at most ``-ub``
prompt tokens per step, so several short prompts go in one step and a long one is cut; the chunks of
several slots go to :meth:`moecache.engine.Engine.eval_seqs` together, which runs them in one
forward pass, as llama-server puts every slot's tokens in one batch: the expert cache then copies
the experts a prompt pass uses once for all of them, not once per slot; with experts in host RAM,
chunks that are all too short for a prompt pass still get a pass each, :meth:`_prompt_chunk`,
each first token sent as its pass ends: ``Engine.shares_pass``), then runs
one decode step for every slot that is generating, all of them in one
forward pass (:meth:`moecache.engine.Engine.decode`: one token per sequence, the matrix products
and the routed experts shared, attention per sequence). A request joins or leaves between steps,
and a long prompt costs the others one chunk per step, not the whole prompt. A job's
``cancelled`` flag (the client left, the server stops) is checked before it starts and at every
step; a cancelled job frees its slot at once.
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

from moecache.server.metrics import Histogram
from moecache.server.schemas import ApiError, GenRequest
from moecache.server.stops import StopMatcher


SYNC_STREAM_WAIT_S = 0.005  # the most a step waits for the loop to stream the last one's text (sync_stream)


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

    def __init__(self, ids: list[int], gen: GenRequest, loop: asyncio.AbstractEventLoop | None):
        self.ids = ids
        self.gen = gen
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.on_cancel: Callable[[], None] | None = None  # told once, at the first cancel (the engine's process)
        self.n_decoded = 0
        self.checked_at = time.monotonic()  # when the route last saw its client connected

    def emit(self, kind: str, value: Any) -> None:
        """Hand an event to the client's loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    def cancel(self) -> None:
        """Stop this job at its next token (or before it starts)."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel()


def _deliver(items: list[tuple[Job, str]], streamed: threading.Event | None = None) -> None:
    """In the loop: each job's text piece into its queue, in order; then, with ``streamed``, set it
    once the loop has run what that woke (the streaming tasks' steps, queued before it: two turns
    of the loop later)."""
    for job, piece in items:
        job.events.put_nowait(("text", piece))
    if streamed is not None:
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, streamed.set)


def emit_texts(items: list[tuple[Job, str]], streamed: threading.Event | None = None) -> bool:
    """Hand a step's text pieces to their loops, one wake-up per loop (from the worker thread):
    woken once per step rather than once per token, the loop's streaming contends less with the
    worker for the GIL (``bench/serve_overhead.py``). A closed loop cancels its jobs. With
    ``streamed`` (one loop only), the loop sets it after streaming them. Returns whether it will."""
    by_loop: dict[int, list[tuple[Job, str]]] = {}
    for it in items:
        by_loop.setdefault(id(it[0].loop), []).append(it)
    tell = streamed if len(by_loop) == 1 else None
    for group in by_loop.values():
        try:
            group[0][0].loop.call_soon_threadsafe(_deliver, group, tell)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            tell = None
            for job, _ in group:
                job.cancel()
    return tell is not None


@dataclass(frozen=True)
class WorkerStatus:
    """What ``/slots`` and ``/metrics`` show of a worker, at one moment (picklable).

    Attributes:
        n_waiting: jobs admitted and not in a slot yet; n_processing: jobs in slots.
        slots: llama-server's ``/slots`` rows (id, n_ctx, is_processing, n_decoded, n_prompt_tokens).
        decode: (decode forward passes, the tokens they decoded).
        engine_s: seconds inside the engine's (decode, prompt) calls, each call once.
        caches: a copy of each GPU expert cache's :class:`moecache.moe.cache.CacheStats`.
        decode_pass: each decode pass's seconds inside the engine.
        between_passes: the worker's seconds from a decode pass's end to the start of the next pass
            that continues a slot of it (sampling, streaming, admitting, other slots' prompt chunks):
            with ``decode_pass``, where a stream's time per output token went.
    """

    n_waiting: int
    n_processing: int
    slots: list[dict[str, Any]]
    decode: tuple[int, int]
    engine_s: tuple[float, float]
    caches: list[Any]
    decode_pass: Histogram = field(default_factory=Histogram)
    between_passes: Histogram = field(default_factory=Histogram)


@dataclass
class _Run:
    """A job in a slot: its sequence, sampler, text stream and counters (the worker thread's own)."""

    job: Job
    slot: int
    kv: Any
    sampler: Any
    stream: Any
    stops: StopMatcher
    left: list[int]  # prompt ids not evaluated yet
    before: list[tuple[int, int, int]]  # the caches' (hits, misses, uploads) when it started
    logprobs: list[TokenLogprob] | None
    n_top: int = 0
    parts: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # per kept token: characters of decoded text before it
    decoded: int = 0
    tokens: list[int] = field(default_factory=list)
    next_tok: int | None = None  # sampled, to be evaluated at the next decode step
    t_prompt: float = 0.0
    t_gen: float = 0.0  # perf_counter when the prompt was in (the generation's wall time starts)
    t_eval: float = 0.0  # the decode forward passes it took part in
    n_eval: int = 0
    last_pass: int = -1  # the number of the last decode pass it took part in (Worker.decode_steps then)


class Worker:
    """Runs jobs on ``llm`` (a :class:`moecache.llm.LLM`) in ``n_parallel`` slots, in its own thread
    (the module docstring says how steps are made).

    Args:
        llm: the loaded model.
        n_parallel: ``-np``: slots, each with ``n_ctx // n_parallel`` positions of the KV cache; as
            many more jobs may wait for a slot, :meth:`submit` refuses beyond (503).
        on_done: called in the worker thread with (job, Result) after each finished job (metrics).
        log: one line per unexpected error (stderr).
        merge_prompts: several slots' prompt chunks of a step go to ``Engine.eval_seqs`` together
            (False: each slot's to ``Engine.eval``, a pass each, as before the thirty-third session;
            for benchmarks).
        sync_stream: at the end of each step, wait until the event loop has streamed the step's
            text before the next step begins (at most ``SYNC_STREAM_WAIT_S``; one loop only), so
            that the loop's Python does not run during the engine's step (a stream's first token,
            read through ``asyncio.wait_for``, is written a turn later). Off by default: an experiment
            (``bench/serve_overhead.py --real --sync-stream``) of whether the loop's hold of the GIL
            during a step slows it (one stream's decode call measured 7.5% slower inside the
            server than alone, run ``h200-s33b``); not measured yet.
        deliver: sends a step's text pieces (:func:`emit_texts`'s signature and return value; the
            engine's process gives one that writes them to the server's process).
    """

    def __init__(self, llm, n_parallel: int, on_done: Callable[[Job, Result], None], log: Callable[[str], None],
                 merge_prompts: bool = True, sync_stream: bool = False,
                 deliver: Callable[[list[tuple[Job, str]], threading.Event | None], bool] = emit_texts):
        self.llm = llm
        self.n_parallel = n_parallel
        self.merge_prompts = merge_prompts
        self.sync_stream = sync_stream
        self.deliver = deliver
        self.on_done = on_done
        self.log = log
        self.stopping = threading.Event()
        if n_parallel > llm.engine.n_ctx:
            raise ValueError(f"-np {n_parallel}: more slots than the context's {llm.engine.n_ctx} positions (-c)")
        self.seqs = llm.engine.sequences(n_parallel)
        self.runs: list[_Run | None] = [None] * n_parallel
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._turn = 0  # the slot whose prompt goes next (slots take turns)
        self._texts: list[tuple[Job, str]] = []  # text pieces sampled, not sent yet (see _send_texts)
        self.decode_steps = 0  # decode forward passes, and the tokens they decoded (batch size = ratio)
        self.decode_tokens = 0
        self.decode_seconds = 0.0  # wall time in the engine's decode calls
        self.prompt_seconds = 0.0  # wall time in the engine's prompt calls (each once, however many slots)
        self.decode_pass = Histogram()  # each decode call's wall time
        self.between_passes = Histogram()  # from a decode call's end to the next call that continues a slot of it
        self._pass_end = 0.0  # perf_counter at the last decode call's end
        self._thread = threading.Thread(target=self._run, name="moecache-engine", daemon=True)
        self._thread.start()

    @property
    def n_ctx_slot(self) -> int:
        """Positions of each slot's sequence."""
        return self.seqs[0].n_ctx

    @property
    def n_waiting(self) -> int:
        """Jobs admitted and not in a slot yet."""
        return self._waiting

    @property
    def n_processing(self) -> int:
        """Jobs in slots."""
        return sum(r is not None for r in self.runs)

    def slots(self) -> list[dict[str, Any]]:
        """llama-server's ``/slots``: per slot its id, context, whether it is busy, its tokens so far."""
        out = []
        for i, r in enumerate(list(self.runs)):
            out.append({"id": i, "n_ctx": self.n_ctx_slot, "is_processing": r is not None,
                        "n_decoded": r.job.n_decoded if r is not None else 0,
                        "n_prompt_tokens": len(r.job.ids) if r is not None else 0})
        return out

    def status(self) -> WorkerStatus:
        """A snapshot for ``/slots`` and ``/metrics`` (from any thread; counters read as they are)."""
        return WorkerStatus(self.n_waiting, self.n_processing, self.slots(), (self.decode_steps, self.decode_tokens),
                            (self.decode_seconds, self.prompt_seconds),
                            [replace(c.stats) for c in self.llm.engine.caches], self.decode_pass.copy(),
                            self.between_passes.copy())

    def submit(self, job: Job) -> None:
        """Queue ``job``; ApiError 503 when the server stops or the queue is full."""
        with self._lock:  # the worker admits and drains under it too: a job is counted exactly once
            if self.stopping.is_set() or not self._thread.is_alive():
                raise ApiError(503, "the server is shutting down")
            if self._waiting + self.n_processing >= 2 * self.n_parallel:  # the slots, and as many waiting
                raise ApiError(503, f"the server is busy: {self.n_processing} requests run and {self._waiting} "
                                    f"wait for a slot (-np {self.n_parallel})")
            self._waiting += 1
            self._q.put(job)

    def cancel_all(self) -> None:
        """Stop taking jobs and cancel the running ones at their next step (a shutdown's first move:
        their clients get what was generated)."""
        self.stopping.set()
        for r in list(self.runs):
            if r is not None:
                r.job.cancel()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every job (running and waiting) and end the thread."""
        self.cancel_all()
        self._q.put(None)
        self._thread.join(timeout)

    def alive(self) -> bool:
        """Whether the engine's thread is still running (a :meth:`stop` that timed out)."""
        return self._thread.is_alive()

    def close_model(self) -> None:
        """After :meth:`stop`: close the model; its hot set is dropped, not saved, when a generation
        still ran (the stop timed out)."""
        if self.alive():
            self.llm.drop_hot_set("a generation was still running at shutdown")
        self.llm.close()

    # ---- the engine's thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                if not self._admit():
                    break
                self._step()
        except Exception as e:  # a bug of the scheduler itself: stop serving, answer everyone
            self.log(f"error: the engine's thread failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            with self._lock:
                self.stopping.set()
            for r in self.runs:
                if r is not None:
                    try:
                        self._finish(r, "cancelled")
                    except Exception:  # noqa: BLE001 - the client still gets its answer below
                        self._fail(r, ApiError(500, "the engine's thread stopped"))
            while True:  # shutting down: say so to whoever still waits
                try:
                    job = self._q.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit("error", ApiError(503, "the server is shutting down"))

    def _admit(self) -> bool:
        """Move waiting jobs into free slots (waiting for one when every slot is idle); False when
        the thread must end."""
        while None in self.runs:
            idle = all(r is None for r in self.runs)
            try:
                job = self._q.get() if idle else self._q.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            slot = self.runs.index(None)  # the lowest free slot: a lone request keeps slot 0 (its CUDA graph)
            run, err = None, None
            if job.cancelled.is_set() or self.stopping.is_set():
                err = ApiError(503, "the request was cancelled before it started")
            else:
                try:
                    run = self._start(job, slot)
                except ApiError as e:
                    err = e
                except Exception as e:  # one request's failure must not end the server
                    self.log(f"error: request failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                    err = ApiError(500, f"generation failed: {type(e).__name__}: {str(e)[:300]}")
            with self._lock:  # waiting -> running at once, as submit counts them
                self._waiting -= 1
                self.runs[slot] = run
            if err is not None:
                job.emit("error", err)
        return True

    def _start(self, job: Job, slot: int) -> _Run:
        from moecache.sampling import Sampler

        eng = self.llm.engine
        kv = self.seqs[slot]
        if len(job.ids) >= kv.n_ctx:
            raise ApiError(400, f"the prompt is {len(job.ids)} tokens, a slot holds {kv.n_ctx} (-c {eng.n_ctx} over "
                                f"-np {self.n_parallel}): nothing left to generate into")
        kv.clear()
        sampler = Sampler(job.gen.sampling, kv.n_ctx, banned=eng.tokenizer.eog_ids if job.gen.ignore_eos else ())
        before = [(c.stats.hits, c.stats.misses, c.stats.uploads) for c in eng.caches]
        lps = [] if job.gen.logprobs is not None else None
        return _Run(job, slot, kv, sampler, eng.tokenizer.streamer(skip_special=True), StopMatcher(job.gen.stop),
                    list(job.ids), before, lps, job.gen.logprobs or 0)

    def _step(self) -> None:
        """Prompt chunks (at most ``-ub`` tokens in all, slots in turn; several slots' in one pass
        where ``Engine.shares_pass`` says so, else a pass each, each first token sent after its own
        pass), then one decode step of every generating slot."""
        for r in self.runs:
            if r is not None and (r.job.cancelled.is_set() or self.stopping.is_set()):
                self._guarded([r], lambda: self._finish(r, "cancelled"))
        # prompt chunks, slots in turn, until this step's -ub tokens are used (at least one chunk)
        prompting = sorted((r for r in self.runs if r is not None and r.left),
                           key=lambda x: (x.slot - self._turn) % self.n_parallel)
        budget = self.llm.engine.n_ubatch
        chunks: list[tuple[_Run, int]] = []
        for r in prompting:
            if budget <= 0:
                break
            n = min(len(r.left), budget)
            budget -= n
            self._turn = (r.slot + 1) % self.n_parallel
            chunks.append((r, n))
        if len(chunks) > 1 and self.merge_prompts and self.llm.engine.shares_pass([n for _, n in chunks]):
            self._guarded([r for r, _ in chunks], lambda: self._prompt_chunks(chunks))
        else:
            for r, n in chunks:
                self._guarded([r], lambda: self._prompt_chunk(r, n))
        ready = [r for r in self.runs if r is not None and r.next_tok is not None]
        if ready:
            self._guarded(ready, lambda: self._decode(ready))
        self._send_texts(wait=self.sync_stream)

    def _send_texts(self, wait: bool = False) -> None:
        """Send the text pieces sampled since the last call: at the end of a step (every slot's token
        of its decode pass: a slot's text waits for the other slots' sampling, ~10 µs each when
        greedy), after a prompt's first token, and before a job's end or error. With ``wait`` (the
        step's end under ``sync_stream``), wait up to ``SYNC_STREAM_WAIT_S`` until the loop has
        streamed them."""
        if self._texts:
            items, self._texts = self._texts, []
            streamed = threading.Event() if wait else None
            if self.deliver(items, streamed) and streamed is not None:
                streamed.wait(SYNC_STREAM_WAIT_S)

    def _guarded(self, runs: list[_Run], work: Callable[[], None]) -> None:
        """Run ``work``; a failure ends ``runs`` with an error (the server goes on)."""
        from moecache.kv_cache import ContextFullError

        try:
            work()
        except ContextFullError as e:
            for r in runs:
                self._fail(r, ApiError(400, str(e)))
        except ApiError as e:
            for r in runs:
                self._fail(r, e)
        except Exception as e:  # a request's failure must not end the server
            self.log(f"error: request failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            for r in runs:
                self._fail(r, ApiError(500, f"generation failed: {type(e).__name__}: {str(e)[:300]}"))

    def _prompt_chunk(self, r: _Run, n: int) -> None:
        """The next ``n`` prompt tokens of ``r``; after the last, its first token."""
        import numpy as np

        eng = self.llm.engine
        part, r.left = r.left[:n], r.left[n:]
        t0 = time.perf_counter()
        try:
            lg = eng.eval(part, logits=np.array([], np.int64) if r.left else "last", kv=r.kv)  # logits at the end only
        finally:
            dt = time.perf_counter() - t0
            self.prompt_seconds += dt
        r.t_prompt += dt
        if not r.left:
            self._prompt_done(r, lg[-1])

    def _prompt_chunks(self, chunks: list[tuple[_Run, int]]) -> None:
        """The next prompt tokens of several runs (``n`` each) in one forward pass
        (:meth:`moecache.engine.Engine.eval_seqs`); each run whose prompt is in takes its first
        token. The pass's time counts in each run's prompt time, as each waited for all of it. A
        run whose logits are not finite fails alone."""
        from moecache.errors import NonFiniteError

        parts = []
        for r, n in chunks:
            parts.append(r.left[:n])
            r.left = r.left[n:]
        t0 = time.perf_counter()
        bad: list[int] = []
        try:
            lg = self.llm.engine.eval_seqs(parts, [r.kv for r, _ in chunks])
        except NonFiniteError as e:
            if not hasattr(e, "rows"):
                raise
            lg, bad = e.logits, e.rows
        finally:
            dt = time.perf_counter() - t0
            self.prompt_seconds += dt
        for j, (r, _) in enumerate(chunks):
            r.t_prompt += dt
            if j in bad:
                self._fail(r, ApiError(500, "generation failed: the model computed non-finite logits (NaN or inf) "
                                            "for this prompt"))
            elif not r.left:
                self._guarded([r], lambda r=r, j=j: self._prompt_done(r, lg[j]))

    def _prompt_done(self, r: _Run, logits: Any) -> None:
        """``r``'s whole prompt is in (``logits``: its last token's): its first token."""
        for tok in r.job.ids:
            r.sampler.accept(tok)
        r.t_gen = time.perf_counter()
        if r.job.gen.max_tokens == 0:
            return self._finish(r, "length")
        self._take(r, logits)
        self._send_texts()  # the first token goes out now, not after the other slots' prompt chunks

    def _decode(self, ready: list[_Run]) -> None:
        """One forward pass for every generating slot; a sequence whose logits are not finite fails
        alone, and each slot's sampling and streaming is guarded on its own."""
        from moecache.errors import NonFiniteError

        t0 = time.perf_counter()
        if any(r.last_pass == self.decode_steps for r in ready):  # a slot of the last pass goes on
            self.between_passes.observe(t0 - self._pass_end)
        bad: list[int] = []
        try:
            lg = self.llm.engine.decode([r.next_tok for r in ready], [r.kv for r in ready])
        except NonFiniteError as e:
            if not hasattr(e, "rows"):
                raise
            lg, bad = e.logits, e.rows
            for i in bad:
                self._fail(ready[i], ApiError(500, f"generation failed: {str(e)[:300]}"))
        self._pass_end = time.perf_counter()
        dt = self._pass_end - t0
        self.decode_steps += 1
        self.decode_tokens += len(ready)
        self.decode_seconds += dt
        self.decode_pass.observe(dt)
        for i, r in enumerate(ready):
            if i in bad:
                continue
            r.last_pass = self.decode_steps
            r.t_eval += dt
            r.n_eval += 1
            r.next_tok = None
            self._guarded([r], lambda: self._take(r, lg[i]))

    def _take(self, r: _Run, logits: Any) -> None:
        """Sample the next token from ``logits``, stream its text, and end the run or queue the
        token for the next decode step (the rules of :meth:`moecache.engine.Engine.generate`)."""
        tok = r.sampler.sample(logits)
        r.sampler.accept(tok)
        if r.logprobs is not None:
            r.logprobs.append(token_logprob(logits, tok, r.n_top))
        if self.llm.engine.tokenizer.is_eog(tok):
            return self._finish(r, "eog")
        r.tokens.append(tok)
        r.job.n_decoded += 1
        if r.job.cancelled.is_set() or self.stopping.is_set():
            return self._finish(r, "cancelled")
        raw = r.stream.push(tok)
        r.offsets.append(r.decoded)
        r.decoded += len(raw)
        piece = r.stops.push(raw)
        if piece:
            r.parts.append(piece)
            self._texts.append((r.job, piece))
        if r.stops.hit is not None:
            return self._finish(r, "stop")
        n = r.job.gen.max_tokens
        if n >= 0 and len(r.tokens) >= n:
            return self._finish(r, "length")
        if r.kv.n_past >= r.kv.n_ctx:
            return self._finish(r, "context")
        r.next_tok = tok

    def _free(self, r: _Run) -> None:
        if self.runs[r.slot] is r:
            self.runs[r.slot] = None
        r.kv.clear()

    def _fail(self, r: _Run, e: ApiError) -> None:
        self._send_texts()  # its text so far goes first
        self._free(r)
        r.job.emit("error", e)

    def _finish(self, r: _Run, stop: str) -> None:
        """End ``r`` (its slot freed at once) and send its :class:`Result`."""
        from moecache.engine import Timings

        self._send_texts()  # its text so far goes first
        self._free(r)
        if stop != "cancelled":
            tail = r.stops.push(r.stream.flush()) + r.stops.flush()
            if tail:
                r.parts.append(tail)
                r.job.emit("text", tail)
        reason = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}.get(stop, "cancelled")
        eng = self.llm.engine
        cache = []
        for c, (h, m, u) in zip(eng.caches, r.before):
            c.flush()
            cache.append({"hits": c.stats.hits - h, "misses": c.stats.misses - m, "uploads": c.stats.uploads - u})
        text = "".join(r.parts)
        logprobs = r.logprobs
        if logprobs is not None:
            del logprobs[len(r.tokens):]  # an end-of-generation token was sampled but not kept
            logprobs = [replace(lp, offset=o) for lp, o in zip(logprobs, r.offsets)]
            if r.stops.hit is not None:  # the tokens of the stop string are not the client's text
                logprobs = [lp for lp in logprobs if lp.offset < len(text)]
        timings = Timings(n_prompt=len(r.job.ids), t_prompt=r.t_prompt, n_gen=len(r.tokens), n_eval=r.n_eval,
                          t_eval=r.t_eval)
        predicted_s = time.perf_counter() - r.t_gen if r.t_gen else 0.0  # wall time from the first token's logits
        res = Result(text, len(r.tokens), reason, timings, predicted_s, cache, logprobs)
        try:
            self.on_done(r.job, res)
        except Exception as e:  # pragma: no cover - metrics must never break serving
            self.log(f"error: metrics: {e}")
        r.job.emit("done", res)
