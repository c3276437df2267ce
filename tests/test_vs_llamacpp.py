"""bench/vs_llamacpp.py's logic on the CPU: case command lines, the -ncmoe search against measured
peaks, VRAM sampling, resumable rows. Stock llama.cpp and nvidia-smi are stand-ins here: a fake
llama-bench sets a "used memory" that a fake nvidia-smi reports, so the sampler and the search run
for real."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

import bench_scripts

ROOT = Path(__file__).resolve().parents[1]
V = bench_scripts.load("vs_llamacpp")

FAKE_SMI = """#!{py}
import sys, time, os
mem = os.environ["FAKE_MEM"]
def used():
    try:
        return int(open(mem).read() or 0)
    except (OSError, ValueError):
        return 0
if "-lms" in sys.argv:
    while True:
        print(1000 + used(), flush=True)
        time.sleep(0.05)
print(1000)
"""

FAKE_BENCH = """#!{py}
import json, os, sys, time
a = sys.argv
k = int(a[a.index("-ncmoe") + 1]) if "-ncmoe" in a else 0
r = int(a[a.index("-r") + 1])
# fewer expert layers on the GPU: less VRAM; a timed run (-r 3) peaks 200 MiB above the probe (-r 1)
open(os.environ["FAKE_MEM"], "w").write(str(9000 - 100 * k + (200 if r > 1 else 0)))
time.sleep(0.4)
open(os.environ["FAKE_MEM"], "w").write("0")
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
print(json.dumps(dict(avg_ts=50.0 + k, stddev_ts=0.5, samples_ts=[50.0 + k], n_cpu_moe=k, n_ubatch=512,
                      n_prompt=p, n_gen=n, build_commit="fake", gpu_info="none")))
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text.replace("{py}", sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture()
def fakes(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _script(bindir / "nvidia-smi", FAKE_SMI)
    bench = _script(bindir / "llama-bench", FAKE_BENCH)
    monkeypatch.setenv("FAKE_MEM", str(tmp_path / "mem"))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return bench


def test_case_names_are_the_specs():
    spec = (ROOT.parent / "shared" / "vs-llamacpp.md")
    names = {"gpu-pp512", "gpu-tg128", "gpu-tg128-d16384", "8g-tg128-qwen3-moe", "8g-tg128-low-locality",
             "8g-tg128-uniform", "8g-tg64-d12620-qwen3-moe", "8g-pp512", "8g-pp12620", "cpu-moe-tg64",
             "pinned-pp512", "pinned-pp2048-ub2048", "x2-gpu-tg128", "x2-8g-tg128-qwen3-moe", "x2-8g-tg128-uniform"}
    assert set(V.CASES) == names
    if spec.exists():  # the spec's table names each case
        text = spec.read_text()
        assert all(n.split("-")[0] in text for n in names)


def test_command_lines_follow_the_fairness_rules():
    c = V.CASES["8g-tg64-d12620-qwen3-moe"]
    ll = V.llama_cmd("lb", "m.gguf", c, 29, 3, 15)
    assert ll[ll.index("-fa") + 1] == "1" and ll[ll.index("-t") + 1] == "15" and ll[ll.index("-lm") + 1] == "none"
    assert ll[ll.index("-ncmoe") + 1] == "29" and ll[ll.index("-d") + 1] == "12620" and ll[ll.index("-n") + 1] == "64"
    us = V.ours_cmd("m.gguf", c, 3, 15, 256)
    assert us[us.index("--vram-budget") + 1] == "8192MiB" and us[us.index("--routing") + 1] == "qwen3-moe"
    assert us[us.index("--load-mode") + 1] == "pin" and V.warmup_of(us) == 256 and us[us.index("-d") + 1] == "12620"
    g = V.CASES["gpu-tg128"]
    assert "-lm" not in V.llama_cmd("lb", "m", g, None, 3, 15) and "-ncmoe" not in V.llama_cmd("lb", "m", g, None, 3, 15)
    assert V.warmup_of(V.ours_cmd("m", g, 3, 15, 256)) == 0  # no cache: nothing to warm
    assert "--miss-split" not in us and "--miss-split" in V.ours_cmd("m.gguf", c, 3, 15, 256, miss_split=True)
    assert "--miss-split" not in V.ours_cmd("m", g, 3, 15, 256, miss_split=True)  # no cache: nothing to split
    assert "--elastic-slots" not in us and "--elastic-slots" in V.ours_cmd("m.gguf", c, 3, 15, 256, elastic_slots=True)
    assert "--elastic-slots" not in V.ours_cmd("m", g, 3, 15, 256, elastic_slots=True)
    assert "--no-elastic-slots" in V.ours_cmd("m.gguf", c, 3, 15, 256, elastic_slots=False)
    assert "--cache-plan" not in us and V.ours_cmd("m.gguf", c, 3, 15, 256, cache_plan="expert")[-2:] == \
        ["--cache-plan", "expert"]
    st = V.ours_cmd("m.gguf", c, 3, 15, 256, static=True)  # --our-static: the budget's static placement
    assert st[st.index("--moe-cache") + 1] == "0" and "-1" not in st and V.warmup_of(st) == 0
    assert st[st.index("--vram-budget") + 1] == "8192MiB" and st[st.index("--load-mode") + 1] == "pin"
    assert V.ours_cmd("m", g, 3, 15, 256, static=True) == V.ours_cmd("m", g, 3, 15, 256)  # no cache case: as is
    ub = V.llama_cmd("lb", "m", V.CASES["pinned-pp2048-ub2048"], 48, 3, 15)
    assert ub[ub.index("-ub") + 1] == "2048" and ub[ub.index("-b") + 1] == "2048"
    assert V.CASES["8g-tg64-d12620-qwen3-moe"].test == "tg64 @ d12620" and V.CASES["gpu-pp512"].test == "pp512"


@pytest.mark.parametrize("hint", [0, 10, 29, 48])
def test_smallest_fitting_ncmoe(hint):
    peak = {k: 9000 - 100 * k for k in range(49)}  # fits 8192 MiB from k = 9
    best, tried = V.smallest_fitting(lambda k: peak[k], 8192, 0, 48, hint)
    assert best == 9 and all(peak[k] == v for k, v in tried.items())
    assert 8 in tried or hint < 9  # the one below the answer was shown to be over
    with pytest.raises(RuntimeError, match="over the 100 MiB budget"):
        V.smallest_fitting(lambda k: peak[k], 100, 0, 48, hint)


def test_sampler_sees_a_process_peak(fakes, tmp_path):
    with V.VramSampler() as s:
        V.run_jsonl([str(fakes), "-p", "0", "-n", "1", "-r", "1", "-ncmoe", "5"], tmp_path / "log")
    assert s.base == [1000] and s.peak_mib == 9000 - 500


def test_a_run_with_fake_llama_bench_and_the_real_moecache_bench(fakes, tmp_path, capsys):
    from moecache.testing.synth import PRESETS, write_model

    model = tmp_path / "tiny.gguf"
    write_model(model, PRESETS["tiny"], seed=1)
    out = tmp_path / "vs"
    args = ["-m", str(model), "--llama-bench", str(fakes), "--cases", "gpu-tg128,8g-tg128-uniform",
            "-r", "2", "-t", "2", "--n-gen-warmup", "2", "--run", "t1", "--ncmoe-hint", "5", "--our-load-mode", "mmap", "--out", str(out)]
    assert V.main(args) == 0
    rows = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    assert [(r["case"], r["engine"]) for r in rows] == [("gpu-tg128", "llama.cpp"), ("gpu-tg128", "moecache"),
                                                         ("8g-tg128-uniform", "llama.cpp"), ("8g-tg128-uniform", "moecache")]
    spec_fields = {"run", "case", "engine", "test", "avg_ts", "stddev_ts", "samples_ts", "n_cpu_moe", "vram_budget_mib",
                   "vram_peak_mib", "routing", "hit_rate", "n_ubatch", "build_commit", "date", "gpu_info"}
    assert all(spec_fields <= set(r) for r in rows)
    ll = rows[2]
    # the probe's -ncmoe 9 fits (8100 MiB) but its timed run peaks at 8300: 10 (8200) is over too, 11 fits
    assert ll["n_cpu_moe"] == 11 and ll["vram_peak_mib"] == 8100 and ll["avg_ts"] == 61.0
    assert rows[3]["test"] == "tg128" and rows[3]["avg_ts"] > 0 and rows[3]["routing"] == "uniform"
    assert rows[3]["n_gen_warmup"] == 2
    md = out.with_suffix(".md").read_text()
    assert "| 8g-tg128-uniform | tg128 | 61.00" in md and "8100 (11)" in md
    # the same run again: nothing reruns
    assert V.main(args) == 0
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 4
    assert json.loads(out.with_suffix(".ncmoe.json").read_text())["8192:0+128@0:512:1"]["best"] == 11


def test_experts_in_vram_per_gib_of_budget():
    """Issue 19's experts held per GiB of budget: llama.cpp's arm holds every expert of the layers
    -ncmoe leaves on the GPU, ours the slots granted; the numbers of run h200-s11p's 8g-pp512 (our
    log: 4797 MiB granted = 1895 slots of 2.53 MiB; llama.cpp at -ncmoe 29) give 304 and 237 per GiB."""
    facts = V.ExpertFacts(tuple(range(48)), 128, 2654208)  # Qwen3-30B-A3B Q4_K: 3 x 768 x 2048 weights at 4.5 bits
    c = V.CASES["8g-pp512"]
    assert V.experts_in_vram({}, c, "llama.cpp", 29, facts) == 19 * 128
    # moecache bench's field: 1895 slots x 2.53125 MiB = 4796.72 MiB, rounded to 4796.7
    assert V.experts_in_vram({"moe_cache_mib_granted": 4796.7}, c, "moecache", 0, facts) == 1895
    leading_dense = V.ExpertFacts(tuple(range(3, 48)), 128, 2654208)  # experts from layer 3 on
    assert V.experts_in_vram({}, c, "llama.cpp", 29, leading_dense) == 19 * 128
    assert V.experts_in_vram({}, c, "llama.cpp", 2, leading_dense) == 45 * 128
    assert V.experts_in_vram({}, c, "moecache", 0, facts) is None  # no granted size reported
    assert V.experts_in_vram({}, V.CASES["gpu-tg128"], "llama.cpp", None, facts) is None  # no budget
    rows = [V.row_of({"avg_ts": 2040.0}, "r", c, "llama.cpp", 8141, 29, 0, 2432),
            V.row_of({"avg_ts": 832.0}, "r", c, "moecache", 8161, None, 0, 1895)]
    md = V.render(rows, "r", "# h")
    assert "| 8g-pp512 | pp512 | 2040.00 ± 0.00 | 832.00 ± 0.00 | 0.41 | - | 8141 (29) | 8161 | 8192 | - | 304 / 237 |" in md
    # the ratio of the samples' medians beside the means' (run h200-s17b's gpu-pp512: 0.83 and 0.78)
    g = V.CASES["gpu-pp512"]
    md3 = V.render([V.row_of({"avg_ts": 7178.0, "samples_ts": [6007.04, 7778.76, 7748.19]}, "r", g, "llama.cpp", 1, None, 0),
                    V.row_of({"avg_ts": 5945.73, "samples_ts": [6083.61, 6070.29, 5683.30]}, "r", g, "moecache", 1, None, 0)],
                   "r", "# h")
    assert "| 0.83 | 0.78 |" in md3
    # --our-static: every expert of the layers our planner left on the GPU (h200-s28: 36 of 48 on the CPU)
    static = {"avg_ts": 70.0, "moe_cache": 0, "host_expert_layers": 36, "n_cpu_moe": 0, "moe_cache_mib_granted": 0.0}
    assert V.experts_in_vram(static, c, "moecache", 0, facts, static=True) == 12 * 128
    assert V.experts_in_vram({"host_expert_layers": None}, c, "moecache", 0, facts, static=True) is None
    st_row = V.row_of(static, "r", c, "moecache", 5684, None, 0, 12 * 128, static=True)
    assert st_row["n_cpu_moe"] == 36 and st_row["our_placement"] == "static" and rows[1]["our_placement"] == "default"
    # a default row keeps the flag's -ncmoe even when bench reports its cached layers (48 behind the cache)
    cached = V.row_of({"avg_ts": 55.0, "n_cpu_moe": 0, "host_expert_layers": 48, "moe_cache": -1}, "r", c,
                      "moecache", 6737, None, 256, 1850)
    assert cached["n_cpu_moe"] == 0 and cached["our_placement"] == "default"
    cpu = V.row_of({"avg_ts": 48.0, "n_cpu_moe": 999, "host_expert_layers": 48, "moe_cache": 0,
                    "cache_plan": "expert"}, "r", V.CASES["cpu-moe-tg64"], "moecache", 1931, None, 0)
    assert cpu["n_cpu_moe"] == 999 and cpu["our_placement"] == "default"  # --cpu-moe is not --our-static
    # a cache case's row says which plan ran (auto resolves to either)
    for plan, want in (("layer", "layer plan"), ("expert", "per-expert")):
        got = V.row_of({"avg_ts": 55.0, "moe_cache": -1, "cache_plan": plan}, "r", c, "moecache", 6737, None, 256, 1850)
        assert got["our_placement"] == want and got["cache_plan"] == plan
    # the plan's CPU layers where a decode made one; a prompt-only run says only which plan (h200-s38p
    # printed "None CPU layers")
    planned = V.row_of({"avg_ts": 55.0, "moe_cache": -1, "cache_plan": "layer", "plan_cpu_layers": 29}, "r", c,
                       "moecache", 8017, None, 256, 2396)
    prompt_only = V.row_of({"avg_ts": 1309.0, "moe_cache": -1, "cache_plan": "layer"}, "r", c, "moecache", 7527,
                           None, 0, 2396)
    assert "| 8017 (layer plan, 29 CPU layers) |" in V.render([rows[0], planned], "r", "# h")
    md4 = V.render([rows[0], prompt_only], "r", "# h")
    assert "| 7527 (layer plan) |" in md4 and "None" not in md4
    assert "| 5684 (36, static) | 8192 | - | 304 / 192 |" in V.render([rows[0], st_row], "r", "# h")
    x2 = V.CASES["x2-8g-tg128-uniform"]  # 8 GiB per GPU, two GPUs: per GiB of the 16 GiB in all
    md2 = V.render([V.row_of({"avg_ts": 1.0}, "r", x2, "llama.cpp", 8000, 10, 0, 4096),
                    V.row_of({"avg_ts": 1.0}, "r", x2, "moecache", 8000, None, 0, 2048)], "r", "# h")
    assert "| 256 / 128 |" in md2


def test_our_static_refuses_the_cache_only_flags(capsys):
    with pytest.raises(SystemExit) as e:
        V.main(["--llama-bench", "/bin/false", "--miss-split", "--cache-plan", "layer"])
    assert e.value.code == 2 and "--miss-split goes without it" in capsys.readouterr().err
    for flag in ("--miss-split", "--elastic-slots", "--no-elastic-slots", "--cache-plan=layer"):
        with pytest.raises(SystemExit) as e:
            V.main(["--llama-bench", "/bin/false", "--our-static", flag])
        assert e.value.code == 2 and "--our-static turns the expert cache off" in capsys.readouterr().err


def test_expert_facts_match_gguf_py(tmp_path):
    """expert_facts against gguf-py's own reader: the bytes of layer 0's three expert tensors per expert."""
    import gguf

    from moecache.testing.synth import PRESETS, SynthConfig, write_model

    path = tmp_path / "moe.gguf"
    write_model(path, SynthConfig(**{**PRESETS["tiny"].__dict__, "n_expert": 16, "n_expert_used": 4}), seed=3)
    r = gguf.GGUFReader(str(path))
    per = sum(int(t.n_bytes) for t in r.tensors if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight"))
    n_moe = len({t.name.split(".")[1] for t in r.tensors if t.name.endswith("ffn_gate_exps.weight")})
    f = V.expert_facts(str(path))
    assert f == V.ExpertFacts(tuple(range(n_moe)), 16, per // 16)
