// RMSNorm family. One block per row; fp32 statistics whatever the storage type.
//   rmsnorm:        out = x * rsqrt(mean(x^2) + eps) * (offset + w)   offset 1.0 = zero-centred weights (Qwen3.5)
//   add_rmsnorm:    residual += x (stored), out = rmsnorm(residual)   (the fused residual add of every layer)
//   rmsnorm_gated:  out = w * rmsnorm(x) * silu(z)                     (Gated DeltaNet output norm)
// Row strides are in elements so that per-head norms can read q out of the fused q|gate projection in place.
#include "common.cuh"

template <typename T>
__device__ void rmsnorm_impl(T* out, int out_stride, const T* x, int x_stride, const T* w, int rows, int dim,
                             float eps, float offset) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + (long long)row * x_stride;
    T* yr = out + (long long)row * out_stride;
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
    extern "C" __global__ void rmsnorm_##S(T* out, int out_stride, const T* x, int x_stride, const T* w, int rows, \
                                           int dim, float eps, float offset) {                                    \
        rmsnorm_impl<T>(out, out_stride, x, x_stride, w, rows, dim, eps, offset);                                  \
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
