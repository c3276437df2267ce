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

extern "C" __global__ void deq_q8_0(const unsigned char *W, float *out, long long n_rows,
                                    long long row_bytes, long long n_blocks_row) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_rows * n_blocks_row) return;
    long long r = b / n_blocks_row, k = b % n_blocks_row;
    const unsigned char *blk = W + r * row_bytes + k * 34;
    float d = f16_at(blk);
    float *y = out + (r * n_blocks_row + k) * 32;
    const signed char *q = (const signed char *)(blk + 2);
    for (int i = 0; i < 32; ++i) y[i] = d * (float)q[i];
}

extern "C" __global__ void deq_q4_0(const unsigned char *W, float *out, long long n_rows,
                                    long long row_bytes, long long n_blocks_row) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_rows * n_blocks_row) return;
    long long r = b / n_blocks_row, k = b % n_blocks_row;
    const unsigned char *blk = W + r * row_bytes + k * 18;
    float d = f16_at(blk);
    float *y = out + (r * n_blocks_row + k) * 32;
    for (int j = 0; j < 16; ++j) {
        int q = blk[2 + j];
        y[j] = d * (float)((q & 0xF) - 8);
        y[j + 16] = d * (float)((q >> 4) - 8);
    }
}

extern "C" __global__ void deq_q5_0(const unsigned char *W, float *out, long long n_rows,
                                    long long row_bytes, long long n_blocks_row) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_rows * n_blocks_row) return;
    long long r = b / n_blocks_row, k = b % n_blocks_row;
    const unsigned char *blk = W + r * row_bytes + k * 22;
    float d = f16_at(blk);
    unsigned int qh = (unsigned int)blk[2] | ((unsigned int)blk[3] << 8) | ((unsigned int)blk[4] << 16) |
                      ((unsigned int)blk[5] << 24);
    float *y = out + (r * n_blocks_row + k) * 32;
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

extern "C" __global__ void deq_q4_k(const unsigned char *W, float *out, long long n_rows,
                                    long long row_bytes, long long n_blocks_row) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_rows * n_blocks_row) return;
    long long r = b / n_blocks_row, k = b % n_blocks_row;
    const unsigned char *blk = W + r * row_bytes + k * 144;
    float d = f16_at(blk), dmin = f16_at(blk + 2);
    const unsigned char *scales = blk + 4, *qs = blk + 16;
    float *y = out + (r * n_blocks_row + k) * 256;
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

extern "C" __global__ void deq_q6_k(const unsigned char *W, float *out, long long n_rows,
                                    long long row_bytes, long long n_blocks_row) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_rows * n_blocks_row) return;
    long long r = b / n_blocks_row, k = b % n_blocks_row;
    const unsigned char *blk = W + r * row_bytes + k * 210;
    const unsigned char *ql = blk, *qh = blk + 128;
    const signed char *sc = (const signed char *)(blk + 192);
    float d = f16_at(blk + 208);
    float *y = out + (r * n_blocks_row + k) * 256;
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
