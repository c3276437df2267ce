"""``moecache profile`` and moecache/moe/profile.py: the recorded trace replays through
``--routing FILE`` to the same choices, recording changes no logits, counts equal a count of the
trace, the PNG is written, the what-if equals the replay module's numbers and grows with the budget,
and saved usage profiles are keyed by model (a foreign one is refused)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

import moecache
from moecache.cli.main import app
from moecache.moe.policy import PolicyConfig
from moecache.moe.profile import (
    ArrayRouting, CostModel, RouteRecorder, Trace, UsageProfile, layer_skew, usage_counts, what_if)
from moecache.moe.replay import replay_lru, replay_policy
from moecache.moe.routing_process import TraceRouting

from conftest import require_shared

runner = CliRunner()
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("prof") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=3)
    return path


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory) -> Trace:
    """The first 384 tokens of code-moe-tiny's real routing (8 layers, 16 experts, top-4)."""
    return Trace.load(require_shared("code-moe-tiny.routes.npz")).head(384)


def _profile(*args: str):
    r = runner.invoke(app, ["profile", *args])
    return r


def test_trace_round_trips_through_routing_file(code_moe_tiny, tmp_path):
    """A trace recorded by ``profile --trace`` replayed with ``--routing FILE`` gives the same expert
    choices and weights, so the same greedy tokens."""
    t1, t2 = tmp_path / "t1.npz", tmp_path / "t2.npz"
    common = ["-m", str(code_moe_tiny), "-p", PROMPT, "-n", "6", "-c", "128", "-t", "1"]
    r = _profile(*common, "--trace", str(t1))
    assert r.exit_code == 0, r.output
    r = _profile(*common, "--routing", str(t1), "--trace", str(t2))
    assert r.exit_code == 0, r.output
    a, b = Trace.load(t1), Trace.load(t2)
    assert a.routes.shape[0] == 8 and a.routes.shape[2] == 4 and a.n_expert == 16 and a.expert_bytes > 0
    assert a.n_tokens == a.tokens.size > 6  # prompt + generated tokens fed, all recorded
    np.testing.assert_array_equal(a.routes, b.routes)
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    tr = TraceRouting(t1)  # what --routing reads
    np.testing.assert_array_equal(tr.routes, a.routes)
    # the skew summary and the heatmap are on stdout, one row per layer
    assert r.stdout.count("top-10% experts take") == 8


def test_recording_changes_no_logits_and_counts_equal_the_trace(tiny):
    with moecache.load(tiny, n_ctx=64, n_threads=1) as llm:
        eng = llm.engine
        toks = np.arange(1, 12)
        plain = eng.eval(toks, "all")
        eng.reset()
        rec = RouteRecorder()
        eng.model.route_observers.append(rec)
        recorded = eng.eval(toks, "all")
        eng.model.route_observers.remove(rec)
        np.testing.assert_array_equal(plain, recorded)
        c = eng.gguf.config
        trace = rec.trace(c.n_expert, 0, toks)
    assert trace.routes.shape == (c.n_layer, toks.size, c.n_expert_used)
    np.testing.assert_array_equal(trace.tokens, toks)
    counts = usage_counts(trace.routes, c.n_expert)
    manual = np.zeros((c.n_layer, c.n_expert), np.int64)
    for il in range(c.n_layer):
        for t in range(toks.size):
            for e in trace.routes[il, t]:
                manual[il, e] += 1
    np.testing.assert_array_equal(counts, manual)
    assert (counts.sum(axis=1) == toks.size * c.n_expert_used).all()


def test_skew_summary_extremes():
    uniform = np.full((1, 20), 5)
    one = np.zeros((1, 20), np.int64)
    one[0, 7] = 100
    u, o = layer_skew(uniform)[0], layer_skew(one)[0]
    assert u.top10_share == pytest.approx(0.1) and u.entropy == pytest.approx(1.0) and u.experts_90 == pytest.approx(0.9)
    assert o.top10_share == 1.0 and o.entropy == 0.0 and o.experts_90 == pytest.approx(0.05) and o.top_expert == 7


def test_what_if_equals_the_replay_module_and_is_monotonic(real_trace, tmp_path):
    eb = 300 * 1024
    cost = CostModel.from_link(0.01, 25e9, eb)
    budgets = [eb * n for n in (4, 8, 16, 32, 64, 96, 128)]
    rows = what_if(real_trace, budgets, cost, expert_bytes=eb)
    cfg = PolicyConfig()
    for r, b in zip(rows, budgets):
        assert r.n_slots == b // eb
        ours = replay_policy(ArrayRouting(real_trace), 8, 16, real_trace.n_tokens, r.n_slots, cfg)
        lru = replay_lru(ArrayRouting(real_trace), 8, real_trace.n_tokens, r.n_slots, cfg)
        assert r.ours == ours and r.lru == lru
        assert r.tokens_per_s == pytest.approx(1 / (0.01 + (ours.misses + ours.uploads) / ours.tokens * eb / 25e9))
        counts = usage_counts(real_trace.routes, 16)
        best = sorted(counts.reshape(-1), reverse=True)[:r.n_slots]
        assert r.static_hit_rate == pytest.approx(sum(best) / counts.sum())
    hits = [r.ours.hit_rate for r in rows]
    static = [r.static_hit_rate for r in rows]
    assert static == sorted(static) and rows[-1].static_hit_rate == 1.0  # 128 slots: every expert
    tps = [r.tokens_per_s for r in rows]
    assert hits == sorted(hits) and tps == sorted(tps) and hits[-1] > hits[0]
    # the trace file read by --trace-in replays the same as the in-memory one (TraceRouting)
    path = tmp_path / "real.npz"
    real_trace.save(path)
    assert replay_policy(TraceRouting(path), 8, 16, real_trace.n_tokens, 32, cfg) == rows[3].ours
    # the CLI prints the library's numbers under the policy costs a run here resolves, and says the
    # speed is uncalibrated
    from moecache.cli.profile import ProfileOptions, what_if_policy

    machine, _ = what_if_policy(real_trace_of(real_trace, eb), ProfileOptions(link_gbps=25.0), None)
    first = what_if(real_trace_of(real_trace, eb), budgets[:1], cost, machine)[0]
    r = _profile("--trace-in", str(path), "--what-if", "1200KiB,2400KiB", "--expert-mib", str(eb / 2**20),
                 "--link-gbps", "25", "--step-ms", "10")
    assert r.exit_code == 0, r.output
    assert "UNCALIBRATED" in r.stdout
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("| | | 1")]
    assert len(table) == 1 and (f"| {100 * first.ours.hit_rate:.1f}% | {100 * first.lru.hit_rate:.1f}% | "
                                f"{100 * first.static_hit_rate:.1f}% |") in table[0]
    assert f"| {first.tokens_per_s:.1f} |" in table[0]


def real_trace_of(trace: Trace, expert_bytes: int) -> Trace:
    return Trace(trace.routes, trace.weights, trace.n_expert, expert_bytes, trace.tokens)


def test_calibration_recovers_a_known_cost_model():
    """Runs made by a known model (step 4 ms, a miss 60 us, an upload 50 us) are fitted back exactly
    from two or more rows; one row takes the miss at the link rate; rows that are not decode runs
    with a cache are skipped; an unphysical fit is refused."""
    from moecache.moe.profile import CalibrationPoint, calibrate, calibration_points

    eb, link = 2_650_000, 53e9  # upload: 50 us
    truth = CostModel(4e-3, 60e-6, eb / link)
    rows = [{"n_prompt": 0, "n_gen": 128, "n_depth": 0, "hit_rate": h, "uploads_per_token": u,
             "moe_cache_mib_granted": 5000, "avg_ts": 1 / truth.seconds_per_token((1 - h) * 48 * 8, u)}
            for h, u in ((0.70, 9.0), (0.85, 7.5), (0.95, 3.0))]
    rows += [{"n_prompt": 512, "n_gen": 0, "hit_rate": 0.5, "avg_ts": 900.0},  # prefill: skipped
             {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "hit_rate": None, "avg_ts": 250.0}]  # no cache: skipped
    pts = calibration_points(rows, 48, 8)
    assert len(pts) == 3 and pts[0].misses_per_token == pytest.approx(0.3 * 384)
    fit = calibrate(pts, eb, link)
    assert (fit.step_s, fit.miss_s, fit.upload_s) == pytest.approx((4e-3, 60e-6, eb / link), rel=1e-9)
    one = calibrate(pts[:1], eb, link)
    assert one.miss_s == pytest.approx(eb / link)
    assert one.seconds_per_token(pts[0].misses_per_token, 9.0) == pytest.approx(pts[0].seconds_per_token)
    with pytest.raises(ValueError, match="not physical"):  # faster with more misses
        calibrate([CalibrationPoint(0.010, 10, 0), CalibrationPoint(0.005, 50, 0)], eb, link)
    with pytest.raises(ValueError, match="no decode run"):
        calibrate([], eb, link)
    good = rows[0]
    for bad, msg in (({"avg_ts": 0}, "avg_ts must be a number > 0"), ({"avg_ts": None}, "avg_ts must be"),
                     ({"avg_ts": "x"}, "avg_ts must be"), ({"hit_rate": 1.5}, "hit_rate must be between 0 and 1"),
                     ({"uploads_per_token": -1}, "uploads_per_token must be")):
        with pytest.raises(ValueError, match=f"record 2: {msg}"):
            calibration_points([good, {**good, **bad}], 48, 8)


def test_what_if_warmup_replays_then_counts(real_trace):
    """--n-gen-warmup: the first tokens run through the policy but are not counted."""
    eb = 300 * 1024
    cost = CostModel.from_link(0.01, 25e9, eb)
    r = what_if(real_trace, [32 * eb], cost, expert_bytes=eb, warmup=100)[0]
    want = replay_policy(ArrayRouting(real_trace), 8, 16, real_trace.n_tokens - 100, 32, PolicyConfig(), 100)
    assert r.ours == want and r.ours.tokens == real_trace.n_tokens - 100
    with pytest.raises(ValueError, match="nothing is left"):
        what_if(real_trace, [32 * eb], cost, expert_bytes=eb, warmup=real_trace.n_tokens)


def test_cli_calibrate(real_trace, tmp_path):
    """--calibrate fits the table's speed to bench rows; a bad file is one error line."""
    import json

    eb = 300 * 1024
    path = tmp_path / "real.npz"
    real_trace.save(path)
    rows = [{"n_prompt": 0, "n_gen": 64, "n_depth": 0, "hit_rate": h, "uploads_per_token": 1.0, "avg_ts": t}
            for h, t in ((0.5, 100.0), (0.9, 150.0))]
    cal = tmp_path / "bench.jsonl"
    cal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ("--trace-in", str(path), "--what-if", "2400KiB", "--expert-mib", str(eb / 2**20), "--link-gbps", "25")
    r = _profile(*args, "--calibrate", str(cal), "--n-gen-warmup", "64")
    assert r.exit_code == 0, r.output
    assert "fitted to 2 measured runs" in r.stdout and "UNCALIBRATED" not in r.stdout
    # the table's t/s is the library's what-if under the fitted model
    from moecache.cli.profile import ProfileOptions, what_if_policy
    from moecache.moe.profile import calibrate, calibration_points

    tr = real_trace_of(real_trace, eb)
    fit = calibrate(calibration_points(rows, tr.n_layer, tr.routes.shape[2]), eb, 25e9)
    machine, _ = what_if_policy(tr, ProfileOptions(link_gbps=25.0), None)
    want = what_if(tr, [2400 * 1024], fit, machine, warmup=64)[0]
    assert f"| {want.tokens_per_s:.1f} |" in r.stdout
    zero = tmp_path / "zero.jsonl"
    zero.write_text(json.dumps({**rows[0], "avg_ts": 0}) + "\n")
    r = _profile(*args, "--calibrate", str(zero))
    assert r.exit_code == 1 and "record 1: avg_ts must be a number > 0" in r.output
    assert r.output.count("error:") == 1 and "Traceback" not in r.output
    r = _profile("--trace-in", str(path), "--expert-mib", "0.3", "--calibrate", str(cal))
    assert r.exit_code == 0 and "--calibrate ignored" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    r = _profile(*args, "--calibrate", str(bad))
    assert r.exit_code == 1 and "line 1 is not a JSON object" in r.output
    r = _profile(*args, "--n-gen-warmup", "384")
    assert r.exit_code == 1 and "none would be counted" in r.output


def test_plot_png_is_written(real_trace, tmp_path):
    path, png = tmp_path / "real.npz", tmp_path / "heat.png"
    real_trace.save(path)
    r = _profile("--trace-in", str(path), "--plot", str(png))
    assert r.exit_code == 0, r.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_save_load_and_a_foreign_profile_refused(tiny, code_moe_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    r = _profile("-m", str(tiny), "-p", "hello world", "-n", "3", "-c", "64", "-t", "1", "--routing", "qwen3-moe",
                 "--save")
    assert r.exit_code == 0, r.output
    saved = list((tmp_path / "cache" / "moecache" / "profiles").glob("*.npz"))
    assert len(saved) == 1 and saved[0].name.startswith("tiny.gguf-")
    prof = UsageProfile.load(saved[0])
    per_layer = prof.counts.sum(axis=1)
    assert prof.tokens > 3 and (per_layer == per_layer[0]).all() and per_layer[0] % prof.tokens == 0
    # loaded back against its model: shown, nothing refused
    r = _profile("-m", str(tiny), "--load-profile", str(saved[0]))
    assert r.exit_code == 0, r.output
    assert f"{prof.tokens} tokens of usage added" in r.output and "refused" not in r.output
    # another model's: refused with a note; alone, nothing is left to show
    r = _profile("-m", str(code_moe_tiny), "--load-profile", str(saved[0]))
    assert r.exit_code == 1
    assert "refused: it is a profile of tiny.gguf" in r.output and "error: nothing to profile" in r.output
    # same key, wrong shape; another key
    assert "are (2, 3)" in UsageProfile("k", np.zeros((2, 3), np.int64), 1).check_model("k", (2, 4))
    assert UsageProfile("k", np.zeros((2, 3), np.int64), 1).check_model("k", (2, 3)) is None
    assert "not of this model" in UsageProfile("a", np.zeros((2, 3), np.int64), 1).check_model("b", (2, 3))
    # not a profile at all: one error line
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(3))
    r = _profile("-m", str(tiny), "--load-profile", str(bad))
    assert r.exit_code == 1 and "not a moecache usage profile" in r.output


@pytest.mark.parametrize("args,msg", [
    ([], "profile needs prompts"),
    (["-p", "x", "--trace-in", "t.npz"], "not both"),
    (["--trace-in", "t.npz", "--what-if", "8XB"], "--what-if"),
    (["--trace-in", "/nonexistent/t.npz"], "t.npz"),
])
def test_bad_input_is_one_error_line(args, msg):
    r = _profile(*args)
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], r.stderr


def test_cache_at_vram_is_what_the_placement_grants():
    """--what-if-vram: a VRAM size becomes the cache the placement grants a run at that budget: the
    VRAM the placement uses (95% of what the run's own CUDA context leaves, 526 MiB as measured on the
    H200, less the 1 GiB reserve and the float32 prompt scratch) less the dense weights, KV cache and
    output, in whole experts (the rule of moecache/placement.py, worked by hand here); with the
    elastic slots (the default) also the reserve less what decoding keeps; a model that fits whole
    caches every expert; more VRAM, more cache."""
    from facts import LARGEST_F32, OUTPUT, moe_facts

    from moecache.moe.profile import cache_at_vram
    from moecache.probe import HostInfo
    from moecache.settings import Settings

    GiB = 1 << 30
    host = HostInfo("test cpu", 16, 32, 128 * GiB, 120 * GiB)
    f = moe_facts(17 * GiB, 16 * GiB, 40960, 96 * 1024)
    c = cache_at_vram(f, 8 * GiB, Settings(n_ctx=512, elastic_slots=False), host)
    free = 8 * GiB - (526 << 20)
    usable = int(free * 0.95) - GiB - LARGEST_F32
    dense = (17 * GiB - 16 * GiB - OUTPUT) // 48 * 48 + OUTPUT + 512 * (96 * 1024 // 48) * 48
    assert not c.fits and c.n_ctx == 512
    assert c.cache_bytes == (usable - dense) // f.expert_each * f.expert_each
    elastic = cache_at_vram(f, 8 * GiB, Settings(n_ctx=512), host).cache_bytes - c.cache_bytes
    assert elastic % f.expert_each == 0
    assert 0 < elastic <= free - usable - (384 << 20)  # the reserve less the decode keep (placement.DECODE_KEEP_BYTES)
    sizes = [cache_at_vram(f, v * GiB, Settings(n_ctx=512), host).cache_bytes for v in (4, 8, 12, 16)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    whole = cache_at_vram(f, 40 * GiB, Settings(), host)
    assert whole.fits and whole.cache_bytes == f.expert_bytes and whole.n_ctx == 40960


def test_cli_what_if_vram(tiny, real_trace, tmp_path):
    """--what-if-vram needs -m, and prints each size's context and cache (all experts when it fits)."""
    path = tmp_path / "real.npz"
    real_trace.save(path)
    r = _profile("--trace-in", str(path), "--what-if-vram", "8GiB", "--expert-mib", "0.3")
    assert r.exit_code == 1 and "--what-if-vram needs the model" in r.output
    r = _profile("-m", str(tiny), "-p", PROMPT, "-n", "4", "--what-if-vram", "40GiB", "--link-gbps", "25")
    assert r.exit_code == 0, r.output
    row = [ln for ln in r.stdout.splitlines() if ln.startswith("| 40GiB |")]
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert cells[2] == "all experts fit" and cells[5] == "100.0%" and cells[8:10] == ["0.00", "0.00"]
    r = _profile("-m", str(tiny), "-p", PROMPT, "-n", "4", "--what-if-vram", "1MiB", "--link-gbps", "25")
    assert r.exit_code == 0, r.output
    assert "| 1MiB |" in r.stdout and "no layer fits: runs on the CPU" in r.stdout


def test_cli_calibrate_refuses_another_models_runs(tiny, real_trace, tmp_path):
    """--calibrate records measured on another model (their model_size differs from -m's tensor
    bytes) are refused before any work, with one error line; a record with a bad number too."""
    import json

    path = tmp_path / "real.npz"
    real_trace.save(path)
    row = {"model_filename": "/tmp/q30.gguf", "model_size": 17460486144, "n_prompt": 0, "n_gen": 64, "n_depth": 0,
           "hit_rate": 0.9, "uploads_per_token": 1.0, "avg_ts": 150.0}
    cal = tmp_path / "other.jsonl"
    cal.write_text(json.dumps(row) + "\n")
    r = _profile("-m", str(tiny), "--trace-in", str(path), "--what-if", "1MiB", "--calibrate", str(cal))
    assert r.exit_code == 1 and "record 1 was measured on /tmp/q30.gguf" in r.output
    assert r.output.count("error:") == 1 and "expert usage per layer" not in r.output
