// RMSNorm family. fp32 statistics whatever the storage type.
//   rmsnorm:        out = x * rsqrt(mean(x^2) + eps) * (offset + w)   offset 1.0 = zero-centred weights (Qwen3.5)
//   add_rmsnorm:    residual += x (stored), out = rmsnorm(residual)   (the fused residual add of every layer)
//   rmsnorm_gated:  out = w * rmsnorm(x) * silu(z)                     (Gated DeltaNet output norm)
// rmsnorm rows may be heads of tokens (token and head strides, in elements): the per-head q/k norms read q and k
// straight out of the fused q|gate|k|v projection; in place (out == x) is allowed.
//
// A block takes `block_rows` rows (ops.norm_launch). Memory: the whole block stages its rows (and their z rows) in
// shared memory, chunk by chunk (a chunk = VEC = 16 / sizeof(T) elements, one 16-byte load; NORM_BATCH loads in
// flight per thread), then writes the outputs the same way. Where a width, stride or pointer is not a 16-byte
// multiple the same chunks go element by element, with the same arithmetic.
// Sum order: `vt` (the block size of the one-block-per-row scalar kernels this file had, ops._threads(dim)) fixes
// it whoever does the loads: virtual thread t < vt sums x[t]^2, x[t + vt]^2, ... in turn, each 32 virtual threads'
// sums go through warp_sum and the vt / 32 results through warp_sum again (block_sum's two stages). So every bit
// equals those kernels' and fp8.cu's norm_quant (which mirrors them; check_fp8 compares the two).
//   block_rows 1: the block's warps share the row, warp r playing virtual warps r, r + blockDim.x / 32, ...
//   block_rows > 1 (short rows, vt <= 128): warp r sums rows r, r + blockDim.x / 32, ..., each alone (it plays
//                  all vt / 32 virtual warps), with no barrier between the block's rows.
#include "common.cuh"

#define NORM_BATCH 2  // chunks (16-byte loads of each operand) a thread issues before it waits on the first
#define NORM_MAX_BLOCK_ROWS 64  // ops.norm_launch's block_rows stay at or under this

extern __shared__ __align__(16) unsigned char norm_smem[];

__device__ __forceinline__ bool aligned16(const void* p) { return (((unsigned long long)p) & 15ull) == 0ull; }

// Chunk c of a row: elements [c * VEC, c * VEC + VEC), one 16-byte load, or (vec false) element loads of the ones
// below dim (the others read as zero and are never summed or stored).
template <typename T>
__device__ __forceinline__ uint4 load_chunk(const T* row, int c, int dim, bool vec) {
    constexpr int VEC = 16 / sizeof(T);
    if (vec) return reinterpret_cast<const uint4*>(row)[c];
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int j = 0; j < VEC; ++j)
        if (c * VEC + j < dim) e[j] = row[c * VEC + j];
    return u;
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* row, int c, int dim, bool vec, const uint4& u) {
    constexpr int VEC = 16 / sizeof(T);
    if (vec) {
        reinterpret_cast<uint4*>(row)[c] = u;
        return;
    }
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < VEC; ++j)
        if (c * VEC + j < dim) row[c * VEC + j] = e[j];
}

// The block's chunks, NORM_BATCH per thread at a time: chunk i is chunk i % cpr of the block's row slot i / cpr.
// load(k, slot, c) issues the loads of batch entry k, use(k, slot, c) consumes them; all loads of a batch come
// first (the compiler cannot move a load above a store to memory it cannot tell apart).
template <typename Load, typename Use>
__device__ __forceinline__ void for_block_chunks(int rows, int block_rows, int cpr, Load load, Use use) {
    const int total = block_rows * cpr, first = blockIdx.x * block_rows;
    for (int i0 = threadIdx.x; i0 < total; i0 += NORM_BATCH * blockDim.x) {
#pragma unroll
        for (int k = 0; k < NORM_BATCH; ++k) {
            const int i = i0 + k * blockDim.x, slot = i / cpr;
            if (i < total && first + slot < rows) load(k, slot, i - slot * cpr);
        }
#pragma unroll
        for (int k = 0; k < NORM_BATCH; ++k) {
            const int i = i0 + k * blockDim.x, slot = i / cpr;
            if (i < total && first + slot < rows) use(k, slot, i - slot * cpr);
        }
    }
}

// Sum of squares of staged row srow in the scalar kernels' order (see the top of this file), by `threads`
// threads starting at a warp boundary (g: rank among them); the lanes of their warps all get it. Where several
// warps share the row, scratch (>= vt / 32 floats) carries the virtual warps' sums across a block barrier.
template <typename T>
__device__ __forceinline__ float staged_sum_sq(const T* srow, int dim, int vt, int g, int threads, float* scratch) {
    const int lane = g & 31, vwarps = vt >> 5;
    float sums = 0.0f;  // one warp alone: lane w holds virtual warp w's sum (block_sum's scratch[w]), 0 past the last
    for (int w = g >> 5; w < vwarps; w += threads >> 5) {
        float ss = 0.0f;
        for (int i = w * 32 + lane; i < dim; i += vt) {
            const float v = to_f(srow[i]);
            ss += v * v;
        }
        ss = warp_sum(ss);
        if (threads == 32) {
            if (lane == w) sums = ss;
        } else if (lane == 0) {
            scratch[w] = ss;
        }
    }
    if (threads > 32) {
        __syncthreads();
        sums = lane < vwarps ? scratch[lane] : 0.0f;
    }
    return warp_sum(sums);
}

// inv_rms[slot] = rsqrt(mean of squares + eps) of each staged row of the block (sa: block_rows rows of sdim).
template <typename T>
__device__ __forceinline__ void block_inv_rms(float* inv_rms, const T* sa, int sdim, int rows, int block_rows, int dim,
                                              int vt, float eps, float* scratch) {
    __syncthreads();  // the staged rows are complete
    if (block_rows == 1) {
        const float inv = rsqrtf(staged_sum_sq(sa, dim, vt, threadIdx.x, blockDim.x, scratch) / (float)dim + eps);
        if (threadIdx.x == 0) inv_rms[0] = inv;
    } else {
        const int warps = blockDim.x >> 5;
        for (int slot = threadIdx.x >> 5; slot < block_rows && blockIdx.x * block_rows + slot < rows; slot += warps) {
            const float ss = staged_sum_sq(sa + (long long)slot * sdim, dim, vt, threadIdx.x & 31, 32, scratch);
            if ((threadIdx.x & 31) == 0) inv_rms[slot] = rsqrtf(ss / (float)dim + eps);
        }
    }
    __syncthreads();
}

// One staged chunk of a row normalised: x * inv_rms * (offset + w), element by element (rmsnorm, add_rmsnorm).
template <typename T>
__device__ __forceinline__ uint4 normed_chunk(const T* srow, int c, const uint4& wv, float inv, float offset) {
    constexpr int VEC = 16 / sizeof(T);
    const uint4 sv = reinterpret_cast<const uint4*>(srow)[c];
    const T *xe = reinterpret_cast<const T*>(&sv), *we = reinterpret_cast<const T*>(&wv);
    uint4 ov;
    T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
    for (int j = 0; j < VEC; ++j) oe[j] = from_f<T>(to_f(xe[j]) * inv * (offset + to_f(we[j])));
    return ov;
}

template <typename T>
__device__ void rmsnorm_impl(T* out, long long out_tok_stride, int out_head_stride, const T* x,
                             long long x_tok_stride, int x_head_stride, int heads, const T* w, int rows, int dim,
                             float eps, float offset, int vt, int block_rows) {
    constexpr int VEC = 16 / sizeof(T);
    pdl_entry();
    __shared__ float scratch[32], inv_rms[NORM_MAX_BLOCK_ROWS];
    const bool vec = dim % VEC == 0 && x_tok_stride % VEC == 0 && x_head_stride % VEC == 0 &&
                     out_tok_stride % VEC == 0 && out_head_stride % VEC == 0 && aligned16(x) && aligned16(out) &&
                     aligned16(w);
    const int cpr = (dim + VEC - 1) / VEC, sdim = cpr * VEC, first = blockIdx.x * block_rows;
    if (first >= rows) return;  // the whole block (grid rounded up)
    T* sx = reinterpret_cast<T*>(norm_smem);
    // row = one head of one token (heads == 1: plain rows)
    uint4 xv[NORM_BATCH];
    for_block_chunks(rows, block_rows, cpr,
                     [&](int k, int slot, int c) {
                         const int row = first + slot;
                         xv[k] = load_chunk(x + (row / heads) * x_tok_stride + (long long)(row % heads) * x_head_stride,
                                            c, dim, vec);
                     },
                     [&](int k, int slot, int c) { reinterpret_cast<uint4*>(sx + (long long)slot * sdim)[c] = xv[k]; });
    block_inv_rms(inv_rms, sx, sdim, rows, block_rows, dim, vt, eps, scratch);
    uint4 wv[NORM_BATCH];
    for_block_chunks(rows, block_rows, cpr, [&](int k, int slot, int c) { wv[k] = load_chunk(w, c, dim, vec); },
                     [&](int k, int slot, int c) {
                         const int row = first + slot;
                         store_chunk(out + (row / heads) * out_tok_stride + (long long)(row % heads) * out_head_stride,
                                     c, dim, vec, normed_chunk(sx + (long long)slot * sdim, c, wv[k], inv_rms[slot],
                                                               offset));
                     });
}

template <typename T>
__device__ void add_rmsnorm_impl(T* out, T* residual, const T* x, const T* w, int rows, int dim, float eps,
                                 float offset, int vt, int block_rows) {
    constexpr int VEC = 16 / sizeof(T);
    pdl_entry();
    __shared__ float scratch[32], inv_rms[NORM_MAX_BLOCK_ROWS];
    const bool vec = dim % VEC == 0 && aligned16(out) && aligned16(residual) && aligned16(x) && aligned16(w);
    const int cpr = (dim + VEC - 1) / VEC, sdim = cpr * VEC, first = blockIdx.x * block_rows;
    if (first >= rows) return;
    T* ss = reinterpret_cast<T*>(norm_smem);
    uint4 rv[NORM_BATCH], xv[NORM_BATCH];
    for_block_chunks(rows, block_rows, cpr,
                     [&](int k, int slot, int c) {
                         const long long row = first + slot;
                         rv[k] = load_chunk(residual + row * dim, c, dim, vec);
                         xv[k] = load_chunk(x + row * dim, c, dim, vec);
                     },
                     [&](int k, int slot, int c) {
                         uint4 sv;
                         const T *re = reinterpret_cast<const T*>(&rv[k]), *xe = reinterpret_cast<const T*>(&xv[k]);
                         T* se = reinterpret_cast<T*>(&sv);
                         // Round the sum to the storage type first: the next layer reads the stored residual, so
                         // must we.
#pragma unroll
                         for (int j = 0; j < VEC; ++j) se[j] = from_f<T>(to_f(re[j]) + to_f(xe[j]));
                         store_chunk(residual + (long long)(first + slot) * dim, c, dim, vec, sv);
                         reinterpret_cast<uint4*>(ss + (long long)slot * sdim)[c] = sv;
                     });
    block_inv_rms(inv_rms, ss, sdim, rows, block_rows, dim, vt, eps, scratch);
    uint4 wv[NORM_BATCH];
    for_block_chunks(rows, block_rows, cpr, [&](int k, int slot, int c) { wv[k] = load_chunk(w, c, dim, vec); },
                     [&](int k, int slot, int c) {
                         store_chunk(out + (long long)(first + slot) * dim, c, dim, vec,
                                     normed_chunk(ss + (long long)slot * sdim, c, wv[k], inv_rms[slot], offset));
                     });
}

template <typename T>
__device__ void rmsnorm_gated_impl(T* out, const T* x, const T* z, int z_stride, const T* w, int rows, int dim,
                                   int heads_per_z_row, float eps, int vt, int block_rows) {
    constexpr int VEC = 16 / sizeof(T);
    pdl_entry();
    __shared__ float scratch[32], inv_rms[NORM_MAX_BLOCK_ROWS];
    const bool vec = dim % VEC == 0 && z_stride % VEC == 0 && aligned16(out) && aligned16(x) && aligned16(z) &&
                     aligned16(w);
    const int cpr = (dim + VEC - 1) / VEC, sdim = cpr * VEC, first = blockIdx.x * block_rows;
    if (first >= rows) return;
    // the block's x rows, then their z rows: z is staged with x so that its loads overlap the sums
    T* sx = reinterpret_cast<T*>(norm_smem);
    T* sz = sx + (long long)block_rows * sdim;
    uint4 xv[NORM_BATCH], zv[NORM_BATCH];
    for_block_chunks(rows, block_rows, cpr,
                     [&](int k, int slot, int c) {
                         const int row = first + slot;
                         // z rows hold `heads_per_z_row` heads of `dim` each (z comes out of a fused projection
                         // with its own stride)
                         const T* zr = z + (long long)(row / heads_per_z_row) * z_stride +
                                       (long long)(row % heads_per_z_row) * dim;
                         xv[k] = load_chunk(x + (long long)row * dim, c, dim, vec);
                         zv[k] = load_chunk(zr, c, dim, vec);
                     },
                     [&](int k, int slot, int c) {
                         reinterpret_cast<uint4*>(sx + (long long)slot * sdim)[c] = xv[k];
                         reinterpret_cast<uint4*>(sz + (long long)slot * sdim)[c] = zv[k];
                     });
    block_inv_rms(inv_rms, sx, sdim, rows, block_rows, dim, vt, eps, scratch);
    uint4 wv[NORM_BATCH];
    for_block_chunks(rows, block_rows, cpr, [&](int k, int slot, int c) { wv[k] = load_chunk(w, c, dim, vec); },
                     [&](int k, int slot, int c) {
                         const uint4 sxv = reinterpret_cast<const uint4*>(sx + (long long)slot * sdim)[c];
                         const uint4 szv = reinterpret_cast<const uint4*>(sz + (long long)slot * sdim)[c];
                         const T *xe = reinterpret_cast<const T*>(&sxv), *ze = reinterpret_cast<const T*>(&szv);
                         const T* we = reinterpret_cast<const T*>(&wv[k]);
                         const float inv = inv_rms[slot];
                         uint4 ov;
                         T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
                         for (int j = 0; j < VEC; ++j)
                             oe[j] = from_f<T>(to_f(we[j]) * to_f(xe[j]) * inv * silu(to_f(ze[j])));
                         store_chunk(out + (long long)(first + slot) * dim, c, dim, vec, ov);
                     });
}

// __launch_bounds__(1024): check_kernels also launches the literal layout (a thread per virtual thread, up to 1024)
#define DEFINE(S, T)                                                                                              \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        rmsnorm_##S(T* out, long long out_tok_stride, int out_head_stride, const T* x, long long x_tok_stride,    \
                    int x_head_stride, int heads, const T* w, int rows, int dim, float eps, float offset, int vt, \
                    int block_rows) {                                                                             \
        rmsnorm_impl<T>(out, out_tok_stride, out_head_stride, x, x_tok_stride, x_head_stride, heads, w, rows, dim,  \
                        eps, offset, vt, block_rows);                                                             \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        add_rmsnorm_##S(T* out, T* residual, const T* x, const T* w, int rows, int dim, float eps, float offset,  \
                        int vt, int block_rows) {                                                                 \
        add_rmsnorm_impl<T>(out, residual, x, w, rows, dim, eps, offset, vt, block_rows);                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        rmsnorm_gated_##S(T* out, const T* x, const T* z, int z_stride, const T* w, int rows, int dim,            \
                          int heads_per_z_row, float eps, int vt, int block_rows) {                               \
        rmsnorm_gated_impl<T>(out, x, z, z_stride, w, rows, dim, heads_per_z_row, eps, vt, block_rows);           \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
