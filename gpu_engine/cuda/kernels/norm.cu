// RMSNorm family. One block per row; fp32 statistics whatever the storage type.
//   rmsnorm:        out = x * rsqrt(mean(x^2) + eps) * (offset + w)   offset 1.0 = zero-centred weights (Qwen3.5)
//   add_rmsnorm:    residual += x (stored), out = rmsnorm(residual)   (the fused residual add of every layer)
//   rmsnorm_gated:  out = w * rmsnorm(x) * silu(z)                     (Gated DeltaNet output norm)
// rmsnorm rows may be heads of tokens (token and head strides, in elements): the per-head q/k norms read q and k
// straight out of the fused q|gate|k|v projection; in place (out == x) is allowed.
#include "common.cuh"

template <typename T>
__device__ void rmsnorm_impl(T* out, long long out_tok_stride, int out_head_stride, const T* x,
                             long long x_tok_stride, int x_head_stride, int heads, const T* w, int rows, int dim,
                             float eps, float offset) {
    pdl_entry();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int tok = row / heads, h = row % heads;  // row = one head of one token (heads == 1: plain rows)
    const T* xr = x + tok * x_tok_stride + (long long)h * x_head_stride;
    T* yr = out + tok * out_tok_stride + (long long)h * out_head_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f(xr[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = from_f<T>(to_f(xr[i]) * inv * (offset + to_f(w[i])));
}

template <typename T>
__device__ void add_rmsnorm_impl(T* out, T* residual, const T* x, const T* w, int rows, int dim, float eps,
                                 float offset) {
    pdl_entry();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    T* rr = residual + (long long)row * dim;
    const T* xr = x + (long long)row * dim;
    T* yr = out + (long long)row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        // Round the sum to the storage type first: the next layer reads the stored residual, so must we.
        const T s = from_f<T>(to_f(rr[i]) + to_f(xr[i]));
        rr[i] = s;
        const float v = to_f(s);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = from_f<T>(to_f(rr[i]) * inv * (offset + to_f(w[i])));
}

template <typename T>
__device__ void rmsnorm_gated_impl(T* out, const T* x, const T* z, int z_stride, const T* w, int rows, int dim,
                                   int heads_per_z_row, float eps) {
    pdl_entry();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + (long long)row * dim;
    // z rows hold `heads_per_z_row` heads of `dim` each (z comes out of a fused projection with its own stride).
    const T* zr = z + (long long)(row / heads_per_z_row) * z_stride + (long long)(row % heads_per_z_row) * dim;
    T* yr = out + (long long)row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f(xr[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = from_f<T>(to_f(w[i]) * to_f(xr[i]) * inv * silu(to_f(zr[i])));
}

#define DEFINE(S, T)                                                                                              \
    extern "C" __global__ void rmsnorm_##S(T* out, long long out_tok_stride, int out_head_stride, const T* x,     \
                                           long long x_tok_stride, int x_head_stride, int heads, const T* w,      \
                                           int rows, int dim, float eps, float offset) {                          \
        rmsnorm_impl<T>(out, out_tok_stride, out_head_stride, x, x_tok_stride, x_head_stride, heads, w, rows, dim,  \
                        eps, offset);                                                                             \
    }                                                                                                             \
    extern "C" __global__ void add_rmsnorm_##S(T* out, T* residual, const T* x, const T* w, int rows, int dim,     \
                                               float eps, float offset) {                                         \
        add_rmsnorm_impl<T>(out, residual, x, w, rows, dim, eps, offset);                                          \
    }                                                                                                             \
    extern "C" __global__ void rmsnorm_gated_##S(T* out, const T* x, const T* z, int z_stride, const T* w,         \
                                                 int rows, int dim, int heads_per_z_row, float eps) {             \
        rmsnorm_gated_impl<T>(out, x, z, z_stride, w, rows, dim, heads_per_z_row, eps);                            \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
