"""A float64 numpy reference forward, written for correctness and readability, not speed.

Reads a GGUF with gguf-py, dequantizes each tensor with ``gguf.quants.dequantize`` when it is
first needed, and runs the whole sequence at once (causal attention, no KV cache). Besides the
logits it records the router's choices per layer, so tests can check expert usage and compare a
real engine's routing and hidden states against it.

Architectures: qwen3moe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize


class RefModel:
    """Hyperparameters (``hp``, keys without the ``{arch}.`` prefix) and lazily dequantized weights."""

    def __init__(self, path: str | Path) -> None:
        self.reader = GGUFReader(path)
        self.arch = self._kv("general.architecture")
        self.hp = {k[len(self.arch) + 1:]: self._kv(k) for k in self.reader.fields
                   if k.startswith(self.arch + ".")}
        self._tensors = {t.name: t for t in self.reader.tensors}

    def _kv(self, key: str):
        return self.reader.fields[key].contents()

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def w(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float64, numpy order (``(n_expert, rows, n_in)`` for expert tensors)."""
        t = self._tensors[name]
        data = t.data.view(np.ndarray)  # the plain array, not a memmap: gguf-py splits it into many views
        return dequantize(data, GGMLQuantizationType(t.tensor_type)).astype(np.float64)


@dataclass
class RefOutput:
    """logits (n_tok, n_vocab); per layer the top-k expert ids and weights (n_tok, k) and the
    residual stream after the layer (n_tok, n_embd); expert usage counts (n_layer, n_expert)."""

    logits: np.ndarray
    expert_ids: list[np.ndarray] = field(default_factory=list)
    expert_weights: list[np.ndarray] = field(default_factory=list)
    usage: np.ndarray | None = None
    hidden: list[np.ndarray] = field(default_factory=list)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T for a weight w of shape (out, in). Uses einsum, not BLAS: single-threaded and
    independent of the BLAS build and thread count (a multi-threaded BLAS on a busy machine was
    40x slower here on these small matrices)."""
    return np.einsum("...i,oi->...o", x, w)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_neox(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """NeoX RoPE on (n_tok, n_head, head_dim): rotates the pairs (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    theta = base ** (-np.arange(half) * 2.0 / x.shape[-1])
    ang = pos[:, None, None] * theta[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal GQA: q (n_tok, n_head, d), k and v (n_tok, n_head_kv, d) -> (n_tok, n_head * d)."""
    n_tok, n_head, d = q.shape
    group = n_head // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n_tok, n_tok), dtype=bool))[None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(n_tok, n_head * d)


def moe(x: np.ndarray, router: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
        k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Softmax top-k routing with renormalized weights, SwiGLU experts.

    Returns (output (n_tok, n_embd), ids (n_tok, k), weights (n_tok, k)); ids are sorted by
    descending weight.
    """
    logits = linear(x, router)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    wts = np.take_along_axis(p, ids, axis=-1)
    wts /= wts.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        xe = x[tok]
        y = linear(silu(linear(xe, gate[e])) * linear(xe, up[e]), down[e])
        out[tok] += wts[tok, slot, None] * y
    return out, ids, wts


def forward_qwen3moe(m: RefModel, tokens: np.ndarray) -> RefOutput:
    hp = m.hp
    n_head, n_head_kv = hp["attention.head_count"], hp["attention.head_count_kv"]
    d = hp.get("attention.key_length", hp["embedding_length"] // n_head)
    eps, base, k = hp["attention.layer_norm_rms_epsilon"], hp["rope.freq_base"], hp["expert_used_count"]
    tokens = np.asarray(tokens)
    pos = np.arange(len(tokens), dtype=np.float64)
    h = m.w("token_embd.weight")[tokens]
    out = RefOutput(logits=np.empty(0))
    usage = np.zeros((hp["block_count"], hp["expert_count"]), dtype=np.int64)
    for i in range(hp["block_count"]):
        b = f"blk.{i}."
        x = rms_norm(h, m.w(b + "attn_norm.weight"), eps)
        q = linear(x, m.w(b + "attn_q.weight")).reshape(len(tokens), n_head, d)
        kk = linear(x, m.w(b + "attn_k.weight")).reshape(len(tokens), n_head_kv, d)
        v = linear(x, m.w(b + "attn_v.weight")).reshape(len(tokens), n_head_kv, d)
        q = rope_neox(rms_norm(q, m.w(b + "attn_q_norm.weight"), eps), pos, base)
        kk = rope_neox(rms_norm(kk, m.w(b + "attn_k_norm.weight"), eps), pos, base)
        h = h + linear(attention(q, kk, v), m.w(b + "attn_output.weight"))
        x = rms_norm(h, m.w(b + "ffn_norm.weight"), eps)
        y, ids, wts = moe(x, m.w(b + "ffn_gate_inp.weight"), m.w(b + "ffn_gate_exps.weight"),
                          m.w(b + "ffn_up_exps.weight"), m.w(b + "ffn_down_exps.weight"), k)
        h = h + y
        np.add.at(usage[i], ids.reshape(-1), 1)
        out.expert_ids.append(ids)
        out.expert_weights.append(wts)
        out.hidden.append(h)
    x = rms_norm(h, m.w("output_norm.weight"), eps)
    out.logits = linear(x, m.w("output.weight" if "output.weight" in m else "token_embd.weight"))
    out.usage = usage
    return out


FORWARDS = {"qwen3moe": forward_qwen3moe}


def forward(model: RefModel | str | Path, tokens: np.ndarray) -> RefOutput:
    """Run ``tokens`` (positions 0..n-1) through the model; dispatches on general.architecture."""
    m = model if isinstance(model, RefModel) else RefModel(model)
    if m.arch not in FORWARDS:
        raise NotImplementedError(f"reference: no forward for architecture {m.arch!r}")
    return FORWARDS[m.arch](m, tokens)
