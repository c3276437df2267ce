"""The architectures moecache reads: which GGUF keys each needs and which tensors it must contain.

One table, :data:`ARCHS`, keyed by ``general.architecture``. An entry lists the ``{arch}.*`` keys
that must be present, the RoPE flavour, and the *tensor groups* of the file: plain dicts from
GGUF tensor name to a function of :class:`ModelConfig` giving the expected shape. Shapes are in
numpy order (outermost first), the reverse of ggml's ``ne``: llama.cpp's
``{n_embd, n_ff_exp, n_expert}`` for ``ffn_gate_exps`` is ``(n_expert, expert_ff, n_embd)`` here.

Sources: gguf-py ``gguf/constants.py`` (``MODEL_TENSORS``, ``TENSOR_NAMES``, ``Keys``) for names,
llama.cpp ``src/models/<arch>.cpp`` (``load_arch_hparams`` / ``load_arch_tensors``) for shapes,
required keys and defaults. Adding an architecture = one :class:`ArchSpec` row (plus a group if it
has tensors no other architecture has).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moecache.errors import GGUFError, UnsupportedArchError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a GGUF model, filled from its ``{arch}.*`` keys.

    Every field is named after, and documented with, the GGUF key it comes from; defaults are
    llama.cpp's. Lengths are element counts, not bytes.
    """

    arch: str                  # general.architecture
    n_layer: int               # {arch}.block_count
    n_embd: int                # {arch}.embedding_length
    n_head: int                # {arch}.attention.head_count
    n_head_kv: int             # {arch}.attention.head_count_kv (default n_head)
    head_dim: int              # {arch}.attention.key_length (default n_embd // n_head)
    head_dim_v: int            # {arch}.attention.value_length (default n_embd // n_head, as llama.cpp)
    n_ff: int                  # {arch}.feed_forward_length (dense FFN width; 0 if absent)
    n_expert: int              # {arch}.expert_count (0: dense model)
    n_expert_used: int         # {arch}.expert_used_count (top-k)
    expert_ff: int             # {arch}.expert_feed_forward_length, else the arch default (ArchSpec)
    shared_expert_ff: int      # {arch}.expert_shared_feed_forward_length (0: no shared expert)
    n_expert_shared: int       # {arch}.expert_shared_count (default 1 if shared_expert_ff else 0)
    context_length: int        # {arch}.context_length (trained context)
    n_vocab: int               # {arch}.vocab_size, else len(tokenizer.ggml.tokens)
    norm_eps: float            # {arch}.attention.layer_norm_rms_epsilon
    rope_freq_base: float      # {arch}.rope.freq_base (default 10000)
    rope_dim: int              # {arch}.rope.dimension_count (default head_dim)
    rope_type: str             # "norm" (pairs x[2i], x[2i+1]) or "neox" (x[i], x[i+d/2]); per arch
    rope_scaling_type: str | None = None      # {arch}.rope.scaling.type ("linear", "yarn", ...)
    rope_scaling_factor: float | None = None  # {arch}.rope.scaling.factor
    rope_scaling_orig_ctx: int | None = None  # {arch}.rope.scaling.original_context_length
    sliding_window: int | None = None         # {arch}.attention.sliding_window (tokens)
    sliding_window_pattern: int | None = None  # {arch}.attention.sliding_window_pattern (every Nth layer is global)
    rope_freq_base_swa: float | None = None   # {arch}.rope.freq_base_swa (RoPE base of sliding-window layers)
    leading_dense_block_count: int = 0        # {arch}.leading_dense_block_count (first dense layers)
    expert_weights_norm: bool | None = None   # {arch}.expert_weights_norm (renormalise top-k)
    expert_weights_scale: float | None = None  # {arch}.expert_weights_scale
    expert_gating_func: int | None = None     # {arch}.expert_gating_func (1 softmax, 2 sigmoid)
    attn_logit_softcapping: float | None = None   # {arch}.attn_logit_softcapping
    final_logit_softcapping: float | None = None  # {arch}.final_logit_softcapping

    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts (``expert_count`` > 0)."""
        return self.n_expert > 0

    @property
    def n_embd_q(self) -> int:
        """Width of the query projection: n_head * head_dim."""
        return self.n_head * self.head_dim

    @property
    def n_embd_k_gqa(self) -> int:
        """Width of the key projection: n_head_kv * head_dim."""
        return self.n_head_kv * self.head_dim

    @property
    def n_embd_v_gqa(self) -> int:
        """Width of the value projection: n_head_kv * head_dim_v."""
        return self.n_head_kv * self.head_dim_v

    def layer_is_moe(self, il: int) -> bool:
        """True when block ``il`` has routed experts (MoE model, past the leading dense blocks)."""
        return self.n_expert > 0 and il >= self.leading_dense_block_count


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape (numpy order) of one tensor, as a function of the config."""

    shape: Callable[[ModelConfig], Shape]
    optional: bool = False


def _t(shape: Callable[[ModelConfig], Shape], optional: bool = False) -> TensorSpec:
    return TensorSpec(shape, optional)


# ---- tensor groups: GGUF name (without "blk.N." for block groups) -> expected shape -------------
GROUPS: dict[str, dict[str, TensorSpec]] = {
    # global tensors; `output` absent = tied to token_embd (llama.cpp TENSOR_DUPLICATED)
    "embd": {
        "token_embd.weight": _t(lambda c: (c.n_vocab, c.n_embd)),
        "output_norm.weight": _t(lambda c: (c.n_embd,)),
        "output.weight": _t(lambda c: (c.n_vocab, c.n_embd), optional=True),
    },
    "rope_freqs": {  # llama3-style per-frequency RoPE factors, one global tensor
        "rope_freqs.weight": _t(lambda c: (c.rope_dim // 2,), optional=True),
    },
    # per-block groups
    "attn": {
        "attn_norm.weight": _t(lambda c: (c.n_embd,)),
        "attn_q.weight": _t(lambda c: (c.n_embd_q, c.n_embd)),
        "attn_k.weight": _t(lambda c: (c.n_embd_k_gqa, c.n_embd)),
        "attn_v.weight": _t(lambda c: (c.n_embd_v_gqa, c.n_embd)),
        "attn_output.weight": _t(lambda c: (c.n_embd, c.n_head * c.head_dim_v)),
        "ffn_norm.weight": _t(lambda c: (c.n_embd,)),
    },
    "attn_out_bias": {
        "attn_output.bias": _t(lambda c: (c.n_embd,), optional=True),
    },
    "qkv_bias": {
        "attn_q.bias": _t(lambda c: (c.n_embd_q,)),
        "attn_k.bias": _t(lambda c: (c.n_embd_k_gqa,)),
        "attn_v.bias": _t(lambda c: (c.n_embd_v_gqa,)),
    },
    "qk_norm": {  # RMSNorm over each head (qwen3, gemma3)
        "attn_q_norm.weight": _t(lambda c: (c.head_dim,)),
        "attn_k_norm.weight": _t(lambda c: (c.head_dim,)),
    },
    "qk_norm_full": {  # RMSNorm over all heads at once (olmoe; llama.cpp says {n_embd} for both, equal there)
        "attn_q_norm.weight": _t(lambda c: (c.n_embd_q,)),
        "attn_k_norm.weight": _t(lambda c: (c.n_embd_k_gqa,)),
    },
    "post_norms": {  # gemma2/3 sandwich norms
        "post_attention_norm.weight": _t(lambda c: (c.n_embd,)),
        "post_ffw_norm.weight": _t(lambda c: (c.n_embd,)),
    },
    "ffn": {
        "ffn_gate.weight": _t(lambda c: (c.n_ff, c.n_embd)),
        "ffn_up.weight": _t(lambda c: (c.n_ff, c.n_embd)),
        "ffn_down.weight": _t(lambda c: (c.n_embd, c.n_ff)),
    },
    "moe": {
        "ffn_gate_inp.weight": _t(lambda c: (c.n_expert, c.n_embd)),
        "ffn_gate_exps.weight": _t(lambda c: (c.n_expert, c.expert_ff, c.n_embd)),
        "ffn_up_exps.weight": _t(lambda c: (c.n_expert, c.expert_ff, c.n_embd)),
        "ffn_down_exps.weight": _t(lambda c: (c.n_expert, c.n_embd, c.expert_ff)),
    },
    "shexp": {  # qwen2moe shared expert with a sigmoid gate
        "ffn_gate_inp_shexp.weight": _t(lambda c: (c.n_embd,)),
        "ffn_gate_shexp.weight": _t(lambda c: (c.shared_expert_ff, c.n_embd)),
        "ffn_up_shexp.weight": _t(lambda c: (c.shared_expert_ff, c.n_embd)),
        "ffn_down_shexp.weight": _t(lambda c: (c.n_embd, c.shared_expert_ff)),
    },
}

# Keys every architecture here needs (suffixes of "{arch}."), as llama.cpp's loader requires them.
BASE_KEYS = (
    "context_length", "embedding_length", "block_count",
    "attention.head_count", "attention.layer_norm_rms_epsilon",
)
MOE_KEYS = ("expert_count", "expert_used_count")


@dataclass(frozen=True)
class ArchSpec:
    """One architecture.

    Attributes:
        name: ``general.architecture``.
        required_keys: ``{arch}.`` key suffixes that must be present.
        rope_type: ``"norm"`` or ``"neox"`` (llama.cpp ``llama_model_rope_type``).
        globals: groups of non-block tensors.
        block: groups every block has.
        moe_block: groups of a block with routed experts (:meth:`ModelConfig.layer_is_moe`).
        dense_block: groups of a block without (a dense model, or a leading dense block).
        moe_required: the architecture is MoE only (``expert_count`` must be > 0).
        expert_ff_default: where ``expert_ff`` comes from when ``expert_feed_forward_length`` is
            absent: ``"n_ff"`` (mixtral, olmoe) or ``"n_ff/n_expert_used"`` (qwen2moe, qwen3moe).
        shared_expert_ff_default: ``"n_ff"`` (qwen2moe) or ``"none"`` when
            ``expert_shared_feed_forward_length`` is absent.
    """

    name: str
    required_keys: tuple[str, ...]
    rope_type: str
    block: tuple[str, ...]
    moe_block: tuple[str, ...] = ()
    dense_block: tuple[str, ...] = ()
    globals: tuple[str, ...] = ("embd",)
    moe_required: bool = False
    expert_ff_default: str = "n_ff"
    shared_expert_ff_default: str = "none"


ARCHS: dict[str, ArchSpec] = {a.name: a for a in (
    ArchSpec("qwen3moe", BASE_KEYS + MOE_KEYS, "neox", ("attn", "qk_norm"), moe_block=("moe",),
             moe_required=True, expert_ff_default="n_ff/n_expert_used"),
    ArchSpec("qwen2moe", BASE_KEYS + MOE_KEYS, "neox", ("attn", "qkv_bias"), moe_block=("moe", "shexp"),
             moe_required=True, expert_ff_default="n_ff/n_expert_used", shared_expert_ff_default="n_ff"),
    ArchSpec("olmoe", BASE_KEYS + MOE_KEYS + ("feed_forward_length",), "neox", ("attn", "qk_norm_full"),
             moe_block=("moe",), moe_required=True),
    # llama covers dense Llama 1/2/3 and Mixtral (expert_count > 0; experts are n_ff wide)
    ArchSpec("llama", BASE_KEYS + ("feed_forward_length",), "norm", ("attn", "attn_out_bias"),
             moe_block=("moe",), dense_block=("ffn",), globals=("embd", "rope_freqs")),
    ArchSpec("qwen3", BASE_KEYS + ("feed_forward_length",), "neox", ("attn", "qk_norm"), dense_block=("ffn",)),
    ArchSpec("gemma3", BASE_KEYS + ("feed_forward_length",), "neox", ("attn", "qk_norm", "post_norms"),
             dense_block=("ffn",)),
)}


def arch_spec(arch: str) -> ArchSpec:
    """The table row of ``arch``. Raises UnsupportedArchError naming the supported ones."""
    spec = ARCHS.get(arch)
    if spec is None:
        raise UnsupportedArchError(
            f"unsupported architecture '{arch}' (supported: {', '.join(sorted(ARCHS))})")
    return spec


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[Shape, bool]]:
    """Every tensor the model may have: GGUF name -> (shape in numpy order, optional)."""
    spec = arch_spec(cfg.arch)
    out: dict[str, tuple[Shape, bool]] = {}
    for g in spec.globals:
        for name, t in GROUPS[g].items():
            out[name] = (t.shape(cfg), t.optional)
    for il in range(cfg.n_layer):
        groups = spec.block + (spec.moe_block if cfg.layer_is_moe(il) else spec.dense_block)
        for g in groups:
            for name, t in GROUPS[g].items():
                out[f"blk.{il}.{name}"] = (t.shape(cfg), t.optional)
    return out


# ---- metadata -> ModelConfig ------------------------------------------------------------------

def _typed(md: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    if key not in md:
        return default
    v = md[key]
    if kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        v = float(v) if ok else v
    elif kind is bool:
        ok = isinstance(v, bool)
    else:
        ok = isinstance(v, str)
    if not ok:
        what = "an array (per-layer values are not supported)" if isinstance(v, (list, tuple)) or hasattr(v, "shape") \
            else f"{type(v).__name__} {v!r}"
        raise GGUFError(f"key {key} is {what}, expected {kind.__name__}")
    return v


def config_from_metadata(md: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    """Build and sanity-check the ModelConfig of ``md['general.architecture']``.

    Args:
        md: the GGUF key/value pairs (scalars must be Python int/float/bool/str).
        n_vocab: vocabulary size, used when ``{arch}.vocab_size`` is absent.

    Raises:
        UnsupportedArchError: the architecture is not in :data:`ARCHS`.
        GGUFError: required keys are missing (all named at once), a key has the wrong type, or
            the values are inconsistent (e.g. expert_used_count > expert_count) or impossible (a
            count or size <= 0, rope.dimension_count past the head size, a non-finite or
            non-positive epsilon or RoPE base, a non-finite scale: :func:`_float_problems`).
            Counts are checked against the tensors the file holds by
            :func:`moecache.gguf_file.open_gguf`, not here.
    """
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("missing required key general.architecture")
    spec = arch_spec(arch)
    missing = [f"{arch}.{k}" for k in spec.required_keys if f"{arch}.{k}" not in md]
    if missing:
        raise GGUFError(f"missing required keys: {', '.join(missing)}")

    def i(k: str, d: Any = None) -> Any:
        return _typed(md, f"{arch}.{k}", int, d)

    def f(k: str, d: Any = None) -> Any:
        return _typed(md, f"{arch}.{k}", float, d)

    n_embd, n_head = i("embedding_length"), i("attention.head_count")
    if n_head <= 0 or n_embd <= 0:
        raise GGUFError(f"{arch}.embedding_length ({n_embd}) and {arch}.attention.head_count ({n_head}) must be > 0")
    head_dim = i("attention.key_length", n_embd // n_head)
    n_ff = i("feed_forward_length", 0)
    n_expert, n_used = i("expert_count", 0), i("expert_used_count", 0)
    expert_ff = i("expert_feed_forward_length", 0)
    if not expert_ff and n_expert:
        if spec.expert_ff_default == "n_ff/n_expert_used":
            expert_ff = n_ff // n_used if n_used else 0
        else:
            expert_ff = n_ff
    shared_ff = i("expert_shared_feed_forward_length", 0)
    if not shared_ff and n_expert and spec.shared_expert_ff_default == "n_ff":
        shared_ff = n_ff
    cfg = ModelConfig(
        arch=arch, n_layer=i("block_count"), n_embd=n_embd, n_head=n_head,
        n_head_kv=i("attention.head_count_kv", n_head), head_dim=head_dim,
        head_dim_v=i("attention.value_length", n_embd // n_head), n_ff=n_ff,
        n_expert=n_expert, n_expert_used=n_used, expert_ff=expert_ff,
        shared_expert_ff=shared_ff, n_expert_shared=i("expert_shared_count", 1 if shared_ff else 0),
        context_length=i("context_length"), n_vocab=i("vocab_size", n_vocab),
        norm_eps=f("attention.layer_norm_rms_epsilon"),
        rope_freq_base=f("rope.freq_base", 10000.0), rope_dim=i("rope.dimension_count", head_dim),
        rope_type=spec.rope_type,
        rope_scaling_type=_typed(md, f"{arch}.rope.scaling.type", str, None),
        rope_scaling_factor=f("rope.scaling.factor"),
        rope_scaling_orig_ctx=i("rope.scaling.original_context_length"),
        sliding_window=i("attention.sliding_window"),
        sliding_window_pattern=i("attention.sliding_window_pattern"),
        rope_freq_base_swa=f("rope.freq_base_swa"),
        leading_dense_block_count=i("leading_dense_block_count", 0),
        expert_weights_norm=_typed(md, f"{arch}.expert_weights_norm", bool, None),
        expert_weights_scale=f("expert_weights_scale"),
        expert_gating_func=i("expert_gating_func"),
        attn_logit_softcapping=f("attn_logit_softcapping"),
        final_logit_softcapping=f("final_logit_softcapping"),
    )
    _check(cfg, spec)
    return cfg


def _float_problems(c: ModelConfig) -> list[str]:
    """Float hyperparameters no model can have: the RMSNorm epsilon and RoPE bases must be finite and
    > 0 (an epsilon of 0 divides a zero row by 0; a base <= 0 gives NaN angles); scales and soft-caps
    finite and >= 0 (0 = unset, as llama.cpp reads them)."""
    a, bad = c.arch, []
    for key, v in (("attention.layer_norm_rms_epsilon", c.norm_eps), ("rope.freq_base", c.rope_freq_base),
                   ("rope.freq_base_swa", c.rope_freq_base_swa)):
        if v is not None and not (math.isfinite(v) and v > 0):
            bad.append(f"{a}.{key} is {v} (must be finite and > 0)")
    for key, v in (("rope.scaling.factor", c.rope_scaling_factor), ("expert_weights_scale", c.expert_weights_scale),
                   ("attn_logit_softcapping", c.attn_logit_softcapping),
                   ("final_logit_softcapping", c.final_logit_softcapping)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            bad.append(f"{a}.{key} is {v} (must be finite and >= 0; 0 = unset)")
    return bad


def _check(c: ModelConfig, spec: ArchSpec) -> None:
    a = c.arch
    bad = []
    if c.n_layer <= 0:
        bad.append(f"{a}.block_count is {c.n_layer}")
    if c.n_head_kv <= 0 or c.n_head % c.n_head_kv:
        bad.append(f"{a}.attention.head_count ({c.n_head}) is not a multiple of head_count_kv ({c.n_head_kv})")
    if c.head_dim <= 0:
        bad.append(f"head size is {c.head_dim}: set {a}.attention.key_length")
    if c.n_vocab <= 0:
        bad.append(f"vocabulary size unknown ({c.n_vocab}): no tokenizer.ggml.tokens and no {a}.vocab_size > 0")
    if spec.moe_required and (c.n_expert <= 0 or c.n_expert_used <= 0):
        bad.append(f"{a} needs {a}.expert_count and {a}.expert_used_count > 0 "
                   f"(got {c.n_expert}, {c.n_expert_used})")
    if c.n_expert and not 0 < c.n_expert_used <= c.n_expert:
        bad.append(f"{a}.expert_used_count ({c.n_expert_used}) must be in 1..expert_count ({c.n_expert})")
    if c.n_expert and c.expert_ff <= 0:
        bad.append(f"expert width unknown: set {a}.expert_feed_forward_length")
    if not c.n_expert and c.n_ff <= 0 and spec.dense_block:
        bad.append(f"{a}.feed_forward_length is {c.n_ff}")
    if c.context_length <= 0:
        bad.append(f"{a}.context_length is {c.context_length}")
    if c.head_dim_v <= 0:
        bad.append(f"{a}.attention.value_length is {c.head_dim_v}")
    if c.head_dim > 0 and not 0 < c.rope_dim <= c.head_dim:
        bad.append(f"{a}.rope.dimension_count ({c.rope_dim}) must be in 1..head size ({c.head_dim})")
    if not 0 <= c.leading_dense_block_count <= max(c.n_layer, 0):
        bad.append(f"{a}.leading_dense_block_count ({c.leading_dense_block_count}) must be in 0..block_count "
                   f"({c.n_layer})")
    for key, v in (("attention.sliding_window", c.sliding_window),
                   ("attention.sliding_window_pattern", c.sliding_window_pattern),
                   ("rope.scaling.original_context_length", c.rope_scaling_orig_ctx),
                   ("expert_shared_count", c.n_expert_shared)):
        if v is not None and v < 0:
            bad.append(f"{a}.{key} is {v}")
    bad += _float_problems(c)
    if bad:
        raise GGUFError("inconsistent hyperparameters: " + "; ".join(bad))
