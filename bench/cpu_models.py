"""Prompt processing (pp) and generation (tg) speed of whole models, moecache vs llama.cpp.

Runs moecache's engine in-process (greedy, median of --reps runs) and, when ``--llama-bench`` is
given, llama.cpp's ``llama-bench`` with the same prompt length, generation length and threads,
in the same run so the ratio is measured side by side. Writes a markdown table (+ JSON lines).

    python bench/cpu_models.py -m MODEL.gguf [-m MODEL2.gguf] -f prompts/clockmaker.txt -n 64 -t 2 \\
        --llama-bench /path/to/llama-bench --out bench/results/cpu-models-HOST.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from moecache.threads import short_openmp_spin

short_openmp_spin()  # as the moecache command does, before the engine's imports load OpenMP

from moecache.engine import Engine, EngineConfig  # noqa: E402
from moecache.sampling import Sampler, SamplingParams  # noqa: E402


def ours(model: Path, prompt: str, n_gen: int, threads: int, reps: int, backend: str = "cpu") -> dict:
    be = None
    if backend == "cuda":
        from moecache.backends.cupy_backend import CupyBackend

        be = CupyBackend()
    with Engine(model, EngineConfig(n_ctx=4096, n_threads=threads), backend=be) as eng:
        ids = eng.tokenizer.encode(prompt)
        pp, tg = [], []
        for _ in range(reps):
            eng.reset()
            g = eng.generate(ids, Sampler(SamplingParams(temp=0.0)), n_gen)
            if g.timings.n_gen < n_gen:
                raise SystemExit(f"{model.name}: generation stopped early ({g.stop})")
            pp.append(g.timings.pp_tps)
            tg.append(g.timings.tg_tps)
        return {"n_prompt": len(ids), "pp": statistics.median(pp), "tg": statistics.median(tg)}


def llamacpp(bench: str, model: Path, n_prompt: int, n_gen: int, threads: int, reps: int) -> dict:
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(bench).parent))
    out = subprocess.run([bench, "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads),
                          "-r", str(reps), "-o", "json"], capture_output=True, text=True, env=env, check=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"pp": pp, "tg": tg, "build": rows[0].get("build_commit", "?")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", required=True, type=Path)
    ap.add_argument("-f", "--file", type=Path, default=Path(__file__).parents[1] / "prompts" / "clockmaker.txt")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu",
                    help="moecache backend: cpu (numpy + Numba) or cuda (the CuPy backend)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    prompt = a.file.read_text().strip()
    lines = [f"# Whole models: moecache vs llama.cpp ({time.strftime('%Y-%m-%d')})", "",
             f"Host: {platform.node()}, {os.cpu_count()} logical CPUs, {platform.processor() or platform.machine()}; "
             f"moecache backend {a.backend}; threads {a.t}; prompt `{a.file.name}`; greedy; median of {a.reps} runs.", "",
             f"Command: `python bench/cpu_models.py {' '.join('-m ' + m.name for m in a.model)} -f {a.file.name} "
             f"-n {a.n} -t {a.t} --reps {a.reps} --backend {a.backend}{' --llama-bench llama-bench' if a.llama_bench else ''}`",
             "",
             "| model | pp tokens | moecache pp t/s | moecache tg t/s | llama.cpp pp t/s | llama.cpp tg t/s | pp ratio | tg ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    records = []
    for m in a.model:
        o = ours(m, prompt, a.n, a.t, a.reps, a.backend)
        ref = llamacpp(a.llama_bench, m, o["n_prompt"], a.n, a.t, a.reps) if a.llama_bench else None
        rec = {"model": m.name, **{f"moecache_{k}": v for k, v in o.items()}}
        row = f"| {m.name} | {o['n_prompt']} | {o['pp']:.1f} | {o['tg']:.2f} |"
        if ref:
            rec.update({f"llamacpp_{k}": v for k, v in ref.items()})
            row += f" {ref['pp']:.1f} | {ref['tg']:.2f} | {o['pp'] / ref['pp']:.2f} | {o['tg'] / ref['tg']:.2f} |"
        else:
            row += " - | - | - | - |"
        lines.append(row)
        records.append(rec)
        print(row, flush=True)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")
        a.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
