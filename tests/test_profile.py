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
    cost = CostModel(0.01, 25e9, eb)
    budgets = [eb * n for n in (4, 8, 16, 32, 64, 96, 128)]
    rows = what_if(real_trace, budgets, cost)
    cfg = PolicyConfig()
    for r, b in zip(rows, budgets):
        assert r.n_slots == b // eb
        ours = replay_policy(ArrayRouting(real_trace), 8, 16, real_trace.n_tokens, r.n_slots, cfg)
        lru = replay_lru(ArrayRouting(real_trace), 8, real_trace.n_tokens, r.n_slots, cfg)
        assert r.ours == ours and r.lru == lru
        assert r.tokens_per_s == pytest.approx(1 / (0.01 + ours.misses / ours.tokens * eb / 25e9))
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
    # the CLI prints the same numbers, and says the speed is uncalibrated
    r = _profile("--trace-in", str(path), "--what-if", "1200KiB,2400KiB", "--expert-mib", str(eb / 2**20),
                 "--link-gbps", "25", "--step-ms", "10")
    assert r.exit_code == 0, r.output
    assert "UNCALIBRATED" in r.stdout
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("| 1")]
    assert len(table) == 1 and (f"| {100 * rows[0].ours.hit_rate:.1f}% | {100 * rows[0].lru.hit_rate:.1f}% | "
                                f"{100 * rows[0].static_hit_rate:.1f}% |") in table[0]
    assert f"| {rows[0].tokens_per_s:.1f} |" in table[0]


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
