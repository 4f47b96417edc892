// Single-purpose fp32 logits kernels [rows, vocab], one block per row, that check_kernels runs against numpy (the
// engine samples with sample_rows_f32 in gpu_engine/cuda/kernels/sampling.cu and launches none of these):
//   argmax:        out[r] = index of the largest logit (smallest index on ties; NaN never wins)
//   log_softmax:   out[r, i] = logits[r, i] - logsumexp(logits[r])   (also writes lse[r])
//   apply_bitmask: logits[r, i] = -inf where bit i of mask row r is 0 (llguidance convention: 1 = allowed);
//                  mask [rows, words] of 32-bit words, word i/32, bit i%32.
#include "common.cuh"

// (best, best_i) across the warp: the largest value, the smallest index among equal ones. Every lane ends with the
// warp's answer. NaN never compares greater, so it never replaces a number.
__device__ __forceinline__ void warp_argmax(float& best, int& best_i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) {
            best = ov;
            best_i = oi;
        }
    }
}

extern "C" __global__ void argmax_f32(int* out, const float* logits, int rows, int vocab) {
    pdl_entry();
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (long long)r * vocab;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (v > best) {  // strictly greater: keeps the first index within this thread's stride
            best = v;
            best_i = i;
        }
    }
    warp_argmax(best, best_i);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < nwarps ? s_val[lane] : NEG_INF;
        best_i = lane < nwarps ? s_idx[lane] : 0x7fffffff;
        warp_argmax(best, best_i);
        if (lane == 0) out[r] = best_i == 0x7fffffff ? 0 : best_i;  // all -inf/NaN row: token 0, never garbage
    }
}

extern "C" __global__ void log_softmax_f32(float* out, float* lse, const float* logits, int rows, int vocab) {
    pdl_entry();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (long long)r * vocab;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, x[i]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(x[i] - m);
    s = block_sum(s, scratch);
    const float l = m + logf(s);
    if (threadIdx.x == 0) lse[r] = l;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) out[(long long)r * vocab + i] = x[i] - l;
}

extern "C" __global__ void apply_bitmask_f32(float* logits, const unsigned int* mask, int rows, int vocab,
                                             int words) {
    pdl_entry();
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* x = logits + (long long)r * vocab;
    const unsigned int* mr = mask + (long long)r * words;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (((mr[i >> 5] >> (i & 31)) & 1u) == 0u) x[i] = NEG_INF;
}
