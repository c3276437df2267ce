"""Placement fidelity matrix (issue 24): code-moe-tiny's perplexity and greedy tokens under every
placement x load mode x -ub on the GPU, next to the CPU's and llama.cpp's.

    python bench/placement_fidelity.py -m code-moe-tiny.gguf -f heldout-b.py.txt --out results.md

Prints (and writes) a markdown table: one row per cell with its PPL, the relative difference to the
CPU's, whether the greedy tokens equal the CPU's, and the expert bytes copied for prompt ubatches.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moecache.engine import Engine, EngineConfig  # noqa: E402
from moecache.testing import fidelity as F  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-f", "--file", required=True, help="text for perplexity")
    ap.add_argument("-c", "--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=-1, help="-1: the whole text")
    ap.add_argument("--ub", default=",".join(map(str, F.UBATCHES)))
    ap.add_argument("--placements", default=",".join(F.PLACEMENTS))
    ap.add_argument("--load-modes", default=",".join(F.LOAD_MODES))
    ap.add_argument("--n-greedy", type=int, default=32)
    ap.add_argument("--llamacpp-ppl", type=float, default=None, help="llama-perplexity's PPL, for the header")
    ap.add_argument("--label", default="", help="a note for the header (e.g. the code version)")
    ap.add_argument("--out", default=None, help="markdown file (a .jsonl beside it gets the rows)")
    a = ap.parse_args()

    with Engine(a.model, EngineConfig(n_ctx=a.ctx)) as e:
        tokens = e.tokenizer.encode(Path(a.file).read_text(), parse_special=False)
    prompt = tokens[100:170]
    t0 = time.perf_counter()
    ppl0, toks0, gaps = F.cpu_reference(a.model, tokens, a.ctx, a.chunks, prompt, a.n_greedy)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = [f"# Placement fidelity: {Path(a.model).name}, perplexity on {Path(a.file).name} at -c {a.ctx}",
            "", f"{platform.node()}; commit {commit or '?'}; {a.label}",
            f"command: `python {' '.join(sys.argv)}`", "",
            f"CPU (`-ngl 0`): PPL **{ppl0:.4f}** ({time.perf_counter() - t0:.1f} s)"
            + (f"; llama.cpp b11434 (CPU): {a.llamacpp_ppl:.4f}" if a.llamacpp_ppl else ""),
            f"Greedy: {a.n_greedy} tokens after a 70-token prompt of the text; `=` equal to the CPU's "
            "(or parting only after a near-tie, top-2 within 0.05 logits).", "",
            "| placement | load mode | -ub | PPL | vs CPU | greedy | prompt expert bytes copied |",
            "| --- | --- | ---: | ---: | ---: | :---: | ---: |"]
    print("\n".join(head), flush=True)
    rows, lines = [], []
    for pl in a.placements.split(","):
        for lm in a.load_modes.split(","):
            for ub in (int(x) for x in a.ub.split(",")):
                c = F.run_cell(a.model, pl, lm, ub, tokens, a.ctx, a.chunks, prompt, a.n_greedy)
                rel = (c.ppl - ppl0) / ppl0
                bad = F.first_real_divergence(toks0, c.tokens, gaps)
                line = (f"| `{pl}` | {lm} | {ub} | {c.ppl:.4f} | {rel * 100:+.3f}% | "
                        f"{'=' if bad is None else f'differs at {bad}'} | {c.offloaded_bytes:,} |")
                print(line, flush=True)
                lines.append(line)
                rows.append(dict(placement=pl, load_mode=lm, n_ubatch=ub, ppl=c.ppl, ppl_cpu=ppl0, rel=rel,
                                 greedy_equal=bad is None, offloaded_bytes=c.offloaded_bytes, summary=c.summary))
    worst = max(abs(r["rel"]) for r in rows)
    tail = ["", f"Largest difference to the CPU: {worst * 100:.3f}%; greedy equal in "
                f"{sum(r['greedy_equal'] for r in rows)} of {len(rows)} cells."]
    print("\n".join(tail))
    if a.out:
        Path(a.out).write_text("\n".join(head + lines + tail) + "\n")
        with open(Path(a.out).with_suffix(".jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
