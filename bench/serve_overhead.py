"""The server's own cost per token, without a GPU: ``moecache serve``'s app and worker in this
process, with ``Engine.decode`` replaced by a stand-in for a GPU decode step, which releases the
GIL for ``--step-ms`` (``time.sleep``, as a CUDA synchronisation does), then copies a (B, 151936)
float32 logits block and checks it for NaN (as the device-to-host copy and ``Engine.decode`` do).
Clients (``serve_load.stream_completion``, greedy, ``ignore_eos``) run in a child process.

Reported per stream count: the stand-in's own time per call, the server's
``timings.predicted_per_second`` as ms per token, their difference (sampling, detokenizing,
streaming, and waits for the GIL while the event loop streams), the clients' TPOT p50, and the CPU
time per generated token of the event loop's thread (HTTP, SSE; it holds the GIL for most of it) and
of the worker's (the stand-in's logits copy included).

    python bench/serve_overhead.py [-m ../shared/models/code-moe-tiny.gguf] [--streams 1,8] [--step-ms 3.5] [-r 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_VOCAB = 151936  # Qwen3's vocabulary: the logits the server samples from


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=str(ROOT.parent / "shared" / "models" / "code-moe-tiny.gguf"))
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--step-ms", type=float, default=3.5)
    ap.add_argument("-n", type=int, default=300, help="tokens per request")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=18181)
    a = ap.parse_args(argv)

    import uvicorn

    import moecache
    from moecache.chat import resolve_chat_template
    from moecache.sampling import SamplingParams
    from moecache.server.app import ServerState, build_app
    from moecache.server.worker import Worker

    streams = [int(s) for s in a.streams.split(",")]
    llm = moecache.load(a.model, n_ctx=4096)
    eng = llm.engine
    logits = np.random.default_rng(0).standard_normal((max(streams), N_VOCAB)).astype(np.float32)
    logits[:, 7] = 50.0  # the greedy token: an id every tokenizer has
    own: list[float] = []

    def stand_in(tokens, kvs):
        t0 = time.perf_counter()
        time.sleep(a.step_ms / 1e3)
        lg = logits[:len(kvs)].copy()
        if not np.isfinite(lg).all():
            raise AssertionError("the stand-in's logits are finite")
        for k in kvs:
            k.advance(1)
        own.append(time.perf_counter() - t0)
        return lg

    eng.decode = stand_in
    state = ServerState(model_id="stand-in", api_key=None, n_parallel=max(streams), defaults=SamplingParams())
    state.llm, state.template = llm, resolve_chat_template(eng.gguf, eng.tokenizer, None)
    state.worker = Worker(llm, max(streams), lambda job, res: None, print)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=a.port, log_level="warning",
                                           access_log=False, lifespan="off"))
    loop_thread = threading.Thread(target=server.run, daemon=True)
    loop_thread.start()
    while not server.started:
        time.sleep(0.05)
    clocks = {"loop": time.pthread_getcpuclockid(loop_thread.ident),
              "worker": time.pthread_getcpuclockid(state.worker._thread.ident)}

    def cpu() -> dict[str, float]:
        return {k: time.clock_gettime(c) for k, c in clocks.items()}
    print(f"stand-in step {a.step_ms} ms, {N_VOCAB}-entry logits, {a.n} tokens per request")
    print("| streams | rep | stand-in ms | server ms per token | difference ms | TPOT p50 ms "
          "| event loop CPU µs per token | worker CPU µs per token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ns in streams:
        client = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); "
                  "from serve_load import stream_completion as s; "
                  "from concurrent.futures import ThreadPoolExecutor as T; "
                  f"rs = list(T({ns}).map(lambda i: s({a.port}, 'hello', {a.n}), range({ns}))); "
                  "g = sorted(x for r in rs for x in r['gaps']); p = sorted(r['predicted_per_second'] for r in rs); "
                  "print(json.dumps({'pps': p[len(p) // 2], 'tpot': g[len(g) // 2] * 1e3}))")
        for rep in range(a.reps + 1):  # the first round warms up
            own.clear()
            c0 = cpu()
            out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, check=True).stdout
            c1 = cpu()
            if rep == 0:
                continue
            r = json.loads(out)
            own_ms, srv_ms = 1e3 * float(np.median(own)), 1e3 / r["pps"]
            per = {k: 1e6 * (c1[k] - c0[k]) / (ns * a.n) for k in clocks}  # (the worker's includes the stand-in's copy)
            print(f"| {ns} | {rep} | {own_ms:.3f} | {srv_ms:.3f} | {srv_ms - own_ms:+.3f} | {r['tpot']:.3f} "
                  f"| {per['loop']:.0f} | {per['worker']:.0f} |", flush=True)
    server.should_exit = True
    llm.close()


if __name__ == "__main__":
    main()
