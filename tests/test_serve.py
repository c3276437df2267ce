"""``moecache serve``: the real server in a subprocess on a free port, driven by the openai client
and plain HTTP (code-moe-tiny for the text, the tiny synthetic model for the queue and shutdown)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import require_module
from moecache.server.stops import StopMatcher

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
PROMPT = "def add(a, b):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``moecache serve`` in a subprocess; ``url``, ``proc``, ``stop()``."""

    def __init__(self, model: Path, *flags: str, env: dict[str, str] | None = None):
        self.model = model
        self.key = KEY if "--api-key" in flags else None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moecache.cli.main", "serve", "-m", str(model),
                                      "--port", str(self.port), "-t", "2", *flags],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=None if env is None else {**os.environ, **env})
        self.output: list[str] = []
        self._reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        httpx = require_module("httpx")
        deadline = time.monotonic() + 120
        seen_503 = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise AssertionError(f"serve exited {self.proc.returncode}: {''.join(self.output)}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    break
                seen_503 |= r.status_code == 503
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            self.stop()
            raise AssertionError(f"serve not ready in 120 s: {''.join(self.output)}")
        self.seen_503 = seen_503

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(code_moe_tiny):
    s = Server(code_moe_tiny, "-c", "256", "--api-key", KEY, "-np", "4")
    try:
        yield s
    finally:
        s.stop()


def _http(server, method: str, path: str, key: str | None = KEY, **kw):
    httpx = require_module("httpx")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kw)


def _client(server):
    openai = require_module("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_the_info_endpoints(server):
    assert _http(server, "GET", "/health", key=None).json() == {"status": "ok"}
    models = _http(server, "GET", "/v1/models").json()
    assert models["data"][0]["id"] == "code-moe-tiny.gguf" and models["data"][0]["meta"]["n_ctx"] == 256
    props = _http(server, "GET", "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 64  # per slot
    slots = _http(server, "GET", "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]  # -c 256 over -np 4, as llama-server splits it
    assert slots[0]["n_ctx"] == 64 and slots[0]["is_processing"] is False
    toks = _http(server, "POST", "/tokenize", json={"content": PROMPT}).json()["tokens"]
    assert toks and _http(server, "POST", "/detokenize", json={"tokens": toks}).json()["content"] == PROMPT
    metrics = _http(server, "GET", "/metrics")
    assert metrics.status_code == 200 and "moecache:tokens_predicted_total" in metrics.text


def test_greedy_text_equals_run_json(server, code_moe_tiny):
    """The same greedy tokens as ``moecache run -p ... --temp 0 --json`` (same -c, -n), streamed or not."""
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "run", "-m", str(code_moe_tiny), "-p", PROMPT,
                        "-n", "12", "--temp", "0", "--json", "-c", "256", "-t", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    client = _client(server)
    out = client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == cli["text"]
    assert out.usage.completion_tokens == len(cli["tokens"]) and out.usage.prompt_tokens == cli["prompt_tokens"]
    assert out.choices[0].finish_reason == ("length" if cli["stop"] == "length" else "stop")
    timings = out.model_extra["timings"]
    assert timings["prompt_n"] == cli["prompt_tokens"] and timings["predicted_n"] == len(cli["tokens"])
    assert timings["predicted_per_second"] > 0 and timings["prompt_per_token_ms"] > 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert streamed == cli["text"]


def test_chat_streamed_and_not(server):
    client = _client(server)
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "add two numbers"}]
    out = client.chat.completions.create(model="x", messages=msgs, max_tokens=10, temperature=0, seed=1)
    text = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens <= 10 and text
    chunks = list(client.chat.completions.create(model="x", messages=msgs, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and chunks[-1].usage.completion_tokens >= 1
    # sampled with a seed: the same seed, the same text
    kw = dict(model="x", messages=msgs, max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
              presence_penalty=0.5, frequency_penalty=0.5)
    a, b = (client.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    assert a == b


def test_stop_strings_end_the_text(server):
    client = _client(server)
    full = client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full[3:6]
    assert stop.strip()
    cut = full[:full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0,
                                                    stop=[stop, "never"], stream=True))
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            c = client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop).choices[0]
            text, reason = c.text, c.finish_reason
        assert (text, reason) == (cut, "stop")


def test_logprobs_are_the_models_log_softmax(server, code_moe_tiny):
    """``logprobs`` of /v1/completions and /v1/chat/completions: each generated token's log-probability
    and its most likely alternatives. The first token's against the library's own logits of the same
    prompt, log-softmax computed here in float64; greedy: the chosen token is the first alternative."""
    import moecache

    client = _client(server)
    out = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0
    with moecache.load(code_moe_tiny, n_ctx=256, n_threads=2) as llm:
        logits = llm.engine.eval(llm.tokenize(PROMPT))[-1].astype(np.float64)
        tok = llm.engine.tokenizer
        m = logits.max()
        ref = logits - (m + np.log(np.exp(logits - m).sum()))
        best = np.argsort(-ref, kind="stable")[:3]
        first = tok.token_bytes(int(best[0])).decode("utf-8", errors="replace")
    assert lp.tokens[0] == first and abs(lp.token_logprobs[0] - ref[best[0]]) < 1e-4
    alts = lp.top_logprobs[0]
    assert list(alts) == [tok.token_bytes(int(i)).decode("utf-8", errors="replace") for i in best]
    np.testing.assert_allclose(list(alts.values()), ref[best], atol=1e-4)
    for lps, chosen in zip(lp.top_logprobs, lp.token_logprobs):  # greedy: the chosen is the most likely
        vals = list(lps.values())
        assert vals == sorted(vals, reverse=True) and abs(vals[0] - chosen) < 1e-9 and chosen <= 0

    msgs = [{"role": "user", "content": "add two numbers"}]
    chat = client.chat.completions.create(model="x", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    streamed = [ch for ch in client.chat.completions.create(model="x", messages=msgs, max_tokens=5, temperature=0,
                                                            logprobs=True, stream=True)]
    got = [c for ch in streamed if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 6)) for c in got] == [(c.token, round(c.logprob, 6)) for c in content]
    plain = client.chat.completions.create(model="x", messages=msgs, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None
    # a stop string: only the tokens whose text the client gets (the one that straddles the cut stays)
    full = client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1)
    stop = full.choices[0].text[3:6]
    cut = client.completions.create(model="x", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1, stop=stop)
    text, lpc = cut.choices[0].text, cut.choices[0].logprobs
    assert text == full.choices[0].text[:full.choices[0].text.index(stop)]
    assert lpc.text_offset == full.choices[0].logprobs.text_offset[:len(lpc.text_offset)]
    assert all(o < len(text) for o in lpc.text_offset) and "".join(lpc.tokens).startswith(text)
    assert len(lpc.tokens) < len(full.choices[0].logprobs.tokens)
    for alts, chosen in zip(lpc.top_logprobs, lpc.tokens):  # the sampled token is among its alternatives
        assert chosen in alts


def test_concurrent_clients_all_complete(server):
    client = _client(server)
    results, errors = [], []

    def one(i: int) -> None:
        try:
            out = client.chat.completions.create(model="x", messages=[{"role": "user", "content": f"count to {i}"}],
                                                 max_tokens=6, temperature=0)
            results.append(out.choices[0].message.content)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 4


@pytest.mark.parametrize("path,body,key,status,words", [
    ("/v1/chat/completions", b"{not json", KEY, 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", KEY, 400, "JSON object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', KEY, 400, "role"),
    ("/v1/chat/completions", b'{"messages": []}', KEY, 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}', KEY, 400,
     "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', KEY, 400,
     "JSON"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}', KEY, 400,
     "boolean"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', KEY, 400,
     "needs 'logprobs': true"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
     b'"top_logprobs": 21}', KEY, 400, "top_logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": true}', KEY, 400, "integer"),
    ("/v1/completions", b'{"prompt": 5}', KEY, 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, 99999999]}', KEY, 400, "token ids"),
    ("/v1/completions", json.dumps({"prompt": "word " * 400}).encode(), KEY, 400, "context"),
    ("/v1/completions", json.dumps({"prompt": "x" * 100000}).encode(), KEY, 400, "at least"),  # not tokenized
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x" * 100000}]}).encode(), KEY, 400,
     "at least"),
    ("/v1/completions", b'{"prompt": "hi", "stop": [1]}', KEY, 400, "stop"),
    ("/v1/completions", b'{"prompt": "hi"}', None, 401, "API Key"),
    ("/v1/completions", b'{"prompt": "hi"}', "wrong", 401, "API Key"),
    ("/v1/nothing", b"{}", KEY, 404, "no such endpoint"),
    ("/tokenize", b'{"content": 3}', KEY, 400, "content"),
    ("/tokenize", b'{"content": "\\ud800"}', KEY, 400, "surrogate"),
    ("/v1/completions", b'{"prompt": "\\udc80abc"}', KEY, 400, "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', KEY, 400, "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 100}}', KEY,
     400, "logit_bias"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"response_format": {"type": "json_object"}}', KEY, 400, "response_format"),
    ("/v1/completions", b'{"prompt": "hi", "echo": true}', KEY, 400, "echo"),
    ("/detokenize", b'{"tokens": [-1]}', KEY, 400, "tokens"),
])
def test_bad_requests_get_one_clear_error(server, path, body, key, status, words):
    r = _http(server, "POST", path, key=key, content=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status and err["type"]
    assert _http(server, "GET", "/health").status_code == 200


def test_a_huge_body_is_refused(server):
    r = _http(server, "POST", "/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]


def _metric(server, name: str) -> float:
    for line in _http(server, "GET", "/metrics", key=KEY if server.key else None).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The tiny synthetic model (fast), -np 1; long requests set ignore_eos."""
    from moecache.testing.synth import PRESETS, write_model

    model = tmp_path_factory.mktemp("serve") / "tiny.gguf"
    write_model(model, PRESETS["tiny"], seed=3)
    s = Server(model, "-c", "4096", "-np", "1", "--timeout", "3")
    try:
        yield s
    finally:
        s.stop()


def test_greedy_text_equals_run_json_with_a_space_prefix_vocabulary(tiny_server):
    """The tiny synthetic model's SentencePiece vocabulary adds a space prefix: the generated text
    keeps its leading space (it separates it from the prompt) in both run --json and the server."""
    httpx = require_module("httpx")
    s = tiny_server
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "run", "-m", str(s.model), "-p", "the", "-n", "6",
                        "--temp", "0", "--json", "-c", "4096", "-t", "2"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    out = httpx.post(s.url + "/v1/completions", json={"prompt": "the", "max_tokens": 6, "temperature": 0},
                     timeout=60).json()
    assert out["choices"][0]["text"] == cli["text"] and cli["text"].startswith(" ")


LONG = {"prompt": "hello", "max_tokens": 4000, "temperature": 1.0, "min_p": 0, "stream": True, "ignore_eos": True}


def test_a_client_that_leaves_mid_stream_frees_the_engine(tiny_server):
    httpx = require_module("httpx")
    s = tiny_server
    before = _metric(s, 'moecache:requests_total{outcome="cancelled"}')
    with httpx.stream("POST", s.url + "/v1/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    t0 = time.monotonic()
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert time.monotonic() - t0 < 20
    assert _metric(s, 'moecache:requests_total{outcome="cancelled"}') == before + 1


def test_fields_that_change_nothing_are_accepted(server):
    """An empty logit_bias, a text response_format and echo false are what the server does anyway."""
    r = _http(server, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logit_bias": {},
        "response_format": {"type": "text"}, "echo": False, "tools": []})
    assert r.status_code == 200, r.text
    r = _http(server, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": None,
                                                       "best_of": 1, "response_format": None, "suffix": ""})
    assert r.status_code == 200, r.text


def test_a_client_that_leaves_a_non_streamed_request_frees_the_engine(tiny_server):
    """A non-streamed answer sends nothing until it ends: the route checks the client every
    POLL_S while tokens come, so a client that closed its connection is cancelled, not decoded to
    max_tokens (it used to be counted "ok" after all 4000 tokens)."""
    import socket

    s = tiny_server
    before = _metric(s, 'moecache:requests_total{outcome="cancelled"}')
    body = json.dumps({**LONG, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.5)
    t0 = time.monotonic()
    while _metric(s, 'moecache:requests_total{outcome="cancelled"}') < before + 1:
        assert time.monotonic() - t0 < 20, "the request was not cancelled"
        time.sleep(0.1)
    r = _http(s, "POST", "/v1/completions", key=None, json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_body_that_never_arrives_is_408(tiny_server):
    """A client that announces a body and sends part of it holds no handler for ever (--timeout 3)."""
    import socket

    s = tiny_server
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        reply = b""
        while b"did not arrive" not in reply:  # the headers and the body may come in separate reads
            got = c.recv(4096)
            if not got:
                break
            reply += got
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive" in reply, reply


def test_a_full_queue_is_503_and_sigterm_stops_cleanly(tiny_server):
    """-np 1: one runs, one waits, the third is refused; SIGTERM cancels both and exits 0 in seconds."""
    httpx = require_module("httpx")
    s = tiny_server
    long = LONG
    try:
        first_line = threading.Event()
        ends: list[str] = []

        def streaming() -> None:
            with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=60) as r:
                for line in r.iter_lines():
                    first_line.set()
                    if line:
                        ends.append(line)
        waiting: list[int] = []
        a = threading.Thread(target=streaming)
        a.start()
        assert first_line.wait(30)
        b = threading.Thread(target=lambda: waiting.append(
            httpx.post(s.url + "/v1/completions", json={**long, "stream": False}, timeout=60).status_code))
        b.start()
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/slots").json()[0]["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(20) == 0
        assert time.monotonic() - t0 < 10
        a.join(10)
        b.join(10)
        assert ends and ends[-1] == "data: [DONE]"  # the running stream was ended, not cut
        assert waiting == [503]
        assert "server: stopped" in "".join(s.output)
    finally:
        s.stop()


def test_health_is_503_while_the_model_loads():
    """Before the engine is there: /health and the completions say 503 "Loading model"."""
    require_module("httpx")
    from starlette.testclient import TestClient

    from moecache.sampling import SamplingParams
    from moecache.server.app import ServerState, build_app

    client = TestClient(build_app(ServerState(model_id="m", api_key=None, n_parallel=1, defaults=SamplingParams())))
    for method, path in (("GET", "/health"), ("POST", "/v1/chat/completions"), ("GET", "/metrics")):
        r = client.request(method, path, json={})
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_stop_matcher_holds_back_what_may_start_a_stop_string():
    m = StopMatcher(["END", "xy"])
    assert m.push("abc E") == "abc " and m.push("N") == "" and m.push("D tail") == "" and m.hit == "END"
    m = StopMatcher(["END"])
    assert m.push("E") == "" and m.push("gg") == "Egg" and m.push("EN") == "" and m.flush() == "EN"
    assert StopMatcher().push("any") == "any"


def test_concurrent_clients_are_decoded_together_with_the_same_text(server):
    """8 clients at once on 4 slots (4 run, 4 wait): each gets the greedy text it gets alone, and
    the decode steps carried several sequences each (continuous batching)."""
    client = _client(server)
    prompts = [PROMPT, "class Stack:", "import os\n", "def add(a, b):", "# sort a list", "x = [", "for i in",
               "print("]
    alone = [client.completions.create(model="x", prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts]
    steps0 = _metric(server, "moecache:decode_steps_total")
    tokens0 = _metric(server, "moecache:decode_step_tokens_total")
    out: dict[int, str] = {}

    def one(i: int) -> None:
        out[i] = client.completions.create(model="x", prompt=prompts[i], max_tokens=10, temperature=0).choices[0].text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [out.get(i) for i in range(len(prompts))] == alone
    steps = _metric(server, "moecache:decode_steps_total") - steps0
    tokens = _metric(server, "moecache:decode_step_tokens_total") - tokens0
    assert steps > 0 and tokens / steps > 1.5, (steps, tokens)


def _engine_pid(server_pid: int) -> int:
    """The engine's process: the server's child started by multiprocessing's spawn (not its
    resource tracker)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and "spawn_main" in cmd and "resource_tracker" not in cmd:
            found.append(int(d.name))
    assert len(found) == 1, f"engine processes of {server_pid}: {found}"
    return found[0]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not reaped yet
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_engine_process_ends_with_the_server_and_gives_the_same_text(tmp_path):
    """``--engine-process``: the model runs in a child of the server, which serves the greedy text
    of the default server (the engine in a thread of its own process, no such child); a server
    killed with SIGKILL, which cannot clean up, still takes the child down (it reads the closed
    pipe)."""
    from moecache.testing.synth import PRESETS, write_model

    httpx = require_module("httpx")
    model = tmp_path / "tiny.gguf"
    write_model(model, PRESETS["tiny"], seed=3)
    req = {"prompt": "the", "max_tokens": 8, "temperature": 0}
    s = Server(model, "-c", "512", "-np", "2")
    try:
        with pytest.raises(AssertionError, match="engine processes"):
            _engine_pid(s.proc.pid)
        text = httpx.post(s.url + "/v1/completions", json=req, timeout=60).json()["choices"][0]["text"]
    finally:
        s.stop()
    s = Server(model, "-c", "512", "-np", "2", "--engine-process")
    try:
        out = httpx.post(s.url + "/v1/completions", json=req, timeout=60).json()["choices"][0]["text"]
        assert out == text and len(text) > 0
        slots = httpx.get(s.url + "/slots", timeout=10).json()  # the child's worker's status, over the pipe
        assert [x["id"] for x in slots] == [0, 1] and slots[0]["n_ctx"] == 256 and slots[0]["queued"] == 0
        assert _metric(s, 'moecache:requests_total{outcome="ok"}') == 1
        assert _metric(s, "moecache:decode_step_tokens_total") == 7  # 8 tokens: the first from the prompt pass
        assert _metric(s, "moecache:decode_pass_seconds_count") == 7  # the histograms cross the pipe too
        assert _metric(s, "moecache:decode_between_passes_seconds_count") == 6
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "max_tokens": 200}, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")  # then the client leaves: a cancel down the pipe
        deadline = time.monotonic() + 20
        while _metric(s, 'moecache:requests_total{outcome="cancelled"}') < 1:
            assert time.monotonic() < deadline, "the cancel did not reach the engine's process"
            time.sleep(0.05)
        assert httpx.get(s.url + "/slots", timeout=10).json()[0]["is_processing"] is False
        child = _engine_pid(s.proc.pid)
        assert child != s.proc.pid
        s.proc.kill()
        s.proc.wait(10)
        assert _gone(child, 20), "the engine's process outlived its server"
    finally:
        s.stop()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_dead_engine_process_fails_its_requests_and_the_server_stays_up(tmp_path):
    """``--engine-process`` killed mid-stream: the stream ends with a 500 error event, the server's
    log says so in one line, /health says 500, a new request and /slots are a 503 naming the cause,
    /metrics still serves the HTTP side's counters, and SIGTERM still stops the server cleanly."""
    from moecache.testing.synth import PRESETS, write_model

    httpx = require_module("httpx")
    model = tmp_path / "tiny.gguf"
    write_model(model, PRESETS["tiny"], seed=3)
    s = Server(model, "-c", "4096", "-np", "1", "--engine-process")
    try:
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", json=LONG, timeout=60) as r:
            it = r.iter_lines()
            lines.append(next(it))
            os.kill(_engine_pid(s.proc.pid), signal.SIGKILL)
            lines += [ln for ln in it if ln]
        assert lines[0].startswith("data: ") and lines[-1] != "data: [DONE]"
        err = json.loads(lines[-1].removeprefix("data: "))["error"]
        assert err["code"] == 500 and "engine's process ended" in err["message"]
        h = httpx.get(s.url + "/health", timeout=10)
        assert h.status_code == 500 and "engine has stopped" in h.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "engine's process has ended" in r.json()["error"]["message"]
        r = httpx.get(s.url + "/slots", timeout=10)
        assert r.status_code == 503 and "engine's process has ended" in r.json()["error"]["message"]
        assert _metric(s, 'moecache:requests_total{outcome="rejected"}') == 1  # the HTTP side's counters live on
        assert any(ln.startswith("error: the engine's process ended (exit code -9) while serving: 1 request")
                   for ln in s.output), "".join(s.output)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(20) == 0
        assert "server: stopped" in "".join(s.output)
    finally:
        s.stop()


def test_the_engine_process_loads_on_a_thread_that_ends(monkeypatch):
    """The child loads the model on a thread of its own that ends before serving: the load runs
    Numba's parallel kernels, and an OpenMP team opened on the child's main thread (which lives on,
    reading the pipe) would stay beside the worker's, more OpenMP threads than cores, so libgomp
    would let idle threads sleep and every CPU expert call wake them (measured on the 2-core VM,
    ``bench/results/serve-engine-process-2core.md``). A load failure comes back as one line."""
    import multiprocessing

    import moecache.cli.common as common
    from moecache.server.engine_process import child_main

    seen = {}

    def fake_load(*args, **kw):
        seen["thread"] = threading.current_thread()
        raise ValueError("no model here")
    monkeypatch.setattr(common, "load_engine", fake_load)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the child ignores both
    ours, theirs = multiprocessing.Pipe()
    try:
        child_main(theirs, "x.gguf", None, 1, False)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert ours.recv() == ("failed", "no model here")
    assert seen["thread"] is not threading.main_thread() and not seen["thread"].is_alive()


def _tagged(tag: str) -> list[int]:
    """The processes whose environment carries ``MOECACHE_TEST_TAG=tag`` (a server and its children)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"MOECACHE_TEST_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                pass
    return [p for p in found if not _gone(p, 0)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_engine_process_stops_cleanly_in_a_generation_and_in_its_load(tmp_path):
    """``--engine-process``: a chat request (the template rendered on the HTTP side) streams; SIGTERM
    in a generation ends the stream with its last chunk and [DONE] and the server exits 0, its
    engine's process gone; SIGTERM while the model loads exits 0 within seconds (the child ignores
    SIGTERM, so the server kills a load in progress), nothing left running; a load that fails in
    the child is one ``error:`` line and exit 1."""
    import uuid

    from moecache.testing.synth import PRESETS, write_model

    httpx = require_module("httpx")
    model = tmp_path / "tiny.gguf"
    write_model(model, PRESETS["tiny"], seed=3)
    tag = uuid.uuid4().hex
    s = Server(model, "-c", "4096", "-np", "1", "--engine-process", env={"MOECACHE_TEST_TAG": tag})
    try:
        chat = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 4, "temperature": 0}, timeout=60)
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
        ends = []
        with httpx.stream("POST", s.url + "/v1/completions", json=LONG, timeout=60) as r:
            it = r.iter_lines()
            assert next(it).startswith("data: ")
            s.proc.send_signal(signal.SIGTERM)
            ends = [ln for ln in it if ln]
        assert ends[-1] == "data: [DONE]" and '"finish_reason": "cancelled"' in ends[-2]
        assert s.proc.wait(20) == 0 and "server: stopped" in "".join(s.output)
        deadline = time.monotonic() + 10
        while _tagged(tag):
            assert time.monotonic() < deadline, f"left running: {_tagged(tag)}"
            time.sleep(0.1)
    finally:
        s.stop()
    tag = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-m", "moecache.cli.main", "serve", "-m", str(model), "--port",
                          str(free_port()), "-t", "2", "--engine-process"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**os.environ, "MOECACHE_TEST_TAG": tag})
    try:
        out = []
        for line in p.stdout:  # the server listens, and loads meanwhile
            out.append(line)
            if "server: listening" in line:
                break
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=20)
        assert p.returncode == 0 and time.monotonic() - t0 < 10, "".join(out) + rest
        assert "server: stopped" in rest and "Traceback" not in rest
        assert not _tagged(tag)
    finally:
        if p.poll() is None:
            p.kill()
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "serve", "-m", str(model), "--port",
                        str(free_port()), "-t", "2", "--engine-process", "-c", "100000000"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "-c 100000000" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_an_api_error_crosses_the_pipe_whole():
    """An ApiError the engine's process raises (a 503 of a request cancelled before it started, a
    400 naming its field) reaches the client with its status, type and field: pickled whole."""
    import pickle

    from moecache.server.schemas import ApiError

    for e in (ApiError(503, "the request was cancelled before it started"), ApiError(400, "bad", param="prompt"),
              ApiError(500, "x", type="server_error")):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is ApiError and back.body() == e.body() and back.status == e.status


def test_a_stop_during_the_load_kills_the_engine_process_at_once(tmp_path):
    """``EngineProcess.stop`` while the child loads (it ignores SIGTERM there): the child is killed at
    once, not after the 30 s stop timeout, and ``start`` ends with EngineProcessError; a stop before
    ``start`` keeps the child from ever starting."""
    from faults import engine_child_that_loads_forever
    from moecache.server.engine_process import EngineProcess, EngineProcessError

    flag = tmp_path / "loading"
    p = EngineProcess(flag, None, 1, lambda job, res: None, target=engine_child_that_loads_forever)
    ended: list[BaseException] = []

    def start() -> None:
        try:
            p.start()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            ended.append(e)
    t = threading.Thread(target=start)
    t.start()
    deadline = time.monotonic() + 60
    while not flag.exists():  # the child is in its "load", SIGTERM ignored
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    p.stop()
    t.join(10)
    assert time.monotonic() - t0 < 10 and not p.alive() and not t.is_alive()
    assert len(ended) == 1 and isinstance(ended[0], EngineProcessError)
    q = EngineProcess(tmp_path / "never", None, 1, lambda job, res: None, target=engine_child_that_loads_forever)
    q.stop()
    with pytest.raises(EngineProcessError, match="stopped before"):
        q.start()
    assert not (tmp_path / "never").exists()


def test_an_engine_process_that_dies_fails_its_job_and_says_it_has_ended():
    """The server's side of a crash, without a model: the child ends (exit code 3) holding a job;
    the job gets a 500 naming the exit code, one log line says so, ``alive()`` turns false (/health
    500), and ``submit`` and ``status`` are 503s naming the cause."""
    import asyncio

    from faults import engine_child_that_dies_when_asked
    from moecache.sampling import SamplingParams
    from moecache.server.engine_process import EngineProcess
    from moecache.server.schemas import ApiError, GenRequest
    from moecache.server.worker import Job

    logged: list[str] = []
    p = EngineProcess(Path("unused.gguf"), None, 1, lambda job, res: None, log=logged.append,
                      target=engine_child_that_dies_when_asked)
    loop = asyncio.new_event_loop()
    try:
        p.start()
        assert p.n_ctx == 256 and p.n_ctx_slot == 64 and p.alive()
        gen = GenRequest(max_tokens=4, sampling=SamplingParams(temp=0.0), stop=(), stream=False, include_usage=False)
        job = Job([1, 2], gen, loop)
        p.submit(job)
        kind, err = loop.run_until_complete(asyncio.wait_for(job.events.get(), 30))
        assert kind == "error" and err.status == 500 and "exit code 3" in err.message
        assert not p.alive()
        assert len(logged) == 1 and logged[0].startswith("error: the engine's process ended (exit code 3)")
        for call in (lambda: p.submit(Job([1], gen, loop)), p.status):
            with pytest.raises(ApiError, match="has ended") as e:
                call()
            assert e.value.status == 503
    finally:
        p.stop()
        loop.close()


def test_the_child_stops_answering_when_its_worker_has_died():
    """The child's pipe loop returns once its worker's thread is gone (the server's side then sees
    the pipe close), however busy the pipe is."""
    from moecache.server.engine_process import _answer

    class Busy:  # a message always waiting
        def poll(self, timeout):
            return True

        def recv(self):
            return ("status", 0)

    class Dead:
        def alive(self):
            return False

        def status(self):
            raise AssertionError("a dead worker was asked")

    _answer(Busy(), Dead(), lambda msg: None)
