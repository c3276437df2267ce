"""Same-lease A/B of the two GPU prompt-MoE paths: float16 tensor-core GEMMs of dequantized experts
(the default) against the grouped 8-bit kernels (``Engine(gpu_prompt_q8=True)``: each expert's
quantized rows read in place once per group of up to 16 tokens, activations rounded to int8).

Loads one engine with every layer on the GPU and switches each GPU backend's ``prompt_q8`` between
repetitions (same weights, same KV cache size); with an expert cache a third arm also triples the
cache's prompt group bytes (fewer, larger groups: fewer launches, more VRAM at once; the pieces and
their concatenation are both held). Per arm: pp t/s of a ``-p``-token prompt in
``-ub`` ubatches (median and spread of ``-r`` runs after one warm-up each), the last token's logits
against the first arm's (max |diff| relative to the logits' spread, top-1 agreement), and how much
CuPy's pool grew during the arm's warm-up prompt (started from an emptied pool: the prompt's
transient VRAM beyond the live arrays). ``--vram-budget``/``--load-mode`` put the routed experts behind
the expert cache as ``run`` does (the prompt then goes through the cache's prompt path).

    python bench/prompt_q8.py -m /tmp/q30.gguf -p 512 -r 5 [-ub 512] [--vram-budget 8GiB --load-mode pin]

``--ab prefetch`` compares instead, with every routed expert in host RAM (``--cpu-moe``, the
``pinned-*`` cases of ``../shared/vs-llamacpp.md``), the op offload that copies each layer's used
experts before computing them against ``Engine(prefetch_experts=True)``, which copies the next
layer's experts on a copy stream while the current layer computes (``moecache/moe/prefetch.py``):

    python bench/prompt_q8.py -m /tmp/q30.gguf --ab prefetch --load-mode pin -p 2048 -ub 2048 -r 3

``--ab cache`` compares, behind the expert cache (``--vram-budget``), its prompt paths from
empty slots (as ``bench -p N -r R`` runs it: a prompt fills no slot), each arm's warm-up and
repetitions in a row, a different prompt each (the same list in every arm): the groups of
``prompt_group_bytes`` (``prompt_stacks`` False, the default: residents read in their slots, two
group buffers, the next group's copy on the copy stream while one computes) against the stacks (``CachedExperts.prompt_stacks``, the default: one stack of the layer's
experts per layer) with two buffers (the next layer's non-resident experts copied on the copy
stream while this one computes) and with one (``prompt_stack_buffers = 1``, the default: no copy
ahead, half the memory), and one buffer in halves (``prompt_stack_halves``, opt-in: the next
layer's half of the experts copied while this layer's other half computes), and the groups with the
next layer's first group copied during this layer (``prompt_group_ahead``, on by default). ``--routing``
replaces the routers' choices as ``bench --routing`` does (the ``8g-*`` cases use qwen3-moe),
restarted at the same seed for the same prompt in every arm, so the arms' last logits compare:

    python bench/prompt_q8.py -m /tmp/q30.gguf --ab cache --vram-budget 8GiB --load-mode pin --routing qwen3-moe -r 3

With ``--ab cache`` each arm also counts the pool's device allocations during its timed prompts,
those of this (the main) thread: CuPy's hooks are per thread.

``--ab keep`` compares, as ``--ab cache`` does (each arm from empty slots, its warm-up prompt then
``-r`` prompts in a row), the groups with the next layer's first group ahead without and with
``CachedExperts.prompt_keep`` (on by default: each prompt leaves experts it copied in the slots that
are empty, so the prompts after the warm-up read those from their slots), twice in turn (off, on,
off, on: a drift shows as a difference between the two runs of one arm):

    python bench/prompt_q8.py -m /tmp/q30.gguf --ab keep --vram-budget 8GiB --load-mode pin --routing qwen3-moe -r 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def main() -> None:
    import cupy as cp

    from moecache.engine import Engine, EngineConfig
    from moecache.placement import PlacementOptions
    from moecache.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("-p", type=int, default=512, help="prompt tokens")
    ap.add_argument("-ub", type=int, default=512, help="ubatch")
    ap.add_argument("-r", type=int, default=5, help="timed prompts per path")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--load-mode", default="mmap")
    ap.add_argument("--ab", choices=("q8", "prefetch", "cache", "keep"), default="q8",
                    help="q8: float16 GEMMs vs the grouped 8-bit kernels; prefetch: --cpu-moe op offload "
                         "without and with the next layer's experts copied during the current one; cache: the "
                         "expert cache's prompt groups vs its prompt stacks with two and with one buffer (from "
                         "empty slots, a new prompt each repetition); keep: the cache's prompt groups without and "
                         "with prompt_keep (as cache: from empty slots, a new prompt each repetition)")
    ap.add_argument("--routing", default=None, help="replace the routers' choices (qwen3-moe, low-locality, uniform)")
    ap.add_argument("--fresh", action="store_true", help="a different prompt for each repetition (as `moecache bench` "
                    "draws them; default: the warm-up's prompt again, except with --ab cache or keep)")
    a = ap.parse_args()
    prefetch = a.ab == "prefetch"
    cache_ab = a.ab in ("cache", "keep")  # arms of the expert cache's prompt paths, each from empty slots
    if cache_ab and a.vram_budget is None:
        raise SystemExit(f"--ab {a.ab} needs --vram-budget (the expert cache exists only when the model does not fit)")
    if prefetch and (a.load_mode != "pin" or a.vram_budget is not None):
        raise SystemExit("--ab prefetch needs --load-mode pin (an asynchronous copy needs page-locked weights) and "
                         "no --vram-budget (every expert in host RAM, --cpu-moe)")
    if prefetch:
        opts = PlacementOptions(n_gpu_layers=99, cpu_moe=True)
    elif a.vram_budget is None:
        opts = PlacementOptions(n_gpu_layers=99)
    else:
        opts = PlacementOptions(vram_budget=parse_size(a.vram_budget, "--vram-budget"))
    cfg = EngineConfig(n_ctx=a.p + 16, n_batch=max(a.p, a.ub), n_ubatch=a.ub)
    rng = np.random.default_rng(0)
    pool = cp.get_default_memory_pool()
    with Engine(a.model, cfg, placement=opts, load_mode=a.load_mode, log=print, prefetch_experts=prefetch) as eng:
        prompts = [rng.integers(0, eng.gguf.config.n_vocab, a.p) for _ in range(a.r + 1)]
        if a.routing:
            from moecache.moe.routing_process import make_routing

            c = eng.gguf.config
            eng.model.routing_override = make_routing(a.routing, c.n_layer, c.n_expert, c.n_expert_used, seed=0)
            if hasattr(eng.model.routing_override, "draw_passes_ahead"):
                eng.model.routing_override.draw_passes_ahead = True  # as moecache.llm sets it on a GPU
        if cache_ab and not eng.caches:
            raise SystemExit(f"--ab {a.ab}: the model fits at this budget, there is no expert cache")
        bes = {id(b): b for b in eng.model.layer_be if hasattr(b, "prompt_q8")}
        print(f"{len(bes)} GPU backend(s); prompt {a.p} tokens, -ub {a.ub}")
        host = [e for e in eng.model.experts.executors.values() if getattr(e, "prefetch", None) is not None]
        shared = host[0].prefetch if host else None
        if prefetch and shared is None:
            raise SystemExit("--ab prefetch: no host-expert layer offloads its prompts to a GPU here")

        # (name, grouped 8-bit, cache group bytes factor, next layer prefetched / slots read in place,
        #  from empty slots)
        if prefetch:
            arms = [("op offload", False, 1, False, False), ("prefetch next layer", False, 1, True, False)]
        elif a.ab == "cache":  # the fourth field: prompt_stacks (2: with prompt_stack_buffers 1; 3: and in halves;
            # 4: no stacks, the groups with prompt_group_ahead)
            arms = [("groups, empty slots", False, 1, False, True),
                    ("groups, next layer's first group ahead, empty slots", False, 1, 4, True),
                    ("stacks, empty slots", False, 1, True, True),
                    ("stacks, 1 buffer, empty slots", False, 1, 2, True),
                    ("stacks, 1 buffer in halves, empty slots", False, 1, 3, True)]
        elif a.ab == "keep":  # the fourth field 5: the groups with prompt_group_ahead and prompt_keep
            arms = [("groups, no keeps", False, 1, 4, True), ("groups, keeps", False, 1, 5, True)] * 2
        else:
            arms = [("float16 GEMMs", False, 1, False, False), ("grouped 8-bit", True, 1, False, False)]
            if eng.caches:  # the expert cache's prompt groups: 3x the bytes a group
                arms.append(("grouped 8-bit, 3x group bytes", True, 3, False, False))
        base_group = {id(c): c.prompt_group_bytes for c in eng.caches}

        def prompt(arm: tuple, i: int) -> tuple[float, np.ndarray]:
            """Prompt i (the first again unless --fresh or --ab cache) through arm's setting: t/s, last logits."""
            for b in bes.values():
                b.prompt_q8 = arm[1]
            for c in eng.caches:
                c.prompt_group_bytes = base_group[id(c)] * arm[2]
                if cache_ab:
                    c.prompt_keep = arm[3] == 5
                    c.prompt_stacks = arm[3] in (True, 2, 3)
                    c.prompt_stack_halves = arm[3] == 3
                    c.prompt_group_ahead = arm[3] in (4, 5)
                    if not c.prompt_group_ahead:
                        c.drop_group_buffers()  # the arm before's kept buffers: not this arm's memory
                    if c.prompt_stack_buffers != (1 if arm[3] in (2, 3) else 2):
                        c.drop_stacks()
                        c.prompt_stack_buffers = 1 if arm[3] in (2, 3) else 2
            for e in host:
                e.prefetch = shared if arm[3] is True else None
            toks = prompts[i if cache_ab or a.fresh else 0]
            restart = getattr(eng.model.routing_override, "restart", None)  # a trace file replays as it is
            if restart is not None:
                restart(i)
            prime = getattr(eng.model.routing_override, "draw_ahead", None)
            if prime is not None:  # the first ubatch's routing drawn before the clock, as `moecache bench` does
                prime(min(a.p, eng.n_ubatch))
            eng.reset()
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            lg = eng.eval(toks)[-1]
            cp.cuda.Device().synchronize()
            return a.p / (time.perf_counter() - t0), np.asarray(lg, np.float64)

        class Allocs(cp.cuda.MemoryHook):
            """Counts the pool's requests to the driver (cudaMalloc: a block no free one could serve)."""

            name = "allocs"

            def __init__(self) -> None:
                self.n = self.bytes = 0

            def alloc_postprocess(self, **kw: object) -> None:
                self.n += 1
                self.bytes += int(kw["mem_size"])

        allocs = Allocs()
        ts: dict[str, list[float]] = {arm[0]: [] for arm in arms}
        started = shared.started if prefetch else 0
        logits: dict[str, np.ndarray] = {}
        held: dict[str, int] = {}

        def warm_up(arm: tuple) -> None:
            """Kernels compiled, pool blocks made (each arm from an emptied pool; from empty slots if
            the arm says so)."""
            for c in eng.caches if arm[4] else ():
                c.preload(np.zeros_like(c.policy.usage))
            pool.free_all_blocks()
            before = pool.total_bytes()
            _, logits[arm[0]] = prompt(arm, 0)
            held[arm[0]] = pool.total_bytes() - before

        if cache_ab:  # each arm's own cache / pool state: its warm-up and repetitions in a row
            for arm in arms:
                warm_up(arm)
                moved0 = sum(c.offload.offloaded_bytes for c in eng.caches)
                keeps0 = sum(c.prompt_keeps for c in eng.caches)
                with allocs:
                    n0, b0 = allocs.n, allocs.bytes
                    for i in range(1, a.r + 1):
                        t, logits[arm[0]] = prompt(arm, i)  # the last prompt's logits are compared
                        ts[arm[0]].append(t)
                print(f"{arm[0]}: {allocs.n - n0} device allocations by CuPy's pool in the timed prompts "
                      f"({(allocs.bytes - b0) >> 20} MiB); experts copied from the host per timed prompt "
                      f"{(sum(c.offload.offloaded_bytes for c in eng.caches) - moved0) / a.r / 1e9:.2f} GB; "
                      f"experts kept in slots in the timed prompts {sum(c.prompt_keeps for c in eng.caches) - keeps0}, "
                      f"in all {sum(c.prompt_keeps for c in eng.caches)}")
                free, total = cp.cuda.runtime.memGetInfo()
                print(f"{arm[0]}: {sum(c.prompt_slot_reads for c in eng.caches)} experts read from slots so far; "
                      f"next-layer copies (started, used, dropped) {[c.stack_prefetch for c in eng.caches]}, "
                      f"first groups ahead {[c.group_prefetch for c in eng.caches]}; "
                      f"GPU memory in use now {(total - free) >> 20} MiB, CuPy pool {pool.total_bytes() >> 20} MiB")
        else:
            for arm in arms:
                warm_up(arm)
            if prefetch and shared.started == started:
                raise SystemExit("--ab prefetch: the warm-up prompt began no upload (ubatch too small, or the "
                                 "weights are not page-locked): the two arms would be the same")
            for i in range(1, a.r + 1):  # alternated, so drift hits every arm alike
                for arm in arms:
                    ts[arm[0]].append(prompt(arm, i)[0])
        if prefetch:
            print(f"prefetch: {shared.started} uploads begun, {shared.used} used, {shared.dropped} dropped, "
                  f"{shared.bytes / 2**30:.1f} GiB")
        ref = logits[arms[0][0]]
        for name in dict.fromkeys(arm[0] for arm in arms):
            v = ts[name]
            d = logits[name] - ref
            print(f"{name:30s} pp{a.p}: median {statistics.median(v):8.1f} t/s (min {min(v):.1f}, max {max(v):.1f}; "
                  f"{', '.join(f'{x:.0f}' for x in v)}); CuPy pool grew by "
                  f"{held[name] >> 20} MiB in its warm-up prompt; last-token logits vs the first arm: max |diff| "
                  f"{np.abs(d).max():.4f} "
                  f"({np.abs(d).max() / float(ref.std()):.2e} of their std), top-1 "
                  f"{'equal' if logits[name].argmax() == ref.argmax() else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
