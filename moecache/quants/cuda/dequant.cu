// Dequantization of GGUF blocks to float32 on the GPU: one thread per block.
// Block layouts: ggml's block_q8_0, block_q4_0, block_q5_0, block_q4_K, block_q6_K
// (ggml/src/ggml-common.h); formulas as gguf-py's gguf/quants.py dequantizers. Written for
// moecache; no code taken from ggml.
//
// Every kernel: W = n_rows rows of row_bytes bytes (the GGUF tensor as stored),
// out = float32 (n_rows, n_in), n_blocks_row = n_in / block size.

#include <cuda_fp16.h>

__device__ __forceinline__ float f16_at(const unsigned char *p) {
    unsigned short h = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    return __half2float(__ushort_as_half(h));
}

// One block's weights into y[0 .. block size): one function per format.
__device__ __forceinline__ void deq_block_q8_0(const unsigned char *blk, float *y) {
    float d = f16_at(blk);
    const signed char *q = (const signed char *)(blk + 2);
    for (int i = 0; i < 32; ++i) y[i] = d * (float)q[i];
}

__device__ __forceinline__ void deq_block_q4_0(const unsigned char *blk, float *y) {
    float d = f16_at(blk);
    for (int j = 0; j < 16; ++j) {
        int q = blk[2 + j];
        y[j] = d * (float)((q & 0xF) - 8);
        y[j + 16] = d * (float)((q >> 4) - 8);
    }
}

__device__ __forceinline__ void deq_block_q5_0(const unsigned char *blk, float *y) {
    float d = f16_at(blk);
    unsigned int qh = (unsigned int)blk[2] | ((unsigned int)blk[3] << 8) | ((unsigned int)blk[4] << 16) |
                      ((unsigned int)blk[5] << 24);
    for (int j = 0; j < 16; ++j) {
        int q = blk[6 + j];
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = d * (float)(((q & 0xF) | (h0 << 4)) - 16);
        y[j + 16] = d * (float)(((q >> 4) | (h1 << 4)) - 16);
    }
}

__device__ __forceinline__ void scale_min_k4(int j, const unsigned char *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

__device__ __forceinline__ void deq_block_q4_k(const unsigned char *blk, float *y) {
    float d = f16_at(blk), dmin = f16_at(blk + 2);
    const unsigned char *scales = blk + 4, *qs = blk + 16;
    for (int j = 0; j < 4; ++j) {
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * j, scales, &sc1, &m1);
        scale_min_k4(2 * j + 1, scales, &sc2, &m2);
        float d1 = d * sc1, mm1 = dmin * m1, d2 = d * sc2, mm2 = dmin * m2;
        for (int l = 0; l < 32; ++l) {
            int q = qs[32 * j + l];
            y[64 * j + l] = d1 * (float)(q & 0xF) - mm1;
            y[64 * j + 32 + l] = d2 * (float)(q >> 4) - mm2;
        }
    }
}

__device__ __forceinline__ void deq_block_q6_k(const unsigned char *blk, float *y) {
    const unsigned char *ql = blk, *qh = blk + 128;
    const signed char *sc = (const signed char *)(blk + 192);
    float d = f16_at(blk + 208);
    for (int n = 0; n < 2; ++n) {
        const unsigned char *l0 = ql + 64 * n, *h0 = qh + 32 * n;
        const signed char *s0 = sc + 8 * n;
        float *yy = y + 128 * n;
        for (int l = 0; l < 32; ++l) {
            int is = l / 16;
            int q1 = (int)((l0[l] & 0xF) | (((h0[l] >> 0) & 3) << 4)) - 32;
            int q2 = (int)((l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4)) - 32;
            int q3 = (int)((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32;
            int q4 = (int)((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32;
            yy[l] = d * s0[is] * q1;
            yy[l + 32] = d * s0[is + 2] * q2;
            yy[l + 64] = d * s0[is + 4] * q3;
            yy[l + 96] = d * s0[is + 6] * q4;
        }
    }
}

// kernel NAME: thread b decodes block b of the (n_rows, n_blocks_row) grid of blocks
#define DEQ_KERNEL(NAME, DEQ, BS, TSZ)                                                               \
extern "C" __global__ void NAME(const unsigned char *W, float *out, long long n_rows,                \
                                long long row_bytes, long long n_blocks_row) {                        \
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                   \
    if (b >= n_rows * n_blocks_row) return;                                                           \
    long long r = b / n_blocks_row, k = b % n_blocks_row;                                             \
    DEQ(W + r * row_bytes + k * TSZ, out + b * BS);                                                   \
}

DEQ_KERNEL(deq_q8_0, deq_block_q8_0, 32, 34)
DEQ_KERNEL(deq_q4_0, deq_block_q4_0, 32, 18)
DEQ_KERNEL(deq_q5_0, deq_block_q5_0, 32, 22)
DEQ_KERNEL(deq_q4_k, deq_block_q4_k, 256, 144)
DEQ_KERNEL(deq_q6_k, deq_block_q6_k, 256, 210)

// ---- quantized matrix x few-token products (decode): Y[t, r] = sum_i W[r, i] * X[t, i] --------
// One warp per output row; each lane dots 32-weight units of the row (see GEMV_KERNEL) with every
// token's slice of X; the 32 partial sums are reduced with shuffles. X: float32
// (n_tok, n_in) row-major, Y: float32 (n_tok, n_rows); n_tok <= MAX_TOK.

#define MAX_TOK 16

// 32-weight formats: decode the block into registers with its deq_block_* and dot it with x.
#define DOT32(NAME, DEQ)                                                                             \
__device__ __forceinline__ float NAME(const unsigned char *blk, int, const float *x) {               \
    float y[32];                                                                                      \
    DEQ(blk, y);                                                                                      \
    float s = 0.f;                                                                                    \
    for (int i = 0; i < 32; ++i) s += y[i] * x[i];                                                    \
    return s;                                                                                         \
}

DOT32(dot_q8_0, deq_block_q8_0)
DOT32(dot_q4_0, deq_block_q4_0)
DOT32(dot_q5_0, deq_block_q5_0)

// K-quants are dotted by 32-weight sub-block (j = 0..7 of a 256-weight block).
__device__ __forceinline__ float dot_q4_k_sub(const unsigned char *blk, int j, const float *x) {
    float d = f16_at(blk), dmin = f16_at(blk + 2);
    int sc, m;
    scale_min_k4(j, blk + 4, &sc, &m);
    const unsigned char *q = blk + 16 + 32 * (j / 2);
    int shift = 4 * (j % 2);
    float a = 0.f, sx = 0.f;
    for (int l = 0; l < 32; ++l) {
        a += (float)((q[l] >> shift) & 0xF) * x[l];
        sx += x[l];
    }
    return d * sc * a - dmin * m * sx;
}

__device__ __forceinline__ float dot_q6_k_sub(const unsigned char *blk, int j, const float *x) {
    int n = j / 4, g = j % 4;
    const unsigned char *ql = blk + 64 * n + 32 * (g % 2), *qh = blk + 128 + 32 * n;
    const signed char *sc = (const signed char *)(blk + 192) + 8 * n + 2 * g;
    float d = f16_at(blk + 208);
    int lshift = 4 * (g / 2), hshift = 2 * g;
    float a0 = 0.f, a1 = 0.f;
    for (int l = 0; l < 16; ++l) {
        int q = (int)(((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        a0 += q * x[l];
    }
    for (int l = 16; l < 32; ++l) {
        int q = (int)(((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        a1 += q * x[l];
    }
    return d * (sc[0] * a0 + sc[1] * a1);
}

// Lane l walks the row's 32-weight units l, l+32, ...: a unit is a whole block of the 32-weight
// formats (SUBS = 1) or one of the 8 sub-blocks of a 256-weight block (SUBS = 8), so a warp's lanes
// share a row's work even when it has few 256-blocks.
#define GEMV_KERNEL(NAME, DOT, SUBS, TSZ)                                                            \
extern "C" __global__ void NAME(const unsigned char *W, const float *X, float *Y, long long n_rows,   \
                                long long row_bytes, long long n_in, int n_tok) {                     \
    long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                       \
    int lane = threadIdx.x % 32;                                                                      \
    if (r >= n_rows) return;                                                                          \
    float acc[MAX_TOK];                                                                               \
    for (int t = 0; t < n_tok; ++t) acc[t] = 0.f;                                                     \
    const unsigned char *row = W + r * row_bytes;                                                     \
    long long ns = n_in / 32;                                                                         \
    for (long long k = lane; k < ns; k += 32) {                                                       \
        const unsigned char *blk = row + (k / SUBS) * TSZ;                                            \
        for (int t = 0; t < n_tok; ++t) acc[t] += DOT(blk, (int)(k % SUBS), X + t * n_in + k * 32);   \
    }                                                                                                 \
    for (int t = 0; t < n_tok; ++t) {                                                                 \
        float v = acc[t];                                                                             \
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);                   \
        if (lane == 0) Y[t * n_rows + r] = v;                                                         \
    }                                                                                                 \
}

GEMV_KERNEL(gemv_q8_0, dot_q8_0, 1, 34)
GEMV_KERNEL(gemv_q4_0, dot_q4_0, 1, 18)
GEMV_KERNEL(gemv_q5_0, dot_q5_0, 1, 22)
GEMV_KERNEL(gemv_q4_k, dot_q4_k_sub, 8, 144)
GEMV_KERNEL(gemv_q6_k, dot_q6_k_sub, 8, 210)
