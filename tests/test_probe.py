"""Startup probe (moecache/probe.py), the resolution of defaults (moecache/settings.py), load modes, probe-pcie on a
machine without a GPU. The resolution is a pure function: table-driven cases."""

from __future__ import annotations

import json

import pytest

from facts import moe_facts

from moecache.probe import GiB, GpuInfo, HostInfo, Probe
from moecache.settings import Settings, resolve

HOST = HostInfo("test cpu", 16, 32, 128 * GiB, 120 * GiB)


def gpu(i, free_gib, h2d=50e9):
    return GpuInfo(i, f"gpu{i}", "9.0", int(free_gib * GiB), int(free_gib * GiB) + GiB, 5, 16, "test", h2d)


MOE_BIG = moe_facts(60 * GiB, 55 * GiB, 40960)
MOE_SMALL = moe_facts(10 * GiB, 8 * GiB, 40960)
DENSE_BIG = moe_facts(60 * GiB, 0, 8192)
MOE_SHORT_CTX = moe_facts(60 * GiB, 55 * GiB, 8192)

CASES = [
    # (name, model, gpus, flags, expected (ub, ctx, threads, mode, experts_in_ram, prompt_gpu))
    ("1 gpu 24G, big moe", MOE_BIG, [gpu(0, 24)], Settings(), (2048, 32768, 15, "pin", True, 0)),
    ("1 gpu 12G, big moe", MOE_BIG, [gpu(0, 12)], Settings(), (2048, 32768, 15, "pin", True, 0)),
    ("1 gpu 8G, big moe", MOE_BIG, [gpu(0, 8)], Settings(), (2048, 32768, 15, "pin", True, 0)),
    ("1 gpu 4G, big moe", MOE_BIG, [gpu(0, 4)], Settings(), (1024, 4096, 15, "pin", True, 0)),
    ("1 gpu 2G, big moe", MOE_BIG, [gpu(0, 2)], Settings(), (512, 4096, 15, "pin", True, 0)),
    ("2 gpus, fastest link second", MOE_BIG, [gpu(0, 24, 25e9), gpu(1, 12, 50e9)], Settings(),
     (2048, 32768, 14, "pin", True, 1)),
    ("4 gpus mismatched", MOE_BIG, [gpu(0, 8), gpu(1, 8, 12e9), gpu(2, 8), gpu(3, 22, 3e9)], Settings(),
     (2048, 32768, 12, "pin", True, 0)),
    ("model fits in VRAM: llama.cpp defaults", MOE_SMALL, [gpu(0, 24)], Settings(), (512, 0, 16, "mmap", False, 0)),
    ("fits only across 4 GPUs", MOE_BIG, [gpu(i, 20) for i in range(4)], Settings(), (512, 0, 16, "mmap", False, 0)),
    ("no GPU", MOE_BIG, [], Settings(), (512, 0, 16, "mmap", False, None)),
    ("dense model larger than VRAM", DENSE_BIG, [gpu(0, 24)], Settings(), (512, 0, 16, "mmap", False, 0)),
    ("short trained context caps -c", MOE_SHORT_CTX, [gpu(0, 24)], Settings(), (2048, 8192, 15, "pin", True, 0)),
    ("user flags win", MOE_BIG, [gpu(0, 24)], Settings(n_ubatch=256, n_ctx=4096, n_threads=3, load_mode="pin"), (256, 4096, 3, "pin", True, 0)),
    ("serve pins when it fits RAM", MOE_BIG, [gpu(0, 24)], ("serve", Settings()), (2048, 32768, 15, "pin", True, 0)),
    ("serve pins a model that fits VRAM", MOE_SMALL, [gpu(0, 24)], ("serve", Settings()), (512, 0, 16, "pin", False, 0)),
    ("serve without a GPU maps (pinning needs CUDA)", MOE_SMALL, [], ("serve", Settings()),
     (512, 0, 16, "mmap", False, None)),
    # experts on the CPU beside a GPU: a core left for the thread that drives it (moecache/threads.py)
    ("--cpu-moe on a GPU leaves a core", MOE_SMALL, [gpu(0, 24)], Settings(cpu_moe=True), (512, 0, 15, "mmap", False, 0)),
    ("-ncmoe on a GPU leaves a core", MOE_SMALL, [gpu(0, 24)], Settings(n_cpu_moe=4), (512, 0, 15, "mmap", False, 0)),
    ("--cpu-moe without a GPU: every core", MOE_SMALL, [], Settings(cpu_moe=True), (512, 0, 16, "mmap", False, None)),
    # --miss-split gets active waiting too (threads.experts_on_cpu), even where no cache takes it up
    ("--miss-split on a GPU leaves a core", MOE_SMALL, [gpu(0, 24)], Settings(miss_split=True),
     (512, 0, 15, "mmap", False, 0)),
]


@pytest.mark.parametrize("name,model,gpus,flags,want", CASES, ids=[c[0] for c in CASES])
def test_resolution_table(name, model, gpus, flags, want):
    command, flags = flags if isinstance(flags, tuple) else ("run", flags)
    r = resolve(flags, model, Probe(HOST, tuple(gpus)), command=command)
    assert (r.n_ubatch, r.n_ctx, r.n_threads, r.load_mode, r.experts_in_ram, r.prompt_gpu) == want
    assert set(r.reasons) >= {"n_ubatch", "n_ctx", "n_threads", "load_mode"}


@pytest.mark.parametrize("command", ["serve", "run"])
def test_a_model_that_does_not_fit_ram_is_mapped(command):
    host = HostInfo("cpu", 16, 32, 64 * GiB, 62 * GiB)
    r = resolve(Settings(), MOE_BIG, Probe(host, (gpu(0, 24),)), command=command)
    assert r.load_mode == "mmap" and "does not fit" in r.reasons["load_mode"]
    assert "computes misses on the CPU" in r.reasons["load_mode"]  # the experts go to host RAM


def test_run_pins_when_the_experts_go_to_host_ram():
    r = resolve(Settings(), MOE_BIG, Probe(HOST, (gpu(0, 24),)), command="run")
    assert r.load_mode == "pin" and "zero-copy" in r.reasons["load_mode"]
    small = resolve(Settings(), MOE_SMALL, Probe(HOST, (gpu(0, 24),)), command="run")
    assert small.load_mode == "mmap" and small.reasons["load_mode"] == "run maps the file"


def test_bad_load_mode_is_named():
    with pytest.raises(ValueError, match="--load-mode must be mmap, pin or auto"):
        resolve(Settings(load_mode="fast"), MOE_BIG, Probe(HOST))


def test_startup_probe_remembers_links_per_boot(tmp_path, monkeypatch):
    import moecache.probe as probe

    calls = []

    def fake_gpu_infos(measure_bytes, reps, full, cached=None):
        if "0000:01:00" not in cached:
            calls.append(measure_bytes)
            cached["0000:01:00"] = {"h2d_pinned": 42e9}
        return [GpuInfo(0, "g", "9.0", GiB, 2 * GiB, h2d_pinned=cached["0000:01:00"]["h2d_pinned"])], ""

    monkeypatch.setattr(probe, "gpu_infos", fake_gpu_infos)
    cache = tmp_path / "probe.json"
    p1 = probe.startup_probe(cache)
    p2 = probe.startup_probe(cache)
    assert calls == [probe.STARTUP_PROBE_BYTES]  # measured once, then read back
    assert p1.gpus[0].h2d_pinned == p2.gpus[0].h2d_pinned == 42e9
    data = json.loads(cache.read_text())
    data["boot_id"] = "another boot"
    cache.write_text(json.dumps(data))
    probe.startup_probe(cache)
    assert len(calls) == 2  # a new boot measures again


def test_startup_probe_without_gpu_is_fast_and_says_why(tmp_path):
    import time

    from moecache.probe import startup_probe

    t0 = time.perf_counter()
    p = startup_probe(tmp_path / "p.json")
    assert time.perf_counter() - t0 < 1.0
    assert p.host.physical_cores >= 1 and p.host.ram_total > 0
    assert p.gpus or p.no_gpu_reason


def test_pin_refuses_before_allocating(tmp_path, monkeypatch):
    import moecache.load_mode as lm
    from moecache.errors import MoecacheError
    from moecache.gguf_file import open_gguf
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=1)

    class VM:
        total = 8 * GiB
        available = 4 * GiB

    monkeypatch.setattr(lm.psutil, "virtual_memory", lambda: VM)
    with open_gguf(path) as m, pytest.raises(MoecacheError, match="headroom.*use --load-mode mmap"):
        lm.pin_model(m)


def test_cli_probe_pcie_without_gpu_prints_host_and_exits_0():
    from typer.testing import CliRunner

    from moecache.cli.main import app

    r = CliRunner().invoke(app, ["probe-pcie", "--json", "--size", "8", "--reps", "1"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["host"]["ram_read_all"] > 0 and data["host"]["physical_cores"] >= 1
    if not data["gpus"]:
        assert data["no_gpu_reason"]
    r = CliRunner().invoke(app, ["probe-pcie", "--size", "0"])
    assert r.exit_code == 2 and r.output.startswith("error: --size")  # Click's range check, one line


def test_run_prints_the_resolved_settings(tmp_path):
    from typer.testing import CliRunner

    from moecache.cli.main import app
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=1)
    r = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "hi", "-n", "2", "--temp", "0", "-v"])
    assert r.exit_code == 0, r.output
    for name in ("-ub", "-c", "-t", "--load-mode"):
        assert f"resolved: {name}" in r.output
    r = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "hi", "-n", "1", "--load-mode", "fast"])
    assert r.exit_code == 1 and "--load-mode must be mmap, pin or auto" in r.output


@pytest.mark.parametrize("model_gib,vram_gib,want", [(16.3, 8, 8192), (16.3, 14, 16384), (60, 48, 32768)])
def test_default_context_leaves_the_expert_cache_most_of_the_vram(model_gib, vram_gib, want):
    """Qwen3-30B-A3B-shaped KV (192 KiB of float32 K and V per position), 1 GiB of dense weights: -c
    32768 would put 6 GiB of KV cache on an 8 GiB card; the default halves it until the KV cache takes
    at most a quarter of the VRAM left after the dense weights and the 1 GiB reserve."""
    model = moe_facts(int(model_gib * GiB), int((model_gib - 1) * GiB), 40960, 48 * 4 * 256 * 4)
    r = resolve(Settings(), model, Probe(HOST, (gpu(0, vram_gib),)))
    assert r.experts_in_ram and r.n_ctx == want
    assert ("halved to" in r.reasons["n_ctx"]) == (want < 32768)
    assert want * model.kv_bytes_per_token <= (vram_gib * GiB - GiB - GiB) / 4
    given = resolve(Settings(n_ctx=32768), model, Probe(HOST, (gpu(0, 8),)))
    assert given.n_ctx == 32768 and given.reasons["n_ctx"] == "-c given"


# ---- one authority on what fits: the resolution reads the placement's verdict -------------------------
def test_a_model_just_under_the_free_vram_does_not_fit_by_the_placement():
    """23 GiB of weights on a card with 24 GiB free: a size comparison would say "fits", but the
    placement keeps 5% of the free memory, the 1 GiB reserve and the float32 prompt scratch, so the
    experts go to host RAM with the expert cache, and the resolution says so (the 32768 default -c)."""
    model = moe_facts(23 * GiB, 21 * GiB, 40960, 48 * 4 * 128 * 2 * 2)
    r = resolve(Settings(), model, Probe(HOST, (gpu(0, 24),)))
    assert r.experts_in_ram and r.n_ctx <= 32768 and "the placement" in r.reasons["experts"]


def test_a_long_trained_context_is_lowered_when_the_model_then_fits():
    """A 10 GiB MoE with a 262144-token trained context: its 24 GiB KV cache does not fit beside it,
    but at -c 32768 (3 GiB) everything does, so the experts stay on the GPU at that context."""
    model = moe_facts(10 * GiB, 8 * GiB, 262144, 96 * 1024)
    r = resolve(Settings(), model, Probe(HOST, (gpu(0, 24),)))
    assert not r.experts_in_ram and r.n_ctx == 32768 and "lowered from the trained 262144" in r.reasons["n_ctx"]
    given = resolve(Settings(n_ctx=262144), model, Probe(HOST, (gpu(0, 24),)))
    assert given.experts_in_ram and given.n_ctx == 262144  # an explicit -c is kept: the experts move instead


@pytest.mark.parametrize("gpus_gib", [(8,), (12,), (24,), (48,), (80,), (12, 12), (24, 16)])
@pytest.mark.parametrize("flags", [{}, {"vram_budget": "10GiB"}, {"split_mode": "none"}])
def test_experts_in_ram_is_what_the_placement_then_does(gpus_gib, flags):
    """Over a grid of model sizes, trained contexts, -c, GPUs (one, two even, two uneven), a
    --vram-budget and -sm none: "experts in host RAM" is exactly the plan the engine then makes at
    the resolved context (every routed expert off the GPUs with an expert cache), and "fits" is a
    plan with every layer and expert on the GPUs."""
    from moecache.placement import plan

    free = [g * GiB for g in gpus_gib]
    for model_gib in (4, 9, 15, 20, 23, 30, 45, 70):
        for trained, ctx in ((40960, None), (262144, None), (8192, None), (40960, 4096), (40960, 0)):
            model = moe_facts(model_gib * GiB, (model_gib - 1) * GiB, trained, 96 * 1024)
            r = resolve(Settings(n_ctx=ctx, **flags), model, Probe(HOST, tuple(gpu(i, g) for i, g in enumerate(gpus_gib))))
            # in use on each GPU (total - free: gpu() leaves 1 GiB), as the engine's probe passes it
            placed = plan(r.placement, model.sizes.with_context(r.n_ctx or trained), free, [GiB] * len(free))
            on = placed.experts_on_device
            case = (model_gib, trained, ctx, r.reasons)
            if r.experts_in_ram:
                assert not any(on) and placed.cache_slots, case
            else:
                assert all(on) and placed.n_gpu_layers == 48, case


def test_a_lowered_context_is_the_largest_at_which_the_whole_model_fits():
    """A MoE that does not fit at its 262144-token trained context but fits whole at 32768 gets -c
    32768, not a halving of it (the halving is the expert cache's rule for big models); one that
    fits only at 16384 gets 16384; the plan at the resolved context keeps every expert on the GPU."""
    from moecache.placement import fits_whole, plan

    for model_gib, free_gib in ((4, 12), (14, 24)):
        model = moe_facts(model_gib * GiB, (model_gib - 1) * GiB, 262144, 96 * 1024)
        r = resolve(Settings(), model, Probe(HOST, (gpu(0, free_gib),)))
        assert not r.experts_in_ram and "lowered from the trained 262144" in r.reasons["n_ctx"], (model_gib, r.reasons)
        fits = [c for c in (32768, 16384, 8192, 4096)
                if fits_whole(r.placement, model.sizes.with_context(c), [free_gib * GiB], [GiB])]
        assert r.n_ctx == max(fits), (model_gib, r.n_ctx, fits)
        placed = plan(r.placement, model.sizes.with_context(r.n_ctx), [free_gib * GiB], [GiB])
        assert all(placed.experts_on_device)


PLAN_CASES = [
    # (name, model, gpus, command, flags, omp_active, expected plan, a word of the reason)
    ("big MoE, pinned, one GPU, active threads", MOE_BIG, [gpu(0, 8)], "run", Settings(), True, "layer", "layer plan"),
    ("bench too", MOE_BIG, [gpu(0, 8)], "bench", Settings(), True, "layer", "layer plan"),
    ("threads not waiting actively", MOE_BIG, [gpu(0, 8)], "run", Settings(), False, "expert", "OMP_WAIT_POLICY"),
    ("serve", MOE_BIG, [gpu(0, 8)], "serve", Settings(), True, "layer", "costed per decode pass"),
    ("serve, threads not waiting actively", MOE_BIG, [gpu(0, 8)], "serve", Settings(), False, "expert", "OMP_WAIT_POLICY"),
    ("perplexity", MOE_BIG, [gpu(0, 8)], "perplexity", Settings(), True, "expert", "perplexity"),
    ("mapped weights", MOE_BIG, [gpu(0, 8)], "run", Settings(load_mode="mmap"), True, "expert", "mapped"),
    ("two GPUs", MOE_BIG, [gpu(0, 8), gpu(1, 8)], "run", Settings(), True, "expert", "one GPU"),
    ("the model fits in VRAM", MOE_SMALL, [gpu(0, 24)], "run", Settings(), True, "expert", "VRAM"),
    ("no GPU", MOE_BIG, [], "run", Settings(), True, "expert", "VRAM"),
    ("--moe-cache 0", MOE_BIG, [gpu(0, 8)], "run", Settings(moe_cache="0"), True, "expert", "--moe-cache 0"),
    ("--n-cpu-moe", MOE_BIG, [gpu(0, 8)], "run", Settings(n_cpu_moe=40), True, "expert", "--n-cpu-moe"),
    ("--miss-split", MOE_BIG, [gpu(0, 8)], "run", Settings(miss_split=True), True, "expert", "--miss-split"),
    ("given: expert", MOE_BIG, [gpu(0, 8)], "run", Settings(cache_plan="expert"), True, "expert", "given"),
    ("given: layer, even without active threads", MOE_BIG, [gpu(0, 8)], "serve", Settings(cache_plan="layer"), False, "layer", "given"),
]


@pytest.mark.parametrize("name,model,gpus,command,flags,active,want,why", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_cache_plan_auto(name, model, gpus, command, flags, active, want, why):
    """--cache-plan auto: layer for run, bench and serve with the experts page-locked behind one GPU's cache
    and the threads waiting actively; the layer plan's policy and a core left follow it."""
    r = resolve(flags, model, Probe(HOST, tuple(gpus)), command=command, omp_active=active)
    assert r.cache_plan == want and why in r.reasons["cache_plan"]
    if model.expert_each:
        assert r.policy.layer_plan is (want == "layer")
    if want == "layer":
        assert r.n_threads == HOST.physical_cores - len(gpus)


def test_cache_plan_auto_reads_the_wait_policy_from_the_environment():
    probe = Probe(HOST, (gpu(0, 8),))
    assert resolve(Settings(), MOE_BIG, probe, environ={"OMP_WAIT_POLICY": "active"}).cache_plan == "layer"
    assert resolve(Settings(), MOE_BIG, probe, environ={"OMP_WAIT_POLICY": "PASSIVE"}).cache_plan == "expert"
    assert resolve(Settings(), MOE_BIG, probe).cache_plan == "expert"
    short = resolve(Settings(), MOE_BIG, probe, omp_active=True).summary_lines(probe)[0]
    assert "--cache-plan layer" in short
    long = resolve(Settings(), MOE_BIG, probe, command="serve").summary_lines(probe, verbose=True)
    assert any("elastic slots" in ln and " on " in ln and "serve: each request's prompt pass lends them" in ln
               for ln in long)
    off = resolve(Settings(elastic_slots=False), MOE_BIG, probe, command="serve").summary_lines(probe, verbose=True)
    assert any("elastic slots" in ln and " off " in ln and "--no-elastic-slots given" in ln for ln in off)
    fits = resolve(Settings(), MOE_SMALL, Probe(HOST, (gpu(0, 24),))).summary_lines(probe, verbose=True)
    assert not any("elastic slots" in ln for ln in fits)  # no expert cache: no row


def test_usable_cores_count_the_affinitys_physical_cores(tmp_path):
    """usable_cores: the CPUs of the affinity grouped into cores by sysfs topology (two hyperthreads
    of one core count once; cores of two packages with the same core_id count twice); a CPU without
    topology files is its own core; host_info never counts more than the machine has."""
    from moecache.probe import host_info, usable_cores

    def cpu(n, pkg, core):
        d = tmp_path / f"cpu{n}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{pkg}\n")
        (d / "core_id").write_text(f"{core}\n")

    for n, (pkg, core) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (0, 1), (1, 0), (1, 1)]):
        cpu(n, pkg, core)  # 4 cores of 2 packages, CPUs 4-7 their siblings
    assert usable_cores(set(range(8)), tmp_path) == (4, 8)
    assert usable_cores({0, 4}, tmp_path) == (1, 2)  # one core's two threads (taskset -c 0,4)
    assert usable_cores({0, 2}, tmp_path) == (2, 2)  # core 0 of each package
    assert usable_cores({0, 9}, tmp_path) == (2, 2)  # cpu9 has no topology here
    h = host_info()
    assert 1 <= h.physical_cores <= h.logical_cores
    mine = usable_cores()
    if mine is not None:
        assert h.physical_cores <= mine[0] and h.logical_cores <= mine[1]
