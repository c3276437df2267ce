"""The serve worker in a process of its own, so that the HTTP server's Python and the engine's never
wait for each other's GIL.

In one process the event loop (HTTP, SSE: starlette's and uvicorn's Python, ~0.2 ms of CPU a
streamed token) and the engine's thread take turns at the GIL; a decode step's host work (the graph's
launch, the answers to the GPU's CPU experts, the cache's accounting) waits while the loop holds it,
and the GPU waits with it. Here the model loads and :class:`moecache.server.worker.Worker` runs in a
child process (``multiprocessing``'s spawn: CUDA does not survive a fork), and the server's process
keeps the HTTP routes, the tokenizer and the chat template. Requests go to the child and each step's
text comes back over one pipe.

:class:`EngineProcess` is the server's side, with the Worker's interface (``submit``, ``status``,
``n_ctx_slot``, ``cancel_all``, ``stop``, ``alive``); :func:`child_main` is the child's.

Messages (pickled tuples), to the child: ``("job", jid, ids, gen)``, ``("cancel", jid)``,
``("cancel_all",)``, ``("status", qid)``, ``("stop",)``. From it: ``("ready", n_ctx, n_ctx_slot)`` or
``("failed", line)`` once, then ``("texts", [(jid, piece), ...])`` (a step's text pieces, in order),
``("end", jid, kind, value)`` (a job's ``"done"`` Result or ``"error"`` ApiError), ``("status", qid,
WorkerStatus)``, and ``("stopped",)`` last. The child ignores SIGINT and SIGTERM (the server's process
decides when it stops) and stops by itself when the pipe closes (the server's process is gone).
"""

from __future__ import annotations

import itertools
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moecache.errors import MoecacheError
from moecache.server.schemas import ApiError
from moecache.server.worker import Job, Result, Worker, WorkerStatus, emit_texts

STATUS_TIMEOUT_S = 10.0  # the most /slots and /metrics wait for the engine's process to answer
STOP_TIMEOUT_S = 30.0  # the most stop() waits for the engine's process to end (it saves the hot set)
POLL_S = 1.0  # how often the child, idle, checks that its worker's thread still runs


class EngineProcessError(MoecacheError):
    """The engine's process failed to load the model or ended: ``str()`` is one line to print."""


class EngineProcess:
    """A :class:`moecache.server.worker.Worker` running in a child process (see the module docstring).

    Args:
        path: the GGUF file; settings: the :class:`moecache.settings.Settings` the flags asked for
            (resolved in the child, as ``serve`` resolves them in-process, and printed from there).
        n_parallel: ``-np``; as many more jobs may wait, :meth:`submit` refuses beyond (503).
        on_done: called with (job, Result) after each finished job, in this process (metrics).
        verbose: ``-v`` for the child's load.
        log: one line when the child ends while serving (stderr by default).
        target: the child's function (default :func:`child_main`; a module-level function taking
            the same arguments, for tests).

    :meth:`start` loads the model (blocks until it is ready); until then, and after the child has
    ended, :meth:`submit` answers 503.
    """

    def __init__(self, path: Path, settings: Any, n_parallel: int, on_done: Callable[[Job, Result], None],
                 verbose: bool = False, log: Callable[[str], None] | None = None, target: Callable | None = None):
        import multiprocessing

        self.n_parallel = n_parallel
        self.on_done = on_done
        self.log = log if log is not None else (lambda line: print(line, file=sys.stderr, flush=True))
        self.stopping = threading.Event()
        self.n_ctx = 0
        self.n_ctx_slot = 0
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the jobs and queries maps, and the admission count
        self._send_lock = threading.Lock()
        self._life = threading.Lock()  # start's and stop's moves on the child (a stop never misses it)
        self._queries: dict[int, list] = {}  # qid -> [Event, WorkerStatus | None]
        self._ended = threading.Event()  # the reader saw the pipe close (or "stopped")
        self._reader: threading.Thread | None = None
        ctx = multiprocessing.get_context("spawn")
        self._conn, self._child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=target or child_main, args=(self._child_conn, str(path), settings, n_parallel, verbose),
                                 name="moecache-engine", daemon=True)

    # ---- lifetime --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the child and wait until its model is loaded. Raises EngineProcessError with the
        child's one-line reason when it failed (or ended without one), or when :meth:`stop` came
        first or meanwhile."""
        with self._life:
            if self.stopping.is_set():
                raise EngineProcessError("the server stopped before the model was loaded")
            self._proc.start()
            self._child_conn.close()  # the child's end lives in the child only: its exit closes the pipe here
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            self._gone()
            raise EngineProcessError(f"the engine's process ended while loading the model (exit code "
                                     f"{self._proc.exitcode})") from None
        if msg[0] != "ready":
            self._proc.join(STOP_TIMEOUT_S)
            self._gone()
            raise EngineProcessError(msg[1])
        with self._life:
            if self.stopping.is_set():  # stop() has killed it meanwhile
                self._gone()
                raise EngineProcessError("the server stopped before the model was loaded")
            _, self.n_ctx, self.n_ctx_slot = msg
            self._reader = threading.Thread(target=self._read, name="moecache-engine-pipe", daemon=True)
            self._reader.start()

    def cancel_all(self) -> None:
        """Stop taking jobs and cancel the running ones at their next step. Safe in a signal handler
        (uvicorn's, on the event loop's thread, which may be inside a send): the message goes from a
        thread of its own."""
        self.stopping.set()
        threading.Thread(target=self._post, args=(("cancel_all",),), name="moecache-cancel", daemon=True).start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel every job and end the child (which stops its worker and closes the model); killed
        after ``timeout`` seconds, or at once while it loads (it ignores SIGTERM; there is nothing to
        finish). Safe before and during :meth:`start` (the child is then never started, or killed) and
        more than once."""
        with self._life:
            self.stopping.set()
            if self._proc.pid is None:  # never started, and start() will not start it now
                self._child_conn.close()
                with self._send_lock:
                    self._conn.close()
                return
            if self._reader is None:  # loading: start() sees the pipe close, and closes our end
                self._proc.kill()
                return
        self._post(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)  # it reads the pipe's end (the child's exit closed it): then close ours
        with self._send_lock:  # no send in flight on a descriptor number being reused
            self._conn.close()

    def _gone(self) -> None:
        """start()'s end without a child: the pipe closed, the engine ended."""
        self._ended.set()
        with self._send_lock:
            self._conn.close()

    def alive(self) -> bool:
        """Whether the child still runs its engine (its process and the pipe's reader: the child ends
        when its worker's thread does)."""
        return self._proc.is_alive() and not self._ended.is_set()

    # ---- the Worker's interface ------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Send ``job`` to the child; ApiError 503 when the server stops, the child has ended, or
        ``-np`` jobs run and as many wait."""
        with self._lock:
            if self.stopping.is_set() or self._reader is None:
                raise ApiError(503, "the server is shutting down")
            if self._ended.is_set():
                raise ApiError(503, f"the engine's process has ended (exit code {self._proc.exitcode}): restart "
                                    f"the server")
            if len(self._jobs) >= 2 * self.n_parallel:  # the slots, and as many waiting
                raise ApiError(503, f"the server is busy: {len(self._jobs)} requests run or wait for a slot "
                                    f"(-np {self.n_parallel})")
            jid = next(self._ids)
            self._jobs[jid] = job
        if not self._post(("job", jid, job.ids, job.gen)):
            with self._lock:
                self._jobs.pop(jid, None)
            raise ApiError(503, "the engine's process has ended: restart the server")
        job.on_cancel = lambda: self._post(("cancel", jid))
        if job.cancelled.is_set():  # cancelled before on_cancel was there
            self._post(("cancel", jid))

    def status(self) -> WorkerStatus:
        """The child's worker's :class:`WorkerStatus` (waits up to STATUS_TIMEOUT_S); ApiError 503
        when the child has ended or does not answer."""
        if self._ended.is_set():
            raise ApiError(503, f"the engine's process has ended (exit code {self._proc.exitcode}): restart the "
                                f"server")
        q: list = [threading.Event(), None]
        with self._lock:
            qid = next(self._ids)
            self._queries[qid] = q
        if not self._post(("status", qid)) or not q[0].wait(STATUS_TIMEOUT_S) or q[1] is None:
            with self._lock:
                self._queries.pop(qid, None)
            raise ApiError(503, "the engine's process did not answer")
        return q[1]

    # ---- the pipe --------------------------------------------------------------------------------------
    def _post(self, msg: tuple) -> bool:
        """Send ``msg`` to the child; False when the pipe is closed."""
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError):  # closed, or the child is gone
            return False

    def _read(self) -> None:
        """The child's messages, in order, until the pipe closes; then every job still waiting gets an
        error (the child ended without answering it). A failure handling one message is printed and
        the next one read (its job's client would wait forever otherwise); one reading the pipe
        ends the reading as a closed pipe does."""
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "stopped":
                    break
                try:
                    self._handle(msg)
                except Exception:  # noqa: BLE001 - a bug here must cost one message, not every client
                    traceback.print_exc()
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - e.g. a message that does not unpickle: the pipe is not read again
            traceback.print_exc()
        finally:
            self._ended.set()
            with self._lock:
                left, self._jobs = list(self._jobs.values()), {}
                queries, self._queries = list(self._queries.values()), {}
            if not self.stopping.is_set():
                self._proc.join(1.0)  # its exit code
                self.log(f"error: the engine's process ended (exit code {self._proc.exitcode}) while serving: "
                         f"{len(left)} request(s) failed, new ones get 503 and /health 500; restart the server")
            why = (ApiError(503, "the server is shutting down") if self.stopping.is_set()
                   else ApiError(500, f"the engine's process ended (exit code {self._proc.exitcode})"))
            for job in left:
                job.emit("error", why)
            for q in queries:
                q[0].set()

    def _handle(self, msg: tuple) -> None:
        """One message of the child (other than "stopped")."""
        if msg[0] == "texts":
            with self._lock:
                items = [(self._jobs[jid], piece) for jid, piece in msg[1] if jid in self._jobs]
            emit_texts(items)
        elif msg[0] == "end":
            _, jid, kind, value = msg
            with self._lock:
                job = self._jobs.pop(jid, None)
            if job is None:
                return
            if kind == "done":
                job.n_decoded = value.n_tokens
                try:
                    self.on_done(job, value)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    traceback.print_exc()
            job.emit(kind, value)
        elif msg[0] == "status":
            with self._lock:
                q = self._queries.pop(msg[1], None)
            if q is not None:
                q[1] = msg[2]
                q[0].set()


class _ChildJob(Job):
    """A job in the child: its events go down the pipe (``send``) instead of to an event loop."""

    def __init__(self, jid: int, ids: list[int], gen: Any, send: Callable[[tuple], None], jobs: dict):
        super().__init__(ids, gen, None)
        self.jid = jid
        self._send = send
        self._jobs = jobs

    def emit(self, kind: str, value: Any) -> None:
        if kind == "text":
            self._send(("texts", [(self.jid, value)]))
            return
        self._jobs.pop(self.jid, None)
        self._send(("end", self.jid, kind, value))


def child_main(conn, path: str, settings: Any, n_parallel: int, verbose: bool) -> None:
    """The engine's process: load the model as ``serve`` does, run a Worker, answer the pipe (see
    the module docstring) until ``("stop",)``, the pipe closes or the worker's thread ends; then
    stop the worker, close the model (its hot set saved, as in-process) and say ``("stopped",)``."""
    import signal

    from moecache.cli.common import note

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        try:
            with lock:
                conn.send(msg)
        except (OSError, ValueError):  # the server's process is gone: the reader below ends us
            pass

    llm, failed = _load_on_a_thread(Path(path), settings, verbose)
    if llm is None:
        send(("failed", failed))
        return

    def deliver(items: list[tuple[Job, str]], streamed: threading.Event | None = None) -> bool:
        send(("texts", [(job.jid, piece) for job, piece in items]))
        return False

    try:
        worker = Worker(llm, n_parallel, lambda job, res: None, note, deliver=deliver)
    except BaseException as e:  # noqa: BLE001 - as the load's failures
        send(("failed", _one_line(e, print_bug=True)))
        llm.close()
        return
    send(("ready", llm.engine.n_ctx, worker.n_ctx_slot))
    try:
        _answer(conn, worker, send)
    finally:
        worker.stop()
        worker.close_model()
        send(("stopped",))


def _load_on_a_thread(path: Path, settings: Any, verbose: bool) -> tuple[Any, str]:
    """``serve``'s load (:func:`moecache.cli.common.load_engine`) on a thread that ends before the
    worker starts: (the LLM, "") or (None, the one line of its failure).

    The load runs Numba's parallel kernels, and GNU OpenMP keeps a team of threads for each thread
    that opened a parallel region, for as long as that thread lives. Loaded on the child's main
    thread (which lives on, reading the pipe), that team would stay beside the worker thread's; with
    more OpenMP threads than CPUs libgomp lets an idle thread spin only 1000 times before it sleeps
    (its ``GOMP_SPINCOUNT`` documentation), so CPU expert calls would wake sleeping threads
    (``bench/results/serve-engine-process-2core.md``). In-process ``serve`` loads on such a thread too."""
    from moecache.cli import common

    out: list = [None, "the engine's process failed while loading"]

    def load() -> None:
        try:
            out[0] = common.load_engine(path, settings, "serve", verbose)
        except BaseException as e:  # noqa: BLE001 - every failure is one line for the server to print
            out[1] = _one_line(e, print_bug=True)
    t = threading.Thread(target=load, name="moecache-load")
    t.start()
    t.join()
    return out[0], ("" if out[0] is not None else out[1])


def _answer(conn, worker: Worker, send: Callable[[tuple], None]) -> None:
    """The child's side of the pipe (see the module docstring) until ``("stop",)``, the pipe closes,
    or the worker's thread has ended (a failure of its own: it answered its jobs, and the server's
    process then sees the pipe close)."""
    jobs: dict[int, _ChildJob] = {}
    while worker.alive():
        try:
            if not conn.poll(POLL_S):
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        op = msg[0]
        if op == "job":
            _, jid, ids, gen = msg
            job = _ChildJob(jid, ids, gen, send, jobs)
            jobs[jid] = job
            try:
                worker.submit(job)
            except ApiError as e:
                job.emit("error", e)
        elif op == "cancel":
            job = jobs.get(msg[1])
            if job is not None:
                job.cancel()
        elif op == "cancel_all":
            worker.cancel_all()
        elif op == "status":
            send(("status", msg[1], worker.status()))
        elif op == "stop":
            return


def _one_line(e: BaseException, print_bug: bool = False) -> str:
    """The ``error:`` line the CLI prints for ``e`` (:func:`moecache.cli.common.error_line`); an error
    the CLI would show with its traceback (a bug) gets a line naming it, and with ``print_bug`` its
    traceback too."""
    from moecache.cli.common import error_line

    line = error_line(e)
    if line is not None:
        return line
    if print_bug:
        traceback.print_exc()
    return f"the engine's process failed while loading: {type(e).__name__}: {str(e)[:300]}"
