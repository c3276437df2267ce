"""Validate ``moecache profile --what-if`` against measured decode speed (issue 22).

1. ``moecache bench`` decodes at each ``--vram-budget`` with an expert cache and ``--routing``
   (the vs-llamacpp 8 GiB case's flags: ``-p 0 -n N -r R --n-gen-warmup W --load-mode pin``).
2. The routing process's own trace is written: the tokens those runs route (the load's warm-up
   token, llama-bench's warm-up token, the ``--n-gen-warmup`` tokens, then the timed ones), all
   single-token passes of :class:`moecache.moe.routing_process.RoutingProcess` seed 0.
3. ``moecache profile --trace-in TRACE -m MODEL -c C --what-if-vram BUDGETS --calibrate CAL
   --n-gen-warmup N`` places each VRAM size as ``run --vram-budget`` would (at the runs' context
   ``C``: the mapped cache is checked against the one each run was granted) and predicts its
   speed, calibrated on the ``--calibrate-at`` runs only; the others are the check.

    python bench/what_if_check.py -m /tmp/q30.gguf --budgets 4,6,8,12,16 --calibrate-at 4,16 \\
        --out bench/results/what-if-h200
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def bench_row(a: argparse.Namespace, gib: float) -> dict:
    cmd = [sys.executable, "-m", "moecache.cli.main", "bench", "-m", a.model, "-p", "0", "-n", str(a.n_gen),
           "-r", str(a.reps), "-t", str(a.threads), "-o", "jsonl", "-ngl", "99", "--moe-cache", "-1",
           "--vram-budget", f"{gib:g}GiB", "--routing", a.routing, "--load-mode", "pin",
           "--n-gen-warmup", str(a.n_gen_warmup)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench at {gib} GiB failed:\n{r.stderr[-2000:]}")
    row = json.loads(r.stdout.strip().splitlines()[-1])
    row["vram_budget_gib"] = gib
    print(f"{gib:g} GiB: {row['avg_ts']:.1f} t/s, hit rate {row['hit_rate']}, cache {row['moe_cache_mib_granted']} MiB",
          file=sys.stderr)
    return row


def write_trace(a: argparse.Namespace, path: Path, n_layer: int, n_expert: int, k: int, expert_bytes: int) -> int:
    """The routing process's first tokens as a trace; returns the warm-up tokens before the timed ones."""
    from moecache.moe.profile import Trace
    from moecache.moe.routing_process import make_routing

    warm = 2 + a.n_gen_warmup  # the load's warm-up token, llama-bench's warm-up token, the --n-gen-warmup tokens
    n = warm + a.reps * a.n_gen
    proc = make_routing(a.routing, n_layer, n_expert, k, 0)
    ids, ws = zip(*(proc.next_token() for _ in range(n)))
    routes, weights = np.concatenate(ids, axis=1), np.concatenate(ws, axis=1)
    Trace(routes, weights, n_expert, expert_bytes, np.zeros(n, np.int32)).save(path)
    return warm


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--budgets", default="4,6,8,12,16", help="--vram-budget values in GiB")
    ap.add_argument("--calibrate-at", default="4,16", help="the budgets whose runs calibrate the model")
    ap.add_argument("--routing", default="qwen3-moe")
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=15)
    ap.add_argument("--n-gen-warmup", type=int, default=256)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from moecache.gguf_file import open_gguf
    from moecache.moe.profile import expert_bytes_of
    from moecache.sizes import parse_size

    with open_gguf(a.model) as g:
        c = g.config
        n_moe = sum(f"blk.{il}.ffn_gate_exps.weight" in g.tensors for il in range(c.n_layer))
        eb, n_expert, k = expert_bytes_of(g), c.n_expert, c.n_expert_used
    budgets = [float(b) for b in a.budgets.split(",")]
    cal_at = {float(b) for b in a.calibrate_at.split(",")}
    rows = [bench_row(a, b) for b in budgets]
    with tempfile.TemporaryDirectory() as tmp:
        trace, cal = Path(tmp) / "trace.npz", Path(tmp) / "cal.jsonl"
        warm = write_trace(a, trace, n_moe, n_expert, k, eb)
        cal.write_text("".join(json.dumps(r) + "\n" for r in rows if r["vram_budget_gib"] in cal_at))
        ctx = a.n_gen + a.n_gen_warmup + 8  # what bench resolves for -p 0 -n N --n-gen-warmup W
        cmd = [sys.executable, "-m", "moecache.cli.main", "profile", "--trace-in", str(trace), "-m", a.model,
               "-c", str(ctx), "--what-if-vram", ",".join(f"{b:g}GiB" for b in budgets), "--calibrate", str(cal),
               "--n-gen-warmup", str(warm)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"profile failed:\n{p.stderr[-2000:]}")
    table = [ln for ln in p.stdout.splitlines() if re.match(r"\| [\d.]+[GMK]iB \| \d+ \|", ln)]
    what = [ln for ln in p.stdout.splitlines() if ln.startswith(("what-if on", "cost model"))]
    lines = ["# what-if against measured decode speed\n",
             f"`python bench/what_if_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n",
             *[f"    {ln}" for ln in what], "",
             "| --vram-budget | cache MiB granted / placed by the what-if | role | measured t/s | predicted t/s | error | "
             "measured hit rate | predicted hit rate | measured uploads/token | predicted uploads/token |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    out = []
    for r, ln in zip(rows, table):
        cells = [x.strip() for x in ln.strip("|").split("|")]
        pred_ts, pred_hit, pred_up = float(cells[-1]), float(cells[5].rstrip("%")) / 100, float(cells[-2])
        placed = parse_size(cells[2], "cache") / 2**20 if cells[2][:1].isdigit() else float("nan")
        err = pred_ts / r["avg_ts"] - 1
        role = "calibration" if r["vram_budget_gib"] in cal_at else "check"
        lines.append(f"| {r['vram_budget_gib']:g} GiB | {r['moe_cache_mib_granted']:.1f} / {placed:.1f} | {role} | "
                     f"{r['avg_ts']:.1f} | "
                     f"{pred_ts:.1f} | {100 * err:+.1f}% | {r['hit_rate']:.4f} | {pred_hit:.4f} | "
                     f"{r['uploads_per_token']:.2f} | {pred_up:.2f} |")
        out.append({**r, "role": role, "placed_cache_mib": placed, "predicted_ts": pred_ts,
                    "predicted_hit_rate": pred_hit, "predicted_uploads_per_token": pred_up, "error": err})
    text = "\n".join(lines) + "\n\nprofile's output:\n\n" + "\n".join(f"    {ln}" for ln in p.stdout.splitlines()) + "\n"
    print(text)
    if a.out:
        a.out.with_suffix(".md").write_text(text)
        with open(a.out.with_suffix(".jsonl"), "w") as f:
            for r in out:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
