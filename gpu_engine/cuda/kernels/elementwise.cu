// Element-wise ops of the MLP and the residual stream. fp32 arithmetic, 16-byte vector loads where aligned.
//   silu_mul:  out[r, i] = silu(gu[r, i]) * gu[r, inter + i]   (gate and up come out of ONE fused GEMM)
//   add:       out = a + b                                      (plain residual add where no norm follows)
// Each thread owns VEC = 16 / sizeof(T) consecutive elements (8 bf16, 4 f32): one 16-byte load per operand.
// Sizes or pointers that are not 16-byte multiples take the scalar path with the same arithmetic (bit-identical).
#include "common.cuh"

__device__ __forceinline__ bool aligned16(const void* p) { return (((unsigned long long)p) & 15ull) == 0ull; }

// Grid (column block of blockDim.x * VEC, row slice): no per-element division.
template <typename T>
__device__ void silu_mul_impl(T* out, const T* gu, int rows, int inter) {
    pdl_entry();
    constexpr int VEC = 16 / sizeof(T);
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (c0 >= inter) return;
    // inter % VEC == 0 keeps every row start (out r*inter, gate r*2*inter, up +inter) 16-byte aligned.
    const bool vec = inter % VEC == 0 && aligned16(out) && aligned16(gu);
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const T* g = gu + (long long)r * 2 * inter;
        T* o = out + (long long)r * inter;
        if (vec) {
            uint4 gv = *reinterpret_cast<const uint4*>(g + c0);
            uint4 uv = *reinterpret_cast<const uint4*>(g + inter + c0);
            uint4 ov;
            const T* ge = reinterpret_cast<const T*>(&gv);
            const T* ue = reinterpret_cast<const T*>(&uv);
            T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
            for (int j = 0; j < VEC; ++j) oe[j] = from_f<T>(silu(to_f(ge[j])) * to_f(ue[j]));
            *reinterpret_cast<uint4*>(o + c0) = ov;
        } else {
            for (int i = c0; i < c0 + VEC && i < inter; ++i) o[i] = from_f<T>(silu(to_f(g[i])) * to_f(g[inter + i]));
        }
    }
}

// Grid-stride over vectors of VEC; the n % VEC tail (and everything when misaligned) goes element by element.
template <typename T>
__device__ void add_impl(T* out, const T* a, const T* b, long long n) {
    pdl_entry();
    constexpr int VEC = 16 / sizeof(T);
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    const bool vec = aligned16(out) && aligned16(a) && aligned16(b);
    const long long nv = vec ? n / VEC : 0;
    for (long long v = tid; v < nv; v += step) {
        uint4 av = reinterpret_cast<const uint4*>(a)[v];
        uint4 bv = reinterpret_cast<const uint4*>(b)[v];
        uint4 ov;
        const T* ae = reinterpret_cast<const T*>(&av);
        const T* be = reinterpret_cast<const T*>(&bv);
        T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
        for (int j = 0; j < VEC; ++j) oe[j] = from_f<T>(to_f(ae[j]) + to_f(be[j]));
        reinterpret_cast<uint4*>(out)[v] = ov;
    }
    for (long long idx = nv * VEC + tid; idx < n; idx += step) out[idx] = from_f<T>(to_f(a[idx]) + to_f(b[idx]));
}

#define DEFINE(S, T)                                                                                  \
    extern "C" __global__ void silu_mul_##S(T* out, const T* gu, int rows, int inter) {                \
        silu_mul_impl<T>(out, gu, rows, inter);                                                        \
    }                                                                                                 \
    extern "C" __global__ void add_##S(T* out, const T* a, const T* b, long long n) { add_impl<T>(out, a, b, n); }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
