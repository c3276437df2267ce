"""The expert cache's three-arm benchmark: cache off, best static placement, cache on, side by side.

For each VRAM budget and routing, three arms run in one process each (``moecache bench`` with the
same tests, seed, ``-c`` and load mode, after the same warm-up of generated tokens):

- ``cache off``: ``--cpu-moe`` (every routed expert on the CPU; prompts op-offloaded);
- ``best static``: ``--n-cpu-moe N`` with the smallest N whose placement fits the same budget (found
  here with the placement planner on the model's sizes, i.e. the most expert layers on the GPU);
- ``cache on``: every expert in host RAM, the budget's free VRAM as the expert cache.

The short test is ``tetris-chat.txt``'s token count as pp, then 256 decoded tokens, at ``-c 4096``;
the long test is ``long-configparser.py.txt``'s (at most :data:`LONG_PROMPT_TOKENS`, ~12k) at ``-c 16384``: its prefill (pp), and
decode after it (``tg256 @ d<prompt>``, llama-bench's depth: the prompt is evaluated first, outside
the decode's timing), reported separately from one run: the pp row is that depth prefill's own
timing (``depth_ts``). The long test skips llama-bench's warm-up pass (it would repeat the 12k-token
prefill); every arm generates at least one token first instead, so the kernels are compiled before
timing. The best static arm is planned with that same context, so every arm's KV cache
is the same size. Writes a markdown table
and jsonl under ``--out``. ``--llama-bench PATH`` adds stock
llama.cpp's ``llama-bench`` on the same file at the best static ``-ncmoe``.

    python bench/cache_arms.py -m /tmp/q30.gguf --vram-budget 8GiB,12GiB \\
        --routing qwen3-moe,low-locality,uniform --out bench/results/cache-arms-h200 [--resume --max-arms 3]

Arms are appended to OUT.jsonl as they finish; ``--resume`` skips those already there, so a matrix
longer than one 10-minute device command runs in parts (``--max-arms`` bounds a part).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# the long prompt's length under code-moe-tiny's BPE tokenizer (prompts/README.md): the long test's
# prefill is at most this many tokens whatever the model's tokenizer
LONG_PROMPT_TOKENS = 12620


def prompt_tokens(model: Path, name: str) -> int:
    from moecache.gguf_file import open_gguf
    from moecache.tokenizer import Tokenizer

    with open_gguf(model) as m:
        return len(Tokenizer.from_gguf(m).encode((ROOT / "prompts" / name).read_text()))


def best_static(model: Path, n_ctx: int, budget: int, free: int, used: int, kv_itemsize: int = 2) -> int:
    """The smallest --n-cpu-moe whose placement fits ``budget`` with the cache off (the most expert
    layers on the GPU): the planner's own choice for --moe-cache 0, as an explicit N, planned as the
    ``moecache bench`` child will plan it: ``used`` (bytes in use on the GPU now, this process's
    CUDA context among them) plus the child's own context count against the budget."""
    from moecache.gguf_file import open_gguf
    from moecache.placement import CUDA_CONTEXT_BYTES, PlacementError, PlacementOptions, model_sizes, plan

    with open_gguf(model) as m:
        sizes = model_sizes(m, n_ctx, kv_itemsize)
    try:
        pl = plan(PlacementOptions(n_gpu_layers=99, moe_cache=0, vram_budget=budget), sizes, [free],
                  [used + CUDA_CONTEXT_BYTES])
    except PlacementError as e:
        raise SystemExit(f"no static placement fits the budget: {e}") from None
    host = [il for il, on in enumerate(pl.experts_on_device) if not on and sizes.experts[il]]
    if host and host != list(range(host[-1] + 1)):
        raise SystemExit(f"the planner kept experts of layers {host} in host RAM: not an --n-cpu-moe placement")
    return host[-1] + 1 if host else 0


def run_arm(model: Path, args: list[str], log: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "moecache.cli.main", "bench", "-m", str(model), "-o", "jsonl", *args]
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True, check=True).stdout
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def prefill_row(rec: dict) -> dict:
    """The pp row of a long test from its ``tg @ d<prompt>`` row: the depth prefill's speed
    (``depth_ts``, the mean over the reps), the same engine and prompt length as a separate
    ``pp<prompt>`` run, without a second model load and prefill. The decode's samples and spread
    are not the prefill's, so they are left out (None), as are hit rate and uploads (the prompt
    path does not count them).

    Raises:
        SystemExit: the row has no depth prefill timing.
    """
    if not rec.get("n_depth") or not rec.get("depth_ts"):
        raise SystemExit(f"{rec.get('arm', 'an arm')}: no depth prefill timing (depth_ts) in its tg @ d row")
    return {**rec, "n_prompt": rec["n_depth"], "n_gen": 0, "n_depth": 0, "avg_ts": rec["depth_ts"],
            "avg_ns": round(rec["n_depth"] * 1e9 / rec["depth_ts"]), "stddev_ns": None, "stddev_ts": None,
            "samples_ns": None, "samples_ts": None, "samples_host_gb": None, "hit_rate": None,
            "uploads_per_token": None}


def render(rows: list[dict], model_name: str, argv: str) -> str:
    """The markdown table of the arms (one row per arm and test) and the cache-on ratios."""
    lines = [f"# Expert cache, three arms: {model_name}", "",
             f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}; "
             f"`python bench/cache_arms.py {argv}`", "",
             "| prompt | budget | routing | arm | test | t/s | hit rate | uploads/token | VRAM used MiB |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    speed: dict[tuple, dict[str, float]] = {}
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] and not r["n_gen"] else f"tg{r['n_gen']}"
        test += f" @ d{r['n_depth']}" if r.get("n_depth") else ""
        hr = "-" if r.get("hit_rate") is None else f"{100 * r['hit_rate']:.1f}%"
        up = "-" if r.get("uploads_per_token") is None else f"{r['uploads_per_token']:.2f}"
        vram = "-" if r.get("vram_used_mib") is None else str(r["vram_used_mib"])
        lines.append(f"| {r['prompt']} | {r['budget']} | {r['routing']} | {r['arm']} | {test} | {r['avg_ts']:.2f} | "
                     f"{hr} | {up} | {vram} |")
        kind = "cache" if r["arm"] == "cache on" else "static" if r["arm"].startswith("best static") else "off"
        speed.setdefault((r["prompt"], r["budget"], r["routing"], test), {})[kind] = r["avg_ts"]
    lines += ["", "| prompt | budget | routing | test | cache on / best static | cache on / cache off |",
              "| --- | --- | --- | --- | ---: | ---: |"]
    for (prompt, budget, routing, test), v in speed.items():
        if "cache" not in v:
            continue
        ratio = {k: f"{v['cache'] / v[k]:.2f}x" if v.get(k) else "-" for k in ("static", "off")}
        lines.append(f"| {prompt} | {budget} | {routing} | {test} | {ratio['static']} | {ratio['off']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from moecache.sizes import parse_size
    import numpy as np

    from moecache.devices import gpu_memory
    from moecache.engine import KV_TYPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default="qwen3-moe,low-locality,uniform")
    ap.add_argument("--tests", default="short", help="short, long or short,long")
    ap.add_argument("-n", type=int, default=256, help="decoded tokens")
    ap.add_argument("--warmup", type=int, default=256, help="generated tokens before timing")
    ap.add_argument("-r", type=int, default=1)
    ap.add_argument("--load-mode", default="pin")
    ap.add_argument("-ctk", "--cache-type", default="f16", help="KV cache type of every arm (f16, f32)")
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true", help="keep the arms already in OUT.jsonl and run the rest "
                    "(a device command is limited to 10 minutes: run the matrix in parts)")
    ap.add_argument("--max-arms", type=int, default=0, help="stop after this many arms (0 = all), for parts")
    ap.add_argument("--arms", default="off,static,cache", help="which arms: off, static, cache (comma list)")
    ap.add_argument("--cold-static", action="store_true", help="no generated warm-up for the cache-off and static "
                    "arms (they have no cache to warm; saves device time)")
    a = ap.parse_args()
    if a.cache_type not in KV_TYPES:
        raise SystemExit(f"-ctk must be one of {', '.join(KV_TYPES)}, got {a.cache_type!r}")
    kv_itemsize = np.dtype(KV_TYPES[a.cache_type]).itemsize
    free, used, why = gpu_memory()
    if not free:
        raise SystemExit(f"no GPU: {why}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    log = a.out.with_suffix(".log")
    jsonl = a.out.with_suffix(".jsonl")
    rows = [json.loads(ln) for ln in jsonl.read_text().splitlines() if ln.strip()] \
        if a.resume and jsonl.exists() else []
    if not a.resume:
        jsonl.write_text("")
    done = {(r["prompt"], r["budget"], r["routing"], r["arm"]) for r in rows
            if r.get("type_k", "f32") == a.cache_type}  # --resume with another -ctk reruns the arms
    ran = 0
    tests = {"short": ("tetris-chat.txt", 4096), "long": ("long-configparser.py.txt", 16384)}
    for test in a.tests.split(","):
        prompt_file, n_ctx = tests[test]  # -c of every arm (its KV cache counts against the budget)
        n_prompt = prompt_tokens(a.model, prompt_file)
        if test == "long":  # a tokenizer that splits finer (the synthetic model's) times the first ~12k tokens
            n_prompt = min(n_prompt, LONG_PROMPT_TOKENS)
        need = (max(n_prompt, a.n) + max(1, a.warmup) if test == "short" else max(n_prompt + a.n, a.warmup + 1)) + 8
        if n_ctx < need:
            raise SystemExit(f"{prompt_file}: {n_prompt} tokens, -n {a.n} and warm-up {a.warmup} need -c {need}, "
                             f"the {test} test runs at {n_ctx}")
        for budget_text in a.vram_budget.split(","):
            budget = parse_size(budget_text, "--vram-budget")
            static_n = best_static(a.model, n_ctx, budget, free[0], used[0], kv_itemsize)
            for routing in a.routing.split(","):
                common = ["-r", str(a.r), "-c", str(n_ctx), "--vram-budget", budget_text, "--routing", routing, "--load-mode", a.load_mode,
                          "-ngl", "99", "-ctk", a.cache_type, "-ctv", a.cache_type]
                # the generated warm-up fills the cache; with --cold-static the static arms (nothing to
                # warm: their speed does not depend on the tokens before) skip it to save device time
                long = test == "long"
                cold = ["--n-gen-warmup", str(int(long)) if a.cold_static else str(max(int(long), a.warmup))]
                arms = {"cache off (--cpu-moe)": ["--n-cpu-moe", "999", "--moe-cache", "0", *cold],
                        f"best static (--n-cpu-moe {static_n})": ["--n-cpu-moe", str(static_n), "--moe-cache", "0", *cold],
                        "cache on": ["--moe-cache", "-1", "--n-gen-warmup", str(max(int(long), a.warmup))]}
                if long:
                    common.append("--no-warmup")
                chosen = a.arms.split(",")
                for (arm, extra), key in zip(arms.items(), ("off", "static", "cache")):
                    if (prompt_file, budget_text, routing, arm) in done or key not in chosen:
                        continue
                    if a.max_arms and ran >= a.max_arms:
                        break
                    ran += 1
                    # short: pp and tg from an empty context (llama-bench's pp/tg); long: one
                    # tg @ d<prompt> run whose depth prefill (timed apart: depth_ts) is the pp row
                    shape = ["-p", str(n_prompt), "-n", str(a.n)] if test == "short" else \
                        ["-p", "0", "-n", str(a.n), "-d", str(n_prompt)]
                    recs = run_arm(a.model, shape + common + extra, log)
                    if long:
                        recs = [prefill_row(recs[0])] + recs
                    for rec in recs:
                        rec.update({"arm": arm, "prompt": prompt_file, "budget": budget_text})
                        rows.append(rec)
                        with jsonl.open("a") as f:  # written as each arm ends: a part can stop anywhere
                            f.write(json.dumps(rec) + "\n")
                        print(json.dumps({k: rec[k] for k in ("arm", "routing", "budget", "n_prompt", "n_gen",
                                                              "avg_ts", "hit_rate")}), flush=True)
    a.out.with_suffix(".md").write_text(render(rows, a.model.name, " ".join(sys.argv[1:])))
    if a.llama_bench:
        env = dict(os.environ, LD_LIBRARY_PATH=str(a.llama_bench.parent))
        n_prompt = prompt_tokens(a.model, tests["short"][0])
        n_ctx = tests["short"][1]
        ncmoe = best_static(a.model, n_ctx, parse_size(a.vram_budget.split(",")[0], "--vram-budget"), free[0],
                            used[0], kv_itemsize)
        out = subprocess.run([str(a.llama_bench), "-m", str(a.model), "-p", str(n_prompt), "-n", str(a.n), "-ngl",
                              "99", "-ncmoe", str(ncmoe), "-ctk", a.cache_type, "-ctv", a.cache_type, "-o", "md"],
                             capture_output=True, text=True, env=env)
        a.out.with_suffix(".llama-bench.md").write_text(out.stdout + out.stderr[-2000:])


if __name__ == "__main__":
    main()
