"""The expert cache's three-arm benchmark: cache off, best static placement, cache on, side by side.

For each VRAM budget and routing, three arms run in one process each (``moecache bench`` with the
same tests, seed, ``-c`` and load mode, after the same warm-up of generated tokens):

- ``cache off``: ``--cpu-moe`` (every routed expert on the CPU; prompts op-offloaded);
- ``best static``: ``--n-cpu-moe N`` with the smallest N whose placement fits the same budget (found
  here with the placement planner on the model's sizes, i.e. the most expert layers on the GPU);
- ``cache on``: every expert in host RAM, the budget's free VRAM as the expert cache.

The short test is ``tetris-chat.txt``'s token count as pp, then 256 decoded tokens; the long test is
``long-configparser.py.txt``'s (~12k tokens); prefill and decode reported separately. ``moecache
bench`` sizes the context for its tests (prompt + decode + warm-up), and the best static arm is
planned with that same context, so every arm's KV cache is the same size. Writes a markdown table
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


def prompt_tokens(model: Path, name: str) -> int:
    from moecache.gguf_file import open_gguf
    from moecache.tokenizer import Tokenizer

    with open_gguf(model) as m:
        return len(Tokenizer.from_gguf(m).encode((ROOT / "prompts" / name).read_text()))


def best_static(model: Path, n_ctx: int, budget: int, free: int) -> int:
    """The smallest --n-cpu-moe whose placement fits ``budget`` (the most expert layers on the GPU)."""
    from moecache.gguf_file import open_gguf
    from moecache.placement import PlacementError, PlacementOptions, model_sizes, plan

    with open_gguf(model) as m:
        sizes = model_sizes(m, n_ctx)
    for n in range(sizes.n_layer + 1):
        try:
            plan(PlacementOptions(n_gpu_layers=99, n_cpu_moe=n, vram_budget=budget), sizes, [free])
            return n
        except PlacementError:
            continue
    raise SystemExit("no --n-cpu-moe fits the budget")


def run_arm(model: Path, args: list[str], log: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "cli.main", "bench", "-m", str(model), "-o", "jsonl", *args]
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True, check=True).stdout
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def main() -> None:
    from cli.main import parse_size
    from moecache.devices import gpu_free_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--vram-budget", default="8GiB")
    ap.add_argument("--routing", default="qwen3-moe,low-locality,uniform")
    ap.add_argument("--tests", default="short", help="short, long or short,long")
    ap.add_argument("-n", type=int, default=256, help="decoded tokens")
    ap.add_argument("--warmup", type=int, default=256, help="generated tokens before timing")
    ap.add_argument("-r", type=int, default=1)
    ap.add_argument("--load-mode", default="pin")
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true", help="keep the arms already in OUT.jsonl and run the rest "
                    "(a device command is limited to 10 minutes: run the matrix in parts)")
    ap.add_argument("--max-arms", type=int, default=0, help="stop after this many arms (0 = all), for parts")
    a = ap.parse_args()
    free, why = gpu_free_bytes()
    if not free:
        raise SystemExit(f"no GPU: {why}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    log = a.out.with_suffix(".log")
    jsonl = a.out.with_suffix(".jsonl")
    rows = [json.loads(ln) for ln in jsonl.read_text().splitlines() if ln.strip()] \
        if a.resume and jsonl.exists() else []
    if not a.resume:
        jsonl.write_text("")
    done = {(r["prompt"], r["budget"], r["routing"], r["arm"]) for r in rows}
    ran = 0
    tests = {"short": ("tetris-chat.txt", 4096), "long": ("long-configparser.py.txt", 16384)}
    for test in a.tests.split(","):
        prompt_file, _ = tests[test]
        n_prompt = prompt_tokens(a.model, prompt_file)
        n_ctx = max(n_prompt, a.n) + max(1, a.warmup) + 8  # as moecache bench sizes it
        for budget_text in a.vram_budget.split(","):
            budget = parse_size(budget_text, "--vram-budget")
            static_n = best_static(a.model, n_ctx, budget, free[0])
            for routing in a.routing.split(","):
                common = ["-p", str(n_prompt), "-n", str(a.n), "-r", str(a.r), "--n-gen-warmup", str(a.warmup),
                          "--vram-budget", budget_text, "--routing", routing, "--load-mode", a.load_mode,
                          "-ngl", "99"]
                arms = {"cache off (--cpu-moe)": ["--n-cpu-moe", "999", "--moe-cache", "0"],
                        f"best static (--n-cpu-moe {static_n})": ["--n-cpu-moe", str(static_n), "--moe-cache", "0"],
                        "cache on": ["--moe-cache", "-1"]}
                for arm, extra in arms.items():
                    if (prompt_file, budget_text, routing, arm) in done:
                        continue
                    if a.max_arms and ran >= a.max_arms:
                        break
                    ran += 1
                    for rec in run_arm(a.model, common + extra, log):
                        rec.update({"arm": arm, "prompt": prompt_file, "budget": budget_text})
                        rows.append(rec)
                        with jsonl.open("a") as f:  # written as each arm ends: a part can stop anywhere
                            f.write(json.dumps(rec) + "\n")
                        print(json.dumps({k: rec[k] for k in ("arm", "routing", "budget", "n_prompt", "n_gen",
                                                              "avg_ts", "hit_rate")}), flush=True)
    lines = [f"# Expert cache, three arms: {a.model.name}", "",
             f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}; "
             f"`python bench/cache_arms.py {' '.join(sys.argv[1:])}`", "",
             "| prompt | budget | routing | arm | test | t/s | hit rate |", "| --- | --- | --- | --- | --- | ---: | ---: |"]
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] and not r["n_gen"] else f"tg{r['n_gen']}"
        hr = "-" if r.get("hit_rate") is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(f"| {r['prompt']} | {r['budget']} | {r['routing']} | {r['arm']} | {test} | {r['avg_ts']:.2f} | {hr} |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if a.llama_bench:
        env = dict(os.environ, LD_LIBRARY_PATH=str(a.llama_bench.parent))
        n_prompt = prompt_tokens(a.model, tests["short"][0])
        n_ctx = max(n_prompt, a.n) + max(1, a.warmup) + 8
        ncmoe = best_static(a.model, n_ctx, parse_size(a.vram_budget.split(",")[0], "--vram-budget"), free[0])
        out = subprocess.run([str(a.llama_bench), "-m", str(a.model), "-p", str(n_prompt), "-n", str(a.n), "-ngl",
                              "99", "-ncmoe", str(ncmoe), "-o", "md"], capture_output=True, text=True, env=env)
        a.out.with_suffix(".llama-bench.md").write_text(out.stdout + out.stderr[-2000:])


if __name__ == "__main__":
    main()
