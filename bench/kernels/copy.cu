// Plain device-to-device copy with 16-byte accesses: the benchmark's HBM-bandwidth ceiling.
#include "common.cuh"

extern "C" __global__ void copy_u4(uint4* dst, const uint4* src, long long n) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
