"""`moecache serve` under load (issue 21): aggregate t/s and time per output token at 1..N concurrent
streams, and a soak (requests completed and failed, the server's RSS and the GPU's used memory over
time).

The server runs in a subprocess (``moecache serve -m MODEL -np MAX(streams)`` plus the flags after
``--``); the clients are threads with the standard library's HTTP client, each streaming a
completion (``ignore_eos``, greedy unless ``--sampler default``, ``-n`` tokens). Per stream, the
time per output token (TPOT) is the gap between consecutive text events; aggregate t/s is all
generated tokens (each response's ``usage``) over the wall time from the first request to the last
answer. One warm-up request runs first, then ``--warmup-rounds`` rounds at the largest stream count
(an expert cache starts empty: a measurement of its first tokens measures the warm-up, not the
steady state). Each row also gives the expert cache's hit rate over that phase, the mean decode
batch (tokens per decode pass), the mean decode pass in ms, and the seconds the worker spent inside
the engine's decode passes and prompt evaluations (the rest of the wall time is HTTP, streaming,
sampling and waits), from the server's ``/metrics`` before and after it; and from its histograms the
p50/p99 of the decode passes and of the worker's own time between two passes of a batch
(``moecache:decode_pass_seconds``, ``moecache:decode_between_passes_seconds``; estimated as
Prometheus's ``histogram_quantile`` does, linear inside buckets of 0.1-0.5 ms below 1 ms, 1 ms up to
16 ms and 2 ms up to 30 ms): at one stream a gap between tokens is a pass plus the worker's time
after it, so a TPOT p99 above the two p99s' sum by more than a bucket was spent outside the worker
(the event loop, the clients); and the threads of the server's process tree after the phase.
``--bench`` also runs ``moecache bench -p 0 -n N`` with the same flags, the server's ``-c`` and
``--n-gen-warmup`` (``--bench-warmup``), for the single-stream ratio (server t/s / bench tg t/s).
``--rounds R`` runs each stream count R times, one round after the other (the wall times summed, the
TPOT percentiles over every round's gaps). (Before the fifteenth session bench ran at its own -c, p
+ n: at 8 GiB its expert cache then had the ~730 MiB that the server's -c 8192 KV cache takes.)

    python bench/serve_load.py -m /tmp/q30.gguf --streams 1,2,4,8 -n 128 --soak-s 600 --soak-clients 8 \\
        --bench --out bench/results/serve-h200 -- --vram-budget 8GiB --routing qwen3-moe -t 15
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moecache.server.metrics import Histogram  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_completion(port: int, prompt: str | list[int], n: int, timeout: float = 600.0,
                      temperature: float | None = 0.0) -> dict:
    """One streamed completion: {"tokens", "gaps" (s between text events), "t0", "t1", "status",
    "predicted_per_second" (the server's ``timings`` of the last chunk: generation t/s from the
    first token's logits, llama-server's field; None when absent)}."""
    req = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:  # None: the server's sampler (its flags; llama.cpp's defaults)
        req["temperature"] = temperature
    body = json.dumps(req)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return {"status": r.status, "tokens": 0, "gaps": [], "t0": t0, "t1": time.perf_counter()}
        last, gaps, tokens, pps = None, [], 0, None
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter()
            if ev.get("choices") and ev["choices"][0].get("text"):
                if last is not None:
                    gaps.append(now - last)
                last = now
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("timings"):
                pps = ev["timings"].get("predicted_per_second")
        return {"status": 200, "tokens": tokens, "gaps": gaps, "t0": t0, "t1": time.perf_counter(),
                "predicted_per_second": pps}
    except (OSError, http.client.HTTPException) as e:
        return {"status": f"{type(e).__name__}: {e}", "tokens": 0, "gaps": [], "t0": t0, "t1": time.perf_counter()}
    finally:
        conn.close()


def get_json(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    except OSError as e:
        return 0, str(e)
    finally:
        conn.close()


def prompt_of(k: int, i: int, n_tokens: int) -> str | list[int]:
    """Round ``k``'s stream ``i``'s prompt: a short text (14 tokens with the synthetic 30B model, 8
    with code-moe-tiny: no prompt pass of 32+ tokens, so the elastic slots are never lent), or with
    ``n_tokens`` that many token ids (ids 100-4099, in every vocabulary of 4100+ tokens; a different
    sequence per stream and round)."""
    if not n_tokens:
        return f"request {k}.{i}: hello"
    return [100 + (i * 7919 + k * 104729 + j * 31) % 4000 for j in range(n_tokens)]


def concurrent(port: int, n_streams: int, n: int, temperature: float | None = 0.0, rounds: int = 1,
               prompt_tokens: int = 0) -> dict:
    """``rounds`` rounds, one after the other, of ``n_streams`` streams at once; the wall time is the
    rounds' walls summed (the gaps between rounds left out), the percentiles pool every round's gaps.
    Returns the row: counts, ``wall_s``, ``aggregate_ts`` (generated tokens / s), ``per_stream_ts``
    (aggregate / ``n_streams``: a failed stream counts as 0), TPOT p50/p99/mean in ms, and the
    server's mean ``predicted_per_second`` (t/s; None unless every stream reported it)."""
    out: list[dict] = []
    wall = 0.0
    for k in range(rounds):
        got: list[dict] = [{}] * n_streams

        def one(i: int) -> None:
            got[i] = stream_completion(port, prompt_of(k, i, prompt_tokens), n, temperature=temperature)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall += max(o["t1"] for o in got) - min(o["t0"] for o in got)
        out += got
    ok = [o for o in out if o["status"] == 200]
    gaps = sorted(g for o in ok for g in o["gaps"])
    tokens = sum(o["tokens"] for o in ok)

    def pct(p: float) -> float:
        return gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1e3 if gaps else float("nan")
    return {"streams": n_streams, "rounds": rounds, "ok": len(ok), "failed": len(out) - len(ok), "tokens": tokens,
            "wall_s": wall,
            "aggregate_ts": tokens / wall if wall > 0 else 0.0, "per_stream_ts": tokens / wall / n_streams if wall > 0 else 0.0,
            "tpot_p50_ms": pct(0.5), "tpot_p99_ms": pct(0.99),
            "server_predicted_ts": statistics.fmean(o["predicted_per_second"] for o in ok)
            if ok and all(o.get("predicted_per_second") for o in ok) else None,
            "tpot_mean_ms": statistics.fmean(gaps) * 1e3 if gaps else float("nan")}


def counters(port: int) -> dict[str, Any]:
    """The server's /metrics counters this script reads (summed over caches): decode steps, their
    tokens and seconds, the seconds of the prompt evaluations, the expert caches' hits, misses and
    uploads; under "hist" its histograms (:func:`histograms`); {} when /metrics does not answer."""
    status, text = get_json(port, "/metrics")
    want = {"moecache:decode_steps_total": "steps", "moecache:decode_step_tokens_total": "step_tokens",
            "moecache:decode_seconds_total": "decode_s", "moecache:prompt_eval_seconds_total": "prompt_s",
            "moecache:expert_cache_hits_total": "hits", "moecache:expert_cache_misses_total": "misses",
            "moecache:expert_cache_uploads_total": "uploads"}
    out: dict[str, Any] = {}
    if status != 200:
        return out
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in want:
            out[want[name]] = out.get(want[name], 0.0) + float(line.split()[-1])
    out["hist"] = histograms(text)
    return out


def histograms(text: str) -> dict[str, Histogram]:
    """The histograms of a Prometheus text exposition (``NAME_bucket{le="..."}``, ``NAME_sum``), by
    NAME, as :class:`moecache.server.metrics.Histogram` (per-bucket counts from the cumulative ones)."""
    cum: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        if "_bucket{" in key and 'le="' in key:
            name = key.split("_bucket{")[0]
            le = key.split('le="')[1].split('"')[0]
            cum.setdefault(name, []).append((math.inf if le == "+Inf" else float(le), float(value)))
        elif key.endswith("_sum"):
            sums[key[:-4]] = float(value)
    out = {}
    for name, rows in cum.items():
        rows.sort()
        counts = [int(c - (rows[i - 1][1] if i else 0)) for i, (_, c) in enumerate(rows)]
        out[name] = Histogram(tuple(b for b, _ in rows[:-1]), counts, sums.get(name, 0.0))
    return out


HISTOGRAMS = {"moecache:decode_pass_seconds": "decode_pass", "moecache:decode_between_passes_seconds": "between"}


def phase(before: dict[str, Any], after: dict[str, Any]) -> dict:
    """Hit rate, uploads, mean decode batch, mean decode pass (ms), the seconds inside the engine's
    decode and prompt calls, and the p50/p99 (ms) of the decode passes and of the worker's time
    between two passes of a batch, between two :func:`counters` reads (None where the server has no
    such counter)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "hist"}
    pairs = d.get("hits", 0.0) + d.get("misses", 0.0)
    row = {"hit_rate": d["hits"] / pairs if pairs else None, "uploads": d.get("uploads"),
           "mean_batch": d["step_tokens"] / d["steps"] if d.get("steps") else None,
           "decode_ms_per_step": 1e3 * d["decode_s"] / d["steps"] if d.get("steps") and "decode_s" in d else None,
           "decode_s": d.get("decode_s"), "prompt_eval_s": d.get("prompt_s")}
    for name, short in HISTOGRAMS.items():
        h = after.get("hist", {}).get(name)
        if h is not None and name in before.get("hist", {}):
            h = h.minus(before["hist"][name])
        for q in (50, 99):
            v = h.quantile(q / 100) if h is not None else math.nan
            row[f"{short}_p{q}_ms"] = None if math.isnan(v) else v * 1e3
    return row


def server_threads(pid: int) -> int | None:
    """Threads of the server's process tree (the server and its engine's process) now: OpenMP teams
    show here (each thread that ran a parallel region keeps one while it lives)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return sum(q.num_threads() for q in [p, *p.children(recursive=True)])
    except psutil.Error:
        return None


def gpu_used_mib() -> float | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return float(sum(float(x) for x in r.stdout.split()))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def soak(port: int, pid: int, seconds: float, clients: int, n: int) -> dict:
    import psutil

    proc = psutil.Process(pid)
    stop = time.monotonic() + seconds
    counts = {"completed": 0, "failed": 0}
    lock = threading.Lock()
    samples: list[dict] = []

    def client(i: int) -> None:
        k = 0
        while time.monotonic() < stop:
            r = stream_completion(port, f"soak {i}.{k}", 16 + (k * 37 + i * 11) % max(1, n))
            k += 1
            with lock:
                counts["completed" if r["status"] == 200 else "failed"] += 1
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        rss = 0
        for p in [proc, *proc.children(recursive=True)]:  # the server and its engine's process
            try:
                rss += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mib": rss / 2**20,
                        "gpu_used_mib": gpu_used_mib(), **counts})
        time.sleep(5)
    for t in threads:
        t.join()
    return {**counts, "samples": samples}


SERVE_ONLY_FLAGS = ("--engine-process", "--no-engine-process")  # server flags without a value that bench lacks


def bench_tg(model: str, n: int, flags: list[str], warmup: int, ctx: int, cpus: set[int] | None = None) -> float | None:
    """``moecache bench``'s tg t/s with the server's flags (less :data:`SERVE_ONLY_FLAGS`) and its
    ``-c`` (the KV cache's VRAM: with ``--vram-budget``, what is left to the expert cache; bench's own
    -c would be only p + n), on the server's CPUs (``cpus``; None: this process's)."""
    flags = [f for f in flags if f not in SERVE_ONLY_FLAGS]
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "bench", "-m", model, "-p", "0", "-n", str(n),
                        "-r", "3", "-o", "jsonl", "--n-gen-warmup", str(warmup), "-c", str(ctx), *flags],
                       capture_output=True, text=True, cwd=ROOT,
                       preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if r.returncode:
        print(f"bench failed: {r.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["avg_ts"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("-c", "--ctx", type=int, default=0, help="-c of the server (default: 1024 per slot)")
    ap.add_argument("--soak-s", type=float, default=0.0)
    ap.add_argument("--soak-clients", type=int, default=8)
    ap.add_argument("--warmup-rounds", type=int, default=2,
                    help="rounds of the largest stream count before measuring (the expert cache warms up)")
    ap.add_argument("--bench", action="store_true", help="also moecache bench -p 0 -n N with the same flags")
    ap.add_argument("--bench-warmup", type=int, default=256, help="bench's --n-gen-warmup")
    ap.add_argument("--bench-also", default="",
                    help="with --bench, a second bench run with these flags added (one string), e.g. "
                         "'--cache-plan expert --no-elastic-slots' (serve's defaults before the thirty-second session)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="each request's prompt as this many token ids (default: a short text, 14 tokens with "
                         "the synthetic 30B model and 8 with code-moe-tiny; prompts of "
                         "32+ tokens are prompt passes, which lend the elastic slots)")
    ap.add_argument("--rounds", type=int, default=1, help="measured rounds of each stream count, one after the other")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="start the server with sys.setswitchinterval(S) (seconds; Python's default 0.005): how "
                         "long the event loop may keep the GIL from the engine's thread once it asks")
    ap.add_argument("--client-cpus", default=None,
                    help="CPUs for this script's client threads, e.g. '15' or '14,15': the server runs on the "
                         "others (its -t default follows its affinity), so the clients' HTTP and SSE parsing "
                         "does not take cores from the server's threads (Linux)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sampler", choices=("greedy", "default"), default="greedy",
                    help="the streams' sampling: greedy (temperature 0), or the server's default chain "
                         "(no temperature sent: temp 0.8, top-k 40, top-p 0.95, min-p 0.05)")
    a = ap.parse_args(argv)
    if a.bench_also and not a.bench:
        ap.error("--bench-also adds a second bench run to --bench's: give --bench too")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: expected 1 or more")
    temp = 0.0 if a.sampler == "greedy" else None
    streams = [int(s) for s in a.streams.split(",")]
    n_slots = max(streams + [a.soak_clients if a.soak_s else 1])
    ctx = a.ctx or 1024 * n_slots
    port = free_port()
    launch = ["-m", "moecache.cli.main"] if a.switch_interval is None else [
        "-c", f"import runpy, sys; sys.setswitchinterval({a.switch_interval!r}); "
              "runpy.run_module('moecache.cli.main', run_name='__main__', alter_sys=True)"]
    cmd = [sys.executable, *launch, "serve", "-m", a.model, "--port", str(port), "-np", str(n_slots),
           "-c", str(ctx), *extra]
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
    log = open(Path(a.out).with_suffix(".server.log") if a.out else "/dev/null", "w")
    server_cpus = None
    if a.client_cpus:
        try:
            mine = {int(c) for c in a.client_cpus.split(",")}
        except ValueError:
            ap.error(f"--client-cpus {a.client_cpus}: expected CPU numbers separated by commas, e.g. 14,15")
        server_cpus = os.sched_getaffinity(0) - mine
        if not server_cpus or not mine <= os.sched_getaffinity(0):
            ap.error(f"--client-cpus {a.client_cpus}: not a part of this process's CPUs {sorted(os.sched_getaffinity(0))}")
        os.sched_setaffinity(0, mine)  # this process's threads, the clients; the server is started on the rest
    srv = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None)
    rows: list[dict] = []
    try:
        deadline = time.monotonic() + 900
        while get_json(port, "/health")[0] != 200:
            if srv.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not come up (exit {srv.poll()}); see its log")
            time.sleep(1)
        stream_completion(port, "warm-up", 8)
        for _ in range(a.warmup_rounds):
            w = concurrent(port, max(streams), a.n, temp, 1, a.prompt_tokens)
            print(json.dumps({"warm-up": w}), file=sys.stderr)
        for n_streams in streams:
            c0 = counters(port)
            row = concurrent(port, n_streams, a.n, temp, a.rounds, a.prompt_tokens)
            row.update(server_flags=" ".join(extra), switch_interval=a.switch_interval, client_cpus=a.client_cpus,
                       prompt_tokens=a.prompt_tokens)
            row.update(phase(c0, counters(port)), server_threads=server_threads(srv.pid))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        soaked = soak(port, srv.pid, a.soak_s, a.soak_clients, a.n) if a.soak_s else None
        status, metrics = get_json(port, "/metrics")
    finally:
        srv.terminate()
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
        log.close()
    tg = bench_tg(a.model, a.n, extra, a.bench_warmup, ctx, server_cpus) if a.bench else None
    also = shlex.split(a.bench_also)
    tg_also = bench_tg(a.model, a.n, extra + also, a.bench_warmup, ctx, server_cpus) if a.bench and also else None
    one = next((r for r in rows if r["streams"] == 1), None)
    lines = [f"# moecache serve under load: {Path(a.model).name}\n",
             f"`python bench/serve_load.py {' '.join(sys.argv[1:])}`; server: "
             f"`{' '.join(cmd[cmd.index('serve'):])}`"
             + (f" with sys.setswitchinterval({a.switch_interval})" if a.switch_interval is not None else "")
             + (f"; the clients on CPUs {a.client_cpus}, the server and bench on the others" if a.client_cpus else "")
             + "\n",
             f"{a.warmup_rounds} warm-up round(s) of {max(streams)} streams first.\n",
             "| streams | ok | failed | tokens | wall s | aggregate t/s | vs 1 stream | TPOT p50 ms | TPOT p99 ms "
             "| hit rate | mean decode batch | decode pass ms | decode pass p50 / p99 ms | between passes p50 / p99 ms "
             "| in decode s | in prompts s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for r in rows:
        rel = r["aggregate_ts"] / one["aggregate_ts"] if one and one["aggregate_ts"] else float("nan")
        lines.append(f"| {r['streams']} | {r['ok']} | {r['failed']} | {r['tokens']} | {r['wall_s']:.1f} | "
                     f"{r['aggregate_ts']:.1f} | {rel:.2f} | {r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} | "
                     f"{_fmt(r.get('hit_rate'), '.3f')} | {_fmt(r.get('mean_batch'), '.2f')} | "
                     f"{_fmt(r.get('decode_ms_per_step'), '.2f')} | "
                     f"{_fmt(r.get('decode_pass_p50_ms'), '.2f')} / {_fmt(r.get('decode_pass_p99_ms'), '.2f')} | "
                     f"{_fmt(r.get('between_p50_ms'), '.2f')} / {_fmt(r.get('between_p99_ms'), '.2f')} | "
                     f"{_fmt(r.get('decode_s'), '.2f')} | "
                     f"{_fmt(r.get('prompt_eval_s'), '.2f')} |")
    if tg and one:
        lines += ["", f"single stream through the server {one['aggregate_ts']:.1f} t/s / `moecache bench -p 0 -n {a.n} "
                      f"--n-gen-warmup {a.bench_warmup} -c {ctx}` "
                      f"{tg:.1f} t/s = **{one['aggregate_ts'] / tg:.2f}**"]
        if one.get("server_predicted_ts"):
            lines += [f"the server's own `timings.predicted_per_second` for it: {one['server_predicted_ts']:.1f} t/s = "
                      f"**{one['server_predicted_ts'] / tg:.2f}** of bench tg"]
    if tg_also and one:
        lines += [f"bench with `{a.bench_also}` added: {tg_also:.1f} t/s; the server's single stream "
                  f"{one['aggregate_ts'] / tg_also:.2f} of it"]
    if soaked:
        s = soaked["samples"]
        warm = next((x for x in s if x["t_s"] >= 60), s[0])  # after a minute: the warm-up is over
        gpu = [x["gpu_used_mib"] for x in s if x["gpu_used_mib"] is not None]
        lines += ["", f"soak: {a.soak_s:.0f} s, {a.soak_clients} clients: {soaked['completed']} completed, "
                      f"{soaked['failed']} failed; RSS {s[0]['rss_mib']:.0f} MiB at start, {warm['rss_mib']:.0f} at "
                      f"{warm['t_s']:.0f} s, {s[-1]['rss_mib']:.0f} at the end (max "
                      f"{max(x['rss_mib'] for x in s):.0f}); GPU used {warm['gpu_used_mib']} MiB at "
                      f"{warm['t_s']:.0f} s, {s[-1]['gpu_used_mib']} at the end (max {max(gpu) if gpu else None})"]
    decode = [ln for ln in metrics.splitlines() if ln.startswith("moecache:decode_step")] if status == 200 else []
    lines += ["", "server /metrics at the end: " + "; ".join(decode)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.with_suffix(".md").write_text(text)
        with open(a.out.with_suffix(".jsonl"), "w") as f:
            for r in rows:  # (the single stream's row carries the bench figures it is compared with)
                extra_f = {"bench_tg_ts": tg, "bench_also": a.bench_also or None, "bench_also_tg_ts": tg_also} \
                    if r is one and tg else {}
                f.write(json.dumps({**r, **extra_f}) + "\n")
            if soaked:
                f.write(json.dumps({"soak": soaked}) + "\n")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


if __name__ == "__main__":
    main()
