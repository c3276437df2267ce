"""The next host-expert layer's experts copied during the current layer (moecache/moe/prefetch.py),
checked on the CPU twin: a GPU stand-in whose uploads hold NaN bytes until finished, so any read
before the copy completes shows in the logits."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.backends import NumpyBackend
from moecache.backends.numpy_backend import TwinUpload
from moecache.gguf_file import open_gguf
from moecache.models import build_model
from moecache.models.base import expert_weights
from moecache.moe.executor import CPUExperts, placed_experts
from moecache.moe.prefetch import LayerPrefetch
from moecache.moe.routing import topk_routing


class Gpu(NumpyBackend):
    """A NumpyBackend standing in for GPU ``device`` (so layers on it offload prompt ubatches)."""

    def __init__(self, device: int = 0):
        super().__init__()
        self.device = device
        self.uploads = 0

    def start_upload(self, ws):
        self.uploads += 1
        return super().start_upload(ws)


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    """The synthetic tiny qwen3moe (4 layers, 8 experts, top-2) open, and its routed experts per layer."""
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("prefetch") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=5)
    with open_gguf(path) as m:
        yield m, expert_weights(m, "silu")


def _routing(rng, n_tok, n_expert, k):
    return topk_routing(rng.dirichlet(np.ones(n_expert), n_tok).astype(np.float32), k, True)


def test_twin_upload_holds_nan_bytes_until_finished():
    w = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    up = TwinUpload((w,))
    assert (up.arrays[0] == 0xFF).all()  # read before the copy: garbage, as on the GPU
    np.testing.assert_array_equal(up.finish()[0], w)


def test_a_prompt_through_prefetched_layers_equals_the_plain_offload(opened, rng):
    m, ew = opened
    c = m.config
    n = c.n_layer
    tokens = rng.integers(0, c.n_vocab, 40)  # >= 32: op offload; 40 * k pairs >= 2 * n_expert
    assert 40 * c.n_expert_used >= 2 * c.n_expert
    out = {}
    for prefetch in (False, True):
        gpu = Gpu()
        bes = [gpu] * n
        ex = placed_experts(ew, [False] * n, bes, 32, None, prefetch)
        lm = build_model(m, gpu, ex, bes, gpu)
        out[prefetch] = lm.forward(tokens, lm.new_kv_cache(64), logits="all")
        if prefetch:
            shared = ex.executors[min(ew)].prefetch
            assert isinstance(shared, LayerPrefetch)
            assert all(ex.executors[il].prefetch is shared for il in ew)
            # every host-expert layer after the first came from the upload begun during the layer before
            assert shared.started == shared.used == len(ew) - 1 and shared.dropped == 0
            assert gpu.uploads == len(ew) - 1
            per_layer = {il: sum(int(w.nbytes) for w in (e.gate, e.up, e.down)) for il, e in ew.items()}
            later = sorted(ew)[1:]
            assert shared.bytes == sum(per_layer[il] for il in later)
            for il in later:  # the whole layer moved, used experts or not
                assert ex.executors[il].offloaded_bytes == per_layer[il]
        else:
            assert gpu.uploads == 0
    cpu_lm = build_model(m, NumpyBackend())  # every layer's experts computed on the CPU, no offload
    ref = cpu_lm.forward(tokens, cpu_lm.new_kv_cache(64), logits="all")
    assert np.isfinite(out[True]).all()
    np.testing.assert_array_equal(out[True], out[False])
    np.testing.assert_allclose(out[True], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_small_ubatches_and_other_layers_do_not_use_an_upload(opened, rng):
    m, ew = opened
    c = m.config
    layers = sorted(ew)
    assert len(layers) >= 3
    gpu = Gpu()
    ex = placed_experts(ew, [False] * c.n_layer, [gpu] * c.n_layer, 32, None, True)
    shared = ex.executors[layers[0]].prefetch
    ref = {il: CPUExperts({il: ew[il]}, NumpyBackend()) for il in layers}

    def check(il, n_tok):
        h = rng.standard_normal((n_tok, c.n_embd)).astype(np.float32)
        r = _routing(rng, n_tok, c.n_expert, c.n_expert_used)
        np.testing.assert_allclose(ex(il, h, r), ref[il](il, h, r), rtol=1e-6, atol=1e-7)

    check(layers[0], 40)
    assert shared.started == 1  # layers[1] is on its way
    check(layers[2], 40)  # not the layer in flight: dropped, layer 2 copies its own experts
    assert shared.dropped == 1 and shared.used == 0
    # layer 2 began layers[3]'s upload if there is one; a small ubatch computed on the CPU drops it
    check(layers[0], 3)
    assert shared._flight is None and shared.dropped == 2 and shared.started == 2
    # too few pairs for the next layer's experts: nothing starts
    few = LayerPrefetch({il: (ew[il], gpu) for il in layers}, min_pairs_per_expert=1e9)
    assert few.start_after(layers[0], 40 * c.n_expert_used) is False and few.started == 0
    assert few.start_after(layers[-1], 10 ** 9) is False  # the last layer has no next one


def test_drop_uploads_leaves_none_in_flight(opened, rng):
    """ExpertsByLayer.drop_uploads (what Engine.close calls): an upload a prompt cut short left in
    flight is dropped (counted), so its arrays never outlive the wait for the copy; with none in
    flight it does nothing."""
    m, ew = opened
    c = m.config
    layers = sorted(ew)
    ex = placed_experts(ew, [False] * c.n_layer, [Gpu()] * c.n_layer, 32, None, True)
    shared = ex.executors[layers[0]].prefetch
    h = rng.standard_normal((40, c.n_embd)).astype(np.float32)
    ex(layers[0], h, _routing(rng, 40, c.n_expert, c.n_expert_used))  # begins layers[1]'s upload
    assert shared._flight is not None and shared.dropped == 0
    ex.drop_uploads()
    assert shared._flight is None and shared.dropped == 1
    ex.drop_uploads()
    assert shared.dropped == 1


def test_no_prefetch_on_cpu_layers_or_by_default(opened):
    m, ew = opened
    n = m.config.n_layer
    assert all(e.prefetch is None for e in placed_experts(ew, [False] * n, [Gpu()] * n, 32).executors.values())
    cpu = placed_experts(ew, [False] * n, [NumpyBackend()] * n, 32, None, True)  # CPU layers: no offload
    assert all(e.prefetch is None for e in cpu.executors.values())
