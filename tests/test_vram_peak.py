"""bench/vram_peak.py's bookkeeping of the arrays alive at a prompt's peak (CPU; the CuPy hook that
feeds it runs on the GPU machine only)."""

from __future__ import annotations

import bench_scripts

_vram_peak = bench_scripts.load("vram_peak")
LiveBytes, call_site = _vram_peak.LiveBytes, _vram_peak.call_site


def test_the_snapshot_is_taken_at_the_largest_total_alive():
    lb = LiveBytes()
    lb.malloc(1, 100, "a")
    lb.malloc(2, 300, "b")
    lb.free(1)
    lb.malloc(3, 50, "a")          # 350 alive: below the 400 before
    assert lb.peak == 400 and dict(lb.at_peak) == {"a": 100, "b": 300}
    lb.malloc(4, 200, "c")          # 550: a new peak, a and b as they are now
    assert lb.peak == 550 and dict(lb.at_peak) == {"a": 50, "b": 300, "c": 200}
    assert lb.counts["a"] == 1
    lb.free(2)
    lb.free(99)                     # a block allocated before the hook: not counted, no error
    assert lb.total == 250 and lb.peak == 550
    rep = lb.report()
    assert "peak of the arrays alive: 0.0 MiB" in rep and rep.index("b") < rep.index("c")


def test_call_site_names_the_innermost_moecache_frame():
    import numpy as np

    from moecache.backends.numpy_backend import NumpyBackend

    seen = []

    class XP:  # numpy, but its mean records who called it
        def __getattr__(self, name):
            return getattr(np, name)

        def mean(self, *a, **kw):
            seen.append(call_site())
            return np.mean(*a, **kw)

    be = NumpyBackend()
    be.xp = XP()
    be.rms_norm(np.ones((2, 4), np.float32), None, 1e-6)
    assert len(seen) == 1 and seen[0].startswith("moecache/backends/ops.py:") and seen[0].endswith(" rms_norm")
    assert call_site() == "?"  # from this test: no moecache frame on the stack
