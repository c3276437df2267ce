"""``moecache bench``: parse the llama-bench-style lists, load each combination, print the table."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from moecache.cli.common import UserError, load_engine, note, resolve_model


# each list flag's field, its valid range (int32 like llama-bench's), and its meaning when not given
INT32_MAX = 2**31 - 1
LIST_RANGES = {"-p": 0, "-n": 0, "-pg": 0, "-d": 0, "-t": 0, "-b": 1, "-ub": 1, "-ngl": -1, "--n-cpu-moe": 0,
               "--moe-cache-window": 1}


def moe_cache_list(text: str | None) -> list[int]:
    """``--moe-cache`` values of a bench: sizes (``8GiB,12GiB``), -1, 0, or llama-bench ranges of
    MiB (``1024-4096+1024``) -> MiB per GPU (-1 fill, 0 off)."""
    from moecache.sizes import parse_moe_cache
    from moecache.benchmark import parse_list, split_items

    out: list[int] = []
    for item in split_items(text, "--moe-cache"):
        if re.fullmatch(r"\d+-\d+([+*]\d+)?", item):  # a range of MiB, as llama-bench writes ranges
            out += [parse_moe_cache(str(v)) for v in parse_list(item, "--moe-cache")]
        else:
            out.append(parse_moe_cache(item))
    return out


def checked_list(text: str | None, flag: str) -> list[int]:
    """A llama-bench list (``1,2``, ``8-32+8``) whose every value is in the flag's range (UserError
    naming the flag, the value and the range)."""
    from moecache.benchmark import parse_list

    vals = parse_list(text, flag)
    lo = LIST_RANGES[flag]
    for v in vals:
        if not lo <= v <= INT32_MAX:
            raise UserError(f"{flag} {v}: values must be in [{lo}, {INT32_MAX}]" + (" (-1 = all that fit)"
                                                                                   if flag == "-ngl" else ""))
    return vals


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """The ``bench`` flags as given (llama-bench's lists and ranges are text until
    :func:`checked_list` reads them; llama.cpp names)."""

    models: list[Path] | None = None
    n_prompt: str = "512"
    n_gen: str = "128"
    pg: str | None = None
    depth: str = "0"
    reps: int = 5
    threads: str | None = None
    batch: str = "2048"
    ubatch: str | None = None  # None: the resolved -ub (moecache.settings.resolve), as run has it
    ngl: str = "99"
    n_cpu_moe: str = "0"
    moe_cache: str | None = None
    vram_budget: str | None = None
    window: str | None = None
    routing: str | None = None
    n_gen_warmup: int = 0
    warmup: bool = True
    load_mode: str | None = None
    output: str = "md"
    ctx_size: int | None = None
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    miss_split: bool = False  # --miss-split (one value for the whole bench)
    elastic_slots: bool | None = None  # --elastic-slots / --no-elastic-slots (one value for the whole bench; None: on)
    cache_plan: str = "auto"  # --cache-plan (one value for the whole bench)


def settle_for_all(combos, settings_of) -> str | None:
    """One OpenMP wait policy for every combination, chosen before the first loads (the runtime
    reads it once): when the command line left it to the resolved settings
    (:func:`moecache.threads.openmp_wait_for_args` deferred it), active waiting if some combination
    gives the CPU experts in decode steps (a layer plan among them) and none runs on the CPU alone
    (spinning threads starve its OpenBLAS calls, moecache/threads.py); each combination's
    ``--cache-plan auto`` then resolves against that. Returns what was settled, None when nothing
    was deferred."""
    from moecache.cli.common import settle_wait, wants_active_wait
    from moecache.threads import wait_chosen

    if wait_chosen():
        return None
    from moecache.llm import resolve_file

    pairs = [(settings_of(p), p) for p in combos]
    res = [resolve_file(p.model, st, command="bench", omp_active=True) for st, p in pairs]
    wanting = [r.n_threads for r, (st, _) in zip(res, pairs) if wants_active_wait(r, st)]
    active = bool(wanting) and all(r.prompt_gpu is not None for r in res)
    return settle_wait(active, max(wanting, default=1), note)


def bench_command(o: BenchOptions) -> None:
    """Expand the lists into combinations, load an engine per combination (the library's
    settings road, as ``run``), run the tests and print the table. Raises UserError / ValueError."""
    from moecache.benchmark import MAX_COMBINATIONS, BenchParams, bench, expand, make_tests, render, split_items
    from moecache.settings import Settings, kv_cache_type
    from moecache.sizes import parse_size

    models, n_prompt, n_gen, pg, depth, reps = o.models, o.n_prompt, o.n_gen, o.pg, o.depth, o.reps
    output, n_gen_warmup, ctx_size = o.output, o.n_gen_warmup, o.ctx_size
    cache_type = kv_cache_type(o.cache_type_k, o.cache_type_v)

    if output not in ("md", "csv", "json", "jsonl"):
        raise UserError(f"-o {output!r}: expected md, csv, json or jsonl")
    if reps < 1:
        raise UserError(f"-r must be >= 1, got {reps}")
    if n_gen_warmup < 0:
        raise UserError(f"--n-gen-warmup must be >= 0, got {n_gen_warmup}")
    models = list(models) if models else [resolve_model(None)]
    for m in models:
        if not m.is_file():
            raise UserError(f"-m {m}: no such file")
    pgs = checked_list(pg, "-pg")
    if len(pgs) % 2:
        raise UserError(f"-pg {pg!r}: expected pp,tg pairs")
    ps, ns, ds = checked_list(n_prompt, "-p"), checked_list(n_gen, "-n"), checked_list(depth, "-d")
    tests = make_tests(ps, ns, list(zip(pgs[::2], pgs[1::2])), ds)
    if not tests:
        raise UserError("no tests: give -p, -n or -pg with values > 0")
    lists = {"model": models, "n_batch": checked_list(o.batch, "-b"), "n_ubatch": checked_list(o.ubatch, "-ub") or [0],
             "n_threads": checked_list(o.threads, "-t") or [0], "n_gpu_layers": checked_list(o.ngl, "-ngl"),
             "n_cpu_moe": checked_list(o.n_cpu_moe, "--n-cpu-moe"),
             "moe_cache": moe_cache_list(o.moe_cache) or [None],
             "vram_budget": [parse_size(v, "--vram-budget") for v in split_items(o.vram_budget, "--vram-budget")]
             or [0],
             "moe_cache_window": checked_list(o.window, "--moe-cache-window") or [None],
             "routing": split_items(o.routing, "--routing") or [None]}
    base = BenchParams(models[0], 2048, 0, 0, 99, 0, None, 0, None, None, o.load_mode or "auto")
    try:
        combos = expand(base, **lists)
    except ValueError as e:
        raise UserError(str(e)) from None
    if len(combos) * len(tests) > MAX_COMBINATIONS:
        raise UserError(f"{len(combos)} parameter combinations x {len(tests)} tests: at most {MAX_COMBINATIONS} runs")
    # the parameters given (varied, or not at their default): the md table's columns
    defaults = {"n_batch": [2048], "n_ubatch": [0], "n_threads": [0], "n_gpu_layers": [99], "n_cpu_moe": [0],
                "moe_cache": [None], "vram_budget": [0], "moe_cache_window": [None], "routing": [None]}
    shown = [k for k, v in lists.items() if k != "model" and (len(v) > 1 or v != defaults.get(k))]
    if cache_type != "f16":
        shown += ["type_k", "type_v"]
    if n_gen_warmup:
        shown.append("n_gen_warmup")
    if o.miss_split:
        shown.append("miss_split")
    if o.elastic_slots is not None:
        shown.append("elastic_slots")
    if o.cache_plan != "auto":
        shown.append("cache_plan")
    need = max(t.n_depth + t.n_prompt + t.n_gen for t in tests) + max(1, n_gen_warmup) + 8
    if ctx_size is not None and ctx_size < need:
        raise UserError(f"-c {ctx_size}: the tests need {need} tokens of context (depth + prompt + generated + "
                        f"warm-up)")
    n_ctx = ctx_size or need
    said: set[str] = set()  # notes said once for the whole bench, not once per combination

    def settings_of(p: BenchParams) -> Settings:
        return Settings(n_ctx=n_ctx, n_batch=p.n_batch, n_ubatch=p.n_ubatch or None, n_threads=p.n_threads or None,
                        n_gpu_layers=p.n_gpu_layers, n_cpu_moe=p.n_cpu_moe, moe_cache=p.moe_cache,
                        vram_budget=p.vram_budget, cache_type=cache_type,
                        load_mode=None if p.load_mode == "auto" else p.load_mode,
                        moe_cache_window=p.moe_cache_window, routing=p.routing, miss_split=o.miss_split,
                        elastic_slots=o.elastic_slots, cache_plan=o.cache_plan)

    def make_engine(p: BenchParams):
        return load_engine(p.model, settings_of(p), "bench", said=said).engine

    settle_for_all(combos, settings_of)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    total = len(combos) * len(tests)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task("bench", total=total)

        started = [0]

        def progress(name: str) -> None:  # called as each test starts
            prog.update(task, description=name, completed=started[0])
            started[0] += 1

        results = bench(combos, tests, reps, o.warmup, n_gen_warmup, make_engine, progress, say=note)
        prog.update(task, completed=total)
    if "cache_plan" not in shown and len({r.fields.get("cache_plan") for r in results}) > 1:
        shown.append("cache_plan")  # auto resolved differently between combinations
    sys.stdout.write(render(results, output, shown))
    if any(r.fields.get("routing") for r in results):
        note("note: --routing replaced the routers' choices: speeds, hit rates and uploads are measured; the text "
             "is meaningless")
