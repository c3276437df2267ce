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

``--real`` keeps the engine (no stand-in; on the lent GPU machines): the model loads with ``-c``,
``-t``, ``--vram-budget`` and ``--routing`` resolved as ``moecache.load`` (``run``) resolves them,
and each rep's ``-n`` tokens are timed three ways: as ``moecache bench`` decodes (``Engine.eval`` of
one token on the engine's own sequence), as the server's worker calls the engine with nothing
around it (``Engine.decode`` of one slot of ``-np``), and through the server, where every
``Engine.decode`` and prompt ``Engine.eval``/``Engine.eval_seqs`` call is timed in place. Per
stream count it prints the server's wall time per round against the time inside the engine's calls
(prompt and decode), the mean decode call, and per token of one stream: inside ``Engine.decode``
against the server's ``predicted_per_second`` and the clients' TPOT. Unless ``--skip-alone``, slot
0 is timed alone again after the server stops (a drift over the process's life would show there as
well). Options:

- ``--client-cpus K`` runs the clients on CPU K (``sched_setaffinity``);
- ``--prompt-tokens N`` sends N-token prompts (``serve_load.prompt_of``);
- ``--separate-prompts`` gives each slot's prompt chunk a pass of its own (the worker's
  ``merge_prompts=False``);
- ``--sync-stream`` makes the worker wait for the loop to stream a step's text before its next step
  (``Worker(sync_stream=True)``);
- ``--gil-load US`` also times slot 0 alone while another thread runs US µs of pure Python about
  once per token (the event loop's hold of the GIL, without the server).

Set ``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=30000000`` as ``serve`` does when it resolves the
layer plan.

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=30000000 python bench/serve_overhead.py --real -m /tmp/q30.gguf \
        --streams 1,8 -n 128 -r 3 -c 8192 -t 15 --vram-budget 8GiB --routing qwen3-moe [--client-cpus 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    ap.add_argument("--real", action="store_true", help="the engine itself, no stand-in (the docstring says how)")
    ap.add_argument("-c", "--ctx-size", type=int, default=None, help="--real: -c (default 8192)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="--real: -t")
    ap.add_argument("--vram-budget", default=None, help="--real: as run's --vram-budget (e.g. 8GiB)")
    ap.add_argument("--routing", default=None, help="--real: as run's --routing (e.g. qwen3-moe)")
    ap.add_argument("-np", "--parallel", type=int, default=None, help="--real: slots (default: the most streams)")
    ap.add_argument("--warmup", type=int, default=256, help="--real: decode steps before the timed ones")
    ap.add_argument("--client-cpus", type=int, default=None, help="--real: run the clients on this CPU")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="--real: N-token prompts (0: short text)")
    ap.add_argument("--no-elastic-slots", action="store_true", help="--real: as run's --no-elastic-slots")
    ap.add_argument("--skip-alone", action="store_true", help="--real: no timing outside the server")
    ap.add_argument("--gil-load", type=float, default=0.0, metavar="US",
                    help="--real: also time the slot alone while another thread runs US µs of pure Python about "
                         "once per token (as the event loop streams a token, but not in phase with the steps: a "
                         "slowdown shows the GIL matters, no slowdown does not clear it)")
    ap.add_argument("--sync-stream", action="store_true",
                    help="--real: the worker waits for the loop to stream a step's text before the next step "
                         "(Worker sync_stream)")
    ap.add_argument("--separate-prompts", action="store_true",
                    help="--real: one prompt pass per slot (Worker merge_prompts=False)")
    a = ap.parse_args(argv)
    real_only = {"-c": a.ctx_size, "-t": a.threads, "--vram-budget": a.vram_budget, "--routing": a.routing,
                 "-np": a.parallel, "--client-cpus": a.client_cpus, "--prompt-tokens": a.prompt_tokens or None,
                 "--no-elastic-slots": a.no_elastic_slots or None, "--skip-alone": a.skip_alone or None,
                 "--gil-load": a.gil_load or None, "--sync-stream": a.sync_stream or None,
                 "--separate-prompts": a.separate_prompts or None}
    if a.real:
        if a.gil_load and a.skip_alone:
            print("note: --gil-load not used: it times slot 0 alone, which --skip-alone skips", file=sys.stderr)
        return real(a)
    ignored = [k for k, v in real_only.items() if v is not None]
    if ignored:
        print(f"note: {', '.join(ignored)} not used: options of --real only", file=sys.stderr)

    import moecache

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
    server, state, clocks = start_server(llm, "stand-in", max(streams), a.port)

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


def start_server(llm, model_id: str, n_par: int, port: int, merge_prompts: bool = True,
                 sync_stream: bool = False) -> tuple:
    """``serve``'s app and a worker of ``n_par`` slots on ``llm``, uvicorn in a thread of this process.
    Returns (the uvicorn server, its ServerState, the CPU clock ids of the event loop's and the
    worker's threads)."""
    import uvicorn

    from moecache.chat import resolve_chat_template
    from moecache.sampling import SamplingParams
    from moecache.server.app import ModelInfo, ServerState, build_app
    from moecache.server.worker import Worker

    eng = llm.engine
    state = ServerState(model_id=model_id, api_key=None, n_parallel=n_par, defaults=SamplingParams())
    state.tokenizer, state.template = eng.tokenizer, resolve_chat_template(eng.gguf, eng.tokenizer, None)
    state.info = ModelInfo.of(eng.gguf, eng.n_ctx)
    state.worker = Worker(llm, n_par, lambda job, res: None, print, merge_prompts=merge_prompts,
                          sync_stream=sync_stream)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="off"))
    loop_thread = threading.Thread(target=server.run, daemon=True)
    loop_thread.start()
    while not server.started:
        time.sleep(0.05)
    clocks = {"loop": time.pthread_getcpuclockid(loop_thread.ident),
              "worker": time.pthread_getcpuclockid(state.worker._thread.ident)}
    return server, state, clocks


def real(a: argparse.Namespace) -> None:
    """``--real``: the engine's decode timed alone, as the worker calls it, and inside the server."""
    import moecache

    streams = [int(s) for s in a.streams.split(",")]
    n_par = a.parallel or max(streams)
    kw = {"n_ctx": a.ctx_size or 8192}
    kw |= {k: v for k, v in (("n_threads", a.threads), ("vram_budget", a.vram_budget), ("routing", a.routing))
           if v is not None} | ({"elastic_slots": False} if a.no_elastic_slots else {})
    llm = moecache.load(a.model, log=lambda s: print(s, file=sys.stderr), **kw)
    eng = llm.engine
    rng = np.random.default_rng(0)
    vocab = eng.gguf.config.n_vocab
    passes = ("a prompt pass per slot" if a.separate_prompts
              else "the slots' prompts in shared passes (Engine.shares_pass)")
    print(f"{a.model}: {kw}, -np {n_par}, {a.n} tokens a rep, {a.reps} reps after {a.warmup} warm-up steps, "
          f"prompts {a.prompt_tokens or 'of 5-8'} tokens, {passes}")

    seqs = eng.sequences(n_par)

    def per_token_ms(step, clear) -> list[float]:
        """The warm-up's steps, then each rep's ``-n`` from an empty sequence (bench's reps)."""
        out = []
        for rep in range(a.reps + 1):
            n = a.warmup if rep == 0 else a.n
            clear()
            t0 = time.perf_counter()
            for _ in range(n):
                step(int(rng.integers(0, vocab)))
            if rep:
                out.append((time.perf_counter() - t0) * 1e3 / n)
        return out

    alone = {} if a.skip_alone else {"bench": per_token_ms(lambda tok: eng.eval([tok]), eng.reset),
                                     "slot": per_token_ms(lambda tok: eng.decode([tok], [seqs[0]]), seqs[0].clear)}
    if alone and a.gil_load > 0:
        period = float(np.mean(alone["slot"])) / 1e3
        stop = threading.Event()

        def hold_gil() -> None:  # pure Python (it keeps the GIL), once per token's time
            while not stop.is_set():
                t_end = time.perf_counter() + a.gil_load / 1e6
                while time.perf_counter() < t_end:
                    pass
                time.sleep(period)
        holder = threading.Thread(target=hold_gil, daemon=True)
        holder.start()
        alone[f"slot 0, another thread holding the GIL {a.gil_load:.0f} us a token"] = per_token_ms(
            lambda tok: eng.decode([tok], [seqs[0]]), seqs[0].clear)
        stop.set()
        holder.join()
    seqs[0].clear()
    for k, v in alone.items():
        names = {"bench": "Engine.eval on its own sequence (bench)", "slot": "Engine.decode of slot 0"}
        what = names[k] if k in names else f"Engine.decode of {k}"
        print(f"alone, {what}: {' '.join(f'{x:.3f}' for x in v)} ms per token", flush=True)

    calls: list[tuple[str, float, int]] = []  # (kind, seconds, tokens) of every engine call the worker makes
    inside = [False]  # an engine call made by another one (decode's or eval_seqs' own Engine.eval): not counted

    def timed(kind: str, fn, size):
        def call(*args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            inside[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
                calls.append((kind, time.perf_counter() - t0, size(*args)))
        return call

    decode, evaluate, evaluate_seqs = eng.decode, eng.eval, eng.eval_seqs
    eng.decode, eng.eval, eng.eval_seqs = (timed("decode", eng.decode, lambda toks, kvs: len(kvs)),
                                           timed("prompt", eng.eval, lambda toks, *_: len(toks)),
                                           timed("prompt", eng.eval_seqs, lambda parts, kvs: sum(map(len, parts))))
    server, state, clocks = start_server(llm, Path(a.model).name, n_par, a.port, merge_prompts=not a.separate_prompts,
                                         sync_stream=a.sync_stream)
    pin = (lambda: os.sched_setaffinity(0, {a.client_cpus})) if a.client_cpus is not None else None
    print("| streams | rep | wall ms | in prompt calls ms | in decode calls ms | outside ms | decode calls "
          "| mean decode call ms | in decode ms per token | server ms per token | TPOT p50 ms | TPOT mean ms "
          "| event loop CPU µs per token | worker CPU µs per token | hit rate |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ns in streams:
        for rep in range(a.reps + 1):  # the first round warms up
            client = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); import serve_load as s; "
                      f"print(json.dumps(s.concurrent({a.port}, {ns}, {a.n}, rounds=1, "
                      f"prompt_tokens={a.prompt_tokens})))")
            calls.clear()
            h0 = [(c.stats.hits, c.stats.misses) for c in eng.caches]
            c0 = {k: time.clock_gettime(c) for k, c in clocks.items()}
            out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, check=True,
                                 preexec_fn=pin).stdout
            c1 = {k: time.clock_gettime(c) for k, c in clocks.items()}
            if rep == 0:
                continue
            r = json.loads(out)
            tok = max(1, r["tokens"])
            hits = sum(c.stats.hits - h for c, (h, _) in zip(eng.caches, h0))
            misses = sum(c.stats.misses - m for c, (_, m) in zip(eng.caches, h0))
            hit_rate = hits / (hits + misses) if hits + misses else float("nan")
            dec = [c for c in calls if c[0] == "decode"]
            t_dec = 1e3 * sum(c[1] for c in dec)
            t_pr = 1e3 * sum(c[1] for c in calls if c[0] == "prompt")
            wall = 1e3 * r["wall_s"]
            per = {k: 1e6 * (c1[k] - c0[k]) / tok for k in clocks}
            srv = 1e3 / r["server_predicted_ts"] if r.get("server_predicted_ts") else float("nan")
            print(f"| {ns} | {rep} | {wall:.1f} | {t_pr:.1f} | {t_dec:.1f} | {wall - t_pr - t_dec:.1f} | {len(dec)} "
                  f"| {t_dec / max(1, len(dec)):.3f} | {t_dec * ns / tok:.3f} | {srv:.3f} | {r['tpot_p50_ms']:.3f} "
                  f"| {r['tpot_mean_ms']:.3f} | {per['loop']:.0f} | {per['worker']:.0f} | {hit_rate:.3f} |", flush=True)
            if ns > 1:
                slow = sorted(c[1] * 1e3 for c in dec)
                by_b: dict[int, list[float]] = {}
                for c in dec:
                    by_b.setdefault(c[2], []).append(c[1] * 1e3)
                print(f"  decode calls: p50 {slow[len(slow) // 2]:.2f} p90 {slow[int(len(slow) * 0.9)]:.2f} max "
                      f"{slow[-1]:.2f} ms; by batch: " + ", ".join(
                          f"B={b}: {len(v)} x {statistics.fmean(v):.2f}" for b, v in sorted(by_b.items())), flush=True)
    server.should_exit = True
    state.worker.stop()
    if alone:  # the same call alone again: a drift over the process's life, not the server, would show here too
        eng.decode, eng.eval, eng.eval_seqs = decode, evaluate, evaluate_seqs
        seqs[0].clear()
        after = per_token_ms(lambda tok: eng.decode([tok], [seqs[0]]), seqs[0].clear)
        print(f"alone again after the server, Engine.decode of slot 0: {' '.join(f'{x:.3f}' for x in after)} ms "
              f"per token", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
