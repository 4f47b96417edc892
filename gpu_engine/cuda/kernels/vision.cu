// The vision tower's own ops (the text decoder never calls these; a separate module keeps its compile apart).
//   layernorm:        out = (x - mean) * rsqrt(var + eps) * w + b     one block per row, fp32 statistics, two
//                                                                     passes (mean, then centred variance: no
//                                                                     E[x^2] - mean^2 cancellation); out may alias x
//   layernorm_rows:   the same, one warp per row (8 rows a block), the row read once into registers as 16-byte
//                     vectors, warp-shuffle sums (dim % (16 / sizeof(T)) == 0 and dim <= 32 * LN_VECS vectors: the
//                     host picks it then); for short rows (the tower's 1152) a block per row left most threads idle
//   bias_act:         out[r, c] = act(x[r, c] + bias[c])              act 0 none, 1 GELU-tanh, 2 exact GELU (erfc
//                                                                     form: stays accurate for x << 0); may alias
//   bias_residual:    x[r, c] += y[r, c] + bias[c]                    one rounding to storage, after both adds
//   patch_pos:        x[r, c] += bias[c] + sum_k wt[r, k] * table[tap[r, k], c]
//                                                                     patch-embed bias + the learned position table
//                                                                     bilinearly resampled (4 taps per patch; taps
//                                                                     and weights come from the host)
//   softmax_rows:     out[r, :] = softmax(scale * s[r, :])              s fp32 (scores from a cuBLASLt GEMM), out in the
//                                                                     storage type (the probabilities of the P @ V GEMM);
//                                                                     three passes over s, any row length (scale > 0)
//   softmax_rows_cached: the same for rows of at most 8 * blockDim.x: the row is read once into registers
//                                                                     (one pass over s instead of three)
//   cast_from_f32:    out[i] = (T) x[i]                               pixels arrive as float32; rounding them to bf16
//                                                                     here is ~10x faster than numpy on the host
//   vision_attention: bidirectional attention inside equal segments of `seg_len` rows (one frame group each);
//                     q, k, v read in place from the fused qkv projection [n, 3 * heads * hd]; out [n, heads*hd].
//                     One block of 4 warps per (query, head); the warps take keys in turn with a running online
//                     softmax each, merged through shared memory at the end. Lane l owns dims l, l+32, ...
//                     (head_dim <= 256). Not tiled: every (query, head) reads its segment's keys once (L2-served).
#include "common.cuh"

#define V_MAX_PER_LANE 8
#define V_WARPS 4

template <typename T>
__device__ void layernorm_impl(T* out, const T* x, const T* w, const T* b, int rows, int dim, float eps) {
    pdl_entry();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + (long long)row * dim;
    T* yr = out + (long long)row * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += to_f(xr[i]);
    const float mean = block_sum(s, scratch) / (float)dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = to_f(xr[i]) - mean;
        ss += d * d;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = from_f<T>((to_f(xr[i]) - mean) * inv * to_f(w[i]) + to_f(b[i]));
}

#define LN_VECS 8  // 16-byte vectors per lane: rows of up to 2048 bf16 / 1024 f32 (vision_ops.LAYERNORM_ROWS_MAX)

template <typename T> union LnVec {
    uint4 u;
    T e[16 / sizeof(T)];
};

template <typename T>
__device__ void layernorm_rows_impl(T* out, const T* x, const T* w, const T* b, int rows, int dim, float eps) {
    pdl_entry();
    constexpr int PER = 16 / sizeof(T);
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;   // whole warps leave: the shuffles below see all 32 lanes
    const int nvec = dim / PER;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)row * dim);
    LnVec<T> v[LN_VECS];
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < LN_VECS; ++j) {
        const int p = lane + 32 * j;
        v[j].u = p < nvec ? xr[p] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int e = 0; e < PER; ++e) s += to_f(v[j].e[e]);   // zero vectors add 0
    }
    const float mean = warp_sum(s) / (float)dim;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < LN_VECS; ++j) {
        if (lane + 32 * j < nvec) {
#pragma unroll
            for (int e = 0; e < PER; ++e) {
                const float d = to_f(v[j].e[e]) - mean;
                ss += d * d;
            }
        }
    }
    const float inv = rsqrtf(warp_sum(ss) / (float)dim + eps);
    uint4* yr = reinterpret_cast<uint4*>(out + (long long)row * dim);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const uint4* bv = reinterpret_cast<const uint4*>(b);
#pragma unroll
    for (int j = 0; j < LN_VECS; ++j) {
        const int p = lane + 32 * j;
        if (p < nvec) {
            LnVec<T> wj, bj, y;
            wj.u = wv[p];
            bj.u = bv[p];
#pragma unroll
            for (int e = 0; e < PER; ++e)
                y.e[e] = from_f<T>((to_f(v[j].e[e]) - mean) * inv * to_f(wj.e[e]) + to_f(bj.e[e]));
            yr[p] = y.u;
        }
    }
}

// f(idx) for each idx in [0, n) of this thread in a grid-stride loop (the one-line elementwise kernels below).
template <typename F>
__device__ __forceinline__ void grid_stride(long long n, F f) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x)
        f(idx);
}

__device__ __forceinline__ float apply_act(float v, int act) {
    if (act == 1) {
        const float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);  // sqrt(2/pi)
        return 0.5f * v * (1.0f + tanhf(inner));
    }
    if (act == 2) return 0.5f * v * erfcf(-v * 0.7071067811865476f);  // x * Phi(x)
    return v;
}

template <typename T>
__device__ void bias_act_impl(T* out, const T* x, const T* bias, int rows, int cols, int act) {
    pdl_entry();
    const long long n = (long long)rows * cols;
    grid_stride(n, [=](long long idx) { out[idx] = from_f<T>(apply_act(to_f(x[idx]) + to_f(bias[idx % cols]), act)); });
}

template <typename T>
__device__ void bias_residual_impl(T* x, const T* y, const T* bias, int rows, int cols) {
    pdl_entry();
    const long long n = (long long)rows * cols;
    grid_stride(n, [=](long long idx) { x[idx] = from_f<T>(to_f(x[idx]) + (to_f(y[idx]) + to_f(bias[idx % cols]))); });
}

template <typename T>
__device__ void patch_pos_impl(T* x, const T* bias, const T* table, const int* taps, const float* weights,
                               int rows, int cols) {
    pdl_entry();
    const long long n = (long long)rows * cols;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long r = idx / cols;
        const int c = (int)(idx % cols);
        float pos = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) pos += weights[r * 4 + k] * to_f(table[(long long)taps[r * 4 + k] * cols + c]);
        x[idx] = from_f<T>(to_f(x[idx]) + to_f(bias[c]) + pos);
    }
}

template <typename T>
__device__ void softmax_rows_impl(T* out, const float* s, int rows, int cols, float scale) {
    pdl_entry();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* sr = s + (long long)row * cols;
    T* pr = out + (long long)row * cols;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, sr[i]);
    m = block_max(m, scratch) * scale;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) sum += expf(sr[i] * scale - m);
    const float inv = 1.0f / block_sum(sum, scratch);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) pr[i] = from_f<T>(expf(sr[i] * scale - m) * inv);
}

template <typename T>
__device__ void cast_from_f32_impl(T* out, const float* x, long long n) {
    pdl_entry();
    grid_stride(n, [=](long long idx) { out[idx] = from_f<T>(x[idx]); });
}

#define SOFTMAX_PER_THREAD 8

template <typename T>
__device__ void softmax_rows_cached_impl(T* out, const float* s, int rows, int cols, float scale) {
    pdl_entry();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* sr = s + (long long)row * cols;
    T* pr = out + (long long)row * cols;
    float v[SOFTMAX_PER_THREAD];
    float m = NEG_INF;
#pragma unroll
    for (int e = 0; e < SOFTMAX_PER_THREAD; ++e) {
        const int i = threadIdx.x + e * blockDim.x;
        v[e] = i < cols ? sr[i] * scale : NEG_INF;
        m = fmaxf(m, v[e]);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < SOFTMAX_PER_THREAD; ++e) {
        v[e] = expf(v[e] - m);  // padding: exp(-inf) = 0
        sum += v[e];
    }
    const float inv = 1.0f / block_sum(sum, scratch);
#pragma unroll
    for (int e = 0; e < SOFTMAX_PER_THREAD; ++e) {
        const int i = threadIdx.x + e * blockDim.x;
        if (i < cols) pr[i] = from_f<T>(v[e] * inv);
    }
}

template <typename T>
__device__ void vision_attention_impl(T* out, const T* qkv, int n, int heads, int head_dim, int seg_len,
                                      float scale) {
    pdl_entry();
    __shared__ float s_m[V_WARPS], s_l[V_WARPS];
    __shared__ float s_acc[V_WARPS][V_MAX_PER_LANE * 32];
    const int token = blockIdx.x, h = blockIdx.y;
    if (token >= n || h >= heads) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long width = (long long)heads * head_dim;  // q | k | v, each [heads, head_dim]
    const long long stride = 3 * width;
    const int lo = token / seg_len * seg_len, hi = min(n, lo + seg_len);

    float qv[V_MAX_PER_LANE], acc[V_MAX_PER_LANE];
    const T* qh = qkv + token * stride + (long long)h * head_dim;
#pragma unroll
    for (int e = 0; e < V_MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < head_dim ? to_f(qh[d]) * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int key = lo + warp; key < hi; key += V_WARPS) {
        const T* kh = qkv + key * stride + width + (long long)h * head_dim;
        const T* vh = kh + width;
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < V_MAX_PER_LANE; ++e) {
            const int d = lane + 32 * e;
            if (d < head_dim) part += qv[e] * to_f(kh[d]);
        }
        const float s = warp_sum(part);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);  // exp(-inf) = 0 on the first key
        const float p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < V_MAX_PER_LANE; ++e) {
            const int d = lane + 32 * e;
            if (d < head_dim) acc[e] = acc[e] * corr + p * to_f(vh[d]);
        }
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < V_MAX_PER_LANE; ++e) s_acc[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    float m_all = NEG_INF;
    for (int w = 0; w < V_WARPS; ++w) m_all = fmaxf(m_all, s_m[w]);
    float l_all = 0.0f;
    for (int w = 0; w < V_WARPS; ++w) l_all += s_m[w] == NEG_INF ? 0.0f : s_l[w] * expf(s_m[w] - m_all);
    T* oh = out + token * width + (long long)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < V_WARPS; ++w)
            if (s_m[w] != NEG_INF) v += s_acc[w][d] * expf(s_m[w] - m_all);
        oh[d] = from_f<T>(v / l_all);
    }
}

#define DEFINE(S, T)                                                                                          \
    extern "C" __global__ void layernorm_##S(T* out, const T* x, const T* w, const T* b, int rows, int dim,    \
                                             float eps) {                                                     \
        layernorm_impl<T>(out, x, w, b, rows, dim, eps);                                                       \
    }                                                                                                         \
    extern "C" __global__ void layernorm_rows_##S(T* out, const T* x, const T* w, const T* b, int rows,       \
                                                  int dim, float eps) {                                       \
        layernorm_rows_impl<T>(out, x, w, b, rows, dim, eps);                                                  \
    }                                                                                                         \
    extern "C" __global__ void bias_act_##S(T* out, const T* x, const T* bias, int rows, int cols, int act) {  \
        bias_act_impl<T>(out, x, bias, rows, cols, act);                                                       \
    }                                                                                                         \
    extern "C" __global__ void bias_residual_##S(T* x, const T* y, const T* bias, int rows, int cols) {        \
        bias_residual_impl<T>(x, y, bias, rows, cols);                                                         \
    }                                                                                                         \
    extern "C" __global__ void patch_pos_##S(T* x, const T* bias, const T* table, const int* taps,             \
                                             const float* weights, int rows, int cols) {                      \
        patch_pos_impl<T>(x, bias, table, taps, weights, rows, cols);                                          \
    }                                                                                                         \
    extern "C" __global__ void softmax_rows_##S(T* out, const float* s, int rows, int cols, float scale) {      \
        softmax_rows_impl<T>(out, s, rows, cols, scale);                                                       \
    }                                                                                                         \
    extern "C" __global__ void softmax_rows_cached_##S(T* out, const float* s, int rows, int cols, float scale) {\
        softmax_rows_cached_impl<T>(out, s, rows, cols, scale);                                                \
    }                                                                                                         \
    extern "C" __global__ void cast_from_f32_##S(T* out, const float* x, long long n) {                        \
        cast_from_f32_impl<T>(out, x, n);                                                                      \
    }                                                                                                         \
    extern "C" __global__ void vision_attention_##S(T* out, const T* qkv, int n, int heads, int head_dim,      \
                                                    int seg_len, float scale) {                               \
        vision_attention_impl<T>(out, qkv, n, heads, head_dim, seg_len, scale);                                \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
