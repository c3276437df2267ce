"""Does warming the expert cache from a prompt's own routing help the decode that follows it?

Issue 20 asks to measure it on the routing presets and on the real trace before choosing. This
replays the real policy (:class:`moecache.moe.policy.CachePolicy`, as :mod:`moecache.moe.replay`
does; no model, no GPU) through: a previous request (its prompt, then ``--prev-decode`` decode
tokens: the slots as an earlier request left them; ``--prev-decode 0``: a fresh process, empty
slots), then a new prompt of ``-p`` tokens in ``-ub`` ubatches (the engine's prompt path: the
routing feeds the usage statistics and admits nothing), then ``-n`` decode tokens, in three arms:

- ``now``: what the engine does (nothing at the prompt's end);
- ``fill``: at the prompt's end the free slots take the most-used experts by the usage after the
  prompt (``CachePolicy.preload`` of that usage: what ``--moe-profile`` does at start);
- ``swap``: ``fill``, then residents give way to more-used experts by the decode rule (payback
  over the window and the hysteresis margin), most-used challenger against least-used resident;

Reported per arm: the decode's hit rate over its first 64 tokens and over all ``-n``, uploads per
decode token, the uploads made at the prompt's end (each one expert's copy; at 8 GiB on the H200
~2.5 MB at ~50 GB/s: ~50 µs), and the replay's modelled µs per decode token (hits x t_gpu +
misses x t_cpu + uploads x t_upload, the prompt-end uploads spread over the ``-n`` tokens).

Sources: ``--routing`` presets (a new request = ``RoutingProcess.restart`` with a new seed: same
popularity and topic, a new prompt hot set) and ``.npz`` traces (``code-moe-tiny.routes.npz``: a
request = one 1024-token window of real text; its first ``-p`` tokens are the prompt, the next
``-n`` the decode; ``-p + -n`` must fit in a window).

    python bench/prompt_warm.py --routing qwen3-moe,low-locality,uniform --slots 0.25,0.5 -p 4096 -n 256
    python bench/prompt_warm.py --routing ../shared/models/code-moe-tiny.routes.npz --slots 0.25,0.5 \\
        -p 768 -n 256 -ub 256
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moecache.moe.policy import CachePolicy, PolicyConfig  # noqa: E402
from moecache.moe.routing_process import RoutingProcess, TraceRouting, make_routing  # noqa: E402

ARMS = ("now", "fill", "swap")


@dataclass
class ArmStats:
    hits64: int = 0
    total64: int = 0
    hits: int = 0
    total: int = 0
    uploads: int = 0
    warm_uploads: int = 0
    decode_tokens: int = 0


class Requests:
    """Request i's prompt and decode routing: ``(prompt (L, P, k), decode (L, D, k))`` int arrays."""

    def __init__(self, name: str, n_layer: int, n_expert: int, k: int, p: int, n: int, ub: int):
        # a trace brings its own shape (code-moe-tiny's: 8 layers, 16 experts, top-4)
        self.src = TraceRouting(name) if name.endswith(".npz") else make_routing(name, n_layer, n_expert, k, 0)
        self.p, self.n, self.ub = p, n, ub
        self.n_layer = getattr(self.src, "n_layer", n_layer)
        self.n_expert = getattr(self.src, "n_expert", n_expert)
        if isinstance(self.src, TraceRouting):
            self.window = int(np.load(name)["routes"].shape[2])
            if p + n > self.window:
                raise SystemExit(f"-p {p} + -n {n} does not fit the trace's windows of {self.window} tokens")
            self.count = self.src.n_tokens // self.window
        else:
            self.count = 1 << 30

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        src = self.src
        if isinstance(src, RoutingProcess):
            src.restart(1000 + i)
            prompt = np.concatenate([np.stack([src.route(il, t).ids for il in range(self.n_layer)])
                                     for t in _pieces(self.p, self.ub)], axis=1)
            decode = np.concatenate([np.stack([src.route(il, 1).ids for il in range(self.n_layer)])
                                     for _ in range(self.n)], axis=1)
            return prompt, decode
        w = i % self.count
        rows = src.routes[:self.n_layer, w * self.window:(w + 1) * self.window]
        return rows[:, :self.p], rows[:, self.p:self.p + self.n]


def _pieces(n: int, ub: int) -> list[int]:
    return [min(ub, n - a) for a in range(0, n, ub)]


def _decode(pol: CachePolicy, visible: np.ndarray, ids: np.ndarray, st: ArmStats | None) -> None:
    """Token-by-token decode through the policy (replay.replay_policy's rule: a copy admitted at a
    token is usable from the next one; an evicted slot is unusable at once)."""
    for t in range(ids.shape[1]):
        pol.new_tokens(1)
        pending = []
        for il in range(ids.shape[0]):
            row = ids[il, t]
            hit = visible[il, row]
            pol.observe(il, row[None, :])
            adm = pol.decide(il, row[~hit])
            for a in adm:
                if a.victim is not None:
                    visible[a.victim] = False
                pending.append((a.layer, a.expert))
            if st is not None:
                h = int(hit.sum())
                st.hits += h
                st.total += row.size
                if t < 64:
                    st.hits64 += h
                    st.total64 += row.size
                st.uploads += len(adm)
        for il, e in pending:
            visible[il, e] = True
        if st is not None:
            st.decode_tokens += 1


def _prompt(pol: CachePolicy, ids: np.ndarray, ub: int) -> None:
    """The engine's prompt path: each ubatch's routing observed, nothing admitted."""
    at = 0
    for t in _pieces(ids.shape[1], ub):
        pol.new_tokens(t)
        for il in range(ids.shape[0]):
            rows = ids[il, at:at + t]
            pol.observe(il, rows)
        at += t


def _warm(pol: CachePolicy, visible: np.ndarray, arm: str) -> int:
    """The arm's action at the prompt's end; returns the uploads it made (usable at once: they
    would be copied before the first decode token)."""
    if arm == "now":
        return 0
    n = 0
    for a in pol.preload(pol.usage.copy()):
        visible[a.layer, a.expert] = True
        n += 1
    if arm == "swap":
        cfg = pol.cfg
        gain = cfg.window * (cfg.t_cpu - cfg.t_gpu)
        cand = np.argsort(-np.where(pol.resident, -np.inf, pol.usage), axis=None, kind="stable")
        res = np.argsort(np.where(pol.resident, pol.usage, np.inf), axis=None, kind="stable")
        for c_flat, v_flat in zip(cand, res):
            c = divmod(int(c_flat), pol.usage.shape[1])
            v = divmod(int(v_flat), pol.usage.shape[1])
            if pol.resident[c] or not pol.resident[v]:
                break
            uc, uv = pol.usage[c], pol.usage[v]
            if (uc - uv) * gain <= cfg.t_upload or uc < (1.0 + cfg.hysteresis) * uv:
                break
            pol.resident[v], visible[v] = False, False
            pol.resident[c], visible[c] = True, True
            n += 1
    return n


def run(name: str, frac: float, prev: int, a: argparse.Namespace) -> dict[str, ArmStats]:
    reqs = Requests(name, a.layers, a.experts, a.k, a.p, a.n, a.ub)
    n_layer, n_expert = reqs.n_layer, reqs.n_expert
    n_slots = int(round(frac * n_expert)) * n_layer
    cfg = PolicyConfig(window=a.window)
    out = {arm: ArmStats() for arm in ARMS}
    for r in range(a.requests):
        prev_p, prev_d = reqs.get(2 * r)
        prompt, decode = reqs.get(2 * r + 1)
        for arm in ARMS:
            pol = CachePolicy(n_layer, n_expert, n_slots, cfg)
            visible = np.zeros((n_layer, n_expert), bool)
            if prev:  # an earlier request: its prompt, then its decode admits as usual
                _prompt(pol, prev_p, a.ub)
                _decode(pol, visible, prev_d[:, :prev], None)
            _prompt(pol, prompt, a.ub)
            out[arm].warm_uploads += _warm(pol, visible, arm)
            _decode(pol, visible, decode, out[arm])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routing", default="qwen3-moe,low-locality,uniform", help="comma list: presets or .npz traces")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--slots", default="0.25,0.5", help="fractions of the experts, per layer on average")
    ap.add_argument("-p", type=int, default=4096, help="prompt tokens")
    ap.add_argument("-n", type=int, default=256, help="decode tokens after the prompt")
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("--prev-decode", default="0,256", help="comma list: decode tokens of the request before "
                    "(0: a fresh process, empty slots)")
    ap.add_argument("--requests", type=int, default=4, help="requests averaged")
    ap.add_argument("--window", type=int, default=64)
    a = ap.parse_args(argv)
    cfg = PolicyConfig(window=a.window)
    print(f"-p {a.p} -ub {a.ub} -n {a.n}, {a.requests} requests each; policy {cfg}")
    print("| routing | slots | before the prompt | arm | hit rate, first 64 | hit rate, all | uploads/token "
          "| uploads at the prompt's end | modelled µs/token |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    prevs = [int(x) for x in a.prev_decode.split(",")]
    for name in a.routing.split(","):
        for frac in (float(x) for x in a.slots.split(",")):
            for prev in prevs:
                res = run(name, frac, prev, a)
                for arm, s in res.items():
                    misses = s.total - s.hits
                    us = 1e6 * (s.hits * cfg.t_gpu + misses * cfg.t_cpu
                                + (s.uploads + s.warm_uploads) * cfg.t_upload) / max(1, s.decode_tokens)
                    label = Path(name).name if name.endswith(".npz") else name
                    before = "fresh (empty slots)" if prev == 0 else f"after {prev} decode tokens"
                    print(f"| {label} | {frac:g} | {before} | {arm} | {100 * s.hits64 / max(1, s.total64):.1f}% "
                          f"| {100 * s.hits / max(1, s.total):.1f}% | {s.uploads / max(1, s.decode_tokens):.2f} "
                          f"| {s.warm_uploads / a.requests:.0f} | {us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
