// Quantized GGUF weights on the GPU: dequantization, matrix x few-token products and the MoE
// expert products of the decode path. Written for moecache; no code taken from ggml.
//
// Block layouts: ggml's block structs (ggml/src/ggml-common.h); formulas as gguf-py's
// gguf/quants.py dequantizers (the tests' reference) and moecache/quants/blocks{32,256}.py.
//
// Everything is built on one decoder per format, UNIT_<fmt>(blk, j, y): the 32 weights
// [32j, 32j + 32) of one block into y[0..32). A block holds SUBS units (1 for the 32-weight
// formats, 8 for the 256-weight K- and IQ4_XS formats). F32, F16 and BF16 rows are read as
// "blocks" of 32 elements (128 / 64 / 64 bytes), so every kernel covers them too.
//
// Shapes: a matrix W is n_rows rows of row_bytes bytes (the GGUF tensor as stored, row = one
// output feature); stacked experts are n_expert such matrices, expert_bytes apart.

#include <cuda_fp16.h>

__device__ __forceinline__ float f16_at(const unsigned char *p) {
    unsigned short h = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ unsigned int u32_at(const unsigned char *p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
}

// kvalues_iq4nl and the doubled FP4 E2M1 values of MXFP4 (ggml-common.h)
__constant__ float IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
__constant__ float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ---- one decoder per format: 32 weights of unit j ------------------------------------------------

// float rows: a unit is 128 (F32) or 64 (F16, BF16) bytes at a multiple of its size from a row
// start (rows of n_in % 32 == 0 elements, 16-byte aligned buffers), read as 16-byte words
__device__ __forceinline__ void unit_f32(const unsigned char *b, int, float *y) {
    const float4 *p = (const float4 *)b;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float4 v = p[i];
        y[4 * i] = v.x;
        y[4 * i + 1] = v.y;
        y[4 * i + 2] = v.z;
        y[4 * i + 3] = v.w;
    }
}

__device__ __forceinline__ void unit_f16(const unsigned char *b, int, float *y) {
    const uint4 *p = (const uint4 *)b;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint4 v = p[i];
        unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            y[8 * i + 2 * j] = __half2float(__ushort_as_half((unsigned short)(w[j] & 0xFFFF)));
            y[8 * i + 2 * j + 1] = __half2float(__ushort_as_half((unsigned short)(w[j] >> 16)));
        }
    }
}

__device__ __forceinline__ void unit_bf16(const unsigned char *b, int, float *y) {
    const uint4 *p = (const uint4 *)b;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint4 v = p[i];
        unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            y[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
            y[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
        }
    }
}

__device__ __forceinline__ void unit_q8_0(const unsigned char *b, int, float *y) {
    // blocks are 34 bytes: 2-byte aligned, so the quants are read 2 at a time (16 loads, not 32)
    float d = f16_at(b);
    const unsigned short *q = (const unsigned short *)(b + 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        unsigned short v = q[i];
        y[2 * i] = d * (float)(signed char)(v & 0xFF);
        y[2 * i + 1] = d * (float)(signed char)(v >> 8);
    }
}

__device__ __forceinline__ void unit_q4_0(const unsigned char *b, int, float *y) {
    float d = f16_at(b);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int q = b[2 + i];
        y[i] = d * (float)((q & 0xF) - 8);
        y[i + 16] = d * (float)((q >> 4) - 8);
    }
}

__device__ __forceinline__ void unit_q4_1(const unsigned char *b, int, float *y) {
    float d = f16_at(b), m = f16_at(b + 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int q = b[4 + i];
        y[i] = d * (float)(q & 0xF) + m;
        y[i + 16] = d * (float)(q >> 4) + m;
    }
}

__device__ __forceinline__ void unit_q5_0(const unsigned char *b, int, float *y) {
    float d = f16_at(b);
    unsigned int qh = u32_at(b + 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int q = b[6 + i];
        int h0 = (int)((qh >> i) & 1u) << 4, h1 = (int)((qh >> (i + 16)) & 1u) << 4;  // int: q - 16 is signed
        y[i] = d * (float)(((q & 0xF) | h0) - 16);
        y[i + 16] = d * (float)(((q >> 4) | h1) - 16);
    }
}

__device__ __forceinline__ void unit_q5_1(const unsigned char *b, int, float *y) {
    float d = f16_at(b), m = f16_at(b + 2);
    unsigned int qh = u32_at(b + 4);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int q = b[8 + i];
        y[i] = d * (float)((q & 0xF) | (((qh >> i) & 1) << 4)) + m;
        y[i + 16] = d * (float)((q >> 4) | (((qh >> (i + 16)) & 1) << 4)) + m;
    }
}

__device__ __forceinline__ void unit_iq4_nl(const unsigned char *b, int, float *y) {
    float d = f16_at(b);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int q = b[2 + i];
        y[i] = d * IQ4NL_VALUES[q & 0xF];
        y[i + 16] = d * IQ4NL_VALUES[q >> 4];
    }
}

__device__ __forceinline__ void unit_mxfp4(const unsigned char *b, int, float *y) {
    // e8m0 scale halved (the table is doubled): 2^(e - 128); e < 2 gives subnormal bit patterns
    unsigned int e = b[0];
    float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int q = b[1 + i];
        y[i] = d * MXFP4_VALUES[q & 0xF];
        y[i + 16] = d * MXFP4_VALUES[q >> 4];
    }
}

// Q2_K: scales[16] @0 (low nibble scale, high nibble min, per 16 weights), qs[64] @16, d @80,
// dmin @82. Weight 128n + 32jj + l: bits 2jj.. of qs[32n + l]; scale 8n + 2jj + l/16.
__device__ __forceinline__ void unit_q2_k(const unsigned char *b, int j, float *y) {
    int n = j >> 2, jj = j & 3;
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    const unsigned char *q = b + 16 + 32 * n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int s = b[8 * n + 2 * jj + h];
        float dl = d * (float)(s & 0xF), ml = dmin * (float)(s >> 4);
#pragma unroll
        for (int l = 0; l < 16; ++l) y[16 * h + l] = dl * (float)((q[16 * h + l] >> (2 * jj)) & 3) - ml;
    }
}

// Q3_K: hmask[32] @0, qs[64] @32, scales[12] @96 (16 signed 6-bit scales), d @108.
// Weight 32j + l (j = 4n + jj): bits 2jj.. of qs[32n + l], minus 4 unless bit j of hmask[l].
__device__ __forceinline__ int q3_scale(const unsigned char *b, int i) {
    int lo = (b[96 + (i & 7)] >> (4 * (i >> 3))) & 0xF;
    int hi = (b[104 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

__device__ __forceinline__ void unit_q3_k(const unsigned char *b, int j, float *y) {
    int n = j >> 2, jj = j & 3;
    float d = f16_at(b + 108);
    const unsigned char *q = b + 32 + 32 * n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float dl = d * (float)q3_scale(b, 2 * j + h);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            int i = 16 * h + l;
            int v = ((q[i] >> (2 * jj)) & 3) - (((b[i] >> j) & 1) ? 0 : 4);
            y[i] = dl * (float)v;
        }
    }
}

// Q4_K / Q5_K: 12 packed bytes at b + 4 hold 8 6-bit scales and 8 6-bit mins.
__device__ __forceinline__ void scale_min_k4(int j, const unsigned char *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K: d @0, dmin @2, scales @4, qs[128] @16; unit j = nibble j%2 of qs[32 (j/2) + l]. Blocks are
// 144 bytes (4-byte aligned rows), so the 32 quant bytes are read as 8 words.
__device__ __forceinline__ void unit_q4_k(const unsigned char *b, int j, float *y) {
    int sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    unsigned int dd = *(const unsigned int *)b;
    float dl = __half2float(__ushort_as_half((unsigned short)(dd & 0xFFFF))) * sc;
    float ml = __half2float(__ushort_as_half((unsigned short)(dd >> 16))) * m;
    const unsigned int *q = (const unsigned int *)(b + 16 + 32 * (j >> 1));
    int sh = 4 * (j & 1);
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        unsigned int v = q[w] >> sh;
#pragma unroll
        for (int c = 0; c < 4; ++c) y[4 * w + c] = dl * (float)((v >> (8 * c)) & 0xF) - ml;
    }
}

// Q5_K: as Q4_K with qh[32] @16 (5th bit of weight l of unit j = bit j of qh[l]), qs @48.
__device__ __forceinline__ void unit_q5_k(const unsigned char *b, int j, float *y) {
    int sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    float dl = f16_at(b) * sc, ml = f16_at(b + 2) * m;
    const unsigned char *q = b + 48 + 32 * (j >> 1), *qh = b + 16;
    int sh = 4 * (j & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = dl * (float)(((q[l] >> sh) & 0xF) | (((qh[l] >> j) & 1) << 4)) - ml;
}

// Q6_K: ql[128] @0, qh[64] @128, scales int8[16] @192, d @208. Weight 128n + 32jj + l: nibble
// jj/2 of ql[64n + 32(jj%2) + l] | bits 2jj.. of qh[32n + l] << 4, minus 32; scale 8n + 2jj + l/16.
__device__ __forceinline__ void unit_q6_k(const unsigned char *b, int j, float *y) {
    int n = j >> 2, jj = j & 3;
    const unsigned char *ql = b + 64 * n + 32 * (jj & 1), *qh = b + 128 + 32 * n;
    const signed char *sc = (const signed char *)(b + 192) + 8 * n + 2 * jj;
    float d = f16_at(b + 208);
    int ls = 4 * (jj >> 1), hs = 2 * jj;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float dl = d * (float)sc[h];
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            int i = 16 * h + l;
            y[i] = dl * (float)((((ql[i] >> ls) & 0xF) | (((qh[i] >> hs) & 3) << 4)) - 32);
        }
    }
}

// IQ4_XS: d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8; unit j uses qs[16j .. 16j + 16).
__device__ __forceinline__ void unit_iq4_xs(const unsigned char *b, int j, float *y) {
    int lo = (b[4 + (j >> 1)] >> (4 * (j & 1))) & 0xF;
    int hi = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3;
    float dl = f16_at(b) * (float)((lo | (hi << 4)) - 32);
    const unsigned char *q = b + 8 + 16 * j;
#pragma unroll
    for (int l = 0; l < 16; ++l) {
        y[l] = dl * IQ4NL_VALUES[q[l] & 0xF];
        y[l + 16] = dl * IQ4NL_VALUES[q[l] >> 4];
    }
}

// ---- the kernels, instantiated per format by FORMAT(...) at the end ------------------------------

// Weight unit k (32 weights) of a row: block k / SUBS, unit k % SUBS.
#define UNIT_PTR(ROW, K, SUBS, TSZ) ((ROW) + ((K) / (SUBS)) * (TSZ))

// y . x over 32 floats; x is 16-byte aligned (unit k of a row starts at float 32k of an aligned
// row of n_in % 32 == 0 floats), so it is read as 8 float4s
__device__ __forceinline__ float dot32(const float *y, const float *x) {
    const float4 *x4 = (const float4 *)x;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float4 v = x4[i];
        s += y[4 * i] * v.x + y[4 * i + 1] * v.y + y[4 * i + 2] * v.z + y[4 * i + 3] * v.w;
    }
    return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float activate(float g, int act) {
    if (act == 0) return g / (1.f + __expf(-g));  // SiLU
    const float c = 0.7978845608028654f;           // GELU, tanh approximation (ggml_gelu)
    return 0.5f * g * (1.f + tanhf(c * (g + 0.044715f * g * g * g)));
}

// The first byte of the expert a routed pair p (expert e = ids[p] >= 0; the decode kernels skip a
// pair of id -1, whose expert the CPU computes: moecache/moe/handoff.py) reads, in the MoE decode
// kernels here and in mmvq.cu: with a slot map (the expert cache), slot slot_map[e] of W when that is >= 0,
// else its staged copy S + p (stage_misses of ops.cu) when S is given, else its page-locked host
// copy H + e, read over PCIe (zero-copy); without one, W + e.
__device__ __forceinline__ const unsigned char *expert_at(const unsigned char *W, const unsigned char *H,
                                                          const unsigned char *S, const int *slot_map, int e,
                                                          int p, long long expert_bytes) {
    if (slot_map != nullptr) {
        int s = slot_map[e];
        if (s >= 0) return W + (long long)s * expert_bytes;
        if (S != nullptr) return S + (long long)p * expert_bytes;
        return H + (long long)e * expert_bytes;
    }
    return W + (long long)e * expert_bytes;
}

#ifndef MAX_TOK
#define MAX_TOK 16  // tokens a GEMV launch takes: DECODE_MAX_TOKENS of moecache/backends/ops.py, which
#endif              // the backend passes as -DMAX_TOK when it compiles this file

// The dequantize kernels: thread i of a block of DEQ_THREADS holds unit blockIdx.x * DEQ_THREADS + i
// in y; the block's units are one contiguous stretch of out (unit u at out + 32u), written through
// shared memory so that consecutive threads store consecutive values (coalesced). out is float32,
// or float16 (rounded to nearest) when half is nonzero: the prompt's tensor-core GEMMs read those.
#define DEQ_THREADS 256
__device__ __forceinline__ void store_units(const float *y, void *out, long long n_units, int half) {
    __shared__ float stage[DEQ_THREADS * 33];
#pragma unroll
    for (int i = 0; i < 32; ++i) stage[threadIdx.x * 33 + i] = y[i];
    __syncthreads();
    long long first = (long long)blockIdx.x * DEQ_THREADS;
    long long n = n_units - first < DEQ_THREADS ? n_units - first : DEQ_THREADS;
    if (half) {
        __half *o = (__half *)out + first * 32;
        for (int j = threadIdx.x; j < n * 32; j += DEQ_THREADS) o[j] = __float2half_rn(stage[(j >> 5) * 33 + (j & 31)]);
    } else {
        float *o = (float *)out + first * 32;
        for (int j = threadIdx.x; j < n * 32; j += DEQ_THREADS) o[j] = stage[(j >> 5) * 33 + (j & 31)];
    }
}

#define FORMAT(SUFFIX, UNIT, SUBS, TSZ)                                                              \
/* dequantize: one thread per 32-weight unit; out float32 (float16 if half) (n_rows, n_in), rows   */ \
/* optionally gathered: row i of out is row idx[i] of W when idx is not null                       */ \
extern "C" __global__ void deq_##SUFFIX(const unsigned char *W, const long long *idx, void *out,      \
                                        long long n_rows, long long row_bytes, long long n_in,        \
                                        int half) {                                                   \
    long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                   \
    long long nu = n_in / 32;                                                                         \
    float y[32];                                                                                      \
    if (u < n_rows * nu) {                                                                            \
        long long r = u / nu, k = u % nu;                                                             \
        long long src = idx ? idx[r] : r;                                                             \
        UNIT(UNIT_PTR(W + src * row_bytes, k, SUBS, TSZ), (int)(k % SUBS), y);                        \
    }                                                                                                 \
    store_units(y, out, n_rows * nu, half);                                                           \
}                                                                                                     \
/* Y[t, r] = W[r, :] . X[t, :] for t < n_tok <= MAX_TOK: a warp per row, lane l takes units        */ \
/* l, l + 32, ... of the row                                                                       */ \
extern "C" __global__ void gemv_##SUFFIX(const unsigned char *W, const float *X, float *Y,            \
                                         long long n_rows, long long row_bytes, long long n_in,       \
                                         int n_tok) {                                                 \
    long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                       \
    int lane = threadIdx.x % 32;                                                                      \
    if (r >= n_rows) return;                                                                          \
    float acc[MAX_TOK];                                                                               \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) acc[t] = 0.f;                                 \
    const unsigned char *row = W + r * row_bytes;                                                     \
    long long nu = n_in / 32;                                                                         \
    for (long long k = lane; k < nu; k += 32) {                                                       \
        float y[32];                                                                                  \
        UNIT(UNIT_PTR(row, k, SUBS, TSZ), (int)(k % SUBS), y);                                        \
        _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t)                                           \
            if (t < n_tok) acc[t] += dot32(y, X + t * n_in + k * 32);                                 \
    }                                                                                                 \
    _Pragma("unroll") for (int t = 0; t < MAX_TOK; ++t) {                                             \
        if (t < n_tok) {                                                                              \
            float v = warp_sum(acc[t]);                                                               \
            if (lane == 0) Y[t * n_rows + r] = v;                                                     \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
/* MoE gate/up of routed pair p = t * k + s (expert ids[p], token t): A[p, r] =                    */ \
/* act(Wg[e, r] . X[t]) * (Wu[e, r] . X[t]); grid (rows / warps, T * k). With a slot map (the      */ \
/* expert cache) expert e is read from slot slot_map[e] of Wg/Wu when that is >= 0, else from      */ \
/* Hg/Hu: its copy in page-locked host RAM, read by the GPU over PCIe (zero-copy); when Sg         */ \
/* is not null, from Sg/Su + p * expert_bytes instead, where stage_misses (ops.cu) put it          */ \
extern "C" __global__ void moe_glu_##SUFFIX(const unsigned char *Wg, const unsigned char *Wu,         \
                                            const int *ids, const float *X, float *A, int k_used,     \
                                            long long n_rows, long long row_bytes,                    \
                                            long long expert_bytes, long long n_in, int act,          \
                                            const int *slot_map, const unsigned char *Hg,             \
                                            const unsigned char *Hu, const unsigned char *Sg,         \
                                            const unsigned char *Su) {                                \
    long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                       \
    int lane = threadIdx.x % 32;                                                                      \
    int p = blockIdx.y;                                                                               \
    if (r >= n_rows) return;                                                                          \
    int e = ids[p];                                                                                   \
    if (e < 0) { if (lane == 0) A[(long long)p * n_rows + r] = 0.f; return; }  /* no pair */          \
    const unsigned char *G = expert_at(Wg, Hg, Sg, slot_map, e, p, expert_bytes) + r * row_bytes;     \
    const unsigned char *U = expert_at(Wu, Hu, Su, slot_map, e, p, expert_bytes) + r * row_bytes;     \
    const float *x = X + (long long)(p / k_used) * n_in;                                              \
    float g = 0.f, u = 0.f;                                                                           \
    long long nu = n_in / 32;                                                                         \
    for (long long k = lane; k < nu; k += 32) {                                                       \
        float y[32];                                                                                  \
        UNIT(UNIT_PTR(G, k, SUBS, TSZ), (int)(k % SUBS), y);                                          \
        g += dot32(y, x + k * 32);                                                                    \
        UNIT(UNIT_PTR(U, k, SUBS, TSZ), (int)(k % SUBS), y);                                          \
        u += dot32(y, x + k * 32);                                                                    \
    }                                                                                                 \
    g = warp_sum(g);                                                                                  \
    u = warp_sum(u);                                                                                  \
    if (lane == 0) A[(long long)p * n_rows + r] = activate(g, act) * u;                               \
}                                                                                                     \
/* MoE down and the weighted sum over a token's k experts: Y[t, r] = sum_s w[t, s] *               */ \
/* (Wd[ids[t, s], r] . A[t * k + s]); grid (rows / warps, T); slot_map, Hd, Sd as in moe_glu       */ \
extern "C" __global__ void moe_down_##SUFFIX(const unsigned char *Wd, const int *ids, const float *w, \
                                             const float *A, float *Y, int k_used, long long n_rows,  \
                                             long long row_bytes, long long expert_bytes,             \
                                             long long n_in, const int *slot_map,                     \
                                             const unsigned char *Hd,                                 \
                                             const unsigned char *Sd) {                               \
    long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                       \
    int lane = threadIdx.x % 32;                                                                      \
    int t = blockIdx.y;                                                                               \
    if (r >= n_rows) return;                                                                          \
    long long nu = n_in / 32;                                                                         \
    float acc = 0.f;                                                                                  \
    for (int s = 0; s < k_used; ++s) {                                                                \
        int p = t * k_used + s;                                                                       \
        if (ids[p] < 0) continue;  /* no pair (the host handoff's CPU pairs) */                       \
        const unsigned char *row = expert_at(Wd, Hd, Sd, slot_map, ids[p], p, expert_bytes) + r * row_bytes; \
        const float *a = A + (long long)p * n_in;                                                     \
        float part = 0.f;                                                                             \
        for (long long k = lane; k < nu; k += 32) {                                                   \
            float y[32];                                                                              \
            UNIT(UNIT_PTR(row, k, SUBS, TSZ), (int)(k % SUBS), y);                                    \
            part += dot32(y, a + k * 32);                                                             \
        }                                                                                             \
        acc += w[p] * part;                                                                           \
    }                                                                                                 \
    acc = warp_sum(acc);                                                                              \
    if (lane == 0) Y[(long long)t * n_rows + r] = acc;                                                \
}                                                                                                     \
/* Dequantize the used experts of a stacked tensor: out float32 (float16 if half)                  */ \
/* (n_used, n_rows, n_in) with out[i] = W[eids[i]]; one thread per unit                            */ \
extern "C" __global__ void deq_experts_##SUFFIX(const unsigned char *W, const int *eids, void *out,    \
                                                long long n_used, long long n_rows,                   \
                                                long long row_bytes, long long expert_bytes,          \
                                                long long n_in, int half) {                           \
    long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                   \
    long long nu = n_in / 32;                                                                         \
    float y[32];                                                                                      \
    if (u < n_used * n_rows * nu) {                                                                   \
        long long k = u % nu, rr = u / nu;                                                            \
        long long r = rr % n_rows, i = rr / n_rows;                                                   \
        UNIT(UNIT_PTR(W + (long long)eids[i] * expert_bytes + r * row_bytes, k, SUBS, TSZ),           \
             (int)(k % SUBS), y);                                                                     \
    }                                                                                                 \
    store_units(y, out, n_used * n_rows * nu, half);                                                  \
}

FORMAT(f32, unit_f32, 1, 128)
FORMAT(f16, unit_f16, 1, 64)
FORMAT(bf16, unit_bf16, 1, 64)
FORMAT(q8_0, unit_q8_0, 1, 34)
FORMAT(q4_0, unit_q4_0, 1, 18)
FORMAT(q4_1, unit_q4_1, 1, 20)
FORMAT(q5_0, unit_q5_0, 1, 22)
FORMAT(q5_1, unit_q5_1, 1, 24)
FORMAT(iq4_nl, unit_iq4_nl, 1, 18)
FORMAT(mxfp4, unit_mxfp4, 1, 17)
FORMAT(q2_k, unit_q2_k, 8, 84)
FORMAT(q3_k, unit_q3_k, 8, 110)
FORMAT(q4_k, unit_q4_k, 8, 144)
FORMAT(q5_k, unit_q5_k, 8, 176)
FORMAT(q6_k, unit_q6_k, 8, 210)
FORMAT(iq4_xs, unit_iq4_xs, 8, 136)
