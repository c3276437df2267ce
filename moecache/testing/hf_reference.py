"""Reference logits from Hugging Face transformers: an independent implementation of every
architecture moecache runs, for parity tests of moecache's own forward pass.

``hf_logits(path, tokens)`` builds the transformers model of the GGUF's architecture (CPU, float32,
eager attention, eager experts) and returns its logits for ``tokens`` at positions 0..n-1.

How the model is built: not with ``from_pretrained(dir, gguf_file=...)``, whose GGUF support
covers only some of the architectures here (no olmoe; a Mixtral GGUF loads as dense llama) and
whose key map ignores ``expert_feed_forward_length``. Instead, uniformly for every architecture:

1. the hyperparameters are read from the raw GGUF keys by gguf-py's own ``GGUFReader``
   (:func:`read_hparams`, llama.cpp's defaults written out here), NOT by moecache's parser, so a
   parsing bug in moecache is not shared by its reference; they fill the transformers config
   class by hand;
2. every tensor is read with gguf-py's ``GGUFReader`` too and dequantized to float32 with
   ``gguf.quants.dequantize`` (not moecache's kernels), renamed to the transformers parameter
   and loaded with ``load_state_dict(strict=True)``: a parameter left out, or one whose shape
   disagrees with the hyperparameters, is an error.

Nothing here imports moecache's GGUF reader or its kernels.

What the GGUF converter (llama.cpp ``conversion/*.py``) changed is undone here:

- llama (dense and Mixtral): ``attn_q``/``attn_k`` rows were permuted for llama.cpp's "norm"
  RoPE, which rotates adjacent pairs (x[2i], x[2i+1]); transformers rotates halves
  (``rotate_half``), so the permutation is reversed (:func:`unpermute_qk`). The NeoX-RoPE
  architectures (qwen2moe, qwen3moe, olmoe, qwen3, gemma3) are stored unpermuted.
- gemma3: the converter adds 1 to every ``*norm.weight``; ``Gemma3RMSNorm`` multiplies by
  ``1 + w``, so 1 is subtracted again.
- a missing ``output.weight`` means the output projection is ``token_embd`` (tied).

Routing as llama.cpp wires each architecture (``src/models/<arch>.cpp``, ``build_moe_ffn``):
softmax over all experts, top-k, then the k weights renormalized for qwen3moe and Mixtral
(``norm_topk_prob`` / Mixtral's router) and not for qwen2moe and olmoe; qwen2moe adds a shared
expert scaled by sigmoid(``ffn_gate_inp_shexp`` . x). gemma3: embeddings times sqrt(n_embd),
query scale 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 62-layer 27B, as llama.cpp),
sliding-window layers except every ``sliding_window_pattern``-th (default 6), RoPE base 10000 on
sliding layers and ``rope.freq_base`` on global ones, GeGLU with tanh-approximate gelu.

Files this does not reproduce faithfully raise NotImplementedError: RoPE scaling other than
linear, llama3 ``rope_freqs``, leading dense blocks, expert weight scale or sigmoid gating,
attention output bias, softcapped attention.

Checked (2026-11-30, transformers 5.24, llama.cpp b11434 CPU), as max |a - b| / max |b| of the
logits over 24-32 tokens: against the float64 numpy reference (qwen3moe; tests): 6.3e-7
synthetic, 7.2e-7 code-moe-tiny. Against llama.cpp on all-F32 copies of the ``tiny-<arch>``
synth presets with an F32 KV cache: 3e-7 to 1e-6 for qwen3moe, qwen2moe, olmoe, Mixtral, llama,
qwen3; 6e-4 for gemma3 (ggml's CPU gelu is an f16 lookup table); dropping the q/k unpermute
(0.5-0.8), the sliding window (0.93), the 10000 SWA RoPE base (0.34) or the query scale (0.32),
or flipping top-k renormalization (0.28-0.64) breaks that agreement. On the real
gemma-3-270m Q4_K_M the logits equal transformers' own GGUF loader's exactly.

Needs ``torch`` and ``transformers>=5`` (the ``test`` extra). Building a tiny model takes ~0.1 s
(after ~4 s of importing torch and transformers); a big GGUF is dequantized whole into float32 RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "llama", "qwen3", "gemma3")

GEMMA3_SWA_PATTERN = 6  # llama.cpp load_swa_pattern(ml, 6): layers il % 6 == 5 are global
GEMMA3_ROPE_BASE_SWA = 10000.0  # llama.cpp hparams.rope_freq_base_train_swa default


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the llama converter's q/k row permutation (``LlamaModel.permute``) for ``n_head``
    heads (n_head_kv for k): within each head, rows (0, 1, 2, 3, ...) = pairs (x[2i], x[2i+1])
    go back to halves (x[i], x[i + d/2])."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


@dataclass(frozen=True)
class Hparams:
    """A GGUF's hyperparameters as llama.cpp reads them (``llama_model::load_hparams`` and
    ``src/models/<arch>.cpp``), from the raw keys. Each field names its key (``{arch}.`` left out)
    and llama.cpp's default where the key is optional."""

    arch: str                     # general.architecture
    n_layer: int                  # block_count
    n_embd: int                   # embedding_length
    n_head: int                   # attention.head_count
    n_head_kv: int                # attention.head_count_kv (n_head)
    head_dim: int                 # attention.key_length (n_embd / n_head)
    head_dim_v: int               # attention.value_length (n_embd / n_head)
    rope_dim: int                 # rope.dimension_count (head_dim)
    n_ff: int                     # feed_forward_length (0)
    n_expert: int                 # expert_count (0)
    n_expert_used: int            # expert_used_count (0)
    expert_ff: int                # expert_feed_forward_length; absent: n_ff / n_expert_used
                                  # (qwen2moe, qwen3moe), n_ff (olmoe, Mixtral: no such key)
    shared_expert_ff: int         # expert_shared_feed_forward_length; absent: n_ff (qwen2moe), 0
    n_vocab: int                  # vocab_size, else len(tokenizer.ggml.tokens)
    context_length: int           # context_length
    norm_eps: float               # attention.layer_norm_rms_epsilon
    rope_freq_base: float         # rope.freq_base (10000)
    rope_type: str                # "norm" (llama) or "neox" (the others): llama_model_rope_type
    rope_scaling_type: str | None         # rope.scaling.type
    rope_scaling_factor: float | None     # rope.scaling.factor
    sliding_window: int                   # attention.sliding_window (0)
    sliding_window_pattern: Any           # attention.sliding_window_pattern (gemma3: 6)
    rope_freq_base_swa: float             # rope.freq_base_swa (10000)
    leading_dense_block_count: int        # leading_dense_block_count (0)
    expert_weights_scale: float | None    # expert_weights_scale
    expert_gating_func: int | None        # expert_gating_func
    attn_logit_softcapping: float | None  # attn_logit_softcapping
    final_logit_softcapping: float | None  # final_logit_softcapping

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def layer_is_moe(self, il: int) -> bool:
        return self.n_expert > 0 and il >= self.leading_dense_block_count


def read_hparams(reader: GGUFReader) -> Hparams:
    """The :class:`Hparams` of a GGUF opened with gguf-py's ``GGUFReader``. Raises KeyError
    naming a required key that is missing."""
    a = _metadata(reader, "general.architecture")
    if a is None:
        raise KeyError("general.architecture")

    def key(name: str, default: Any = KeyError) -> Any:
        v = _metadata(reader, f"{a}.{name}", default)
        if v is KeyError:
            raise KeyError(f"{a}.{name}")
        return v

    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    n_ff = int(key("feed_forward_length", 0))
    n_expert, n_used = int(key("expert_count", 0)), int(key("expert_used_count", 0))
    ff_exp_default = n_ff // n_used if a in ("qwen2moe", "qwen3moe") and n_used else n_ff
    vocab = _metadata(reader, f"{a}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return Hparams(
        arch=a, n_layer=int(key("block_count")), n_embd=n_embd, n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head)), head_dim=head_dim,
        head_dim_v=int(key("attention.value_length", n_embd // n_head)),
        rope_dim=int(key("rope.dimension_count", head_dim)), n_ff=n_ff, n_expert=n_expert,
        n_expert_used=n_used, expert_ff=int(key("expert_feed_forward_length", ff_exp_default)),
        shared_expert_ff=int(key("expert_shared_feed_forward_length", n_ff if a == "qwen2moe" else 0)),
        n_vocab=int(vocab), context_length=int(key("context_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_freq_base=float(key("rope.freq_base", 10000.0)),
        rope_type="norm" if a == "llama" else "neox",
        rope_scaling_type=key("rope.scaling.type", None), rope_scaling_factor=key("rope.scaling.factor", None),
        sliding_window=int(key("attention.sliding_window", 0)),
        sliding_window_pattern=key("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN),
        rope_freq_base_swa=float(key("rope.freq_base_swa", GEMMA3_ROPE_BASE_SWA)),
        leading_dense_block_count=int(key("leading_dense_block_count", 0)),
        expert_weights_scale=key("expert_weights_scale", None),
        expert_gating_func=key("expert_gating_func", None),
        attn_logit_softcapping=key("attn_logit_softcapping", None),
        final_logit_softcapping=key("final_logit_softcapping", None),
    )


def _unsupported(cfg: Hparams, reader: GGUFReader, path: Path) -> None:
    names = {t.name for t in reader.tensors}
    a = cfg.arch
    bad = []
    if cfg.arch not in ARCHS:
        bad.append(f"architecture {a!r} (have: {', '.join(ARCHS)})")
    if cfg.rope_scaling_type not in (None, "none", "linear"):
        bad.append(f"RoPE scaling {cfg.rope_scaling_type!r}")
    if "rope_freqs.weight" in names:
        bad.append("llama3 rope_freqs")
    if cfg.leading_dense_block_count:
        bad.append("leading dense blocks")
    if cfg.expert_weights_scale not in (None, 0.0, 1.0):
        bad.append(f"expert_weights_scale {cfg.expert_weights_scale}")
    if cfg.expert_gating_func not in (None, 1):
        bad.append(f"expert_gating_func {cfg.expert_gating_func} (only softmax)")
    if cfg.attn_logit_softcapping:
        bad.append("attention logit softcapping")
    if any(n.endswith("attn_output.bias") for n in names):
        bad.append("attn_output.bias")
    if cfg.rope_dim != cfg.head_dim or cfg.head_dim_v != cfg.head_dim:
        bad.append(f"partial RoPE or head_dim_v != head_dim ({cfg.rope_dim}, {cfg.head_dim_v}, {cfg.head_dim})")
    if cfg.arch == "olmoe" and cfg.n_head * cfg.head_dim != cfg.n_embd:
        bad.append("olmoe with n_head * head_dim != n_embd")
    if isinstance(cfg.sliding_window_pattern, list):
        bad.append("per-layer sliding_window_pattern array")
    if bad:
        raise NotImplementedError(f"hf_reference: {path.name}: not supported: "
                                  + "; ".join(bad))


def _rope(cfg: Hparams, theta: float) -> dict[str, Any]:
    if cfg.rope_scaling_type == "linear" and cfg.rope_scaling_factor not in (None, 1.0):
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(cfg.rope_scaling_factor)}
    return {"rope_type": "default", "rope_theta": theta}


def hf_config(cfg: Hparams):
    """The transformers config of ``cfg`` (a ``PreTrainedConfig``), with eager attention."""
    import transformers as tf

    common = dict(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.context_length,
        tie_word_embeddings=False,  # lm_head is always loaded explicitly (token_embd when tied)
        attention_dropout=0.0, use_cache=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    rope = _rope(cfg, cfg.rope_freq_base)
    a = cfg.arch
    if a == "qwen3moe":
        c = tf.Qwen3MoeConfig(**common, rope_parameters=rope, intermediate_size=cfg.n_ff or cfg.expert_ff,
                              moe_intermediate_size=cfg.expert_ff, num_experts=cfg.n_expert,
                              num_experts_per_tok=cfg.n_expert_used, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                              attention_bias=False, hidden_act="silu")
    elif a == "qwen2moe":
        c = tf.Qwen2MoeConfig(**common, rope_parameters=rope, intermediate_size=cfg.n_ff or cfg.expert_ff,
                              moe_intermediate_size=cfg.expert_ff,
                              shared_expert_intermediate_size=cfg.shared_expert_ff,
                              num_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
                              norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                              use_sliding_window=False, qkv_bias=True, hidden_act="silu")
    elif a == "olmoe":
        c = tf.OlmoeConfig(**common, rope_parameters=rope, intermediate_size=cfg.expert_ff,
                           num_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
                           norm_topk_prob=False, clip_qkv=None, attention_bias=False, hidden_act="silu")
    elif a == "llama" and cfg.is_moe:  # Mixtral: experts are n_ff wide (arch.py's default)
        c = tf.MixtralConfig(**common, rope_parameters=rope, intermediate_size=cfg.expert_ff,
                             num_local_experts=cfg.n_expert, num_experts_per_tok=cfg.n_expert_used,
                             sliding_window=None, router_jitter_noise=0.0, hidden_act="silu")
    elif a == "llama":
        c = tf.LlamaConfig(**common, rope_parameters=rope, intermediate_size=cfg.n_ff,
                           attention_bias=False, mlp_bias=False, hidden_act="silu")
    elif a == "qwen3":
        c = tf.Qwen3Config(**common, rope_parameters=rope, intermediate_size=cfg.n_ff,
                           attention_bias=False, use_sliding_window=False,
                           layer_types=["full_attention"] * cfg.n_layer, hidden_act="silu")
    elif a == "gemma3":
        pattern = cfg.sliding_window_pattern
        swa = bool(cfg.sliding_window)
        layer_types = ["sliding_attention" if swa and (pattern == 0 or il % pattern < pattern - 1)
                       else "full_attention" for il in range(cfg.n_layer)]
        base_swa = cfg.rope_freq_base_swa
        c = tf.Gemma3TextConfig(
            **common, intermediate_size=cfg.n_ff, hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=cfg.n_embd // cfg.n_head if cfg.n_layer == 62 else cfg.head_dim,
            sliding_window=cfg.sliding_window if swa else None, layer_types=layer_types,
            rope_parameters={"full_attention": _rope(cfg, cfg.rope_freq_base),
                             "sliding_attention": {"rope_type": "default", "rope_theta": float(base_swa)}},
            final_logit_softcapping=cfg.final_logit_softcapping or None, attn_logit_softcapping=None,
            attention_bias=False, use_bidirectional_attention=False)
    else:  # pragma: no cover - _unsupported refuses it first
        raise NotImplementedError(a)
    c._attn_implementation = "eager"
    c._experts_implementation = "eager"
    return c


def hf_state_dict(cfg: Hparams, reader: GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF as float32, under its transformers parameter name."""

    def w(name: str) -> np.ndarray:
        t = tensors[name]
        data = t.data.view(np.ndarray)  # the plain array, not a memmap view
        return np.array(dequantize(data, GGMLQuantizationType(t.tensor_type)), dtype=np.float32)  # a copy

    tensors = {t.name: t for t in reader.tensors}
    a = cfg.arch
    norm_shift = 1.0 if a == "gemma3" else 0.0  # the converter's +1 on gemma3 norms

    def norm(name: str) -> np.ndarray:
        return w(name) - np.float32(norm_shift)

    sd = {"model.embed_tokens.weight": w("token_embd.weight"),
          "model.norm.weight": norm("output_norm.weight"),
          "lm_head.weight": w("output.weight" if "output.weight" in tensors else "token_embd.weight")}
    for il in range(cfg.n_layer):
        b, h = f"blk.{il}.", f"model.layers.{il}."
        q, k = w(b + "attn_q.weight"), w(b + "attn_k.weight")
        if cfg.rope_type == "norm":
            q, k = unpermute_qk(q, cfg.n_head), unpermute_qk(k, cfg.n_head_kv)
        sd |= {h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
               h + "self_attn.v_proj.weight": w(b + "attn_v.weight"),
               h + "self_attn.o_proj.weight": w(b + "attn_output.weight"),
               h + "input_layernorm.weight": norm(b + "attn_norm.weight")}
        if a == "qwen2moe":
            for x in "qkv":
                sd[h + f"self_attn.{x}_proj.bias"] = w(b + f"attn_{x}.bias")
        if a in ("qwen3moe", "olmoe", "qwen3", "gemma3"):
            sd[h + "self_attn.q_norm.weight"] = norm(b + "attn_q_norm.weight")
            sd[h + "self_attn.k_norm.weight"] = norm(b + "attn_k_norm.weight")
        if a == "gemma3":
            sd |= {h + "post_attention_layernorm.weight": norm(b + "post_attention_norm.weight"),
                   h + "pre_feedforward_layernorm.weight": norm(b + "ffn_norm.weight"),
                   h + "post_feedforward_layernorm.weight": norm(b + "post_ffw_norm.weight")}
        else:
            sd[h + "post_attention_layernorm.weight"] = norm(b + "ffn_norm.weight")
        if cfg.layer_is_moe(il):
            sd |= {h + "mlp.gate.weight": w(b + "ffn_gate_inp.weight"),
                   h + "mlp.experts.gate_up_proj": np.concatenate(
                       [w(b + "ffn_gate_exps.weight"), w(b + "ffn_up_exps.weight")], axis=1),
                   h + "mlp.experts.down_proj": w(b + "ffn_down_exps.weight")}
            if a == "qwen2moe":
                sd |= {h + "mlp.shared_expert_gate.weight": w(b + "ffn_gate_inp_shexp.weight")[None, :],
                       h + "mlp.shared_expert.gate_proj.weight": w(b + "ffn_gate_shexp.weight"),
                       h + "mlp.shared_expert.up_proj.weight": w(b + "ffn_up_shexp.weight"),
                       h + "mlp.shared_expert.down_proj.weight": w(b + "ffn_down_shexp.weight")}
        else:
            sd |= {h + "mlp.gate_proj.weight": w(b + "ffn_gate.weight"),
                   h + "mlp.up_proj.weight": w(b + "ffn_up.weight"),
                   h + "mlp.down_proj.weight": w(b + "ffn_down.weight")}
    return sd


def hf_model(path: str | Path):
    """The transformers ``*ForCausalLM`` of the GGUF at ``path``: float32, eval mode, eager
    attention and experts, every parameter from the file. Raises NotImplementedError for what
    it does not reproduce (see the module docstring)."""
    import torch
    import transformers as tf

    path = Path(path)
    reader = GGUFReader(path)
    cfg = read_hparams(reader)
    _unsupported(cfg, reader, path)
    config = hf_config(cfg)
    sd = hf_state_dict(cfg, reader)
    with torch.device("cpu"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    return model.eval()


def hf_logits(gguf_path: str | Path, tokens: list[int] | np.ndarray, model=None) -> np.ndarray:
    """transformers' logits for ``tokens`` (positions 0..n-1, one sequence, no cache):
    float32 array of shape (n_tokens, n_vocab). Pass ``model`` (from :func:`hf_model`) to reuse
    a built model."""
    import torch

    if model is None:
        model = hf_model(gguf_path)
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).reshape(1, -1)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].to(torch.float32).numpy()
