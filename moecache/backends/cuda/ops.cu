// The non-quantized layer operations of the CuPy backend, one launch each: RMSNorm, RoPE, gated
// activations, decode attention over the KV cache and softmax top-k routing (with the router product
// of a decode step: router_topk). float32 throughout.
// Formulas: the numpy twins in moecache/backends/ops.py and moecache/models/base.py (the tests
// compare against them). Written for moecache.

#include <cuda_fp16.h>

#define NEG_INF (-__int_as_float(0x7f800000))  // nvrtc has no math.h INFINITY
#ifndef MAX_TOK
#define MAX_TOK 16  // tokens of a decode step (router_topk): DECODE_MAX_TOKENS of moecache/backends/ops.py,
#endif              // which the backend passes as -DMAX_TOK when it compiles this file

// KV cache elements: float32 (default) or float16 (-ctk/-ctv f16), read and written as float
__device__ __forceinline__ float kv_load(const float *p) { return *p; }
__device__ __forceinline__ float kv_load(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ void kv_put(float *p, float v) { *p = v; }
__device__ __forceinline__ void kv_put(__half *p, float v) { *p = __float2half(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w   (w may be null). One block per row of n floats.
extern "C" __global__ void rms_norm(const float *x, const float *w, float *y, long long n, float eps) {
    __shared__ float part[32];
    const float *xr = x + blockIdx.x * n;
    float *yr = y + blockIdx.x * n;
    float s = 0.f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    s = warp_sum(s);
    int wid = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    if (lane == 0) part[wid] = s;
    __syncthreads();
    if (wid == 0) {
        s = lane < nw ? part[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) part[0] = s;
    }
    __syncthreads();
    float inv = 1.f / sqrtf(part[0] / (float)n + eps);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w ? xr[i] * inv * w[i] : xr[i] * inv;
}

// RMSNorm fused with the residual sum before it and the 8-bit activation rounding after it (the
// decode path with act_q8): v = x + r (r may be null; then h is not written), h = v,
// y = v / sqrt(mean(v^2) + eps) * w (w may be null), and y rounded as quantize_q8 of mmvq.cu does:
// XQ int8 (T, n), XD, XS float (T, n / 32). One block per row of n floats (n % 256 == 0,
// n <= 8192), n / 8 threads: thread i holds elements 8i .. 8i + 7 (four threads per 32-value unit).
extern "C" __global__ void rms_norm_q8(const float *x, const float *r, const float *w, float *h, float *y,
                                       signed char *XQ, float *XD, float *XS, int n, float eps) {
    __shared__ float red[32];
    int row = blockIdx.x, i = threadIdx.x, lane = i % 32, wid = i / 32, nw = blockDim.x / 32;
    long long o = (long long)row * n + 8 * i;
    float v[8];
    {
        float4 a = *(const float4 *)(x + o), b = *(const float4 *)(x + o + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
    if (r != nullptr) {
        float4 a = *(const float4 *)(r + o), b = *(const float4 *)(r + o + 4);
        v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w; v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
        *(float4 *)(h + o) = make_float4(v[0], v[1], v[2], v[3]);
        *(float4 *)(h + o + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
    ss = warp_sum(ss);
    if (lane == 0) red[wid] = ss;
    __syncthreads();
    if (wid == 0) {
        float tt = lane < nw ? red[lane] : 0.f;
        tt = warp_sum(tt);
        if (lane == 0) red[0] = tt;
    }
    __syncthreads();
    float inv = 1.f / sqrtf(red[0] / (float)n + eps);
    float wv[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
    if (w != nullptr) {
        float4 a = *(const float4 *)(w + 8 * i), b = *(const float4 *)(w + 8 * i + 4);
        wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w; wv[4] = b.x; wv[5] = b.y; wv[6] = b.z; wv[7] = b.w;
    }
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        v[k] = w != nullptr ? v[k] * inv * wv[k] : v[k] * inv;
        amax = fmaxf(amax, fabsf(v[k]));
    }
    *(float4 *)(y + o) = make_float4(v[0], v[1], v[2], v[3]);
    *(float4 *)(y + o + 4) = make_float4(v[4], v[5], v[6], v[7]);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    float d = amax / 127.f;
    int q[8], s = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        q[k] = amax == 0.f ? 0 : __float2int_rn(v[k] / d);
        s += q[k];
    }
    int lo = (q[0] & 0xFF) | ((q[1] & 0xFF) << 8) | ((q[2] & 0xFF) << 16) | ((q[3] & 0xFF) << 24);
    int hi = (q[4] & 0xFF) | ((q[5] & 0xFF) << 8) | ((q[6] & 0xFF) << 16) | ((q[7] & 0xFF) << 24);
    *(int2 *)(XQ + o) = make_int2(lo, hi);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if ((i & 3) == 0) {
        long long u = o / 32;
        XD[u] = d;
        XS[u] = d * (float)s;
    }
}

// RoPE of x (T, H, D): rotates the first 2*half dims of each head with cos/sin (T, half); pairs
// (i, i + half) when neox, (2i, 2i + 1) otherwise; other dims are copied. One thread per pair.
extern "C" __global__ void rope(const float *x, float *y, const float *cs, const float *sn, int T, int H, int D,
                                int half, int neox) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long n_pairs = (long long)T * H * (D / 2);
    if (i >= n_pairs) return;
    int j = (int)(i % (D / 2));
    long long th = i / (D / 2);
    int t = (int)(th / H);
    const float *xh = x + th * D;
    float *yh = y + th * D;
    if (j < half) {
        float c = cs[t * half + j], s = sn[t * half + j];
        int a = neox ? j : 2 * j, b = neox ? j + half : 2 * j + 1;
        float xa = xh[a], xb = xh[b];
        yh[a] = xa * c - xb * s;
        yh[b] = xa * s + xb * c;
    } else {  // the unrotated tail: dims 2*half .. D, two per thread
        int a = 2 * half + 2 * (j - half);
        yh[a] = xh[a];
        yh[a + 1] = xh[a + 1];
    }
}

// act 0: SiLU, 1: GELU (tanh approximation, as ggml_gelu)
__device__ __forceinline__ float glu_act(float a, int act) {
    if (act == 0) return a / (1.f + __expf(-a));
    const float c = 0.7978845608028654f;
    return 0.5f * a * (1.f + tanhf(c * (a + 0.044715f * a * a * a)));
}

// out = act(g) * u
extern "C" __global__ void glu(const float *g, const float *u, float *out, long long n, int act) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = glu_act(g[i], act) * u[i];
}

// out = act(g) * u rounded to float16 (the prompt MoE's down-product operand: one launch, no
// float32 copy of the product)
extern "C" __global__ void glu_f16(const float *g, const float *u, __half *out, long long n, int act) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = __float2half_rn(glu_act(g[i], act) * u[i]);
}

// Attention of T few queries over the cache (the decode shape). q (T, H, D); K (n_ctx, Hkv, D),
// V (n_ctx, Hkv, Dv); out (T, H * Dv). Query t is at position pos[t] (device memory: a captured
// CUDA graph replays at any position) and sees keys max(0, p - window + 1) .. p (window 0: all).
// Split over the keys ("flash-decoding", Dao et al. 2023): grid (H, T, S); block s of (h, t) takes
// the s-th of S equal runs of the query's keys, its ATT_WARPS warps take every ATT_WARPS-th key of
// the run with an online softmax (Milakov & Gimelshein 2018) and merge; the block writes its
// unnormalised partial (max logit M, sum L, o[Dv]) to part (T, H, S, Dv + 2) and attn_combine
// merges the S partials. S is fixed when a graph is captured, the runs follow the position, so
// every position keeps all blocks busy. Decode attention is latency-bound (a key costs a load and
// a warp reduction): a key's K and V rows are loaded together. D, Dv <= 256.
// kvb (may be null): query t's keys start at row kvb[t] of K and V (several sequences in one cache
// buffer, one query each: a batched decode step); null: row 0 for every query.
#define ATT_WARPS 4
template <typename KV>
__device__ void attn_split_t(const float *q, const KV *K, const KV *V, float *part, const int *pos, int H, int Hkv,
                             int D, int Dv, float scale, int window, float softcap, int max_keys, const int *kvb) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], so[ATT_WARPS][256];
    int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
    int hk = h / (H / Hkv);
    int p = pos[t];
    if (kvb != nullptr) {
        K += (long long)kvb[t] * Hkv * D;
        V += (long long)kvb[t] * Hkv * Dv;
    }
    int start = window > 0 ? max(0, p - window + 1) : 0;
    if (max_keys > 0 && p - start + 1 >= max_keys) return;  // attn_gqa takes this query
    int chunk = (p - start + S) / S;  // ceil(n_keys / S)
    int j0 = start + s * chunk, j1 = min(p + 1, j0 + chunk);
    const float *qh = q + ((long long)t * H + h) * D;
    float qr[8], acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int d = lane + 32 * i;
        qr[i] = d < D ? qh[d] : 0.f;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int j = j0 + wid; j < j1; j += ATT_WARPS) {
        const KV *kj = K + ((long long)j * Hkv + hk) * D;
        const KV *vj = V + ((long long)j * Hkv + hk) * Dv;
        float kr[8], vr[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int d = lane + 32 * i;
            kr[i] = d < D ? kv_load(kj + d) : 0.f;
            vr[i] = d < Dv ? kv_load(vj + d) : 0.f;
        }
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) x += qr[i] * kr[i];
        x = warp_sum(x) * scale;
        if (softcap > 0.f) x = softcap * tanhf(x / softcap);
        float m2 = fmaxf(m, x);
        float a = __expf(m - m2), e = __expf(x - m2);
        l = l * a + e;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + e * vr[i];
        m = m2;
    }
    if (lane == 0) {
        sm[wid] = m;
        sl[wid] = l;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int d = lane + 32 * i;
        if (d < Dv) so[wid][d] = acc[i];
    }
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, sm[w]);
    float L = 0.f;
    for (int w = 0; w < ATT_WARPS; ++w) L += sm[w] == NEG_INF ? 0.f : sl[w] * __expf(sm[w] - M);
    float *ps = part + (((long long)t * H + h) * S + s) * (Dv + 2);
    if (threadIdx.x == 0) {
        ps[0] = M;
        ps[1] = L;
    }
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w)
            if (sm[w] != NEG_INF) o += so[w][d] * __expf(sm[w] - M);
        ps[2 + d] = o;
    }
}

// max_keys > 0: queries with at least that many keys are left to attn_gqa (nothing written for them)
extern "C" __global__ void attn_decode(const float *q, const float *K, const float *V, float *part, const int *pos,
                                       int H, int Hkv, int D, int Dv, float scale, int window, float softcap,
                                       int max_keys, const int *kvb) {
    attn_split_t(q, K, V, part, pos, H, Hkv, D, Dv, scale, window, softcap, max_keys, kvb);
}

extern "C" __global__ void attn_decode_f16(const float *q, const __half *K, const __half *V, float *part,
                                           const int *pos, int H, int Hkv, int D, int Dv, float scale, int window,
                                           float softcap, int max_keys, const int *kvb) {
    attn_split_t(q, K, V, part, pos, H, Hkv, D, Dv, scale, window, softcap, max_keys, kvb);
}

// Decode attention that reads each KV head once for its whole query group (grouped-query attention:
// G = H / Hkv query heads share a KV head), split over keys as flash-decoding does. Grid (Hkv, T, S),
// GQA_THREADS threads; the query's keys go in runs of gqa_run(n_keys, S, min_run) keys (ceil(n_keys / S)
// in whole chunks; n_keys from the position in device memory, so a captured graph replays at any
// position; blocks past the last run return at once); block s of (kv head hk, query t) takes run s for the G heads
// hk*G .. hk*G + G - 1, in chunks of CH keys with an online softmax (Milakov & Gimelshein 2018):
//   0. the chunk's K and V rows are loaded into shared memory by every thread at once, 16 bytes per
//      load, all of a thread's loads issued before any is stored (a block keeps ~2 * CH * D * size
//      bytes in flight: reading the keys is bound by bandwidth, not by one warp's chain of loads);
//      the next chunk's loads are issued before this chunk is computed;
//   1. scores: thread (key i, head set) takes the dot products of key i with its heads, K from
//      shared memory (rows padded by one word: the 32 lanes' keys fall in 32 banks), the queries
//      (in shared memory) broadcast;
//   2. per head, the chunk's max and exp-sum (a warp per head) rescale the running M, L and o;
//   3. o[g][d] += sum_i p[g][i] V[i][d]: thread (dim pair, head set), V from shared memory.
// The partials (M, L, o) go to part (T, H, S, D + 2) as attn_decode writes them (attn_combine
// merges them). Needs G <= GQA_MAX_G, D = Dv in {64, 128, 256} and G * D <= 2048 (gqa_ok in
// cupy_backend.py). kvb: as in attn_split_t (query t's keys from row kvb[t]; null: row 0).
#define GQA_THREADS 128
#define GQA_MAX_G 16

// keys per run of a query with n_keys keys, S runs: ceil(n_keys / S), at least min_run, rounded up
// to a multiple of min_run (a block's keys are whole 64-key chunks: 16448 keys in 256 runs are 129
// runs of 128, where they were 254 runs of 65 keys, each a 64-key chunk and a 1-key chunk). Below
// 64 * S keys every run is min_run keys, as before the rounding.
__device__ __forceinline__ int gqa_run(int n_keys, int S, int min_run) {
    min_run = max(1, min_run);
    int r = max(min_run, (n_keys + S - 1) / S);
    return (r + min_run - 1) / min_run * min_run;
}

// The keys j0 .. j1 - 1 of attn_gqa's block (query t, run s of S): false when the block has none
// (a query of fewer than min_keys keys is attn_decode's; runs past the query's keys are empty); K
// and V are moved to the query's rows (kvb: as in attn_split_t; D = Dv)
template <typename KV>
__device__ __forceinline__ bool gqa_keys(const int *pos, const int *kvb, int t, int s, int S, int window,
                                         int min_keys, int run, long long row_elems, const KV *&K,
                                         const KV *&V, int &j0, int &j1) {
    int p = pos[t];
    int start = window > 0 ? max(0, p - window + 1) : 0;
    if (p - start + 1 < min_keys) return false;
    if (kvb != nullptr) {
        K += (long long)kvb[t] * row_elems;
        V += (long long)kvb[t] * row_elems;
    }
    run = gqa_run(p - start + 1, S, run);
    j0 = start + s * run;
    j1 = min(p + 1, j0 + run);
    return j0 < j1;
}

// Issues the loads of the chunk at key c0 (keys c0 .. min(c0 + CH, j1) - 1; pieces past the run:
// none): each thread's LPT 16-byte pieces of K and of V (W4 pieces per row, rows rstride elements
// apart, KV head hk's D elements at hk * D), into kr and vr
template <typename KV, int D, int CH, int LPT, int NT>
__device__ __forceinline__ void gqa_fetch(const KV *K, const KV *V, long long rstride, int hk, int c0, int j1,
                                          int tid, uint4 (&kr)[LPT], uint4 (&vr)[LPT]) {
    constexpr int W4 = D * (int)sizeof(KV) / 16;
    int n = min(CH, j1 - c0);
#pragma unroll
    for (int k = 0; k < LPT; ++k) {
        int u = tid + k * NT, r = u / W4, c = u % W4;
        if (r < n) {
            long long at = (long long)(c0 + r) * rstride + (long long)hk * D;
            kr[k] = ((const uint4 *)(K + at))[c];
            vr[k] = ((const uint4 *)(V + at))[c];
        }
    }
}

// Step 2 of attn_gqa (online softmax, Milakov & Gimelshein 2018): warp w takes heads w, w + NT/32,
// ...: over the chunk's n scores of head g (row g of sc, rows scs floats apart) the max, then
// p = e^(x - M) in place (0 past n, up to CH), the running max M, sum L and the factor A = e^(M_old
// - M) that rescales the head's sums (sM, sL, sA: shared memory, GQA_MAX_G entries)
template <int CH, int NT>
__device__ __forceinline__ void gqa_softmax_chunk(float *sc, int scs, int G, int n, int wid, int lane, float *sM,
                                                  float *sL, float *sA) {
    for (int g = wid; g < G; g += NT / 32) {
        float *row = sc + g * scs;
        float m = NEG_INF;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, row[i]);
        m = warp_max(m);
        float M = fmaxf(sM[g], m);
        float sum = 0.f;
        for (int i = lane; i < CH; i += 32) {
            float e = i < n ? __expf(row[i] - M) : 0.f;
            row[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        __syncwarp();
        if (lane == 0) {
            float a = sM[g] == NEG_INF ? 0.f : __expf(sM[g] - M);
            sA[g] = a;
            sL[g] = sL[g] * a + sum;
            sM[g] = M;
        }
    }
}

// elements 2w, 2w + 1 of a K or V row staged in shared memory as 32-bit words
__device__ __forceinline__ float2 kv_pair(const unsigned *row, int w, __half) {
    return __half22float2(*(const __half2 *)(row + w));
}
__device__ __forceinline__ float2 kv_pair(const unsigned *row, int w, float) {
    return make_float2(__uint_as_float(row[2 * w]), __uint_as_float(row[2 * w + 1]));
}

template <typename KV, int D>
__device__ void attn_gqa_t(const float *q, const KV *K, const KV *V, float *part, const int *pos, int H, int Hkv,
                           float scale, int window, float softcap, int run, int min_keys, const int *kvb) {
    constexpr int NT = GQA_THREADS;
    constexpr int W = D * (int)sizeof(KV) / 4;   // 32-bit words per row
    constexpr int RS = W + 1;                     // padded row stride in shared memory (words)
    constexpr int CH = W <= 64 ? 64 : 4096 / W;   // keys per chunk: K + V stay under ~33 KB
    constexpr int W4 = W / 4;                     // 16-byte pieces per row
    constexpr int LPT = CH * W4 / NT;             // pieces per thread per chunk (of K, and of V)
    constexpr int HS = NT / CH;                   // scores: threads per key (head sets)
    constexpr int HPS = (GQA_MAX_G + HS - 1) / HS;  // ... heads per thread at most
    constexpr int P = D / 2;                      // sums: dim pairs
    constexpr int HG = NT / P;                    // ... threads per dim pair (head sets)
    constexpr int HPG = 2048 / D / HG;            // ... heads per thread at most (G * D <= 2048)
    static_assert(LPT * NT == CH * W4 && HS * CH == NT && HG * P == NT, "shapes");
    __shared__ unsigned ks[CH * RS], vs[CH * RS];
    __shared__ __align__(16) float qs[2048];      // the group's queries, G * D <= 2048
    __shared__ float sc[GQA_MAX_G][CH];
    __shared__ float sM[GQA_MAX_G], sL[GQA_MAX_G], sA[GQA_MAX_G];
    int hk = blockIdx.x, t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    int G = H / Hkv, tid = threadIdx.x, wid = tid / 32, lane = tid % 32;
    long long rstride = (long long)Hkv * D;  // elements between one key's rows
    int j0, j1;
    // attn_combine reads only the runs that hold keys
    if (!gqa_keys(pos, kvb, t, s, S, window, min_keys, run, rstride, K, V, j0, j1)) return;
    const float *qg = q + ((long long)t * H + (long long)hk * G) * D;
    for (int i = tid; i < G * D; i += NT) qs[i] = qg[i];
    if (tid < GQA_MAX_G) {
        sM[tid] = NEG_INF;
        sL[tid] = 0.f;
    }
    uint4 kr[LPT], vr[LPT];
    gqa_fetch<KV, D, CH, LPT, NT>(K, V, rstride, hk, j0, j1, tid, kr, vr);
    // the dims and heads of this thread in the sums
    int dp = tid % P, dg = tid / P;
    float acc[HPG][2];
#pragma unroll
    for (int k = 0; k < HPG; ++k) acc[k][0] = acc[k][1] = 0.f;
    for (int c0 = j0; c0 < j1; c0 += CH) {
        int n = min(CH, j1 - c0);
        __syncthreads();  // the previous chunk is done with ks, vs and sc (and qs, sM are written)
#pragma unroll
        for (int k = 0; k < LPT; ++k) {
            int u = tid + k * NT, r = u / W4, c = u % W4;
            if (r < n) {
                unsigned *kd = ks + r * RS + 4 * c, *vd = vs + r * RS + 4 * c;
                kd[0] = kr[k].x; kd[1] = kr[k].y; kd[2] = kr[k].z; kd[3] = kr[k].w;
                vd[0] = vr[k].x; vd[1] = vr[k].y; vd[2] = vr[k].z; vd[3] = vr[k].w;
            }
        }
        __syncthreads();
        if (c0 + CH < j1) gqa_fetch<KV, D, CH, LPT, NT>(K, V, rstride, hk, c0 + CH, j1, tid, kr, vr);  // in flight
                                                                                                    // while this chunk is computed
        // 1. scores of key i for heads hs, hs + HS, ...
        {
            int i = tid % CH, hs = tid / CH;
            float x[HPS];
#pragma unroll
            for (int k = 0; k < HPS; ++k) x[k] = 0.f;
            const unsigned *row = ks + i * RS;
#pragma unroll 8
            for (int w = 0; w < D / 2; ++w) {
                float2 kv = kv_pair(row, w, KV());
#pragma unroll
                for (int k = 0; k < HPS; ++k) {
                    int g = hs + k * HS;
                    if (g < G) {
                        float2 qv = *(const float2 *)(qs + g * D + 2 * w);
                        x[k] += qv.x * kv.x + qv.y * kv.y;
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < HPS; ++k) {
                int g = hs + k * HS;
                if (g < G) {
                    float v = x[k] * scale;
                    if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                    sc[g][i] = i < n ? v : NEG_INF;
                }
            }
        }
        __syncthreads();
        // 2. a warp per head: the chunk's max, p = e^(x - M), the running M and L
        gqa_softmax_chunk<CH, NT>(&sc[0][0], CH, G, n, wid, lane, sM, sL, sA);
        __syncthreads();
        // 3. o += p V for dims 2 dp, 2 dp + 1 of heads dg, dg + HG, ...
#pragma unroll
        for (int k = 0; k < HPG; ++k) {
            int g = dg + k * HG;
            if (g < G) {
                float a = sA[g];
                acc[k][0] *= a;
                acc[k][1] *= a;
            }
        }
        for (int i = 0; i < n; ++i) {
            float2 v = kv_pair(vs + i * RS, dp, KV());
#pragma unroll
            for (int k = 0; k < HPG; ++k) {
                int g = dg + k * HG;
                if (g < G) {
                    float pr = sc[g][i];
                    acc[k][0] += pr * v.x;
                    acc[k][1] += pr * v.y;
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < HPG; ++k) {
        int g = dg + k * HG;
        if (g < G) {
            float *ps = part + (((long long)t * H + (long long)hk * G + g) * S + s) * (D + 2);
            ps[2 + 2 * dp] = acc[k][0];
            ps[3 + 2 * dp] = acc[k][1];
            if (dp == 0) {
                ps[0] = sM[g];
                ps[1] = sL[g];
            }
        }
    }
}

#ifndef GQA_MIN_BLOCKS
// blocks per SM the registers must leave room for (__launch_bounds__'s minimum): 1 lets the compiler
// keep the sums in 183 registers (no spills; two blocks of 128 threads still fit an SM); on the H200
// with 512-thread merges, 12.5 / 16.1 / 49.7 µs per layer at 1024 / 4096 / 16000 keys against 19.6 /
// 23.3 / 48.6 with 4 (128 registers, 8 bytes spilled), bench/attn_variants.py
#define GQA_MIN_BLOCKS 1
#endif
#define GQA_KERNEL(NAME, KV, D)                                                                       \
extern "C" __global__ void __launch_bounds__(GQA_THREADS, GQA_MIN_BLOCKS) NAME(const float *q, const KV *K, const KV *V, \
        float *part, const int *pos, int H, int Hkv, int D_, int Dv, float scale, int window, float softcap, \
        int run, int min_keys, const int *kvb) {                                                      \
    attn_gqa_t<KV, D>(q, K, V, part, pos, H, Hkv, scale, window, softcap, run, min_keys, kvb);      \
}
GQA_KERNEL(attn_gqa_d2, float, 64)
GQA_KERNEL(attn_gqa_d4, float, 128)
GQA_KERNEL(attn_gqa_d8, float, 256)

// The float16 cache's attn_gqa on tensor cores (sm_80+; older GPUs take attn_gqa_t): same grid, runs,
// chunks and partials as attn_gqa_t, and the same online softmax (step 2 is attn_gqa_t's), but both
// products are warp-level m16n8k16 MMAs (f16 inputs, f32 sums; PTX ISA, "Matrix fragments for
// mma.m16n8k16"): the group's G <= 16 query heads are the 16 rows of A (rows >= G zero).
//   scores (16 x CH) = Q (16 x D) K^T: warp w takes keys w*CH/4 .. (w+1)*CH/4 - 1, K rows from shared
//     memory are B's columns as they lie (two dims per 32-bit word);
//   o (16 x D) += P (16 x CH) V: warp w takes dims w*D/4 .. (w+1)*D/4 - 1, B's pairs of keys gathered
//     from V's rows in shared memory.
// Q and P are float32 split in two float16 parts, x = hi + lo with hi = f16(x), lo = f16(x - hi), and
// each product is the sum of the two MMAs: the result carries ~2^-22 of |x| (f16's 11-bit significand,
// twice) instead of f16 rounding's 2^-11, so the partials match attn_gqa_t's float32 sums to float
// rounding (K and V are float16 already: exact in the MMA). Limits: |q| < 65504 (f16's range, as the
// cache's K and V); lo below f16's normal range (|x - hi| < 6.1e-5) keeps 2^-24 absolute.
// Shared-memory rows are padded to 4 words mod 32 (K and V), 4 (Q) and 8 (P): a warp's K and Q
// fragment loads (8 rows x 4 words) fall in 32 different banks, its P loads (8-byte, by half warps)
// and its V gathers (4 key pairs x 8 dims) without conflicts too; the score stores are 2-way. V rows past the run are stored as zeros (P is 0 there,
// and 0 x NaN from stale shared memory would be NaN).
__device__ __forceinline__ void mma_16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (x, y) as two float16 pairs: hi = f16(x, y), lo = f16 of the remainders (low half: x)
__device__ __forceinline__ void split_f16x2(float x, float y, unsigned &hi, unsigned &lo) {
    __half2 h = __floats2half2_rn(x, y);
    float2 hf = __half22float2(h);
    __half2 l = __floats2half2_rn(x - hf.x, y - hf.y);
    hi = *reinterpret_cast<unsigned *>(&h);
    lo = *reinterpret_cast<unsigned *>(&l);
}

template <int D>
__device__ void attn_gqa_mma_t(const float *q, const __half *K, const __half *V, float *part, const int *pos, int H,
                               int Hkv, float scale, int window, float softcap, int run, int min_keys,
                               const int *kvb) {
    constexpr int NT = GQA_THREADS;                    // 4 warps
    constexpr int W = D / 2;                           // 32-bit words per K or V row
    constexpr int RS = W + 4;                          // padded row stride (words), 4 mod 32
    constexpr int CH = W <= 64 ? 64 : 32;              // keys per chunk (as attn_gqa_t's)
    constexpr int W4 = W / 4;                          // 16-byte pieces per row
    constexpr int LPT = CH * W4 / NT;                  // pieces per thread per chunk (of K, and of V)
    constexpr int QR = 2048 / D < 16 ? 2048 / D : 16;  // query rows held: G <= QR (G * D <= 2048)
    constexpr int SCS = CH + 8;                        // score row stride (floats), 8 mod 32
    constexpr int KPW = CH / 4, NKT = KPW / 8;         // scores: keys per warp, n-tiles of 8 keys
    constexpr int DPW = D / 4, NDT = DPW / 8;          // sums: dims per warp, n-tiles of 8 dims
    static_assert(LPT * NT == CH * W4 && NKT >= 1 && NDT >= 1 && CH % 16 == 0, "shapes");
    __shared__ __align__(16) unsigned ks[CH * RS], vs[CH * RS];
    __shared__ unsigned qh[QR * RS], ql[QR * RS];
    __shared__ __align__(16) float sc[QR * SCS];
    __shared__ float sM[GQA_MAX_G], sL[GQA_MAX_G], sA[GQA_MAX_G];
    int hk = blockIdx.x, t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    int G = H / Hkv, tid = threadIdx.x, wid = tid / 32, lane = tid % 32;
    int gid = lane / 4, tig = lane % 4;  // the fragments' row (group) and pair-in-row indices
    long long rstride = (long long)Hkv * D;
    int j0, j1;
    if (!gqa_keys(pos, kvb, t, s, S, window, min_keys, run, rstride, K, V, j0, j1)) return;
    const float *qg = q + ((long long)t * H + (long long)hk * G) * D;
    for (int i = tid; i < QR * W; i += NT) {  // Q as hi + lo float16 pairs, rows >= G zero
        int g = i / W, w = i % W;
        float2 x = g < G ? *(const float2 *)(qg + g * D + 2 * w) : make_float2(0.f, 0.f);
        split_f16x2(x.x, x.y, qh[g * RS + w], ql[g * RS + w]);
    }
    if (tid < GQA_MAX_G) {
        sM[tid] = NEG_INF;
        sL[tid] = 0.f;
    }
    uint4 kr[LPT], vr[LPT];
    gqa_fetch<__half, D, CH, LPT, NT>(K, V, rstride, hk, j0, j1, tid, kr, vr);
    float acc[NDT][4];
#pragma unroll
    for (int k = 0; k < NDT; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.f;
    bool lo_row = gid + 8 < QR;  // A's rows gid + 8 exist (QR 16)
    for (int c0 = j0; c0 < j1; c0 += CH) {
        int n = min(CH, j1 - c0);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < LPT; ++k) {
            int u = tid + k * NT, r = u / W4, c = u % W4;
            uint4 z = make_uint4(0u, 0u, 0u, 0u);
            *(uint4 *)(ks + r * RS + 4 * c) = r < n ? kr[k] : z;
            *(uint4 *)(vs + r * RS + 4 * c) = r < n ? vr[k] : z;
        }
        __syncthreads();
        if (c0 + CH < j1) gqa_fetch<__half, D, CH, LPT, NT>(K, V, rstride, hk, c0 + CH, j1, tid, kr, vr);
        // 1. scores of this warp's keys for the 16 rows
        {
            float sa[NKT][4];
#pragma unroll
            for (int nt = 0; nt < NKT; ++nt) sa[nt][0] = sa[nt][1] = sa[nt][2] = sa[nt][3] = 0.f;
#pragma unroll 4
            for (int kk = 0; kk < D / 16; ++kk) {
                int wq = kk * 8 + tig;  // the word of dims 16 kk + 2 tig, + 1
                unsigned ah[4], al[4];
                ah[0] = qh[gid * RS + wq];
                ah[2] = qh[gid * RS + wq + 4];
                al[0] = ql[gid * RS + wq];
                al[2] = ql[gid * RS + wq + 4];
                ah[1] = lo_row ? qh[(gid + 8) * RS + wq] : 0u;
                ah[3] = lo_row ? qh[(gid + 8) * RS + wq + 4] : 0u;
                al[1] = lo_row ? ql[(gid + 8) * RS + wq] : 0u;
                al[3] = lo_row ? ql[(gid + 8) * RS + wq + 4] : 0u;
#pragma unroll
                for (int nt = 0; nt < NKT; ++nt) {
                    const unsigned *kro = ks + (wid * KPW + nt * 8 + gid) * RS + wq;
                    unsigned b0 = kro[0], b1 = kro[4];
                    mma_16816(sa[nt], ah, b0, b1);
                    mma_16816(sa[nt], al, b0, b1);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NKT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int g = gid + (e >= 2 ? 8 : 0), i = wid * KPW + nt * 8 + 2 * tig + (e & 1);
                    if (g < G) {
                        float v = sa[nt][e] * scale;
                        if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                        sc[g * SCS + i] = i < n ? v : NEG_INF;
                    }
                }
            }
        }
        __syncthreads();
        // 2. a warp per head: the chunk's max, p = e^(x - M), the running M and L (as attn_gqa_t)
        gqa_softmax_chunk<CH, NT>(sc, SCS, G, n, wid, lane, sM, sL, sA);
        __syncthreads();
        // 3. o += P V for this warp's dims
        {
            float a0 = gid < G ? sA[gid] : 0.f, a1 = gid + 8 < G ? sA[gid + 8] : 0.f;
#pragma unroll
            for (int nt = 0; nt < NDT; ++nt) {
                acc[nt][0] *= a0;
                acc[nt][1] *= a0;
                acc[nt][2] *= a1;
                acc[nt][3] *= a1;
            }
            const unsigned short *vh = (const unsigned short *)vs;
#pragma unroll
            for (int kk = 0; kk < CH / 16; ++kk) {
                int i0 = kk * 16 + 2 * tig;  // keys i0, i0 + 1 (and + 8, + 9)
                float2 z = make_float2(0.f, 0.f);
                float2 p00 = gid < G ? *(const float2 *)(sc + gid * SCS + i0) : z;
                float2 p01 = gid < G ? *(const float2 *)(sc + gid * SCS + i0 + 8) : z;
                float2 p10 = gid + 8 < G ? *(const float2 *)(sc + (gid + 8) * SCS + i0) : z;
                float2 p11 = gid + 8 < G ? *(const float2 *)(sc + (gid + 8) * SCS + i0 + 8) : z;
                unsigned ph[4], pl[4];
                split_f16x2(p00.x, p00.y, ph[0], pl[0]);
                split_f16x2(p10.x, p10.y, ph[1], pl[1]);
                split_f16x2(p01.x, p01.y, ph[2], pl[2]);
                split_f16x2(p11.x, p11.y, ph[3], pl[3]);
#pragma unroll
                for (int nt = 0; nt < NDT; ++nt) {
                    int dim = wid * DPW + nt * 8 + gid;
                    const unsigned short *vc = vh + i0 * 2 * RS + dim;  // V[i0][dim]
                    unsigned b0 = (unsigned)vc[0] | ((unsigned)vc[2 * RS] << 16);
                    unsigned b1 = (unsigned)vc[16 * RS] | ((unsigned)vc[18 * RS] << 16);
                    mma_16816(acc[nt], ph, b0, b1);
                    mma_16816(acc[nt], pl, b0, b1);
                }
            }
        }
    }
    // rows gid, gid + 8 of this warp's dims; M and L per head
#pragma unroll
    for (int nt = 0; nt < NDT; ++nt) {
        int d = wid * DPW + nt * 8 + 2 * tig;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            int g = gid + 8 * hh;
            if (g < G) {
                float *ps = part + (((long long)t * H + (long long)hk * G + g) * S + s) * (D + 2);
                ps[2 + d] = acc[nt][2 * hh];
                ps[3 + d] = acc[nt][2 * hh + 1];
            }
        }
    }
    if (tid < G) {
        float *ps = part + (((long long)t * H + (long long)hk * G + tid) * S + s) * (D + 2);
        ps[0] = sM[tid];
        ps[1] = sL[tid];
    }
}

// sm_80+: the tensor-core kernel; older GPUs: attn_gqa_t (mma.m16n8k16 needs sm_80)
template <int D>
__device__ __forceinline__ void attn_gqa_f16(const float *q, const __half *K, const __half *V, float *part,
                                             const int *pos, int H, int Hkv, float scale, int window,
                                             float softcap, int run, int min_keys, const int *kvb) {
#if __CUDA_ARCH__ >= 800
    attn_gqa_mma_t<D>(q, K, V, part, pos, H, Hkv, scale, window, softcap, run, min_keys, kvb);
#else
    attn_gqa_t<__half, D>(q, K, V, part, pos, H, Hkv, scale, window, softcap, run, min_keys, kvb);
#endif
}

#ifndef GQA_MMA_MIN_BLOCKS
#define GQA_MMA_MIN_BLOCKS 3
#endif
// the float16 kernels' __launch_bounds__ minimum: the tensor-core kernel's, or attn_gqa_t's on GPUs
// before sm_80 (which take attn_gqa_t, compiled as the float32 ones are)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define GQA_F16_MIN_BLOCKS GQA_MIN_BLOCKS
#else
#define GQA_F16_MIN_BLOCKS GQA_MMA_MIN_BLOCKS
#endif
#define GQA_MMA_KERNEL(NAME, D)                                                                        \
extern "C" __global__ void __launch_bounds__(GQA_THREADS, GQA_F16_MIN_BLOCKS) NAME(const float *q,       \
        const __half *K, const __half *V, float *part, const int *pos, int H, int Hkv, int D_, int Dv,      \
        float scale, int window, float softcap, int run, int min_keys, const int *kvb) {                  \
    attn_gqa_f16<D>(q, K, V, part, pos, H, Hkv, scale, window, softcap, run, min_keys, kvb);          \
}
GQA_MMA_KERNEL(attn_gqa_d2_f16, 64)
GQA_MMA_KERNEL(attn_gqa_d4_f16, 128)
GQA_MMA_KERNEL(attn_gqa_d8_f16, 256)

// Prompt attention on tensor cores, one sequence, a float16 cache: FlashAttention-2's scheme (Dao
// 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
// Algorithm 1), written for mma.m16n8k16 (f16 inputs, f32 sums; the fragments as in attn_gqa_mma_t).
// The CPU twin of its roundings is moecache/backends/flash.py (flash_attention_twin).
// Grid (ceil(T / PA_BQ), H), PA_WARPS warps: warp w takes the block's queries w*16 .. w*16 + 15 (the
// rows of A) of head blockIdx.y; the keys go in tiles of PA_BK at multiples of PA_BK, from the first
// key any of the block's queries sees (window) to the last (causal), each tile staged in shared
// memory by the whole block:
//   S (16 x PA_BK) = Q K^T, scaled (then the softcap), keys the row does not see -inf;
//   per row: M_new = max(M, max S), P = e^(S - M_new), L = L e^(M - M_new) + sum P (the sum of a
//   lane's own columns; the row's four lanes add theirs at the end), O = O e^(M - M_new) + P V with
//   S's accumulators reused as P's A fragments (the C and A layouts of m16n8k16 line up);
//   out[t, h*D + d] = O / L, float32. No score block in memory.
// SPLIT = 0 (the default arithmetic): Q and P rounded to float16. SPLIT = 1: Q and P as hi + lo
// float16 pairs (split_f16x2), two MMAs each: float32 attention to float rounding. Shared rows are
// padded to 4 words mod 32: the K fragment loads (8 rows x 4 words) fall in 32 banks, the V gathers
// (4 key pairs x 8 dims) in 16 words read twice. Keys past the last one are staged as zeros.
#define PA_WARPS 4
#define PA_BQ (16 * PA_WARPS)  // queries per block
#define PA_BK 64               // keys per tile: FLASH_TILE of moecache/backends/flash.py

__device__ __forceinline__ unsigned pack_f16x2(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<unsigned *>(&h);
}

template <int D, bool SPLIT>
__device__ void attn_prompt_t(const float *q, const __half *K, const __half *V, float *out, const int *pos, int T,
                              int H, int Hkv, float scale, int window, float softcap) {
#if __CUDA_ARCH__ >= 800
    int pos0 = pos[0];  // the queries are at pos0 .. pos0 + T - 1
    constexpr int W = D / 2;           // 32-bit words per K or V row
    constexpr int RS = W + 4;          // padded row stride (words)
    constexpr int W4 = W / 4;          // 16-byte pieces per row
    constexpr int NKT = PA_BK / 8;     // score n-tiles of 8 keys
    constexpr int NDT = D / 8;         // output n-tiles of 8 dims
    constexpr int NQ = SPLIT ? 2 : 1;  // float16 parts of Q and P
    __shared__ __align__(16) unsigned ks[PA_BK * RS], vs[PA_BK * RS];
    int h = blockIdx.y, hk = h / (H / Hkv);
    int tid = threadIdx.x, wid = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    long long rstride = (long long)Hkv * D;
    int t_lo = blockIdx.x * PA_BQ, t_hi = min(T, t_lo + PA_BQ);
    int k_lo = window > 0 ? max(0, pos0 + t_lo - window + 1) : 0;
    k_lo -= k_lo % PA_BK;
    int k_hi = pos0 + t_hi;                        // one past the block's last key
    int r0 = t_lo + wid * 16 + gid, r1 = r0 + 8;   // this lane's rows (A rows gid, gid + 8)
    int qp0 = pos0 + r0, qp1 = pos0 + r1;
    int w_last = pos0 + t_lo + wid * 16 + 15;      // the warp's last position: later tiles are masked
    unsigned qa[NQ][D / 16][4];
    {
        const float *q0 = q + ((long long)r0 * H + h) * D, *q1 = q + ((long long)r1 * H + h) * D;
        float2 z = make_float2(0.f, 0.f);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            int c = kk * 16 + 2 * tig;
            float2 x[4] = {r0 < T ? *(const float2 *)(q0 + c) : z, r1 < T ? *(const float2 *)(q1 + c) : z,
                           r0 < T ? *(const float2 *)(q0 + c + 8) : z, r1 < T ? *(const float2 *)(q1 + c + 8) : z};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (SPLIT) split_f16x2(x[e].x, x[e].y, qa[0][kk][e], qa[NQ - 1][kk][e]);
                else qa[0][kk][e] = pack_f16x2(x[e].x, x[e].y);
            }
        }
    }
    float o[NDT][4];
#pragma unroll
    for (int k = 0; k < NDT; ++k) o[k][0] = o[k][1] = o[k][2] = o[k][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const unsigned short *vh = (const unsigned short *)vs;
    for (int kt = k_lo; kt < k_hi; kt += PA_BK) {
        __syncthreads();
        for (int u = tid; u < PA_BK * W4; u += 32 * PA_WARPS) {
            int r = u / W4, c = u % W4, key = kt + r;
            uint4 kz = make_uint4(0u, 0u, 0u, 0u), vz = kz;
            if (key < k_hi) {
                kz = *(const uint4 *)(K + key * rstride + (long long)hk * D + 8 * c);
                vz = *(const uint4 *)(V + key * rstride + (long long)hk * D + 8 * c);
            }
            *(uint4 *)(ks + r * RS + 4 * c) = kz;
            *(uint4 *)(vs + r * RS + 4 * c) = vz;
        }
        __syncthreads();
        if (kt > w_last) continue;  // every key of the tile is after the warp's queries
        float s[NKT][4];
#pragma unroll
        for (int nt = 0; nt < NKT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < NKT; ++nt) {
                const unsigned *kr = ks + (nt * 8 + gid) * RS + kk * 8 + tig;
                unsigned b0 = kr[0], b1 = kr[4];
#pragma unroll
                for (int part = 0; part < NQ; ++part) mma_16816(s[nt], qa[part][kk], b0, b1);
            }
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NKT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int key = kt + nt * 8 + 2 * tig + (e & 1), qp = e < 2 ? qp0 : qp1;
                float v = s[nt][e] * scale;
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                bool ok = key <= qp && (window <= 0 || key > qp - window);
                v = ok ? v : NEG_INF;
                s[nt][e] = v;
                if (e < 2) mx0 = fmaxf(mx0, v);
                else mx1 = fmaxf(mx1, v);
            }
        }
#pragma unroll
        for (int off = 1; off < 4; off *= 2) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        bool live0 = mn0 != NEG_INF, live1 = mn1 != NEG_INF;
        float a0 = live0 ? __expf(m0 - mn0) : 1.f, a1 = live1 ? __expf(m1 - mn1) : 1.f;
        float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < NKT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                bool first = e < 2;
                float p = (first ? live0 : live1) ? __expf(s[nt][e] - (first ? mn0 : mn1)) : 0.f;
                s[nt][e] = p;
                if (first) ls0 += p;
                else ls1 += p;
            }
        }
        l0 = l0 * a0 + ls0;
        l1 = l1 * a1 + ls1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int k = 0; k < NDT; ++k) {
            o[k][0] *= a0;
            o[k][1] *= a0;
            o[k][2] *= a1;
            o[k][3] *= a1;
        }
#pragma unroll
        for (int kk = 0; kk < PA_BK / 16; ++kk) {
            unsigned pa[NQ][4];
            const float *lo = s[2 * kk], *hi = s[2 * kk + 1];  // keys 16 kk + 0..7, + 8..15
            float2 pp[4] = {make_float2(lo[0], lo[1]), make_float2(lo[2], lo[3]), make_float2(hi[0], hi[1]),
                            make_float2(hi[2], hi[3])};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (SPLIT) split_f16x2(pp[e].x, pp[e].y, pa[0][e], pa[NQ - 1][e]);
                else pa[0][e] = pack_f16x2(pp[e].x, pp[e].y);
            }
            int i0 = kk * 16 + 2 * tig;  // keys i0, i0 + 1 (and + 8, + 9) of the tile
#pragma unroll
            for (int dt = 0; dt < NDT; ++dt) {
                const unsigned short *vc = vh + i0 * 2 * RS + dt * 8 + gid;  // V[i0][dt * 8 + gid]
                unsigned b0 = (unsigned)vc[0] | ((unsigned)vc[2 * RS] << 16);
                unsigned b1 = (unsigned)vc[16 * RS] | ((unsigned)vc[18 * RS] << 16);
#pragma unroll
                for (int part = 0; part < NQ; ++part) mma_16816(o[dt], pa[part], b0, b1);
            }
        }
    }
#pragma unroll
    for (int off = 1; off < 4; off *= 2) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    long long ostride = (long long)H * D;
#pragma unroll
    for (int dt = 0; dt < NDT; ++dt) {
        int d = dt * 8 + 2 * tig;
        if (r0 < T) *(float2 *)(out + r0 * ostride + (long long)h * D + d) = make_float2(o[dt][0] * inv0, o[dt][1] * inv0);
        if (r1 < T) *(float2 *)(out + r1 * ostride + (long long)h * D + d) = make_float2(o[dt][2] * inv1, o[dt][3] * inv1);
    }
#endif
}

#define PROMPT_KERNEL(NAME, D, SPLIT)                                                                   \
extern "C" __global__ void __launch_bounds__(32 * PA_WARPS) NAME(const float *q, const __half *K,       \
        const __half *V, float *out, const int *pos, int T, int H, int Hkv, float scale, int window,      \
        float softcap) {                                                                               \
    attn_prompt_t<D, SPLIT>(q, K, V, out, pos, T, H, Hkv, scale, window, softcap);                     \
}
PROMPT_KERNEL(attn_prompt_d2_f16, 64, false)
PROMPT_KERNEL(attn_prompt_d4_f16, 128, false)
PROMPT_KERNEL(attn_prompt_d2_f16_x, 64, true)
PROMPT_KERNEL(attn_prompt_d4_f16_x, 128, true)

// Merges the partials of attn_decode (part_a (T, H, S_a, Dv + 2)) or attn_gqa (part_b (T, H, S_b,
// Dv + 2), may be null) of each query: out[t, h*Dv + d] = sum_s o_s[d] e^(M_s - M) / sum_s L_s
// e^(M_s - M) with M the largest M_s. A query with at least min_keys keys (and part_b given) was
// taken by attn_gqa: its runs of gqa_run(n_keys, S_b, min_run) keys, only those that hold keys
// (the others were not written); else by attn_decode: all S_a runs, those without keys (M_s =
// -inf) weigh 0. Grid (H, T), COMBINE_THREADS threads: the weights are computed once, in parallel,
// into shared memory; then COMBINE_GROUPS groups of 128 threads each sum a contiguous share of the
// runs for every dim (the gqa sum unrolled so that its loads overlap), and the first group adds the
// groups' sums (a head's S partials are read by 4x the threads of one 128-thread block: the merge
// of 256 runs was one serial chain of 16 rounds of loads per thread). When XQ is not null (Dv % 32
// == 0), out is also rounded to 8 bits as quantize_q8 (mmvq.cu) rounds it: XQ (T, H*Dv), XD, XS.
#define COMBINE_MAX_S 256
#define COMBINE_THREADS 512
#define COMBINE_GROUPS (COMBINE_THREADS / 128)
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) attn_combine(
        const float *part_a, const float *part_b, float *out, int H, int S_a, int S_b, int Dv, const int *pos,
        int window, int min_run, int min_keys, signed char *XQ, float *XD, float *XS) {
    constexpr int NWARP = COMBINE_THREADS / 32;
    __shared__ float w[COMBINE_MAX_S];
    __shared__ float red[NWARP];
    __shared__ float osum[COMBINE_GROUPS][256];  // each group's sums per dim (Dv <= 256)
    int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, wid = tid / 32, lane = tid % 32;
    int p = pos[t];
    int start = window > 0 ? max(0, p - window + 1) : 0;
    int nk = p - start + 1;
    bool gqa = part_b != nullptr && nk >= min_keys;
    int S = gqa ? S_b : S_a, n = S;
    const float *pt = (gqa ? part_b : part_a) + ((long long)t * H + h) * S * (Dv + 2);
    if (gqa) {
        int rl = gqa_run(nk, S, min_run);
        n = min(S, (nk + rl - 1) / rl);  // runs that hold keys
    }
    float m = NEG_INF;
    for (int s = tid; s < n; s += COMBINE_THREADS) m = fmaxf(m, pt[(long long)s * (Dv + 2)]);
    m = warp_max(m);
    if (lane == 0) red[wid] = m;
    __syncthreads();
    float M = red[0];
#pragma unroll
    for (int i = 1; i < NWARP; ++i) M = fmaxf(M, red[i]);
    __syncthreads();
    float l = 0.f;
    for (int s = tid; s < n; s += COMBINE_THREADS) {
        float ms = pt[(long long)s * (Dv + 2)];
        float e = ms == NEG_INF ? 0.f : __expf(ms - M);
        w[s] = e;
        l += e == 0.f ? 0.f : e * pt[(long long)s * (Dv + 2) + 1];
    }
    l = warp_sum(l);
    if (lane == 0) red[wid] = l;
    __syncthreads();
    float L = 0.f;
#pragma unroll
    for (int i = 0; i < NWARP; ++i) L += red[i];
    int g = tid / 128, dt = tid % 128;
    int s0 = g * n / COMBINE_GROUPS, s1 = (g + 1) * n / COMBINE_GROUPS;
    for (int d = dt; d < Dv; d += 128) {
        float o = 0.f;
        const float *pd = pt + 2 + d;
        int s = s0;
        if (gqa) {  // every run read holds keys: no test, 16 loads in flight
            for (; s + 16 <= s1; s += 16) {
                float v[16];
#pragma unroll
                for (int u = 0; u < 16; ++u) v[u] = pd[(long long)(s + u) * (Dv + 2)];
#pragma unroll
                for (int u = 0; u < 16; ++u) o += v[u] * w[s + u];
            }
        }
        for (; s < s1; ++s)
            if (w[s] != 0.f) o += pd[(long long)s * (Dv + 2)] * w[s];
        osum[g][d] = o;
    }
    __syncthreads();
    if (tid >= 128) return;
    for (int d = tid; d < Dv; d += 128) {
        float o = osum[0][d];
#pragma unroll
        for (int k = 1; k < COMBINE_GROUPS; ++k) o += osum[k][d];
        long long at = ((long long)t * H + h) * Dv + d;
        float val = o / L;
        out[at] = val;
        if (XQ != nullptr) {  // out's 8-bit rounding for the attn_output product (quantize_q8 of mmvq.cu);
            // Dv % 32 == 0: a warp holds one whole unit
            float amax = warp_max(fabsf(val));
            float dq = amax / 127.f;
            int qv = amax == 0.f ? 0 : __float2int_rn(val / dq);
            XQ[at] = (signed char)qv;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) qv += __shfl_xor_sync(0xffffffffu, qv, off);
            if (lane == 0) {
                XD[at / 32] = dq;
                XS[at / 32] = dq * (float)qv;
            }
        }
    }
}

// Router: softmax over n_expert logits per token, then the k largest (ties: lower id first) with
// their probabilities, divided by their sum when renorm. One warp per token; n_expert <= 32 * PER.
// A lane holds experts lane, lane + 32, ... in registers (every index below is a compile-time
// constant after unrolling: a dynamically indexed array would live in local memory). The logits
// are read through L2 (__ldcg): router_topk's last block reads what the other blocks wrote.
template <int PER>
__device__ __forceinline__ void topk_warp(const float *x, int *ids, float *weights, int n_expert, int k,
                                          int renorm, int lane) {
    float v[PER];
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        int e = lane + 32 * i;
        v[i] = e < n_expert ? __ldcg(x + e) : NEG_INF;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        int e = lane + 32 * i;
        v[i] = e < n_expert ? __expf(v[i] - mx) : -1.f;  // probabilities are >= 0; -1 marks "taken"
        sum += e < n_expert ? v[i] : 0.f;
    }
    sum = warp_sum(sum);
    float chosen = 0.f;
    for (int s = 0; s < k; ++s) {
        float best = -1.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            int e = lane + 32 * i;
            if (v[i] > best || (v[i] == best && e < bi)) {
                best = v[i];
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (lane + 32 * i == bi) v[i] = -1.f;
        float pr = best / sum;
        if (bi >= n_expert) {  // nothing left that compares (NaN logits): a valid id with a NaN weight,
            bi = 0;            // which reaches the logits (the engine checks them) instead of an id
            pr = __int_as_float(0x7fc00000);  // past the experts that the MoE kernels would read
        }
        chosen += pr;
        if (lane == 0) {
            ids[s] = bi;
            weights[s] = pr;
        }
    }
    if (renorm && lane == 0)
        for (int s = 0; s < k; ++s) weights[s] /= chosen;
}

__device__ __forceinline__ void topk_any(const float *x, int *ids, float *weights, int n_expert, int k, int renorm,
                                         int lane) {
    if (n_expert <= 128) topk_warp<4>(x, ids, weights, n_expert, k, renorm, lane);
    else if (n_expert <= 256) topk_warp<8>(x, ids, weights, n_expert, k, renorm, lane);
    else topk_warp<32>(x, ids, weights, n_expert, k, renorm, lane);
}

extern "C" __global__ void softmax_topk(const float *logits, int *ids, float *weights, int n_expert, int k,
                                        int renorm) {
    int t = blockIdx.x;
    topk_any(logits + (long long)t * n_expert, ids + t * k, weights + t * k, n_expert, k, renorm, threadIdx.x);
}

// The router of a decode step in one launch: logits[t, e] = W[e, :] . X[t, :] (W float32 (E, n),
// X float32 (T, n), T <= MAX_TOK, n % 4 == 0, both 16-byte aligned), then softmax_topk's choice for
// every token, made by the block that finishes last. Grid (E), ROUTER_THREADS threads: a block's
// threads share one row (4 floats each per load, 4 loads in flight), summed through
// shared memory. The blocks count themselves in *done (0 before the launch); the last one resets it,
// so the launch can be replayed from a CUDA graph (one launch at a time per counter).
#define ROUTER_THREADS 128
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS) router_topk(
        const float *W, const float *X, float *logits, int *ids, float *weights, int n_expert, int n, int T, int k,
        int renorm, unsigned int *done) {
    constexpr int NW = ROUTER_THREADS / 32;
    __shared__ float red[MAX_TOK][NW];
    __shared__ int last;
    int e = blockIdx.x, tid = threadIdx.x, lane = tid % 32, wid = tid / 32;
    const float4 *w4 = (const float4 *)(W + (long long)e * n);
    int n4 = n / 4;
    float acc[MAX_TOK];
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) acc[t] = 0.f;
#pragma unroll 4  // ROUTER_UNROLL
    for (int j = tid; j < n4; j += ROUTER_THREADS) {
        float4 a = w4[j];
#pragma unroll
        for (int t = 0; t < MAX_TOK; ++t) {
            if (t < T) {
                float4 b = ((const float4 *)(X + (long long)t * n))[j];
                acc[t] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
        if (t < T) {
            float v = warp_sum(acc[t]);
            if (lane == 0) red[t][wid] = v;
        }
    }
    __syncthreads();
    if (tid < T) {
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < NW; ++i) v += red[tid][i];
        logits[(long long)tid * n_expert + e] = v;
    }
    __threadfence();  // the logits are visible to every block before this block counts itself
    __syncthreads();
    if (tid == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = wid; t < T; t += NW)
        topk_any(logits + (long long)t * n_expert, ids + t * k, weights + t * k, n_expert, k, renorm, lane);
    if (tid == 0) *done = 0;
}

// The prompt attention's scores, in place: S (H, T, n) float32, query t at position pos0 + t, key j
// at start + j: x = S * scale, softcap * tanh(x / softcap) when softcap > 0, keys after the query or
// at or before pos - window (window > 0) excluded, then softmax over the row (the excluded keys 0).
// One block of SOFTMAX_THREADS per row (h, t); ArrayOps._masked_softmax is the numpy twin.
#define SOFTMAX_THREADS 256
extern "C" __global__ void __launch_bounds__(SOFTMAX_THREADS) masked_softmax(
        float *S, int T, long long n, int pos0, int start, int window, float scale, float softcap) {
    __shared__ float red[SOFTMAX_THREADS / 32];
    long long row = blockIdx.x;
    int t = (int)(row % T), tid = threadIdx.x, wid = tid / 32, lane = tid % 32;
    float *x = S + row * n;
    int p = pos0 + t;
    long long lo = window > 0 ? (long long)(p - window + 1 - start) : 0;  // first key it sees
    long long hi = (long long)(p - start);                                // last key it sees
    if (lo < 0) lo = 0;
    if (hi > n - 1) hi = n - 1;
    float m = NEG_INF;
    for (long long j = tid; j < n; j += SOFTMAX_THREADS) {
        float v = x[j] * scale;
        if (softcap > 0.f) v = softcap * tanhf(v / softcap);
        v = (j < lo || j > hi) ? NEG_INF : v;
        x[j] = v;
        m = fmaxf(m, v);
    }
    m = warp_max(m);
    if (lane == 0) red[wid] = m;
    __syncthreads();
    float M = red[0];
#pragma unroll
    for (int i = 1; i < SOFTMAX_THREADS / 32; ++i) M = fmaxf(M, red[i]);
    __syncthreads();
    float l = 0.f;
    for (long long j = tid; j < n; j += SOFTMAX_THREADS) {
        float e = (j < lo || j > hi) ? 0.f : expf(x[j] - M);
        x[j] = e;
        l += e;
    }
    l = warp_sum(l);
    if (lane == 0) red[wid] = l;
    __syncthreads();
    float L = 0.f;
#pragma unroll
    for (int i = 0; i < SOFTMAX_THREADS / 32; ++i) L += red[i];
    float inv = 1.f / L;
    for (long long j = tid; j < n; j += SOFTMAX_THREADS) x[j] *= inv;
}

// Weighted scatter-add of the prefill MoE path: out[rows[i]] += w[i] * Y[i], i < P, in the order
// given (one thread per output column, a loop over pairs: deterministic, no atomics).
// Pairs are sorted by token (rows nondecreasing), starts[t] .. starts[t+1] the pairs of token t.
extern "C" __global__ void moe_combine(const float *Y, const int *pair_of, const float *w, const int *starts,
                                       float *out, int T, long long n) {
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (c >= n) return;
    float s = 0.f;
    for (int i = starts[t]; i < starts[t + 1]; ++i) s += w[i] * Y[(long long)pair_of[i] * n + c];
    out[(long long)t * n + c] = s;
    (void)T;
}

// cos/sin (T, half) of the angles pos[t] * inv_freq[i], computed in double and rounded to float as
// RopeSpec.angles does on the host.
extern "C" __global__ void rope_table(const double *inv_freq, const int *pos, float *cs, float *sn, int T, int half) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * half) return;
    double a = (double)pos[i / half] * inv_freq[i % half];
    cs[i] = (float)cos(a);
    sn[i] = (float)sin(a);
}

// K[pos[t]] = k[t], V[pos[t]] = v[t]: the KV cache write of T new positions (row_k, row_v elements
// per position, float32 or float16 in the cache); positions come from device memory.
template <typename KV>
__device__ void kv_store_t(const float *k, const float *v, KV *K, KV *V, const int *pos, int row_k, int row_v) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (i < row_k) kv_put(K + (long long)pos[t] * row_k + i, k[(long long)t * row_k + i]);
    if (i < row_v) kv_put(V + (long long)pos[t] * row_v + i, v[(long long)t * row_v + i]);
}

extern "C" __global__ void kv_store(const float *k, const float *v, float *K, float *V, const int *pos, int T,
                                    int row_k, int row_v) {
    kv_store_t(k, v, K, V, pos, row_k, row_v);
}

extern "C" __global__ void kv_store_f16(const float *k, const float *v, __half *K, __half *V, const int *pos, int T,
                                        int row_k, int row_v) {
    kv_store_t(k, v, K, V, pos, row_k, row_v);
}

// The attention inputs of a block in one launch (ArrayOps.qk_rope_store): per-head RMSNorm of q and
// k (when qw / kw are not null), RoPE of both (cos/sin (T, half), pairs as in rope), q written to
// qo (T, H, D), k and v written into the KV cache at row pos[t] (kvb not null: kvb[t] + pos[t], the
// row of token t's sequence in a cache buffer several sequences share). Grid (H + 2 Hkv, T), 128 threads:
// block x < H is query head x, then the Hkv key heads, then the Hkv value heads (copied). Thread i
// holds RoPE pair i (D <= 256).
template <typename KV>
__device__ void qk_rope_store_t(const float *q, const float *k, const float *v, const float *qw, const float *kw,
                                float eps, const float *cs, const float *sn, int half, int neox, float *qo, KV *K,
                                KV *V, const int *pos, int H, int Hkv, int D, int Dv, const int *kvb) {
    __shared__ float red[4];
    int hi = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    long long row = (long long)pos[t] + (kvb != nullptr ? kvb[t] : 0);
    if (hi >= H + Hkv) {  // a value head: into the cache as it is
        int hv = hi - H - Hkv;
        const float *src = v + ((long long)t * Hkv + hv) * Dv;
        KV *dst = V + (row * Hkv + hv) * Dv;
        for (int i = tid; i < Dv; i += blockDim.x) kv_put(dst + i, src[i]);
        return;
    }
    bool is_q = hi < H;
    const float *x = is_q ? q + ((long long)t * H + hi) * D : k + ((long long)t * Hkv + (hi - H)) * D;
    const float *w = is_q ? qw : kw;
    bool act = tid < D / 2;
    int a = 0, b = 0;
    float xa = 0.f, xb = 0.f;
    if (act) {
        if (tid < half) {
            a = neox ? tid : 2 * tid;
            b = neox ? tid + half : 2 * tid + 1;
        } else {  // the unrotated tail, two dims per thread
            a = 2 * half + 2 * (tid - half);
            b = a + 1;
        }
        xa = x[a];
        xb = x[b];
    }
    if (w != nullptr) {  // uniform over the block
        float ss = warp_sum(xa * xa + xb * xb);
        if (tid % 32 == 0) red[tid / 32] = ss;
        __syncthreads();
        float inv = 1.f / sqrtf((red[0] + red[1] + red[2] + red[3]) / (float)D + eps);
        xa = xa * inv * (act ? w[a] : 0.f);
        xb = xb * inv * (act ? w[b] : 0.f);
    }
    if (!act) return;
    float ya = xa, yb = xb;
    if (tid < half) {
        float c = cs[t * half + tid], s = sn[t * half + tid];
        ya = xa * c - xb * s;
        yb = xa * s + xb * c;
    }
    if (is_q) {
        float *o = qo + ((long long)t * H + hi) * D;
        o[a] = ya;
        o[b] = yb;
    } else {
        KV *o = K + (row * Hkv + (hi - H)) * D;
        kv_put(o + a, ya);
        kv_put(o + b, yb);
    }
}

extern "C" __global__ void qk_rope_store(const float *q, const float *k, const float *v, const float *qw,
                                         const float *kw, float eps, const float *cs, const float *sn, int half,
                                         int neox, float *qo, float *K, float *V, const int *pos, int H, int Hkv,
                                         int D, int Dv, const int *kvb) {
    qk_rope_store_t(q, k, v, qw, kw, eps, cs, sn, half, neox, qo, K, V, pos, H, Hkv, D, Dv, kvb);
}

extern "C" __global__ void qk_rope_store_f16(const float *q, const float *k, const float *v, const float *qw,
                                             const float *kw, float eps, const float *cs, const float *sn, int half,
                                             int neox, float *qo, __half *K, __half *V, const int *pos, int H,
                                             int Hkv, int D, int Dv, const int *kvb) {
    qk_rope_store_t(q, k, v, qw, kw, eps, cs, sn, half, neox, qo, K, V, pos, H, Hkv, D, Dv, kvb);
}

// Expert-cache misses of a decode ubatch staged in VRAM before the MoE kernels read them: for routed
// pair p whose expert e = ids[p] has no slot (slot_map[e] < 0), copy matrix z (0 gate, 1 up, 2 down)
// of expert e from src_z + e * n_vec_z (page-locked host memory, read over PCIe) to dst_z +
// p * n_vec_z. 16-byte loads, four in flight per thread, so the GPU asks the link for whole cache
// lines. Sizes in uint4 units (the caller checks that every matrix is a multiple of 16 bytes).
// Grid (chunks of chunk_vec, n_pairs, 3).
extern "C" __global__ void stage_misses(const int *ids, const int *slot_map,
                                        const uint4 *src_g, const uint4 *src_u, const uint4 *src_d,
                                        uint4 *dst_g, uint4 *dst_u, uint4 *dst_d,
                                        long long n_vec_gu, long long n_vec_d, long long chunk_vec) {
    int p = blockIdx.y;
    int e = ids[p];
    if (e < 0 || slot_map[e] >= 0) return;  // no pair, or a hit
    int z = blockIdx.z;
    long long n_vec = z == 2 ? n_vec_d : n_vec_gu;
    const uint4 *s = (z == 0 ? src_g : z == 1 ? src_u : src_d) + (long long)e * n_vec;
    uint4 *d = (z == 0 ? dst_g : z == 1 ? dst_u : dst_d) + (long long)p * n_vec;
    long long i0 = (long long)blockIdx.x * chunk_vec;
    long long i1 = i0 + chunk_vec < n_vec ? i0 + chunk_vec : n_vec;
    for (long long i = i0 + threadIdx.x; i < i1; i += 4 * (long long)blockDim.x) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            long long k = i + (long long)j * blockDim.x;
            if (k < i1) v[j] = s[k];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            long long k = i + (long long)j * blockDim.x;
            if (k < i1) d[k] = v[j];
        }
    }
}

// ---- the host handoff (moecache/moe/handoff.py): a captured decode step hands a layer's routed
// experts to the CPU and takes their sum back without ending the graph. The H* buffers are
// page-locked host memory read and written in place over PCIe; the host spins on FLAG and the GPU
// on DONE (volatile: every read goes to memory, .relaxed.sys on sm_70+), with system-scope fences
// between a buffer's data and its flag. SEQ (device) holds the pass number the host set before the
// launch.

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One block. Pairs p = t * k + j of the T tokens: the CPU takes a pair when SLOT_MAP is null (every
// routed expert on the CPU) or, with a map, up to NCPU[il] of a token's misses (slot_map[e] < 0),
// the last ones in pair order. HIDS/HW get the CPU's pairs (id -1 for the others), GIDS (if not
// null) the GPU's (-1 for the CPU's); with any pair for the CPU, H's T rows go to HH; COUNT[il]
// (the CPU's pairs), NMISS[il] (every miss, or every pair without a map) and NTOK[il] are set, then
// FLAG[il] = SEQ. DCOUNT[il] (device) tells handoff_wait whether to wait. A layer whose NCPU[il] is 0
// (with a map) writes only DCOUNT, COUNT, NMISS and NTOK: no rows, no fences and no FLAG (the host
// serves only layers with a share, moecache/moe/cache.py), so a plan's GPU-only layers cost one small
// kernel, not two PCIe round trips.
extern "C" __global__ void handoff_post(const float *h, const int *ids, const float *w, const int *slot_map,
                                        const int *ncpu, int il, int T, int k, long long n_embd,
                                        const long long *seq, float *HH, int *HIDS, float *HW, int *GIDS,
                                        volatile long long *FLAG, volatile int *COUNT, volatile int *NTOK,
                                        volatile int *NMISS, int *DCOUNT) {
    __shared__ int n_cpu_pairs, n_miss;
    if (threadIdx.x == 0) n_cpu_pairs = n_miss = 0;
    __syncthreads();
    int cap = slot_map ? ncpu[il] : k;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        int taken = 0, missed = 0;
        for (int j = k - 1; j >= 0; --j) {
            int p = t * k + j, e = ids[p];
            bool miss = e >= 0 && (!slot_map || slot_map[e] < 0);
            bool cpu = miss && taken < cap;
            missed += miss;
            taken += cpu;
            if (cap > 0) {  // no share: nothing for the host to read
                ((volatile int *)HIDS)[p] = cpu ? e : -1;
                ((volatile float *)HW)[p] = w[p];
            }
            if (GIDS) GIDS[p] = cpu ? -1 : e;
        }
        atomicAdd(&n_cpu_pairs, taken);
        atomicAdd(&n_miss, missed);
    }
    __syncthreads();
    int n = n_cpu_pairs;
    if (cap == 0) {  // a layer without a share (the host does not serve it): the counts, no fences, no flag
        if (threadIdx.x == 0) {
            DCOUNT[il] = 0;
            COUNT[il] = 0;
            NMISS[il] = n_miss;
            NTOK[il] = T;
        }
        return;
    }
    if (n > 0) {
        long long m = (long long)T * n_embd;
        for (long long i = threadIdx.x; i < m; i += blockDim.x) ((volatile float *)HH)[i] = h[i];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        DCOUNT[il] = n;
        COUNT[il] = n;
        NMISS[il] = n_miss;
        NTOK[il] = T;
        __threadfence_system();
        FLAG[il] = *seq;
    }
}

// One block, after handoff_post for the same layer: when the layer had pairs for the CPU, thread 0
// waits until DONE[il] >= SEQ (at most TIMEOUT_NS; past it ERR = il + 1 and the CPU's part counts as
// zero, and later layers do not wait while ERR is set) and records the ns it waited in WAITNS[il] (0 without pairs), then
// OUT = (ADD ? OUT : 0) + HOUT over T * n_embd floats.
extern "C" __global__ void handoff_wait(volatile const long long *DONE, const int *DCOUNT, int il,
                                        const long long *seq, volatile const float *HOUT, float *out,
                                        long long n, int add, long long timeout_ns, volatile int *ERR,
                                        volatile long long *WAITNS) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        ok = DCOUNT[il] > 0 && *ERR == 0;  // after a timeout in this pass, no more waiting
        long long waited = 0;
        if (ok) {
            long long want = *seq;
            unsigned long long t0 = global_ns();
            while (DONE[il] < want) {
                if ((long long)(global_ns() - t0) > timeout_ns) { ok = 0; *ERR = il + 1; break; }
            }
            waited = (long long)(global_ns() - t0);
            __threadfence_system();
        }
        WAITNS[il] = waited;
    }
    __syncthreads();
    if (!ok && add) return;  // nothing to add
    // eight volatile reads in flight per thread before their stores (one PCIe round trip each)
    for (long long i0 = threadIdx.x; i0 < n; i0 += 8 * (long long)blockDim.x) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            long long i = i0 + (long long)j * blockDim.x;
            v[j] = ok && i < n ? HOUT[i] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            long long i = i0 + (long long)j * blockDim.x;
            if (i < n) out[i] = add ? out[i] + v[j] : v[j];
        }
    }
}
