"""Synthetic GGUF models: a valid file of a given architecture and shape, with random weights.

Used by the tests (tiny models) and by the benchmark (a model shaped like Qwen3-30B-A3B, ~17 GB).
Architectures (:data:`ARCHS`): qwen3moe, qwen2moe, olmoe, llama (dense, or Mixtral when
``n_expert`` > 0), qwen3, gemma3; a ``tiny-<arch>`` preset each (``tiny`` is qwen3moe).
The file is written tensor by tensor, each tensor generated in chunks right before it is written,
so memory stays small whatever the model size. The same (config, seed) writes the same bytes: each
tensor draws from its own generator, seeded by (seed, sha256 of the tensor name).

Weight scales ("balanced" init) are chosen so that routing stays near-uniform through every layer,
the honest worst case for an expert cache (tests/test_synth.py checks it with
:mod:`moecache.testing.reference`):

- every layer input is RMS-normalized, so a projection that reads it gets std 1/sqrt(n_in)
  (unit-variance outputs: q, k, v, gate, up, output logits);
- the router gets std 1/sqrt(n_embd): router logits ~ N(0, 1), a soft but not flat top-k;
- projections that write into the residual stream (attn_output, ffn_down_exps) are scaled so
  each sub-layer adds about ``RESIDUAL_GAIN`` x the RMS of the embeddings (std 1): the residual
  grows like sqrt(1 + 2 n_layer gain^2) instead of exploding, and no layer dominates it;
- attention biases (qwen2moe) get std ``BIAS_STD``: a small shift of the unit-variance q, k, v;
- a tied output (no ``output.weight``) reads the embedding table as its projection, so the table
  gets std 1/sqrt(n_embd) (unit-variance logits); gemma3 multiplies the embeddings by
  sqrt(n_embd), so its table always gets that std and its layer inputs still have RMS 1;
- a shared expert (qwen2moe) and the routed experts each add ``RESIDUAL_GAIN``/sqrt(2), so their
  sum adds about ``RESIDUAL_GAIN``; its sigmoid gate is router-like (gate logits ~ N(0, 1)).
  qwen2moe and olmoe do not renormalize the top-k weights, so their routed part adds a bit less;
- gemma3 normalizes each sub-layer's output (post-norms), so each adds RMS ~1 whatever its scale;
- quantized blocks are zero-mean. Random K-quant blocks (and Q4_1/Q5_1) have a large positive
  mean (``d*sc*q - dmin*m`` with random bytes: mean/std ~0.6 for Q4_K, 1.0 for Q4_1, the same
  sign in every row). That is a rank-one spike in every matrix: all outputs move along one
  direction, which builds up in the residual stream until every token routes to the same
  experts. The mins are therefore set to centre each sub-block (``m = sc``, ``dmin = d * mean q``),
  and each block's scale fields get a random sign (removes the small -0.5 LSB bias of Q4_0,
  Q8_0, IQ4_NL, ...), so the weights are zero-mean with no shared direction.

``init="naive"`` writes the same shapes with std 0.02 everywhere and uncentred blocks, the kind of
model whose routing collapses; it exists to show what the balanced init prevents.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import string
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize

from moecache.quants.formats import FORMATS, BlockFormat
from moecache.quants.random_blocks import FLOAT_STD, center_blocks, random_rows, scale_blocks

# Scale choices of the balanced init (see the module docstring).
EMBD_STD = 1.0
NORM_JITTER = 0.1  # norm weights are 1 + N(0, NORM_JITTER): not all ones, so an ignored norm shows
ROUTER_SPREAD = 1.0  # std of the router logits
RESIDUAL_GAIN = 0.5  # RMS a sub-layer adds to the residual, relative to the embeddings
SILU_RMS = math.sqrt(0.3553)  # RMS of silu(g) for g ~ N(0, 1); silu(g) * u has the same RMS
GELU_RMS = math.sqrt(0.4252)  # the same for gelu (tanh approximation): gemma3's GeGLU
SIGMOID_RMS = math.sqrt(0.2934)  # RMS of sigmoid(g) for g ~ N(0, 1): qwen2moe's shared-expert gate
BIAS_STD = 0.1
NAIVE_STD = 0.02

CHUNK_BYTES = 8 << 20  # tensors are generated and written in chunks of about this many bytes


@dataclass(frozen=True)
class SynthConfig:
    """Shape and quant types of a synthetic model. Quant types are keys of ``FORMATS``."""

    arch: str = "qwen3moe"
    name: str = "synthetic"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_expert: int = 8
    n_expert_used: int = 2
    expert_ff: int = 32
    n_ff: int = 128  # dense FFN length (feed_forward_length; unused by qwen3moe, qwen2moe)
    n_vocab: int = 300
    context_length: int = 4096
    rope_freq_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    expert_type: str = "Q4_0"
    attn_type: str = "Q8_0"
    embd_type: str = "Q8_0"
    output_type: str = "Q8_0"
    ffn_type: str = "Q8_0"  # dense FFN and shared-expert matrices
    shared_expert_ff: int = 0  # shared-expert width (qwen2moe; expert_shared_feed_forward_length)
    sliding_window: int = 0  # sliding-window attention length (gemma3; 0: none, every layer global)
    tied_output: bool = False  # no output.weight: the output projection is token_embd


PRESETS: dict[str, SynthConfig] = {
    "tiny": SynthConfig(name="synthetic-tiny", n_layer=4),
    "qwen3-30b-a3b": SynthConfig(
        name="synthetic-qwen3-30b-a3b", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
        n_expert=128, n_expert_used=8, expert_ff=768, n_ff=6144, n_vocab=32000, context_length=40960,
        expert_type="Q4_K", attn_type="Q8_0", embd_type="Q8_0", output_type="Q8_0"),
    # one tiny model per other architecture, with different quant types so that each exercises
    # other kernels; K-quants need rows of 256, hence n_embd 256 where they are used
    "tiny-qwen2moe": SynthConfig(
        arch="qwen2moe", name="synthetic-tiny-qwen2moe", n_expert=8, n_expert_used=2, expert_ff=32,
        shared_expert_ff=64, n_ff=64, rope_freq_base=10000.0, expert_type="Q8_0", attn_type="Q5_0",
        embd_type="F16", output_type="Q8_0", ffn_type="F16"),
    "tiny-olmoe": SynthConfig(
        arch="olmoe", name="synthetic-tiny-olmoe", n_embd=256, n_head=4, n_head_kv=4, head_dim=64,
        n_expert=8, n_expert_used=2, expert_ff=256, n_ff=256, rope_freq_base=10000.0, norm_eps=1e-5,
        expert_type="Q4_K", attn_type="Q6_K", embd_type="Q8_0", output_type="Q6_K"),
    "tiny-mixtral": SynthConfig(
        arch="llama", name="synthetic-tiny-mixtral", n_expert=8, n_expert_used=2, expert_ff=64, n_ff=64,
        rope_freq_base=1_000_000.0, norm_eps=1e-5, expert_type="Q5_0", attn_type="F16",
        embd_type="Q8_0", output_type="Q8_0"),
    "tiny-llama": SynthConfig(
        arch="llama", name="synthetic-tiny-llama", n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
        n_expert=0, n_expert_used=0, n_ff=512, rope_freq_base=500000.0, norm_eps=1e-5,
        attn_type="Q4_K", ffn_type="Q6_K", embd_type="Q8_0", tied_output=True),
    "tiny-qwen3": SynthConfig(
        arch="qwen3", name="synthetic-tiny-qwen3", n_expert=0, n_expert_used=0, n_ff=128,
        attn_type="Q8_0", ffn_type="Q5_0", embd_type="F32", output_type="F16"),
    # 6 layers: gemma3's layers 0-4 use the sliding window, layer 5 is global
    "tiny-gemma3": SynthConfig(
        arch="gemma3", name="synthetic-tiny-gemma3", n_layer=6, n_head=4, n_head_kv=1, head_dim=32,
        n_expert=0, n_expert_used=0, n_ff=128, sliding_window=8, attn_type="Q8_0", ffn_type="Q4_1",
        embd_type="Q8_0", tied_output=True),
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write.

    ``shape`` is in numpy order, in weights (``(n_expert, rows, n_in)``); the last axis is the
    quantized one. ``role`` picks the scale (see :func:`weight_std`): ``embedding``, ``norm``,
    ``input`` (reads a normalized vector), ``router``, ``residual`` (writes into the residual
    stream; ``gain`` corrects for an input RMS other than 1 or a sum of several outputs),
    ``bias``. For ``embedding`` the ``gain`` multiplies the embeddings' std (tied output, gemma3).
    """

    name: str
    shape: tuple[int, ...]
    qtype: str
    role: str
    gain: float = 1.0

    @property
    def fmt(self) -> BlockFormat:
        return FORMATS[self.qtype]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def n_in(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.fmt.row_bytes(self.n_in)


# ---- architectures: a tensor list and the architecture's own keys ------------------------------
# Tensor names are gguf-py's (MODEL_TENSORS[arch] + ".weight"/".bias"); shapes follow
# moecache.arch.GROUPS, which the reader checks every file against.

def _embedding(c: SynthConfig) -> TensorSpec:
    e = c.n_embd
    gain = 1.0 / math.sqrt(e) if c.tied_output or c.arch == "gemma3" else 1.0
    return TensorSpec("token_embd.weight", (c.n_vocab, e), c.embd_type, "embedding", gain=gain)


def _output(c: SynthConfig) -> list[TensorSpec]:
    t = [TensorSpec("output_norm.weight", (c.n_embd,), "F32", "norm")]
    if not c.tied_output:
        t.append(TensorSpec("output.weight", (c.n_vocab, c.n_embd), c.output_type, "input"))
    return t


def _attention(c: SynthConfig, b: str, qk_norm: str | None = None, bias: bool = False,
               post_norm: bool = False) -> list[TensorSpec]:
    """attn_norm, q, k, v (with biases when ``bias``), attn_output, then the q/k norms:
    ``qk_norm`` "head" (one head_dim vector shared by all heads: qwen3, gemma3) or "full" (over the
    whole projection: olmoe); ``post_norm`` adds gemma3's norm of the attention output."""
    e, q_dim, kv_dim = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    t = [TensorSpec(b + "attn_norm.weight", (e,), "F32", "norm")]
    for name, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
        t.append(TensorSpec(b + name + ".weight", (rows, e), c.attn_type, "input"))
        if bias:
            t.append(TensorSpec(b + name + ".bias", (rows,), "F32", "bias"))
    t.append(TensorSpec(b + "attn_output.weight", (e, q_dim), c.attn_type, "residual"))
    if qk_norm is not None:
        q_len, k_len = (c.head_dim, c.head_dim) if qk_norm == "head" else (q_dim, kv_dim)
        t += [TensorSpec(b + "attn_q_norm.weight", (q_len,), "F32", "norm"),
              TensorSpec(b + "attn_k_norm.weight", (k_len,), "F32", "norm")]
    if post_norm:
        t.append(TensorSpec(b + "post_attention_norm.weight", (e,), "F32", "norm"))
    return t


def _ffn_norm(c: SynthConfig, b: str) -> TensorSpec:
    return TensorSpec(b + "ffn_norm.weight", (c.n_embd,), "F32", "norm")


def _moe(c: SynthConfig, b: str, shared: bool = False) -> list[TensorSpec]:
    """Router and routed experts (SwiGLU), plus qwen2moe's sigmoid-gated shared expert."""
    e, ff = c.n_embd, c.expert_ff
    # the layer output is sum_k w_k down_k(silu(g) * u) with sum w_k = 1: about
    # 1/sqrt(k) of one expert's RMS when the k weights are similar
    gain = math.sqrt(c.n_expert_used) / SILU_RMS
    if shared:  # routed and shared parts add RESIDUAL_GAIN / sqrt(2) each
        gain /= math.sqrt(2)
    t = [
        TensorSpec(b + "ffn_gate_inp.weight", (c.n_expert, e), "F32", "router"),
        TensorSpec(b + "ffn_gate_exps.weight", (c.n_expert, ff, e), c.expert_type, "input"),
        TensorSpec(b + "ffn_up_exps.weight", (c.n_expert, ff, e), c.expert_type, "input"),
        TensorSpec(b + "ffn_down_exps.weight", (c.n_expert, e, ff), c.expert_type, "residual", gain=gain),
    ]
    if shared:
        sff = c.shared_expert_ff
        t += [
            TensorSpec(b + "ffn_gate_inp_shexp.weight", (e,), "F32", "router"),
            TensorSpec(b + "ffn_gate_shexp.weight", (sff, e), c.ffn_type, "input"),
            TensorSpec(b + "ffn_up_shexp.weight", (sff, e), c.ffn_type, "input"),
            TensorSpec(b + "ffn_down_shexp.weight", (e, sff), c.ffn_type, "residual",
                       gain=1.0 / (SILU_RMS * SIGMOID_RMS * math.sqrt(2))),
        ]
    return t


def _ffn(c: SynthConfig, b: str, act_rms: float = SILU_RMS) -> list[TensorSpec]:
    """Dense gated FFN: down(act(gate x) * up x); ``act_rms`` is the RMS of act(N(0, 1))."""
    e = c.n_embd
    return [TensorSpec(b + "ffn_gate.weight", (c.n_ff, e), c.ffn_type, "input"),
            TensorSpec(b + "ffn_up.weight", (c.n_ff, e), c.ffn_type, "input"),
            TensorSpec(b + "ffn_down.weight", (e, c.n_ff), c.ffn_type, "residual", gain=1.0 / act_rms)]


def _model(c: SynthConfig, block: Callable[[str], list[TensorSpec]]) -> list[TensorSpec]:
    return [_embedding(c), *(t for i in range(c.n_layer) for t in block(f"blk.{i}.")), *_output(c)]


def _need(ok: bool, c: SynthConfig, what: str) -> None:
    if not ok:
        raise ValueError(f"synth: {c.arch}: {what}")


def _need_moe(c: SynthConfig) -> None:
    _need(0 < c.n_expert_used <= c.n_expert, c,
          f"needs experts: 0 < n_expert_used <= n_expert (got {c.n_expert_used}, {c.n_expert})")


def _need_dense(c: SynthConfig) -> None:
    _need(c.n_expert == 0, c, f"is dense: set n_expert=0 (got {c.n_expert})")


def qwen3moe_tensors(c: SynthConfig) -> list[TensorSpec]:
    """qwen3moe: q/k norm per head, routed experts only; in llama.cpp's file order."""
    _need_moe(c)
    return _model(c, lambda b: [*_attention(c, b, qk_norm="head"), _ffn_norm(c, b), *_moe(c, b)])


def qwen2moe_tensors(c: SynthConfig) -> list[TensorSpec]:
    """qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases, routed experts + a shared expert."""
    _need_moe(c)
    _need(c.shared_expert_ff > 0, c, "needs a shared expert: set shared_expert_ff > 0")
    return _model(c, lambda b: [*_attention(c, b, bias=True), _ffn_norm(c, b), *_moe(c, b, shared=True)])


def olmoe_tensors(c: SynthConfig) -> list[TensorSpec]:
    """olmoe: q/k RMSNorm over the whole projection, routed experts. llama.cpp builds q and k as
    n_embd wide and needs output.weight."""
    _need_moe(c)
    _need(c.n_head * c.head_dim == c.n_embd and c.n_head_kv == c.n_head, c,
          "llama.cpp needs n_head * head_dim == n_embd and n_head_kv == n_head")
    _need(not c.tied_output, c, "llama.cpp needs output.weight (tied_output=False)")
    return _model(c, lambda b: [*_attention(c, b, qk_norm="full"), _ffn_norm(c, b), *_moe(c, b)])


def llama_tensors(c: SynthConfig) -> list[TensorSpec]:
    """llama: dense (Llama 1-3) or, with n_expert > 0, Mixtral (routed experts, renormalized top-k)."""
    if c.n_expert:
        _need_moe(c)
    return _model(c, lambda b: [*_attention(c, b), _ffn_norm(c, b),
                                *(_moe(c, b) if c.n_expert else _ffn(c, b))])


def qwen3_tensors(c: SynthConfig) -> list[TensorSpec]:
    """qwen3 (dense): q/k norm per head, SwiGLU FFN."""
    _need_dense(c)
    return _model(c, lambda b: [*_attention(c, b, qk_norm="head"), _ffn_norm(c, b), *_ffn(c, b)])


def gemma3_tensors(c: SynthConfig) -> list[TensorSpec]:
    """gemma3 (dense): q/k norm per head, norms after attention and FFN, GeGLU FFN. Norm weights
    are stored as written (the converter adds gemma's +1 to them); about 1 here as for any arch."""
    _need_dense(c)
    return _model(c, lambda b: [*_attention(c, b, qk_norm="head", post_norm=True), _ffn_norm(c, b),
                                *_ffn(c, b, act_rms=GELU_RMS),
                                TensorSpec(b + "post_ffw_norm.weight", (c.n_embd,), "F32", "norm")])


def _hparam_keys(w: GGUFWriter, c: SynthConfig, n_ff: int) -> None:
    """Keys of every architecture here (``{arch}.*``); ``n_ff`` is written as feed_forward_length."""
    w.add_block_count(c.n_layer)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head_kv)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_freq_base)
    w.add_layer_norm_rms_eps(c.norm_eps)


def moe_keys(w: GGUFWriter, c: SynthConfig) -> None:
    """qwen3moe, qwen2moe: experts expert_feed_forward_length wide, feed_forward_length = n_ff."""
    _hparam_keys(w, c, c.n_ff)
    w.add_expert_count(c.n_expert)
    w.add_expert_used_count(c.n_expert_used)
    w.add_expert_feed_forward_length(c.expert_ff)
    if c.shared_expert_ff:
        w.add_expert_shared_feed_forward_length(c.shared_expert_ff)


def ff_experts_keys(w: GGUFWriter, c: SynthConfig) -> None:
    """olmoe, llama: experts are feed_forward_length wide (the converters write no
    expert_feed_forward_length), so ``expert_ff`` goes there and ``n_ff`` is unused when
    there are experts; a dense llama writes ``n_ff``."""
    _hparam_keys(w, c, c.expert_ff if c.n_expert else c.n_ff)
    if c.n_expert:
        w.add_expert_count(c.n_expert)
        w.add_expert_used_count(c.n_expert_used)


def dense_keys(w: GGUFWriter, c: SynthConfig) -> None:
    _hparam_keys(w, c, c.n_ff)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)


# An architecture is its tensor list and its keys: a tensor-list function (plus a key function
# where its keys differ) and an entry here.
ARCHS: dict[str, tuple[Callable[[SynthConfig], list[TensorSpec]], Callable[[GGUFWriter, SynthConfig], None]]] = {
    "qwen3moe": (qwen3moe_tensors, moe_keys),
    "qwen2moe": (qwen2moe_tensors, moe_keys),
    "olmoe": (olmoe_tensors, ff_experts_keys),
    "llama": (llama_tensors, ff_experts_keys),
    "qwen3": (qwen3_tensors, dense_keys),
    "gemma3": (gemma3_tensors, dense_keys),
}


def tensor_specs(c: SynthConfig) -> list[TensorSpec]:
    """The tensors of ``c``'s architecture. Raises ValueError on an unknown arch or a bad shape."""
    if c.arch not in ARCHS:
        raise ValueError(f"synth: unknown architecture {c.arch!r} (have: {', '.join(ARCHS)})")
    if c.shared_expert_ff and c.arch != "qwen2moe":
        raise ValueError(f"synth: {c.arch}: no shared expert (shared_expert_ff is for qwen2moe)")
    if c.sliding_window and c.arch != "gemma3":
        raise ValueError(f"synth: {c.arch}: no sliding-window attention (sliding_window is for gemma3)")
    specs = ARCHS[c.arch][0](c)
    for s in specs:
        if s.qtype not in FORMATS:
            raise ValueError(f"synth: tensor {s.name}: unknown quant type {s.qtype!r}")
        if s.n_in % s.fmt.block_size:
            raise ValueError(f"synth: tensor {s.name}: row length {s.n_in} is not a multiple of "
                             f"{s.qtype}'s block size {s.fmt.block_size}")
    return specs


# ---- weights -----------------------------------------------------------------------------------

def weight_std(spec: TensorSpec, init: str = "balanced") -> float:
    """Standard deviation of ``spec``'s weights (norm weights: of their jitter around 1)."""
    if init == "naive":
        return 0.0 if spec.role == "norm" else NAIVE_STD
    if init != "balanced":
        raise ValueError(f"synth: unknown init {init!r} (balanced, naive)")
    return {
        "embedding": EMBD_STD * spec.gain,
        "norm": NORM_JITTER,
        "bias": BIAS_STD,
        "input": 1.0 / math.sqrt(spec.n_in),
        "router": ROUTER_SPREAD / math.sqrt(spec.n_in),
        "residual": RESIDUAL_GAIN * EMBD_STD * spec.gain / math.sqrt(spec.n_in),
    }[spec.role]


def tensor_rng(seed: int, name: str, chunk: int = 0) -> np.random.Generator:
    """The generator of one chunk of one tensor: stable across runs and machines (no salted ``hash()``)."""
    digest = hashlib.sha256(name.encode()).digest()
    words = np.frombuffer(digest[:16], dtype="<u4").tolist()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *words, chunk])))


@lru_cache(maxsize=None)
def _unit_factor(qtype: str) -> float:
    """Factor that brings centred random blocks of ``qtype`` to RMS 1 (measured once, fixed seed)."""
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(12345)
    n_in = 16 * max(fmt.block_size, 256)
    blocks = random_rows(fmt, 4096 * fmt.block_size // n_in + 1, n_in, rng)
    flat = blocks.reshape(-1, fmt.type_size)
    center_blocks(fmt, flat, rng)
    w = dequantize(blocks, GGMLQuantizationType(fmt.ggml_type)).astype(np.float64)
    return 1.0 / math.sqrt(float(np.mean(w * w)))


def chunk_jobs(spec: TensorSpec, seed: int, init: str = "balanced") -> list[Callable[[], np.ndarray]]:
    """One tensor's bytes as jobs, each returning uint8 for a run of whole rows, in file order.

    Each chunk (``CHUNK_BYTES`` of rows, a function of the shape only) has its own generator, so
    chunks can be generated in any order or in parallel and the bytes stay the same.
    """
    fmt, std = spec.fmt, weight_std(spec, init)
    if spec.role == "norm":
        if spec.qtype != "F32":
            raise ValueError(f"synth: norm tensor {spec.name} must be F32")

        def norm() -> np.ndarray:
            w = 1.0 + std * tensor_rng(seed, spec.name).standard_normal(spec.n_rows * spec.n_in)
            return w.astype(np.float32).view(np.uint8)
        return [norm]
    def rows(k: int, n: int) -> np.ndarray:
        rng = tensor_rng(seed, spec.name, k)
        if init == "naive":  # uncentred blocks, scaled by random_rows' own measurement
            return random_rows(fmt, n, spec.n_in, rng, std=std).reshape(-1)
        blocks = random_rows(fmt, n, spec.n_in, rng).reshape(-1, fmt.type_size)
        center_blocks(fmt, blocks, rng)
        # a factor measured once per format (random_rows(std=...) measures on every call: too
        # slow for 17 GB); random_blocks draws the float formats with std FLOAT_STD
        scale_blocks(fmt, blocks, std / FLOAT_STD if fmt.float_elems else std * _unit_factor(spec.qtype))
        return blocks.reshape(-1)

    chunk_rows = max(1, CHUNK_BYTES // fmt.row_bytes(spec.n_in))
    return [partial(rows, k, min(chunk_rows, spec.n_rows - r0))
            for k, r0 in enumerate(range(0, spec.n_rows, chunk_rows))]


def tensor_bytes(spec: TensorSpec, seed: int, init: str = "balanced") -> np.ndarray:
    """One whole tensor's bytes (uint8, flat); for tests and small tensors."""
    return np.concatenate([job() for job in chunk_jobs(spec, seed, init)])


def _ordered(jobs: Iterator[Callable[[], np.ndarray]], workers: int) -> Iterator[np.ndarray]:
    """Results of ``jobs`` in order, run on ``workers`` threads with at most 2 x workers in flight
    (numpy's generators and array ops release the GIL; memory stays a few chunks)."""
    if workers <= 1:
        yield from (job() for job in jobs)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="synth") as ex:
        pending: deque = deque()
        for job in jobs:
            pending.append(ex.submit(job))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# ---- tokenizer ---------------------------------------------------------------------------------

_WORDS = (
    "the of and to in is was for that on as with by he it at from his an are were which be this "
    "has also or had not first one their its new after but who they have her she two been other "
    "when there all during into school time may years more most only over city some world would "
    "where later up such used many can state about national out known university united then made "
    "team what we you do if so no my me your will just like how than people could because good"
).split()


def spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary (``tokenizer.ggml.model = llama``) of exactly n_vocab tokens.

    ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2, the 256 byte tokens ``<0x00>``..``<0xFF>``, then
    pieces: ``▁`` + common words, single characters, ``▁`` + characters, then consonant-vowel
    syllables with and without ``▁``, scored -1, -2, ... in that order.
    Returns (tokens, scores, token types). Raises ValueError if n_vocab < 260.
    """
    if n_vocab < 260:
        raise ValueError(f"synth: n_vocab {n_vocab} < 260 (3 control + 256 byte tokens + pieces)")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)] + [int(TokenType.BYTE)] * 256
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation

    def pieces() -> Iterator[str]:
        yield "▁"
        yield from ("▁" + w for w in _WORDS)
        yield from chars
        yield from ("▁" + ch for ch in chars)
        syl = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
        for n in range(1, 5):
            for idx in np.ndindex(*([len(syl)] * n)):
                s = "".join(syl[i] for i in idx)
                yield "▁" + s
                yield s

    seen = set(tokens)
    gen = pieces()
    while len(tokens) < n_vocab:
        p = next(gen)
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(int(TokenType.NORMAL))
    scores = [0.0] * 259 + [-float(i + 1) for i in range(n_vocab - 259)]
    return tokens, scores, types


# ---- the file ----------------------------------------------------------------------------------

class _Progress:
    """Prints written GB and GB/s to stderr every ``every`` seconds."""

    def __init__(self, total: int, every: float) -> None:
        self.total, self.every, self.done = total, every, 0
        self.t0 = self.last = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            print(f"synth: {self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB, "
                  f"{self.done / 1e9 / (now - self.t0):.2f} GB/s", file=sys.stderr, flush=True)


def write_model(path: str | Path, config: SynthConfig, seed: int = 0, *, init: str = "balanced",
                workers: int = 0, progress: bool = False) -> int:
    """Write a synthetic GGUF of ``config`` to ``path``; returns the file size in bytes.

    Chunks are generated on ``workers`` threads (0: up to 8, one per core) and written in order;
    memory stays at a few chunks (``CHUNK_BYTES``) whatever the model size, and the bytes do
    not depend on ``workers``.
    Raises ValueError on an unknown architecture, quant type or init, or a shape that does not
    fit a quant type's block size (before the file is created).
    """
    specs = tensor_specs(config)
    weight_std(specs[0], init)  # validates init
    path = Path(path)
    partial_path = path.with_name(path.name + ".partial")  # renamed when complete
    w = GGUFWriter(partial_path, config.arch)
    w.add_name(config.name)
    w.add_quantization_version(2)
    ARCHS[config.arch][1](w, config)
    tokens, scores, types = spm_vocab(config.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for s in specs:
        w.add_tensor_info(s.name, (*s.shape[:-1], s.fmt.row_bytes(s.n_in)), np.dtype(np.uint8), s.nbytes,
                          raw_dtype=GGMLQuantizationType(s.fmt.ggml_type))
    for s in specs:  # measure the scale factors once, before the threads start
        if init == "balanced" and s.fmt.float_elems is None:
            _unit_factor(s.qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        size = _write_data(w, specs, seed, init, workers or min(8, os.cpu_count() or 1), progress)
        w.close()
        partial_path.replace(path)
    except BaseException:
        w.close()
        partial_path.unlink(missing_ok=True)
        raise
    return size


def _write_data(w: GGUFWriter, specs: list[TensorSpec], seed: int, init: str, workers: int,
                progress: bool) -> int:
    """Tensor data, chunk by chunk. GGUFWriter.write_tensor_data takes a whole tensor; this does
    what it does per tensor (pad to the alignment, the bytes, pad again) with the bytes in chunks."""
    assert w.fout is not None and len(w.fout) == 1
    fout = w.fout[0]
    prog = _Progress(sum(s.nbytes for s in specs), 3.0) if progress else None
    jobs = [(i, job) for i, s in enumerate(specs) for job in chunk_jobs(s, seed, init)]
    written = [0] * len(specs)
    for (i, _), chunk in zip(jobs, _ordered((job for _, job in jobs), workers)):
        if written[i] == 0:  # the tensor's first chunk
            w.tensors[0].pop(specs[i].name)
            w.write_padding(fout, fout.tell())
        chunk.tofile(fout)
        written[i] += chunk.nbytes
        if written[i] == specs[i].nbytes:
            w.write_padding(fout, specs[i].nbytes)
        if prog:
            prog.add(chunk.nbytes)
    assert written == [s.nbytes for s in specs]
    return fout.tell()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m moecache.testing.synth", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", choices=["balanced", "naive"], default="balanced")
    ap.add_argument("-o", "--output", required=True, help="GGUF file to write")
    ap.add_argument("--workers", type=int, default=0, help="generator threads (0: one per core, up to 8)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a SynthConfig field of the preset, e.g. --set n_layer=8 (repeatable)")
    a = ap.parse_args(argv)
    cfg = PRESETS[a.preset]
    for kv in a.set:
        field, _, value = kv.partition("=")
        if field not in SynthConfig.__dataclass_fields__:
            ap.error(f"--set: unknown field {field!r}")
        cur = getattr(cfg, field)
        try:
            if isinstance(cur, bool):  # bool("false") is True
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                cfg = replace(cfg, **{field: value.lower() in ("true", "1")})
            else:
                cfg = replace(cfg, **{field: type(cur)(value)})
        except ValueError:
            ap.error(f"--set {field}: {value!r} is not a valid {type(cur).__name__}")
    t0 = time.perf_counter()
    try:
        size = write_model(a.output, cfg, a.seed, init=a.init, workers=a.workers, progress=True)
    except (ValueError, OSError) as e:
        ap.exit(1, f"error: {a.output}: {getattr(e, 'strerror', None) or e}\n")
    dt = time.perf_counter() - t0
    from moecache.sizes import format_size

    print(f"synth: wrote {a.output}: {format_size(size)} in {dt:.1f} s ({size / 1e9 / dt:.2f} GB/s)", file=sys.stderr)


if __name__ == "__main__":
    main()
