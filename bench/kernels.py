"""CPU kernel bandwidth: weight bytes streamed per second by the Numba kernels, per format, at 1
and 8 tokens, next to the machine's RAM read bandwidth measured the same way (an all-threads
Numba ``prange`` read of a large array). Also the grouped MoE kernel (``moe_ffn_routed``: the expert cache's
miss path and ``--cpu-moe``'s)
on one Qwen3-30B-A3B-shaped layer (128 experts, top-8, n_embd 2048, expert ff 768), with float32
activations and with ``act_q8`` (8-bit activations, integer dots for Q8_0, Q4_K, Q5_K and Q6_K experts;
``--moe-formats`` picks the experts' formats, Q4_K by default).

Decode on the CPU is memory-bound: GB/s of weights read is the honest headline (gpt-fast's habit).
Each matrix is larger than the last-level cache, so every call streams from RAM.

    python bench/kernels.py [--threads N] [--mib 256] [--formats Q4_K,Q8_0] [--moe-k 1,2,4] [--moe-formats Q4_K,Q6_K] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moecache.quants import cpu  # noqa: E402  (sets up numba first)
from moecache.quants.formats import FORMATS  # noqa: E402
from moecache.quants.int_dots import ROW_DOTS  # noqa: E402
from moecache.probe import cpu_model  # noqa: E402
from moecache.quants.random_blocks import random_rows  # noqa: E402

import numba  # noqa: E402
from numba import njit, prange  # noqa: E402


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _read_all(a):
    n_chunks = 1024
    per = a.shape[0] // n_chunks
    parts = np.zeros(n_chunks, np.uint64)
    for c in prange(n_chunks):
        s = np.uint64(0)
        for i in range(c * per, (c + 1) * per):
            s += a[i]
        parts[c] = s
    return parts.sum()


def median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def ram_bandwidth(mib: int, threads: int, reps: int) -> float:
    a = np.random.default_rng(0).integers(0, 2**62, size=mib * 2**20 // 8, dtype=np.uint64)
    numba.set_num_threads(threads)
    t = median_time(lambda: _read_all(a), reps)
    return a.nbytes / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--mib", type=int, default=256, help="weight MiB per format (> last-level cache)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--moe-k", default="", help="also time one token through k experts of the MoE layer with 8-bit "
                    "activations, for each k of this comma list (the fixed cost of a call against its per-expert "
                    "slope: the CPU's share of an expert cache's misses is a few experts)")
    ap.add_argument("--moe-formats", default="Q4_K", help="expert formats of the MoE layer, comma list (each gets the "
                    "same rows; the engine's 8-bit dots take Q8_0, Q4_K, Q5_K and Q6_K experts)")
    ap.add_argument("--out", type=Path, help="write a markdown table here (and .jsonl beside it)")
    args = ap.parse_args()
    moe_formats = args.moe_formats.split(",")
    for name in args.formats.split(",") + moe_formats:
        if name not in FORMATS:
            ap.error(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    float_only = [n for n in moe_formats if n not in ROW_DOTS]
    if float_only:  # the engine does the same: 8-bit activations, float kernel (moecache.quants.cpu.moe_ffn)
        print(f"note: {', '.join(float_only)} experts have no integer dots: their 8-bit rows round the activations "
              f"and take the float kernel", file=sys.stderr)
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    t_start = time.time()

    ram_all = ram_bandwidth(1024, args.threads, args.reps)
    ram_one = ram_bandwidth(512, 1, max(3, args.reps // 3))
    numba.set_num_threads(args.threads)
    print(f"RAM read (numba prange): {ram_all:.1f} GB/s with {args.threads} threads, {ram_one:.1f} GB/s with 1",
          file=sys.stderr)

    n_in = 4096
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        row_bytes = fmt.row_bytes(n_in)
        n_out = max(64, args.mib * 2**20 // row_bytes)
        W = random_rows(fmt, n_out, n_in, rng, std=0.02)
        res = {"format": name, "bits_per_weight": fmt.bits_per_weight, "weight_mib": W.nbytes / 2**20}
        for n_tok in (1, 8):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            out = np.empty((n_tok, n_out), np.float32)
            t = median_time(lambda: cpu.matmul(W, fmt.ggml_type, x, out=out), args.reps)
            res[f"gbps_{n_tok}tok"] = W.nbytes / t / 1e9
            res[f"ms_{n_tok}tok"] = t * 1e3
        res["frac_ram_1tok"] = res["gbps_1tok"] / ram_all
        rows.append(res)
        print(f"{name:7s} {res['gbps_1tok']:7.1f} GB/s @1  {res['gbps_8tok']:7.1f} GB/s @8  "
              f"({100 * res['frac_ram_1tok']:.0f}% of RAM)", file=sys.stderr)
        del W

    moe = []
    if not args.no_moe:
        n_expert, top_k, n_embd, n_ff = 128, 8, 2048, 768
        for fname in moe_formats:
            ef = FORMATS[fname]
            Wg = random_rows(ef, n_expert * n_ff, n_embd, rng, std=0.02).reshape(n_expert, n_ff, -1)
            Wu = random_rows(ef, n_expert * n_ff, n_embd, rng, std=0.02).reshape(n_expert, n_ff, -1)
            Wd = random_rows(ef, n_expert * n_embd, n_ff, rng, std=0.02).reshape(n_expert, n_embd, -1)
            bytes_per_expert = Wg[0].nbytes + Wu[0].nbytes + Wd[0].nbytes
            types = (ef.ggml_type,) * 3
            runs = [(1, False, top_k), (1, True, top_k), (8, False, top_k), (8, True, top_k)]
            runs += [(1, True, int(k)) for k in args.moe_k.split(",") if k and int(k) != top_k]
            for n_tok, q8, k_used in runs:
                h = rng.standard_normal((n_tok, n_embd)).astype(np.float32)

                def routed():  # the router's (T, k) ids and weights, as the engine hands them over
                    ids = np.stack([rng.choice(n_expert, k_used, replace=False) for _ in range(n_tok)]).astype(np.int32)
                    return ids, np.full(ids.shape, 1.0 / k_used, np.float32)

                calls = [routed() for _ in range(args.reps + 2)]
                out = np.zeros((n_tok, n_embd), np.float32)
                it = iter(calls)
                t = median_time(lambda: cpu.moe_ffn_routed(Wg, Wu, Wd, types, *next(it), h, out=out, act_q8=q8),
                                args.reps)
                n_distinct = float(np.mean([len(np.unique(c[0])) for c in calls]))
                gbps = n_distinct * bytes_per_expert / t / 1e9
                moe.append({"format": fname, "n_tokens": n_tok, "act_q8": q8, "experts_per_token": k_used,
                            "distinct_experts": n_distinct, "ms": t * 1e3, "gbps": gbps, "frac_ram": gbps / ram_all,
                            "mib_per_matrix": Wg[0].nbytes / 2**20})
                print(f"moe_ffn {fname} {n_tok} tok x {k_used}{' act_q8' if q8 else ''}: {t * 1e3:.3f} ms, "
                      f"{gbps:.1f} GB/s", file=sys.stderr)
            del Wg, Wu, Wd

    host = {"cpu": cpu_model(), "threads": args.threads, "logical_cpus": os.cpu_count(),
            "numba": numba.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "threading_layer": numba.threading_layer(),
            "cpu_features_env": os.environ.get("NUMBA_CPU_FEATURES", "")[-40:],
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join(sys.argv), "ram_gbps_all": ram_all, "ram_gbps_1": ram_one,
            "seconds": time.time() - t_start}
    lines = [f"# CPU kernel bandwidth: {host['cpu']}", "",
             f"- {host['date']}, `{host['command']}`",
             f"- {args.threads} threads ({host['logical_cpus']} logical CPUs), numba {host['numba']} "
             f"({host['threading_layer']} layer), numpy {host['numpy']}, Python {host['python']}",
             f"- RAM read, numba prange over 1 GiB: **{ram_all:.1f} GB/s** with {args.threads} threads, "
             f"{ram_one:.1f} GB/s with 1", "",
             "| format | bits/weight | weights MiB | GB/s @ 1 token | % of RAM read | GB/s @ 8 tokens | ms @ 1 | ms @ 8 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['bits_per_weight']:.2f} | {r['weight_mib']:.0f} | {r['gbps_1tok']:.1f} | "
                     f"{100 * r['frac_ram_1tok']:.0f}% | {r['gbps_8tok']:.1f} | {r['ms_1tok']:.2f} | {r['ms_8tok']:.2f} |")
    if moe:
        sizes = ", ".join(dict.fromkeys(f"{m['mib_per_matrix']:.2f} MiB of {m['format']}" for m in moe))
        lines += ["", "Grouped MoE kernel (`moe_ffn_routed`, the kernel of the engine's CPU call), one Qwen3-30B-A3B-shaped layer: 128 experts, "
                  f"top-8, n_embd 2048, expert ff 768 ({sizes} per matrix); random routing; activations "
                  "float32, or rounded to 8 bits with integer dots (`act_q8`):", "",
                  "| experts | tokens | experts per token | activations | distinct experts | ms | expert GB/s | % of RAM read |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"]
        for m in moe:
            act = ("8-bit" if m["format"] in ROW_DOTS else "8-bit (float kernel)") if m["act_q8"] else "float32"
            lines.append(f"| {m['format']} | {m['n_tokens']} | {m['experts_per_token']} | {act} | "
                         f"{m['distinct_experts']:.1f} | {m['ms']:.3f} | {m['gbps']:.1f} | {100 * m['frac_ram']:.0f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        with open(args.out.with_suffix(".jsonl"), "w") as f:
            f.write(json.dumps({"host": host}) + "\n")
            for r in rows:
                f.write(json.dumps({"kernel": "matmul", **r}) + "\n")
            for m in moe:
                f.write(json.dumps({"kernel": "moe_ffn", **m}) + "\n")


if __name__ == "__main__":
    main()
