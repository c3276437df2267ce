"""Integer block dots of 8-bit activations, written in LLVM IR: the CPU's 8-bit expert kernels.

With ``act_q8`` the CPU expert kernel (:func:`moecache.quants.cpu.moe_ffn`) rounds each activation
row once per layer by the GPU's rule (:mod:`moecache.quants.act_q8`: per 32 values ``d = max|x| /
127``, ``q = rint(x / d)``) and multiplies the weights' integer quants into those int8 values with
integer products, the idea of llama.cpp's CPU ``vec_dot`` kernels (there the activations are
rounded per 256 values). Numba widens every uint8/int8 product to int64, so the dots are written
in LLVM IR (a function per format, linked into the kernels that call it through
:data:`ROW_DOTS`): on a CPU with AVX512-VNNI each 64 byte products take one ``vpdpbusd``
(``llvm.x86.avx512.vpdpbusd.512``), elsewhere the same lanes are summed by portable vector IR
(LLVM picks the instructions), so both give the same integers.

Every row dot asks for the weights :data:`PREFETCH_BYTES` ahead of the block it reads
(``llvm.prefetch``), and so do the float kernels' one-token dots through :func:`prefetcher_for`:
without it a core waits for each cache line (bench/results/kernels-2core-prefetch.md).

Formats: Q4_K and Q6_K (the two of a Q4_K_M file's experts), Q5_K (a Q5_K_M file's, a variant of
Q4_K's IR: :func:`_q4k_ir`), Q8_0 (:func:`_q80_ir`); the others take the float kernel on the
rounded values. Q6_K: see :func:`_q6k_ir`.

Q4_K (layout: ggml-common.h ``block_q4_K``; the scale unpacking is ``blocks256._scale_min_k4``'s,
done on three 32-bit words): for sub-block j of 32 weights with 6-bit scale ``sc_j`` and min
``m_j``, weight ``d*sc_j*n - dmin*m_j`` (n the nibble); with activation quants ``q`` of scale
``dx_j``, the block's dot is ``sum_j d*sc_j*dx_j * sum(n*q) - dmin * sum_j m_j * dx_j*sum(q)``.
The integer sums ``sum(n*q)`` are exact; the float combination runs in 16 vector lanes, summed once
per row. The per-32 sums ``dx_j*sum(q)`` come from :func:`quantize_rows` (``xs``).
"""

from __future__ import annotations

from moecache.quants import _numba_setup  # noqa: F401  (configures numba before any @njit)

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import errors, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

Q8_0_BYTES = 34  # bytes of one block_q8_0 (32 weights)
Q4_K_BYTES = 144  # bytes of one block_q4_K (256 weights)
Q5_K_BYTES = 176  # bytes of one block_q5_K
Q6_K_BYTES = 210  # bytes of one block_q6_K

# How far ahead of the block it reads each row dot asks the CPU to fetch the weights
# (``llvm.prefetch``, one request per cache line). One core streaming a Q4_K matrix from RAM read
# 5.0 GB/s without it (the dot waits for each line: 8 ns of arithmetic per block, 29 ns per block
# from RAM) and 13.3 GB/s with it, 88% of what the core's plain read loop gets (development VM,
# one thread; 512 B ahead: 12.0, 1 KiB: 12.9, 4 KiB: 9.6-11.8). Reading past a matrix's end only
# fetches lines that are never used (2 KiB per expert matrix of ~0.8 MiB).
PREFETCH_BYTES = 2048


def host_has_vnni() -> bool:
    """Whether Numba compiles for a CPU with AVX512-VNNI and AVX512-BW (``vpdpbusd`` on 512 bits):
    the features of its CPU target (``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES`` respected, so a
    generic target takes the portable IR rather than an instruction it cannot select)."""
    from numba.core.registry import cpu_target

    feats = set(getattr(cpu_target.target_context.codegen(), "_tm_features", "").split(","))
    return {"+avx512vnni", "+avx512bw", "+avx512f"} <= feats


def _dot_ir(name: str, vnni: bool) -> list[str]:
    """IR lines computing ``%name = <16 x i32>`` lane sums of ``%n_<name>`` (u8) times ``%x_<name>``
    (s8), both <64 x i8>: lane i sums the products of bytes 4i .. 4i+3 (``vpdpbusd``'s lanes)."""
    if vnni:
        return [f"  %{name} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, "
                f"<64 x i8> %n_{name}, <64 x i8> %x_{name})"]
    lines = [f"  %zn_{name} = zext <64 x i8> %n_{name} to <64 x i32>",
             f"  %sx_{name} = sext <64 x i8> %x_{name} to <64 x i32>",
             f"  %m_{name} = mul <64 x i32> %zn_{name}, %sx_{name}"]
    for k in range(4):
        idx = ", ".join(f"i32 {4 * i + k}" for i in range(16))
        lines.append(f"  %m{k}_{name} = shufflevector <64 x i32> %m_{name}, <64 x i32> poison, <16 x i32> <{idx}>")
    lines += [f"  %a_{name} = add <16 x i32> %m0_{name}, %m1_{name}",
              f"  %b_{name} = add <16 x i32> %m2_{name}, %m3_{name}",
              f"  %{name} = add <16 x i32> %a_{name}, %b_{name}"]
    return lines


def _prefetch_ir(p: str, ptr: str, nbytes: int) -> list[str]:
    """IR lines asking for the cache lines of the ``nbytes`` at ``ptr`` + :data:`PREFETCH_BYTES`
    (read, keep in all cache levels): one request per 64 bytes, so that consecutive iterations
    that step ``nbytes`` cover every line of a row."""
    lines = []
    for i in range(-(-nbytes // 64)):
        lines += [f"  %{p}pf{i} = getelementptr i8, ptr {ptr}, i64 {PREFETCH_BYTES + 64 * i}",
                  f"  call void @llvm.prefetch.p0(ptr %{p}pf{i}, i32 0, i32 3, i32 1)"]
    return lines


def _splat(ty: str, n: int, v: str) -> str:
    return f"<{', '.join(f'{ty} {v}' for _ in range(n))}>"


def _halves_ir(p: str, ptr: str, n: int) -> list[str]:
    """IR lines widening the ``n`` IEEE halves at ``ptr`` to ``%<p>d = <n x float>`` with integer
    ops (no half type: a target without F16C would call a conversion routine the JIT does not
    link). The magnitude's bits move to a float's place and its exponent is rebased by integer
    addition (112 << 23); inf and NaN get the all-ones exponent; a subnormal half (exponent 0) is
    rebased one step further and 2^-14 subtracted, which renormalizes it exactly. No operand of a
    float instruction is ever a float subnormal: on x86 each subnormal operand costs a microcode
    assist (a scale of 1e-4, common in Q4_K files, made the row dot 6x slower when the rebase was a
    multiplication by 2^112)."""
    v = lambda ty: f"<{n} x {ty}>"  # noqa: E731
    c = lambda x: _splat("i32", n, x)  # noqa: E731
    two14 = ", ".join(["float 0x3F10000000000000"] * n)  # 2^-14, the smallest normal half
    return [f"  %{p}w = load {v('i16')}, ptr {ptr}, align 1",
            f"  %{p}z = zext {v('i16')} %{p}w to {v('i32')}",
            f"  %{p}ab = and {v('i32')} %{p}z, {c('32767')}",
            f"  %{p}sh = shl {v('i32')} %{p}ab, {c('13')}",
            f"  %{p}ex = and {v('i32')} %{p}sh, {c('260046848')}",  # 0x0F800000: the half's exponent
            f"  %{p}nb = add {v('i32')} %{p}sh, {c('939524096')}",  # 112 << 23: a normal half's bits
            f"  %{p}nf = icmp eq {v('i32')} %{p}ex, {c('260046848')}",
            f"  %{p}inf = or {v('i32')} %{p}sh, {c('2139095040')}",  # 0x7F800000: inf / NaN
            f"  %{p}sub = icmp eq {v('i32')} %{p}ex, {c('0')}",
            f"  %{p}sb1 = add {v('i32')} %{p}sh, {c('947912704')}",  # 113 << 23: 2^-14 * (1 + m / 1024)
            f"  %{p}sf1 = bitcast {v('i32')} %{p}sb1 to {v('float')}",
            f"  %{p}sf = fsub {v('float')} %{p}sf1, <{two14}>",  # 2^-14 * m / 1024, exact
            f"  %{p}sbits = bitcast {v('float')} %{p}sf to {v('i32')}",
            f"  %{p}m1 = select {v('i1')} %{p}nf, {v('i32')} %{p}inf, {v('i32')} %{p}nb",
            f"  %{p}mb = select {v('i1')} %{p}sub, {v('i32')} %{p}sbits, {v('i32')} %{p}m1",
            f"  %{p}sg0 = and {v('i32')} %{p}z, {c('32768')}",
            f"  %{p}sg = shl {v('i32')} %{p}sg0, {c('16')}",
            f"  %{p}bits = or {v('i32')} %{p}mb, %{p}sg",
            f"  %{p}d = bitcast {v('i32')} %{p}bits to {v('float')}"]


def _row_function(symbol: str, block_bytes: int, body: list[str], acc: str, accm: str | None = None) -> str:
    """``i32 @<symbol>(ptr row, ptr xq, ptr xd, ptr xs, i64 nb)``: a loop over the row's ``nb``
    blocks of ``block_bytes`` running ``body`` with ``%b`` the block, ``%blk`` its bytes, ``%xo``
    its first activation and ``%xdv`` its 8 activation scales; ``body`` leaves the new 16-lane float
    accumulator in ``acc`` (and an 8-lane one subtracted at the end in ``accm``); the lanes are
    summed once, after the loop. The float32 result is returned as its bits: Numba marks a call
    returning a float with its fastmath flags (no inf, no NaN), which would let LLVM fold the
    callers' check of an infinite or NaN result away."""
    head = [f"define i32 @{symbol}(ptr noalias readonly %row, ptr noalias readonly %xq, "
            "ptr noalias readonly %xd, ptr noalias readonly %xs, i64 %nb) alwaysinline {",
            "entry:",
            "  %any = icmp sgt i64 %nb, 0",
            "  br i1 %any, label %loop, label %done",
            "loop:",
            "  %b = phi i64 [0, %entry], [%bn, %loop]",
            f"  %acc = phi <16 x float> [zeroinitializer, %entry], [{acc}, %loop]"]
    done = [f"  %af = phi <16 x float> [zeroinitializer, %entry], [{acc}, %loop]"]
    if accm:
        head.append(f"  %accm = phi <8 x float> [zeroinitializer, %entry], [{accm}, %loop]")
        done.append(f"  %mf = phi <8 x float> [zeroinitializer, %entry], [{accm}, %loop]")
    head += [f"  %o = mul i64 %b, {block_bytes}",
             "  %blk = getelementptr i8, ptr %row, i64 %o",
             *_prefetch_ir("", "%blk", block_bytes),
             "  %xi = mul i64 %b, 8",
             "  %pxd = getelementptr float, ptr %xd, i64 %xi",
             "  %xdv = load <8 x float>, ptr %pxd, align 4",
             "  %xo = mul i64 %b, 256"]
    done.append("  %ra = call reassoc float @llvm.vector.reduce.fadd.v16f32(float 0.0, <16 x float> %af)")
    if accm:
        done += ["  %rm = call reassoc float @llvm.vector.reduce.fadd.v8f32(float 0.0, <8 x float> %mf)",
                 "  %r = fsub float %ra, %rm",
                 "  %rbits = bitcast float %r to i32",
                 "  ret i32 %rbits"]
    else:
        done += ["  %rbits = bitcast float %ra to i32",
                 "  ret i32 %rbits"]
    tail = ["  %bn = add i64 %b, 1",
            "  %more = icmp slt i64 %bn, %nb",
            "  br i1 %more, label %loop, label %done",
            "done:"]
    return "\n".join(head + body + tail + done + ["}"]) + "\n"


def _q4k_ir(vnni: bool, q5: bool = False) -> str:
    """``i32 @moecache_q4k_q8_row(ptr row, ptr xq, ptr xd, ptr xs, i64 nb)``: the dot of ``nb``
    Q4_K blocks at ``row`` with int8 quants ``xq`` (nb*256), their per-32 scales ``xd`` and scaled
    sums ``xs`` (float32, nb*8 each).

    ``q5``: ``@moecache_q5k_q8_row`` of Q5_K blocks instead (ggml-common.h ``block_q5_K``, 176 bytes:
    d, dmin, the same 12 scale bytes, qh[32], qs[128]): a weight's quant is its nibble plus 16 times
    bit ``s`` of ``qh[l]`` for sub-block ``s`` (``blocks256.deq_q5_k``'s layout), 0..31, still an
    unsigned byte for the same products."""
    nib15 = _splat("i8", 32, "15")
    nib4 = _splat("i8", 32, "4")
    qs_at = 48 if q5 else 16
    cat = ", ".join(f"i32 {i}" for i in range(64))
    body = [
        *_halves_ir("d", "%blk", 2),  # %dd: <2 x float> d, dmin
        "  %d = extractelement <2 x float> %dd, i64 0",
        "  %dmin = extractelement <2 x float> %dd, i64 1",
        "  %p0 = getelementptr i8, ptr %blk, i64 4",
        "  %w0 = load i32, ptr %p0, align 1",
        "  %p1 = getelementptr i8, ptr %blk, i64 8",
        "  %w1 = load i32, ptr %p1, align 1",
        "  %p2 = getelementptr i8, ptr %blk, i64 12",
        "  %w2 = load i32, ptr %p2, align 1",
        # scales j < 4: low 6 bits of bytes 0..3; mins j < 4: of bytes 4..7
        "  %sclo = and i32 %w0, 1061109567",  # 0x3F3F3F3F
        "  %mnlo = and i32 %w1, 1061109567",
        # j >= 4: low (scales) / high (mins) nibble of bytes 8..11, top 2 bits of bytes 0..3 / 4..7
        "  %t0 = and i32 %w2, 252645135",  # 0x0F0F0F0F
        "  %t1 = lshr i32 %w0, 2",
        "  %t2 = and i32 %t1, 808464432",  # 0x30303030
        "  %schi = or i32 %t0, %t2",
        "  %t3 = lshr i32 %w2, 4",
        "  %t4 = and i32 %t3, 252645135",
        "  %t5 = lshr i32 %w1, 2",
        "  %t6 = and i32 %t5, 808464432",
        "  %mnhi = or i32 %t4, %t6",
        "  %sv0 = insertelement <2 x i32> poison, i32 %sclo, i64 0",
        "  %sv = insertelement <2 x i32> %sv0, i32 %schi, i64 1",
        "  %sb = bitcast <2 x i32> %sv to <8 x i8>",
        "  %scf = uitofp <8 x i8> %sb to <8 x float>",
        "  %mv0 = insertelement <2 x i32> poison, i32 %mnlo, i64 0",
        "  %mv = insertelement <2 x i32> %mv0, i32 %mnhi, i64 1",
        "  %mb = bitcast <2 x i32> %mv to <8 x i8>",
        "  %mnf = uitofp <8 x i8> %mb to <8 x float>",
        "  %pxs = getelementptr float, ptr %xs, i64 %xi",
        "  %xsv = load <8 x float>, ptr %pxs, align 4",
        "  %d0 = insertelement <8 x float> poison, float %d, i64 0",
        "  %dv = shufflevector <8 x float> %d0, <8 x float> poison, <8 x i32> zeroinitializer",
        "  %m0 = insertelement <8 x float> poison, float %dmin, i64 0",
        "  %mv8 = shufflevector <8 x float> %m0, <8 x float> poison, <8 x i32> zeroinitializer",
        "  %fs0 = fmul <8 x float> %scf, %xdv",
        "  %fs = fmul <8 x float> %fs0, %dv",  # d * sc_j * dx_j
        "  %mm0 = fmul <8 x float> %mnf, %xsv",
        "  %accm1 = call <8 x float> @llvm.fma.v8f32(<8 x float> %mm0, <8 x float> %mv8, <8 x float> %accm)",
    ]
    if q5:
        body += ["  %pqh = getelementptr i8, ptr %blk, i64 16",
                 "  %qh = load <32 x i8>, ptr %pqh, align 1"]
    acc = "%acc"
    for p in range(4):  # qs[32p:32p+32]: low nibbles = sub-block 2p, high = 2p+1
        nm = f"i{p}"
        sel = ", ".join([f"i32 {2 * p}"] * 8 + [f"i32 {2 * p + 1}"] * 8)
        body += [
            f"  %pq{p} = getelementptr i8, ptr %blk, i64 {qs_at + 32 * p}",
            f"  %q{p} = load <32 x i8>, ptr %pq{p}, align 1",
            f"  %lo{p} = and <32 x i8> %q{p}, {nib15}",
            f"  %hi{p} = lshr <32 x i8> %q{p}, {nib4}",
        ]
        lo, hi = f"%lo{p}", f"%hi{p}"
        if q5:  # the fifth bit: bit 2p (low nibbles) and 2p+1 (high) of qh[l], worth 16
            for part, bit in (("lo", 2 * p), ("hi", 2 * p + 1)):
                body += [f"  %h{part}{p} = lshr <32 x i8> %qh, {_splat('i8', 32, str(bit))}",
                         f"  %h{part}b{p} = and <32 x i8> %h{part}{p}, {_splat('i8', 32, '1')}",
                         f"  %h{part}s{p} = shl <32 x i8> %h{part}b{p}, {nib4}",
                         f"  %{part}5{p} = or <32 x i8> %{part}{p}, %h{part}s{p}"]
            lo, hi = f"%lo5{p}", f"%hi5{p}"
        body += [
            f"  %n_{nm} = shufflevector <32 x i8> {lo}, <32 x i8> {hi}, <64 x i32> <{cat}>",
            f"  %xo{p} = add i64 %xo, {64 * p}",
            f"  %px{p} = getelementptr i8, ptr %xq, i64 %xo{p}",
            f"  %x_{nm} = load <64 x i8>, ptr %px{p}, align 1",
            *_dot_ir(nm, vnni),
            f"  %f{p} = sitofp <16 x i32> %{nm} to <16 x float>",
            f"  %s{p} = shufflevector <8 x float> %fs, <8 x float> poison, <16 x i32> <{sel}>",
            f"  %acc{p + 1} = call <16 x float> @llvm.fma.v16f32(<16 x float> %f{p}, <16 x float> %s{p}, "
            f"<16 x float> {acc})",
        ]
        acc = f"%acc{p + 1}"
    if q5:
        return _row_function("moecache_q5k_q8_row", Q5_K_BYTES, body, acc, "%accm1")
    return _row_function("moecache_q4k_q8_row", Q4_K_BYTES, body, acc, "%accm1")


def _q6k_ir(vnni: bool) -> str:
    """``i32 @moecache_q6k_q8_row(ptr row, ptr xq, ptr xd, ptr xs, i64 nb)``: the dot of ``nb``
    Q6_K blocks (ggml-common.h ``block_q6_K``, 210 bytes: ql[128], qh[64], int8 scales[16], f16 d)
    with int8 quants ``xq`` and their per-32 scales ``xd`` (``xs`` unused). Weight n*128 + j*32 + l
    (n < 2, j < 4, l < 32) is ``d * sc[n*8 + 2j + l//16] * (q - 32)``, q's low 4 bits nibble j//2 of
    ql[n*64 + (j%2)*32 + l], its high 2 bits bits 2j, 2j+1 of qh[n*32 + l] (``blocks256.deq_q6_k``'s
    layout). Sub-blocks j and j+1 (j even) fill one 64-byte vector of q against 64 activations;
    ``sum((q - 32) * x)`` per 4-lane group is ``dot(q, x) - 32 * dot(1, x)``, exact."""
    m15, m3 = _splat("i8", 64, "15"), _splat("i8", 32, "3")
    ones = _splat("i8", 64, "1")
    cat = ", ".join(f"i32 {i}" for i in range(64))
    body = [
        "  %pdh = getelementptr i8, ptr %blk, i64 208",
        *_halves_ir("d", "%pdh", 1),
        "  %d = extractelement <1 x float> %dd, i64 0",
        "  %d0 = insertelement <16 x float> poison, float %d, i64 0",
        "  %dv = shufflevector <16 x float> %d0, <16 x float> poison, <16 x i32> zeroinitializer",
        "  %psc = getelementptr i8, ptr %blk, i64 192",
        "  %scb = load <16 x i8>, ptr %psc, align 1",
        "  %scf = sitofp <16 x i8> %scb to <16 x float>",
        "  %sd = fmul <16 x float> %scf, %dv",  # d * sc, one per 16 weights
    ]
    acc = "%acc"
    for n in range(2):
        body += [
            f"  %pl{n} = getelementptr i8, ptr %blk, i64 {64 * n}",
            f"  %ql{n} = load <64 x i8>, ptr %pl{n}, align 1",
            f"  %ph{n} = getelementptr i8, ptr %blk, i64 {128 + 32 * n}",
            f"  %qh{n} = load <32 x i8>, ptr %ph{n}, align 1",
        ]
        for half in range(2):  # sub-blocks j = 2*half, 2*half + 1
            k = f"{n}{half}"
            j0 = 2 * half
            lo = f"%ql{n}" if half == 0 else f"%qs{k}"
            if half == 1:
                body.append(f"  %qs{k} = lshr <64 x i8> %ql{n}, {_splat('i8', 64, '4')}")
            body += [
                f"  %nb{k} = and <64 x i8> {lo}, {m15}",
                f"  %ha{k} = lshr <32 x i8> %qh{n}, {_splat('i8', 32, str(2 * j0))}",
                f"  %hb{k} = lshr <32 x i8> %qh{n}, {_splat('i8', 32, str(2 * j0 + 2))}",
                f"  %ha3{k} = and <32 x i8> %ha{k}, {m3}",
                f"  %hb3{k} = and <32 x i8> %hb{k}, {m3}",
                f"  %hc{k} = shufflevector <32 x i8> %ha3{k}, <32 x i8> %hb3{k}, <64 x i32> <{cat}>",
                f"  %hs{k} = shl <64 x i8> %hc{k}, {_splat('i8', 64, '4')}",
                f"  %n_q{k} = or <64 x i8> %nb{k}, %hs{k}",
                f"  %xo{k} = add i64 %xo, {128 * n + 64 * half}",
                f"  %px{k} = getelementptr i8, ptr %xq, i64 %xo{k}",
                f"  %x_q{k} = load <64 x i8>, ptr %px{k}, align 1",
                f"  %n_o{k} = bitcast <64 x i8> {ones} to <64 x i8>",
                f"  %x_o{k} = bitcast <64 x i8> %x_q{k} to <64 x i8>",
                *_dot_ir(f"q{k}", vnni),
                *_dot_ir(f"o{k}", vnni),
                f"  %o32{k} = shl <16 x i32> %o{k}, {_splat('i32', 16, '5')}",
                f"  %iq{k} = sub <16 x i32> %q{k}, %o32{k}",
                f"  %f{k} = sitofp <16 x i32> %iq{k} to <16 x float>",
            ]
            # lanes 4g .. 4g+3 hold 16 weights of scale n*8 + 2j + (g % 2), j = j0 + g // 2
            scl = ", ".join(f"i32 {n * 8 + 2 * (j0 + g // 2) + g % 2}" for g in range(4) for _ in range(4))
            dxl = ", ".join(f"i32 {n * 4 + j0 + g // 2}" for g in range(4) for _ in range(4))
            body += [
                f"  %s{k} = shufflevector <16 x float> %sd, <16 x float> poison, <16 x i32> <{scl}>",
                f"  %u{k} = shufflevector <8 x float> %xdv, <8 x float> poison, <16 x i32> <{dxl}>",
                f"  %w{k} = fmul <16 x float> %s{k}, %u{k}",
                f"  %acc{k} = call <16 x float> @llvm.fma.v16f32(<16 x float> %f{k}, <16 x float> %w{k}, "
                f"<16 x float> {acc})",
            ]
            acc = f"%acc{k}"
    return _row_function("moecache_q6k_q8_row", Q6_K_BYTES, body, acc)


def _signed_dot_ir(pre: str, q: str, vnni: bool) -> list[str]:
    """IR lines giving ``%<pre>f = <16 x float>``: the lane sums (:func:`_dot_ir`'s lanes) of the
    signed bytes ``q`` (<64 x i8>) times the signed activations ``%x_<pre>p`` (<64 x i8>, defined
    by the caller), converted to float. ``vpdpbusd`` takes an unsigned factor: it multiplies
    ``q + 128`` (the top bit flipped) and 128 times the activations' lane sums are subtracted,
    exact in int32."""
    return [f"  %n_{pre}p = xor <64 x i8> {q}, {_splat('i8', 64, '-128')}",
            f"  %n_{pre}o = bitcast <64 x i8> {_splat('i8', 64, '1')} to <64 x i8>",
            f"  %x_{pre}o = bitcast <64 x i8> %x_{pre}p to <64 x i8>",
            *_dot_ir(f"{pre}p", vnni),
            *_dot_ir(f"{pre}o", vnni),
            f"  %{pre}o128 = shl <16 x i32> %{pre}o, {_splat('i32', 16, '7')}",
            f"  %{pre}iq = sub <16 x i32> %{pre}p, %{pre}o128",
            f"  %{pre}f = sitofp <16 x i32> %{pre}iq to <16 x float>"]


def _q80_ir(vnni: bool) -> str:
    """``i32 @moecache_q80_q8_row(ptr row, ptr xq, ptr xd, ptr xs, i64 nb)``: the dot of ``nb`` Q8_0
    blocks (ggml-common.h ``block_q8_0``, 34 bytes: f16 d, int8 qs[32]) with int8 quants ``xq``
    (nb*32) and their per-32 scales ``xd`` (nb; ``xs`` unused), two blocks per iteration and an odd
    last one on its own (both factors signed: :func:`_signed_dot_ir`)."""
    cat = ", ".join(f"i32 {i}" for i in range(64))
    half = ", ".join(["i32 0"] * 8 + ["i32 1"] * 8)
    lines = ["define i32 @moecache_q80_q8_row(ptr noalias readonly %row, ptr noalias readonly %xq, "
             "ptr noalias readonly %xd, ptr noalias readonly %xs, i64 %nb) alwaysinline {",
             "entry:",
             "  %np = lshr i64 %nb, 1",
             "  %any = icmp sgt i64 %np, 0",
             "  br i1 %any, label %loop, label %done",
             "loop:",
             "  %i = phi i64 [0, %entry], [%in, %loop]",
             "  %acc = phi <16 x float> [zeroinitializer, %entry], [%acc1, %loop]",
             f"  %off = mul i64 %i, {2 * Q8_0_BYTES}",
             "  %blk = getelementptr i8, ptr %row, i64 %off",
             f"  %blkb = getelementptr i8, ptr %blk, i64 {Q8_0_BYTES}",
             *_prefetch_ir("", "%blk", 2 * Q8_0_BYTES),
             *_halves_ir("a", "%blk", 1),
             *_halves_ir("b", "%blkb", 1),
             "  %da = extractelement <1 x float> %ad, i64 0",
             "  %db = extractelement <1 x float> %bd, i64 0",
             "  %pqa = getelementptr i8, ptr %blk, i64 2",
             "  %qa = load <32 x i8>, ptr %pqa, align 1",
             f"  %pqb = getelementptr i8, ptr %blk, i64 {Q8_0_BYTES + 2}",
             "  %qb = load <32 x i8>, ptr %pqb, align 1",
             f"  %qab = shufflevector <32 x i8> %qa, <32 x i8> %qb, <64 x i32> <{cat}>",
             "  %xo = mul i64 %i, 64",
             "  %px = getelementptr i8, ptr %xq, i64 %xo",
             "  %x_p = load <64 x i8>, ptr %px, align 1",
             *_signed_dot_ir("", "%qab", vnni),
             "  %xi = mul i64 %i, 2",
             "  %pxd = getelementptr float, ptr %xd, i64 %xi",
             "  %xdv = load <2 x float>, ptr %pxd, align 4",
             "  %dab0 = insertelement <2 x float> poison, float %da, i64 0",
             "  %dab = insertelement <2 x float> %dab0, float %db, i64 1",
             "  %sc2 = fmul <2 x float> %dab, %xdv",
             f"  %sc = shufflevector <2 x float> %sc2, <2 x float> poison, <16 x i32> <{half}>",
             "  %acc1 = call <16 x float> @llvm.fma.v16f32(<16 x float> %f, <16 x float> %sc, <16 x float> %acc)",
             "  %in = add i64 %i, 1",
             "  %more = icmp slt i64 %in, %np",
             "  br i1 %more, label %loop, label %done",
             "done:",
             "  %af = phi <16 x float> [zeroinitializer, %entry], [%acc1, %loop]",
             "  %odd = and i64 %nb, 1",
             "  %has = icmp ne i64 %odd, 0",
             "  br i1 %has, label %tail, label %fin",
             # the last block of an odd count: its 32 bytes against 32 activations, both padded with
             # zeros to 64 (a padded weight byte becomes 0x80, times a zero activation: nothing)
             "tail:",
             f"  %toff = mul i64 %np, {2 * Q8_0_BYTES}",
             "  %tblk = getelementptr i8, ptr %row, i64 %toff",
             *_halves_ir("t", "%tblk", 1),
             "  %dt = extractelement <1 x float> %td, i64 0",
             "  %ptq = getelementptr i8, ptr %tblk, i64 2",
             "  %tq = load <32 x i8>, ptr %ptq, align 1",
             f"  %tq64 = shufflevector <32 x i8> %tq, <32 x i8> zeroinitializer, <64 x i32> <{cat}>",
             "  %txo = mul i64 %np, 64",
             "  %ptx = getelementptr i8, ptr %xq, i64 %txo",
             "  %tx = load <32 x i8>, ptr %ptx, align 1",
             f"  %x_tp = shufflevector <32 x i8> %tx, <32 x i8> zeroinitializer, <64 x i32> <{cat}>",
             *_signed_dot_ir("t", "%tq64", vnni),
             "  %txi = shl i64 %np, 1",
             "  %ptxd = getelementptr float, ptr %xd, i64 %txi",
             "  %txd = load float, ptr %ptxd, align 4",
             "  %tsc1 = fmul float %dt, %txd",
             "  %tsc0 = insertelement <16 x float> poison, float %tsc1, i64 0",
             "  %tsc = shufflevector <16 x float> %tsc0, <16 x float> poison, <16 x i32> zeroinitializer",
             "  %acct = call <16 x float> @llvm.fma.v16f32(<16 x float> %tf, <16 x float> %tsc, <16 x float> %af)",
             "  br label %fin",
             "fin:",
             "  %afin = phi <16 x float> [%af, %done], [%acct, %tail]",
             "  %ra = call reassoc float @llvm.vector.reduce.fadd.v16f32(float 0.0, <16 x float> %afin)",
             "  %rbits = bitcast float %ra to i32",
             "  ret i32 %rbits",
             "}"]
    return "\n".join(lines) + "\n"


def module_ir(vnni: bool) -> str:
    """The LLVM IR module of every row dot (:data:`ROW_DOTS`), with ``vpdpbusd`` or portable IR."""
    decls = [
        "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)" if vnni else "",
        "declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
        "declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)",
        "declare float @llvm.vector.reduce.fadd.v16f32(float, <16 x float>)",
        "declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)",
        "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
    ]
    pf = "".join(_prefetch_function_ir(n) for n in PREFETCH_LINES)
    return "\n".join(decls) + "\n" + _q4k_ir(vnni) + _q4k_ir(vnni, q5=True) + _q6k_ir(vnni) + _q80_ir(vnni) + pf


PREFETCH_LINES = (1, 2, 3, 4, 5)  # the prefetch functions: up to 320 bytes a step (Q8_0's 8 blocks: 272)


def _prefetch_function_ir(n_lines: int) -> str:
    """``void @moecache_prefetch<n>(ptr p)``: :func:`_prefetch_ir` of ``64 * n_lines`` bytes."""
    return "\n".join([f"define void @moecache_prefetch{n_lines}(ptr %p) alwaysinline {{", "entry:",
                      *_prefetch_ir("", "%p", 64 * n_lines), "  ret void", "}"]) + "\n"


_LIBS: dict[int, object] = {}  # id(codegen) -> its code library of the IR functions


def _library(context):
    cg = context.codegen()
    lib = _LIBS.get(id(cg))
    if lib is None:
        lib = cg.create_library("moecache_int_dots")
        lib.add_llvm_module(llvm.parse_assembly(module_ir(host_has_vnni())))
        lib.finalize()
        _LIBS[id(cg)] = lib
    return lib


def _ir_function(context, builder, symbol: str, ret: ir.Type, n_ptrs: int, extra: tuple = ()):
    """The IR function ``symbol`` of :func:`module_ir` declared in the module being built (its
    library linked in): ``n_ptrs`` byte pointers, then the ``extra`` argument types."""
    context.active_code_library.add_linking_library(_library(context))
    i8p = ir.IntType(8).as_pointer()
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [i8p] * n_ptrs + list(extra)), symbol)


def _row_dot(fmt: str, symbol: str, block_bytes: int):
    """A Numba intrinsic ``(row, xq, xd, xs) -> float32`` calling the IR function ``symbol``: one row
    of ``fmt`` (uint8, nb * ``block_bytes``) dotted with an activation row rounded to 8 bits (``xq``
    int8, one per weight of the row; ``xd`` and ``xs`` float32, one per 32 of them: the scale and
    ``d * sum(q)``, :func:`quantize_row`). All C-contiguous 1-D (a TypingError otherwise); the lengths are not
    checked (the callers' shapes guarantee them)."""

    def typer(typingctx, row, xq, xd, xs):
        for a, dt in ((row, types.uint8), (xq, types.int8), (xd, types.float32), (xs, types.float32)):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt):
                raise errors.TypingError(f"{fmt} row dot: expected C-contiguous 1-D {dt} arrays, got {a}")
        sig = types.float32(row, xq, xd, xs)

        def codegen(context, builder, signature, args):
            i8p = ir.IntType(8).as_pointer()
            fn = _ir_function(context, builder, symbol, ir.IntType(32), 4, (ir.IntType(64),))
            arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
            nb = builder.udiv(arrs[0].nitems, ir.Constant(ir.IntType(64), block_bytes))
            ptrs = [builder.bitcast(a.data, i8p) for a in arrs]
            return builder.bitcast(builder.call(fn, [*ptrs, nb]), ir.FloatType())

        return sig, codegen

    typer.__name__ = f"{fmt.lower()}_row_dot"
    return intrinsic(typer)


def _prefetcher(n_lines: int):
    """A Numba intrinsic ``(row, o) -> None``: ask for the ``n_lines`` cache lines at the address
    ``row``'s data + ``o`` + :data:`PREFETCH_BYTES` bytes (``row`` a 1-D uint8 array, any layout:
    the kernels' rows are contiguous; a strided view would get a hint at the wrong place, which
    only costs the fetch). An address past the array's end is fine: a prefetch never faults, and
    the address is computed without ``inbounds``."""

    def typer(typingctx, row, o):
        if not (isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.uint8) \
                or not isinstance(o, types.Integer):
            raise errors.TypingError(f"prefetch: expected a 1-D uint8 array and an integer, got {row}, {o}")
        sig = types.none(row, o)

        def codegen(context, builder, signature, args):
            i8p = ir.IntType(8).as_pointer()
            fn = _ir_function(context, builder, f"moecache_prefetch{n_lines}", ir.VoidType(), 1)
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            off = context.cast(builder, args[1], signature.args[1], types.intp)
            builder.call(fn, [builder.gep(builder.bitcast(arr.data, i8p), [off])])
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"prefetch{n_lines}"
    return intrinsic(typer)


_PREFETCHERS = {n: _prefetcher(n) for n in PREFETCH_LINES}


def prefetcher_for(step_bytes: int):
    """The prefetch intrinsic (:func:`_prefetcher`) for a loop that steps ``step_bytes`` through a
    row: the CPU's float kernels call it once a step, as the IR row dots do. Raises ValueError
    outside 1 to ``64 * max(PREFETCH_LINES)`` bytes (a format with a larger step needs more lines
    in :data:`PREFETCH_LINES`)."""
    n = -(-step_bytes // 64)
    if n not in _PREFETCHERS:
        raise ValueError(f"prefetch: a step of {step_bytes} bytes; 1 to {64 * max(PREFETCH_LINES)} supported")
    return _PREFETCHERS[n]


q80_row_dot = _row_dot("Q8_0", "moecache_q80_q8_row", Q8_0_BYTES)
q4k_row_dot = _row_dot("Q4_K", "moecache_q4k_q8_row", Q4_K_BYTES)
q5k_row_dot = _row_dot("Q5_K", "moecache_q5k_q8_row", Q5_K_BYTES)
q6k_row_dot = _row_dot("Q6_K", "moecache_q6k_q8_row", Q6_K_BYTES)


@intrinsic
def finite_f32(typingctx, x):
    """Whether a float32 is finite, read from its exponent bits with integer ops. ``np.isfinite``
    cannot be trusted in a process that compiles fastmath kernels: LLVM folds it to True under
    no-inf/no-NaN flags, and Numba compiles the ufunc's float32 loop once per process, with the
    flags of the first kernel that uses it (measured: after the MoE kernel compiled,
    :func:`quantize_row` missed a NaN)."""
    if x != types.float32:
        raise errors.TypingError(f"finite_f32: expected float32, got {x}")

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        exp = builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7F800000))
        return builder.icmp_unsigned("!=", exp, ir.Constant(i32, 0x7F800000))

    return types.boolean(x), codegen


@intrinsic
def abs_bits_f32(typingctx, x):
    """The bits of ``|x|`` for a float32 ``x`` as a uint32 (the sign bit cleared): for finite values
    ordered as ``|x|`` is, and 0x7F800000 or more exactly when ``x`` is infinite or NaN, so one
    integer maximum gives a unit's largest magnitude and whether it is all finite (an integer max
    reduction vectorizes without fastmath, a float one does not)."""
    if x != types.float32:
        raise errors.TypingError(f"abs_bits_f32: expected float32, got {x}")

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7FFFFFFF))

    return types.uint32(x), codegen


@intrinsic
def f32_from_bits(typingctx, u):
    """The float32 whose bits are the uint32 ``u``."""
    if u != types.uint32:
        raise errors.TypingError(f"f32_from_bits: expected uint32, got {u}")

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(u), codegen


@njit(cache=True, nogil=True, fastmath=False)
def quantize_row(x, q, d, s, r):
    """Round one float32 row ``x`` (n,) to 8 bits per 32 values (the rule of
    :mod:`moecache.quants.act_q8`; compiled without fastmath, so ``x / d`` is a true division and
    the quants equal the GPU's): ``q`` int8 (n,), ``d`` float32 (n/32,) the scales, ``s`` float32
    (n/32,) ``d * sum(q)`` per 32, ``r`` float32 (n,) the rounded values ``q * d``. A unit holding
    an infinite or NaN value gets the scale, the sum and the rounded values NaN and the quants 0
    (its products NaN: nothing non-finite is lost), stored as constants: when a fastmath kernel in
    the process compiled first, this function's own float arithmetic on a NaN could not be trusted
    (measured: ``0 * NaN`` came out 0, see :func:`finite_f32`). A unit's largest magnitude and
    its finiteness come from one integer maximum of the values' bits (:func:`abs_bits_f32`): half
    the time of a float compare per value (a row of 2048 on the 2-core VM: 1.1 us, 2.2 before)."""
    for u in range(x.shape[0] // 32):
        o = u * 32
        mb = np.uint32(0)
        for i in range(32):
            mb = max(mb, abs_bits_f32(x[o + i]))
        if mb >= np.uint32(0x7F800000):  # an infinite or NaN value
            for i in range(32):
                q[o + i] = 0
                r[o + i] = np.float32(np.nan)
            d[u] = np.float32(np.nan)
            s[u] = np.float32(np.nan)
            continue
        dd = f32_from_bits(mb) / np.float32(127.0)
        t = np.int32(0)
        if dd > 0:
            for i in range(32):
                v = np.int32(np.rint(x[o + i] / dd))
                v = min(np.int32(127), max(np.int32(-127), v))  # |x / d| <= 127 but for a subnormal d
                q[o + i] = v
                r[o + i] = np.float32(v) * dd
                t += v
        else:
            for i in range(32):
                q[o + i] = 0
                r[o + i] = np.float32(0.0) * dd
        d[u] = dd
        s[u] = np.float32(t) * dd


@njit(cache=True, nogil=True, fastmath=False)
def quantize_rows(X, Q, D, S, R):
    """:func:`quantize_row` for each row of ``X`` float32 (n, m): ``Q`` int8 (n, m), ``D`` and ``S``
    float32 (n, m/32), ``R`` float32 (n, m)."""
    for t in range(X.shape[0]):
        quantize_row(X[t], Q[t], D[t], S[t], R[t])


# GGML type name -> the IR dot of one row of that format with 8-bit activations
ROW_DOTS = {"Q8_0": q80_row_dot, "Q4_K": q4k_row_dot, "Q5_K": q5k_row_dot, "Q6_K": q6k_row_dot}
