"""Where a decode step's wall time goes when the routed experts are computed on the CPU (``--cpu-moe``).

Loads a model with every layer on the GPU and every routed expert in host RAM (the
``cpu-moe-tg64`` case of bench/vs_llamacpp.py), runs ``-n`` single-token decode steps and splits
each step's wall time, per MoE layer, into: waiting for the routing (the GPU runs the layer's
attention and router, then the ids and weights come to the host), the hidden state's copy to the
host, the CPU call (a layer's :class:`moecache.quants.cpu.RoutedExperts`, and of it the compiled
call alone), the result's copy back, and the rest
(Python and kernel launches of the dense ops, sampling). Host clocks only: every piece ends in a
host synchronisation already, so timing it adds nothing. OpenMP threads wait actively, as the
``moecache`` command sets them up for ``--cpu-moe`` (``OMP_WAIT_POLICY=PASSIVE`` or a
``GOMP_SPINCOUNT`` in the environment wins, to compare).

With a CUDA graph, the CPU-expert layers are handed over inside the graph by default
(:mod:`moecache.moe.handoff`; the time the host spends answering them, spins on the GPU's posts
included, is the "handoff" row); ``--cut`` ends the graph at each such layer instead (the "cut" row).

    python bench/cpu_moe_step.py -m /tmp/q30.gguf -n 32 [--load-mode pin] [-t 16] [--cut]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("-n", type=int, default=32, help="decode steps timed")
    ap.add_argument("-c", type=int, default=4096)
    ap.add_argument("-t", type=int, default=0, help="CPU threads (0 = physical cores minus one, as the moecache "
                    "command resolves -t with one GPU; active waiting needs that free core)")
    ap.add_argument("--load-mode", default="pin", choices=("pin", "mmap"))
    ap.add_argument("--no-graph", action="store_true", help="decode op by op (no CUDA graph)")
    ap.add_argument("--cut", action="store_true", help="end the graph at each CPU-expert layer (graph segments) "
                    "instead of the host handoff inside it")
    a = ap.parse_args()
    from moecache.threads import openmp_wait_for_args

    import psutil

    if not a.t:
        a.t = max(1, (psutil.cpu_count(logical=False) or 2) - 1)
    print("OpenMP wait:", openmp_wait_for_args(["--cpu-moe", "-t", str(a.t)]))  # as the moecache command
    import numba

    try:
        from moecache.backends import cuda_graph
    except ImportError:  # no CuPy: a CPU run (op by op), for trying the script out
        cuda_graph = None
    from moecache.engine import Engine, EngineConfig
    from moecache.moe import executor as ex
    from moecache.moe.routing import Routing
    from moecache.placement import PlacementOptions
    from moecache.quants import cpu

    if a.t:
        numba.set_num_threads(a.t)
    acc: dict[str, float] = defaultdict(float)
    calls = [0]
    kern = [0.0]  # seconds in the compiled MoE kernel (inside the CPU call's time)
    seen: list = []  # (a CPUExperts, a layer) the steps called

    def timed_call(self, il, h, routing):  # CPUExperts.__call__ with clocks (same steps)
        seen[:] = [(self, il)]
        t0 = time.perf_counter()
        e = self.layers[il]
        r = routing.host()
        t1 = time.perf_counter()
        be = self.backend
        hh = np.ascontiguousarray(be.to_host(h), dtype=np.float32)
        t2 = time.perf_counter()
        out = self.compute_host(il, hh, r, np.zeros((hh.shape[0], e.down.shape[1]), np.float32))
        t3 = time.perf_counter()
        res = be.asarray(out)
        t4 = time.perf_counter()
        acc["routing to host (waits for the GPU)"] += t1 - t0
        acc["h to host"] += t2 - t1
        acc["result to GPU"] += t4 - t3
        return res

    def timed_compute_host(self, il, h, routing, out, _orig=ex.CPUExperts.compute_host):
        seen[:] = [(self, il)]
        t0 = time.perf_counter()
        r = _orig(self, il, h, routing, out)
        acc["the CPU call (Python + compiled)"] += time.perf_counter() - t0
        calls[0] += 1
        return r

    def timed_kernel(kernel):  # the compiled call alone
        def timed(*args):
            t0 = time.perf_counter()
            res = kernel(*args)
            kern[0] += time.perf_counter() - t0
            return res
        timed.timed = True
        return timed

    def timed_kernel_factory(*key, _orig=cpu._moe_kernel):  # moe_ffn_routed's kernel (a call's fallback)
        return timed_kernel(_orig(*key))

    def timed_routed_call(self, *args, _orig=cpu.RoutedExperts.__call__):  # a layer's prepared call: its
        if not getattr(self.kernel, "timed", False):  # kernel, found when it was made, timed from now on
            self.kernel = timed_kernel(self.kernel)
        return _orig(self, *args)

    def timed_cut(self, stream):  # graph segments: the whole host part of a cut
        t0 = time.perf_counter()
        orig_cut(self, stream)
        acc["cut: sync + copies (graph)"] += time.perf_counter() - t0

    def timed_serve(self):  # the host handoff: spins on the GPU's posts + the answers
        t0 = time.perf_counter()
        orig_serve(self)
        acc["handoff: spins + answers (graph)"] += time.perf_counter() - t0

    orig_cut = cuda_graph._Cut.run if cuda_graph is not None else None
    orig_serve = cuda_graph._HandoffExperts.serve if cuda_graph is not None else None

    cfg = EngineConfig(n_ctx=a.c, n_ubatch=512, cache_type="f16", n_threads=a.t)
    rng = np.random.default_rng(0)
    with Engine(a.model, cfg, log=print, load_mode=a.load_mode, cuda_graph=not a.no_graph, graph_handoff=not a.cut,
                placement=PlacementOptions(n_gpu_layers=99, cpu_moe=True, moe_cache=0)) as eng:
        vocab = eng.gguf.config.n_vocab
        for _ in range(4):
            eng.eval([int(rng.integers(0, vocab))])
        ex.CPUExperts.__call__ = timed_call
        timed_compute_host.__wrapped_orig__ = ex.CPUExperts.compute_host
        ex.CPUExperts.compute_host = timed_compute_host
        cpu._moe_kernel = timed_kernel_factory
        cpu.RoutedExperts.__call__ = timed_routed_call
        if cuda_graph is not None:
            cuda_graph._Cut.run = timed_cut
            cuda_graph._HandoffExperts.serve = timed_serve
        toks = rng.integers(0, vocab, a.n)
        t0 = time.perf_counter()
        for t in toks:
            eng.eval([int(t)])
        wall = time.perf_counter() - t0
        mode = "op by op" if eng.model.decode_graph is None else \
            "CUDA graph, graph segments" if a.cut else "CUDA graph, host handoff"
        acc_steps, kern_steps, calls_steps = dict(acc), kern[0], calls[0]
        # the same kernel back to back on one layer's experts (random routing, no GPU between calls)
        b2b = None
        if seen:
            cx, il = seen[0]
            e = cx.layers[il]
            k = eng.gguf.config.n_expert_used
            n_exp = e.gate.shape[0]
            args = [(rng.standard_normal((1, e.down.shape[1])).astype(np.float32),
                     Routing(rng.choice(n_exp, k, replace=False).astype(np.int32)[None], np.full((1, k), 1 / k, np.float32)),
                     np.zeros((1, e.down.shape[1]), np.float32)) for _ in range(64)]
            kern[0] = 0.0
            t0 = time.perf_counter()
            for hh, r, out in args:
                ex.CPUExperts.compute_host.__wrapped_orig__(cx, il, hh, r, out)
            b2b = ((time.perf_counter() - t0) / 64, kern[0] / 64)
    acc, calls[0] = acc_steps, calls_steps
    kern[0] = kern_steps
    n = a.n
    layers = calls[0] / n
    print(f"\n{a.model.name}: {n} decode steps, {layers:.0f} CPU-expert layers per step, {numba.get_num_threads()} "
          f"threads, load mode {a.load_mode}, {mode}")
    for k in ("cut: sync + copies (graph)", "handoff: spins + answers (graph)"):
        if k in acc:  # the kernel's time is inside the cut's or the handoff's
            acc[k] -= acc["the CPU call (Python + compiled)"]
    print(f"wall {wall / n * 1e3:.2f} ms/token ({n / wall:.2f} t/s)")
    rest = wall - sum(acc.values())
    rows = [*acc.items(), ("  of it the compiled kernel", kern[0]), ("rest (dense ops, launches, sampling)", rest)]
    for k, v in rows:
        if not calls[0]:
            break
        print(f"  {k:40s} {v / n * 1e3:7.2f} ms/token {v / calls[0] * 1e6:8.1f} µs/layer {100 * v / wall:5.1f}%")
    if b2b is not None:
        print(f"back to back on layer {seen[0][1]}'s experts (64 calls, random routing, no GPU between them): "
              f"the CPU call {b2b[0] * 1e6:.1f} µs/call, of it the compiled kernel {b2b[1] * 1e6:.1f}")


if __name__ == "__main__":
    main()
