// Speculative decoding on the CUDA runner (gpu_engine/cuda/verify.py): the linear-attention state after each
// token of a verify window, and the batched copies that snapshot, restore and roll back state slots.
//
// copy_segments: table [count, 3] int64 of (dst address, src address, bytes); block row y copies segment y.
//   One launch moves every layer's conv and recurrent rows of every rolled-back sequence.
// conv1d_silu_window / gated_delta_rule_window: the decode kernels of deltanet.cu (same arithmetic, token by
//   token), which also write the state after each token but the last of a sequence whose win_base[s] >= 0 into
//   window row win_base[s] + i (conv: [rows, K-1, conv_dim], recurrent: f32 [rows, v_heads, dv, dk]). The state
//   after the last token is the slot's own, as in a decode step.
#include "common.cuh"
#include "deltanet_step.cuh"

#define MAX_CONV 8
#define MAX_DK_PER_LANE 8
#define GDN_WARPS 8

extern "C" __global__ void copy_segments(const long long* table, int count) {
    pdl_entry();
    const int seg = blockIdx.y;
    if (seg >= count) return;
    char* dst = (char*)table[3 * seg];
    const char* src = (const char*)table[3 * seg + 1];
    const long long bytes = table[3 * seg + 2];
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((((long long)dst | (long long)src | bytes) & 15) == 0) {
        int4* d = (int4*)dst;
        const int4* s = (const int4*)src;
        for (long long i = first; i < bytes / 16; i += stride) d[i] = s[i];
    } else {
        for (long long i = first; i < bytes; i += stride) dst[i] = src[i];
    }
}

template <typename T>
__device__ void conv1d_silu_window_impl(T* out, long long out_stride, const T* x, long long x_stride, const T* w,
                                        T* conv_state, T* window, const int* win_base, const int* cu_seqlens,
                                        const int* state_slots, const int* fresh, int conv_dim, int K) {
    pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (c >= conv_dim) return;
    T* st = conv_state + (long long)state_slots[s] * (K - 1) * conv_dim + c;
    const int wb = win_base[s];
    float win[MAX_CONV], wc[MAX_CONV];
#pragma unroll
    for (int k = 0; k < MAX_CONV; ++k) {
        wc[k] = k < K ? to_f(w[(long long)c * K + k]) : 0.0f;
        win[k] = (k < K - 1 && !fresh[s]) ? to_f(st[(long long)k * conv_dim]) : 0.0f;
    }
    const int first = cu_seqlens[s], last = cu_seqlens[s + 1];
    for (int t = first; t < last; ++t) {
        const float xt = to_f(x[t * x_stride + c]);
        float acc = wc[K - 1] * xt;
#pragma unroll
        for (int k = 0; k < MAX_CONV - 1; ++k)
            if (k < K - 1) acc += wc[k] * win[k];
        out[t * out_stride + c] = from_f<T>(silu(acc));
#pragma unroll
        for (int k = 0; k < MAX_CONV - 1; ++k)
            if (k < K - 2) win[k] = win[k + 1];
#pragma unroll
        for (int k = 0; k < MAX_CONV - 1; ++k)
            if (k == K - 2) win[k] = xt;
        if (wb >= 0 && t < last - 1) {
            T* row = window + ((long long)(wb + t - first) * (K - 1)) * conv_dim + c;
#pragma unroll
            for (int k = 0; k < MAX_CONV - 1; ++k)
                if (k < K - 1) row[(long long)k * conv_dim] = from_f<T>(win[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < MAX_CONV - 1; ++k)
        if (k < K - 1) st[(long long)k * conv_dim] = from_f<T>(win[k]);
}

template <typename T>
__device__ void gated_delta_rule_window_impl(T* out, const T* q, const T* k, const T* v, long long qkv_stride,
                                             const T* a, const T* b, long long ab_stride, const float* A_log,
                                             const float* dt_bias, float* state, float* window, const int* win_base,
                                             const int* cu_seqlens, const int* state_slots, const int* fresh,
                                             int k_heads, int v_heads, int dk, int dv) {
    pdl_entry();
    __shared__ float q_s[MAX_DK_PER_LANE * 32], k_s[MAX_DK_PER_LANE * 32], scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.y, s = blockIdx.z;
    const int j = blockIdx.x * GDN_WARPS + warp;
    const int kh = h / (v_heads / k_heads);
    const long long col = ((long long)h * dv + (j < dv ? j : 0)) * dk;  // this warp's column inside one state
    float* S = state + (long long)state_slots[s] * v_heads * dv * dk + col;
    const int wb = win_base[s];
    float Sr[MAX_DK_PER_LANE];
#pragma unroll
    for (int e = 0; e < MAX_DK_PER_LANE; ++e)
        Sr[e] = (lane + 32 * e < dk && j < dv && !fresh[s]) ? S[lane + 32 * e] : 0.0f;
    const float neg_A = -expf(A_log[h]);
    const float q_scale = rsqrtf((float)dk);
    const int first = cu_seqlens[s], last = cu_seqlens[s + 1];
    for (int t = first; t < last; ++t) {
        const GdnGates g = gdn_token_gates(q_s, k_s, scratch, q, k, qkv_stride, a, b, ab_stride, dt_bias, neg_A,
                                           q_scale, t, h, kh, dk);
        if (j < dv) {
            const float o = gdn_column_step(Sr, q_s, k_s, g, v + (t * qkv_stride + (long long)h * dv + j), lane, dk);
            if (lane == 0) out[(long long)t * v_heads * dv + (long long)h * dv + j] = from_f<T>(o);
            if (wb >= 0 && t < last - 1) {
                float* W = window + (long long)(wb + t - first) * v_heads * dv * dk + col;
#pragma unroll
                for (int e = 0; e < MAX_DK_PER_LANE; ++e)
                    if (lane + 32 * e < dk) W[lane + 32 * e] = Sr[e];
            }
        }
        __syncthreads();
    }
    if (j < dv) {
#pragma unroll
        for (int e = 0; e < MAX_DK_PER_LANE; ++e)
            if (lane + 32 * e < dk) S[lane + 32 * e] = Sr[e];
    }
}

#define DEFINE(S, T)                                                                                              \
    extern "C" __global__ void conv1d_silu_window_##S(T* out, long long out_stride, const T* x,                  \
                                                      long long x_stride, const T* w, T* conv_state, T* window,   \
                                                      const int* win_base, const int* cu_seqlens,                 \
                                                      const int* state_slots, const int* fresh, int conv_dim,     \
                                                      int K) {                                                    \
        conv1d_silu_window_impl<T>(out, out_stride, x, x_stride, w, conv_state, window, win_base, cu_seqlens,     \
                                   state_slots, fresh, conv_dim, K);                                              \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gated_delta_rule_window_##S(                      \
        T* out, const T* q, const T* k, const T* v, long long qkv_stride, const T* a, const T* b,                 \
        long long ab_stride, const float* A_log, const float* dt_bias, float* state, float* window,               \
        const int* win_base, const int* cu_seqlens, const int* state_slots, const int* fresh, int k_heads,        \
        int v_heads, int dk, int dv) {                                                                            \
        gated_delta_rule_window_impl<T>(out, q, k, v, qkv_stride, a, b, ab_stride, A_log, dt_bias, state, window, \
                                        win_base, cu_seqlens, state_slots, fresh, k_heads, v_heads, dk, dv);      \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
