"""``moecache serve``: start the HTTP server at once (``/health`` says 503 while the model loads),
load the model in a thread (with ``--engine-process``, in a process of its own:
:mod:`moecache.server.engine_process`), then serve until SIGINT/SIGTERM (uvicorn's graceful shutdown;
running generations are cancelled at their next token; exit 0)."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moecache.cli.common import UserError, load_engine, note, resolve_model


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """The parsed ``serve`` flags other than the engine's and the sampler's settings."""

    model: Path | None
    host: str = "127.0.0.1"
    port: int = 8080
    n_parallel: int = 4
    api_key: str | None = None
    alias: str | None = None
    n_predict: int = -1
    chat_template: str | None = None
    verbose: bool = False
    timeout: float = 600.0
    engine_process: bool = False


def serve_command(opts: ServeOptions, settings, sampling) -> None:
    """Run the server; returns when it has stopped. Raises UserError when the model cannot load."""
    import uvicorn

    from moecache.cli.run import check_chat_template_name
    from moecache.server.app import ServerState, build_app

    try:
        sampling.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    check_chat_template_name(opts.chat_template)
    if opts.api_key is not None and not opts.api_key:
        raise UserError("--api-key is empty")
    if opts.api_key is None and os.environ.get("MOECACHE_API_KEY") == "":
        raise UserError("MOECACHE_API_KEY is set but empty: unset it to serve without a key, or give a key")
    path = resolve_model(opts.model)
    if not path.is_file():
        raise UserError(f"{path}: " + ("not a file (it is a directory)" if path.is_dir() else "no such file"))
    state = ServerState(model_id=opts.alias or path.name, api_key=opts.api_key, n_parallel=opts.n_parallel,
                        defaults=sampling, max_tokens=opts.n_predict, body_timeout_s=opts.timeout)
    config = uvicorn.Config(build_app(state), host=opts.host, port=opts.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5, lifespan="off")
    try:
        sock = config.bind_socket()  # before the (possibly long) load: a port in use fails at once
    except SystemExit:
        raise UserError(f"cannot listen on {opts.host}:{opts.port} (see the line above: the port in use, or an "
                        f"address that is not this machine's?)") from None
    server = make_server(config, state)
    failed: list[BaseException] = []
    held = _Held()

    def done(job, res) -> None:
        state.metrics.done(res.timings.n_prompt, res.timings.t_prompt, res.n_tokens, res.predicted_s,
                           res.finish_reason == "cancelled")

    def load() -> None:
        try:
            worker = (load_process if opts.engine_process else load_here)()
            if opts.n_parallel > 1:
                note(f"note: -c {state.info.n_ctx} is split over -np {opts.n_parallel} slots: a request holds up to "
                     f"{worker.n_ctx_slot} positions (llama-server's split without a unified KV cache; -np 1 gives "
                     f"one request all of it)")
            state.worker = worker
            note(f"server: ready: model {state.model_id}, {opts.n_parallel} slot(s) of {worker.n_ctx_slot} positions "
                 f"decoded together (-np, -c {state.info.n_ctx}), up to {opts.n_parallel} more waiting"
                 f"{', API key required' if opts.api_key else ''}")
        except BaseException as e:
            if not (opts.engine_process and server.should_exit):  # not the stop of a load in progress
                failed.append(e)
            server.should_exit = True

    def template(gguf, tok):
        from moecache.chat import resolve_chat_template

        tmpl = resolve_chat_template(gguf, tok, opts.chat_template)
        note(f"chat template: {tmpl.name} ({tmpl.source})")
        return tmpl

    def load_here():
        """The model in this process, the worker in a thread."""
        from moecache.server.app import ModelInfo
        from moecache.server.worker import Worker

        llm = load_engine(path, settings, "serve", opts.verbose)
        held.llm = llm
        eng = llm.engine
        tmpl = template(eng.gguf, eng.tokenizer)
        worker = Worker(llm, opts.n_parallel, done, note)
        held.worker = worker
        state.tokenizer, state.template, state.info = eng.tokenizer, tmpl, ModelInfo.of(eng.gguf, eng.n_ctx)
        return worker

    def load_process():
        """The tokenizer and the chat template here (from the GGUF's metadata), the model and the
        worker in the engine's process."""
        from moecache.gguf_file import open_gguf
        from moecache.server.app import ModelInfo
        from moecache.tokenizer import Tokenizer

        proc = held.proc
        gguf = open_gguf(path)
        try:
            tok = Tokenizer.from_gguf(gguf)
            tmpl = template(gguf, tok)
            proc.start()
            state.tokenizer, state.template, state.info = tok, tmpl, ModelInfo.of(gguf, proc.n_ctx)
        finally:
            gguf.close()
        return proc

    if opts.engine_process:  # made here, before any signal is handled: no shutdown can miss it
        from moecache.server.engine_process import EngineProcess

        held.proc = EngineProcess(path, settings, opts.n_parallel, done, opts.verbose, log=note)
    loader = threading.Thread(target=load, name="moecache-load", daemon=True)
    # uvicorn re-raises the signal it caught after its graceful shutdown, to the handler it found:
    # ours only asks the server to stop (done by then), so that the stop is clean (exit 0); a signal
    # before uvicorn has put its own handlers in place (from the line below on) stops the server as
    # soon as it runs
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    note(f"server: listening on http://{opts.host}:{opts.port} (loading the model; /health says 503 until ready)")
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal while closing ends the process
            signal.signal(sig, signal.SIG_DFL)
        held.close(loader)
    if failed:
        raise failed[0]
    note("server: stopped")


@dataclass
class _Held:
    """What the load made that the shutdown closes: the model and the worker's thread (in-process),
    or the engine's process."""

    llm: Any = None
    worker: Any = None
    proc: Any = None

    def close(self, loader: threading.Thread) -> None:
        """Stop the engine's process (it closes its own model; a load in progress is ended), or the
        worker and then the model, whose hot set is saved unless a generation still ran."""
        if self.proc is not None:
            self.proc.stop()
        if self.worker is not None:
            self.worker.stop()
        loader.join(timeout=1.0)
        if self.worker is not None:
            self.worker.close_model()
        elif self.llm is not None:  # loaded, no worker made
            self.llm.close()


def make_server(config, state):
    """uvicorn's server, whose signal handler also cancels the running generations."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.worker is not None:
                state.worker.cancel_all()
            super().handle_exit(sig, frame)
    return Server(config)
