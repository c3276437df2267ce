"""The server's step-time histograms (``moecache.server.metrics.Histogram``): counts against numpy,
the exposition parsed by the Prometheus project's own parser (``prometheus_client``), and
``bench/serve_load.py``'s reading of them."""

from __future__ import annotations

import math
import secrets

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench_scripts import load as load_bench
from moecache.server.metrics import STEP_BUCKETS_S, Histogram, Metrics
from moecache.server.worker import WorkerStatus


def _values(seed: int, n: int = 2000) -> np.ndarray:
    """Step-like times (s): mostly 5-8 ms, a tail to 0.3 s, some exactly on a bound, one above 5 s."""
    rng = np.random.default_rng(seed)
    v = np.concatenate([rng.uniform(0.005, 0.008, n), rng.exponential(0.03, n // 10),
                        rng.choice(np.array(STEP_BUCKETS_S), 50), [7.0]])
    rng.shuffle(v)
    return v


def test_histogram_counts_and_quantiles_agree_with_numpy():
    seed = secrets.randbits(32)
    print(f"seed {seed}")
    v = _values(seed)
    h = Histogram()
    for x in v:
        h.observe(float(x))
    cum = np.cumsum(h.counts)
    for b, c in zip(STEP_BUCKETS_S, cum):
        assert c == int((v <= b).sum()), b  # Prometheus's le: a value on a bound is in that bound's bucket
    assert cum[-1] == v.size and h.count == v.size
    assert h.total == pytest.approx(float(v.sum()), rel=1e-12)
    edges = (0.0, *STEP_BUCKETS_S, math.inf)
    for q in (0.01, 0.5, 0.9, 0.99):
        est = h.quantile(q)
        exact = float(np.quantile(v, q, method="inverted_cdf"))
        i = int(np.searchsorted(STEP_BUCKETS_S, exact, side="left"))  # exact's bucket
        lo, hi = edges[i], min(edges[i + 1], STEP_BUCKETS_S[-1])
        assert lo <= est <= hi, (q, est, exact)
    assert h.quantile(1.0) == STEP_BUCKETS_S[-1]  # the +Inf bucket's rank: the highest bound
    assert math.isnan(Histogram().quantile(0.5))


def test_histogram_quantile_is_linear_inside_a_bucket():
    """Ten values in (0.005, 0.006]: the median is half-way through that bucket, as Prometheus's
    histogram_quantile interpolates."""
    h = Histogram()
    for _ in range(10):
        h.observe(0.0055)
    assert h.quantile(0.5) == pytest.approx(0.0055)
    assert h.quantile(0.1) == pytest.approx(0.0051)


def test_histogram_minus_is_the_observations_since():
    h = Histogram()
    for x in (0.004, 0.02):
        h.observe(x)
    before = h.copy()
    for x in (0.0065, 0.0066, 0.3):
        h.observe(x)
    d = h.minus(before)
    assert d.count == 3 and d.total == pytest.approx(0.0065 + 0.0066 + 0.3)
    assert d.quantile(0.5) == pytest.approx(0.006 + 0.001 * (1.5 / 2))
    with pytest.raises(ValueError):
        Histogram((0.1, 0.05))
    with pytest.raises(ValueError, match="went down"):  # not an earlier copy (a restarted server's)
        before.minus(h)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        h.quantile(-0.1)


def test_metrics_exposition_parses_with_prometheus_client():
    """The whole of /metrics' text, histograms included, through the Prometheus project's parser:
    every family typed as rendered; the histogram's buckets cumulative and its count and sum the
    observations'."""
    seed = secrets.randbits(32)
    print(f"seed {seed}")
    v = _values(seed, 300)
    dp, bp = Histogram(), Histogram()
    for x in v:
        dp.observe(float(x))
    bp.observe(0.0004)
    text = Metrics().render(WorkerStatus(1, 2, [], (len(v), 3 * len(v)), (float(v.sum()), 0.5), [], dp, bp))
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["moecache:decode_pass_seconds"].type == "histogram"
    assert fams["moecache:decode_steps"].type == "counter"  # (the parser drops a counter's _total)
    samples = fams["moecache:decode_pass_seconds"].samples
    buckets = [(s.labels["le"], s.value) for s in samples if s.name.endswith("_bucket")]
    assert [float(b) for b, _ in buckets] == [*STEP_BUCKETS_S, math.inf]
    assert [c for _, c in buckets] == [float((v <= float(b)).sum()) for b, _ in buckets]
    by = {s.name: s.value for s in samples if not s.name.endswith("_bucket")}
    assert by["moecache:decode_pass_seconds_count"] == v.size
    assert by["moecache:decode_pass_seconds_sum"] == pytest.approx(float(v.sum()))
    between = {s.name: s.value for s in fams["moecache:decode_between_passes_seconds"].samples}
    assert between["moecache:decode_between_passes_seconds_count"] == 1


def test_serve_load_reads_the_histograms_back():
    """``serve_load``'s parser gives back the rendered histogram, and ``phase`` takes the p50/p99 of
    what was observed between two reads only."""
    sl = load_bench("serve_load")
    before, after = Histogram(), Histogram()
    for x in (0.004, 0.004, 0.2):
        before.observe(x)
        after.observe(x)
    for x in (0.0062, 0.0064, 0.0066, 0.0068):
        after.observe(x)

    def read(h: Histogram) -> dict:
        text = Metrics().render(WorkerStatus(0, 0, [], (0, 0), (0.0, 0.0), [], h))
        return {"steps": 1.0, "step_tokens": 1.0, "decode_s": 0.0, "hits": 0.0, "misses": 0.0,
                "hist": sl.histograms(text)}
    got = sl.histograms(Metrics().render(WorkerStatus(0, 0, [], (0, 0), (0.0, 0.0), [], after)))
    h = got["moecache:decode_pass_seconds"]
    assert h.bounds == STEP_BUCKETS_S and h.counts == after.counts and h.total == pytest.approx(after.total)
    row = sl.phase(read(before), read(after))
    assert row["decode_pass_p50_ms"] == pytest.approx(6.5)  # the four new ones, all in (6, 7] ms
    assert 6.0 < row["decode_pass_p99_ms"] <= 7.0
    assert row["between_p50_ms"] is None  # nothing observed there
