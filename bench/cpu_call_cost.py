"""What one call of the CPU's MoE kernel costs beyond reading its experts: the fixed cost that a
batched decode step pays once per handed-over layer (48 times a step at 8 GiB on the H200 machine),
and twice per layer when the step runs in two halves (``CachedExperts.decode_halves``).

Random experts of a Qwen3-30B-A3B layer (Q4_K gate and up, Q6_K down; n_embd 2048, n_ff 768),
page-locked when CuPy is there (as ``--load-mode pin`` holds them), and per (tokens, pairs, threads)
the median of ``-n`` calls of :func:`moecache.quants.cpu.moe_ffn_routed` (the handoff's answer, as
``CachedExperts._split_compute`` made it until the thirty-seventh session), of the layer's prepared
call (:class:`moecache.quants.cpu.RoutedExperts`, the engine's call since: the weights checked once)
and of the compiled kernel called directly (without any Python checks); pairs 0 is the call without
work (Python and dispatch only). Each pair is a distinct expert, as the CPU's misses of one layer
nearly always are at 8 tokens. The "fixed" cost printed is the intercept of a least-squares line
through the pair counts >= 1 (of ``moe_ffn_routed``'s medians), its slope the time per expert: an
extrapolation, not a measured call (the 0-pair call returns before any parallel work: 2-15 µs on the
H200 machine), and a line through two points only is said to be one. Needs otherwise idle cores: a
thread that loses its core for a time slice makes a case's median milliseconds, not microseconds
(the minimum is printed beside it to show that).

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=30000000 python bench/cpu_call_cost.py [-n 300] [--threads 16,8,4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=300, help="calls per case (the median is printed)")
    ap.add_argument("--threads", default=None, help="comma list of Numba thread counts (default: all)")
    ap.add_argument("--tokens", default="8,4", help="comma list of token counts (rows of h)")
    ap.add_argument("--pairs", default="0,1,2,4,8", help="comma list of pair counts (distinct experts)")
    ap.add_argument("--q8", action="store_true", help="activations rounded to 8 bits (act_q8), as the engine's "
                    "expert cache calls the kernel by default; without it, float32 activations")
    a = ap.parse_args()
    import numba

    from moecache.quants import cpu
    from moecache.quants.formats import FORMATS
    from moecache.quants.random_blocks import random_experts

    fm = (FORMATS["Q4_K"], FORMATS["Q4_K"], FORMATS["Q6_K"])
    n_embd, ff, n_exp, k = 2048, 768, 16, 8
    rng = np.random.default_rng(0)
    experts = random_experts(fm, n_exp, n_embd, ff, rng)
    try:
        import cupyx

        def pinned(x):
            y = cupyx.empty_pinned(x.shape, x.dtype)
            y[...] = x
            return y
        experts = tuple(pinned(x) for x in experts)
        where = "page-locked"
    except ImportError:
        where = "pageable"
    g, u, d = experts
    types = tuple(f.ggml_type for f in fm)
    kern = cpu._moe_kernel(*types, a.q8)
    prepared = cpu.RoutedExperts(g, u, d, types, cpu.ACT_SILU, a.q8)  # the engine's call since the 37th session
    most = numba.get_num_threads()
    threads = [int(x) for x in a.threads.split(",")] if a.threads else [most]
    print(f"threading layer {numba.threading_layer() if _warm(kern, cpu, g, u, d, most) else '?'}, "
          f"{most} threads at most, experts {where}, activations {'8-bit' if a.q8 else 'float32'}, {a.n} calls a case")

    def med(f) -> tuple[float, float]:
        """(median, minimum) of ``-n`` calls, µs."""
        f()
        ts = []
        for _ in range(a.n):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e6, float(np.min(ts)) * 1e6

    for nt in threads:
        numba.set_num_threads(nt)
        for T in (int(x) for x in a.tokens.split(",")):
            rows = []
            for npairs in (int(x) for x in a.pairs.split(",")):
                ids = np.full((T, k), -1, np.int32)
                for p in range(npairs):  # distinct experts, spread over the tokens
                    ids[p % T, p // T] = (p * 5) % n_exp
                w = np.full((T, k), 0.25, np.float32)
                h = rng.standard_normal((T, n_embd)).astype(np.float32)
                out = np.zeros((T, n_embd), np.float32)
                (full, full_min) = med(lambda: cpu.moe_ffn_routed(g, u, d, types, ids, w, h, out, act_q8=a.q8))
                (direct, direct_min) = med(lambda: kern(g, u, d, False, cpu._NO_I32, cpu._NO_I32, cpu._NO_I32,
                                                        cpu._NO_F32, ids, w, h, cpu.ACT_SILU, out, cpu.STEP, nt))
                (prep, prep_min) = med(lambda: prepared(ids, w, h, out))
                rows.append((npairs, full, direct))
                print(f"threads {nt:2d}, {T} tokens, {npairs} pairs: moe_ffn_routed {full:8.1f} us (min {full_min:.1f}), "
                      f"prepared {prep:8.1f} us (min {prep_min:.1f}), "
                      f"compiled call {direct:8.1f} us (min {direct_min:.1f})")
            x = np.array([r[0] for r in rows if r[0] > 0], float)
            if x.size >= 2:
                y = np.array([r[1] for r in rows if r[0] > 0])
                slope, icpt = np.polyfit(x, y, 1)
                said = []
                if x.size == 2:
                    said.append("a line through two points")
                if slope <= 0 or icpt < 0:
                    said.append("a slope or intercept below 0: noise (busy cores?)")
                print(f"threads {nt:2d}, {T} tokens: fixed {icpt:.1f} us a call + {slope:.1f} us an expert "
                      f"(moe_ffn_routed's medians, least squares over pairs >= 1"
                      f"{'; ' + ', '.join(said) if said else ''})")


def _warm(kern, cpu, g, u, d, nt) -> bool:
    """One call, so that the threading layer is chosen."""
    ids = np.zeros((1, 8), np.int32)
    kern(g, u, d, False, cpu._NO_I32, cpu._NO_I32, cpu._NO_I32, cpu._NO_F32, ids, np.ones((1, 8), np.float32),
         np.zeros((1, 2048), np.float32), cpu.ACT_SILU, np.zeros((1, 2048), np.float32), cpu.STEP, nt)
    return True


if __name__ == "__main__":
    main()
