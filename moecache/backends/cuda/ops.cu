// The non-quantized layer operations of the CuPy backend, one launch each: RMSNorm, RoPE, gated
// activations, decode attention over the KV cache and softmax top-k routing. float32 throughout.
// Formulas: the numpy twins in moecache/backends/ops.py and moecache/models/base.py (the tests
// compare against them). Written for moecache.

#include <cuda_fp16.h>

#define NEG_INF (-__int_as_float(0x7f800000))  // nvrtc has no math.h INFINITY

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

// out = act(g) * u; act 0: SiLU, 1: GELU (tanh approximation, as ggml_gelu)
extern "C" __global__ void glu(const float *g, const float *u, float *out, long long n, int act) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = g[i];
    if (act == 0) {
        a = a / (1.f + __expf(-a));
    } else {
        const float c = 0.7978845608028654f;
        a = 0.5f * a * (1.f + tanhf(c * (a + 0.044715f * a * a * a)));
    }
    out[i] = a * u[i];
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
#define ATT_WARPS 4
template <typename KV>
__device__ void attn_split_t(const float *q, const KV *K, const KV *V, float *part, const int *pos, int H, int Hkv,
                             int D, int Dv, float scale, int window, float softcap) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], so[ATT_WARPS][256];
    int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z, S = gridDim.z;
    int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
    int hk = h / (H / Hkv);
    int p = pos[t];
    int start = window > 0 ? max(0, p - window + 1) : 0;
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

extern "C" __global__ void attn_decode(const float *q, const float *K, const float *V, float *part, const int *pos,
                                       int H, int Hkv, int D, int Dv, float scale, int window, float softcap) {
    attn_split_t(q, K, V, part, pos, H, Hkv, D, Dv, scale, window, softcap);
}

extern "C" __global__ void attn_decode_f16(const float *q, const __half *K, const __half *V, float *part,
                                           const int *pos, int H, int Hkv, int D, int Dv, float scale, int window,
                                           float softcap) {
    attn_split_t(q, K, V, part, pos, H, Hkv, D, Dv, scale, window, softcap);
}

// Merges the S partials of attn_decode: out[t, h*Dv + d] = sum_s o_s[d] e^(M_s - M) / sum_s L_s e^(M_s - M)
// with M the largest M_s (runs without keys have M_s = -inf and are skipped). Grid (H, T).
extern "C" __global__ void attn_combine(const float *part, float *out, int H, int S, int Dv) {
    int h = blockIdx.x, t = blockIdx.y;
    const float *pt = part + ((long long)t * H + h) * S * (Dv + 2);
    float M = NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, pt[s * (Dv + 2)]);
    float L = 0.f;
    for (int s = 0; s < S; ++s) {
        float ms = pt[s * (Dv + 2)];
        if (ms != NEG_INF) L += pt[s * (Dv + 2) + 1] * __expf(ms - M);
    }
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < S; ++s) {
            float ms = pt[s * (Dv + 2)];
            if (ms != NEG_INF) o += pt[s * (Dv + 2) + 2 + d] * __expf(ms - M);
        }
        out[((long long)t * H + h) * Dv + d] = o / L;
    }
}

// Router: softmax over n_expert logits per token, then the k largest (ties: lower id first) with
// their probabilities, divided by their sum when renorm. One warp per token; n_expert <= 1024.
extern "C" __global__ void softmax_topk(const float *logits, int *ids, float *weights, int n_expert, int k,
                                        int renorm) {
    int t = blockIdx.x, lane = threadIdx.x;
    const float *x = logits + (long long)t * n_expert;
    float v[32];
    int per = (n_expert + 31) / 32;
    float mx = NEG_INF;
    for (int i = 0; i < per; ++i) {
        int e = lane + 32 * i;
        v[i] = e < n_expert ? x[e] : NEG_INF;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    for (int i = 0; i < per; ++i) {
        int e = lane + 32 * i;
        v[i] = e < n_expert ? __expf(v[i] - mx) : -1.f;  // probabilities are >= 0; -1 marks "taken"
        sum += e < n_expert ? v[i] : 0.f;
    }
    sum = warp_sum(sum);
    float chosen = 0.f;
    for (int s = 0; s < k; ++s) {
        float best = -1.f;
        int bi = 0x7fffffff;
        for (int i = 0; i < per; ++i) {
            int e = lane + 32 * i;
            if (v[i] > best || (v[i] == best && e < bi)) {
                best = v[i];
                bi = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        if (bi % 32 == lane) v[bi / 32] = -1.f;
        float pr = best / sum;
        chosen += pr;
        if (lane == 0) {
            ids[t * k + s] = bi;
            weights[t * k + s] = pr;
        }
    }
    if (renorm && lane == 0)
        for (int s = 0; s < k; ++s) weights[t * k + s] /= chosen;
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
    if (slot_map[e] >= 0) return;
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
