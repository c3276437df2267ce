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
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moecache.errors import MoecacheError
from moecache.server.schemas import ApiError
from moecache.server.worker import Job, Result, Worker, WorkerStatus, emit_texts

STATUS_TIMEOUT_S = 10.0  # the most /slots and /metrics wait for the engine's process to answer
STOP_TIMEOUT_S = 30.0  # the most stop() waits for the engine's process to end (it saves the hot set)


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

    :meth:`start` loads the model (blocks until it is ready); until then, and after the child has
    ended, :meth:`submit` answers 503.
    """

    def __init__(self, path: Path, settings: Any, n_parallel: int, on_done: Callable[[Job, Result], None],
                 verbose: bool = False):
        import multiprocessing

        self.n_parallel = n_parallel
        self.on_done = on_done
        self.stopping = threading.Event()
        self.n_ctx = 0
        self.n_ctx_slot = 0
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the jobs map, and the admission count
        self._send_lock = threading.Lock()
        self._queries: dict[int, list] = {}  # qid -> [Event, WorkerStatus | None]
        self._ended = threading.Event()  # the reader saw the pipe close (or "stopped")
        self._reader: threading.Thread | None = None
        ctx = multiprocessing.get_context("spawn")
        self._conn, self._child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=child_main, args=(self._child_conn, str(path), settings, n_parallel, verbose),
                                 name="moecache-engine", daemon=True)

    # ---- lifetime --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the child and wait until its model is loaded. Raises EngineProcessError with the
        child's one-line reason when it failed (or ended without one)."""
        if self.stopping.is_set():
            raise EngineProcessError("the server stopped before the model was loaded")
        self._proc.start()
        self._child_conn.close()  # the child's end lives in the child only: its exit closes the pipe here
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            self._ended.set()
            raise EngineProcessError(f"the engine's process ended while loading the model (exit code "
                                     f"{self._proc.exitcode})") from None
        if msg[0] != "ready":
            self._proc.join(STOP_TIMEOUT_S)
            self._ended.set()
            raise EngineProcessError(msg[1])
        _, self.n_ctx, self.n_ctx_slot = msg
        self._reader = threading.Thread(target=self._read, name="moecache-engine-pipe", daemon=True)
        self._reader.start()

    def cancel_all(self) -> None:
        """Stop taking jobs and cancel the running ones at their next step."""
        self.stopping.set()
        self._post(("cancel_all",))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel every job and end the child (which stops its worker and closes the model); killed
        after ``timeout`` seconds. Safe before :meth:`start` has returned (a load in progress is
        ended) and more than once."""
        self.stopping.set()
        if self._proc.pid is None:  # never started
            return
        if self._reader is None:  # still loading: nothing to finish
            self._proc.terminate()
        else:
            self._post(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def alive(self) -> bool:
        """Whether the child still runs."""
        return self._proc.is_alive()

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
        when the child does not answer."""
        qid = next(self._ids)
        q: list = [threading.Event(), None]
        self._queries[qid] = q
        if not self._post(("status", qid)) or not q[0].wait(STATUS_TIMEOUT_S) or q[1] is None:
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
        error (the child ended without answering it)."""
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "texts":
                    jobs = self._jobs
                    emit_texts([(jobs[jid], piece) for jid, piece in msg[1] if jid in jobs])
                elif msg[0] == "end":
                    _, jid, kind, value = msg
                    with self._lock:
                        job = self._jobs.pop(jid, None)
                    if job is None:
                        continue
                    if kind == "done":
                        job.n_decoded = value.n_tokens
                        try:
                            self.on_done(job, value)
                        except Exception:  # noqa: BLE001 - metrics must never break serving
                            pass
                    job.emit(kind, value)
                elif msg[0] == "status":
                    q = self._queries.pop(msg[1], None)
                    if q is not None:
                        q[1] = msg[2]
                        q[0].set()
                elif msg[0] == "stopped":
                    break
        except (EOFError, OSError):
            pass
        finally:
            self._ended.set()
            with self._lock:
                left, self._jobs = list(self._jobs.values()), {}
            if not self.stopping.is_set():
                self._proc.join(1.0)  # its exit code
            why = (ApiError(503, "the server is shutting down") if self.stopping.is_set()
                   else ApiError(500, f"the engine's process ended (exit code {self._proc.exitcode})"))
            for job in left:
                job.emit("error", why)
            for q in list(self._queries.values()):
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
    the module docstring) until ``("stop",)`` or the pipe closes; then stop the worker, close the
    model (its hot set saved, as in-process) and say ``("stopped",)``."""
    import signal
    import traceback

    from moecache.cli.common import load_engine, note

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        try:
            with lock:
                conn.send(msg)
        except (OSError, ValueError):  # the server's process is gone: the reader below ends us
            pass

    loaded: dict[str, Any] = {}

    def load() -> None:
        try:
            loaded["llm"] = load_engine(Path(path), settings, "serve", verbose)
        except BaseException as e:  # noqa: BLE001 - every failure is one line for the server to print
            line, expected = _one_line(e)
            if not expected:  # a bug: its traceback too, as the CLI would show it
                traceback.print_exc()
            loaded["failed"] = line

    # The load runs Numba's parallel kernels, and GNU OpenMP keeps a team of threads for each thread
    # that opened a parallel region, for as long as that thread lives. Loaded on this (main) thread,
    # its team would stay beside the worker thread's, and with more OpenMP threads than cores libgomp
    # cuts the spinning of idle threads (moecache.threads.one_thread_if_active): every CPU expert call
    # would wake sleeping threads. So the load gets a thread that ends, as in-process serve's does.
    loader = threading.Thread(target=load, name="moecache-load")
    loader.start()
    loader.join()
    if "llm" not in loaded:
        send(("failed", loaded.get("failed", "the engine's process failed while loading")))
        return
    llm = loaded["llm"]
    jobs: dict[int, _ChildJob] = {}

    def deliver(items: list[tuple[Job, str]], streamed: threading.Event | None = None) -> bool:
        send(("texts", [(job.jid, piece) for job, piece in items]))
        return False

    try:
        worker = Worker(llm, n_parallel, lambda job, res: None, note, deliver=deliver)
    except ValueError as e:
        send(("failed", str(e)))
        llm.close()
        return
    send(("ready", llm.engine.n_ctx, worker.n_ctx_slot))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
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
                break
    finally:
        worker.stop()
        if worker.alive():
            llm.drop_hot_set("a generation was still running at shutdown")
        llm.close()
        send(("stopped",))


def _one_line(e: BaseException) -> tuple[str, bool]:
    """The ``error:`` line the CLI prints for ``e`` (``moecache.cli.main._user_errors``' rules), and
    whether ``e`` is one of the errors those rules expect (else its traceback is worth printing)."""
    from moecache.cli.common import UserError

    if isinstance(e, MemoryError):
        from moecache.cli.main import out_of_memory

        return out_of_memory(e), True
    if isinstance(e, (UserError, MoecacheError, ValueError, OSError)):
        return str(e), True
    return f"the engine's process failed while loading: {type(e).__name__}: {str(e)[:300]}", False
