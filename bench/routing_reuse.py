"""Short-range reuse of the routing presets: what share of a decode token's experts the last d tokens
already used, per layer (issue 19's low-locality gap; runs on the CPU, no model needed).

The layer plan (``--cache-plan layer``) plans on usage averaged over ``--moe-cache-window`` tokens;
a preset whose locality is short-range (``low-locality``: an AR(1) drift with rho 0.7, no static
popularity, ``../shared/routing.md``) looks nearly flat there. This counts the reuse such a plan
does not see: for each d, the experts of layer l that tokens t-d..t-1 used (the "held" set, its
mean size per layer) and the share of token t's (layer, expert) pairs among them. At uniform
routing the share is the held set's size over the experts per layer (chance).

    python bench/routing_reuse.py --tokens 400
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def draw(preset: str, n_layer: int, n_expert: int, k: int, tokens: int, seed: int = 0) -> np.ndarray:
    """The preset's decode routing: ids int32 (tokens, n_layer, k), one token per pass."""
    from moecache.moe.routing_process import make_routing

    rp = make_routing(preset, n_layer, n_expert, k, seed=seed)
    out = np.empty((tokens, n_layer, k), np.int32)
    for t in range(tokens):
        for il in range(n_layer):
            out[t, il] = rp.route(il, 1).ids[0]
    return out


def reuse(ids: np.ndarray, n_expert: int, depth: int) -> tuple[float, float]:
    """(share of each token's pairs that the ``depth`` tokens before it used in the same layer, mean
    size of that set per layer) over the tokens that have ``depth`` tokens before them."""
    t_n, n_layer, _ = ids.shape
    used = np.zeros((t_n, n_layer, n_expert), bool)
    np.put_along_axis(used, ids.astype(np.int64), True, axis=2)
    held = np.zeros_like(used)
    for j in range(1, depth + 1):
        held[j:] |= used[:-j]
    held, now = held[depth:], used[depth:]
    return float((held & now).sum() / now.sum()), float(held.sum(axis=2).mean())


def main(argv: list[str] | None = None) -> None:
    if str(ROOT) not in sys.path:  # run as a script from a checkout
        sys.path.insert(0, str(ROOT))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="low-locality,uniform,qwen3-moe")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--depths", default="1,2,4,8")
    a = ap.parse_args(argv)
    depths = [int(d) for d in a.depths.split(",")]
    print("| preset | " + " | ".join(f"last {d} token(s): share (held per layer)" for d in depths) + " |")
    print("| --- |" + " ---: |" * len(depths))
    for name in a.presets.split(","):
        ids = draw(name, a.layers, a.experts, a.k, a.tokens)
        cells = [f"{s:.1%} ({h:.1f})" for s, h in (reuse(ids, a.experts, d) for d in depths)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
