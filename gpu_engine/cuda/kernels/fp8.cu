// Block-scaled FP8 (e4m3) kernels: the dynamic activation quantisation and the small-batch (decode) GEMM.
//
// Formats (gpu_engine/fp8.py): a weight W [n, k] is e4m3 bytes Q and one float32 scale per 128x128 block,
// W = Q * sw[n / 128, k / 128]; an activation row is quantised per 128-wide group of its k features,
// x ~ e4m3(x / s) * s with s = max(amax(|group|), 1e-10) / 448. Scale tensors are addressed with explicit strides
// (elements), so one kernel serves the layouts cuBLASLt wants (see gpu_engine/cuda/fp8_ops.py).
// k must be a multiple of 16 (16-byte rows); the last group / block of a ragged k is narrower.
#include "common.cuh"

typedef unsigned char u8_t;

#define E4M3_MAX 448.0f
#define ACT_FLOOR 1e-10f

// float pair -> two e4m3 bytes (lo in the low byte), round to nearest even, saturating at +-448 (sm_89+)
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short out;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
    return out;
}

// ---- dynamic activation quantisation --------------------------------------------------------------------
// grid (rows, ceil(groups / 8)), 128 threads: each half-warp quantises one 128-group of one row, 8 features a
// lane (16-byte loads). q [rows, k] with row stride q_ld; scales[g * s_g + r * s_m].
// SWIGLU: the features are silu(gate) * up, rounded to bf16 as silu_mul stores them (elementwise.cu), with gate at
// column c and up at k + c of the row (the fused gate|up GEMM's output), so the MLP's activation goes straight to
// FP8 without its bf16 round trip through memory.
template <bool SWIGLU>
__device__ __forceinline__ void quant_rows(const bf16_t* __restrict__ x, long long x_ld, u8_t* __restrict__ q,
                                           long long q_ld, float* __restrict__ scales, long long s_g, long long s_m,
                                           int rows, int k) {
    pdl_entry();
    const int r = blockIdx.x, lane = threadIdx.x & 31, sub = lane & 15;
    const int g = blockIdx.y * 8 + (threadIdx.x >> 4);
    const int groups = (k + 127) / 128;
    if (r >= rows || g >= groups) return;  // whole half-warps leave together: the shuffles below stay in a half
    const int col = g * 128 + sub * 8;
    const bool in = col < k;  // k % 16 == 0: a lane's 8 features are all in or all out
    float v[8];
    const bf16_t* row = x + (long long)r * x_ld;
    const uint4 raw = in ? *reinterpret_cast<const uint4*>(row + col) : make_uint4(0u, 0u, 0u, 0u);
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = to_f((bf16_t)(words[i] & 0xffffu));
        v[2 * i + 1] = to_f((bf16_t)(words[i] >> 16));
    }
    if (SWIGLU) {
        const uint4 up = in ? *reinterpret_cast<const uint4*>(row + k + col) : make_uint4(0u, 0u, 0u, 0u);
        const unsigned int uw[4] = {up.x, up.y, up.z, up.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = to_f(from_f<bf16_t>(silu(v[2 * i]) * to_f((bf16_t)(uw[i] & 0xffffu))));
            v[2 * i + 1] = to_f(from_f<bf16_t>(silu(v[2 * i + 1]) * to_f((bf16_t)(uw[i] >> 16))));
        }
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    // a half-warp's max (the two halves of a warp are two groups; a half that left early is a whole group)
    const unsigned int mask = (threadIdx.x & 16) ? 0xffff0000u : 0x0000ffffu;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
    const float s = fmaxf(amax, ACT_FLOOR) / E4M3_MAX;  // IEEE division, as numpy's float32
    if (in) {
        uint2 out;
        out.x = (unsigned int)e4m3x2(v[0] / s, v[1] / s) | ((unsigned int)e4m3x2(v[2] / s, v[3] / s) << 16);
        out.y = (unsigned int)e4m3x2(v[4] / s, v[5] / s) | ((unsigned int)e4m3x2(v[6] / s, v[7] / s) << 16);
        *reinterpret_cast<uint2*>(q + (long long)r * q_ld + col) = out;
    }
    if (sub == 0) scales[(long long)g * s_g + (long long)r * s_m] = s;
}

extern "C" __global__ void fp8_quant_act_bf16(const bf16_t* x, long long x_ld, u8_t* q, long long q_ld,
                                              float* scales, long long s_g, long long s_m, int rows, int k) {
    quant_rows<false>(x, x_ld, q, q_ld, scales, s_g, s_m, rows, k);
}

// k = the intermediate size; gate_up rows [gate (k) | up (k)] with row stride x_ld
extern "C" __global__ void fp8_silu_mul_quant_bf16(const bf16_t* gate_up, long long x_ld, u8_t* q, long long q_ld,
                                                   float* scales, long long s_g, long long s_m, int rows, int k) {
    quant_rows<true>(gate_up, x_ld, q, q_ld, scales, s_g, s_m, rows, k);
}

// ---- RMSNorm with its output quantised (the FP8 linear's input straight from the norm) -----------------------
// norm.cu's rmsnorm (ADD false: out = rmsnorm(x)) and add_rmsnorm (ADD true: residual += x, rounded and stored;
// out = rmsnorm(residual)) on bf16 rows [rows, dim], the same arithmetic in the same order with the same block
// size (ops._threads), so `out` is bit-identical to theirs; then q / scales exactly as fp8_quant_act_bf16 computes
// them from `out` (one warp a 128-group, 4 features a lane). dim % 16 == 0. One block per row.
template <bool ADD>
__device__ __forceinline__ void norm_quant(bf16_t* out, bf16_t* residual, const bf16_t* x, const bf16_t* w,
                                           u8_t* q, long long q_ld, float* scales, long long s_g, long long s_m,
                                           int rows, int dim, float eps, float offset) {
    pdl_entry();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const bf16_t* xr = x + (long long)row * dim;
    bf16_t* rr = ADD ? residual + (long long)row * dim : nullptr;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v;
        if (ADD) {
            const bf16_t s = from_f<bf16_t>(to_f(rr[i]) + to_f(xr[i]));  // the stored residual, as add_rmsnorm
            rr[i] = s;
            v = to_f(s);
        } else {
            v = to_f(xr[i]);
        }
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);  // its __syncthreads publishes rr
    const bf16_t* src = ADD ? rr : xr;
    bf16_t* yr = out + (long long)row * dim;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, groups = (dim + 127) / 128;
    for (int g = threadIdx.x >> 5; g < groups; g += warps) {
        const int c = g * 128 + lane * 4;
        const bool in = c < dim;  // dim % 16 == 0: a lane's 4 features are all in or all out
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (in) {
                const bf16_t h = from_f<bf16_t>(to_f(src[c + j]) * inv * (offset + to_f(w[c + j])));
                yr[c + j] = h;
                v[j] = to_f(h);
            }
            amax = fmaxf(amax, fabsf(v[j]));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float s = fmaxf(amax, ACT_FLOOR) / E4M3_MAX;
        if (in)
            *reinterpret_cast<unsigned int*>(q + (long long)row * q_ld + c) =
                (unsigned int)e4m3x2(v[0] / s, v[1] / s) | ((unsigned int)e4m3x2(v[2] / s, v[3] / s) << 16);
        if (lane == 0) scales[(long long)g * s_g + (long long)row * s_m] = s;
    }
}

extern "C" __global__ void fp8_rmsnorm_quant_bf16(bf16_t* out, const bf16_t* x, const bf16_t* w, u8_t* q,
                                                  long long q_ld, float* scales, long long s_g, long long s_m,
                                                  int rows, int dim, float eps, float offset) {
    norm_quant<false>(out, nullptr, x, w, q, q_ld, scales, s_g, s_m, rows, dim, eps, offset);
}

extern "C" __global__ void fp8_add_rmsnorm_quant_bf16(bf16_t* out, bf16_t* residual, const bf16_t* x,
                                                      const bf16_t* w, u8_t* q, long long q_ld, float* scales,
                                                      long long s_g, long long s_m, int rows, int dim, float eps,
                                                      float offset) {
    norm_quant<true>(out, residual, x, w, q, q_ld, scales, s_g, s_m, rows, dim, eps, offset);
}

// ---- small-batch GEMM: y[m, n] = sum_k deq(xq)[m, k] deq(W)[n, k], m <= 8 * NT ---------------------------------
// Tensor cores (mma.sync m16n8k32 e4m3 -> f32) with the weight as the 16-row operand and the tokens as the
// 8-column one, so a decode step streams W once. One block = FP8_GEMV_WARPS warps on one 16-row tile; warp w takes
// the 128-groups w, w + WARPS, ...; each group's products are summed apart and scaled by sw * sx before joining
// the total (the scales are constant over a group). Within a group the k order is free as long as both operands
// use the same one: lane (gid, tig) loads 16 contiguous bytes of its W rows and of its token row at
// 16 * tig and 64 + 16 * tig, and feeds them to the mma as its k-slots, so every load is a 16-byte vector.
#define FP8_GEMV_WARPS 8

__device__ __forceinline__ void mma_e4m3(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm(  // not volatile: the next group's loads may be scheduled above it
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load16(const u8_t* base, long long row, long long ld, int col, bool ok) {
    if (!ok) return make_uint4(0u, 0u, 0u, 0u);
    return __ldg(reinterpret_cast<const uint4*>(base + row * ld + col));
}

// SPLIT (split-K): blockIdx.y takes the groups [blockIdx.y * gps, + gps) and stores its f32 sums to
// part[blockIdx.y][tok][row]; fp8_splitk_reduce_bf16 adds the splits in index order (deterministic). Why: N = 5120
// is 320 tiles, 1.2 waves of 264 resident blocks, so a third of the machine idles in the last wave.
template <int NT, bool SPLIT>
__device__ __forceinline__ void fp8_gemv(bf16_t* __restrict__ y, long long y_ld, const u8_t* __restrict__ xq,
                                         long long xq_ld, const float* __restrict__ sx, long long sx_g,
                                         long long sx_m, const u8_t* __restrict__ w, long long w_ld,
                                         const float* __restrict__ sw, long long sw_nb, long long sw_kb, int m,
                                         int n, int k, float* __restrict__ part, int gps) {
    pdl_entry();
    __shared__ float red[FP8_GEMV_WARPS][NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int n0 = blockIdx.x * 16;
    const int r0 = n0 + gid, r1 = n0 + gid + 8;
    const int all_groups = (k + 127) / 128;
    const int g_lo = SPLIT ? blockIdx.y * gps : 0;
    const int groups = SPLIT ? min(all_groups, g_lo + gps) : all_groups;
    const float* swrow = sw + (long long)(n0 / 128) * sw_nb;
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
#pragma unroll 2
    for (int g = g_lo + warp; g < groups; g += FP8_GEMV_WARPS) {
        const int c0 = g * 128 + tig * 16, c1 = c0 + 64;
        const uint4 w00 = load16(w, r0, w_ld, c0, r0 < n && c0 < k), w01 = load16(w, r0, w_ld, c1, r0 < n && c1 < k);
        const uint4 w10 = load16(w, r1, w_ld, c0, r1 < n && c0 < k), w11 = load16(w, r1, w_ld, c1, r1 < n && c1 < k);
        const float wscale = __ldg(swrow + (long long)g * sw_kb);
        const unsigned int a0[4] = {w00.x, w10.x, w00.y, w10.y}, a1[4] = {w00.z, w10.z, w00.w, w10.w};
        const unsigned int a2[4] = {w01.x, w11.x, w01.y, w11.y}, a3[4] = {w01.z, w11.z, w01.w, w11.w};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int tok = t * 8 + gid;
            const uint4 x0 = load16(xq, tok, xq_ld, c0, tok < m && c0 < k);
            const uint4 x1 = load16(xq, tok, xq_ld, c1, tok < m && c1 < k);
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            mma_e4m3(c, a0, x0.x, x0.y);
            mma_e4m3(c, a1, x0.z, x0.w);
            mma_e4m3(c, a2, x1.x, x1.y);
            mma_e4m3(c, a3, x1.z, x1.w);
            const int col = t * 8 + tig * 2;  // c[0], c[2]: token col; c[1], c[3]: col + 1
            const float s0 = col < m ? __ldg(sx + (long long)g * sx_g + (long long)col * sx_m) * wscale : 0.f;
            const float s1 = col + 1 < m ? __ldg(sx + (long long)g * sx_g + (long long)(col + 1) * sx_m) * wscale
                                         : 0.f;
            acc[t][0] += c[0] * s0;
            acc[t][1] += c[1] * s1;
            acc[t][2] += c[2] * s0;
            acc[t][3] += c[3] * s1;
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][t * 4 + i][lane] = acc[t][i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float v = 0.f;
#pragma unroll
            for (int wi = 0; wi < FP8_GEMV_WARPS; ++wi) v += red[wi][t * 4 + i][lane];
            const int row = i < 2 ? r0 : r1, tok = t * 8 + tig * 2 + (i & 1);
            if (row < n && tok < m) {
                if (SPLIT)
                    part[((long long)blockIdx.y * m + tok) * n + row] = v;
                else
                    y[(long long)tok * y_ld + row] = from_f<bf16_t>(v);
            }
        }
    }
}

#define FP8_GEMV_ENTRY(NT)                                                                                           \
    extern "C" __global__ void __launch_bounds__(FP8_GEMV_WARPS * 32, 2)                                          \
        fp8_gemv_bf16_t##NT(bf16_t* y, long long y_ld, const u8_t* xq, long long xq_ld, const float* sx,            \
                            long long sx_g, long long sx_m, const u8_t* w, long long w_ld, const float* sw,         \
                            long long sw_nb, long long sw_kb, int m, int n, int k) {                                \
        fp8_gemv<NT, false>(y, y_ld, xq, xq_ld, sx, sx_g, sx_m, w, w_ld, sw, sw_nb, sw_kb, m, n, k, nullptr, 0);    \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(FP8_GEMV_WARPS * 32, 2)                                          \
        fp8_gemv_splitk_t##NT(float* part, int gps, const u8_t* xq, long long xq_ld, const float* sx,               \
                              long long sx_g, long long sx_m, const u8_t* w, long long w_ld, const float* sw,       \
                              long long sw_nb, long long sw_kb, int m, int n, int k) {                              \
        fp8_gemv<NT, true>(nullptr, 0, xq, xq_ld, sx, sx_g, sx_m, w, w_ld, sw, sw_nb, sw_kb, m, n, k, part, gps);   \
    }
FP8_GEMV_ENTRY(1)
FP8_GEMV_ENTRY(2)
FP8_GEMV_ENTRY(3)
FP8_GEMV_ENTRY(4)

// y[tok, row] = bf16(sum over s of part[s][tok][row]), s in index order; one thread an output
extern "C" __global__ void fp8_splitk_reduce_bf16(bf16_t* y, long long y_ld, const float* part, int splits, int m,
                                                  int n) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, mn = (long long)m * n;
    if (i >= mn) return;
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += part[s * mn + i];
    y[(i / n) * y_ld + i % n] = from_f<bf16_t>(v);
}
