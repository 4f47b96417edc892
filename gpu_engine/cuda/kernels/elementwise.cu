// Element-wise ops of the MLP and the residual stream. Grid-stride loops; fp32 arithmetic.
//   silu_mul:  out[r, i] = silu(gu[r, i]) * gu[r, inter + i]   (gate and up come out of ONE fused GEMM)
//   add:       out = a + b                                      (plain residual add where no norm follows)
#include "common.cuh"

template <typename T>
__device__ void silu_mul_impl(T* out, const T* gu, int rows, int inter) {
    pdl_entry();
    const long long n = (long long)rows * inter;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long r = idx / inter, i = idx % inter;
        const T* row = gu + r * 2 * inter;
        out[idx] = from_f<T>(silu(to_f(row[i])) * to_f(row[inter + i]));
    }
}

template <typename T>
__device__ void add_impl(T* out, const T* a, const T* b, long long n) {
    pdl_entry();
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x)
        out[idx] = from_f<T>(to_f(a[idx]) + to_f(b[idx]));
}

#define DEFINE(S, T)                                                                                  \
    extern "C" __global__ void silu_mul_##S(T* out, const T* gu, int rows, int inter) {                \
        silu_mul_impl<T>(out, gu, rows, inter);                                                        \
    }                                                                                                 \
    extern "C" __global__ void add_##S(T* out, const T* a, const T* b, long long n) { add_impl<T>(out, a, b, n); }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
