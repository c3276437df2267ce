"""Routing processes for benchmarks: realistic expert choices for models whose routers are random.

Our large benchmark models have random weights; their routers route near-uniformly and say nothing
about how a real model's routing uses a cache. A routing process replaces the router's choice
(the router still runs: its cost is real) with ids drawn from the parametric process of
``../shared/routing.md``, calibrated to published measurements of real MoE models. For layer l and
token t, the top-k of

    logit[e] = s * z_l[e] + tau * w_l[e] + g * x_{l,t}[e] + Gumbel(0, 1)

with ``z_l ~ N(0, 1)`` the static popularity of the layer's experts, ``w_l = sqrt(1 - lam) * u_topic
+ sqrt(lam) * v_prompt`` the prompt's hot set, ``x_{l,t} = rho * x_{l,t-1} + sqrt(1 - rho^2) * eps``
an AR(1) drift (short-range reuse); weights = softmax over the chosen logits. A recorded trace
(:class:`TraceRouting`) replays real routing instead.

Text generated under a routing process is meaningless; speed, hit rate and uploads are what it
measures.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import moecache.quants._numba_setup  # noqa: F401,I001 - numba's settings, before numba is imported
from numba import njit, prange

from moecache.moe.routing import Routing
from moecache.threads import one_thread_if_active


@dataclass(frozen=True)
class ProcessParams:
    """Parameters of the routing process (routing.md's table)."""

    s: float
    tau: float
    g: float
    rho: float
    lam: float = 0.6


PRESETS: dict[str, ProcessParams] = {
    "qwen3-moe": ProcessParams(2.0, 2.0, 2.0, 0.7),
    "olmoe": ProcessParams(1.0, 1.0, 2.0, 0.7),
    "low-locality": ProcessParams(0.0, 0.5, 2.0, 0.7),
    "uniform": ProcessParams(0.0, 0.0, 0.0, 0.0),
}


class RoutingProcess:
    """The parametric routing process of one model.

    Args:
        params: a preset's parameters (:data:`PRESETS`).
        n_layer, n_expert, k: the model's shape (presets keep the model's own top-k).
        seed: fixes the model's popularity, the topic, the first prompt and every draw.
    """

    def __init__(self, params: ProcessParams, n_layer: int, n_expert: int, k: int, seed: int = 0):
        if not 0 < k <= n_expert:
            raise ValueError(f"top-k {k} must be in 1..{n_expert}")
        self.p = params
        self.n_layer, self.n_expert, self.k = n_layer, n_expert, k
        self.rng = np.random.default_rng(seed)
        self.z = self.rng.standard_normal((n_layer, n_expert))
        self.topic = self.rng.standard_normal((n_layer, n_expert))
        self.x = self.rng.standard_normal((n_layer, n_expert))
        self._cur_ids = self._cur_w = np.zeros((n_layer, 0, k))  # the current pass's choices (L, T, k)
        self._left: set[int] = set()  # layers of the current pass not handed out yet
        self._ahead: tuple[int, Future] | None = None  # (its token count, the next pass drawn early)
        self._worker: ThreadPoolExecutor | None = None  # the draws ahead of multi-token passes (one thread)
        self._before_ahead: dict | None = None  # the generator's state before that draw
        # multi-token passes (prompt ubatches, batched decode steps) draw the next pass of the same size on
        # a worker thread while the caller computes this one (see route); the owner turns it on where the
        # CPU is otherwise idle (the layers on a GPU: moecache.llm)
        self.draw_passes_ahead = False
        self.new_prompt()

    def new_prompt(self) -> None:
        """Draw a new prompt's hot set (``v_prompt``); the topic and popularity stay."""
        self._drop_ahead()  # choices drawn with the old hot set are not handed out
        self._left = set()
        lam = self.p.lam
        v = self.rng.standard_normal((self.n_layer, self.n_expert))
        self.w = math.sqrt(1 - lam) * self.topic + math.sqrt(lam) * v

    def restart(self, seed: int) -> None:
        """A new request drawn from ``seed``: the model's popularity and topic stay, the prompt's hot
        set, the token state and every later draw come from ``seed`` (two processes restarted with
        the same seed route the same tokens, whatever each routed before)."""
        self._drop_ahead()
        self.rng = np.random.default_rng(seed)
        self.x = self.rng.standard_normal((self.n_layer, self.n_expert))
        self.new_prompt()

    def route(self, layer: int, n_tokens: int) -> Routing:
        """The next ``n_tokens`` tokens' choices at ``layer``: ids int32 (T, k) best first, weights
        float32 (T, k) (softmax over the chosen logits).

        The choices of every layer are drawn at once (one vectorized draw per pass: ~0.6 ms for a
        48-layer decode step instead of ~2 ms layer by layer) and handed out layer by layer; asking
        for a layer already handed out, or for another token count, starts the next pass. With
        ``draw_passes_ahead``, a pass of several tokens starts drawing the next pass of as many tokens
        on a worker thread (the numpy fills and the compiled pass release the GIL): at layer 0 of
        every prompt ubatch the GPU had stood idle 193 ms (torch profiler, run h200-s14a,
        bench/results/prompt-timeline-h200.md) while the host drew a 512-token pass of a 48-layer,
        128-expert model (65 ms when timed alone there). A pass of another size, :meth:`new_prompt`
        or :meth:`restart` waits for that draw and rewinds the generator, so every pass gets the
        choices it would get without drawing ahead."""
        if layer not in self._left or self._cur_ids.shape[1] != n_tokens:
            self._start_pass(n_tokens)
        self._left.discard(layer)
        return Routing(self._cur_ids[layer], self._cur_w[layer])

    def next_token(self) -> tuple[np.ndarray, np.ndarray]:
        """A whole decode pass at once: ids int32 and weights float32 (n_layer, 1, k), the same
        choices as ``route(il, 1)`` for every layer in turn would give."""
        self._start_pass(1)
        self._left = set()
        return self._cur_ids, self._cur_w

    def draw_ahead(self, n_tokens: int = 1) -> None:
        """Draw the next pass of ``n_tokens`` now, on this thread (a CUDA-graph decode calls this for
        one token while the device runs the current pass; ``moecache bench`` for a prompt's first
        ubatch before it starts the clock, as llama-bench's prompts pay no routing emulation). The
        next pass of that size takes it; a pass of another size or :meth:`new_prompt` drops it and
        rewinds the process to before it, so every pass gets the choices it would get without
        drawing ahead. A pass of ``n_tokens`` already drawn ahead is kept (one at most), its draw
        waited for when a worker makes it; one of another size is dropped first.

        Raises:
            ValueError: ``n_tokens`` < 1.
        """
        if n_tokens < 1:
            raise ValueError(f"draw_ahead: n_tokens must be >= 1, got {n_tokens}")
        if self._ahead is not None and self._ahead[0] != n_tokens:
            self._drop_ahead()
        if self._ahead is not None:
            wait_for([self._ahead[1]])  # a worker's draw: done before this returns (its error: when taken)
        self._begin_ahead(n_tokens, background=False)

    def _begin_ahead(self, n_tokens: int, background: bool) -> None:
        """Start drawing the next pass of ``n_tokens`` (on a worker thread if ``background``; the
        generator is the worker's until :meth:`_start_pass` takes the pass or :meth:`_drop_ahead`
        drops it)."""
        if self._ahead is None:
            self._before_ahead = self.rng.bit_generator.state
            if background:
                if self._worker is None:  # its thread is joined at the interpreter's exit (not a daemon)
                    # under active OpenMP waiting, one Numba thread: a team of its own would stop the
                    # main thread's team spinning (moecache.threads.one_thread_if_active)
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="routing-draw",
                                                      initializer=one_thread_if_active)
                fut = self._worker.submit(_draw, self, self.rng, self.x, n_tokens)
            else:  # on this thread: an exception (a KeyboardInterrupt too) propagates at once
                fut = Future()
                fut.set_result(self._draw(n_tokens))
            self._ahead = (n_tokens, fut)

    def _drop_ahead(self) -> None:
        """Discard the pass drawn ahead: wait for its draw, rewind the generator to before it."""
        if self._ahead is not None:
            wait_for([self._ahead[1]])  # its result or error unused
            self.rng.bit_generator.state = self._before_ahead
        self._ahead = self._before_ahead = None

    def _start_pass(self, n_tokens: int) -> None:
        if self._ahead is not None and self._ahead[0] == n_tokens:
            ahead, self._ahead = self._ahead[1], None
            try:
                got = ahead.result()
            except BaseException:  # the draw failed: the generator as before it, the next pass draws anew
                self.rng.bit_generator.state = self._before_ahead
                raise
            finally:
                self._before_ahead = None
        else:
            self._drop_ahead()
            got = self._draw(n_tokens)
        self._cur_ids, self._cur_w, self.x = got
        self._left = set(range(self.n_layer))
        if n_tokens > 1 and self.draw_passes_ahead:
            self._begin_ahead(n_tokens, background=True)

    def _draw(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next ``n_tokens`` tokens of every layer from the process's state: ids int32, weights
        float32 (L, T, k) and the drift after them (L, E); the generator advances, ``self.x`` stays
        (the caller keeps the new drift with the choices it takes)."""
        return _draw(self, self.rng, self.x, n_tokens)


def _draw(rp: RoutingProcess, rng: np.random.Generator, x0: np.ndarray,
          n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The next ``n_tokens`` tokens of every layer of ``rp`` from generator ``rng`` and drift
    ``x0`` (L, E) (left unchanged): ids int32, weights float32 (L, T, k), the drift after them.

    The random numbers come from the process's generator in the order a token-by-token draw
    takes them (each token's drift noise, then the Gumbel noise of every logit as uniform
    doubles, ``Generator.gumbel``'s own source); :func:`_draw_pass` turns them into choices,
    one layer per thread. numpy alone took ~103 ms for a 512-token pass of a 48-layer,
    128-expert model on the 2-core development VM (Gumbel transform 51, drift loop 29,
    partition 16): host time that ``--routing`` prompt runs paid on our side only."""
    p = rp.p
    base = p.s * rp.z + p.tau * rp.w  # (L, E)
    a, b = p.rho, math.sqrt(max(0.0, 1.0 - p.rho * p.rho))
    eps = rng.standard_normal((n_tokens, rp.n_layer, rp.n_expert))
    u = rng.random((rp.n_layer, n_tokens, rp.n_expert))
    x = x0.copy()
    ids = np.empty((rp.n_layer, n_tokens, rp.k), np.int32)
    w = np.empty((rp.n_layer, n_tokens, rp.k), np.float32)
    _draw_pass(base, float(p.g), float(a), float(b), x, eps, u, ids, w)
    return ids, w, x


@njit(parallel=True, cache=True, nogil=True)
def _draw_pass(base, g, a, b, x, eps, u, ids, w):  # pragma: no cover - compiled
    """One pass's choices of every layer, in place: per layer (a thread each) and token t, the drift
    ``x = a * x + b * eps[t]`` (x float64 (L, E), updated to the last token's), the logits
    ``(base + g * x) + G`` with Gumbel noise ``G = -log(-log(1 - u))`` from uniform doubles ``u``
    (L, T, E) (numpy's ``Generator.gumbel`` formula; a u of exactly 0 is taken as 2^-53, the
    generator's smallest nonzero double, where numpy would draw again and shift every later number:
    a chance of about T * L * E / 2^53 per pass), the k largest logits best first (equal
    logits in expert order, as a stable sort), and their softmax: ids int32 and w float32 (L, T, k)."""
    n_layer, n_tok, n_expert = u.shape
    k = ids.shape[2]
    for il in prange(n_layer):
        xl = x[il].copy()
        bv = np.empty(k)
        bi = np.zeros(k, np.int64)
        ex = np.empty(k)
        for t in range(n_tok):
            n = 0
            for e in range(n_expert):
                xl[e] = a * xl[e] + b * eps[t, il, e]
                ue = max(u[il, t, e], 2.0 ** -53)
                v = (base[il, e] + g * xl[e]) + (0.0 - np.log(-np.log(1.0 - ue)))
                if n < k:
                    pos = n
                    n += 1
                elif v > bv[k - 1]:
                    pos = k - 1
                else:
                    continue
                while pos > 0 and bv[pos - 1] < v:
                    bv[pos] = bv[pos - 1]
                    bi[pos] = bi[pos - 1]
                    pos -= 1
                bv[pos] = v
                bi[pos] = e
            s = 0.0
            for j in range(k):
                ex[j] = np.exp(bv[j] - bv[0])
                s += ex[j]
            for j in range(k):
                ids[il, t, j] = bi[j]
                w[il, t, j] = ex[j] / s
        x[il] = xl


class TraceRouting:
    """A recorded routing trace: ``routes`` (n_layer, ..., k) expert ids in token order.

    ``.npz`` files hold ``routes`` (and optionally ``weights`` of the same shape); middle axes are
    flattened into one token axis (``code-moe-tiny.routes.npz``: [layers, windows, tokens, k]).
    Without weights the chosen experts weigh equally. Raises ValueError on a malformed file.
    """

    def __init__(self, path: str | Path):
        try:
            f = np.load(path)
        except Exception as e:  # noqa: BLE001 - a corrupt zip, a pickle, not numpy at all
            why = "a pickle (refused)" if "allow_pickle" in str(e) else str(e)[:200]
            raise ValueError(f"{path}: not a routing trace (.npz with 'routes'): {why}") from None
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise ValueError(f"{path}: not a routing trace (.npz with a 'routes' array)")
        with f:
            if "routes" not in f:
                raise ValueError(f"{path}: no 'routes' array (expected [layer, ..., k] expert ids)")
            routes = np.asarray(f["routes"])
            weights = np.asarray(f["weights"]) if "weights" in f else None
        if routes.ndim < 3:
            raise ValueError(f"{path}: 'routes' must be [layer, tokens..., k], got shape {routes.shape}")
        if routes.size == 0:
            raise ValueError(f"{path}: 'routes' holds no tokens (shape {routes.shape})")
        if routes.dtype.kind not in "iu" or int(routes.min()) < 0 or int(routes.max()) >= 1 << 31:
            raise ValueError(f"{path}: 'routes' must hold expert ids >= 0 (integers below 2**31), got "
                             f"{routes.dtype} from {routes.min()} to {routes.max()}")
        if weights is not None and (weights.shape != routes.shape or not np.isfinite(weights).all()):
            raise ValueError(f"{path}: 'weights' must be finite numbers of the shape of 'routes' {routes.shape}, "
                             f"got shape {weights.shape}")
        self.n_layer, self.k = routes.shape[0], routes.shape[-1]
        self.routes = routes.reshape(self.n_layer, -1, self.k).astype(np.int32)
        self.weights = None if weights is None else weights.reshape(self.routes.shape).astype(np.float32)
        self.n_expert = int(self.routes.max()) + 1
        self.pos = np.zeros(self.n_layer, np.int64)

    @property
    def n_tokens(self) -> int:
        return self.routes.shape[1]

    def route(self, layer: int, n_tokens: int) -> Routing:
        """The trace's next ``n_tokens`` choices at ``layer`` (wrapping around at the end)."""
        idx = (self.pos[layer] + np.arange(n_tokens)) % self.n_tokens
        self.pos[layer] += n_tokens
        ids = self.routes[layer, idx]
        w = self.weights[layer, idx] if self.weights is not None else np.full(ids.shape, 1.0 / self.k, np.float32)
        return Routing(ids, w)


def make_routing(name: str, n_layer: int, n_expert: int, k: int, seed: int = 0) -> RoutingProcess | TraceRouting:
    """``--routing NAME|FILE``: a preset process for this model shape, or a trace file.

    Raises:
        ValueError: an unknown preset and no such file, or a trace that does not fit the model.
    """
    if name in PRESETS:
        return RoutingProcess(PRESETS[name], n_layer, n_expert, k, seed)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--routing {name!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    tr = TraceRouting(path)
    if tr.n_layer < n_layer or tr.n_expert > n_expert or tr.k != k:
        raise ValueError(f"--routing {name}: the trace has {tr.n_layer} layers, {tr.k} experts per token and "
                         f"expert ids up to {tr.n_expert - 1}; the model has {n_layer} layers, {k} experts per token "
                         f"and {n_expert} experts")
    return tr
