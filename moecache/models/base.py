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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from moecache.arch import ModelConfig
from moecache.errors import MoecacheError
from moecache.gguf_file import GGUFModel
from moecache.kv_cache import KVCache, KVShape
from moecache.moe.executor import CPUExperts, ExpertExecutor, ExpertWeights, Routing

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

    def angles(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, float32 (T, n_rot/2), of int positions (T,). Angles in float64, then rounded."""
        inv = self.base ** (-np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot)
        if self.factors is not None:
            inv = inv / self.factors.astype(np.float64)
        a = pos.astype(np.float64)[:, None] * (self.freq_scale * inv)[None, :]
        return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def topk_routing(probs: np.ndarray, k: int, renorm: bool, scale: float | None = None) -> Routing:
    """The k largest of ``probs`` (T, n_expert) per token, their probabilities as weights.

    ``renorm`` divides the k weights by their sum (llama.cpp ``norm_w``; Qwen3-MoE
    ``norm_topk_prob``); ``scale`` multiplies them (``expert_weights_scale``).
    """
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(probs, ids, axis=-1).astype(np.float32)
    if renorm:
        w = w / w.sum(axis=-1, keepdims=True)
    if scale and scale != 1.0:  # 0 means unset, as in llama.cpp
        w = w * np.float32(scale)
    return Routing(ids, w.astype(np.float32))


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
        backend: array operations (:class:`moecache.backends.NumpyBackend` on the CPU).
        experts: executor of the routed experts; None = :class:`CPUExperts` over the file's
            expert tensors.

    Attributes:
        cfg: the :class:`ModelConfig`.
        layers: per block, a dict from the GGUF tensor name without ``blk.N.`` and ``.weight``
            (``"attn_q"``, ``"attn_q.bias"``, ``"ffn_gate_exps"``, ...) to the backend weight.
        route_observers: callables ``(il, routing)`` told every MoE layer's routing (usage
            statistics of the expert cache, tests).

    Class attributes an architecture sets: ``act`` (FFN activation), ``renorm_topk`` (divide the
    top-k weights by their sum), ``attn_softcap`` / ``final_softcap`` (apply the GGUF's
    ``attn_logit_softcapping`` / ``final_logit_softcapping``; llama.cpp reads them per architecture).
    """

    arch: ClassVar[str] = ""
    act: ClassVar[str] = "silu"  # gated-FFN activation: "silu" (SwiGLU) or "gelu" (GeGLU)
    renorm_topk: ClassVar[bool] = True
    attn_softcap: ClassVar[bool] = False
    final_softcap: ClassVar[bool] = False

    def __init__(self, model: GGUFModel, backend: Any, experts: ExpertExecutor | None = None):
        self.cfg: ModelConfig = model.config
        self.be = backend
        self.gguf = model
        c = self.cfg
        if c.rope_scaling_type not in (None, "none", "linear"):
            raise MoecacheError(f"{c.arch}: rope scaling type '{c.rope_scaling_type}' is not supported yet "
                                f"(supported: none, linear)")
        t = model.tensors
        self.token_embd = backend.linear(t["token_embd.weight"])
        self.output_norm = backend.vector(t["output_norm.weight"])
        self.output = backend.linear(t["output.weight"]) if "output.weight" in t else self.token_embd
        self.layers: list[dict[str, Any]] = []
        for il in range(c.n_layer):
            pre = f"blk.{il}."
            d: dict[str, Any] = {}
            for name, tv in t.items():
                if name.startswith(pre):
                    key = name[len(pre):].removesuffix(".weight")
                    if key.endswith("_exps"):
                        continue  # routed experts stay in host memory, owned by the executor
                    d[key] = backend.vector(tv) if len(tv.shape) == 1 else backend.linear(tv)
            self.layers.append(d)
        factors = t.get("rope_freqs.weight")
        self.rope_factors = backend.to_host(backend.vector(factors)) if factors is not None else None
        self.experts = experts if experts is not None else CPUExperts(expert_weights(model, self.act), backend)
        self.route_observers: list[RouteObserver] = []
        self._rope_cache: dict[tuple, tuple[Any, Any]] = {}

    # ---- the pieces an architecture file may override ------------------------------------------
    def block(self, il: int, x: Any, pos: np.ndarray, kv: KVCache) -> Any:
        """One transformer block: float32 (T, n_embd) -> (T, n_embd). Subclasses write it."""
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
    def new_kv_cache(self, n_ctx: int) -> KVCache:
        """An empty KV cache of ``n_ctx`` positions on the backend."""
        c = self.cfg
        return KVCache(KVShape(c.n_layer, n_ctx, c.n_head_kv, c.head_dim, c.head_dim_v), xp=self.be.xp)

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
        self._rope_cache: dict[tuple, tuple[Any, Any]] = {}  # this pass's cos/sin (see _rope_tables)
        x = self.be.embed(self.token_embd, tokens)
        s = self.embed_scale()
        if s is not None:
            x = x * np.float32(s)
        for il in range(c.n_layer):
            x = self.block(il, x, pos, kv)
        kv.advance(tokens.size)
        if isinstance(logits, str):
            if logits == "last":
                x = x[-1:]
            elif logits != "all":
                raise ValueError(f"logits must be 'last', 'all' or an index array, got {logits!r}")
        else:
            idx = np.asarray(logits, dtype=np.int64)
            if idx.size == 0:
                return np.empty((0, c.n_vocab), np.float32)
            x = x[idx]
        return self.be.to_host(self.head(x))

    def head(self, x: Any) -> Any:
        """Final norm and output projection (with final logit soft-capping if the model has it)."""
        x = self.be.rms_norm(x, self.output_norm, self.cfg.norm_eps)
        y = self.be.matmul(self.output, x)
        cap = self.cfg.final_logit_softcapping if self.final_softcap else None
        if cap:
            y = np.float32(cap) * self.be.xp.tanh(y / np.float32(cap))
        return y

    # ---- building blocks ---------------------------------------------------------------------------
    def norm(self, x: Any, w: Any) -> Any:
        """RMSNorm with the model's epsilon."""
        return self.be.rms_norm(x, w, self.cfg.norm_eps)

    def attention(self, il: int, x: Any, pos: np.ndarray, kv: KVCache, *, qk_norm: str | None = None,
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
        q = self._proj(L, "attn_q", x)
        k = self._proj(L, "attn_k", x)
        v = self._proj(L, "attn_v", x)
        if qk_norm == "full":
            q = self.norm(q, L["attn_q_norm"])
            k = self.norm(k, L["attn_k_norm"])
        q = q.reshape(t, c.n_head, c.head_dim)
        k = k.reshape(t, c.n_head_kv, c.head_dim)
        v = v.reshape(t, c.n_head_kv, c.head_dim_v)
        if qk_norm == "head":
            q = self.norm(q, L["attn_q_norm"])
            k = self.norm(k, L["attn_k_norm"])
        rope = self.rope_spec(il)
        cos, sin = self._rope_tables(rope, pos)
        q = be.rope(q, cos, sin, rope.neox)
        k = be.rope(k, cos, sin, rope.neox)
        pos0 = int(pos[0])
        kv.store(il, pos0, k, v)
        o = be.attention(q, kv.k[il], kv.v[il], pos0, scale if scale is not None else 1.0 / math.sqrt(c.head_dim),
                         window=self.window(il), softcap=c.attn_logit_softcapping if self.attn_softcap else None)
        return self._proj(L, "attn_output", o)

    def _rope_tables(self, rope: RopeSpec, pos: np.ndarray) -> tuple[Any, Any]:
        """cos/sin of ``rope`` at ``pos`` on the backend, computed once per forward pass for each
        distinct RoPE (gemma3 has two; the others one) instead of once per layer."""
        key = (rope.n_rot, rope.base, rope.freq_scale)
        tables = self._rope_cache.get(key)
        if tables is None:
            cos, sin = rope.angles(pos)
            tables = self._rope_cache[key] = (self.be.asarray(cos), self.be.asarray(sin))
        return tables

    def _proj(self, L: dict[str, Any], name: str, x: Any) -> Any:
        y = self.be.matmul(L[name], x)
        b = L.get(name + ".bias")
        return y + b if b is not None else y

    def dense_ffn(self, il: int, x: Any, prefix: str = "ffn", suffix: str = "") -> Any:
        """Gated FFN ``down(act(gate(x)) * up(x))`` (Shazeer 2020) of ``{prefix}_gate{suffix}`` etc."""
        L, be = self.layers[il], self.be
        g = be.matmul(L[f"{prefix}_gate{suffix}"], x)
        u = be.matmul(L[f"{prefix}_up{suffix}"], x)
        return be.matmul(L[f"{prefix}_down{suffix}"], be.glu(g, u, self.act))

    def router_probs(self, il: int, x: Any) -> np.ndarray:
        """Softmax of the router logits ``ffn_gate_inp(x)``, float32 host (T, n_expert)."""
        logits = self.be.to_host(self.be.matmul(self.layers[il]["ffn_gate_inp"], x))
        return softmax(np.asarray(logits, dtype=np.float32))

    def route(self, il: int, x: Any) -> Routing:
        """Top-k softmax routing of the normed input x (T, n_embd) -> ids and weights (T, k);
        ``renorm_topk`` decides renormalising (per architecture, as llama.cpp hard-codes it)."""
        return topk_routing(self.router_probs(il, x), self.cfg.n_expert_used, self.renorm_topk)

    def moe(self, il: int, x: Any) -> Any:
        """Routed experts of block ``il`` on the normed input x (T, n_embd) -> (T, n_embd): route,
        tell the observers, run the executor."""
        r = self.route(il, x)
        for obs in self.route_observers:
            obs(il, r)
        return self.experts(il, x, r)
