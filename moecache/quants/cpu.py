"""CPU kernels (Numba): ``Y = X @ W.T`` straight from GGUF blocks, dequantization, and the grouped
MoE expert kernel that is the expert cache's miss path.

Structure (the pattern that compiled well in Numba, ../shared/style.md): a ``prange`` driver over
chunks of output rows calls a serial row-range kernel; the row-range kernel dequantizes one block of
one row into a small float32 scratch (``deq_block``, inlined per format) and dots it with every
token's slice of X, so each weight byte is read once per call whatever the number of tokens.
All kernels are ``nogil`` (the hybrid executor runs them beside the GPU) and cached on disk.

Shapes and dtypes:
    W: uint8 (n_out, row_bytes), a row-major GGUF tensor's bytes (rows = output features).
    X: float32 (n_tokens, n_in) or (n_in,).   Y: float32 (n_tokens, n_out) or (n_out,).
"""

from __future__ import annotations

from moecache.quants import _numba_setup  # noqa: F401  (must run before numba compiles)

import numba
import numpy as np
from numba import njit, prange

from moecache.quants.blocks32 import (deq_bf16, deq_f16, deq_f32, deq_iq4_nl, deq_mxfp4, deq_q4_0,
                                      deq_q4_1, deq_q5_0, deq_q5_1, deq_q8_0)
from moecache.quants.blocks256 import deq_iq4_xs, deq_q2_k, deq_q3_k, deq_q4_k, deq_q5_k, deq_q6_k
from moecache.quants.formats import BlockFormat, format_for

_KERNEL = dict(cache=True, nogil=True, fastmath=True)
_INLINE = dict(inline="always", **_KERNEL)

# Activations of the gated FFN (the `act` argument of moe_ffn).
ACT_SILU = 0   # SwiGLU: silu(gate) * up (qwen, mixtral, olmoe, deepseek)
ACT_GELU = 1   # GeGLU with tanh-approximated GELU (gemma)


@njit(**_INLINE)
def deq_block(fmt, blk, out, outu):
    """Dequantize one block of GGML type id ``fmt`` (see formats.FORMATS) into ``out``."""
    if fmt == 8:
        deq_q8_0(blk, out, outu)
    elif fmt == 12:
        deq_q4_k(blk, out, outu)
    elif fmt == 14:
        deq_q6_k(blk, out, outu)
    elif fmt == 13:
        deq_q5_k(blk, out, outu)
    elif fmt == 11:
        deq_q3_k(blk, out, outu)
    elif fmt == 10:
        deq_q2_k(blk, out, outu)
    elif fmt == 2:
        deq_q4_0(blk, out, outu)
    elif fmt == 3:
        deq_q4_1(blk, out, outu)
    elif fmt == 6:
        deq_q5_0(blk, out, outu)
    elif fmt == 7:
        deq_q5_1(blk, out, outu)
    elif fmt == 20:
        deq_iq4_nl(blk, out, outu)
    elif fmt == 23:
        deq_iq4_xs(blk, out, outu)
    elif fmt == 39:
        deq_mxfp4(blk, out, outu)
    elif fmt == 0:
        deq_f32(blk, out, outu)
    elif fmt == 1:
        deq_f16(blk, out, outu)
    elif fmt == 30:
        deq_bf16(blk, out, outu)


@njit(**_INLINE)
def deq_step(fmt, bs, tsz, g, row, b, buf, bufu):
    """Dequantize step ``b`` of a row: ``g`` consecutive blocks (g * bs weights) into ``buf``."""
    o = b * g * tsz
    for k in range(g):
        deq_block(fmt, row[o + k * tsz:o + (k + 1) * tsz], buf[k * bs:(k + 1) * bs], bufu[k * bs:(k + 1) * bs])


@njit(**_KERNEL)
def _matmul_rows(fmt, bs, tsz, g, W, X, Y, r0, r1):
    buf = np.empty(256, np.float32)
    bufu = buf.view(np.uint32)
    n_tok = X.shape[0]
    step = bs * g
    n_steps = X.shape[1] // step
    acc = np.empty(n_tok, np.float32)
    for r in range(r0, r1):
        acc[:] = 0.0
        for b in range(n_steps):
            deq_step(fmt, bs, tsz, g, W[r], b, buf, bufu)
            base = b * step
            for t in range(n_tok):
                s = np.float32(0.0)
                for i in range(step):
                    s += buf[i] * X[t, base + i]
                acc[t] += s
        for t in range(n_tok):
            Y[t, r] = acc[t]


@njit(parallel=True, **_KERNEL)
def _matmul(fmt, bs, tsz, g, W, X, Y, chunk):
    n = W.shape[0]
    n_chunks = (n + chunk - 1) // chunk
    for c in prange(n_chunks):
        _matmul_rows(fmt, bs, tsz, g, W, X, Y, c * chunk, min(n, (c + 1) * chunk))


@njit(**_KERNEL)
def _dequant_rows(fmt, bs, tsz, W, Out, r0, r1):
    buf = np.empty(256, np.float32)
    bufu = buf.view(np.uint32)
    nb = W.shape[1] // tsz
    for r in range(r0, r1):
        for b in range(nb):
            deq_block(fmt, W[r, b * tsz:(b + 1) * tsz], buf, bufu)
            for i in range(bs):
                Out[r, b * bs + i] = buf[i]


@njit(parallel=True, **_KERNEL)
def _dequant(fmt, bs, tsz, W, Out, chunk):
    n = W.shape[0]
    n_chunks = (n + chunk - 1) // chunk
    for c in prange(n_chunks):
        _dequant_rows(fmt, bs, tsz, W, Out, c * chunk, min(n, (c + 1) * chunk))


def kernel_block(fmt: BlockFormat) -> tuple[int, int]:
    """(weights, bytes) of the block the kernels decode at a time: the format's block, or 32
    elements for the plain float formats."""
    if fmt.float_elems is not None:
        return 32, 32 * fmt.type_size
    return fmt.block_size, fmt.type_size


def kernel_step(fmt: BlockFormat, n_in: int) -> tuple[int, int, int]:
    """(block weights, block bytes, blocks per step). A step is 256 weights where the row allows:
    one dot-product reduction per 256 weights instead of per 32 (measured ~4x faster for the
    32-weight formats on 2 cores)."""
    bs, tsz = kernel_block(fmt)
    g = 256 // bs if n_in % 256 == 0 else 1
    return bs, tsz, g


def _chunk(n_rows: int) -> int:
    # Enough chunks that every thread gets several (load balance), few enough that each chunk
    # amortises its scratch set-up.
    per = n_rows // (4 * numba.get_num_threads())
    return int(max(1, min(64, per)))


def _check_weights(W: np.ndarray, ggml_type: int, n_in: int, name: str | None) -> BlockFormat:
    fmt = format_for(ggml_type, name)
    bs, tsz = kernel_block(fmt)
    if n_in % bs:
        raise ValueError(f"{name or fmt.name}: n_in={n_in} is not a multiple of {bs}")
    if W.dtype != np.uint8 or W.ndim != 2 or W.shape[1] != n_in // bs * tsz:
        raise ValueError(f"{name or fmt.name}: expected uint8 weights of shape (n_out, {n_in // bs * tsz}), "
                         f"got {W.dtype} {W.shape}")
    return fmt


def matmul(W: np.ndarray, ggml_type: int, x: np.ndarray, out: np.ndarray | None = None,
           name: str | None = None) -> np.ndarray:
    """``y = W @ x`` for a quantized GGUF matrix W, on all Numba threads.

    Args:
        W: uint8 (n_out, row_bytes) raw tensor bytes (a gguf-py ``tensor.data`` view works as is;
            for F32/F16/BF16 tensors pass ``data.view(np.uint8)``).
        ggml_type: GGML type id of W (``gguf.GGMLQuantizationType``).
        x: float32 (n_in,) or (n_tokens, n_in).
        out: optional float32 (n_out,) or (n_tokens, n_out) output buffer.
        name: tensor name, used in error messages.

    Returns:
        float32 (n_out,) or (n_tokens, n_out).

    Raises:
        UnsupportedQuantError: the type has no kernel. ValueError: inconsistent shapes.
    """
    W = np.asarray(W)
    X = np.ascontiguousarray(x, dtype=np.float32)
    vec = X.ndim == 1
    X2 = X.reshape(1, -1) if vec else X
    fmt = _check_weights(W, ggml_type, X2.shape[1], name)
    bs, tsz, g = kernel_step(fmt, X2.shape[1])
    n_out = W.shape[0]
    if out is None:
        Y = np.empty((X2.shape[0], n_out), np.float32)
    else:
        Y = out.reshape(X2.shape[0], n_out)
    _matmul(fmt.ggml_type, bs, tsz, g, W, X2, Y, _chunk(n_out))
    return Y.reshape(n_out) if vec else Y


def dequantize(W: np.ndarray, ggml_type: int, n_in: int, name: str | None = None) -> np.ndarray:
    """Dequantize a GGUF matrix: uint8 (n_out, row_bytes) -> float32 (n_out, n_in), all threads."""
    W = np.asarray(W)
    fmt = _check_weights(W, ggml_type, n_in, name)
    bs, tsz = kernel_block(fmt)
    out = np.empty((W.shape[0], n_in), np.float32)
    _dequant(fmt.ggml_type, bs, tsz, W, out, _chunk(W.shape[0]))
    return out


@njit(**_INLINE)
def _activate(act, g, u):
    if act == 0:
        return g / (np.float32(1.0) + np.exp(-g)) * u
    # GELU, tanh approximation (Hendrycks & Gimpel 2016), as ggml_gelu
    c = np.float32(0.7978845608028654)
    return np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g))) * u


@njit(**_KERNEL)
def _moe_gate_up_rows(fg, fu, kg, ku, Wg, Wu, e, p0, p1, rows, H, act, A, f0, f1):
    buf_g = np.empty(256, np.float32)
    bufu_g = buf_g.view(np.uint32)
    buf_u = np.empty(256, np.float32)
    bufu_u = buf_u.view(np.uint32)
    n = p1 - p0
    acc_g = np.empty(n, np.float32)
    acc_u = np.empty(n, np.float32)
    step_g = kg[0] * kg[2]
    step_u = ku[0] * ku[2]
    for f in range(f0, f1):
        acc_g[:] = 0.0
        acc_u[:] = 0.0
        for b in range(H.shape[1] // step_g):
            deq_step(fg, kg[0], kg[1], kg[2], Wg[e, f], b, buf_g, bufu_g)
            base = b * step_g
            for j in range(n):
                t = rows[p0 + j]
                s = np.float32(0.0)
                for i in range(step_g):
                    s += buf_g[i] * H[t, base + i]
                acc_g[j] += s
        for b in range(H.shape[1] // step_u):
            deq_step(fu, ku[0], ku[1], ku[2], Wu[e, f], b, buf_u, bufu_u)
            base = b * step_u
            for j in range(n):
                t = rows[p0 + j]
                s = np.float32(0.0)
                for i in range(step_u):
                    s += buf_u[i] * H[t, base + i]
                acc_u[j] += s
        for j in range(n):
            A[p0 + j, f] = _activate(act, acc_g[j], acc_u[j])


@njit(**_KERNEL)
def _moe_down_rows(fd, kd, Wd, eids, offs, rows, wts, A, Out, r0, r1):
    buf = np.empty(256, np.float32)
    bufu = buf.view(np.uint32)
    step = kd[0] * kd[2]
    n_steps = A.shape[1] // step
    for r in range(r0, r1):
        for g in range(eids.shape[0]):
            e = eids[g]
            for b in range(n_steps):
                deq_step(fd, kd[0], kd[1], kd[2], Wd[e, r], b, buf, bufu)
                base = b * step
                for p in range(offs[g], offs[g + 1]):
                    s = np.float32(0.0)
                    for i in range(step):
                        s += buf[i] * A[p, base + i]
                    Out[rows[p], r] += wts[p] * s


@njit(parallel=True, **_KERNEL)
def _moe_ffn(fg, fu, fd, kg, ku, kd, Wg, Wu, Wd, eids, offs, rows, wts, H, act, A, Out, f_chunk, r_chunk):
    n_groups = eids.shape[0]
    n_ff = Wg.shape[1]
    n_fc = (n_ff + f_chunk - 1) // f_chunk
    # phase 1: every (expert, ff-row chunk) job computes act(gate) * up for that expert's tokens
    for job in prange(n_groups * n_fc):
        g = job // n_fc
        c = job % n_fc
        _moe_gate_up_rows(fg, fu, kg, ku, Wg, Wu, eids[g], offs[g], offs[g + 1],
                          rows, H, act, A, c * f_chunk, min(n_ff, (c + 1) * f_chunk))
    # phase 2: every output-row chunk adds all experts' weighted down projections (no races:
    # a chunk owns its output columns)
    n_out = Wd.shape[1]
    n_rc = (n_out + r_chunk - 1) // r_chunk
    for c in prange(n_rc):
        _moe_down_rows(fd, kd, Wd, eids, offs, rows, wts, A, Out, c * r_chunk, min(n_out, (c + 1) * r_chunk))


def moe_ffn(gate_exps: np.ndarray, up_exps: np.ndarray, down_exps: np.ndarray,
            types: tuple[int, int, int], expert_ids: np.ndarray, offsets: np.ndarray,
            token_rows: np.ndarray, weights: np.ndarray, h: np.ndarray,
            out: np.ndarray | None = None, act: int = ACT_SILU) -> np.ndarray:
    """Weighted sum of gated-FFN experts for one MoE layer, in one parallel call.

    ``out[t] += sum over routed pairs (e, t, w) of w * down_e(act(gate_e(h[t])) * up_e(h[t]))``

    Args:
        gate_exps, up_exps: uint8 (n_expert, n_ff, row_bytes) ``blk.N.ffn_gate_exps``/``ffn_up_exps``.
        down_exps: uint8 (n_expert, n_embd, row_bytes) ``blk.N.ffn_down_exps``.
        types: GGML type ids of (gate, up, down).
        expert_ids: int32 (G,) the distinct experts to compute (CSR groups).
        offsets: int32 (G+1,) pairs of group g are ``offsets[g]:offsets[g+1]``.
        token_rows: int32 (P,) row of ``h`` for each pair.
        weights: float32 (P,) routing weight of each pair.
        h: float32 (n_tokens, n_embd) hidden states.
        out: float32 (n_tokens, n_embd) accumulated into; zeros if None.
        act: ACT_SILU (SwiGLU) or ACT_GELU (GeGLU).

    Returns:
        ``out``. Raises ValueError on inconsistent shapes, UnsupportedQuantError on unknown types.
    """
    gate_exps, up_exps, down_exps = (np.asarray(a) for a in (gate_exps, up_exps, down_exps))
    H = np.ascontiguousarray(h, dtype=np.float32)
    n_tok, n_embd = H.shape
    n_exp, n_ff = gate_exps.shape[:2]
    fg = _check_weights(gate_exps.reshape(-1, gate_exps.shape[2]), types[0], n_embd, "ffn_gate_exps")
    fu = _check_weights(up_exps.reshape(-1, up_exps.shape[2]), types[1], n_embd, "ffn_up_exps")
    fd = _check_weights(down_exps.reshape(-1, down_exps.shape[2]), types[2], n_ff, "ffn_down_exps")
    if up_exps.shape[:2] != (n_exp, n_ff) or down_exps.shape[:2] != (n_exp, n_embd):
        raise ValueError(f"expert tensor shapes disagree: gate {gate_exps.shape}, up {up_exps.shape}, "
                         f"down {down_exps.shape}, n_embd {n_embd}")
    eids = np.ascontiguousarray(expert_ids, dtype=np.int32)
    offs = np.ascontiguousarray(offsets, dtype=np.int32)
    rows = np.ascontiguousarray(token_rows, dtype=np.int32)
    wts = np.ascontiguousarray(weights, dtype=np.float32)
    if offs.shape != (eids.shape[0] + 1,) or offs[0] != 0 or offs[-1] != rows.shape[0] \
            or rows.shape != wts.shape or np.any(np.diff(offs) < 0):
        raise ValueError("moe_ffn: offsets must be a CSR index (G+1 ascending, from 0 to P) over token_rows/weights")
    if eids.size and (eids.min() < 0 or eids.max() >= n_exp):
        raise ValueError(f"moe_ffn: expert id out of range [0, {n_exp})")
    if rows.size and (rows.min() < 0 or rows.max() >= n_tok):
        raise ValueError(f"moe_ffn: token row out of range [0, {n_tok})")
    if out is None:
        out = np.zeros((n_tok, n_embd), np.float32)
    if rows.size == 0:
        return out
    A = np.empty((rows.shape[0], n_ff), np.float32)
    nt = numba.get_num_threads()
    # ff-row chunks: enough jobs across all experts for every thread
    f_chunk = int(max(4, min(64, n_ff * eids.shape[0] // (4 * nt))))
    _moe_ffn(fg.ggml_type, fu.ggml_type, fd.ggml_type, kernel_step(fg, n_embd), kernel_step(fu, n_embd),
             kernel_step(fd, n_ff), gate_exps, up_exps, down_exps, eids, offs, rows, wts, H, act, A, out,
             f_chunk, _chunk(n_embd))
    return out
