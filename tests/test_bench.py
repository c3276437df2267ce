"""`moecache bench`: llama-bench's conventions (field names, test names, lists and ranges, output
formats) on a tiny model."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import bench_scripts
from moecache.cli.main import app
from moecache.benchmark import LLAMA_BENCH_FIELDS, BenchTest, make_tests, parse_list

FIELDS = Path(__file__).parent / "data" / "llamacpp" / "llama-bench-fields.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=2)
    return path


def test_lists_and_ranges():
    assert parse_list("512", "-p") == [512]
    assert parse_list("1,2,4", "-t") == [1, 2, 4]
    assert parse_list("8-32+8", "-t") == [8, 16, 24, 32]
    assert parse_list("1-16*2", "-ub") == [1, 2, 4, 8, 16]
    assert parse_list("-1", "--moe-cache") == [-1]
    with pytest.raises(ValueError, match="-p 'x'"):
        parse_list("x", "-p")
    with pytest.raises(ValueError, match="range"):
        parse_list("32-8+8", "-t")
    assert len(parse_list("1-1000+1", "-p")) == 1000 and parse_list("", "-p") == []
    with pytest.raises(ValueError, match="more than 1000 values"):  # refused before it is built
        parse_list("1-100000000000+1", "-p")
    with pytest.raises(ValueError, match="more than 1000 values"):
        parse_list(",".join(["8"] * 1001), "-p")
    with pytest.raises(ValueError, match="empty item"):
        parse_list("8,,8", "-p")


def test_too_many_combinations_are_refused_before_any_run():
    """-t, -ub and -b of 30 values each would be 27000 engines: one error, at once."""
    from moecache.benchmark import BenchParams, expand

    base = BenchParams(Path("m.gguf"), 2048, 512, 0, 99, 0, None, 0, None, None, "auto")
    assert len(expand(base, n_threads=[1, 2], n_ubatch=[64, 128, 256])) == 6
    with pytest.raises(ValueError, match="27000 combinations"):
        expand(base, n_threads=list(range(30)), n_ubatch=list(range(30)), n_batch=list(range(30)))


def test_test_names_follow_llama_bench():
    assert [t.name for t in make_tests([512], [128], [(512, 128)], [0, 4096])] == [
        "pp512", "tg128", "pp512+tg128", "pp512 @ d4096", "tg128 @ d4096", "pp512+tg128 @ d4096"]
    assert BenchTest(0, 128, 512).name == "tg128 @ d512"  # as in llama-bench's README table


def test_field_names_are_llama_benchs():
    documented = {ln.strip() for ln in FIELDS.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    assert set(LLAMA_BENCH_FIELDS) <= documented
    assert {"avg_ts", "stddev_ts", "samples_ts", "samples_ns", "model_filename", "n_prompt", "n_gen"} <= documented


def test_bench_on_a_tiny_model_in_every_format(tiny):
    r = CliRunner().invoke(app, ["bench", "-m", str(tiny), "-p", "16", "-n", "4", "-d", "0,8", "-r", "2",
                                 "-t", "1,2", "-o", "json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    assert len(recs) == 2 * 2 * 2  # threads x tests x depths
    for rec in recs:
        assert rec["avg_ts"] > 0 and len(rec["samples_ts"]) == 2 and len(rec["samples_ns"]) == 2
        assert rec["n_prompt"] + rec["n_gen"] > 0 and rec["model_n_params"] > 0 and rec["model_size"] > 0
    assert {rec["n_threads"] for rec in recs} == {1, 2} and {rec["n_depth"] for rec in recs} == {0, 8}
    for rec in recs:  # the untimed depth prefill has its own speed; no depth, none
        assert (rec["depth_ts"] > 0) if rec["n_depth"] else rec["depth_ts"] is None
    md = CliRunner().invoke(app, ["bench", "-m", str(tiny), "-p", "16", "-n", "4", "-r", "2", "-t", "1,2"])
    assert md.exit_code == 0, md.output
    assert "| test | t/s |" in md.stdout and "| pp16 |" in md.stdout and "| tg4 |" in md.stdout and " ± " in md.stdout
    out = CliRunner().invoke(app, ["bench", "-m", str(tiny), "-p", "16", "-n", "0", "-r", "1", "-o", "csv"])
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert len(rows) == 1 and rows[0]["n_prompt"] == "16"
    jl = CliRunner().invoke(app, ["bench", "-m", str(tiny), "-p", "0", "-n", "2", "-r", "1", "-o", "jsonl",
                                  "--routing", "uniform", "--n-gen-warmup", "3"])
    rec = json.loads(jl.stdout)
    assert rec["routing"] == "uniform" and rec["n_gen_warmup"] == 3 and rec["n_gen"] == 2


@pytest.mark.parametrize("args,msg,code", [(["-o", "xml"], "-o 'xml'", 1), (["-r", "0"], "-r/--repetitions", 2),
                                           (["-pg", "512"], "pp,tg pairs", 1), (["-p", "0", "-n", "0"], "no tests", 1),
                                           (["-d", "-8"], "-d -8: values must be in [0, ", 1),
                                           (["-p", "0", "-n", "0", "-pg", "0,0"], "no tests", 1)])
def test_bad_bench_flags(tiny, args, msg, code):
    r = CliRunner().invoke(app, ["bench", "-m", str(tiny), *args])
    assert r.exit_code == code and msg in r.output  # 2: a usage error Click's range type caught
    assert r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1


def _cache_arms():
    return bench_scripts.load("cache_arms")


def test_cache_arms_plans_the_best_static_arm_and_renders_ratios(tiny):
    """bench/cache_arms.py: the static arm is the smallest --n-cpu-moe whose placement fits the
    budget (one layer fewer on the CPU would not fit), at the arms' KV type, planned as the bench
    child plans it (what is in use now plus the child's own CUDA context count against the budget);
    the table gives the cache-on ratios of the same run."""
    from moecache.gguf_file import open_gguf
    from moecache.placement import (CUDA_CONTEXT_BYTES, RESERVE_BYTES, USABLE_FRACTION, PlacementError,
                                    PlacementOptions, model_sizes, plan)

    arms = _cache_arms()
    with open_gguf(tiny) as m:
        sizes = model_sizes(m, 256, 2)
    n = sizes.n_layer
    # a budget that holds the dense part and about half the experts

    need = sum(sizes.dense) + n * sizes.kv + sizes.output + sizes.token_embd
    used = 100 << 20  # in use on the GPU now (this process's context, say)
    budget = int((RESERVE_BYTES + sizes.largest_matrix_f32 + need + sum(sizes.experts) // 2) / USABLE_FRACTION)
    budget += used + CUDA_CONTEXT_BYTES
    k = arms.best_static(tiny, 256, budget, 1 << 41, used, 2)
    assert 0 < k < n

    def fits(n_cpu):
        try:
            plan(PlacementOptions(n_gpu_layers=99, n_cpu_moe=n_cpu, vram_budget=budget), sizes, [1 << 41],
                 [used + CUDA_CONTEXT_BYTES])
            return True
        except PlacementError:
            return False

    assert fits(k) and not fits(k - 1)
    rows = [{"prompt": "p.txt", "budget": "8GiB", "routing": "uniform", "arm": arm, "n_prompt": 0, "n_gen": 64,
             "avg_ts": ts, "hit_rate": hr, "uploads_per_token": None, "vram_used_mib": 100}
            for arm, ts, hr in (("cache off (--cpu-moe)", 5.0, None), (f"best static (--n-cpu-moe {k})", 10.0, None),
                                ("cache on", 25.0, 0.5))]
    rows += [{**rows[1], "n_depth": 300, "avg_ts": 8.0}, {**rows[2], "n_depth": 300, "avg_ts": 20.0}]
    pp = arms.prefill_row({**rows[2], "n_depth": 300, "depth_ts": 123.0, "hit_rate": 0.5, "samples_ts": [25.0],
                           "samples_host_gb": [0.0]})
    assert (pp["n_prompt"], pp["n_gen"], pp["n_depth"], pp["avg_ts"], pp["hit_rate"]) == (300, 0, 0, 123.0, None)
    assert pp["avg_ns"] == round(300e9 / 123.0) and pp["samples_ts"] is None  # not the decode's samples
    assert pp["samples_host_gb"] is None  # the decode's bytes (its depth prefill not counted), not the prefill's
    with pytest.raises(SystemExit, match="depth_ts"):
        arms.prefill_row({**rows[2], "n_depth": 300, "depth_ts": None})
    md = arms.render(rows + [pp], "tiny.gguf", "-m tiny.gguf")
    assert "| p.txt | 8GiB | uniform | cache on | pp300 | 123.00 | - | - | 100 |" in md
    assert "| p.txt | 8GiB | uniform | tg64 | 2.50x | 5.00x |" in md
    assert "| p.txt | 8GiB | uniform | tg64 @ d300 | 2.50x | - |" in md  # decode after the long prompt


def test_depth_ts_is_the_depth_prefills_own_speed(monkeypatch):
    """run_test times a @ d test's depth prefill apart from the samples: with a clock that advances
    1 us per evaluated token, depth_ts is 1e6 t/s whatever the reps, and the samples hold only the
    timed tokens."""
    from types import SimpleNamespace

    from moecache import benchmark

    clock = [0]
    monkeypatch.setattr(benchmark.time, "perf_counter_ns", lambda: clock[0])

    class Eng:
        gguf = SimpleNamespace(config=SimpleNamespace(n_vocab=50))
        caches: list = []

        def reset(self):
            pass

        def eval(self, toks):
            clock[0] += 1000 * len(toks)

    for reps in (1, 3):
        samples, tot = benchmark.run_test(Eng(), benchmark.BenchTest(0, 4, 300), reps, True, np.random.default_rng(0))
        assert samples == [4000] * reps and tot["depth_ns"] == 300_000 * reps and tot["routing_primed"] is None
        assert benchmark.depth_ts(benchmark.BenchTest(0, 4, 300), reps, tot["depth_ns"]) == 1e6
    assert benchmark.depth_ts(benchmark.BenchTest(0, 4, 0), 3, 0) is None


def _routed_engine(proc, on_pass, n_ubatch: int = 8):
    """A stand-in engine for run_test with a --routing process: eval cuts the tokens into ubatches of
    ``n_ubatch`` and calls ``on_pass(n)`` for each (the forward pass, which routes its layers)."""
    from types import SimpleNamespace

    class Eng:
        gguf = SimpleNamespace(config=SimpleNamespace(n_vocab=50))
        caches: list = []
        model = SimpleNamespace(routing_override=proc)

        def reset(self):
            pass

        def eval(self, toks):
            for i in range(0, len(toks), self.n_ubatch):
                on_pass(min(self.n_ubatch, len(toks) - i))

    Eng.n_ubatch = n_ubatch
    return Eng()


def test_run_test_draws_the_prompts_first_ubatch_of_a_routing_process_before_the_clock(monkeypatch):
    """--routing: run_test has the routing process draw each timed prompt's first ubatch (min(prompt,
    -ub) tokens) before it starts the clock, so the samples exclude the emulation's host draw; a real
    RoutingProcess whose draw costs clock time shows it: the samples hold only the evaluation, and the
    draws counted equal the prompts (warm-up included). Without a prompt (tg) it draws nothing."""
    from moecache import benchmark
    from moecache.moe.routing_process import PRESETS, RoutingProcess

    clock = [0]
    monkeypatch.setattr(benchmark.time, "perf_counter_ns", lambda: clock[0])
    proc = RoutingProcess(PRESETS["qwen3-moe"], 2, 16, 2, seed=1)
    draws = []
    real_draw = proc._draw

    def costly_draw(n):
        draws.append(n)
        clock[0] += 7_000_000  # 7 ms a draw: outside the samples only if drawn before the clock
        return real_draw(n)

    proc._draw = costly_draw

    def forward(n):
        proc.route(0, n)  # the pass's routing of its two layers
        proc.route(1, n)
        clock[0] += 1000 * n

    def Eng():
        return _routed_engine(proc, forward)

    samples, tot = benchmark.run_test(Eng(), benchmark.BenchTest(5, 0, 0), 3, True, np.random.default_rng(0))
    assert samples == [5000] * 3 and draws == [5] * 4  # warm-up's draw in the pass; each timed one before
    assert tot["routing_primed"] == 3
    draws.clear()
    samples, _ = benchmark.run_test(Eng(), benchmark.BenchTest(20, 0, 0), 2, False, np.random.default_rng(0))
    # 8 + 8 + 4 tokens: the first ubatch's draw before the clock; the later ones in their passes (no
    # worker drawing ahead here), so inside the samples
    assert draws == [8, 8, 4] * 2 and samples == [20000 + 2 * 7_000_000] * 2
    draws.clear()
    samples, tot = benchmark.run_test(Eng(), benchmark.BenchTest(0, 3, 0), 2, False, np.random.default_rng(0))
    # tg: every one-token pass draws in its pass, on the clock; nothing drawn before it
    assert draws == [1] * 6 and samples == [3 * 7_000_000 + 3000] * 2 and tot["routing_primed"] == 0
    draws.clear()
    samples, tot = benchmark.run_test(Eng(), benchmark.BenchTest(5, 0, 16), 2, False, np.random.default_rng(0))
    # pp5 @ d16: the depth prefill's two passes draw in them (outside the samples, in depth_ns); the
    # prompt's pass is drawn after the depth, before the clock
    assert draws == [8, 8, 5] * 2 and samples == [5000] * 2
    assert tot["depth_ns"] == 2 * (16000 + 2 * 7_000_000)


def test_run_test_priming_keeps_the_routing_of_a_process_drawing_ahead_on_a_worker():
    """The GPU runs' setting (draw_passes_ahead: each multi-token pass starts the next one of its size
    on a worker): with run_test drawing each prompt's first ubatch before the clock, every pass still
    gets the choices of a process that draws each pass when asked (prompts of 8 + 8 + 4 tokens, so
    the worker's pending 4-token pass is dropped by each priming of 8, and one of 8 is kept)."""
    from moecache import benchmark
    from moecache.moe.routing_process import PRESETS, RoutingProcess

    n_layer = 3
    proc = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 16, 2, seed=4)
    proc.draw_passes_ahead = True
    ref = RoutingProcess(PRESETS["qwen3-moe"], n_layer, 16, 2, seed=4)
    got, want = [], []

    def forward(n):
        got.append(np.stack([proc.route(il, n).ids for il in range(n_layer)]))
        want.append(np.stack([ref.route(il, n).ids for il in range(n_layer)]))

    benchmark.run_test(_routed_engine(proc, forward), benchmark.BenchTest(20, 0, 0), 3, True, np.random.default_rng(0))
    benchmark.run_test(_routed_engine(proc, forward), benchmark.BenchTest(16, 0, 0), 2, False, np.random.default_rng(0))
    assert len(got) == 4 * 3 + 2 * 2
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), i


def test_prompt_timeline_summary_of_a_made_trace():
    """bench/prompt_timeline.py's report on a hand-made Chrome trace: busy time is the union of the
    device spans over every stream (an overlapped copy counts once), idle is the rest of the span,
    copies report bytes and GB/s, the idle gaps over 0.2 ms name their neighbours."""
    pt = bench_scripts.load("prompt_timeline")

    ev = [
        {"cat": "kernel", "name": "router", "ts": 0, "dur": 100},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 1100, "dur": 1000,
         "args": {"bytes": 50_000_000}},  # after a 1 ms gap
        {"cat": "kernel", "name": "moe", "ts": 1600, "dur": 1000},  # overlaps the copy by 0.5 ms
        {"cat": "kernel", "name": "moe", "ts": 2700, "dur": 300},  # a 0.1 ms gap: not listed
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 1000, "dur": 20},
    ]
    assert pt.busy_ms([(0, 100), (1100, 2100), (1600, 2600), (2700, 3000)]) == pytest.approx(1.9)
    lines = pt.summarize(ev)
    assert lines[0] == "GPU span 3.0 ms, busy (any stream) 1.9 ms, idle 1.1 ms"
    assert lines[1] == "  kernel busy 1.4 ms" and lines[2] == "  gpu_memcpy busy 1.0 ms"
    text = "\n".join(lines)
    assert "0.05 GB at 50.0 GB/s" in text and "2x  moe" in text
    assert "GPU idle gaps over 0.2 ms: 1, 1.0 ms in all" in text and "after router before Memcpy HtoD" in text


def test_bench_scripts_stay_off_sys_path():
    """bench/ never goes on sys.path in the tests: its kernels.py would shadow Hugging Face's
    ``kernels`` package, which transformers imports when it finds one (CI failed so: 18 reference
    tests, ImportError of CUDAProperties from bench/kernels.py)."""
    import importlib.util
    import re
    import sys

    bench_scripts.load("vs_llamacpp")
    assert all(Path(p or ".").resolve() != bench_scripts.BENCH for p in sys.path)
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin).resolve().parent != bench_scripts.BENCH
    here = Path(__file__).parent
    for f in sorted(here.glob("*.py")):
        for line in f.read_text().splitlines():
            assert not re.search(r"sys\.path\.(insert|append)\(.*bench", line), f"{f.name}: {line.strip()}"


def test_host_expert_layers_counts_the_layers_not_resident_on_a_device():
    """bench's ``host_expert_layers`` (vs_llamacpp.py --our-static's -ncmoe): the MoE layers whose
    executor is not a DeviceExperts (CPU experts or an expert cache), from the placed executors."""
    from types import SimpleNamespace

    from moecache.benchmark import host_expert_layers
    from moecache.moe.executor import CPUExperts, DeviceExperts, ExpertsByLayer

    dev, cpu = object.__new__(DeviceExperts), CPUExperts({})
    placed = ExpertsByLayer({il: cpu if il < 36 else dev for il in range(48)})
    assert host_expert_layers(SimpleNamespace(model=SimpleNamespace(experts=placed))) == 36
    assert host_expert_layers(SimpleNamespace(model=SimpleNamespace(experts=ExpertsByLayer({0: dev})))) == 0
    assert host_expert_layers(SimpleNamespace(model=SimpleNamespace(experts=None))) == 0


def test_after_prompt_runs_its_sequence_in_one_process(tmp_path, capsys, monkeypatch):
    """bench/after_prompt.py on the CPU: one JSON row per test of --sequence, in order, each with a
    speed; ``gc`` freezes Python's objects after a prompt (counted with the frozen ones)."""
    import gc
    import json

    from moecache.testing.synth import PRESETS, write_model

    mod = bench_scripts.load("after_prompt")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # the script's wait policy leaves this process's env as it was
    model = tmp_path / "tiny.gguf"
    write_model(model, PRESETS["tiny"], seed=1)
    try:
        mod.main(["-m", str(model), "-p", "8", "-n", "3", "-c", "64", "-t", "2", "--load-mode", "mmap",
                  "--vram-budget", "0", "--sequence", "tg,pp,tg", "--after-prompt", "gc"])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert [r["test"] for r in rows] == ["tg3", "pp8", "tg3"] and all(r["t_s"] > 0 for r in rows)
    assert rows[2]["gc_objects"] >= rows[0]["gc_objects"] // 2  # the frozen objects still counted
    with pytest.raises(SystemExit):
        mod.main(["-m", str(model), "--sequence", "tg,xx"])


def test_run_test_counts_the_timed_steps_replayed_as_a_graph_and_the_rows_carry_them():
    """run_test's graph_steps: the timed one-token steps the decode graph replayed (a step run op by
    op, as every -ncmoe step under --routing was before the twenty-eighth session, does not count;
    neither do warm-up steps); bench's jsonl rows carry it and host_expert_layers."""
    from types import SimpleNamespace

    from moecache.benchmark import BenchTest, Result, render, run_test

    class FakeEngine:
        def __init__(self, every):
            self.every, self.calls = every, 0
            self.model = SimpleNamespace(decode_graph=SimpleNamespace(replays=0))
            self.gguf = SimpleNamespace(config=SimpleNamespace(n_vocab=10))

        def reset(self):
            pass

        def eval(self, toks):
            if len(toks) == 1:
                self.calls += 1
                if self.calls % self.every == 0:  # the graph replays every `every`-th step
                    self.model.decode_graph.replays += 1

    rng = np.random.default_rng(0)
    t = BenchTest(n_prompt=0, n_gen=8, n_depth=0)
    for every, want in ((1, 24), (2, 12)):
        eng = FakeEngine(every)
        _, tot = run_test(eng, t, 3, True, rng)  # the warm-up's one step is not timed
        assert tot["graph_steps"] == want and eng.calls == 25
    r = Result(fields={"host_expert_layers": 36, "graph_steps": 384}, samples_ns=[1], n_tokens=1)
    row = json.loads(render([r], "jsonl", []).splitlines()[0])
    assert row["host_expert_layers"] == 36 and row["graph_steps"] == 384


def test_plan_fields_count_the_layers_per_share():
    from types import SimpleNamespace

    from moecache.benchmark import plan_fields

    def cache(layer_plan, shares, layers=None):  # a plan has a row per model layer; the cache holds `layers`
        plan = None if shares is None else SimpleNamespace(share=np.array(shares))
        held = set(range(len(shares or ()))) if layers is None else set(layers)
        return SimpleNamespace(policy=SimpleNamespace(layer_plan=layer_plan, plan=plan), cached_layers=held)

    assert plan_fields(SimpleNamespace()) == {"cache_plan": "expert", "plan_cpu_layers": None, "plan_shares": None}
    assert plan_fields(SimpleNamespace(caches=[cache(False, None)]))["cache_plan"] == "expert"
    assert plan_fields(SimpleNamespace(caches=[cache(True, None)])) == {"cache_plan": "layer", "plan_cpu_layers": None,
                                                                         "plan_shares": None}
    got = plan_fields(SimpleNamespace(caches=[cache(True, [0, 4, 4, 0, 3]), cache(True, [4])]))
    assert got == {"cache_plan": "layer", "plan_cpu_layers": 4, "plan_shares": "0x2 3x1 4x3"}
    # two GPUs' caches, each with its own layers of a 4-layer model: each layer counted once
    got = plan_fields(SimpleNamespace(caches=[cache(True, [4, 4, 0, 0], [0, 1]), cache(True, [0, 0, 3, 0], [2, 3])]))
    assert got == {"cache_plan": "layer", "plan_cpu_layers": 3, "plan_shares": "0x1 3x1 4x2"}


def test_routing_reuse_counts_the_last_tokens_experts():
    """bench/routing_reuse.py's reuse(): against a hand count on a tiny sequence, and uniform
    routing's share near chance (k / n_expert for the last token)."""
    from bench_scripts import load

    rr = load("routing_reuse")
    ids = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]]], np.int32)  # 4 tokens, 1 layer, top-2 of 4
    # last token: t1 reuses 1 of {0,1}; t2 reuses 2 of {1,2}; t3 reuses 3 of {2,3}: 3 of 6 pairs
    assert rr.reuse(ids, 4, 1) == (0.5, 2.0)
    # last two tokens: t2 {0,1,2} holds 2; t3 {1,2,3} holds 3: 2 of 4 pairs, 3 experts held
    assert rr.reuse(ids, 4, 2) == (0.5, 3.0)
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    flat = np.random.default_rng(seed).random((2000, 3, 64)).argsort(axis=2)[:, :, :4].astype(np.int32)
    share, held = rr.reuse(flat, 64, 1)
    assert held == 4.0 and abs(share - 4 / 64) < 0.015


def test_run_test_sums_the_miss_paths_of_every_cache():
    """run_test's totals carry the CPU's misses and the GPU's waits for them (CacheStats.cpu_misses,
    cpu_wait_ns) over the timed steps only, summed over the caches, as hits and misses are; bench's
    jsonl rows carry the per-token fields."""
    from types import SimpleNamespace

    from moecache.benchmark import BenchTest, Result, miss_paths, render, run_test
    from moecache.moe.cache import CacheStats

    class Cache:
        def __init__(self, cpu, wait):
            self.stats, self.cpu, self.wait = CacheStats(), cpu, wait

        def reset_stats(self):
            self.stats.reset()

        def flush(self):
            pass

    class Eng:
        gguf = SimpleNamespace(config=SimpleNamespace(n_vocab=10))

        def __init__(self):
            self.caches = [Cache(3, 1000), Cache(1, 500)]

        def reset(self):
            pass

        def eval(self, toks):
            for c in self.caches:
                c.stats.tokens += len(toks)
                c.stats.misses += 2 * c.cpu
                c.stats.cpu_misses += c.cpu
                c.stats.cpu_wait_ns += c.wait

    _, tot = run_test(Eng(), BenchTest(0, 5, 0), 2, True, np.random.default_rng(0))  # the warm-up step not counted
    assert (tot["tokens"], tot["misses"], tot["cpu_misses"], tot["cpu_wait_ns"]) == (10, 80, 40, 15000)
    # per token: 8 misses, 4 of them the CPU's, 1.5 us of waiting (15000 ns over 10 tokens)
    assert miss_paths(tot) == {"misses_per_token": 8.0, "cpu_misses_per_token": 4.0, "cpu_wait_us_per_token": 1.5}
    assert set(miss_paths({**tot, "tokens": 0}).values()) == {None}
    r = Result(fields={"misses_per_token": 8.0, "cpu_misses_per_token": 4.0, "cpu_wait_us_per_token": 1.5},
               samples_ns=[1], n_tokens=1)
    row = json.loads(render([r], "jsonl", []).splitlines()[0])
    assert (row["misses_per_token"], row["cpu_misses_per_token"], row["cpu_wait_us_per_token"]) == (8.0, 4.0, 1.5)


def test_prompt_chunks_counts_the_plans_and_parses_its_arms():
    """bench/prompt_chunks.py: its counter records each plan call's chunks, padded rows, routed pairs
    and distinct chunk shapes as the plan returns them (a ratio of 8 makes fewer chunks than 2 on
    a skewed routing, the same pairs), its table averages them per MoE call and per pair, and an arm
    is RATIO,POW2 with a ratio >= 1."""
    import argparse

    from moecache.backends.moe_plan import layer_plan

    pc = bench_scripts.load("prompt_chunks")
    rng = np.random.default_rng(5)
    p = np.exp(3.0 * rng.standard_normal(64))
    ids = np.stack([rng.choice(64, 8, replace=False, p=p / p.sum()) for _ in range(512)]).astype(np.int32)
    got = {}
    for ratio in (2, 8):
        c = pc.ChunkCounter(layer_plan)
        chunks, _, _, n_r, n_p = c(ids, 64, 40, 8192, 64 << 20, 16, ratio, False)
        assert c.calls == [(len(chunks), n_r, n_p)] and n_p == ids.size
        assert c.shapes == {(int(a), int(b)) for a, b in chunks}
        got[ratio] = c.calls[0]
        c.clear()
        assert c.calls == [] and c.shapes == set()
    assert got[8][0] < got[2][0] and got[8][1] >= got[2][1]  # fewer chunks, more padded rows
    lines = pc.table([("a", [100.0, 300.0, 200.0], [(4, 60, 40), (2, 20, 20)], {(1, 16), (2, 32)})])
    assert lines[2] == "| a | 200 | 100, 300, 200 | 3.00 | 2 | 1.33 |"
    assert pc.table([("b", [], [(1, 16, 8)], set())])[2] == "| b | - | - | 1.00 | 0 | 2.00 |"
    counted = pc.count_only([(2, False), (8, True)], 64, 1, "uniform")  # the plans of one drawn prompt
    assert len(counted) == 4 and counted[2].startswith("| ratio 2, align 16 | - | - |")
    split = pc.count_only([(2, False)], 64, 1, "uniform", resident=0.25, group=8)  # the cache's calls
    per_call = lambda line: float(line.split("|")[4])  # noqa: E731 - chunks per MoE call
    assert per_call(split[2]) < per_call(counted[2])  # more calls a layer, each of fewer experts
    assert pc.parse_arm("4,1") == (4, True) and pc.parse_arm("2,0") == (2, False)
    for bad in ("x", "0,1", "4"):
        with pytest.raises(argparse.ArgumentTypeError):
            pc.parse_arm(bad)


def test_run_test_counts_each_samples_host_bytes_apart_from_the_warm_up_and_depth():
    """With experts placed per layer (ExpertsByLayer), run_test reports per timed sample the bytes
    copied from host RAM (the caches' ``offload.offloaded_bytes`` and the op offload's own, over the
    sample): a stand-in whose prompt passes copy 100 bytes a token into one cache (serving two layers,
    counted once) and 7 into an op-offload layer, and fewer each prompt (as the prompt keeps fill
    slots), gives exactly those per-sample sums; the warm-up and the depth prefill copy too but are
    not counted; without per-layer experts the list is None."""
    from types import SimpleNamespace

    from moecache import benchmark
    from moecache.moe.executor import ExpertsByLayer

    class Cache:
        def __init__(self, per_token):
            self.offload = SimpleNamespace(offloaded_bytes=0)
            self.stats = SimpleNamespace(hits=0, misses=0, uploads=0, cpu_misses=0, cpu_wait_ns=0, tokens=0)
            self.per_token = per_token

        def reset_stats(self):
            pass

        def flush(self):
            pass

    caches = [Cache(100), Cache(7)]
    offload = caches[1].offload  # layer 2: an op-offload executor (its own counter, no cache around it)
    evals = []

    class Eng:
        gguf = SimpleNamespace(config=SimpleNamespace(n_vocab=50))

        def reset(self):
            pass

        def eval(self, toks):
            evals.append(len(toks))
            for c in caches:  # the k-th eval copies less than the one before
                c.offload.offloaded_bytes += c.per_token * len(toks) // len(evals)

    Eng.caches = caches[:1]
    Eng.model = SimpleNamespace(experts=ExpertsByLayer({0: caches[0], 1: caches[0], 2: offload}))
    samples, tot = benchmark.run_test(Eng(), benchmark.BenchTest(12, 0, 30), 3, True, np.random.default_rng(0))
    # evals: warm-up 12 (1st), then per rep depth 30 and prompt 12: the prompts are evals 3, 5, 7
    assert evals == [12, 30, 12, 30, 12, 30, 12]
    want = [sum(per * 12 // k for per in (100, 7)) for k in (3, 5, 7)]
    assert tot["host_bytes"] == want == [400 + 28, 240 + 16, 171 + 12]
    Eng.caches, Eng.model = [], None
    _, tot = benchmark.run_test(Eng(), benchmark.BenchTest(12, 0, 0), 2, False, np.random.default_rng(0))
    assert tot["host_bytes"] is None
    # the records: json/jsonl carry the list beside the samples, csv (as llama-bench's) leaves lists out
    r = benchmark.Result(fields={"samples_host_gb": [0.428, 0.256]}, samples_ns=[1, 1], n_tokens=12)
    assert json.loads(benchmark.render([r], "jsonl", []).splitlines()[0])["samples_host_gb"] == [0.428, 0.256]
    assert "samples_host_gb" not in benchmark.render([r], "csv", []).splitlines()[0]
