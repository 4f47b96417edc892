// Token embedding gather and vision-embedding scatter. One block per output row.
//   embed_gather:  out[i] = table[ids[i]]            (ids outside [0, vocab) give a zero row, never a wild read)
//   scatter_rows:  out[dst[i]] = src[i]              (vision embeddings into their placeholder rows of a chunk)
#include "common.cuh"

template <typename T>
__device__ void embed_gather_impl(T* out, const T* table, const int* ids, int n, int hidden, int vocab) {
    pdl_entry();
    const int row = blockIdx.x;
    if (row >= n) return;
    const int id = ids[row];
    T* dst = out + (long long)row * hidden;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = from_f<T>(0.0f);
        return;
    }
    const T* src = table + (long long)id * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

template <typename T>
__device__ void scatter_rows_impl(T* out, const T* src, const int* dst_rows, int n, int hidden) {
    pdl_entry();
    const int row = blockIdx.x;
    if (row >= n) return;
    T* dst = out + (long long)dst_rows[row] * hidden;
    const T* s = src + (long long)row * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = s[i];
}

#define DEFINE(S, T)                                                                                          \
    extern "C" __global__ void embed_gather_##S(T* out, const T* table, const int* ids, int n, int hidden,     \
                                                int vocab) {                                                  \
        embed_gather_impl<T>(out, table, ids, n, hidden, vocab);                                               \
    }                                                                                                         \
    extern "C" __global__ void scatter_rows_##S(T* out, const T* src, const int* dst_rows, int n, int hidden) { \
        scatter_rows_impl<T>(out, src, dst_rows, n, hidden);                                                   \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
