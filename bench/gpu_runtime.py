"""GPU runtime speed by placement: pp and tg of one model, each next to its bandwidth floor.

For each arm (a placement: all on the GPU, ``--cpu-moe``, ``--n-cpu-moe N``) the engine is loaded
in-process and timed as llama-bench does: ``pp N`` = one N-token prompt from an empty context,
``tg N`` = N single-token decode steps from an empty context, median of ``-r`` runs, t/s.

The floor beside each number is the time to read the weights a token needs once at the measured
bandwidth (HBM device-to-device copy for GPU-resident weights, a multi-threaded host read for
host experts): ``dense bytes / HBM + expert bytes per token / (HBM or host RAM)``; for pp, the weights
of the whole ubatch read once (every expert is used by some token of a 512-token prompt).
Routing is measured too: the share of the experts a layer uses in the pp prompt (near 1 for the
near-uniform routing of the synthetic models: nothing is flattered).

    python bench/gpu_runtime.py -m /tmp/q30.gguf --arms gpu,cpu-moe,ncmoe24 -p 512 -n 128 -r 3 -t 16 \\
        --out bench/results/gpu-runtime-h200.md
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

from moecache.threads import short_openmp_spin

short_openmp_spin()

import numpy as np  # noqa: E402

from moecache.engine import Engine, EngineConfig  # noqa: E402
from moecache.placement import PlacementOptions  # noqa: E402


def arm_options(arm: str) -> PlacementOptions:
    if arm in ("gpu", "gpu-eager"):
        return PlacementOptions(n_gpu_layers=99)
    if arm == "cpu-moe":
        return PlacementOptions(n_gpu_layers=99, cpu_moe=True)
    if arm.startswith("ncmoe"):
        return PlacementOptions(n_gpu_layers=99, n_cpu_moe=int(arm[5:]))
    raise SystemExit(f"unknown arm {arm!r}: gpu, gpu-eager (no CUDA graph), cpu-moe, ncmoeN")


def run_arm(model: Path, arm: str, n_prompt: int, n_gen: int, reps: int, threads: int, load_mode: str = "mmap") -> dict:
    import cupy as cp

    opts = arm_options(arm)
    rng = np.random.default_rng(0)
    t_load = time.perf_counter()
    with Engine(model, EngineConfig(n_ctx=n_prompt + n_gen + 8, n_ubatch=n_prompt, n_threads=threads),
                log=print, placement=opts, cuda_graph=arm != "gpu-eager", load_mode=load_mode) as eng:
        t_load = time.perf_counter() - t_load
        c = eng.gguf.config
        used: list[float] = []
        eng.model.route_observers.append(lambda il, r: used.append(np.unique(r.ids).size / c.n_expert))
        prompt = rng.integers(1, c.n_vocab, n_prompt)
        eng.reset()
        eng.eval(prompt)
        eng.model.route_observers.clear()
        pp, tg = [], []
        for _ in range(reps):
            eng.reset()
            t0 = time.perf_counter()
            eng.eval(prompt)
            pp.append(n_prompt / (time.perf_counter() - t0))
            eng.reset()
            tok = int(prompt[0])
            t0 = time.perf_counter()
            for _ in range(n_gen):
                lg = eng.eval([tok])
                tok = int(lg[0].argmax())
            tg.append(n_gen / (time.perf_counter() - t0))
        pl = eng.placement
        dense = sum(t.n_bytes for n, t in eng.gguf.tensors.items() if not n.endswith("_exps.weight")
                    and n != "token_embd.weight")
        exp_all = [sum(t.n_bytes for n, t in eng.gguf.tensors.items() if n.startswith(f"blk.{il}.")
                       and n.endswith("_exps.weight")) for il in range(c.n_layer)]
        host_exp = sum(exp_all[il] for il in range(c.n_layer) if not pl.experts_on_device[il])
        dev_exp = sum(exp_all) - host_exp
        vram = cp.get_default_memory_pool().used_bytes()
        summary = pl.summary()
    del eng
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    frac = c.n_expert_used / c.n_expert
    return {"arm": arm, "load_mode": load_mode, "load_s": t_load, "placement": summary, "pp": statistics.median(pp), "tg": statistics.median(tg),
            "pp_runs": pp, "tg_runs": tg, "dense_bytes": dense, "dev_expert_bytes": dev_exp,
            "host_expert_bytes": host_exp, "tok_dev_expert_bytes": dev_exp * frac,
            "tok_host_expert_bytes": host_exp * frac, "expert_use_pp": float(np.mean(used)) if used else 0.0,
            "vram_bytes": vram}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--arms", default="gpu,cpu-moe")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", type=int, default=16)
    ap.add_argument("--load-modes", default="mmap", help="comma-separated: mmap, pin (each arm runs in each)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import cupy as cp

    from moecache.probe import gpu_bandwidths, ram_read_bandwidth

    hbm = gpu_bandwidths(cp, 0, 1 << 30, 10)["d2d_copy"]  # bytes read + written per second
    ram = ram_read_bandwidth(2 << 30, 5)[1]  # all of Numba's threads
    rows = []
    for arm, mode in [(x, m) for x in a.arms.split(",") for m in a.load_modes.split(",")]:
        r = run_arm(a.model, arm, a.p, a.n, a.r, a.t, mode)
        t_tok = (r["dense_bytes"] + r["tok_dev_expert_bytes"]) / hbm + r["tok_host_expert_bytes"] / ram
        # pp floor: every weight read once per ubatch (host experts cross PCIe or are read by the CPU)
        t_pp = (r["dense_bytes"] + r["dev_expert_bytes"]) / hbm + r["host_expert_bytes"] / ram
        r["tg_floor"] = 1.0 / t_tok
        r["pp_floor"] = a.p / t_pp
        rows.append(r)
        print(json.dumps(r))
    lines = [f"# GPU runtime by placement: {a.model.name}", "",
             f"Host: {platform.node()}, {platform.processor() or platform.machine()}; measured HBM copy "
             f"{hbm / 1e12:.2f} TB/s (read + write), host read {ram / 1e9:.1f} GB/s ({a.t} threads).",
             f"Command: `python bench/gpu_runtime.py -m {a.model.name} --arms {a.arms} --load-modes {a.load_modes} "
             f"-p {a.p} -n {a.n} -r {a.r} -t {a.t}`", "",
             f"| arm | load mode | load s | placement | pp{a.p} t/s | pp floor | tg{a.n} t/s | tg floor | tg % of floor | "
             f"VRAM GiB | experts used per layer (pp) |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['load_mode']} | {r['load_s']:.1f} | {r['placement']} | {r['pp']:.1f} | {r['pp_floor']:.0f} | {r['tg']:.2f} | "
                     f"{r['tg_floor']:.0f} | {100 * r['tg'] / r['tg_floor']:.0f}% | {r['vram_bytes'] / 2**30:.2f} | "
                     f"{100 * r['expert_use_pp']:.0f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
        a.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
