"""The library entry point (moecache.load, moecache/llm.py) and the one road for settings
(moecache/settings.py): the library and the CLI resolve the same flags to the same values and the
same placement, and give the same greedy tokens on a real MoE model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moecache
from facts import moe_facts

from moecache.probe import GiB, GpuInfo, HostInfo, Probe
from moecache.settings import ModelFacts, Settings, resolve

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("lib") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=5)
    return path


def test_library_tokens_equal_the_cli_json_tokens(code_moe_tiny):
    """README's library example on the real model: the same greedy tokens and text as
    ``moecache run -p ... -n 8 --temp 0 --json`` with the same flags."""
    lines: list[str] = []
    with moecache.load(code_moe_tiny, lines.append, n_ctx=256, n_threads=2) as llm:
        out = llm.complete(PROMPT, n_predict=8, temperature=0)
        reply = llm.chat([{"role": "user", "content": "hi"}], n_predict=8)
    assert len(out.tokens) == 8 and out.stop == "length" and out.timings.n_gen == 8
    assert isinstance(out.text, str) and out.text
    assert reply.tokens and reply.stop in ("eog", "length") and len(reply.tokens) <= 8
    assert any(ln.startswith("resolved: ") for ln in lines) and any(ln.startswith("model: ") for ln in lines)
    r = subprocess.run([sys.executable, "-m", "moecache.cli.main", "run", "-m", str(code_moe_tiny), "-p", PROMPT,
                        "-n", "8", "--temp", "0", "--json", "-c", "256", "-t", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    assert cli["tokens"] == out.tokens
    assert cli["text"] == out.text and cli["prompt_tokens"] == out.prompt_tokens and cli["stop"] == out.stop


@pytest.mark.parametrize("flags,settings", [
    (["-c", "128", "-t", "1", "-ub", "64", "-b", "96", "-ctk", "f32", "--load-mode", "mmap"],
     dict(n_ctx=128, n_threads=1, n_ubatch=64, n_batch=96, cache_type="f32", load_mode="mmap")),
    (["-c", "64", "-ngl", "0", "--n-cpu-moe", "2", "--moe-cache-window", "8", "-ts", "3,1"],
     dict(n_ctx=64, n_gpu_layers=0, n_cpu_moe=2, moe_cache_window=8, tensor_split="3,1")),
    (["-c", "96", "--vram-budget", "8GiB", "--moe-cache", "512", "--deterministic"],
     dict(n_ctx=96, vram_budget="8GiB", moe_cache="512", deterministic=True)),
])
def test_cli_and_library_resolve_the_same_flags_alike(tiny, monkeypatch, flags, settings):
    """The CLI and moecache.load fed the same flags: equal resolved values, reasons, policy costs,
    printed ``resolved:`` line and placement (on the CPU: every layer on the host; compared as far as
    it exists)."""
    import moecache.llm as llm_mod
    from moecache.cli.main import app

    seen = []
    real = llm_mod.open_llm

    def spy(*a, **k):
        llm = real(*a, **k)
        seen.append((llm.resolved, llm.engine.placement, llm.engine.n_ctx, llm.engine.n_ubatch,
                     llm.engine.config))
        return llm
    monkeypatch.setattr(llm_mod, "open_llm", spy)
    r = CliRunner().invoke(app, ["run", "-m", str(tiny), "-p", "x", "-n", "1", "--temp", "0", *flags])
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(llm_mod, "open_llm", real)
    lines: list[str] = []
    with moecache.load(tiny, lines.append, **settings) as llm:
        lib = (llm.resolved, llm.engine.placement, llm.engine.n_ctx, llm.engine.n_ubatch, llm.engine.config)
    (cli,) = seen
    assert dataclasses.asdict(cli[0]) == dataclasses.asdict(lib[0])  # values, reasons, placement flags, policy
    assert cli[2:] == lib[2:]  # n_ctx, n_ubatch and the engine's config as built
    cpl, lpl = cli[1], lib[1]
    assert (cpl is None) == (lpl is None)
    if cpl is not None:
        assert cpl.summary() == lpl.summary() and cpl.layer_device == lpl.layer_device
        assert cpl.experts_on_device == lpl.experts_on_device and cpl.cache_slots == lpl.cache_slots
    resolved_line = next(ln for ln in lines if ln.startswith("resolved: "))
    assert resolved_line in r.output
    given = settings.get("n_ctx")
    assert lib[0].n_ctx == given and lib[0].reasons["n_ctx"] == "-c given"


def test_library_defaults_are_the_clis(tiny, monkeypatch):
    """No settings given: the library resolves as ``moecache run`` does without flags (f16 KV cache,
    -b 2048, -ub 512, llama.cpp's defaults on a CPU-only machine)."""
    with moecache.load(tiny) as llm:
        res = llm.resolved
        assert (res.cache_type, res.n_batch, res.n_ubatch, res.load_mode) == ("f16", 2048, 512, "mmap")
        assert llm.engine.config.cache_type == "f16"


def test_unknown_setting_and_bad_values_are_named(tiny):
    with pytest.raises(TypeError):
        moecache.load(tiny, n_ctxx=64)
    with pytest.raises(ValueError, match="-ctk f32 -ctv f16"):
        moecache.load(tiny, cache_type_k="f32", cache_type_v="f16")
    with pytest.raises(ValueError, match="--load-mode must be mmap, pin or auto"):
        moecache.load(tiny, load_mode="fast")
    with pytest.raises(ValueError, match="-ts"):
        moecache.load(tiny, tensor_split="a,b")
    with pytest.raises(ValueError, match=r"-c \(n_ctx\) must be an integer, got '64'"):  # was a TypeError from '<'
        moecache.load(tiny, n_ctx="64")
    with pytest.raises(ValueError, match=r"-t \(n_threads\) must be an integer, got 2.5"):
        moecache.load(tiny, n_threads=2.5)
    with moecache.load(tiny, n_ctx=64, n_threads=1) as llm:  # -n's range, as the CLI checks it
        for n in (-3, 2.5):
            with pytest.raises(ValueError, match="-n/--n-predict"):
                llm.complete("hi", n_predict=n)
            with pytest.raises(ValueError, match="-n/--n-predict"):
                llm.chat([{"role": "user", "content": "hi"}], n_predict=n)


def test_a_routing_process_draws_ahead_only_beside_a_gpu(tiny):
    """--routing: the process draws the next prompt pass on a worker thread only where the layers
    run on a GPU (the CPU then waits for it); on the CPU the draw would take the kernels' cores."""
    with moecache.load(tiny, n_ctx=64, n_threads=1, n_gpu_layers=0, routing="qwen3-moe") as llm:
        assert llm.engine.model.routing_override.draw_passes_ahead is False
        assert len(llm.complete([1, 2, 3, 4, 5], n_predict=2, temperature=0).tokens) == 2


def test_sampling_through_the_library_follows_the_seed(tiny):
    with moecache.load(tiny, n_ctx=64) as llm:
        a = llm.complete("Hello", n_predict=6, temperature=0.9, seed=7)
        b = llm.complete("Hello", n_predict=6, temperature=0.9, seed=7)
        g = llm.complete("Hello", n_predict=6, temperature=0)
        with pytest.raises(ValueError, match="--top-p"):
            llm.complete("Hello", n_predict=2, top_p=1.5)
        with pytest.raises(ValueError, match="nothing left to generate into"):
            llm.complete("Hello " * 80, n_predict=2)
    assert a.tokens == b.tokens and len(g.tokens) == 6


# ---- the pure resolution: n_batch follows the resolved -ub, and says so -------------------------------
HOST = HostInfo("test cpu", 16, 32, 128 * GiB, 120 * GiB)
BIG = moe_facts(60 * GiB, 55 * GiB, 40960)


def _gpu(free_gib):
    return GpuInfo(0, "gpu0", "9.0", int(free_gib * GiB), int(free_gib * GiB) + GiB, 5, 16, "test", 50e9)


def test_n_batch_raised_to_the_resolved_ubatch_is_a_reason():
    r = resolve(Settings(n_batch=256), BIG, Probe(HOST, (_gpu(24),)))
    assert (r.n_ubatch, r.n_batch) == (2048, 2048) and "raised from 256" in r.reasons["n_batch"]
    given = resolve(Settings(n_batch=256, n_ubatch=1024), BIG, Probe(HOST, (_gpu(24),)))
    assert (given.n_ubatch, given.n_batch) == (1024, 256) and given.reasons["n_batch"] == "-b given"
    plain = resolve(Settings(), BIG, Probe(HOST))
    assert plain.n_batch == 2048 and plain.reasons["n_batch"] == "llama.cpp default"


def test_policy_costs_and_budget_come_from_the_resolution():
    """--vram-budget bounds the GPU the resolution sees (a 24 GiB card at 4 GiB: -ub 1024); the
    policy's costs use the measured link unless --deterministic (or MOECACHE_DETERMINISTIC=1)."""
    r = resolve(Settings(vram_budget="4GiB", moe_cache_window=16), BIG, Probe(HOST, (_gpu(24),)))
    assert r.n_ubatch == 1024 and r.placement.vram_budget == 4 * GiB and r.placement.prompt_gpu == 0
    assert r.policy.window == 16 and r.policy.adaptive and r.policy.t_upload == pytest.approx(BIG.expert_each / 50e9)
    det = resolve(Settings(), BIG, Probe(HOST, (_gpu(24),)), environ={"MOECACHE_DETERMINISTIC": "1"})
    assert not det.policy.adaptive and det.policy.t_upload == pytest.approx(BIG.expert_each / 25e9)
    assert resolve(Settings(), ModelFacts(GiB, 0, 4096), Probe(HOST)).policy is None  # a dense model: no cache
