"""Placement fidelity: the same model's perplexity and greedy tokens under each placement, load mode
and ``-ub``, next to the CPU's (issue 24). Shared by ``tests/test_gpu_fidelity.py`` and
``bench/placement_fidelity.py``. Also :func:`serve_steps`: a serve-like schedule of slots on two
engines, for the logits' equality (``tests/test_cache.py``, ``tests/test_gpu.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moecache.engine import Engine, EngineConfig
from moecache.placement import PlacementOptions
from moecache.settings import LOAD_MODES  # noqa: F401 - the load modes every placement runs under

PLACEMENTS: dict[str, dict[str, Any]] = {  # name -> PlacementOptions fields ("budget": an expert cache)
    "-ngl 99": dict(n_gpu_layers=99),
    "--cpu-moe": dict(cpu_moe=True),
    "--n-cpu-moe 4": dict(n_cpu_moe=4),
    "cache": dict(),
}
UBATCHES = (16, 32, 64, 256)


def third_of_experts_budget(path: str | Path, n_ctx: int) -> int:
    """A ``--vram-budget`` (bytes) that leaves the expert cache room for about a third of the experts,
    for an engine built next: what is in use on the GPUs now (the CUDA context, engines still open)
    counts against a budget (:func:`moecache.placement.budgeted_free`), so it is added (the most of
    any GPU's), and anything allocated between this call and the engine's start shrinks the cache."""
    from moecache.devices import gpu_memory
    from moecache.gguf_file import open_gguf
    from moecache.placement import RESERVE_BYTES, USABLE_FRACTION, model_sizes

    with open_gguf(path) as m:
        sz = model_sizes(m, n_ctx)
    need = sum(sz.dense) + sz.n_layer * sz.kv + sz.output
    _, used, _ = gpu_memory()
    planned = RESERVE_BYTES + sz.largest_matrix_f32 + need + sum(sz.experts) // 3
    return int(planned / USABLE_FRACTION) + max(used, default=0)


def greedy(eng: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after ``prompt`` (fresh sequence) and, per token, the gap in logits between
    the chosen token and the runner-up (a near-tie may flip under float rounding)."""
    eng.reset()
    logits = eng.eval(prompt)[-1]
    toks, gaps = [], []
    for _ in range(n):
        top2 = np.argpartition(-logits, 1)[:2]
        t = int(top2[0] if logits[top2[0]] >= logits[top2[1]] else top2[1])
        gaps.append(float(abs(logits[top2[0]] - logits[top2[1]])))
        toks.append(t)
        logits = eng.eval([t])[-1]
    eng.reset()
    return toks, gaps


@dataclass
class Cell:
    """One configuration's results."""

    placement: str
    load_mode: str
    n_ubatch: int
    ppl: float
    tokens: list[int]
    offloaded_bytes: int  # host expert bytes copied to the GPU for prompt ubatches
    summary: str


def offloaded_bytes(eng: Engine) -> int:
    """Host expert bytes copied to the GPU so far by op offload and the caches' prompt path
    (:meth:`moecache.moe.executor.ExpertsByLayer.offloaded_bytes`; 0 without per-layer executors)."""
    count = getattr(eng.model.experts, "offloaded_bytes", None)
    return 0 if count is None else count()


def run_cell(path: str | Path, placement: str, load_mode: str, n_ubatch: int, tokens: list[int], n_ctx: int,
             max_chunks: int, prompt: list[int], n_greedy: int, prompt_stacks: bool | None = None) -> Cell:
    """Perplexity (``n_ctx`` chunks, at most ``max_chunks``) and greedy tokens in one configuration;
    ``prompt_stacks`` (None: the default) is set on the expert caches (their prompt path)."""
    opts = dict(PLACEMENTS[placement])
    if placement == "cache":
        opts["vram_budget"] = third_of_experts_budget(path, n_ctx)
    cfg = EngineConfig(n_ctx=n_ctx, n_batch=max(n_ctx, n_ubatch), n_ubatch=n_ubatch)
    # float32 activations: the CPU's arithmetic, so that only moved bytes can make a difference
    with Engine(path, cfg, placement=PlacementOptions(**opts), load_mode=load_mode, gpu_act_q8=False) as eng:
        if placement == "cache":
            assert eng.caches and eng.placement.cache_slots[0][1] > 0, "the budget gave no expert cache"
        for cache in eng.caches if prompt_stacks is not None else ():
            cache.prompt_stacks = prompt_stacks
        ppl = eng.perplexity(tokens, n_ctx, max_chunks=max_chunks).ppl
        toks, _ = greedy(eng, prompt, n_greedy)
        return Cell(placement, load_mode, n_ubatch, ppl, toks, offloaded_bytes(eng), eng.placement.summary())


def cpu_reference(path: str | Path, tokens: list[int], n_ctx: int, max_chunks: int, prompt: list[int],
                  n_greedy: int) -> tuple[float, list[int], list[float]]:
    """The CPU's perplexity, greedy tokens and their top-2 gaps."""
    with Engine(path, EngineConfig(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx)) as eng:
        ppl = eng.perplexity(tokens, n_ctx, max_chunks=max_chunks).ppl
        toks, gaps = greedy(eng, prompt, n_greedy)
    return ppl, toks, gaps


def first_real_divergence(ref: list[int], got: list[int], gaps: list[float], tie: float = 0.05) -> int | None:
    """Index of the first token where ``got`` leaves ``ref`` although the CPU's top two were more
    than ``tie`` logits apart (after a near-tie, the texts may legitimately part); None if none."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return None if gaps[i] <= tie else i
    return None


# a serve-like schedule of three slots, (kind, slots, tokens): "p" a request's prompt, or the last
# chunk of one ("p+" a chunk with more to come: no logits), of one slot; "d" one decode pass of the
# slots given (tokens unused: one each). Prompts start while other slots decode; slot 0 starts a
# second request at step 15; every chunk but one (12 tokens) is a prompt pass of 32+ tokens
# (PlacementOptions.offload_min_batch). It is a superset of what serve's worker does: the worker also
# decodes a slot in the step of its last prompt chunk, never rests a generating slot, and may put
# several slots' chunks in one step; here slots rest between passes (steps 19-21), which the
# sequences' independence allows.
SERVE_STEPS: tuple[tuple[str, tuple[int, ...], int], ...] = (
    ("p", (0,), 40), ("d", (0,), 1), ("d", (0,), 1), ("d", (0,), 1),
    ("p+", (1,), 36), ("d", (0,), 1), ("p", (1,), 12), ("d", (0, 1), 1), ("d", (0, 1), 1), ("d", (0, 1), 1),
    ("p", (2,), 48), ("d", (0, 1), 1), ("d", (0, 1, 2), 1), ("d", (0, 1, 2), 1), ("d", (1, 2), 1),
    ("p", (0,), 33), ("d", (1, 2), 1), ("d", (0, 1, 2), 1), ("d", (0, 1, 2), 1), ("d", (0,), 1), ("d", (0,), 1),
    ("d", (0, 2), 1), ("d", (0, 1, 2), 1), ("d", (0, 1, 2), 1))


def serve_steps(engines: tuple[Engine, Engine], rng: np.random.Generator, n_vocab: int, check) -> int:
    """Run :data:`SERVE_STEPS` on two engines (three slot sequences each from ``Engine.sequences(3)``,
    so the engines' own sequences must not be in use), the same random token ids (< ``n_vocab``, at
    most the models' vocabulary) to both: a request's prompt clears its slot's sequence first; a
    decode pass appends one token to each of its slots (``Engine.decode``). ``check(a, b, what)``
    compares each float32 logits block (engine 0's, engine 1's): (1, n_vocab) after a request's
    whole prompt, (len(slots), n_vocab) after a decode pass. Each slot needs 60 positions: ``-c``
    of at least 180. Returns the decode passes run (19).

    Raises:
        ContextFullError: the engines' ``-c`` is below 180.
        ValueError: ``n_vocab`` exceeds a model's vocabulary.
    """
    seqs = [e.sequences(3) for e in engines]
    reading = [False] * 3  # the slot's request has prompt chunks left
    passes = 0
    for i, (kind, slots, n) in enumerate(SERVE_STEPS):
        if kind in ("p", "p+"):
            s = slots[0]
            if not reading[s]:  # a new request in the slot
                for q in seqs:
                    q[s].clear()
            reading[s] = kind == "p+"
            toks = rng.integers(0, n_vocab, n)
            rows = np.array([], np.int64) if reading[s] else "last"
            out = [e.eval(toks, logits=rows, kv=q[s]) for e, q in zip(engines, seqs)]
            if not reading[s]:
                check(out[0], out[1], f"step {i}: slot {s}'s prompt")
        else:
            toks = rng.integers(0, n_vocab, len(slots))
            out = [e.decode(toks, [q[s] for s in slots]) for e, q in zip(engines, seqs)]
            check(out[0], out[1], f"step {i}: decode of slots {slots}")
            passes += 1
    return passes
