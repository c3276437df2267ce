"""The side-by-side benchmark against stock llama.cpp (../shared/vs-llamacpp.md): every speed goal of
moecache is a ratio moecache / llama.cpp measured here, same GGUF, same machine, same lease.

    python bench/vs_llamacpp.py --llama-bench /tmp/lcpp/llama.cpp/build/bin/llama-bench \\
        -m /tmp/q30.gguf --make-model --cases gpu-tg128,8g-tg128-qwen3-moe --run r1 \\
        --deadline-s 540

Each case runs both engines with llama-bench's tests (``-r 3``, llama-bench's warm-up; our cache arms
also generate ``--n-gen-warmup`` tokens first). A VRAM budget is the measured peak of the GPU's used
memory (``nvidia-smi`` sampled every 200 ms, CUDA context included, less the used memory before the
run): llama.cpp's arm is the smallest ``-ncmoe`` whose peak stays within the budget, found by trying
(``--ncmoe-hint`` first, then one layer at a time); ours runs ``--vram-budget``. Rows go to
``OUT.jsonl`` as each engine finishes (fields of the spec); ``OUT.md`` is rebuilt from the run's rows.
The same ``--run`` again skips what is done, so a run spans several 10-minute commands.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    """One row of the spec's case table.

    Attributes:
        name: the case's exact name.
        p, n, d: llama-bench's -p, -n, -d (one test per case).
        budget_mib: VRAM budget per GPU (MiB), None = none.
        routing: our ``--routing`` preset (cache cases), None = the model's router.
        ncmoe: llama.cpp's ``-ncmoe``: an int, "best" (smallest within the budget) or None.
        host_experts: experts in host RAM (llama.cpp ``-lm none``, ours ``--load-mode pin``).
        ours: our placement flags.
        ub: -b/-ub when not llama-bench's default.
        gpus: GPUs the case needs.
    """

    name: str
    p: int
    n: int
    d: int = 0
    budget_mib: int | None = None
    routing: str | None = None
    ncmoe: int | str | None = None
    host_experts: bool = False
    ours: tuple[str, ...] = ()
    ub: int | None = None
    gpus: int = 1

    @property
    def test(self) -> str:
        """llama-bench's test name."""
        t = f"pp{self.p}" if self.p else f"tg{self.n}"
        return t + (f" @ d{self.d}" if self.d else "")


CACHE = ("-ngl", "99", "--moe-cache", "-1")  # every expert in host RAM, the free VRAM as the cache
CPU_MOE = ("-ngl", "99", "-ncmoe", "999", "--moe-cache", "0")  # every expert in host RAM, no cache
CASES: dict[str, Case] = {c.name: c for c in [
    Case("gpu-pp512", 512, 0, ncmoe=None, ours=("-ngl", "99")),
    Case("gpu-tg128", 0, 128, ncmoe=None, ours=("-ngl", "99")),
    Case("gpu-tg128-d16384", 0, 128, d=16384, ncmoe=None, ours=("-ngl", "99")),
    *[Case(f"8g-tg128-{r}", 0, 128, budget_mib=8192, routing=r, ncmoe="best", host_experts=True, ours=CACHE)
      for r in ("qwen3-moe", "low-locality", "uniform")],
    Case("8g-tg64-d12620-qwen3-moe", 0, 64, d=12620, budget_mib=8192, routing="qwen3-moe", ncmoe="best",
         host_experts=True, ours=CACHE),
    Case("8g-pp512", 512, 0, budget_mib=8192, routing="qwen3-moe", ncmoe="best", host_experts=True, ours=CACHE),
    Case("8g-pp12620", 12620, 0, budget_mib=8192, routing="qwen3-moe", ncmoe="best", host_experts=True,
         ours=CACHE),
    Case("cpu-moe-tg64", 0, 64, ncmoe=48, host_experts=True, ours=CPU_MOE),
    Case("pinned-pp512", 512, 0, ncmoe=48, host_experts=True, ours=CPU_MOE),
    Case("pinned-pp2048-ub2048", 2048, 0, ncmoe=48, host_experts=True, ub=2048,
         ours=CPU_MOE),
    Case("x2-gpu-tg128", 0, 128, ncmoe=None, ours=("-ngl", "99"), gpus=2),
    *[Case(f"x2-8g-tg128-{r}", 0, 128, budget_mib=8192, routing=r, ncmoe="best", host_experts=True, ours=CACHE,
           gpus=2) for r in ("qwen3-moe", "uniform")],
]}


def llama_cmd(bin_: str, model: str, case: Case, ncmoe: int | None, reps: int, threads: int) -> list[str]:
    """llama-bench's command line for a case (the spec's fairness rules: -fa 1, -t, -lm none for
    host experts)."""
    cmd = [bin_, "-m", model, "-p", str(case.p), "-n", str(case.n), "-ngl", "99", "-fa", "1",
           "-t", str(threads), "-r", str(reps), "-o", "jsonl"]
    if case.d:
        cmd += ["-d", str(case.d)]
    if ncmoe is not None:
        cmd += ["-ncmoe", str(ncmoe)]
    if case.host_experts:
        cmd += ["-lm", "none"]
    if case.ub:
        cmd += ["-b", str(case.ub), "-ub", str(case.ub)]
    if case.gpus > 1:
        cmd += ["-sm", "layer"]
    return cmd


STATIC = ("-ngl", "99", "--moe-cache", "0")  # --our-static: the budget's static placement, no cache


def ours_cmd(model: str, case: Case, reps: int, threads: int, warmup: int, load_mode: str = "pin",
             miss_split: bool = False, elastic_slots: bool | None = None, static: bool = False,
             cache_plan: str = "auto") -> list[str]:
    """``moecache bench``'s command line for a case (``load_mode`` where experts are in host RAM;
    ``miss_split`` / ``elastic_slots``: ``--miss-split`` / ``--elastic-slots`` (True) or
    ``--no-elastic-slots`` (False; None: neither) in the cases with an expert cache; ``static``: those cases run with the cache off instead, ``--moe-cache 0``, so the
    placement keeps as many layers' experts on the GPU as the budget holds and the CPU computes the
    rest: llama.cpp's ``-ncmoe`` arm, with our N and kernels; ``cache_plan``: ``--cache-plan`` in
    the cases with an expert cache, when not "auto", the default)."""
    ours = STATIC if static and case.ours == CACHE else case.ours
    cmd = [sys.executable, "-m", "moecache.cli.main", "bench", "-m", model, "-p", str(case.p), "-n", str(case.n),
           "-t", str(threads), "-r", str(reps), "-o", "jsonl", *ours]
    if case.d:
        cmd += ["-d", str(case.d)]
    if case.budget_mib:
        cmd += ["--vram-budget", f"{case.budget_mib}MiB"]
    if case.routing:
        cmd += ["--routing", case.routing]
    if case.host_experts:
        cmd += ["--load-mode", load_mode]
    if case.ub:
        cmd += ["-b", str(case.ub), "-ub", str(case.ub)]
    cached = ours == CACHE
    if warmup and case.n and cached:
        cmd += ["--n-gen-warmup", str(warmup)]
    if miss_split and cached:
        cmd += ["--miss-split"]
    if elastic_slots is not None and cached:
        cmd += ["--elastic-slots" if elastic_slots else "--no-elastic-slots"]
    if cache_plan != "auto" and cached:
        cmd += ["--cache-plan", cache_plan]
    return cmd


def warmup_of(cmd: list[str]) -> int:
    """The ``--n-gen-warmup`` count a command passes (0 when none)."""
    return int(cmd[cmd.index("--n-gen-warmup") + 1]) if "--n-gen-warmup" in cmd else 0


class VramSampler:
    """Peak used device memory per GPU (MiB) while the ``with`` block runs, from ``nvidia-smi
    --query-gpu=memory.used -lms 200``, less the used memory sampled just before (what other
    processes hold); the CUDA context of the measured process is included.

    Args:
        query: the sampling command (one line per GPU per sample, MiB); a test may pass its own.
    """

    QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "200"]

    def __init__(self, query: list[str] | None = None):
        self.query = query or self.QUERY
        self.base: list[int] = []
        self.peak: list[int] = []

    def _once(self) -> list[int]:
        q = [a for a in self.query if a not in ("-lms", "200")]
        out = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout
        return [int(x) for x in out.split()]

    def __enter__(self) -> VramSampler:
        self.base = self._once()
        self.peak = list(self.base)
        self._proc = subprocess.Popen(self.query, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        n = max(1, len(self.base))
        for i, line in enumerate(self._proc.stdout):
            try:
                v = int(line.strip())
            except ValueError:
                continue
            g = i % n
            if g < len(self.peak):
                self.peak[g] = max(self.peak[g], v)

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.4)  # one more sample after the process ended its work
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._thread.join(timeout=5)

    @property
    def peak_mib(self) -> int:
        """The largest per-GPU peak above that GPU's baseline."""
        return max((p - b for p, b in zip(self.peak, self.base)), default=0)


def run_jsonl(cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None) -> list[dict]:
    """Run a benchmark command; its jsonl rows (stdout lines that are JSON objects)."""
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True, env=env,
                             timeout=timeout).stdout
    rows = []
    for ln in out.splitlines():
        ln = ln.strip()
        if ln.startswith("{"):
            rows.append(json.loads(ln))
    return rows


def smallest_fitting(peak_at: Callable[[int], int], budget_mib: int, lo: int, hi: int, hint: int) -> tuple[int, dict]:
    """The smallest ``-ncmoe`` in [lo, hi] whose measured peak is within ``budget_mib``: from ``hint``,
    up one layer at a time while over, else down while within (the peak falls as -ncmoe grows).

    Returns:
        (that -ncmoe, {ncmoe tried: peak MiB}).

    Raises:
        RuntimeError: even ``hi`` is over the budget.
    """
    tried: dict[int, int] = {}

    def fits(k: int) -> bool:
        if k not in tried:
            tried[k] = peak_at(k)
        return tried[k] <= budget_mib

    k = min(max(hint, lo), hi)
    if fits(k):
        while k > lo and fits(k - 1):
            k -= 1
        return k, tried
    while k < hi:
        k += 1
        if fits(k):
            return k, tried
    raise RuntimeError(f"-ncmoe {hi} still peaks at {tried[hi]} MiB, over the {budget_mib} MiB budget")


@dataclass
class State:
    """The run's rows and searched -ncmoe values (kept in OUT.jsonl and OUT.ncmoe.json)."""

    rows: list[dict] = field(default_factory=list)
    ncmoe: dict[str, dict] = field(default_factory=dict)

    def done(self, run: str, case: str, engine: str) -> bool:
        return any(r["run"] == run and r["case"] == case and r["engine"] == engine for r in self.rows)


@dataclass(frozen=True)
class ExpertFacts:
    """The model's routed experts: the indices of the layers that have them, experts per layer,
    bytes of one expert's three matrices (a cache slot)."""

    moe_layers: tuple[int, ...]
    n_expert: int
    expert_bytes: int


def expert_facts(model: str) -> ExpertFacts | None:
    """:class:`ExpertFacts` of a GGUF (None for a dense model)."""
    from moecache.gguf_file import open_gguf
    from moecache.placement import model_sizes

    with open_gguf(model) as m:
        sz = model_sizes(m, 1)
        if not sz.expert_each:
            return None
        return ExpertFacts(tuple(il for il, e in enumerate(sz.experts) if e), m.config.n_expert, sz.expert_each)


def experts_in_vram(rec: dict, case: Case, engine: str, ncmoe: int | None, facts: ExpertFacts | None,
                    static: bool = False) -> int | None:
    """Routed experts a budget case's arm holds in VRAM (issue 19 asks for them per GiB of budget):
    llama.cpp's arm keeps every expert of the layers ``-ncmoe`` leaves on the GPU (the experts of
    layers 0 .. ncmoe - 1 go to the CPU); ours the expert cache's slots, ``moe_cache_mib_granted``
    MiB (rounded to 0.1 by ``moecache bench``) of ``facts.expert_bytes`` each. Summed over the
    case's GPUs. None outside budget cases or when unknown."""
    if case.budget_mib is None or facts is None:
        return None
    if engine == "llama.cpp":
        return None if ncmoe is None else sum(1 for il in facts.moe_layers if il >= ncmoe) * facts.n_expert
    if static:  # --our-static: every expert of the layers our planner kept on the GPU
        n = rec.get("host_expert_layers")
        return None if n is None else max(0, len(facts.moe_layers) - n) * facts.n_expert
    granted = rec.get("moe_cache_mib_granted")
    return None if granted is None else round(granted * MIB / facts.expert_bytes)


def row_of(rec: dict, run: str, case: Case, engine: str, peak: int, ncmoe: int | None, warmup: int,
           experts_vram: int | None = None, static: bool = False) -> dict:
    """A jsonl row of the spec from a llama-bench/``moecache bench`` record (plus ``experts_vram``:
    :func:`experts_in_vram`; ``static``: our side ran ``--our-static``, its ``n_cpu_moe`` is the
    placed ``host_expert_layers``)."""
    return dict(run=run, case=case.name, engine=engine, test=case.test, avg_ts=rec.get("avg_ts"),
                stddev_ts=rec.get("stddev_ts"), samples_ts=rec.get("samples_ts"),
                n_cpu_moe=ncmoe if engine == "llama.cpp" else rec.get("host_expert_layers") if static
                else rec.get("n_cpu_moe"),
                our_placement=None if engine == "llama.cpp" else "static" if static
                else "layer plan" if rec.get("cache_plan") == "layer"
                else "per-expert" if case.ours == CACHE and rec.get("cache_plan") == "expert" else "default",
                cache_plan=rec.get("cache_plan"), plan_cpu_layers=rec.get("plan_cpu_layers"),
                plan_shares=rec.get("plan_shares"),
                graph_steps=rec.get("graph_steps"), samples_host_gb=rec.get("samples_host_gb"),
                vram_budget_mib=case.budget_mib, vram_peak_mib=peak, routing=case.routing,
                hit_rate=rec.get("hit_rate"), misses_per_token=rec.get("misses_per_token"),
                cpu_misses_per_token=rec.get("cpu_misses_per_token"),
                cpu_wait_us_per_token=rec.get("cpu_wait_us_per_token"), n_ubatch=rec.get("n_ubatch"),
                n_gen_warmup=warmup,
                build_commit=rec.get("build_commit"), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                gpu_info=rec.get("gpu_info"), experts_vram=experts_vram)


def render(rows: list[dict], run: str, header: str) -> str:
    """The markdown table of one run: case, both engines' t/s, ratio (of the means, as the spec
    defines it), the ratio of the samples' medians beside it (llama-bench's first timed sample is
    often its slow one: run h200-s17b's gpu-pp512 was 0.83 on the means and 0.78 on the medians),
    VRAM peaks, and in budget cases the routed experts each holds in VRAM per GiB of the budget."""
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["run"] == run:
            by.setdefault(r["case"], {})[r["engine"]] = r
    lines = [header, "", "| case | test | llama.cpp t/s | moecache t/s | ratio | ratio of medians | "
             "llama.cpp VRAM peak MiB (-ncmoe) | moecache VRAM peak MiB | budget MiB | hit rate | "
             "experts in VRAM per GiB of budget (llama.cpp / moecache) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in [c for c in CASES if c in by]:
        e = by[name]
        ll, us = e.get("llama.cpp"), e.get("moecache")

        def ts(r: dict | None) -> str:
            return "-" if not r or r.get("avg_ts") is None else f"{r['avg_ts']:.2f} ± {r.get('stddev_ts') or 0:.2f}"

        ratio = f"{us['avg_ts'] / ll['avg_ts']:.2f}" if ll and us and ll.get("avg_ts") and us.get("avg_ts") else "-"

        def median(r: dict | None) -> float | None:
            return float(statistics.median(r["samples_ts"])) if r and r.get("samples_ts") else None

        ml, mu = median(ll), median(us)
        ratio_med = f"{mu / ml:.2f}" if ml and mu else "-"
        lpk = "-" if not ll else f"{ll['vram_peak_mib']}" + (f" ({ll['n_cpu_moe']})" if ll.get("n_cpu_moe") is not None else "")
        upk = "-" if not us else str(us["vram_peak_mib"]) + (
            f" ({us['n_cpu_moe']}, static)" if us.get("our_placement") == "static"
            else f" (layer plan, {us['plan_cpu_layers']} CPU layers)"
            if us.get("our_placement") == "layer plan" and us.get("plan_cpu_layers") is not None
            else " (layer plan)" if us.get("our_placement") == "layer plan"  # (prompts only: no decode plan made)
            else "")
        hr = "-" if not us or us.get("hit_rate") is None else f"{100 * us['hit_rate']:.1f}%"
        budget = (ll or us or {}).get("vram_budget_mib") or "-"
        test = (ll or us)["test"]

        def per_gib(r: dict | None) -> str:  # the budget is per GPU, the experts of every GPU of the case
            n = None if not r else r.get("experts_vram")
            if n is None or not r.get("vram_budget_mib"):
                return "-"
            return f"{n / (r['vram_budget_mib'] * CASES[name].gpus / 1024):.0f}"

        held = "-" if budget == "-" else f"{per_gib(ll)} / {per_gib(us)}"
        lines.append(f"| {name} | {test} | {ts(ll)} | {ts(us)} | {ratio} | {ratio_med} | {lpk} | {upk} | {budget} | {hr} "
                     f"| {held} |")
    return "\n".join(lines) + "\n"


def load_state(out: Path) -> State:
    st = State()
    jl = out.with_suffix(".jsonl")
    if jl.exists():
        st.rows = [json.loads(ln) for ln in jl.read_text().splitlines() if ln.strip()]
    nc = out.with_suffix(".ncmoe.json")
    if nc.exists():
        st.ncmoe = json.loads(nc.read_text())
    return st


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="/tmp/q30.gguf")
    ap.add_argument("--make-model", action="store_true", help="write the synthetic Qwen3-30B-A3B (seed 0) if missing")
    ap.add_argument("--llama-bench", required=True, help="stock llama.cpp's llama-bench")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES.values() if c.gpus == 1))
    ap.add_argument("--engines", default="llama.cpp,moecache")
    ap.add_argument("--run", default=time.strftime("%Y%m%d-%H%M%S", time.gmtime()), help="run id (the same id again "
                    "continues that run)")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=15)
    ap.add_argument("--n-gen-warmup", type=int, default=256, help="our cache arms' generated warm-up tokens")
    ap.add_argument("--ncmoe-hint", type=int, default=29, help="first -ncmoe tried for an 8 GiB budget")
    ap.add_argument("--our-load-mode", default="pin", help="our --load-mode where experts are in host RAM")
    ap.add_argument("--miss-split", action="store_true", help="our cache cases with --miss-split (opt-in: the CPU "
                    "computes a share of the misses)")
    ap.add_argument("--elastic-slots", action=argparse.BooleanOptionalAction, default=None, help="our cache cases "
                    "with --elastic-slots or --no-elastic-slots (not given: the default, on)")
    ap.add_argument("--cache-plan", default="auto", choices=("auto", "expert", "layer"), help="our cache cases "
                    "with --cache-plan (auto: the default, layer where experts are page-locked behind one GPU)")
    ap.add_argument("--our-static", action="store_true", help="our cache cases with the cache off (--moe-cache 0): "
                    "the budget's static placement, -ncmoe chosen by our planner; the row says (N, static)")
    ap.add_argument("--deadline-s", type=float, default=0, help="start no new case after this many seconds (0: none)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs-llamacpp-h200")
    a = ap.parse_args(argv)

    if a.our_static and (a.miss_split or a.elastic_slots is not None or a.cache_plan != "auto"):
        ap.error("--our-static turns the expert cache off: --miss-split, --elastic-slots and --cache-plan need it")
    if a.miss_split and a.cache_plan == "layer":
        ap.error("--cache-plan layer sets each layer's miss path itself: --miss-split goes without it")
    t_start = time.perf_counter()
    unknown = [c for c in a.cases.split(",") if c not in CASES]
    if unknown:
        print(f"error: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    if a.make_model and not Path(a.model).exists():
        subprocess.run([sys.executable, "-m", "moecache.testing.synth", "--preset", "qwen3-30b-a3b", "--seed", "0",
                        "--workers", str(os.cpu_count() or 1), "-o", a.model], cwd=ROOT, check=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    log = a.out.with_suffix(".log")
    st = load_state(a.out)  # earlier runs' rows stay in the file; rows of this --run are skipped
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(a.llama_bench).resolve().parent))
    n_layer = 48
    facts = expert_facts(a.model) if Path(a.model).exists() else None

    def save() -> None:
        a.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in st.rows))
        a.out.with_suffix(".ncmoe.json").write_text(json.dumps(st.ncmoe, indent=1))
        head = (f"# moecache vs stock llama.cpp b11434: {Path(a.model).name}\n\nrun `{a.run}`; "
                f"`python bench/vs_llamacpp.py {' '.join(sys.argv[1:] if argv is None else argv)}`; ratio = moecache / "
                "llama.cpp; VRAM peaks: nvidia-smi used memory, CUDA context included, above the idle baseline")
        a.out.with_suffix(".md").write_text(render(st.rows, a.run, head))

    for name in a.cases.split(","):
        case = CASES[name]
        for engine in a.engines.split(","):
            if st.done(a.run, name, engine):
                continue
            if a.deadline_s and time.perf_counter() - t_start > a.deadline_s:
                print(f"deadline: stopping before {name} ({engine}); rerun with --run {a.run}", flush=True)
                save()
                return 0
            ncmoe = case.ncmoe if isinstance(case.ncmoe, int) else None
            static = engine == "moecache" and a.our_static and case.ours == CACHE  # --our-static's arm
            key = f"{case.budget_mib}:{case.p}+{case.n}@{case.d}:{case.ub or 512}:{case.gpus}"
            if engine == "llama.cpp" and case.ncmoe == "best" and key not in st.ncmoe:
                def peak_at(k: int) -> int:  # the case's own test, once: the peak of the timed run's shape
                    with VramSampler() as s:
                        run_jsonl(llama_cmd(a.llama_bench, a.model, case, k, 1, a.threads), log, env)
                    print(f"  {name}: -ncmoe {k} peaks at {s.peak_mib} MiB", flush=True)
                    return s.peak_mib
                best, tried = smallest_fitting(peak_at, case.budget_mib, 0, n_layer, a.ncmoe_hint)
                st.ncmoe[key] = dict(best=best, tried=tried)
                save()
            while True:
                if engine == "llama.cpp" and case.ncmoe == "best":
                    ncmoe = st.ncmoe[key]["best"]
                cmd = (llama_cmd(a.llama_bench, a.model, case, ncmoe, a.reps, a.threads) if engine == "llama.cpp"
                       else ours_cmd(a.model, case, a.reps, a.threads, a.n_gen_warmup, a.our_load_mode,
                                     a.miss_split, a.elastic_slots, static, a.cache_plan))
                try:
                    with VramSampler() as s:
                        recs = run_jsonl(cmd, log, env if engine == "llama.cpp" else None)
                except subprocess.SubprocessError as e:
                    print(f"{name} ({engine}) failed: {e}", flush=True)
                    recs = []
                # the timed run must stay within the budget too: over it, one more layer's experts to the CPU
                if (engine == "llama.cpp" and case.ncmoe == "best" and recs and s.peak_mib > case.budget_mib
                        and ncmoe < n_layer):
                    print(f"  {name}: the timed run at -ncmoe {ncmoe} peaked at {s.peak_mib} MiB; -ncmoe {ncmoe + 1}",
                          flush=True)
                    st.ncmoe[key]["tried"][str(ncmoe)] = s.peak_mib
                    st.ncmoe[key]["best"] = ncmoe + 1
                    save()
                    continue
                break
            if not recs:
                print(f"{name} ({engine}): no result (see {log})", flush=True)
                continue
            row = row_of(recs[-1], a.run, case, engine, s.peak_mib, ncmoe, warmup_of(cmd),
                         experts_in_vram(recs[-1], case, engine, ncmoe, facts, static), static)
            st.rows.append(row)
            save()
            print(json.dumps({k: row[k] for k in ("case", "engine", "test", "avg_ts", "vram_peak_mib", "n_cpu_moe",
                                                  "hit_rate")}), flush=True)
    save()
    print(a.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
