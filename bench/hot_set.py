"""The first tokens of a fresh process, with and without a saved hot set, against a warm process (issue 22).

Three child processes load the same model at the same ``--vram-budget`` with the same ``--routing``
process (seed 0: the model's expert popularity and topic), each in a fresh Python process:

- ``warm``: no saved profile; it serves ``--requests`` earlier requests of ``--tokens`` decode
  tokens each (a new prompt hot set each), saves their expert usage as a profile
  (:class:`moecache.moe.profile.HotSet`, the file ``run``/``serve`` keep), then the measured request;
- ``fresh``: no profile, the measured request first (the cache fills from empty slots);
- ``profile``: the saved profile preloaded into the slots before the first token, then the
  measured request first.

The measured request is the same in all three: the routing process restarts at ``--seed``
(:meth:`moecache.moe.routing_process.RoutingProcess.restart`: a prompt hot set none of the earlier
requests had), so every process routes the same tokens. Each request is a one-token prompt and
``-n`` decode tokens, timed token by token (wall time of each decode step, as ``bench``'s tg). Load
and preload times are reported apart. Random token ids are fed; ``--routing`` replaces the router.

    python bench/hot_set.py -m /tmp/q30.gguf --vram-budget 8GiB --routing qwen3-moe -n 128 \\
        --out bench/results/hot-set-h200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODES = ("fresh", "profile", "warm")


def child(a: argparse.Namespace) -> dict:
    """One process: load, (warm: earlier requests, save the profile), the measured request."""
    import moecache
    from moecache.moe.profile import HotSet

    t0 = time.perf_counter()
    llm = moecache.load(a.model, vram_budget=a.vram_budget, routing=a.routing, load_mode=a.load_mode,
                        n_ctx=a.ctx, no_moe_profile=True)
    load_s = time.perf_counter() - t0
    eng = llm.engine
    proc = eng.model.routing_override
    if not eng.caches or not hasattr(proc, "restart"):
        raise SystemExit("hot_set: needs an expert cache (a model larger than --vram-budget) and a --routing preset")
    vocab = eng.gguf.config.n_vocab
    rng = np.random.default_rng(1)
    notes: list[str] = []
    t0 = time.perf_counter()
    # warm runs first: the file does not exist yet (nothing preloaded), its usage is written there
    hs = HotSet.start(eng, a.profile_file, notes.append) if a.mode != "fresh" else None
    preload_s = time.perf_counter() - t0
    if a.mode == "profile" and (hs is None or hs.base is None):
        raise SystemExit(f"hot_set: the profile {a.profile_file} was not loaded: {notes}")

    def request(n: int, timed: bool) -> list[float]:
        eng.reset()
        eng.eval([int(rng.integers(0, vocab))])
        out = []
        for _ in range(n):
            t = time.perf_counter()
            eng.eval([int(rng.integers(0, vocab))])
            out.append(time.perf_counter() - t)
        return out if timed else []

    if a.mode == "warm":
        for i in range(a.requests):
            proc.restart(1000 + i)
            request(a.tokens, False)
        hs.save(eng, notes.append)
    proc.restart(a.seed)
    for c in eng.caches:
        c.reset_stats()
    steps = request(a.n_predict, True)
    for c in eng.caches:
        c.flush()
    hits = sum(c.stats.hits for c in eng.caches)
    misses = sum(c.stats.misses for c in eng.caches)
    uploads = sum(c.stats.uploads for c in eng.caches)
    slots = sum(c.policy.n_slots for c in eng.caches)
    llm.close()
    s = np.array(steps)
    return {"mode": a.mode, "n": len(steps), "ts": len(steps) / s.sum(), "ts_first32": min(32, len(s)) / s[:32].sum(),
            "hit_rate": hits / max(1, hits + misses), "uploads_per_token": uploads / max(1, len(steps)),
            "load_s": load_s, "preload_s": preload_s, "slots": slots, "notes": notes}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default="qwen3-moe")
    ap.add_argument("--load-mode", default="pin")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="measured decode tokens")
    ap.add_argument("--requests", type=int, default=4, help="earlier requests of the warm process (and the profile)")
    ap.add_argument("--tokens", type=int, default=256, help="decode tokens per earlier request")
    ap.add_argument("--seed", type=int, default=12345, help="the measured request's routing seed")
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.jsonl")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--profile-file", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mode:
        print(json.dumps(child(a)))
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        prof = str(Path(tmp) / "hot.npz")
        for mode in ("warm", "fresh", "profile"):  # warm writes the profile the third one loads
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--mode", mode,
                   "--profile-file", prof]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{mode}: exit {r.returncode}\n{r.stderr[-3000:]}")
            rows[mode] = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{mode}: {rows[mode]}", file=sys.stderr)
    w = rows["warm"]["ts"]
    head = (f"# First {a.n_predict} tokens: fresh process, fresh + saved hot set, warm process\n\n"
            f"`python bench/hot_set.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
            f"model {Path(a.model).name}, --vram-budget {a.vram_budget}, --routing {a.routing}, --load-mode "
            f"{a.load_mode}, -c {a.ctx}; warm = after {a.requests} requests of {a.tokens} tokens (their usage is "
            f"the saved profile); the measured request routes the same tokens in all three.\n")
    lines = [head, "| process | t/s (all) | vs warm | t/s (first 32) | hit rate | uploads/token | load s | preload s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode in ("fresh", "profile", "warm"):
        r = rows[mode]
        name = {"fresh": "fresh, no profile", "profile": "fresh + saved hot set", "warm": "warm"}[mode]
        lines.append(f"| {name} | {r['ts']:.1f} | {r['ts'] / w:.2f} | {r['ts_first32']:.1f} | {r['hit_rate']:.4f} | "
                     f"{r['uploads_per_token']:.2f} | {r['load_s']:.1f} | {r['preload_s']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.with_suffix(".md").write_text(text)
        with open(a.out.with_suffix(".jsonl"), "w") as f:
            for r in rows.values():
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
