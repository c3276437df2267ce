"""A/B of the float16 prompt MoE's chunking on the GPU: fewer chunks (launches) or fewer GEMM shapes
against more padded rows.

``CupyBackend._moe_prompt`` cuts a layer's used experts into chunks (one dequantization and one
batched cuBLAS GEMM per matrix each, :func:`moecache.backends.ops.moe_prompt_chunks`): a chunk
holds experts of at least 1 / ratio of its largest count (``prompt_chunk_ratio``, 2 by default) and
pads their rows to that count rounded up to 16, or with ``prompt_m_pow2`` to a power of two. At
pp512 a layer made 7.8 chunks (every expert on the GPU) and a prompt ran 156 distinct cuBLAS
kernels, with GPU gaps of 3-4 ms before some of them (``bench/results/vs-llamacpp-h200.md``,
thirty-ninth session): both host launches and first uses of kernels may cost more than the padded
rows' arithmetic. This script loads the model once as ``moecache bench`` does (the library's settings
road; every layer and expert on the GPU unless ``--vram-budget``), then evaluates fresh prompts
with the arms interleaved (a warm-up prompt per arm first), and prints per arm the prompts' t/s,
the chunks per MoE call, the distinct (experts, padded rows) shapes it used and the padded rows per
routed pair. ``CUDA_MODULE_LOADING=EAGER`` in the environment loads every kernel at start (the
gaps' other test).

    python bench/prompt_chunks.py -m /tmp/q30.gguf -p 512 -r 5 --arms 2,0 4,0 2,1 4,1
    python bench/prompt_chunks.py -m /tmp/q30.gguf -p 512 -r 5 --vram-budget 8GiB --routing qwen3-moe

``--count`` runs on the CPU, with no model: the plans alone of ``-r`` prompts of ``-p`` tokens drawn
by a routing preset (``--routing``, qwen3-moe by default) for Qwen3-30B-A3B's shape (48 layers, 128
experts, top-8, n_embd 2048, expert ff 768), one MoE call a layer as with every expert on the GPU:

    python bench/prompt_chunks.py --count -p 512 -r 6 [--resident 0.35]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np


def parse_arm(s: str) -> tuple[int, bool]:
    """'RATIO,POW2' (e.g. '4,1') -> (ratio >= 1, pow2)."""
    try:
        r, p = s.split(",")
        ratio, pow2 = int(r), bool(int(p))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an arm is RATIO,POW2 (e.g. 4,1), got {s!r}") from None
    if ratio < 1:
        raise argparse.ArgumentTypeError(f"an arm's ratio must be >= 1, got {ratio}")
    return ratio, pow2


class ChunkCounter:
    """Wraps a prompt-MoE plan function (:func:`moecache.backends.moe_plan.layer_plan`'s signature and
    return) and records each call's chunks: ``calls`` holds (chunks, padded rows, routed pairs) per
    call, ``shapes`` the distinct (experts, padded rows per expert) of the chunks; :meth:`clear`
    starts over."""

    def __init__(self, plan):
        self.plan = plan
        self.calls: list[tuple[int, int, int]] = []
        self.shapes: set[tuple[int, int]] = set()

    def __call__(self, *args, **kw):
        out = self.plan(*args, **kw)
        chunks, _, _, n_r, n_p = out
        self.calls.append((len(chunks), int(n_r), int(n_p)))
        self.shapes.update((int(c), int(m)) for c, m in chunks)
        return out

    def clear(self) -> None:
        self.calls, self.shapes = [], set()


def table(rows: list[tuple[str, list[float], list[tuple[int, int, int]], set]]) -> list[str]:
    """Markdown lines, one row per arm: (name, t/s samples (none: '-'), its MoE calls' (chunks,
    padded rows, pairs), its distinct chunk shapes)."""
    out = ["| arm | t/s median | samples | chunks per MoE call | distinct (experts, rows) shapes | padded rows per pair |",
           "| --- | ---: | --- | ---: | ---: | ---: |"]
    for name, ts, calls, shapes in rows:
        n_calls, pairs = max(1, len(calls)), max(1, sum(c[2] for c in calls))
        med = f"{statistics.median(ts):.0f}" if ts else "-"
        out.append(f"| {name} | {med} | {', '.join(f'{x:.0f}' for x in ts) or '-'} | "
                   f"{sum(c[0] for c in calls) / n_calls:.2f} | {len(shapes)} | {sum(c[1] for c in calls) / pairs:.2f} |")
    return out


def count_only(arms: list[tuple[int, bool]], n_prompt: int, reps: int, routing: str,
               resident: float = 0.0, group: int = 50) -> list[str]:
    """The plans of ``reps`` prompts of ``n_prompt`` tokens under routing preset ``routing`` for
    Qwen3-30B-A3B's shape, per arm (the GPU's float16 scratch and activation bounds): markdown lines
    as :func:`table`'s, with no t/s. ``resident`` > 0 splits each layer's calls as the expert
    cache's prompt groups do, roughly: that fraction of the layer's experts, the pass's most used,
    in one call (the slots), the other used ones ``group`` at a time by id (128 MiB groups of
    2.53 MiB experts), each call's other pairs of no expert. The cache's real slots follow its
    usage history, not the pass's own counts: an approximation."""
    from moecache.backends.moe_plan import layer_plan
    from moecache.backends.ops import MOE_ACT_BYTES, MOE_PROMPT_M_ALIGN, MOE_SCRATCH_BYTES
    from moecache.moe.routing_process import make_routing

    n_layer, n_expert, k, n_embd, ff = 48, 128, 8, 2048, 768
    max_experts = max(1, MOE_SCRATCH_BYTES // (2 * ff * n_embd))  # float16 dequantized matrices
    rp = make_routing(routing, n_layer, n_expert, k, seed=0)
    passes = []
    for _ in range(reps):
        if hasattr(rp, "new_prompt"):
            rp.new_prompt()
        passes += [np.asarray(rp.route(il, n_prompt).ids) for il in range(n_layer)]
    out = table([])
    calls = []
    for ids in passes:
        if resident <= 0:
            calls.append(ids)
            continue
        counts = np.bincount(ids.reshape(-1), minlength=n_expert)
        slots = np.argsort(-counts, kind="stable")[:int(resident * n_expert)]
        used = np.flatnonzero(counts)
        rest = np.setdiff1d(used, slots)
        for sel in [slots] + [rest[i:i + group] for i in range(0, rest.size, group)]:
            calls.append(np.where(np.isin(ids, sel), ids, -1).astype(np.int32))
    for ratio, pow2 in arms:
        c = ChunkCounter(layer_plan)
        for ids in calls:
            c(ids, n_expert, max_experts, 4 * max(n_embd, ff), MOE_ACT_BYTES, MOE_PROMPT_M_ALIGN, ratio, pow2)
        out += table([(f"ratio {ratio}, {'pow2' if pow2 else 'align 16'}", [], c.calls, c.shapes)])[2:]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="the GGUF (not with --count)")
    ap.add_argument("--count", action="store_true", help="the plans alone, on the CPU, no model (see above)")
    ap.add_argument("--resident", type=float, default=0.0, help="with --count: that fraction of a layer's experts "
                    "in slots, the rest in prompt groups (count_only's approximation of the expert cache)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-r", "--reps", type=int, default=5, help="timed prompts per arm (after one warm-up each)")
    ap.add_argument("--arms", type=parse_arm, nargs="+", default=[(2, False), (4, False), (2, True), (4, True)],
                    help="RATIO,POW2 per arm (the first is the default road: 2,0)")
    ap.add_argument("--vram-budget", default=None, help="with an expert cache (as --vram-budget); default: none")
    ap.add_argument("--routing", default=None, help="--routing preset (with --vram-budget); default: the model's router")
    ap.add_argument("--load-mode", default="pin")
    ap.add_argument("-t", "--threads", type=int, default=15)
    a = ap.parse_args(argv)
    if a.count:
        print("\n".join(count_only(a.arms, a.n_prompt, a.reps, a.routing or "qwen3-moe", a.resident)))
        return 0
    if not a.model:
        ap.error("-m MODEL is needed (or --count)")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prompt_timeline import timed_prompt

    try:
        import moecache.backends.cupy_backend as cb
    except ImportError as e:
        raise SystemExit(f"prompt_chunks: the chunking is the GPU's, and CuPy is not importable here ({e})")
    from moecache.llm import open_llm
    from moecache.settings import Settings

    counter = ChunkCounter(cb.layer_plan)
    cb.layer_plan = counter  # this process only: the backend's calls are counted
    settings = Settings(n_ctx=a.n_prompt, n_gpu_layers=99, moe_cache=-1 if a.vram_budget else None,
                        vram_budget=a.vram_budget, routing=a.routing, load_mode=a.load_mode, n_threads=a.threads)
    with open_llm(a.model, settings, command="bench", log=lambda m: print(m, file=sys.stderr, flush=True)) as llm:
        eng = llm.engine
        bes = list({id(b): b for b in eng.model.layer_be if hasattr(b, "prompt_chunk_ratio")}.values())
        if not bes:
            raise SystemExit("no GPU backend: the chunking is the GPU's")
        prompt = timed_prompt(eng, a.n_prompt, np.random.default_rng(0), eng.gguf.config.n_vocab)

        def arm_set(arm: tuple[int, bool]) -> None:
            for b in bes:
                b.prompt_chunk_ratio, b.prompt_m_pow2 = arm

        names = [f"ratio {r}, {'pow2' if p else 'align 16'}" for r, p in a.arms]
        rows = [(n, [], [], set()) for n in names]
        for arm, name in zip(a.arms, names):  # warm-ups: each arm's first kernels loaded off the clock
            arm_set(arm)
            print(f"warm-up, {name}: {a.n_prompt / prompt():.0f} t/s")
        for rep in range(a.reps):
            for arm, (name, ts, calls, shapes) in zip(a.arms, rows):
                arm_set(arm)
                counter.clear()
                dt = prompt()
                ts.append(a.n_prompt / dt)
                calls += counter.calls
                shapes |= counter.shapes
                print(f"round {rep}, {name}: {a.n_prompt / dt:.0f} t/s, {sum(c[0] for c in counter.calls)} chunks "
                      f"in {len(counter.calls)} MoE calls, {len(counter.shapes)} shapes", flush=True)
        arm_set(a.arms[0])
    print("\n" + "\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
