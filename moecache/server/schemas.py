"""Request bodies -> checked parameters, and the OpenAI-style error object.

Plain checks, no framework: each known field is type-checked (a wrong type is a 400 naming the
field); unknown fields are ignored, as OpenAI's clients send extras. Sampling fields a request leaves
out take the server's defaults (the ``serve`` flags, as llama-server does).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused (413)
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request that gets an error response: ``{"error": {"message", "type", "code"}}``.

    Attributes:
        status: the HTTP status; message: one line for the client; type: OpenAI's error type.
    """

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 500: "server_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or self.TYPES.get(status, "invalid_request_error")
        self.param = param

    def __reduce__(self):  # pickled whole (the engine's process sends it to the server's)
        return (type(self), (self.status, self.message, self.type, self.param))

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "code": self.status, "param": self.param}}


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; ApiError 400 when it is not one (NaN/Infinity refused)."""
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise bad(f"the request body must be a JSON object, not {type(data).__name__}")
    try:  # a "\\udc80" escape parses to a lone UTF-16 surrogate: a str that is not Unicode text
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"the request body holds a lone UTF-16 surrogate escape ({e.object[e.start:e.end]!a}): "
                  "not valid Unicode text") from None
    return data


# ---- typed field getters ------------------------------------------------------------------------

def get_bool(d: dict, key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return v


def _range(lo: float | None, hi: float | None) -> str:
    """``[lo, hi]``, or ``>= lo`` / ``<= hi`` for an open end."""
    return f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"


def get_int(d: dict, key: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"'{key}' must be an integer", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"'{key}' must be {_range(lo, hi)}, got {v}", key)
    return v


def get_float(d: dict, key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise bad(f"'{key}' must be a finite number", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"'{key}' must be {_range(lo, hi)}, got {v}", key)
    return float(v)


def get_str(d: dict, key: str, default: str | None = None) -> str | None:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(f"'{key}' must be a string", key)
    return v


# ---- completion requests ------------------------------------------------------------------------

@dataclass(frozen=True)
class GenRequest:
    """One completion request's generation settings.

    Attributes:
        max_tokens: most tokens to generate (-1: until the end of generation or a full context).
        sampling: a :class:`moecache.sampling.SamplingParams` (the server's defaults overridden).
        stop: stop strings (the text ends before the first one; ``finish_reason`` "stop").
        stream: answer as server-sent events.
        include_usage: ``stream_options.include_usage``: a last chunk carries ``usage``.
        ignore_eos: llama-server's ``ignore_eos``: end-of-generation tokens are never sampled.
        logprobs: None (off), or how many most likely alternatives to return with each generated
            token's log-probability (chat: ``logprobs: true`` + ``top_logprobs`` 0-20;
            completions: ``logprobs`` 0-20).
    """

    max_tokens: int
    sampling: Any
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    logprobs: int | None = None


MAX_TOP_LOGPROBS = 20  # OpenAI's limit of top_logprobs


def parse_logprobs(d: dict, chat: bool) -> int | None:
    """``logprobs`` / ``top_logprobs`` as OpenAI defines them for chat (a boolean, then 0-20
    alternatives) and for completions (0-20 alternatives); None when not asked for."""
    lp, top = d.get("logprobs"), d.get("top_logprobs")
    if chat:
        if lp is None or lp is False:
            if top not in (None, 0):
                raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        if lp is not True:
            raise bad("'logprobs' must be a boolean", "logprobs")
        return get_int(d, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if lp is None or lp is False:
        return None
    if isinstance(lp, bool):
        raise bad(f"'logprobs' must be an integer 0-{MAX_TOP_LOGPROBS}", "logprobs")
    return get_int(d, "logprobs", None, 0, MAX_TOP_LOGPROBS)


def parse_gen(d: dict, defaults: Any, default_max_tokens: int, *, chat: bool) -> GenRequest:
    """The generation fields of chat (``chat``) and completions (OpenAI's names, plus llama-server's
    ``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``n_predict``, ``ignore_eos``)."""
    from moecache.sampling import DEFAULT_SEED

    logprobs = parse_logprobs(d, chat)
    if get_int(d, "n", 1, 1) != 1:
        raise bad("'n' must be 1: one choice per request", "n")
    max_tokens = get_int(d, "max_completion_tokens", None, -1)
    if max_tokens is None:
        max_tokens = get_int(d, "max_tokens", None, -1)
    if max_tokens is None:
        max_tokens = get_int(d, "n_predict", default_max_tokens, -1)
    stop = d.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"'stop': at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    seed = get_int(d, "seed", -1, None, None)
    seed = DEFAULT_SEED if seed is None or seed < 0 else seed
    if seed > 0xFFFFFFFF:
        raise bad("'seed' must be at most 4294967295", "seed")
    sp = replace(defaults,
                 temp=get_float(d, "temperature", defaults.temp, 0.0, 100.0),
                 top_p=get_float(d, "top_p", defaults.top_p, 0.0, 1.0),
                 top_k=get_int(d, "top_k", defaults.top_k, 0, 1 << 30),
                 min_p=get_float(d, "min_p", defaults.min_p, 0.0, 1.0),
                 presence_penalty=get_float(d, "presence_penalty", defaults.presence_penalty, -2.0, 2.0),
                 frequency_penalty=get_float(d, "frequency_penalty", defaults.frequency_penalty, -2.0, 2.0),
                 repeat_penalty=get_float(d, "repeat_penalty", defaults.repeat_penalty, 1e-6, 100.0),
                 repeat_last_n=get_int(d, "repeat_last_n", defaults.repeat_last_n, -1, 1 << 30),
                 seed=seed if "seed" in d and d["seed"] is not None else defaults.seed)
    unsupported(d)
    opts = d.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return GenRequest(max_tokens, sp, stops, get_bool(d, "stream", False),
                      get_bool(opts or {}, "include_usage", False), get_bool(d, "ignore_eos", False), logprobs)


# request fields of OpenAI's API (or llama-server's) that would change what is generated and that
# moecache does not implement: a request that uses them gets a 400, never a result that ignored them
UNSUPPORTED = {
    "logit_bias": lambda v: bool(v),  # {} and null change nothing
    "response_format": lambda v: not (v is None or (isinstance(v, dict) and v.get("type", "text") == "text")),
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "grammar": lambda v: bool(v),
    "json_schema": lambda v: bool(v),
    "echo": lambda v: v not in (None, False),
    "suffix": lambda v: bool(v),
    "best_of": lambda v: v not in (None, 1),
}


def unsupported(d: dict) -> None:
    """ApiError 400 when ``d`` uses a field of :data:`UNSUPPORTED` with a value that matters."""
    for key, used in UNSUPPORTED.items():
        if key in d and used(d[key]):
            raise bad(f"'{key}' is not supported by this server (moecache): the request would be answered "
                      "as if it were absent", key)


def parse_messages(d: dict) -> list[dict[str, str]]:
    """``messages`` as the chat template takes them: role and text content (text parts joined);
    ``developer`` becomes ``system``. ApiError 400 for anything else."""
    msgs = d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}", "messages")
        c = m.get("content")
        if c is None:
            text = ""
        elif isinstance(c, str):
            text = c
        elif isinstance(c, list):
            parts = []
            for p in c:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(p["text"])
            text = "".join(parts)
        else:
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def parse_prompt(d: dict, n_vocab: int) -> str | list[int]:
    """``prompt`` of /v1/completions: a string, token ids, or a list holding one of those."""
    p = d.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(not 0 <= t < n_vocab for t in p):
            raise bad(f"'prompt': token ids must be in [0, {n_vocab})", "prompt")
        return list(p)
    raise bad("'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def timings_object(t: Any, predicted_s: float) -> dict[str, Any]:
    """llama-server's ``timings``: prompt and generation counts, milliseconds and rates."""
    pn, pms = t.n_prompt, t.t_prompt * 1e3
    gn, gms = t.n_gen, predicted_s * 1e3
    return {"prompt_n": pn, "prompt_ms": pms, "prompt_per_token_ms": pms / pn if pn else 0.0,
            "prompt_per_second": 1e3 * pn / pms if pms > 0 else 0.0,
            "predicted_n": gn, "predicted_ms": gms, "predicted_per_token_ms": gms / gn if gn else 0.0,
            "predicted_per_second": 1e3 * gn / gms if gms > 0 else 0.0}
