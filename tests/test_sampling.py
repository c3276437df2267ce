"""Sampler: greedy, the filters of llama.cpp's default chain, penalties, seeds, validation."""

from __future__ import annotations

import numpy as np
import pytest

from moecache.sampling import Sampler, SamplingParams

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)


def draws(params: SamplingParams, logits: np.ndarray, n: int) -> np.ndarray:
    s = Sampler(params)
    return np.array([s.sample(logits) for _ in range(n)])


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert Sampler(SamplingParams(temp=0.0)).sample(x) == int(np.argmax(x))


def test_plain_temperature_sampling_follows_softmax():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0])
    temp = 0.7
    p = np.exp(logits / temp)
    p /= p.sum()
    n = 40000
    got = np.bincount(draws(SamplingParams(temp=temp, seed=7, **OFF), logits, n), minlength=5) / n
    # 5 standard errors of a binomial frequency
    assert np.all(np.abs(got - p) < 5 * np.sqrt(p * (1 - p) / n)), (got, p)


def test_top_k_top_p_min_p_cut_the_tail():
    logits = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))
    # top-k 2: only the two best
    assert set(draws(SamplingParams(temp=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=1), logits, 3000)) == {0, 1}
    # top-p 0.75: smallest prefix with mass >= 0.75 is {0.40, 0.25, 0.15} (0.80)
    assert set(draws(SamplingParams(temp=1.0, top_k=0, top_p=0.75, min_p=0.0, seed=2), logits, 3000)) == {0, 1, 2}
    # min-p 0.3: p >= 0.3 * 0.40 = 0.12 keeps the first three
    assert set(draws(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.3, seed=3), logits, 3000)) == {0, 1, 2}


def test_top_k_one_is_greedy_at_any_temperature():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(500)
    assert set(draws(SamplingParams(temp=5.0, top_k=1, seed=4), x, 200)) == {int(np.argmax(x))}


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    x = np.array([3.0, 2.5, -1.0, -1.2])
    s = Sampler(SamplingParams(temp=0.0, repeat_penalty=1.5))
    assert s.sample(x) == 0
    s.accept(0)  # 3.0 / 1.5 = 2.0 < 2.5
    assert s.sample(x) == 1
    s2 = Sampler(SamplingParams(temp=0.0, repeat_penalty=2.0))
    x2 = np.array([-1.0, -1.5, -5.0])
    s2.accept(0)  # -1.0 * 2 = -2.0 < -1.5
    assert s2.sample(x2) == 1


def test_repeat_last_n_window_and_presence_penalty():
    x = np.array([1.0, 0.9])
    s = Sampler(SamplingParams(temp=0.0, repeat_penalty=2.0, repeat_last_n=2))
    s.accept(0)
    assert s.sample(x) == 1
    s.accept(1)
    s.accept(1)  # token 0 left the 2-token window
    assert s.sample(np.array([1.0, 0.9])) == 0
    s3 = Sampler(SamplingParams(temp=0.0, presence_penalty=0.5, frequency_penalty=0.0))
    s3.accept(0)
    assert s3.sample(np.array([1.0, 0.6])) == 1  # 1.0 - 0.5 < 0.6


def test_same_seed_same_tokens_different_seed_differs():
    rng = np.random.default_rng(9)
    x = rng.standard_normal(2000)
    a = draws(SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42), x, 50)
    b = draws(SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42), x, 50)
    c = draws(SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=43), x, 50)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("bad,flag", [
    (dict(top_p=1.5), "--top-p"), (dict(min_p=-0.1), "--min-p"), (dict(repeat_penalty=0.0), "--repeat-penalty"),
    (dict(temp=float("nan")), "--temp"), (dict(seed=-5), "--seed"), (dict(repeat_last_n=-2), "--repeat-last-n"),
])
def test_invalid_values_name_the_flag(bad, flag):
    with pytest.raises(ValueError, match=flag):
        Sampler(SamplingParams(**bad))


def test_filters_act_before_temperature_as_in_llamacpp():
    # llama.cpp's chain: top-p and min-p see the untempered distribution, temperature comes last.
    # At temp 3 the tempered nucleus of mass 0.75 would hold 5 tokens; the untempered one holds 3.
    logits = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))
    got = set(draws(SamplingParams(temp=3.0, top_k=0, top_p=0.75, min_p=0.0, seed=8), logits, 4000))
    assert got == {0, 1, 2}
    got = set(draws(SamplingParams(temp=3.0, top_k=0, top_p=1.0, min_p=0.3, seed=9), logits, 4000))
    assert got == {0, 1, 2}


def test_banned_ids_are_never_picked_greedy_or_sampled(rng):
    """``banned`` (llama-server's ignore_eos): greedy takes the best id outside the set, against an
    argmax over the logits with those ids removed; sampling at a temperature never draws them; the
    greedy path that skips the float64 copy gives the same ids as the one that makes it."""
    for _ in range(50):
        x = rng.standard_normal(3000).astype(np.float32)
        top = np.argsort(-x)[:3]
        banned = [int(top[0]), int(top[1]), 2999, 5000]  # 5000: past the vocabulary, ignored
        keep = np.setdiff1d(np.arange(3000), banned)
        ref = int(keep[np.argmax(x[keep])])
        assert Sampler(SamplingParams(temp=0.0), banned=banned).sample(x) == ref not in banned
        assert Sampler(SamplingParams(temp=0.0), banned=[5000]).sample(x) == int(np.argmax(x))
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    got = draws_banned(SamplingParams(temp=1.0, seed=3, **OFF), logits, [0], 3000)
    assert set(got) == {1, 2}


def draws_banned(params: SamplingParams, logits: np.ndarray, banned: list[int], n: int) -> np.ndarray:
    s = Sampler(params, banned=banned)
    return np.array([s.sample(logits) for _ in range(n)])


def test_greedy_with_penalties_after_history_takes_the_penalised_path():
    """Greedy with a penalty in effect (history present) picks by the penalised logits; with the same
    history and neutral penalties it is the plain argmax (the copy-free path)."""
    x = np.array([3.0, 2.5, -1.0], np.float32)
    s = Sampler(SamplingParams(temp=0.0, presence_penalty=1.0))
    assert s.sample(x) == 0  # no history yet: nothing to penalise
    s.accept(0)  # 3.0 - 1.0 = 2.0 < 2.5
    assert s.sample(x) == 1
    n = Sampler(SamplingParams(temp=0.0))
    n.accept(0)
    assert n.sample(x) == 0


def _reference_distribution(logits, params, history=(), banned=()):
    """The chain in plain float64 over the whole vocabulary (every id sorted, no partition): bans,
    penalties (llama.cpp's formulas), top-k, top-p, min-p, temperature."""
    p = params
    x = np.array(logits, dtype=np.float64)
    for b in banned:
        if 0 <= b < x.size:
            x[b] = -np.inf
    hist = list(history)[-p.repeat_last_n:] if p.repeat_last_n > 0 else []
    for t in sorted(set(hist)):
        c = hist.count(t)
        v = x[t] / p.repeat_penalty if x[t] > 0 else x[t] * p.repeat_penalty
        x[t] = v - c * p.frequency_penalty - p.presence_penalty
    order = sorted(range(x.size), key=lambda i: (-x[i], i))  # value descending, lower id first
    if 0 < p.top_k < x.size:
        order = order[:p.top_k]
    v = x[order]
    if p.top_p < 1.0:
        e = np.exp(v - v.max())
        cum = np.cumsum(e / e.sum())
        n = int(np.argmax(cum >= p.top_p)) + 1 if (cum >= p.top_p).any() else len(order)
        order, v = order[:n], v[:n]
    if p.min_p > 0.0:
        keep = [i for i in range(len(order)) if i == 0 or v[i] >= v[0] + np.log(p.min_p)]
        order, v = [order[i] for i in keep], v[keep]
    e = np.exp(v / p.temp - (v / p.temp).max())
    return np.array(order), e / e.sum()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temp=1.3, top_k=5, top_p=0.8, min_p=0.0),
                                    SamplingParams(temp=0.7, top_k=0, top_p=0.9, min_p=0.1),
                                    SamplingParams(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.5)])
def test_distribution_equals_the_whole_vocabulary_reference(params, rng):
    """The chain's candidates and probabilities (top-k by a partition, only the candidates sorted)
    equal a plain float64 reference that sorts the whole vocabulary, with ties at the k-th value,
    banned ids and a history for the penalties."""
    for _ in range(10):
        x = (rng.standard_normal(5000) * 3).astype(np.float32)
        x[rng.integers(0, 5000, 30)] = x[np.argsort(-x)[params.top_k - 1 if params.top_k > 0 else 3]]  # ties
        hist = rng.integers(0, 5000, 40).tolist() + [int(np.argmax(x))]
        banned = rng.integers(0, 5000, 3).tolist()
        s = Sampler(params, banned=banned)
        for t in hist:
            s.accept(t)
        ids, probs = s.distribution(x)
        ref_ids, ref_probs = _reference_distribution(x, params, hist, banned)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(probs, ref_probs, rtol=1e-9)
