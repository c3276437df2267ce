"""Token sampling: llama.cpp's default sampler chain and defaults.

Chain (llama.cpp ``common_params_sampling::samplers`` order, the samplers off by default left out):
repetition penalties -> top-k -> top-p -> min-p -> temperature -> draw. ``temp <= 0`` is greedy
(argmax of the penalised logits). Defaults are llama.cpp's (``common/common.h``): temp 0.8, top-k 40,
top-p 0.95, min-p 0.05, repeat penalty 1.0 (off) over the last 64 tokens, random seed.

Formulas: repetition penalty as CTRL (Keskar et al. 2019) in llama.cpp's form (a positive logit is
divided by the penalty, a negative one multiplied); frequency/presence penalties as OpenAI's API
(``logit -= count * freq + (count > 0) * presence``); nucleus top-p (Holtzman et al. 2019); min-p
(Nguyen et al. 2024): keep tokens with ``p >= min_p * p_max``.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp LLAMA_DEFAULT_SEED: draw a random seed


@dataclass(frozen=True)
class SamplingParams:
    """Sampler settings (llama.cpp flag names in brackets).

    Attributes:
        temp: temperature [--temp]; <= 0 = greedy.
        top_k: keep the k most likely tokens [--top-k]; <= 0 = off.
        top_p: nucleus mass [--top-p]; 1.0 = off.
        min_p: relative probability floor [--min-p]; 0.0 = off.
        repeat_penalty: [--repeat-penalty]; 1.0 = off.
        repeat_last_n: tokens the penalties look back over [--repeat-last-n]; 0 = off, -1 = context.
        frequency_penalty, presence_penalty: [--frequency-penalty, --presence-penalty]; 0 = off.
        seed: RNG seed [--seed]; DEFAULT_SEED (0xFFFFFFFF) = random.
    """

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = DEFAULT_SEED

    def validate(self) -> None:
        """Raise ValueError naming the flag of any out-of-range value."""
        bad = []
        if not np.isfinite(self.temp):
            bad.append(f"--temp must be a finite number, got {self.temp}")
        if not 0.0 <= self.top_p <= 1.0:
            bad.append(f"--top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad.append(f"--min-p must be in [0, 1], got {self.min_p}")
        if not (np.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            bad.append(f"--repeat-penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            bad.append(f"--repeat-last-n must be >= -1, got {self.repeat_last_n}")
        if not (0 <= self.seed <= 0xFFFFFFFF):
            bad.append(f"--seed must be in [0, 4294967295], got {self.seed}")
        if bad:
            raise ValueError("; ".join(bad))


class Sampler:
    """Picks the next token from a logits row; remembers recent tokens for the penalties.

    Args:
        params: the settings (validated here; ValueError if out of range).
        n_ctx: context size, the look-back when ``repeat_last_n`` is -1.
        banned: token ids never picked (their logits set to -inf before the chain: llama-server's
            ``ignore_eos`` bans the end-of-generation ids); negative ids and ids past the
            vocabulary are ignored.

    The same seed and the same logits give the same tokens (numpy PCG64 generator).
    """

    def __init__(self, params: SamplingParams, n_ctx: int = 4096, banned: Iterable[int] = ()):
        params.validate()
        self.params = params
        # ids never picked (their logits set to -inf before the chain: llama-server's ignore_eos)
        self.banned = np.array(sorted({int(i) for i in banned if int(i) >= 0}), dtype=np.int64)
        seed = params.seed if params.seed != DEFAULT_SEED else int(np.random.SeedSequence().entropy % 0xFFFFFFFF)
        self.seed = seed
        self.rng = np.random.Generator(np.random.PCG64(seed))
        n = params.repeat_last_n if params.repeat_last_n >= 0 else n_ctx
        self.history: deque[int] = deque(maxlen=max(n, 0))

    def accept(self, token: int) -> None:
        """Record a token of the sequence (prompt or generated) for the penalties."""
        if self.history.maxlen:
            self.history.append(int(token))

    def sample(self, logits: np.ndarray) -> int:
        """The next token id from float (n_vocab,) logits. Does not record it (call :meth:`accept`)."""
        p = self.params
        ids, probs = self.distribution(logits)
        if p.temp <= 0:
            return int(ids[0])
        return int(ids[self.rng.choice(probs.shape[0], p=probs)])

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chain's candidates and their probabilities for float (n_vocab,) logits: int64 ids, most
        likely first (ties: lower id first), and float64 probabilities summing to 1 (greedy: the best
        id alone, probability 1).

        Cost: with top-k on (llama.cpp's default 40), a partition of the logits finds the k-th largest
        value and only the candidates are sorted and copied; the logits are copied whole only when
        banned ids or penalties change them (151936 logits: ~0.15 ms where a float64 copy, a negated
        copy, an index array and an argpartition took ~2.4 ms)."""
        p = self.params
        x = np.asarray(logits)
        penalised = self._penalties_apply()
        if p.temp <= 0 and not penalised:
            # greedy, no penalty in effect: the argmax of the logits as given (their float32 order is
            # the float64 one), no copy unless it is a banned id
            tok = int(np.argmax(x))
            if not np.any(self.banned == tok):
                return np.array([tok], np.int64), np.ones(1)
        if self.banned.size or penalised:
            x = np.array(x, dtype=np.float64, copy=True)
            if self.banned.size:
                x[self.banned[self.banned < x.shape[0]]] = -np.inf
            self._penalize(x)
        n = x.shape[0]
        if p.temp <= 0:
            return np.array([int(np.argmax(x))], np.int64), np.ones(1)
        if 0 < p.top_k < n:
            kth = np.partition(x, n - p.top_k)[n - p.top_k]  # the k-th largest value
            ids = np.flatnonzero(x >= kth)  # k of them, or more where values tie with it
        else:
            ids = np.arange(n)
        vals = x[ids].astype(np.float64)
        order = np.argsort(-vals, kind="stable")  # value descending, then id ascending (ids ascend)
        if 0 < p.top_k < n:
            order = order[:p.top_k]
        ids, vals = ids[order], vals[order]
        if p.top_p < 1.0:
            probs = _softmax(vals)
            m = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, vals = ids[:max(m, 1)], vals[:max(m, 1)]
        if p.min_p > 0.0:
            keep = vals >= vals[0] + np.log(p.min_p)
            keep[0] = True
            ids, vals = ids[keep], vals[keep]
        return ids.astype(np.int64), _softmax(vals / p.temp)

    def _penalties_apply(self) -> bool:
        p = self.params
        return bool(self.history) and not (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0
                                           and p.presence_penalty == 0.0)

    def _penalize(self, x: np.ndarray) -> None:
        p = self.params
        if not self._penalties_apply():
            return
        counts = Counter(self.history)
        tok = np.fromiter(counts.keys(), dtype=np.int64)
        cnt = np.fromiter(counts.values(), dtype=np.float64)
        tok_ok = tok < x.shape[0]
        tok, cnt = tok[tok_ok], cnt[tok_ok]
        v = x[tok]
        v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        v -= cnt * p.frequency_penalty + p.presence_penalty
        x[tok] = v


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
