"""The decoder-only transformer every architecture file builds on.

:class:`DecoderLM` owns what all supported architectures share: token embedding, the stack of
blocks, the final norm and the output head, the KV cache bookkeeping, and the building blocks a
block is made of (attention with RoPE, dense gated FFN, MoE routing and expert execution). An
architecture file (``moecache/models/<arch>.py``) subclasses it and writes :meth:`DecoderLM.block`
from those pieces, plus its own router where it differs. All array work goes through the backend
(:mod:`moecache.backends`), so the same code runs on numpy and CuPy.

Formulas follow llama.cpp's graphs (``src/models/<arch>.cpp``, ``llm_graph_context::build_norm,
build_ffn, build_moe_ffn, build_attn``) and the papers named at each method.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from moecache.arch import ModelConfig
from moecache.backends.contract import ArrayBackend
from moecache.errors import MoecacheError
from moecache.gguf_file import GGUFModel
from moecache.kv_cache import KVCache, KVShape
from moecache.moe.executor import CPUExperts, ExpertExecutor, ExpertWeights
from moecache.moe.routing import Routing

RouteObserver = Callable[[int, Routing], None]


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer: ``angle(pos, i) = pos * freq_scale * base^(-2i / n_rot) / factor[i]``.

    Attributes:
        n_rot: rotated dims per head (``rope.dimension_count``).
        base: ``rope.freq_base``.
        freq_scale: 1 / ``rope.scaling.factor`` for linear scaling, else 1.
        neox: GPT-NeoX pairing (see :meth:`NumpyBackend.rope`).
        factors: float32 (n_rot/2,) llama3 ``rope_freqs.weight`` or None.
    """

    n_rot: int
    base: float
    freq_scale: float
    neox: bool
    factors: np.ndarray | None = None

    def inv_freq(self) -> np.ndarray:
        """float64 (n_rot/2,): ``freq_scale * base^(-2i / n_rot) / factor[i]``, the angle per position."""
        inv = self.base ** (-np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot)
        if self.factors is not None:
            inv = inv / self.factors.astype(np.float64)
        return self.freq_scale * inv


@dataclass(frozen=True)
class Pending:
    """The residual stream as a sum not yet taken, ``h + d`` (both float32 (T, n_embd)), as a block
    returns it: the next block's first RMSNorm takes the sum with it (:meth:`DecoderLM.enter`: one
    launch on the GPU instead of an add and a norm)."""

    h: Any
    d: Any


@dataclass(frozen=True)
class Half:
    """One half of a batched decode step run in two halves (:meth:`DecoderLM.halves_for`): its
    ``index`` (0 or 1), its first row ``start`` in the pass of ``n`` tokens, and ``routed``, the
    routing process's choices of the pass per layer (``--routing``: drawn once for all ``n`` rows,
    shared by both halves)."""

    index: int
    start: int
    n: int
    routed: dict = field(default_factory=dict)


@dataclass
class ForwardPass:
    """What one forward pass shares between its layers, passed down to every block (the model keeps
    only the backend of the layer being run, ``be``, switched as the pass moves between devices).

    Attributes:
        pos: int (T,) host positions of the pass's tokens.
        pos_inputs: ``id(backend)`` -> that backend's int32 (T,) positions (uploaded once per
            backend; a CUDA graph passes its own persistent buffers).
        rope: (backend id, n_rot, base, freq_scale) -> that RoPE's cos/sin tables of this pass.
        seqs: several sequences in one pass (a batched decode step, or several sequences' prompt
            chunks: :meth:`DecoderLM.forward_parts`): per sequence, its tokens'
            rows ``(start, stop)`` and its :class:`KVCache`; empty = every token belongs to the
            one cache the blocks are given.
        shared: a batched step whose sequences are slices of one cache (:meth:`KVCache.slice`,
            one token each): that cache, each token's first row in it (int (T,), host) and the
            rows of each sequence; attention then runs once for all of them, reading each
            token's own rows. None otherwise.
        base_inputs: ``id(backend)`` -> that backend's int32 (T,) copy of ``shared``'s rows.
        part: the half of a pass run in halves this pass is (its rows only), else None.
    """

    pos: np.ndarray
    pos_inputs: dict[int, Any] = field(default_factory=dict)
    rope: dict[tuple, tuple[Any, Any]] = field(default_factory=dict)
    seqs: tuple[tuple[int, int, KVCache], ...] = ()
    shared: tuple[KVCache, np.ndarray, int] | None = None
    base_inputs: dict[int, Any] = field(default_factory=dict)
    part: Half | None = None


def shared_cache(kvs: list[KVCache]) -> tuple[KVCache, np.ndarray, int] | None:
    """:attr:`ForwardPass.shared` of a batched step, one token per cache: when every cache is a
    slice of the same whole cache and all have the same size, (that cache, each one's first row,
    the size); else None (attention then runs sequence by sequence)."""
    whole = kvs[0].parent
    if whole is None or any(k.parent is not whole or k.n_ctx != kvs[0].n_ctx for k in kvs):
        return None
    return whole, np.array([k.offset for k in kvs], np.int64), kvs[0].n_ctx


def check_parts(parts: list[Any], kvs: list[KVCache], n_vocab: int, what: str) -> list[np.ndarray]:
    """Several sequences' tokens for one call (``what`` names it in the errors): ``parts`` as int64
    (T_i,) arrays, after checking that there is one distinct cache per part, no part is empty, every
    id is in [0, ``n_vocab``) and every part fits its cache.

    Raises:
        ValueError: a count mismatch, an empty part, a cache given twice or an id outside the
            vocabulary.
        ContextFullError: a part does not fit its cache.
    """
    toks = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
    if len(toks) != len(kvs) or not toks:
        raise ValueError(f"{what}: {len(toks)} parts for {len(kvs)} sequences")
    if any(t.size == 0 for t in toks):
        raise ValueError(f"{what}: an empty part")
    if len({id(k) for k in kvs}) != len(kvs):
        raise ValueError(f"{what}: a sequence's cache is given twice")
    every = np.concatenate(toks)
    if every.min() < 0 or every.max() >= n_vocab:
        bad = every[(every < 0) | (every >= n_vocab)][0]
        raise ValueError(f"token id {bad} outside the vocabulary [0, {n_vocab})")
    for t, k in zip(toks, kvs):
        k.check_room(t.size)
    return toks


def expert_weights(model: GGUFModel, act: str) -> dict[int, ExpertWeights]:
    """The routed experts of every MoE layer as host views of the file (no copy), keyed by layer:
    what an expert executor is built from (before or without the model object)."""
    out = {}
    for il in range(model.config.n_layer):
        names = [f"blk.{il}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        if names[0] in model.tensors:
            g, u, d = (model.tensors[n] for n in names)
            out[il] = ExpertWeights(g.data, u.data, d.data, (g.ggml_type, u.ggml_type, d.ggml_type), act)
    return out


class DecoderLM:
    """A decoder-only LM over one GGUF file.

    Args:
        model: the opened GGUF (config and tensor views; weights stay memory-mapped).
        backend: array operations (:class:`moecache.backends.NumpyBackend` on the CPU): every
            layer's unless ``layer_backends`` says otherwise.
        experts: executor of the routed experts; None = :class:`CPUExperts` over the file's
            expert tensors (on each layer's backend).
        layer_backends: per layer, the backend holding its weights and KV cache (partial GPU
            offload, several GPUs); the hidden state moves between backends where they change.
            Token embeddings live on layer 0's backend.
        output_backend: backend of the output norm and matrix; default ``backend``.
        pass_hooks: objects told of every forward pass (``begin_pass``, ``launched``, ``end_pass``,
            and ``abort_pass`` instead of the last two when an exception, Ctrl-C included, cuts
            the pass short): the expert caches.
        routing_override: a routing process replacing the router's choice (``--routing``); also a
            settable attribute (the library sets it after the engine is built, benchmarks swap it,
            and a CUDA-graph capture replaces it while it records).

    Attributes:
        cfg: the :class:`ModelConfig`.
        layers: per block, a dict from the GGUF tensor name without ``blk.N.`` and ``.weight``
            (``"attn_q"``, ``"attn_q.bias"``, ``"ffn_gate_exps"``, ...) to the backend weight.
        route_observers: callables ``(il, routing)`` told every MoE layer's routing (usage
            statistics of the expert cache, tests).

    Class attributes an architecture sets: ``act`` (FFN activation), ``renorm_topk`` (divide the
    top-k weights by their sum), ``attn_softcap`` / ``final_softcap`` (apply the GGUF's
    ``attn_logit_softcapping`` / ``final_logit_softcapping``; llama.cpp reads them per architecture),
    ``moe_out_last`` (True: its blocks return the routed experts' output as the :class:`Pending`
    sum's ``d`` with no arithmetic on it, so a batched step may run in halves, :meth:`halves_for`,
    whose CPU share is added into that output later; False by default, as a block that computed
    with the output before that would be wrong).
    """

    arch: ClassVar[str] = ""
    act: ClassVar[str] = "silu"  # gated-FFN activation: "silu" (SwiGLU) or "gelu" (GeGLU)
    renorm_topk: ClassVar[bool] = True
    attn_softcap: ClassVar[bool] = False
    final_softcap: ClassVar[bool] = False
    moe_out_last: ClassVar[bool] = False

    def __init__(self, model: GGUFModel, backend: ArrayBackend, experts: ExpertExecutor | None = None,
                 layer_backends: list[ArrayBackend] | None = None, output_backend: ArrayBackend | None = None,
                 *, pass_hooks: Any = (), routing_override: Any = None):
        self.cfg: ModelConfig = model.config
        self.gguf = model
        c = self.cfg
        if c.rope_scaling_type not in (None, "none", "linear"):
            raise MoecacheError(f"{c.arch}: rope scaling type '{c.rope_scaling_type}' is not supported yet "
                                f"(supported: none, linear)")
        self.layer_be = list(layer_backends) if layer_backends is not None else [backend] * c.n_layer
        if len(self.layer_be) != c.n_layer:
            raise ValueError(f"layer_backends: {len(self.layer_be)} backends for {c.n_layer} layers")
        self.output_be = output_backend if output_backend is not None else backend
        self.be = self.layer_be[0]  # the backend of the layer being run (forward switches it)
        t = model.tensors
        self.token_embd = self.layer_be[0].linear(t["token_embd.weight"])
        ob = self.output_be
        self.output_norm = ob.vector(t["output_norm.weight"])
        if "output.weight" in t:
            self.output = ob.linear(t["output.weight"])
        else:  # tied embeddings: share the upload when input and output are on the same backend
            self.output = self.token_embd if ob is self.layer_be[0] else ob.linear(t["token_embd.weight"])
        self.layers: list[dict[str, Any]] = []
        for il in range(c.n_layer):
            pre = f"blk.{il}."
            be = self.layer_be[il]
            d: dict[str, Any] = {}
            for name, tv in t.items():
                if name.startswith(pre):
                    key = name[len(pre):].removesuffix(".weight")
                    if key.endswith("_exps"):
                        continue  # routed experts stay in host memory, owned by the executor
                    d[key] = be.vector(tv) if len(tv.shape) == 1 else be.linear(tv)
            self.layers.append(d)
        factors = t.get("rope_freqs.weight")
        self.rope_factors = self._cpu_vector(factors) if factors is not None else None
        if experts is None:
            from moecache.moe.executor import ExpertsByLayer
            ew = expert_weights(model, self.act)
            experts = ExpertsByLayer({il: CPUExperts({il: e}, self.layer_be[il]) for il, e in ew.items()})
        self.experts = experts
        # a moecache.backends.cuda_graph.DecodeGraph replaying decode steps: it is made from the built
        # model, so it is attached after construction (Engine._decode_graph)
        self.decode_graph: Any = None
        self.routing_override: Any = routing_override  # benchmarks: a routing process replacing the router's choice
        self.route_observers: list[RouteObserver] = []
        # told of every forward pass: begin_pass(n_tokens) before it is queued, launched() once it is
        # (the device may still be running it), end_pass() after its output reached the host,
        # abort_pass() when an exception cut it short (the expert caches, moecache.moe.cache)
        self.pass_hooks: list[Any] = list(pass_hooks)

    @staticmethod
    def _cpu_vector(t: Any) -> np.ndarray:
        from moecache.backends import NumpyBackend
        return NumpyBackend().vector(t)

    # ---- the pieces an architecture file may override ------------------------------------------
    def block(self, il: int, x: Any, fp: ForwardPass, kv: KVCache) -> Any:
        """One transformer block of the pass ``fp``: the residual stream float32 (T, n_embd), or the
        previous block's :class:`Pending` sum, -> the next one (an array or a :class:`Pending`; a
        block starts with :meth:`enter`). Subclasses write it."""
        raise NotImplementedError

    def embed_scale(self) -> float | None:
        """Factor applied to the token embeddings (gemma: sqrt(n_embd)); None = none."""
        return None

    def rope_spec(self, il: int) -> RopeSpec:
        """RoPE of layer ``il`` (the config's; gemma3 overrides it for sliding-window layers)."""
        c = self.cfg
        scale = 1.0 / c.rope_scaling_factor if c.rope_scaling_type == "linear" and c.rope_scaling_factor else 1.0
        return RopeSpec(c.rope_dim, c.rope_freq_base, scale, c.rope_type == "neox", self.rope_factors)

    def window(self, il: int) -> int | None:
        """Sliding-window size of layer ``il`` (None: full causal attention)."""
        return None

    # ---- forward ---------------------------------------------------------------------------------
    def new_kv_cache(self, n_ctx: int, dtype: Any = np.float32) -> KVCache:
        """An empty KV cache of ``n_ctx`` positions on the backends, elements of ``dtype`` (float32, or
        float16: half the memory, values rounded as llama.cpp's default f16 cache rounds them)."""
        c = self.cfg
        return KVCache(KVShape(c.n_layer, n_ctx, c.n_head_kv, c.head_dim, c.head_dim_v), dtype=dtype,
                       zeros=lambda il, shape: self.layer_be[il].zeros(shape, dtype))

    def forward(self, tokens: np.ndarray, kv: KVCache, logits: str | np.ndarray = "last") -> np.ndarray:
        """Run T tokens at positions ``kv.n_past ..`` and append them to the cache.

        Args:
            tokens: int (T,) token ids, T >= 1.
            kv: the sequence's cache; ContextFullError (before any change) if T tokens don't fit.
            logits: "last" (the last token's), "all", or an int array of row indices into the T tokens.

        Returns:
            float32 host array (n_rows, n_vocab).

        Raises:
            ValueError: empty input or a token id outside the vocabulary.
        """
        c = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("forward: no tokens")
        if tokens.min() < 0 or tokens.max() >= c.n_vocab:
            bad = tokens[(tokens < 0) | (tokens >= c.n_vocab)][0]
            raise ValueError(f"token id {bad} outside the vocabulary [0, {c.n_vocab})")
        kv.check_room(tokens.size)
        pos = np.arange(kv.n_past, kv.n_past + tokens.size)
        last_only = (logits == "last") if isinstance(logits, str) else np.array_equal(logits, [tokens.size - 1])
        if isinstance(logits, str) and logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last', 'all' or an index array, got {logits!r}")
        if tokens.size == 1:
            self._note_decode(1)
        if self.decode_graph is not None and tokens.size == 1 and last_only:
            out = self.decode_graph.run(self, tokens, pos, kv)  # calls the pass hooks itself
            if out is not None:
                kv.advance(1)
                return out
        with self.hooked_pass(tokens.size):
            x = self.body(tokens, pos, kv, {})
            kv.advance(tokens.size)
            if isinstance(logits, str):
                if logits == "last":
                    x = x[-1:]
            else:
                idx = np.asarray(logits, dtype=np.int64)
                x = x[idx]
            y = self.head(x) if x.shape[0] else None
            for hk in self.pass_hooks:
                hk.launched()
            out = self.be.to_host(y) if y is not None else np.empty((0, c.n_vocab), np.float32)
        return out

    def _note_decode(self, n_seqs: int) -> None:
        """Tell the pass hooks that have ``note_decode`` (the expert caches) that the next pass is a
        decode step of ``n_seqs`` sequences, one token each (a prompt's ubatch of 2 or more tokens is
        not; one of a single token is counted as one, a pass of one token either way)."""
        for hk in self.pass_hooks:
            note = getattr(hk, "note_decode", None)
            if note is not None:
                note(n_seqs)

    @contextlib.contextmanager
    def hooked_pass(self, n_tokens: int) -> Iterator[None]:
        """One forward pass of ``n_tokens`` as the pass hooks are told of it: ``begin_pass`` on
        entry, ``end_pass`` on a normal exit, ``abort_pass`` instead when an exception (Ctrl-C
        included) leaves it; the body calls ``launched`` itself, once the pass is queued."""
        for hk in self.pass_hooks:
            hk.begin_pass(n_tokens)
        try:
            yield
        except BaseException:
            for hk in self.pass_hooks:
                hk.abort_pass()
            raise
        for hk in self.pass_hooks:
            hk.end_pass()

    def forward_seqs(self, tokens: np.ndarray, kvs: list[KVCache]) -> np.ndarray:
        """One decode step of several sequences in one pass: token ``i`` is appended to ``kvs[i]``
        at its position ``kvs[i].n_past`` (continuous batching: the matrix products and the routed
        experts run once for all of them; attention reads each sequence's own cache).

        Args:
            tokens: int (N,) one token id per sequence.
            kvs: N distinct caches.

        Returns:
            float32 host array (N, n_vocab): each token's logits.

        Raises:
            ValueError: a count mismatch, a cache given twice or an id outside the vocabulary.
            ContextFullError: a sequence is full (before any change).
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size != len(kvs) or tokens.size == 0:
            raise ValueError(f"forward_seqs: {tokens.size} tokens for {len(kvs)} sequences")
        check_parts(tokens.reshape(-1, 1), kvs, self.cfg.n_vocab, "forward_seqs")  # a part of one token each
        self._note_decode(tokens.size)
        if self.decode_graph is not None:
            out = self.decode_graph.run_seqs(self, tokens, kvs)  # calls the pass hooks itself
            if out is not None:
                for k in kvs:
                    k.advance(1)
                return out
        pos = np.array([k.n_past for k in kvs], np.int64)
        with self.hooked_pass(tokens.size):
            x = self.body(tokens, pos, None, {}, seqs=tuple((i, i + 1, k) for i, k in enumerate(kvs)),
                          shared=shared_cache(kvs))
            for k in kvs:
                k.advance(1)
            y = self.head(x)
            for hk in self.pass_hooks:
                hk.launched()
            out = self.be.to_host(y)
        return out

    def forward_parts(self, parts: list[np.ndarray], kvs: list[KVCache]) -> np.ndarray:
        """Prompt chunks of several sequences in one pass: part ``i`` (T_i tokens) is appended to
        ``kvs[i]`` at positions ``kvs[i].n_past ..`` (serve's slots: the matrix products and the
        routed experts run once for every part's tokens, the expert cache sees one prompt pass of
        sum(T_i) tokens; attention runs sequence by sequence, each part over its own cache).

        Args:
            parts: int (T_i,) token ids per sequence, each T_i >= 1.
            kvs: one distinct cache per part.

        Returns:
            float32 host array (N, n_vocab): the logits of each part's last token.

        Raises:
            ValueError: a count mismatch, an empty part, a cache given twice or an id outside the
                vocabulary.
            ContextFullError: a part does not fit its cache (before any change).
        """
        parts = check_parts(parts, kvs, self.cfg.n_vocab, "forward_parts")
        tokens = np.concatenate(parts)
        ends = np.cumsum([p.size for p in parts])
        seqs = tuple((int(e - p.size), int(e), k) for p, e, k in zip(parts, ends, kvs))
        pos = np.concatenate([np.arange(k.n_past, k.n_past + p.size) for p, k in zip(parts, kvs)])
        with self.hooked_pass(tokens.size):
            x = self.body(tokens, pos, None, {}, seqs=seqs)
            for p, k in zip(parts, kvs):
                k.advance(p.size)
            y = self.head(x[ends - 1])
            for hk in self.pass_hooks:
                hk.launched()
            out = self.be.to_host(y)
        return out

    def body(self, tokens: Any, pos: np.ndarray, kv: KVCache | None, pos_inputs: dict[int, Any],
             seqs: tuple[tuple[int, int, KVCache], ...] = (),
             shared: tuple[KVCache, np.ndarray, int] | None = None, base_inputs: dict[int, Any] | None = None) -> Any:
        """Embedding and every block: int (T,) tokens (host, or on layer 0's backend) at host positions
        ``pos`` -> hidden states float32 (T, n_embd) on the output backend, KV cache written.
        ``pos_inputs`` maps ``id(backend)`` to that backend's positions array; missing ones are
        uploaded once (a CUDA graph passes its own persistent buffers). ``seqs``: the tokens of
        several sequences (:attr:`ForwardPass.seqs`; ``kv`` is None then), ``shared`` and
        ``base_inputs`` as :class:`ForwardPass` has them."""
        if shared is not None and self.halves_for(len(pos)):
            return self._body_halves(tokens, pos, pos_inputs, shared, {} if base_inputs is None else base_inputs)
        fp = ForwardPass(pos, pos_inputs, seqs=seqs, shared=shared, base_inputs={} if base_inputs is None else base_inputs)
        x = self._embed(tokens)
        for il in range(self.cfg.n_layer):
            if self.layer_be[il] is not self.be:
                x = self.settled(x)
                self._use(self.layer_be[il])
                x = self.be.adopt(x)
            x = self.block(il, x, fp, kv)
        x = self.settled(x)
        if self.output_be is not self.be:
            self._use(self.output_be)
            x = self.be.adopt(x)
        return x

    def _embed(self, tokens: Any) -> Any:
        """The token embeddings of ``tokens`` on layer 0's backend (made current), scaled where the
        architecture scales them: float32 (T, n_embd)."""
        self._use(self.layer_be[0])
        x = self.be.embed(self.token_embd, tokens)
        s = self.embed_scale()
        return x * np.float32(s) if s is not None else x

    def halves_for(self, n_seqs: int) -> bool:
        """Whether a batched decode step of ``n_seqs`` sequences (slices of one cache, one token
        each) runs in two halves (:meth:`_body_halves`): when the routed experts' executor asks for
        it (``halves(n)``: the expert cache with the miss split), the architecture's blocks allow it
        (``moe_out_last``), every layer is on one backend and no route observer listens (each would
        hear a layer twice). A captured graph records the answer it was captured with
        (:mod:`moecache.backends.cuda_graph`)."""
        ask = getattr(self.experts, "halves", None)
        return (ask is not None and self.moe_out_last and not self.route_observers and ask(n_seqs)
                and all(b is self.output_be for b in self.layer_be))

    def _body_halves(self, tokens: Any, pos: np.ndarray, pos_inputs: dict[int, Any],
                     shared: tuple[KVCache, np.ndarray, int], base_inputs: dict[int, Any]) -> Any:
        """:meth:`body` of a batched step in two halves of its rows, interleaved block by block so
        that the host computes one half's share of the misses while the GPU runs the other half:
        per layer, half 0's block (attention, router, the post of its CPU pairs, its GPU pairs),
        then half 1's; the wait for a half's CPU answer (the executor's ``settle``) is queued just
        before that half's next block reads it. In lockstep (one pass of all rows) the CPU waited
        for the layer's attention and the GPU for the CPU's answer, each idle a third of the step
        (8 tokens, 8 GiB, H200: ``bench/decode_profile.py --host-times``, bench/results/serve-h200.md).
        Each token goes through the same operations as in one pass, on fewer rows (the CPU twin's
        logits differ by a few 1e-6: kernels that split their work by the rows' count); the
        routing process's draw of the pass is shared by the halves (:class:`Half`). A pass that
        runs op by op on the GPU (no capture) runs in halves too, without the CPU's share (the
        split happens inside captured graphs only): twice the launches for nothing, where batch
        graphs are off. Opt-in (``CachedExperts.decode_halves``): on
        the H200 machine it gained nothing at 8 tokens, each half paying the CPU kernel's fixed cost
        per call (bench/results/serve-h200.md, thirty-fifth session)."""
        t = len(pos)
        m = (t + 1) // 2
        whole, base, n_ctx = shared
        routed: dict = {}
        fps = [ForwardPass(pos[a:b], {k: v[a:b] for k, v in pos_inputs.items()}, shared=(whole, base[a:b], n_ctx),
                           base_inputs={k: v[a:b] for k, v in base_inputs.items()}, part=Half(i, a, t, routed))
               for i, (a, b) in enumerate(((0, m), (m, t)))]
        x = self._embed(tokens)
        xs: list[Any] = [x[:m], x[m:]]
        settle = self.experts.settle
        for il in range(self.cfg.n_layer):
            for i in (0, 1):
                settle(i)  # the wait for this half's CPU answer of the layer before
                xs[i] = self.block(il, xs[i], fps[i], None)
        for i in (0, 1):
            settle(i)
        return self.be.xp.concatenate([self.settled(xs[0]), self.settled(xs[1])])

    def positions(self, fp: ForwardPass) -> Any:
        """The pass's positions on the current backend, int32 (T,) (uploaded once per backend)."""
        return self._on_backend(fp.pos_inputs, fp.pos)

    def kv_bases(self, fp: ForwardPass) -> Any:
        """The pass's per-token first KV rows (``fp.shared``) on the current backend, int32 (T,)
        (uploaded once per backend)."""
        return self._on_backend(fp.base_inputs, fp.shared[1])

    def _on_backend(self, uploaded: dict[int, Any], host: np.ndarray) -> Any:
        """``host`` ints as the current backend's int32 array, kept in ``uploaded`` by backend."""
        a = uploaded.get(id(self.be))
        if a is None:
            a = uploaded[id(self.be)] = self.be.positions(host)
        return a

    def _use(self, be: Any) -> None:
        """Run what follows on ``be`` (its device made current)."""
        self.be = be
        be.activate()

    def head(self, x: Any) -> Any:
        """Final norm and output projection (with final logit soft-capping if the model has it)."""
        x = self.be.rms_norm(x, self.output_norm, self.cfg.norm_eps)
        y = self.be.matmul(self.output, x)
        cap = self.cfg.final_logit_softcapping if self.final_softcap else None
        if cap:
            y = np.float32(cap) * self.be.xp.tanh(y / np.float32(cap))
        return y

    # ---- building blocks ---------------------------------------------------------------------------
    @staticmethod
    def settled(x: Any) -> Any:
        """The residual stream as an array: a :class:`Pending` sum taken (``h + d``), else x."""
        return x.h + x.d if isinstance(x, Pending) else x

    def enter(self, x: Any, w: Any) -> tuple[Any, Any]:
        """A block's start: (the residual stream as an array, its RMSNorm with weight ``w``). A
        :class:`Pending` sum from the previous block is taken in the same launch as the norm
        (:meth:`add_norm`; the CPU twin's arithmetic is the same: ``h + d``, then the norm)."""
        if isinstance(x, Pending):
            return self.add_norm(x.h, x.d, w)
        return x, self.norm(x, w)

    def norm(self, x: Any, w: Any) -> Any:
        """RMSNorm with the model's epsilon."""
        return self.be.rms_norm(x, w, self.cfg.norm_eps)

    def add_norm(self, x: Any, r: Any, w: Any) -> tuple[Any, Any]:
        """The residual sum ``h = x + r`` and its RMSNorm ``norm(h, w)``: (h, normed), both float32
        (T, n_embd) (one launch on the GPU)."""
        return self.be.add_rms_norm(x, r, w, self.cfg.norm_eps)

    def attention(self, il: int, x: Any, fp: ForwardPass, kv: KVCache, *, qk_norm: str | None = None,
                  scale: float | None = None) -> Any:
        """Self-attention of block ``il`` on the normed input; returns the ``attn_output`` projection.

        Args:
            x: float32 (T, n_embd), already normed.
            qk_norm: None, ``"head"`` (RMSNorm per head: qwen3, gemma3) or ``"full"`` (over the whole
                projection before the head split: olmoe).
            scale: score scale, default ``1/sqrt(head_dim)``.

        Projection biases (``attn_q.bias``, ..., ``attn_output.bias``) are added when present.
        """
        c, be, L = self.cfg, self.be, self.layers[il]
        t = x.shape[0]
        q, k, v = self._projs(L, ("attn_q", "attn_k", "attn_v"), x)
        if qk_norm == "full":
            q = self.norm(q, L["attn_q_norm"])
            k = self.norm(k, L["attn_k_norm"])
        q = q.reshape(t, c.n_head, c.head_dim)
        k = k.reshape(t, c.n_head_kv, c.head_dim)
        v = v.reshape(t, c.n_head_kv, c.head_dim_v)
        per_head = qk_norm == "head"
        rope = self.rope_spec(il)
        cos, sin = self._rope_tables(rope, fp)
        p = self.positions(fp)
        qn, kn = (L["attn_q_norm"], L["attn_k_norm"]) if per_head else (None, None)
        scale = scale if scale is not None else 1.0 / math.sqrt(c.head_dim)
        softcap = c.attn_logit_softcapping if self.attn_softcap else None
        if fp.shared is not None:  # a batched step over slices of one cache: one launch each
            whole, _, n_ctx = fp.shared
            kb = self.kv_bases(fp)
            qs = be.qk_rope_store(q, k, v, qn, kn, c.norm_eps, cos, sin, rope.neox, whole.k[il], whole.v[il], p,
                                  kv_base=kb)
            o = be.attention(qs, whole.k[il], whole.v[il], p, scale, window=self.window(il), softcap=softcap,
                             kv_base=kb, n_ctx=n_ctx)
            return self._proj(L, "attn_output", o)
        outs = []
        for a, b, cache in fp.seqs or ((0, t, kv),):  # several sequences: each reads its own cache
            def rows(arr: Any) -> Any:
                return arr if (a, b) == (0, t) else arr[a:b]
            qs = be.qk_rope_store(rows(q), rows(k), rows(v), qn, kn, c.norm_eps, rows(cos), rows(sin), rope.neox,
                                  cache.k[il], cache.v[il], rows(p))
            outs.append(be.attention(qs, cache.k[il], cache.v[il], rows(p), scale, window=self.window(il),
                                     softcap=softcap))
        o = outs[0] if len(outs) == 1 else be.xp.concatenate(outs)
        return self._proj(L, "attn_output", o)

    def _rope_tables(self, rope: RopeSpec, fp: ForwardPass) -> tuple[Any, Any]:
        """cos/sin of ``rope`` at the pass's positions on the backend, computed once per forward pass
        for each distinct RoPE (gemma3 has two; the others one) instead of once per layer."""
        key = (id(self.be), rope.n_rot, rope.base, rope.freq_scale)
        tables = fp.rope.get(key)
        if tables is None:
            tables = fp.rope[key] = self.be.rope_tables(rope.inv_freq(), self.positions(fp))
        return tables

    def _proj(self, L: dict[str, Any], name: str, x: Any) -> Any:
        return self._projs(L, (name,), x)[0]

    def _projs(self, L: dict[str, Any], names: tuple[str, ...], x: Any) -> list[Any]:
        """The projections ``names`` of x (one input: the backend may run them as one launch), each
        with its ``.bias`` added when present."""
        ys = self.be.matmuls([L[n] for n in names], x) if len(names) > 1 else [self.be.matmul(L[names[0]], x)]
        out = []
        for n, y in zip(names, ys):
            b = L.get(n + ".bias")
            out.append(y + b if b is not None else y)
        return out

    def dense_ffn(self, il: int, x: Any, prefix: str = "ffn", suffix: str = "") -> Any:
        """Gated FFN ``down(act(gate(x)) * up(x))`` (Shazeer 2020) of ``{prefix}_gate{suffix}`` etc."""
        L, be = self.layers[il], self.be
        g, u = be.matmuls([L[f"{prefix}_gate{suffix}"], L[f"{prefix}_up{suffix}"]], x)
        return be.matmul(L[f"{prefix}_down{suffix}"], be.glu(g, u, self.act))

    def route(self, il: int, x: Any) -> Routing:
        """Top-k softmax routing of the normed input x (T, n_embd) -> ids and weights (T, k), on the
        layer's backend (they stay on the GPU there); ``renorm_topk`` decides renormalising (per
        architecture, as llama.cpp hard-codes it)."""
        return self.be.route(self.layers[il]["ffn_gate_inp"], x, self.cfg.n_expert_used, self.renorm_topk)

    def moe(self, il: int, x: Any, fp: ForwardPass | None = None) -> Any:
        """Routed experts of block ``il`` on the normed input x (T, n_embd) -> (T, n_embd): route,
        tell the observers (host arrays), run the executor. ``fp``: the pass, when it is a half of
        one (:meth:`_body_halves`: the routing process's rows of that half; the executor is told the
        half, and the CPU's share of the output may be added later, by its ``settle``)."""
        part = fp.part if fp is not None else None
        r = self.route(il, x)
        if self.routing_override is not None:  # --routing: the router ran (its cost is real); its choice is replaced
            if part is None:
                r = self.routing_override.route(il, x.shape[0])
            else:  # one draw of the whole pass per layer, each half its rows
                whole = part.routed.get(il)
                if whole is None:
                    whole = part.routed[il] = self.routing_override.route(il, part.n)
                a, b = part.start, part.start + x.shape[0]
                r = Routing(whole.ids[a:b], whole.weights[a:b])
        for obs in self.route_observers:
            obs(il, r.host())
        return self.experts(il, x, r) if part is None else self.experts(il, x, r, part=part)
