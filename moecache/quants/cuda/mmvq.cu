// Quantized matrix x few-token products with 8-bit activations: the decode GEMVs and the MoE expert
// products for Q4_0, Q8_0, Q4_K, Q5_K and Q6_K weights. Compiled together with dequant.cu (after
// it: f16_at, scale_min_k4, warp_sum, activate and MAX_TOK come from there). Written for moecache;
// the idea (activations rounded to int8 once per op, integer dot products of weight and activation
// quants, float scales per block) is llama.cpp's MMVQ; the code is not.
//
// Activations: quantize_q8 turns X float32 (R, n) into XQ int8 (R, n), XD float (R, n/32) and
// XS float (R, n/32): per 32 values d = max|x| / 127, q = rint(x / d) (0 when max|x| is 0),
// XS = d * sum(q). Formulas of the weight blocks: dequant.cu's decoders (ggml's block layouts).
//
// Work split: a row's blocks are cut into pieces (VDOT_<fmt> handles one piece of one block: a
// 32-weight unit, or two units that share their quant bytes); lpr lanes (a power of two <= 32)
// share a row, lane s taking pieces s, s + lpr, ...; a warp takes 32 / lpr rows, a block of
// MMVQ_WARPS warps 32 * MMVQ_WARPS / lpr rows. Weight quants are read as 16-byte words where
// the block layout is 16-byte aligned (Q4_K, Q5_K), else as 16-bit words.

#define MMVQ_WARPS 4
#ifndef MMVQ_UNROLL
#define MMVQ_UNROLL 1  // pieces of a lane's loop unrolled (their loads issued together)
#endif
#define MMVQ_PRAGMA_(x) _Pragma(#x)
#define MMVQ_PRAGMA(x) MMVQ_PRAGMA_(x)

// X (R, n) -> XQ, XD, XS for n_units = R * n / 32 units of 32 values; a warp per unit
extern "C" __global__ void quantize_q8(const float *X, signed char *XQ, float *XD, float *XS, long long n_units) {
    long long u = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (u >= n_units) return;  // uniform over the warp
    float x = X[u * 32 + lane];
    float amax = fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.f;
    int q = amax == 0.f ? 0 : __float2int_rn(x / d);
    XQ[u * 32 + lane] = (signed char)q;
    int s = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) {
        XD[u] = d;
        XS[u] = d * (float)s;
    }
}

// 32 activation quants of token t at xq (16-byte aligned) as 8 ints
__device__ __forceinline__ void load_x32(const signed char *xq, int *x) {
    const int4 *p = (const int4 *)xq;
    int4 a = p[0], b = p[1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

__device__ __forceinline__ int dot8(const int *w, const int *x) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a(w[i], x[i], s);
    return s;
}

// 16 bytes at a 2-byte aligned address as 4 ints
__device__ __forceinline__ void load16_u16(const unsigned char *p, int *v) {
    const unsigned short *h = (const unsigned short *)p;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (int)((unsigned int)h[2 * i] | ((unsigned int)h[2 * i + 1] << 16));
}

// Every VDOT_<fmt>(blk, sub, xq, xd, xs, sq, sd, n_tok, acc): acc[t] += piece sub of block blk .
// the block's activations of token t (xq + t * sq, xd + t * sd, xs + t * sd point at the block's
// first activation and scale).

// Q8_0: one piece per block (34 bytes: d, 32 int8)
__device__ __forceinline__ void vdot_q8_0(const unsigned char *blk, int, const signed char *xq, const float *xd,
                                          const float *, long long sq, long long sd, int n_tok, float *acc) {
    float d = f16_at(blk);
    int w[8];
    load16_u16(blk + 2, w);
    load16_u16(blk + 18, w + 4);
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
        if (t < n_tok) {
            int x[8];
            load_x32(xq + t * sq, x);
            acc[t] += d * xd[t * sd] * (float)dot8(w, x);
        }
    }
}

// Q4_0: one piece per block (18 bytes: d, 16 bytes of nibbles; weight l < 16 low nibble of byte l,
// weight 16 + l its high nibble); w = d (q - 8)
__device__ __forceinline__ void vdot_q4_0(const unsigned char *blk, int, const signed char *xq, const float *xd,
                                          const float *xs, long long sq, long long sd, int n_tok, float *acc) {
    float d = f16_at(blk);
    int v[4], w[8];
    load16_u16(blk + 2, v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = v[i] & 0x0F0F0F0F;
        w[i + 4] = (v[i] >> 4) & 0x0F0F0F0F;
    }
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
        if (t < n_tok) {
            int x[8];
            load_x32(xq + t * sq, x);
            acc[t] += d * (xd[t * sd] * (float)dot8(w, x) - 8.f * xs[t * sd]);
        }
    }
}

// Q4_K and Q5_K once their quants are bytes: units 2n (wa) and 2n + 1 (wb) of a block whose d, dmin
// (f16) and 12 bytes of 6-bit scales and mins start it; w = d * sc_j * q - dmin * m_j
__device__ __forceinline__ void vdot_k4_units(const unsigned char *blk, int n, const int *wa, const int *wb,
                                              const signed char *xq, const float *xd, const float *xs,
                                              long long sq, long long sd, int n_tok, float *acc) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * n, blk + 4, &sc0, &m0);
    scale_min_k4(2 * n + 1, blk + 4, &sc1, &m1);
    unsigned int dd = *(const unsigned int *)blk;
    float d = __half2float(__ushort_as_half((unsigned short)(dd & 0xFFFF)));
    float dmin = __half2float(__ushort_as_half((unsigned short)(dd >> 16)));
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
        if (t < n_tok) {
            const signed char *x0 = xq + t * sq + 64 * n;
            const float *dt = xd + t * sd + 2 * n, *st = xs + t * sd + 2 * n;
            int xa[8], xb[8];
            load_x32(x0, xa);
            load_x32(x0 + 32, xb);
            acc[t] += d * ((float)sc0 * dt[0] * (float)dot8(wa, xa) + (float)sc1 * dt[1] * (float)dot8(wb, xb)) -
                      dmin * ((float)m0 * st[0] + (float)m1 * st[1]);
        }
    }
}

// Q4_K: piece n < 4 = units 2n (low nibbles) and 2n + 1 (high nibbles) of qs[32n .. 32n + 32);
// w = d * sc_j * q - dmin * m_j
__device__ __forceinline__ void vdot_q4_k(const unsigned char *blk, int n, const signed char *xq, const float *xd,
                                          const float *xs, long long sq, long long sd, int n_tok, float *acc) {
    const uint4 *qp = (const uint4 *)(blk + 16 + 32 * n);
    uint4 q0 = qp[0], q1 = qp[1];
    unsigned int v[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    int wa[8], wb[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        wa[i] = (int)(v[i] & 0x0F0F0F0Fu);
        wb[i] = (int)((v[i] >> 4) & 0x0F0F0F0Fu);
    }
    vdot_k4_units(blk, n, wa, wb, xq, xd, xs, sq, sd, n_tok, acc);
}

// Q5_K: as Q4_K with the 5th bit of weight l of unit j in bit j of qh[l] (qh @16, qs @48)
__device__ __forceinline__ void vdot_q5_k(const unsigned char *blk, int n, const signed char *xq, const float *xd,
                                          const float *xs, long long sq, long long sd, int n_tok, float *acc) {
    const uint4 *qp = (const uint4 *)(blk + 48 + 32 * n), *hp = (const uint4 *)(blk + 16);
    uint4 q0 = qp[0], q1 = qp[1], h0 = hp[0], h1 = hp[1];
    unsigned int v[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    unsigned int h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    int wa[8], wb[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        wa[i] = (int)((v[i] & 0x0F0F0F0Fu) | (((h[i] >> (2 * n)) & 0x01010101u) << 4));
        wb[i] = (int)(((v[i] >> 4) & 0x0F0F0F0Fu) | (((h[i] >> (2 * n + 1)) & 0x01010101u) << 4));
    }
    vdot_k4_units(blk, n, wa, wb, xq, xd, xs, sq, sd, n_tok, acc);
}

// Q6_K (210-byte blocks: 2-byte aligned): piece p = 2n + a (n, a < 2) = units 4n + a (low nibbles)
// and 4n + a + 2 (high nibbles) of ql[64n + 32a .. + 32), with 2 high bits from qh[32n .. 32n + 32);
// w = d * sc * (q - 32), a scale per 16 weights
__device__ __forceinline__ void vdot_q6_k(const unsigned char *blk, int p, const signed char *xq, const float *xd,
                                          const float *, long long sq, long long sd, int n_tok, float *acc) {
    int n = p >> 1, a = p & 1;
    int ql[8], qh[8];
    load16_u16(blk + 64 * n + 32 * a, ql);
    load16_u16(blk + 64 * n + 32 * a + 16, ql + 4);
    load16_u16(blk + 128 + 32 * n, qh);
    load16_u16(blk + 128 + 32 * n + 16, qh + 4);
    int wa[8], wb[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        unsigned int l = (unsigned int)ql[i], h = (unsigned int)qh[i];
        wa[i] = (int)__vsub4((l & 0x0F0F0F0Fu) | (((h >> (2 * a)) & 0x03030303u) << 4), 0x20202020u);
        wb[i] = (int)__vsub4(((l >> 4) & 0x0F0F0F0Fu) | (((h >> (2 * a + 4)) & 0x03030303u) << 4), 0x20202020u);
    }
    const signed char *sc = (const signed char *)(blk + 192) + 8 * n;
    float d = f16_at(blk + 208);
    int ja = 4 * n + a, jb = ja + 2;  // unit indices in the block
    float sa0 = (float)sc[2 * a], sa1 = (float)sc[2 * a + 1], sb0 = (float)sc[2 * a + 4], sb1 = (float)sc[2 * a + 5];
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
        if (t < n_tok) {
            int xa[8], xb[8];
            load_x32(xq + t * sq + 32 * ja, xa);
            load_x32(xq + t * sq + 32 * jb, xb);
            int a0 = 0, a1 = 0, b0 = 0, b1 = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a0 = __dp4a(wa[i], xa[i], a0);
                a1 = __dp4a(wa[i + 4], xa[i + 4], a1);
                b0 = __dp4a(wb[i], xb[i], b0);
                b1 = __dp4a(wb[i + 4], xb[i + 4], b1);
            }
            const float *dt = xd + t * sd;
            acc[t] += d * (dt[ja] * (sa0 * (float)a0 + sa1 * (float)a1) + dt[jb] * (sb0 * (float)b0 + sb1 * (float)b1));
        }
    }
}

__device__ __forceinline__ float lanes_sum(float v, int lpr) {
    for (int o = lpr / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define VFORMAT(SUFFIX, VDOT, PPB, QK, TSZ)                                                          \
/* Y[t, r] = W[r, :] . X[t, :] for t < n_tok <= MAX_TOK, X given as quantize_q8's XQ, XD, XS,  */ \
/* for up to three matrices of one format and width that read the same X (q, k, v; gate, up) in */ \
/* one launch: their rows stacked (W0's n0, then W1's n1, then W2's n2; unused: n = 0, null)     */ \
extern "C" __global__ void gemvq_##SUFFIX(const unsigned char *W0, const unsigned char *W1,           \
                                          const unsigned char *W2, const signed char *XQ,             \
                                          const float *XD, const float *XS, float *Y0, float *Y1,     \
                                          float *Y2, long long n0, long long n1, long long n2,        \
                                          long long row_bytes, long long n_in, int n_tok, int lpr) {  \
    int lane = threadIdx.x % 32;                                                                      \
    long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                    \
    long long r = warp * (32 / lpr) + lane / lpr;                                                     \
    const unsigned char *W = W0;                                                                      \
    float *Y = Y0;                                                                                    \
    long long n_rows = n0;                                                                            \
    if (r >= n0) {                                                                                    \
        r -= n0; W = W1; Y = Y1; n_rows = n1;                                                         \
        if (r >= n1) { r -= n1; W = W2; Y = Y2; n_rows = n2; }                                        \
    }                                                                                                 \
    int sl = lane % lpr;                                                                              \
    float acc[MAX_TOK];                                                                               \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) acc[t] = 0.f;                                 \
    long long npc = n_in / QK * PPB;                                                                  \
    if (r < n_rows) {                                                                                 \
        const unsigned char *row = W + r * row_bytes;                                                 \
        MMVQ_PRAGMA(unroll MMVQ_UNROLL)                                                               \
        for (long long pc = sl; pc < npc; pc += lpr) {                                                \
            long long b = pc / PPB;                                                                   \
            VDOT(row + b * TSZ, (int)(pc % PPB), XQ + b * QK, XD + b * (QK / 32), XS + b * (QK / 32), \
                 n_in, n_in / 32, n_tok, acc);                                                        \
        }                                                                                             \
    }                                                                                                 \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) {                                             \
        if (t < n_tok) {                                                                              \
            float v = lanes_sum(acc[t], lpr);                                                         \
            if (r < n_rows && sl == 0) Y[t * n_rows + r] = v;                                         \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
/* MoE gate/up of routed pair p (moe_glu_<fmt> of dequant.cu, 8-bit activations of X (T, n_in)) */  \
extern "C" __global__ void moeq_glu_##SUFFIX(const unsigned char *Wg, const unsigned char *Wu,        \
                                             const int *ids, const signed char *XQ, const float *XD,  \
                                             const float *XS, float *A, int k_used, long long n_rows, \
                                             long long row_bytes, long long expert_bytes,             \
                                             long long n_in, int act, const int *slot_map,            \
                                             const unsigned char *Hg, const unsigned char *Hu,        \
                                             const unsigned char *Sg, const unsigned char *Su,        \
                                             int lpr) {                                               \
    int lane = threadIdx.x % 32;                                                                      \
    long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                    \
    long long r = warp * (32 / lpr) + lane / lpr;                                                     \
    int sl = lane % lpr;                                                                              \
    int p = blockIdx.y;                                                                               \
    int e = ids[p];                                                                                   \
    if (e < 0) {  /* no pair: a zero row (the down kernel skips it) */                                \
        if (r < n_rows && sl == 0) A[(long long)p * n_rows + r] = 0.f;                                \
        return;                                                                                       \
    }                                                                                                 \
    const unsigned char *G = expert_at(Wg, Hg, Sg, slot_map, e, p, expert_bytes) + r * row_bytes;     \
    const unsigned char *U = expert_at(Wu, Hu, Su, slot_map, e, p, expert_bytes) + r * row_bytes;     \
    long long tok = p / k_used, nd = n_in / 32;                                                       \
    const signed char *xq = XQ + tok * n_in;                                                          \
    const float *xd = XD + tok * nd, *xs = XS + tok * nd;                                             \
    float g[1] = {0.f}, u[1] = {0.f};                                                                 \
    long long npc = n_in / QK * PPB;                                                                  \
    if (r < n_rows) {                                                                                 \
        for (long long pc = sl; pc < npc; pc += lpr) {                                                \
            long long b = pc / PPB;                                                                   \
            int sub = (int)(pc % PPB);                                                                \
            VDOT(G + b * TSZ, sub, xq + b * QK, xd + b * (QK / 32), xs + b * (QK / 32), 0, 0, 1, g);  \
            VDOT(U + b * TSZ, sub, xq + b * QK, xd + b * (QK / 32), xs + b * (QK / 32), 0, 0, 1, u);  \
        }                                                                                             \
    }                                                                                                 \
    float gs = lanes_sum(g[0], lpr), us = lanes_sum(u[0], lpr);                                       \
    if (r < n_rows && sl == 0) A[(long long)p * n_rows + r] = activate(gs, act) * us;                 \
}                                                                                                     \
/* MoE down and the weighted sum over a token's k experts (moe_down_<fmt> of dequant.cu), with   */ \
/* the activations A (T * k, n_in) given as quantize_q8's AQ, AD, AS. The lpr lanes of a row     */ \
/* take the pieces of all k experts' rows together (k * pieces: their loads overlap)             */ \
extern "C" __global__ void moeq_down_##SUFFIX(const unsigned char *Wd, const int *ids, const float *w, \
                                              const signed char *AQ, const float *AD,                 \
                                              const float *AS, float *Y, int k_used,                  \
                                              long long n_rows, long long row_bytes,                  \
                                              long long expert_bytes, long long n_in,                 \
                                              const int *slot_map, const unsigned char *Hd,           \
                                              const unsigned char *Sd, int lpr) {                     \
    int lane = threadIdx.x % 32;                                                                      \
    long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                    \
    long long r = warp * (32 / lpr) + lane / lpr;                                                     \
    int sl = lane % lpr;                                                                              \
    int t = blockIdx.y;                                                                               \
    long long nd = n_in / 32, npc = n_in / QK * PPB;                                                  \
    float acc = 0.f;                                                                                  \
    if (r < n_rows) {                                                                                 \
        MMVQ_PRAGMA(unroll MMVQ_UNROLL)                                                               \
        for (long long i = sl; i < k_used * npc; i += lpr) {                                          \
            int s = (int)(i / npc);                                                                   \
            long long pc = i % npc;                                                                   \
            int p = t * k_used + s;                                                                   \
            if (ids[p] < 0) continue;  /* no pair */                                                  \
            long long b = pc / PPB;                                                                   \
            const unsigned char *blk = expert_at(Wd, Hd, Sd, slot_map, ids[p], p, expert_bytes) +     \
                                       r * row_bytes + b * TSZ;                                       \
            float part[1] = {0.f};                                                                    \
            VDOT(blk, (int)(pc % PPB), AQ + (long long)p * n_in + b * QK,                             \
                 AD + (long long)p * nd + b * (QK / 32), AS + (long long)p * nd + b * (QK / 32),      \
                 0, 0, 1, part);                                                                      \
            acc += w[p] * part[0];                                                                    \
        }                                                                                             \
    }                                                                                                 \
    acc = lanes_sum(acc, lpr);                                                                        \
    if (r < n_rows && sl == 0) Y[(long long)t * n_rows + r] = acc;                                    \
}                                                                                                     \
/* Prompt MoE gate/up, grouped by expert (moe_prompt_groups of ops.py): group g = GR[3g ..] =     */  \
/* (expert e, first row p0, n <= MAX_TOK rows) of X (quantize_q8 of the gathered rows: row p0 + t */  \
/* is the t-th pair routed to e); every row r of e's gate and up is read once for the n rows:     */  \
/* A[p0 + t, r] = act(gate_r . x) * (up_r . x). Grid (row blocks, groups)                         */  \
extern "C" __global__ void moeq_gglu_##SUFFIX(const unsigned char *Wg, const unsigned char *Wu,       \
                                              const int *GR, const signed char *XQ, const float *XD,  \
                                              const float *XS, float *A, long long n_rows,            \
                                              long long row_bytes, long long expert_bytes,            \
                                              long long n_in, int act, int lpr) {                     \
    int lane = threadIdx.x % 32;                                                                      \
    long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                    \
    long long r = warp * (32 / lpr) + lane / lpr;                                                     \
    int sl = lane % lpr;                                                                              \
    const int *gr = GR + 3 * (long long)blockIdx.y;                                                   \
    long long e = gr[0], p0 = gr[1], nd = n_in / 32, npc = n_in / QK * PPB;                           \
    int n = gr[2];                                                                                    \
    float g[MAX_TOK], u[MAX_TOK];                                                                     \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) g[t] = u[t] = 0.f;                            \
    if (r < n_rows) {                                                                                 \
        const unsigned char *G = Wg + e * expert_bytes + r * row_bytes;                               \
        const unsigned char *U = Wu + e * expert_bytes + r * row_bytes;                               \
        const signed char *xq = XQ + p0 * n_in;                                                       \
        const float *xd = XD + p0 * nd, *xs = XS + p0 * nd;                                           \
        for (long long pc = sl; pc < npc; pc += lpr) {                                                \
            long long b = pc / PPB;                                                                   \
            int sub = (int)(pc % PPB);                                                                \
            VDOT(G + b * TSZ, sub, xq + b * QK, xd + b * (QK / 32), xs + b * (QK / 32), n_in, nd, n, g);\
            VDOT(U + b * TSZ, sub, xq + b * QK, xd + b * (QK / 32), xs + b * (QK / 32), n_in, nd, n, u);\
        }                                                                                             \
    }                                                                                                 \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) {                                             \
        if (t < n) {                                                                                  \
            float gs = lanes_sum(g[t], lpr), us = lanes_sum(u[t], lpr);                               \
            if (r < n_rows && sl == 0) A[(p0 + t) * n_rows + r] = activate(gs, act) * us;             \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
/* Prompt MoE down, grouped as moeq_gglu: Y[p0 + t, r] = down_r of expert e . A[p0 + t] (A given   */ \
/* as quantize_q8's AQ, AD, AS); moe_combine then sums each token's k rows with its weights        */ \
extern "C" __global__ void moeq_gdown_##SUFFIX(const unsigned char *Wd, const int *GR, const signed char *AQ,\
                                               const float *AD, const float *AS, float *Y, long long n_rows,\
                                               long long row_bytes, long long expert_bytes, long long n_in,\
                                               int lpr) {                                             \
    int lane = threadIdx.x % 32;                                                                      \
    long long warp = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                    \
    long long r = warp * (32 / lpr) + lane / lpr;                                                     \
    int sl = lane % lpr;                                                                              \
    const int *gr = GR + 3 * (long long)blockIdx.y;                                                   \
    long long e = gr[0], p0 = gr[1], nd = n_in / 32, npc = n_in / QK * PPB;                           \
    int n = gr[2];                                                                                    \
    float acc[MAX_TOK];                                                                               \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) acc[t] = 0.f;                                 \
    if (r < n_rows) {                                                                                 \
        const unsigned char *D = Wd + e * expert_bytes + r * row_bytes;                               \
        const signed char *aq = AQ + p0 * n_in;                                                       \
        const float *ad = AD + p0 * nd, *as = AS + p0 * nd;                                           \
        for (long long pc = sl; pc < npc; pc += lpr) {                                                \
            long long b = pc / PPB;                                                                   \
            VDOT(D + b * TSZ, (int)(pc % PPB), aq + b * QK, ad + b * (QK / 32), as + b * (QK / 32), n_in, nd, n,\
                 acc);                                                                                \
        }                                                                                             \
    }                                                                                                 \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) {                                             \
        if (t < n) {                                                                                  \
            float v = lanes_sum(acc[t], lpr);                                                         \
            if (r < n_rows && sl == 0) Y[(p0 + t) * n_rows + r] = v;                                  \
        }                                                                                             \
    }                                                                                                 \
}

VFORMAT(q8_0, vdot_q8_0, 1, 32, 34)
VFORMAT(q4_0, vdot_q4_0, 1, 32, 18)
VFORMAT(q4_k, vdot_q4_k, 4, 256, 144)
VFORMAT(q5_k, vdot_q5_k, 4, 256, 176)
VFORMAT(q6_k, vdot_q6_k, 4, 256, 210)

// ---- The grouped prompt MoE on the tensor cores (sm_80+): Q4_K weights x 8-bit activations ----
// moeq_mma_gglu_q4_k / moeq_mma_gdown_q4_k take the arguments and give the results of
// moeq_gglu_q4_k / moeq_gdown_q4_k (the same groups of pairs sorted by expert, here of up to
// MMQ_TOK rows), with each 32-weight unit's integer dot computed by mma.m16n8k32 (s8 x s8 -> s32)
// instead of dp4a: the weights' nibbles (0..15) are already int8 values, the activations
// quantize_q8's; every unit's int32 dot is exact, then scaled as vdot_k4_units does:
// d * sc_j * xd_j * dot - dmin * m_j * xs_j. A block of MMQ_WARPS warps takes 16 * MMQ_WARPS rows of
// one group; a warp's 16 rows x 32 tokens are four m16n8 tiles sharing the weight fragments.
// Fragments (PTX ISA, mma.m16n8k32 .s8): lane = 4 g + t; A (16 x 32, row-major) regs: rows g, g + 8,
// g, g + 8 at k = 4t .. 4t + 3, 4t .. 4t + 3, 16 + 4t .., 16 + 4t ..; B (32 x 8, column-major)
// regs: column g at k = 4t .. 4t + 3 and 16 + 4t ..; C: rows g, g, g + 8, g + 8 at columns 2t,
// 2t + 1, 2t, 2t + 1. Unit 2p of a Q4_K block is the low nibbles of qs[32p .. 32p + 32), unit
// 2p + 1 their high nibbles, so one word of qs gives four k of both units.
#define MMQ_TOK 32
#define MMQ_WARPS 4

__device__ __forceinline__ void mma_s8_16832(int c[4], const unsigned a[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// acc[nt][i] += rows (ra, ra, rb, rb)[i] of W . token rows nt * 8 + 2t + (i & 1) of xq (n rows, n_in
// values each; xd, xs per 32), over every block of the rows; rows not valid (va, vb false) read nothing
__device__ __forceinline__ void mmq_q4_k_rows(const unsigned char *W, long long row_bytes, long long ra, long long rb,
                                              bool va, bool vb, const signed char *xq, const float *xd,
                                              const float *xs, long long n_in, int n, float acc[4][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    long long nd = n_in / 32;
    const unsigned char *Ra = W + ra * row_bytes, *Rb = W + rb * row_bytes;
    for (long long b = 0; b < n_in / 256; ++b) {
        const unsigned char *ba = Ra + b * 144, *bb = Rb + b * 144;
        unsigned dda = va ? *(const unsigned *)ba : 0u, ddb = vb ? *(const unsigned *)bb : 0u;
        float da = __half2float(__ushort_as_half((unsigned short)(dda & 0xFFFF)));
        float dma = __half2float(__ushort_as_half((unsigned short)(dda >> 16)));
        float db = __half2float(__ushort_as_half((unsigned short)(ddb & 0xFFFF)));
        float dmb = __half2float(__ushort_as_half((unsigned short)(ddb >> 16)));
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            unsigned qa0 = va ? *(const unsigned *)(ba + 16 + 32 * p + 4 * t) : 0u;
            unsigned qa1 = va ? *(const unsigned *)(ba + 32 + 32 * p + 4 * t) : 0u;
            unsigned qb0 = vb ? *(const unsigned *)(bb + 16 + 32 * p + 4 * t) : 0u;
            unsigned qb1 = vb ? *(const unsigned *)(bb + 32 + 32 * p + 4 * t) : 0u;
            const unsigned lo[4] = {qa0 & 0x0F0F0F0Fu, qb0 & 0x0F0F0F0Fu, qa1 & 0x0F0F0F0Fu, qb1 & 0x0F0F0F0Fu};
            const unsigned hi[4] = {(qa0 >> 4) & 0x0F0F0F0Fu, (qb0 >> 4) & 0x0F0F0F0Fu, (qa1 >> 4) & 0x0F0F0F0Fu,
                                    (qb1 >> 4) & 0x0F0F0F0Fu};
            int sa0 = 0, ma0 = 0, sa1 = 0, ma1 = 0, sb0 = 0, mb0 = 0, sb1 = 0, mb1 = 0;
            if (va) {
                scale_min_k4(2 * p, ba + 4, &sa0, &ma0);
                scale_min_k4(2 * p + 1, ba + 4, &sa1, &ma1);
            }
            if (vb) {
                scale_min_k4(2 * p, bb + 4, &sb0, &mb0);
                scale_min_k4(2 * p + 1, bb + 4, &sb1, &mb1);
            }
            float fa0 = da * (float)sa0, fa1 = da * (float)sa1, fb0 = db * (float)sb0, fb1 = db * (float)sb1;
            float ga0 = dma * (float)ma0, ga1 = dma * (float)ma1, gb0 = dmb * (float)mb0, gb1 = dmb * (float)mb1;
            long long j = b * 8 + 2 * p;  // the low unit's index among the row's 32-value units
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                if (nt * 8 < n) {  // uniform over the block
                    int tok = nt * 8 + g;
                    unsigned b0l = 0u, b1l = 0u, b0h = 0u, b1h = 0u;
                    if (tok < n) {
                        const signed char *x = xq + (long long)tok * n_in + 32 * j;
                        b0l = *(const unsigned *)(x + 4 * t);
                        b1l = *(const unsigned *)(x + 16 + 4 * t);
                        b0h = *(const unsigned *)(x + 32 + 4 * t);
                        b1h = *(const unsigned *)(x + 48 + 4 * t);
                    }
                    int cl[4] = {0, 0, 0, 0}, ch[4] = {0, 0, 0, 0};
                    mma_s8_16832(cl, lo, b0l, b1l);
                    mma_s8_16832(ch, hi, b0h, b1h);
#pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        int tk = nt * 8 + 2 * t + s;
                        float xdl = 0.f, xdh = 0.f, xsl = 0.f, xsh = 0.f;
                        if (tk < n) {
                            xdl = xd[tk * nd + j];
                            xdh = xd[tk * nd + j + 1];
                            xsl = xs[tk * nd + j];
                            xsh = xs[tk * nd + j + 1];
                        }
                        acc[nt][s] += fa0 * xdl * (float)cl[s] + fa1 * xdh * (float)ch[s] - (ga0 * xsl + ga1 * xsh);
                        acc[nt][2 + s] += fb0 * xdl * (float)cl[2 + s] + fb1 * xdh * (float)ch[2 + s] -
                                          (gb0 * xsl + gb1 * xsh);
                    }
                }
            }
        }
    }
}

// Prompt MoE gate/up on the tensor cores: as moeq_gglu_q4_k (groups GR of up to MMQ_TOK rows).
// Grid ((n_rows + 16 MMQ_WARPS - 1) / (16 MMQ_WARPS), groups), blocks of 32 MMQ_WARPS threads
extern "C" __global__ void __launch_bounds__(32 * MMQ_WARPS) moeq_mma_gglu_q4_k(
        const unsigned char *Wg, const unsigned char *Wu, const int *GR, const signed char *XQ, const float *XD,
        const float *XS, float *A, long long n_rows, long long row_bytes, long long expert_bytes, long long n_in,
        int act) {
#if __CUDA_ARCH__ >= 800
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int *gr = GR + 3 * (long long)blockIdx.y;
    long long e = gr[0], p0 = gr[1], nd = n_in / 32;
    int n = gr[2];
    long long ra = (long long)blockIdx.x * 16 * MMQ_WARPS + (threadIdx.x >> 5) * 16 + g, rb = ra + 8;
    bool va = ra < n_rows, vb = rb < n_rows;
    float ga[4][4], ua[4][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) ga[i / 4][i % 4] = ua[i / 4][i % 4] = 0.f;
    const signed char *xq = XQ + p0 * n_in;
    const float *xd = XD + p0 * nd, *xs = XS + p0 * nd;
    mmq_q4_k_rows(Wg + e * expert_bytes, row_bytes, ra, rb, va, vb, xq, xd, xs, n_in, n, ga);
    mmq_q4_k_rows(Wu + e * expert_bytes, row_bytes, ra, rb, va, vb, xq, xd, xs, n_in, n, ua);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int tk = nt * 8 + 2 * t + (i & 1);
            long long r = i < 2 ? ra : rb;
            if (tk < n && (i < 2 ? va : vb)) A[(p0 + tk) * n_rows + r] = activate(ga[nt][i], act) * ua[nt][i];
        }
    }
#endif
}

// Prompt MoE down on the tensor cores: as moeq_gdown_q4_k (groups GR of up to MMQ_TOK rows)
extern "C" __global__ void __launch_bounds__(32 * MMQ_WARPS) moeq_mma_gdown_q4_k(
        const unsigned char *Wd, const int *GR, const signed char *AQ, const float *AD, const float *AS, float *Y,
        long long n_rows, long long row_bytes, long long expert_bytes, long long n_in) {
#if __CUDA_ARCH__ >= 800
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int *gr = GR + 3 * (long long)blockIdx.y;
    long long e = gr[0], p0 = gr[1], nd = n_in / 32;
    int n = gr[2];
    long long ra = (long long)blockIdx.x * 16 * MMQ_WARPS + (threadIdx.x >> 5) * 16 + g, rb = ra + 8;
    bool va = ra < n_rows, vb = rb < n_rows;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i / 4][i % 4] = 0.f;
    mmq_q4_k_rows(Wd + e * expert_bytes, row_bytes, ra, rb, va, vb, AQ + p0 * n_in, AD + p0 * nd, AS + p0 * nd, n_in,
                  n, acc);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int tk = nt * 8 + 2 * t + (i & 1);
            long long r = i < 2 ? ra : rb;
            if (tk < n && (i < 2 ? va : vb)) Y[(p0 + tk) * n_rows + r] = acc[nt][i];
        }
    }
#endif
}
