"""The GPU timeline of one prompt behind the expert cache, as ``moecache bench`` runs it: where a
prompt ubatch's wall time goes (kernels, host-to-device copies, the GPU idle while the host works).

Loads the model as ``moecache bench`` does (the library's settings road), times ``-r`` prompts of
``-p`` tokens (fresh token ids each; the first compiles and warms), then records one more under
torch's profiler, whose CUPTI activity sees every kernel and copy of the process (CuPy's included;
Nsight Systems does not run on the lent machines, ../.library/device/KINDS.md). Prints:

- each prompt's time and t/s; the routing process's draw of one pass alone (``--routing``);
- the profiled prompt's GPU span, the union of busy time (any stream) and per kind, the idle rest;
- kernels and copies by name (count, ms, bytes and GB/s for copies);
- the host's CUDA API time by call; the GPU's idle gaps over 0.2 ms (what ran before and after).

The profiler slows the host (the profiled prompt is slower than the timed ones); the busy times
and bytes are the GPU's own. ``--trace FILE`` keeps the Chrome trace (JSON).

    python bench/prompt_timeline.py -m /tmp/q30.gguf -p 512 --vram-budget 8192MiB --routing qwen3-moe
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` spans in µs, as ms."""
    total, cur = 0.0, None
    for s, e in sorted(spans):
        if cur is None or s > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return (total + (0.0 if cur is None else cur[1] - cur[0])) / 1e3


def summarize(events: list[dict], top: int = 24) -> list[str]:
    """The report's lines for a Chrome trace's events (torch profiler's categories: ``kernel``,
    ``gpu_memcpy``, ``gpu_memset`` on the device; ``cuda_runtime``, ``cuda_driver`` on the host)."""
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not gpu:
        return ["no GPU activity recorded"]
    t0, t1 = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    span = (t1 - t0) / 1e3
    all_busy = busy_ms([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    out = [f"GPU span {span:.1f} ms, busy (any stream) {all_busy:.1f} ms, idle {span - all_busy:.1f} ms"]
    for cat in ("kernel", "gpu_memcpy"):
        out.append(f"  {cat} busy {busy_ms([(e['ts'], e['ts'] + e['dur']) for e in gpu if e['cat'] == cat]):.1f} ms")
    by: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0])
    for e in gpu:
        row = by[e["name"][:90]]
        row[0] += 1
        row[1] += e["dur"]
        row[2] += int((e.get("args") or {}).get("bytes", 0) or 0)
    out.append(f"by name ({len(by)} names; 'nvjet' are cuBLAS's kernels: "
               f"{sum(1 for k in by if k.startswith('nvjet'))} of them):")
    for name, (n, dur, nbytes) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        rate = f"  {nbytes / 1e9:.2f} GB at {nbytes / dur / 1e3:.1f} GB/s" if nbytes else ""
        out.append(f"  {dur / 1e3:8.1f} ms {n:6d}x  {name}{rate}")
    api: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            api[e["name"]][0] += 1
            api[e["name"]][1] += e.get("dur", 0)
    out.append("host CUDA API:")
    for name, (n, dur) in sorted(api.items(), key=lambda kv: -kv[1][1])[:10]:
        out.append(f"  {dur / 1e3:8.1f} ms {n:6d}x  {name}")
    gaps, end, before = [], gpu[0]["ts"] + gpu[0]["dur"], gpu[0]["name"]
    for e in gpu[1:]:
        if e["ts"] - end > 200:
            gaps.append((e["ts"] - end, before[:40], e["name"][:40]))
        if e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], e["name"]
    out.append(f"GPU idle gaps over 0.2 ms: {len(gaps)}, {sum(g[0] for g in gaps) / 1e3:.1f} ms in all; the longest:")
    for g, a, b in sorted(gaps, reverse=True)[:10]:
        out.append(f"  {g / 1e3:7.2f} ms after {a} before {b}")
    return out


def timed_prompt(eng, n_prompt: int, rng: np.random.Generator, vocab: int):
    """A function that evaluates a fresh ``n_prompt``-token prompt from an emptied context on ``eng``
    and returns its wall time in s, the GPU synchronized (CuPy)."""
    import cupy as cp

    prime = getattr(getattr(eng.model, "routing_override", None), "draw_ahead", None)

    def prompt() -> float:
        eng.reset()
        if prime is not None:  # the first ubatch's routing drawn before the clock, as `moecache bench` does
            prime(min(n_prompt, eng.n_ubatch))
        t = time.perf_counter()
        eng.eval(rng.integers(0, vocab, n_prompt))
        cp.cuda.runtime.deviceSynchronize()
        return time.perf_counter() - t
    return prompt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-r", "--reps", type=int, default=4, help="timed prompts before the profiled one")
    ap.add_argument("--vram-budget", default="8192MiB",
                    help="'none': every layer and expert on the GPU (no expert cache; the gpu-pp512 case)")
    ap.add_argument("--routing", default="qwen3-moe", help="'' or 'none': the model's own router")
    ap.add_argument("--load-mode", default="pin")
    ap.add_argument("-t", "--threads", type=int, default=15)
    ap.add_argument("--trace", type=Path, help="keep the Chrome trace here")
    ap.add_argument("--no-keep", action="store_true",
                    help="the expert cache's prompt keeps off (CachedExperts.prompt_keep): prompts fill no slot")
    a = ap.parse_args(argv)

    import torch  # noqa: F401 - its profiler (CUPTI) records the CuPy kernels too
    from torch.profiler import ProfilerActivity, profile

    from moecache.llm import open_llm
    from moecache.settings import Settings

    whole = a.vram_budget.lower() == "none"
    settings = Settings(n_ctx=a.n_prompt, n_gpu_layers=99, moe_cache=None if whole else -1,
                        vram_budget=None if whole else a.vram_budget,
                        routing=None if a.routing in ("", "none") else a.routing, load_mode=a.load_mode, n_threads=a.threads)
    with open_llm(a.model, settings, command="bench", log=lambda m: print(m, file=sys.stderr, flush=True)) as llm:
        eng = llm.engine
        for c in getattr(eng, "caches", []) if a.no_keep else ():
            c.prompt_keep = False
        rng = np.random.default_rng(0)
        vocab = eng.gguf.config.n_vocab
        proc = eng.model.routing_override
        if proc is not None and hasattr(proc, "_draw"):
            t = time.perf_counter()
            proc._draw(a.n_prompt)  # its result is dropped: the process's generator moves on, as any pass's
            print(f"routing process: a {a.n_prompt}-token pass drawn alone in {(time.perf_counter() - t) * 1e3:.1f} ms "
                  f"(drawn ahead on a worker: {getattr(proc, 'draw_passes_ahead', False)})")

        prompt = timed_prompt(eng, a.n_prompt, rng, vocab)
        for i in range(a.reps):
            dt = prompt()
            print(f"prompt {i}: {dt * 1e3:.1f} ms, {a.n_prompt / dt:.0f} t/s")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dt = prompt()
        print(f"profiled prompt: {dt * 1e3:.1f} ms, {a.n_prompt / dt:.0f} t/s")
        path = a.trace or Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(path))
    print("\n".join(summarize(json.loads(Path(path).read_text())["traceEvents"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
