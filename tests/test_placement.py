"""Layer placement (-ngl, --cpu-moe, --n-cpu-moe, -sm, -ts) and the executors it builds: the plan is
pure logic, and the per-layer backend switching and op-offload bookkeeping run here with CPU twins
(NumpyBackend instances standing in for GPUs; tests/test_gpu.py repeats them on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends import NumpyBackend
from moecache.gguf_file import open_gguf
from moecache.models import build_model
from moecache.models.base import expert_weights
from moecache.moe.executor import CPUExperts, DeviceExperts, ExpertsByLayer, placed_experts
from moecache.placement import CPU, ModelSizes, PlacementError, PlacementOptions, plan

GiB = 1 << 30


def sizes(n=8, dense=0.5, experts=2.0, kv=0.25, output=0.5):
    return ModelSizes((int(dense * GiB),) * n, (int(experts * GiB),) * n, int(kv * GiB), int(output * GiB), 0)


def test_no_gpu_or_ngl_0_is_all_cpu():
    for p in (plan(PlacementOptions(), sizes(), []), plan(PlacementOptions(n_gpu_layers=0), sizes(), [80 * GiB])):
        assert p.layer_device == (CPU,) * 8 and p.output_device == CPU and not any(p.experts_on_device)
        assert p.devices == []


def test_everything_fits_is_all_gpu():
    p = plan(PlacementOptions(), sizes(), [80 * GiB])
    assert p.layer_device == (0,) * 8 and p.output_device == 0 and all(p.experts_on_device) and not p.notes


def test_ngl_counts_from_the_last_layer_and_output_needs_more_than_n_layer():
    p = plan(PlacementOptions(n_gpu_layers=3), sizes(), [80 * GiB])
    assert p.layer_device == (CPU,) * 5 + (0,) * 3 and p.output_device == CPU
    assert p.experts_on_device == (False,) * 5 + (True,) * 3
    assert plan(PlacementOptions(n_gpu_layers=8), sizes(), [80 * GiB]).output_device == CPU
    assert plan(PlacementOptions(n_gpu_layers=9), sizes(), [80 * GiB]).output_device == 0


def test_experts_that_do_not_fit_stay_on_the_host_first_layers_first():
    # dense 8 * (0.5 + 0.25) + 0.5 = 6.5 GiB; 10 GiB usable leaves room for experts of 1 layer only
    free = int((10 + 1) / 0.95 * GiB) + 1
    p = plan(PlacementOptions(), sizes(), [free])
    assert p.layer_device == (0,) * 8
    assert p.experts_on_device == (False,) * 7 + (True,)
    assert any("7 layer(s)" in n and "--n-cpu-moe 7" in n for n in p.notes)


def test_cpu_moe_and_n_cpu_moe():
    p = plan(PlacementOptions(cpu_moe=True), sizes(), [80 * GiB])
    assert p.layer_device == (0,) * 8 and not any(p.experts_on_device)
    p = plan(PlacementOptions(n_cpu_moe=3), sizes(), [80 * GiB])
    assert p.experts_on_device == (False,) * 3 + (True,) * 5
    with pytest.raises(PlacementError, match="raise --n-cpu-moe"):
        plan(PlacementOptions(n_cpu_moe=1), sizes(), [12 * GiB])


def test_auto_ngl_drops_layers_that_do_not_fit():
    p = plan(PlacementOptions(), sizes(dense=1.0, kv=1.0), [int(9.5 * GiB)])
    n = p.n_gpu_layers
    assert 0 < n < 8 and p.layer_device == (CPU,) * (8 - n) + (0,) * n
    assert any("-ngl auto" in s for s in p.notes)
    with pytest.raises(PlacementError, match="lower -ngl or -c"):
        plan(PlacementOptions(n_gpu_layers=8), sizes(dense=1.0, kv=1.0), [int(9.5 * GiB)])


def test_split_layers_over_gpus():
    # llama.cpp's split: the output layer counts (9 offloaded layers), layer j goes to the first GPU
    # whose cumulative share exceeds j / 9: 7 layers on GPU 0, 1 layer + the output on GPU 1
    p = plan(PlacementOptions(tensor_split=(3, 1)), sizes(), [80 * GiB, 80 * GiB])
    assert p.layer_device == (0,) * 7 + (1,) * 1 and p.output_device == 1
    # default: by free memory, when the model needs both GPUs (54.5 GiB; 46.5 and 27.5 GiB usable):
    # 9 offloaded layers at shares 0.625 / 1: 6 layers on GPU 0, 2 and the output on GPU 1
    p = plan(PlacementOptions(), sizes(experts=6.0), [50 * GiB, 30 * GiB])
    assert p.layer_device == (0,) * 6 + (1,) * 2 and p.output_device == 1
    p = plan(PlacementOptions(n_gpu_layers=8, tensor_split=(1, 1)), sizes(), [80 * GiB, 80 * GiB])
    assert p.layer_device == (0,) * 4 + (1,) * 4 and p.output_device == CPU  # output on the CPU: 8 split
    p = plan(PlacementOptions(split_mode="none", main_gpu=1), sizes(), [80 * GiB, 80 * GiB])
    assert p.layer_device == (1,) * 8 and p.devices == [1]
    p = plan(PlacementOptions(tensor_split=(0, 1)), sizes(), [80 * GiB, 80 * GiB])
    assert p.layer_device == (1,) * 8


def test_a_model_that_fits_one_gpu_stays_on_it():
    """Without -ts the default split keeps a model that fits on one GPU there (the one with the most
    usable memory, the lower index on a tie), with a note; -ts splits it; a model that needs both
    is split as llama.cpp splits it (test_split_layers_over_gpus)."""
    for free, gpu in (([40 * GiB, 30 * GiB], 0), ([30 * GiB, 40 * GiB], 1), ([40 * GiB, 40 * GiB], 0)):
        p = plan(PlacementOptions(), sizes(), free)  # 22.5 GiB
        assert p.layer_device == (gpu,) * 8 and p.output_device == gpu and all(p.experts_on_device), free
        assert p.devices == [gpu] and any(f"fits on GPU {gpu} alone" in n for n in p.notes)
    p = plan(PlacementOptions(tensor_split=(1, 1)), sizes(), [40 * GiB, 40 * GiB])
    assert p.devices == [0, 1] and not any("alone" in n for n in p.notes)
    p = plan(PlacementOptions(n_gpu_layers=4), sizes(), [40 * GiB, 40 * GiB])  # the last 4 layers, on one GPU
    assert p.layer_device == (CPU,) * 4 + (0,) * 4
    p = plan(PlacementOptions(cpu_moe=True), sizes(experts=6.0), [30 * GiB, 30 * GiB])  # dense only: 6.5 GiB
    assert p.devices == [0] and not any(p.experts_on_device)


def test_a_gpu_too_small_to_hold_anything_is_left_out():
    """A second GPU with 0.5 GiB free (less than the 1 GiB reserve) no longer drags every layer to
    the CPU: it is left out with a note, and the model runs on the first with the expert cache."""
    p = plan(PlacementOptions(), sizes(experts=3.0), [20 * GiB, GiB // 2])  # 30.5 GiB model, 18 GiB usable
    assert p.layer_device == (0,) * 8 and p.devices == [0]
    assert any("GPU 1 left out" in n for n in p.notes)


@pytest.mark.parametrize("opts,msg", [
    (PlacementOptions(split_mode="row"), "-sm"), (PlacementOptions(n_cpu_moe=-1), "--n-cpu-moe"),
    (PlacementOptions(tensor_split=(1, 1, 1)), "-ts"), (PlacementOptions(main_gpu=2), "-mg"),
    (PlacementOptions(n_gpu_layers=-2), "-ngl"), (PlacementOptions(tensor_split=(0, 0)), "-ts")])
def test_impossible_flags_name_the_flag(opts, msg):
    with pytest.raises(PlacementError, match=msg):
        plan(opts, sizes(), [80 * GiB, 80 * GiB])


class TwinBackend(NumpyBackend):
    """A NumpyBackend that stands in for a GPU: arrays it adopts are copies, and it counts them."""

    def __init__(self, device: int):
        self.device = device
        self.adopted = 0
        self.activated = 0

    def activate(self):
        self.activated += 1

    def adopt(self, a):
        self.adopted += 1
        return np.array(a)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("placement") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=11)
    return path


def test_layers_on_several_backends_give_the_same_logits(tiny_moe):
    with open_gguf(tiny_moe) as m:
        tokens = np.random.default_rng(1).integers(0, m.config.n_vocab, 12)
        one = build_model(m, NumpyBackend())
        ref = one.forward(tokens, one.new_kv_cache(16), logits="all")
        a, b = TwinBackend(0), TwinBackend(1)
        bes = [NumpyBackend(), a, a, b]
        split = build_model(m, bes[0], layer_backends=bes, output_backend=b)
        got = split.forward(tokens, split.new_kv_cache(16), logits="all")
    np.testing.assert_array_equal(got, ref)
    assert a.adopted == 1 and b.adopted == 1  # the hidden state moved once into each device


def test_op_offload_and_device_experts_equal_the_cpu_path(tiny_moe):
    with open_gguf(tiny_moe) as m:
        ew = expert_weights(m, "silu")
        il = min(ew)
        rng = np.random.default_rng(2)
        cpu_only = CPUExperts(ew, NumpyBackend())
        off = CPUExperts(ew, NumpyBackend(), offload_min_batch=32)
        dev = DeviceExperts({il: ew[il]}, NumpyBackend())
        from moecache.moe.routing import topk_routing
        for t in (3, 40):
            h = rng.standard_normal((t, m.config.n_embd)).astype(np.float32)
            r = topk_routing(rng.dirichlet(np.ones(m.config.n_expert), t).astype(np.float32),
                             m.config.n_expert_used, True)
            ref = cpu_only(il, h, r)
            before = off.offloaded_bytes
            np.testing.assert_allclose(off(il, h, r), ref, rtol=1e-6, atol=1e-7)
            used = np.unique(r.ids).size
            per_expert = sum(w[0].nbytes for w in (ew[il].gate, ew[il].up, ew[il].down))
            assert off.offloaded_bytes - before == (used * per_expert if t >= 32 else 0)
            np.testing.assert_allclose(dev(il, h, r), ref, rtol=1e-6, atol=1e-7)


def test_placed_experts_follow_the_placement(tiny_moe):
    with open_gguf(tiny_moe) as m:
        ew = expert_weights(m, "silu")
        n = m.config.n_layer
        bes = [NumpyBackend()] + [TwinBackend(0)] * (n - 1)
        on_dev = [False, False] + [True] * (n - 2)
        ex = placed_experts(ew, on_dev, bes, 32)
    assert isinstance(ex, ExpertsByLayer)
    assert isinstance(ex.executors[0], CPUExperts) and ex.executors[0].offload_min_batch is None  # CPU layer
    assert isinstance(ex.executors[1], CPUExperts) and ex.executors[1].offload_min_batch == 32  # GPU layer, host experts
    assert all(isinstance(ex.executors[i], DeviceExperts) for i in range(2, n))


def test_engine_without_a_gpu_says_so_once_and_runs_on_the_cpu(tiny_moe, monkeypatch):
    import moecache.engine as engine_mod
    from moecache.engine import Engine, EngineConfig

    monkeypatch.setattr(engine_mod, "gpu_memory", lambda: ([], [], "CuPy is not installed (cupy)"))
    notes: list[str] = []
    with Engine(tiny_moe, EngineConfig(n_ctx=32), log=notes.append, placement=PlacementOptions()) as e:
        assert e.placement is not None and e.placement.devices == []
        assert isinstance(e.backend, NumpyBackend)
    assert sum("no usable GPU: CuPy is not installed" in n for n in notes) == 1


@pytest.mark.parametrize("args,msg,code", [(["-sm", "row"], "-sm 'row'", 1), (["-ts", "3,x"], "-ts '3,x'", 1),
                                           (["--n-cpu-moe", "-1"], "-ncmoe/--n-cpu-moe: input should be greater", 2)])
def test_cli_placement_flags_are_checked(tmp_path, args, msg, code):
    from typer.testing import CliRunner

    from moecache.cli.main import app
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=1)
    r = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "hi", "-n", "1", *args])
    assert r.exit_code == code and msg in r.output and "Traceback" not in r.output  # 2: Click's range check


def test_prompt_gpu_is_the_fastest_link_and_offload_goes_there(tiny_moe):
    p = plan(PlacementOptions(prompt_gpu=1, tensor_split=(1, 1)), sizes(), [80 * GiB, 80 * GiB])
    assert p.prompt_gpu == 1 and p.devices == [0, 1]
    assert plan(PlacementOptions(prompt_gpu=0), sizes(), [80 * GiB]).prompt_gpu is None  # one GPU: its own
    with open_gguf(tiny_moe) as m:
        ew = expert_weights(m, "silu")
        il = min(ew)
        rng = np.random.default_rng(4)
        layer_be, fast = TwinBackend(0), TwinBackend(1)
        ex = placed_experts({il: ew[il]}, [False] * m.config.n_layer, [layer_be] * m.config.n_layer, 32, fast)
        from moecache.moe.routing import topk_routing
        h = rng.standard_normal((40, m.config.n_embd)).astype(np.float32)
        r = topk_routing(rng.dirichlet(np.ones(m.config.n_expert), 40).astype(np.float32), m.config.n_expert_used, True)
        got = ex(il, h, r)
        ref = CPUExperts({il: ew[il]}, NumpyBackend())(il, h, r)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert fast.adopted == 1 and layer_be.adopted == 1  # h went to the prompt GPU, the result came back


def test_memory_in_use_when_probed_counts_against_the_vram_budget():
    """--vram-budget is checked against the measured device memory, CUDA context included: what is in
    use when the GPU is probed comes out of the budget (a long prompt ran 200-290 MiB over 8 GiB while
    the ~0.5 GiB context was left out, bench/results/vs-llamacpp-h200.md, run h200-s9m)."""
    from moecache.placement import USABLE_FRACTION, budgeted_free

    mib = 1 << 20
    assert budgeted_free([80 * GiB], 8 * GiB, [512 * mib]) == [8 * GiB - 512 * mib]
    assert budgeted_free([80 * GiB], 8 * GiB) == [8 * GiB]
    assert budgeted_free([80 * GiB], 0, [512 * mib]) == [80 * GiB]  # no budget: free is what is free
    assert budgeted_free([6 * GiB], 8 * GiB, [512 * mib]) == [6 * GiB]  # the GPU has less than the budget leaves
    assert budgeted_free([80 * GiB], 8 * GiB, [9 * GiB]) == [0]
    with pytest.raises(ValueError, match="2 GPUs"):
        budgeted_free([GiB, GiB], 8 * GiB, [0])
    each = 16 * mib
    sz = ModelSizes((GiB // 4,) * 8, (128 * each,) * 8, GiB // 64, GiB // 4, 0, each)

    def slots(used):
        p = plan(PlacementOptions(vram_budget=8 * GiB), sz, [80 * GiB], used)
        assert not any(p.experts_on_device)
        return dict(p.cache_slots)[0]

    # 512 MiB in use leaves 0.95 * 512 MiB less to plan: 30.4 slots of 16 MiB
    assert 512 * mib * USABLE_FRACTION / each == pytest.approx(30.4)
    assert slots(None) - slots([512 * mib]) in (30, 31)
    assert slots([0]) == slots(None)
