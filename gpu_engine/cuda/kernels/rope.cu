// Rotary position embedding, in place, rotate-half convention on the first `rot_dim` dims of each head
// (the rest pass through). One kernel serves both users through two small host-built tables:
//   inv_freq[j]  (j < rot_dim/2)  the frequency of pair (j, j + rot_dim/2)
//   axis[j]                       which row of `pos` drives pair j
// Text M-RoPE (Qwen3.5): axis = interleaved T/H/W pattern from mrope_section, pos = [3, n] (t, h, w).
// Vision 2-D rotary: axis = h for the first quarter of the head, w for the second, pos = [2, n] (h, w).
// The angle is one fp32 multiply pos * inv_freq, as transformers computes it, then precise sincosf.
#include "common.cuh"

template <typename T>
__device__ void rope_impl(T* x, long long token_stride, int head_stride, const int* pos, int pos_row_stride,
                          const float* inv_freq, const int* axis, int n, int heads, int rot_dim) {
    pdl_entry();
    const int token = blockIdx.x;
    if (token >= n) return;
    const int half = rot_dim / 2;
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        const int h = idx / half, j = idx % half;
        const float angle = (float)pos[axis[j] * pos_row_stride + token] * inv_freq[j];
        float s, c;
        sincosf(angle, &s, &c);
        T* xh = x + token * token_stride + (long long)h * head_stride;
        const float x1 = to_f(xh[j]), x2 = to_f(xh[j + half]);
        xh[j] = from_f<T>(x1 * c - x2 * s);
        xh[j + half] = from_f<T>(x2 * c + x1 * s);
    }
}

#define DEFINE(S, T)                                                                                          \
    extern "C" __global__ void rope_##S(T* x, long long token_stride, int head_stride, const int* pos,         \
                                        int pos_row_stride, const float* inv_freq, const int* axis, int n,     \
                                        int heads, int rot_dim) {                                             \
        rope_impl<T>(x, token_stride, head_stride, pos, pos_row_stride, inv_freq, axis, n, heads, rot_dim);    \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
