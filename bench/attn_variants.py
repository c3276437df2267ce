"""Decode attention kernels on one layer of Qwen3-30B-A3B's shape (32 query heads, 4 KV heads,
head_dim 128, float16 KV cache): µs per call of ``attn_gqa`` + ``attn_combine`` with several
shortest key runs (``min_run``), and of the per-head ``attn_decode`` + ``attn_combine``, at several
depths of a 16640-position cache (launches replayed from a CUDA graph); registers and local-memory
bytes. ``--src`` compares other versions of ``ops.cu`` (e.g. the committed one of an earlier tree),
``-D`` passes a macro to the compiler (``-D GQA_MIN_BLOCKS=1``).

    python bench/attn_variants.py [--ctx 16640] [--depths 0,128,4096,16000] [--src OLD.cu] [-D NAME=V]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from moecache.backends import cupy_backend as cb  # noqa: E402

NULL = cb.NULL


def timed(fn, reps: int = 20) -> float:
    """µs per call of ``fn``'s launches, replayed from a captured CUDA graph (no Python between them)."""
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        fn()
        st.begin_capture()
        for _ in range(reps):
            fn()
        g = st.end_capture()
        g.launch(st)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(st)
        for _ in range(5):
            g.launch(st)
        b.record(st)
        b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e3 / (5 * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=16640)
    ap.add_argument("--depths", default="0,128,1024,4096,16000")
    ap.add_argument("--src", action="append", default=[], help="another ops.cu to time too")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE for the compiler")
    ap.add_argument("--min-runs", default="32,64,128,256")
    a = ap.parse_args()
    H, Hkv, D = 32, 4, 128
    rng = np.random.default_rng(0)
    K = cp.asarray(rng.standard_normal((a.ctx, Hkv, D)).astype(np.float16))
    V = cp.asarray(rng.standard_normal((a.ctx, Hkv, D)).astype(np.float16))
    q = cp.asarray(rng.standard_normal((1, H, D)).astype(np.float32))
    out = cp.empty((1, H * D), cp.float32)
    depths = [int(x) for x in a.depths.split(",")]
    old_S = cb.att_splits(a.ctx)
    old_part = cp.empty((1, H, old_S, D + 2), cp.float32)
    print(f"ctx {a.ctx}; attn_decode S={old_S}")
    print("variant".ljust(44) + "regs  local  " + "  ".join(f"d{d:>6}" for d in depths))
    opts = ("-std=c++17", f"-DMAX_TOK={cb.DECODE_MAX_TOKENS}") + tuple(f"-D{d}" for d in a.defines)
    ref = None
    for label, path in [("committed", cb.OPS_SRC)] + [(Path(s).name, Path(s)) for s in a.src]:
        mod = cp.RawModule(code=path.read_text(), options=opts)
        f, comb = mod.get_function("attn_gqa_d4_f16"), mod.get_function("attn_combine")
        src = path.read_text()  # a file before attn_combine took COMBINE_THREADS ran it with 128
        combine_threads = cb.COMBINE_THREADS if "#define COMBINE_THREADS" in src else 128
        for min_run in (int(x) for x in a.min_runs.split(",")):
            S = max(1, min(cb.GQA_MAX_SPLITS, -(-a.ctx // min_run)))
            part = cp.empty((1, H, S, D + 2), cp.float32)
            row = []
            for d in depths:
                pos = cp.asarray(np.array([d], np.int32))

                def call():
                    f((Hkv, 1, S), (cb.GQA_THREADS,), (q, K, V, part, pos, np.int32(H), np.int32(Hkv), np.int32(D),
                                                       np.int32(D), np.float32(0.088), np.int32(0), np.float32(0),
                                                       np.int32(min_run), np.int32(0), NULL))
                    comb((H, 1), (combine_threads,), (part, part, out, np.int32(H), np.int32(S), np.int32(S), np.int32(D), pos,
                                          np.int32(0), np.int32(min_run), np.int32(0), NULL, NULL, NULL))
                row.append(timed(call))
                if d == depths[-1]:  # every variant's output at the deepest position: the same
                    got = out.get()
                    ref = got if ref is None else ref
                    err = float(np.abs(got - ref).max())
            attrs = f.attributes
            print(f"{label} gqa min_run {min_run:3d} (S {S:3d})".ljust(44)
                  + f"{attrs['num_regs']:4d} {attrs['local_size_bytes']:6d}  " + "  ".join(f"{t:7.1f}" for t in row)
                  + f"   max |out - first| {err:.2e}", flush=True)
        f = mod.get_function("attn_decode_f16")
        row = []
        for d in depths:
            pos = cp.asarray(np.array([d], np.int32))

            def call():
                f((H, 1, old_S), (32 * cb.ATT_WARPS,), (q, K, V, old_part, pos, np.int32(H), np.int32(Hkv),
                                                         np.int32(D), np.int32(D), np.float32(0.088), np.int32(0),
                                                         np.float32(0), np.int32(0), NULL))
                comb((H, 1), (combine_threads,), (old_part, NULL, out, np.int32(H), np.int32(old_S), np.int32(0), np.int32(D),
                                      pos, np.int32(0), np.int32(0), np.int32(0), NULL, NULL, NULL))
            row.append(timed(call))
        print(f"{label} attn_decode (per head)".ljust(44) + f"{f.attributes['num_regs']:4d} "
              f"{f.attributes['local_size_bytes']:6d}  " + "  ".join(f"{t:7.1f}" for t in row), flush=True)
    kv_bytes = [2 * (d + 1) * Hkv * D * 2 for d in depths]
    print("KV bytes read (MB)".ljust(56) + "  ".join(f"{b / 1e6:7.2f}" for b in kv_bytes))


if __name__ == "__main__":
    main()
