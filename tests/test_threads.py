"""The OpenMP wait policy a command line gets (moecache/threads.py): active waiting exactly when
routed experts run on the CPU every decode step, a user's own setting always wins."""

from __future__ import annotations

import pytest

from moecache import threads


@pytest.mark.parametrize("argv, want", [
    (["run", "-m", "x.gguf", "--cpu-moe"], True),
    (["bench", "-cmoe"], True),
    (["bench", "-ncmoe", "999"], True),
    (["bench", "--n-cpu-moe=4"], True),
    (["bench", "-ncmoe", "0"], False),
    (["bench", "--n-cpu-moe=0"], False),
    (["run", "-m", "x.gguf", "-p", "--cpu-moe is a flag"], False),  # a value, not a flag
    (["run", "-m", "x.gguf"], False),
    (["bench", "-ncmoe"], False),  # no value: the command itself reports the usage error
    (["bench", "-ncmoe", "0,0"], False),
    (["bench", "-ncmoe", "0,8"], True),
    (["bench", "-ncmoe", "8", "-ncmoe", "0"], False),  # the last one given wins, as in click
    (["bench", "--miss-split"], True),  # the CPU takes a share of the cache's misses every decode step
])
def test_experts_on_cpu(argv, want):
    assert threads.experts_on_cpu(argv) is want


def test_wait_policy_follows_the_flags(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    assert threads.openmp_wait_for_args(["bench", "-ncmoe", "48"], n_cpus=16, gpu_stack=True) == "active"
    assert threads.os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert threads.openmp_wait_for_args(["bench", "--cache-plan", "expert"], gpu_stack=True) == "short spin"
    assert threads.os.environ["GOMP_SPINCOUNT"] == threads.SPINCOUNT
    assert "OMP_WAIT_POLICY" not in threads.os.environ
    monkeypatch.delenv("GOMP_SPINCOUNT")
    # --cache-plan left to auto: nothing set until the settings are resolved
    for argv in (["bench"], ["run", "--cache-plan", "layer", "--cache-plan=auto"]):
        assert threads.openmp_wait_for_args(argv, n_cpus=16, gpu_stack=True) == "deferred"
        assert "OMP_WAIT_POLICY" not in threads.os.environ and "GOMP_SPINCOUNT" not in threads.os.environ
    assert threads.openmp_wait_for_args(["run", "--cache-plan", "layer"], n_cpus=16, gpu_stack=True) == "active"


def test_deferred_wait_settles_from_the_resolved_settings(monkeypatch):
    """settle_openmp_wait: active waiting for a resolved layer plan with a core free, else the short
    spin; nothing once either variable is set or once an OpenMP runtime is mapped."""
    def clear():
        for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            monkeypatch.delenv(k, raising=False)

    clear()
    assert threads.settle_openmp_wait(True, 15, n_cpus=16, maps="") == "active"
    assert threads.os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert threads.settle_openmp_wait(False, 15, n_cpus=16, maps="") == "set before"  # the first choice stays
    assert threads.os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and threads.os.environ["GOMP_SPINCOUNT"] == threads.ACTIVE_SPINCOUNT
    clear()
    assert threads.settle_openmp_wait(True, 16, n_cpus=16, maps="") == "no free core"  # the short spin
    assert threads.os.environ["GOMP_SPINCOUNT"] == threads.SPINCOUNT
    clear()
    assert threads.settle_openmp_wait(False, 15, n_cpus=16, maps="") == "short spin"
    clear()
    maps = "7f1c2a000000-7f1c2a040000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
    assert threads.settle_openmp_wait(True, 15, n_cpus=16, maps=maps) == "too late"
    assert "OMP_WAIT_POLICY" not in threads.os.environ and "GOMP_SPINCOUNT" not in threads.os.environ


def test_openmp_runtime_loaded_reads_the_maps():
    assert not threads.openmp_runtime_loaded("7f00-7f10 r-xp 0 0:0 0 /usr/lib/libc.so.6\n")
    for lib in ("libgomp.so.1", "libomp.so.5", "libiomp5.so"):
        assert threads.openmp_runtime_loaded(f"7f00-7f10 r-xp 0 0:0 0 /opt/lib/{lib}\n")


def test_users_setting_wins(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert threads.openmp_wait_for_args(["bench", "--cpu-moe"], gpu_stack=True) == "user's"
    assert threads.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in threads.os.environ


@pytest.mark.parametrize("argv, want", [
    (["bench", "-ncmoe", "48", "-t", "15"], "active"),
    (["bench", "-ncmoe", "48"], "active"),  # the resolved -t leaves a core per GPU (settings.py)
    (["bench", "-ncmoe", "48", "-t", "0"], "active"),  # 0 = the resolved default too
    (["bench", "-ncmoe", "48", "-t", "16"], "short spin"),  # no core left
    (["bench", "-ncmoe", "48", "-t16"], "short spin"),
    (["bench", "-ncmoe", "48", "-t", "8,16"], "short spin"),  # a bench list: its largest
    (["bench", "-ncmoe", "48", "-t", "16", "-t", "8"], "active"),  # the last one given wins
    (["bench", "-ncmoe", "48", "--threads=32"], "short spin"),
    (["bench", "-ncmoe", "48", "-ts", "3,1"], "active"),  # -ts is not -t
    (["bench", "--vram-budget", "8GiB", "--miss-split", "-t", "15"], "active"),
    (["bench", "--vram-budget", "8GiB", "--miss-split", "-t", "16"], "short spin"),
    (["bench", "--vram-budget", "8GiB", "-t", "15", "--cache-plan", "expert"], "short spin"),  # the GPU reads the misses
    (["bench", "--vram-budget", "8GiB", "-t", "15"], "deferred"),  # auto: decided once resolved
    (["bench", "--vram-budget", "8GiB", "-t", "16"], "short spin"),  # auto, but no core left
    (["bench", "--vram-budget", "8GiB", "--cache-plan", "layer", "-t", "15"], "active"),
])
def test_active_waiting_leaves_a_core_free(monkeypatch, argv, want):
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    assert threads.openmp_wait_for_args(argv, n_cpus=16, gpu_stack=True) == want


def test_no_active_waiting_without_the_gpu_stack(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    assert threads.openmp_wait_for_args(["run", "--cpu-moe", "-t", "2"], n_cpus=16, gpu_stack=False) == "short spin"


def test_one_thread_if_active_sets_the_calling_threads_numba_count(monkeypatch):
    """one_thread_if_active: 1 Numba thread in the thread that calls it, only under active waiting
    (ours or the user's OMP_WAIT_POLICY=active, any case); the other threads keep their count."""
    import threading

    import numba

    main = numba.get_num_threads()
    got = {}

    def helper(key):
        threads.one_thread_if_active()
        got[key] = numba.get_num_threads()

    for policy, want in (("ACTIVE", 1), (" active ", 1), ("PASSIVE", main), (None, main)):
        if policy is None:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        else:
            monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        t = threading.Thread(target=helper, args=(policy,))
        t.start()
        t.join()
        assert got[policy] == want, policy
        assert threads.waits_actively() is (policy in ("ACTIVE", " active "))
    assert numba.get_num_threads() == main


def test_no_openmp_runtime_before_the_settings_are_resolved(code_moe_tiny):
    """The deferred choice works only if nothing loads OpenMP before the commands settle it: in a
    fresh process with neither variable set, the CLI's load_engine resolves a real model, settles
    the wait with no OpenMP runtime mapped yet (here: no GPU, so the short spin), and a completion
    afterwards maps one (the check sees it)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import os, sys\n"
        "for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'NUMBA_THREADING_LAYER'): os.environ.pop(k, None)\n"
        "from moecache import threads\n"
        "import moecache.cli.common as c\n"
        "from moecache.settings import Settings\n"
        "seen, orig = [], c.settle_wait\n"
        "def spy(*a):\n"
        "    seen.append(threads.openmp_runtime_loaded())\n"
        "    return orig(*a)\n"
        "c.settle_wait = spy\n"
        "llm = c.load_engine(sys.argv[1], Settings(n_ctx=64, n_gpu_layers=0), 'run')\n"
        "llm.complete('def f', n_predict=1)\n"
        "import numba\n"
        "print(seen, threads.openmp_runtime_loaded(), numba.threading_layer(), os.environ.get('GOMP_SPINCOUNT'))\n")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code, str(code_moe_tiny)], capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    seen, after, layer, spin = r.stdout.split()[-4:]
    assert seen == "[False]" and spin == threads.SPINCOUNT
    if layer == "omp":  # (a TBB layer maps no OpenMP runtime)
        assert after == "True"


@pytest.fixture(autouse=True)
def _restore_wait_variables(monkeypatch):
    """The code under test writes the wait variables into os.environ itself: every test here leaves
    them as it found them (set then deleted through monkeypatch, which restores the original)."""
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    yield


def _clear_wait(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(threads, "openmp_runtime_loaded", lambda maps=None: False)


def _resolved(plan="layer", gpu=0, n_threads=15, cpu_moe=False):
    from types import SimpleNamespace

    return SimpleNamespace(cache_plan=plan, prompt_gpu=gpu, n_threads=n_threads,
                           placement=SimpleNamespace(cpu_moe=cpu_moe, n_cpu_moe=0))


def test_active_waiting_is_bounded(monkeypatch):
    """Active waiting spins ACTIVE_SPINCOUNT rounds, then sleeps (an idle chat does not keep every
    thread at 100%): both the command-line choice and the settled one set the bound."""
    _clear_wait(monkeypatch)
    assert threads.openmp_wait_for_args(["run", "--cpu-moe"], n_cpus=16, gpu_stack=True) == "active"
    assert threads.os.environ["GOMP_SPINCOUNT"] == threads.ACTIVE_SPINCOUNT
    _clear_wait(monkeypatch)
    assert threads.settle_openmp_wait(True, 15, n_cpus=16) == "active"
    assert threads.os.environ["GOMP_SPINCOUNT"] == threads.ACTIVE_SPINCOUNT
    assert threads.waits_actively()


def test_only_commands_that_load_a_model_defer(monkeypatch):
    _clear_wait(monkeypatch)
    for argv in (["probe-pcie"], ["info", "-m", "x.gguf"], []):
        assert threads.openmp_wait_for_args(argv, n_cpus=16, gpu_stack=True) == "short spin"
        _clear_wait(monkeypatch)
    for cmd in threads.DEFERRING_COMMANDS:
        assert threads.openmp_wait_for_args([cmd, "-m", "x.gguf"], n_cpus=16, gpu_stack=True) == "deferred"


def test_settle_wait_says_why_the_threads_do_not_wait_actively(monkeypatch):
    from moecache.cli.common import settle_wait, wants_active_wait
    from moecache.settings import Settings

    said = []
    _clear_wait(monkeypatch)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    assert wants_active_wait(_resolved("layer"), Settings()) and not wants_active_wait(_resolved("expert"), Settings())
    assert wants_active_wait(_resolved("expert", cpu_moe=True), Settings())
    assert settle_wait(True, 8, said.append) == "no free core"
    assert len(said) == 1 and "-t 8 leaves no CPU free" in said[0] and "may use 8" in said[0]
    assert settle_wait(True, 7, said.append) == "set before" and len(said) == 1  # the short spin stays
    _clear_wait(monkeypatch)
    monkeypatch.setattr(threads, "openmp_runtime_loaded", lambda maps=None: True)
    assert settle_wait(True, 7, said.append) == "too late" and "loaded before" in said[-1]
    assert settle_wait(False, 7, said.append) == "too late" and len(said) == 2  # nothing to say without a plan


@pytest.mark.parametrize("results, want", [
    # one combination with a plan: active for all (the other's -t 8, every CPU, does not count: it
    # wants no active waiting)
    ([("layer", 0, 7), ("expert", 0, 8)], "active"),
    ([("expert", 0, 7), ("expert", 0, 7)], "short spin"),
    ([("layer", 0, 7), ("expert", None, 8)], "short spin"),  # a CPU-only combination: no spinning threads
    ([("layer", 0, 8), ("expert", 0, 7)], "no free core"),  # the plan's own -t takes every CPU
])
def test_bench_settles_one_wait_for_every_combination(monkeypatch, results, want):
    """bench resolves every combination before the first load and settles one policy for all
    (the runtime reads it once), so --cache-plan auto resolves the same way in each row."""
    import moecache.llm as llm
    from moecache.cli import bench as bench_mod

    _clear_wait(monkeypatch)
    seen = []

    def fake_resolve_file(model, settings, command, omp_active):
        seen.append((model, command, omp_active))
        plan, gpu, n = results[len(seen) - 1]
        return _resolved(plan, gpu, n_threads=n)

    monkeypatch.setattr(llm, "resolve_file", fake_resolve_file)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    combos = [type("P", (), {"model": f"m{i}.gguf"})() for i in range(len(results))]
    from moecache.settings import Settings

    assert bench_mod.settle_for_all(combos, lambda p: Settings()) == want
    assert seen == [("m0.gguf", "bench", True), ("m1.gguf", "bench", True)]
    assert threads.waits_actively() is (want == "active")
    # settled: later loads see it, and bench resolves nothing again
    assert bench_mod.settle_for_all(combos, lambda p: Settings()) is None and len(seen) == 2


def test_load_engine_defers_to_the_resolved_settings(monkeypatch):
    """load_engine: with neither variable set it resolves once with active waiting assumed, settles
    the policy from that before anything loads, and loads against what was settled (a layer plan
    only if the threads wait actively); with one set it settles nothing."""
    import moecache.llm as llm
    from moecache.cli.common import load_engine
    from moecache.settings import Settings

    calls = []
    monkeypatch.setattr(llm, "resolve_file", lambda *a, **k: calls.append(("resolve", k["omp_active"]))
                        or _resolved("layer", 0, n_threads=7))
    monkeypatch.setattr(llm, "open_llm", lambda *a, **k: calls.append(("load", threads.waits_actively())) or "llm")
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    _clear_wait(monkeypatch)
    assert load_engine("m.gguf", Settings(), "run") == "llm"
    assert calls == [("resolve", True), ("load", True)]
    _clear_wait(monkeypatch)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 7)  # -t 7 takes every CPU: no active waiting
    calls.clear()
    load_engine("m.gguf", Settings(), "run")
    assert calls == [("resolve", True), ("load", False)] and threads.os.environ["GOMP_SPINCOUNT"] == threads.SPINCOUNT
    calls.clear()
    load_engine("m.gguf", Settings(), "run")  # settled: nothing resolved twice
    assert calls == [("load", False)]


def test_bench_command_settles_before_loading(monkeypatch, tmp_path):
    """moecache bench calls settle_for_all with its combinations before the first engine loads."""
    from typer.testing import CliRunner

    import moecache.cli.bench as bench_mod
    from moecache.cli.main import app
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=0)
    order = []
    monkeypatch.setattr(bench_mod, "settle_for_all", lambda combos, settings_of: order.append(
        ("settle", len(combos), settings_of(combos[0]).n_threads)))
    orig = bench_mod.load_engine
    monkeypatch.setattr(bench_mod, "load_engine", lambda *a, **k: order.append(("load",)) or orig(*a, **k))
    r = CliRunner().invoke(app, ["bench", "-m", str(path), "-p", "0", "-n", "1", "-r", "1", "-t", "1,2", "-o", "jsonl"])
    assert r.exit_code == 0, r.output
    assert order == [("settle", 2, 1), ("load",), ("load",)]


def _other_thread(fn):
    """Run ``fn`` on a new thread (Numba's thread count there starts at NUMBA_NUM_THREADS); its result."""
    import threading

    box = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["e"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box.get("v")


def _need_two_numba_threads():
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:  # a failure, not a skip: this machine cannot tell -t 1 from "all"
        pytest.fail(f"these tests need NUMBA_NUM_THREADS >= 2 (CI has 2 cores), got {numba.config.NUMBA_NUM_THREADS}")


def test_engine_runs_on_its_threads_from_a_thread_that_did_not_load_it(tmp_path, monkeypatch):
    """``-t`` holds on whatever thread calls the engine: serve loads on one thread and decodes on
    another, and Numba's thread count is per thread (a new thread runs on all CPUs). Every forward
    pass of eval, decode and eval_seqs made on a fresh thread runs at the engine's 1 thread
    (before the thirty-seventh session these ran on NUMBA_NUM_THREADS)."""
    import numba

    import moecache
    from moecache.testing.synth import PRESETS, write_model

    _need_two_numba_threads()
    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=3)
    with moecache.load(path, n_ctx=256, n_threads=1, no_moe_profile=True) as m:
        eng = m.engine
        seen: list[tuple[str, int]] = []
        for name in ("forward", "forward_seqs", "forward_parts"):
            orig = getattr(eng.model, name)

            def spy(*a, _orig=orig, _name=name, **k):
                seen.append((_name, numba.get_num_threads()))
                return _orig(*a, **k)
            monkeypatch.setattr(eng.model, name, spy)
        assert _other_thread(numba.get_num_threads) == numba.config.NUMBA_NUM_THREADS  # the default there
        kvs = eng.sequences(2)
        _other_thread(lambda: eng.eval([1, 2, 3], kv=kvs[0]))
        _other_thread(lambda: eng.decode([4, 5], kvs))
        _other_thread(lambda: eng.eval_seqs([[6, 7], [8]], kvs))
        assert {n for n, _ in seen} == {"forward", "forward_seqs", "forward_parts"}, seen
        assert all(t == 1 for _, t in seen), seen


def test_cache_misses_run_on_the_callers_threads(tmp_path, monkeypatch):
    """The expert cache's op-by-op misses run on its own worker thread: at the calling thread's
    Numba thread count, not that thread's default (all CPUs)."""
    import numba
    import numpy as np

    from moecache.backends import NumpyBackend
    from moecache.gguf_file import open_gguf
    from moecache.models.base import expert_weights
    from moecache.moe.cache import CachedExperts
    from moecache.moe.policy import CachePolicy, PolicyConfig
    from moecache.moe.routing import topk_routing
    from moecache.quants import cpu
    from moecache.testing.synth import PRESETS, write_model

    _need_two_numba_threads()
    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=4)
    seen: list[int] = []
    orig = cpu.RoutedExperts.__call__

    def spy(self, *a):
        seen.append(numba.get_num_threads())
        return orig(self, *a)
    monkeypatch.setattr(cpu.RoutedExperts, "__call__", spy)
    with open_gguf(path) as m:
        c = m.config
        ew = expert_weights(m, "silu")
        policy = CachePolicy(c.n_layer, c.n_expert, 1, PolicyConfig(t_upload=1.0))
        cache = CachedExperts(ew, NumpyBackend(), 1, policy, 32)
        rng = np.random.default_rng(0)
        il = next(iter(ew))
        h = rng.standard_normal((2, c.n_embd)).astype(np.float32)
        r = topk_routing(rng.dirichlet(np.ones(c.n_expert), 2).astype(np.float32), c.n_expert_used, True)
        saved = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            cache(il, h, r)  # no slot filled: every pair is a miss, computed on the cache's thread
        finally:
            numba.set_num_threads(saved)
            cache.close()
    assert seen == [1]
