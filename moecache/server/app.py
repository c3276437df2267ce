"""The HTTP routes (Starlette): llama-server's endpoints, OpenAI's shapes.

Every route answers JSON; an error is ``{"error": {"message", "type", "code"}}`` with a 4xx/5xx
status, and nothing a request sends can end the server (each handler's exception becomes a 500).
Prompts are rendered and tokenized in the request's thread (under a lock: a chat template's sandbox
keeps state), so a prompt too long for the context is a 400 before it queues; the engine runs in
:class:`moecache.server.worker.Worker`'s thread, in this process or in a process of its own
(:class:`moecache.server.engine_process.EngineProcess`, the same interface).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from moecache.server.metrics import Metrics
from moecache.server.schemas import (MAX_BODY_BYTES, ApiError, GenRequest, bad, get_bool, parse_gen, parse_json,
                                     parse_messages, parse_prompt, timings_object)
from moecache.server.worker import Job, Result, WorkerStatus

POLL_S = 0.25  # how often a waiting request checks that its client is still there


@dataclass(frozen=True)
class ModelInfo:
    """What the routes show of the loaded model: its file, its size in bytes, the context it was
    trained for (``n_ctx_train``) and the server's ``-c`` (``n_ctx``, every slot's together)."""

    path: str
    n_bytes: int
    n_ctx_train: int
    n_ctx: int

    @classmethod
    def of(cls, gguf: Any, n_ctx: int) -> ModelInfo:
        """From an opened GGUF (:class:`moecache.gguf_file.GGUFModel`) and the resolved ``-c``."""
        return cls(str(gguf.path), gguf.n_bytes, gguf.config.context_length, n_ctx)


@dataclass
class ServerState:
    """What the routes share. ``worker``/``tokenizer``/``template``/``info`` are None while the model
    loads (``worker`` is set last: the routes take it for ready).

    Attributes:
        model_id: the name /v1/models and responses give (``--alias`` or the file name).
        api_key: ``--api-key`` (None: no key needed).
        n_parallel: ``-np``: slots (requests decoded together, each with ``-c / -np`` positions); as
            many more may wait for one.
        defaults: the server's :class:`moecache.sampling.SamplingParams` (the sampling flags).
        max_tokens: the default ``max_tokens`` (``-n``; -1 = until the end or a full context).
        body_timeout_s: seconds a request's body may take to arrive (``--timeout``), else 408.
    """

    model_id: str
    api_key: str | None
    n_parallel: int
    defaults: Any
    max_tokens: int = -1
    body_timeout_s: float = 600.0
    worker: Any = None  # a Worker, or an EngineProcess
    tokenizer: Any = None
    template: Any = None
    info: ModelInfo | None = None
    metrics: Metrics = field(default_factory=Metrics)
    prep_lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.time)


def logprobs_object(lps: Any, chat: bool, tok: Any) -> dict | None:
    """OpenAI's ``logprobs`` of a choice from the worker's :class:`TokenLogprob` list (None: not
    asked for). Chat: ``{"content": [{token, logprob, bytes, top_logprobs}]}``; completions:
    ``{tokens, token_logprobs, top_logprobs, text_offset}`` (``text_offset`` counts characters of
    the completion's text, from 0). A token's text is its bytes decoded as UTF-8 (a partial
    character shows as U+FFFD; ``bytes`` has the exact bytes)."""
    if lps is None:
        return None

    def piece(i: int) -> tuple[str, list[int]]:
        b = tok.token_bytes(i)
        return b.decode("utf-8", errors="replace"), list(b)

    if chat:
        content = []
        for lp in lps:
            text, raw = piece(lp.token)
            top = [{"token": piece(i)[0], "logprob": v, "bytes": piece(i)[1]} for i, v in lp.top]
            content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}
    tops = []
    for lp in lps:
        top: dict[str, float] = {}
        for i, v in lp.top:  # most likely first: a text two ids share keeps the likelier's value
            top.setdefault(piece(i)[0], v)
        if lp.top:
            top.setdefault(piece(lp.token)[0], lp.logprob)  # the sampled token is always there (OpenAI)
        tops.append(top)
    return {"tokens": [piece(lp.token)[0] for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": tops, "text_offset": [lp.offset for lp in lps]}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, ensure_ascii=False), status_code=status, media_type="application/json")


async def read_json(request: Request, timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object, at most :data:`MAX_BODY_BYTES` (413 beyond), in full within
    ``timeout_s`` seconds (408 beyond); 499 when the client went away meanwhile."""
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
            chunks.append(chunk)
    try:
        await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive in full within {timeout_s:g} s (--timeout)") from None
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected") from None
    return parse_json(b"".join(chunks))


def build_app(state: ServerState) -> Starlette:
    """The ASGI app over ``state`` (see the module docstring for the endpoints)."""

    def ready() -> None:
        if state.worker is None:
            raise ApiError(503, "Loading model")

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            try:
                if state.api_key is not None and request.url.path not in ("/health", "/v1/health"):
                    if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                        raise ApiError(401, "Invalid API Key")
                return await handler(request)
            except ApiError as e:
                if e.status >= 400 and e.status != 499 and request.url.path.endswith("completions"):
                    state.metrics.count("rejected" if e.status == 503 else "error")
                return error_response(e)
            except Exception as e:  # a bug must cost one request, not the server
                import traceback

                traceback.print_exc()
                return error_response(ApiError(500, f"internal error: {type(e).__name__}: {str(e)[:300]}"))
        return endpoint

    async def health(request: Request) -> Response:
        ready()
        if not state.worker.alive():
            raise ApiError(500, "the engine has stopped: restart the server")
        return _json({"status": "ok"})

    async def models(request: Request) -> Response:
        meta = {}
        if state.worker is not None:
            info = state.info
            meta = {"n_vocab": state.tokenizer.n_vocab, "n_ctx_train": info.n_ctx_train, "n_ctx": info.n_ctx,
                    "size": info.n_bytes}
        return _json({"object": "list", "data": [{"id": state.model_id, "object": "model", "created": int(state.started),
                                                  "owned_by": "moecache", "meta": meta}]})

    async def props(request: Request) -> Response:
        ready()
        return _json({"default_generation_settings": {**asdict(state.defaults), "n_ctx": state.worker.n_ctx_slot,
                                                      "n_predict": state.max_tokens},
                      "total_slots": state.n_parallel, "model_path": state.info.path, "model_alias": state.model_id,
                      "chat_template": state.template.name, "chat_template_source": state.template.source,
                      "build_info": "moecache",
                      "batching": "continuous: the slots' decode steps run as one forward pass"})

    async def slots(request: Request) -> Response:
        ready()
        st = await run_in_threadpool(state.worker.status)
        return _json([{**slot, "queued": st.n_waiting} for slot in st.slots])

    async def metrics(request: Request) -> Response:
        ready()
        try:
            st = await run_in_threadpool(state.worker.status)
        except ApiError:
            if state.worker.alive():  # slow to answer: a 503, not counters that look reset
                raise
            st = WorkerStatus(0, 0, [], (0, 0), (0.0, 0.0), [])  # the engine has ended: the HTTP side's counters
        text = state.metrics.render(st)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def tokenize(request: Request) -> Response:
        ready()
        d = await read_json(request, state.body_timeout_s)
        content = d.get("content")
        if not isinstance(content, str):
            raise bad("'content' must be a string", "content")
        add_special = get_bool(d, "add_special", False)
        tok = state.tokenizer
        ids = await run_in_threadpool(tok.encode, content, None if add_special else False)
        if get_bool(d, "with_pieces", False):
            return _json({"tokens": [{"id": i, "piece": tok.token_bytes(i).decode("utf-8", "replace")} for i in ids]})
        return _json({"tokens": ids})

    async def detokenize(request: Request) -> Response:
        ready()
        d = await read_json(request, state.body_timeout_s)
        ids = d.get("tokens")
        n = state.tokenizer.n_vocab
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                                for i in ids):
            raise bad(f"'tokens' must be a list of token ids in [0, {n})", "tokens")
        return _json({"content": state.tokenizer.decode(ids)})

    def prepare(prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        """Prompt ids (rendered with the chat template for messages); 400 when they do not fit (a
        text far too long for a slot before it is tokenized: its bytes over the longest token's)."""
        tok, n_ctx = state.tokenizer, state.info.n_ctx
        n_slot = state.worker.n_ctx_slot

        def too_long(text: str) -> None:
            floor = len(text.encode("utf-8")) // tok.max_token_bytes
            if floor >= 2 * n_slot:
                raise bad(f"the prompt is at least {floor} tokens, a slot's context is {n_slot} (-c {n_ctx} "
                          f"over -np {state.n_parallel})", "prompt")
        if isinstance(prompt, str):
            too_long(prompt)
        with state.prep_lock:
            if messages is not None:
                try:
                    prompt = state.template.render(messages, add_generation_prompt=True)
                except ValueError as e:
                    raise bad(f"the chat template failed on these messages: {str(e)[:300]}", "messages") from None
                too_long(prompt)
            ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad("the prompt is empty", "prompt")
        if len(ids) >= n_slot:
            raise bad(f"the prompt is {len(ids)} tokens, a slot's context is {n_slot} (-c {n_ctx} over "
                      f"-np {state.n_parallel}): nothing left to generate into", "prompt")
        return ids

    async def next_event(job: Job, request: Request) -> tuple[str, Any]:
        """The job's next event; cancels it when the client has gone meanwhile (checked at least
        every POLL_S, also while events keep coming: a non-streamed answer sends nothing until it
        ends, so only this check frees the slot of a client that left)."""
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), POLL_S)
            except asyncio.TimeoutError:
                ev = None
            now = time.monotonic()
            if ev is None or now - job.checked_at >= POLL_S:
                job.checked_at = now
                if await request.is_disconnected():
                    job.cancel()
                    raise ApiError(499, "the client disconnected")
            if ev is not None:
                return ev

    async def completion(request: Request, chat: bool) -> Response:
        ready()
        d = await read_json(request, state.body_timeout_s)
        if chat:
            messages, prompt = parse_messages(d), None
        else:
            messages, prompt = None, parse_prompt(d, state.tokenizer.n_vocab)
        gen = parse_gen(d, state.defaults, state.max_tokens, chat=chat)
        ids = await run_in_threadpool(prepare, prompt, messages)
        room = state.worker.n_ctx_slot - len(ids)
        if gen.max_tokens < 0 or gen.max_tokens > room:
            gen = replace(gen, max_tokens=room)
        job = Job(ids, gen, asyncio.get_running_loop())
        state.worker.submit(job)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        try:
            first = await next_event(job, request)
        except BaseException:
            job.cancel()
            raise
        if first[0] == "error":
            raise first[1]
        if gen.stream:
            return SSEResponse(_stream(job, request, first, chat, ident, created, gen), job)
        parts = []
        ev = first
        try:
            while ev[0] == "text":
                parts.append(ev[1])
                ev = await next_event(job, request)
        except BaseException:
            job.cancel()
            raise
        if ev[0] == "error":
            raise ev[1]
        res: Result = ev[1]
        choice: dict[str, Any] = {"index": 0, "finish_reason": res.finish_reason,
                                  "logprobs": logprobs_object(res.logprobs, chat, state.tokenizer)}
        if chat:
            choice["message"] = {"role": "assistant", "content": res.text}
        else:
            choice["text"] = res.text
        return _json({"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                      "model": state.model_id, "choices": [choice], "usage": _usage(len(ids), res),
                      "timings": timings_object(res.timings, res.predicted_s),
                      **({"moe_cache": res.cache} if res.cache else {})})

    async def _stream(job: Job, request: Request, first, chat: bool, ident: str, created: int, gen: GenRequest):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, extra: dict | None = None, role: bool = False,
                  logprobs: Any = None) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            body = {"id": ident, "object": obj, "created": created, "model": state.model_id, "choices": [choice],
                    **(extra or {})}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

        try:
            if chat:
                yield chunk("", None, role=True)
            ev = first
            while ev[0] == "text":
                yield chunk(ev[1], None)
                ev = await job.events.get()
            if ev[0] == "error":
                yield f"data: {json.dumps(ev[1].body())}\n\n".encode()
                return
            res: Result = ev[1]
            extra = {"timings": timings_object(res.timings, res.predicted_s),
                     **({"moe_cache": res.cache} if res.cache else {})}
            if gen.include_usage:
                extra["usage"] = _usage(len(job.ids), res)
            # the tokens' log-probabilities come whole with the last chunk (stop strings hold text
            # back, so text chunks and tokens do not line up)
            yield chunk(None, res.finish_reason, extra,
                        logprobs=logprobs_object(res.logprobs, chat, state.tokenizer))
            yield b"data: [DONE]\n\n"
        finally:
            job.cancel()  # a client that left stops its generation at the next token

    async def chat_completions(request: Request) -> Response:
        return await completion(request, True)

    async def completions(request: Request) -> Response:
        return await completion(request, False)

    routes = [("/health", health, ["GET"]), ("/v1/health", health, ["GET"]), ("/v1/models", models, ["GET"]),
              ("/models", models, ["GET"]), ("/props", props, ["GET"]), ("/slots", slots, ["GET"]),
              ("/metrics", metrics, ["GET"]), ("/tokenize", tokenize, ["POST"]), ("/detokenize", detokenize, ["POST"]),
              ("/v1/chat/completions", chat_completions, ["POST"]), ("/chat/completions", chat_completions, ["POST"]),
              ("/v1/completions", completions, ["POST"]), ("/completions", completions, ["POST"])]
    app = Starlette(routes=[Route(p, guarded(h), methods=m) for p, h, m in routes],
                    exception_handlers={404: _not_found, 405: _not_allowed})
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, f"no such endpoint: {request.url.path}"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))


def _usage(n_prompt: int, res: Result) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": res.n_tokens, "total_tokens": n_prompt + res.n_tokens}


class SSEResponse(StreamingResponse):
    """Server-sent events whose job is cancelled however the response ends (done, the client gone,
    the server stopping)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
