// The epilogue of the tiled prefill attention kernels (flash_prefill.cu, flash_prefill_ws.cu): this thread's two
// query rows (ra, rb of the m16n8 / m64 fragments) normalised by the row sums, gated by sigmoid(gate) and stored
// as bf16, rows at or past count skipped. Include after common.cuh and tensor_core.cuh.

template <int HD>
__device__ __forceinline__ void flash_store_gated(const float (&o)[HD / 8][4], float l_a, float l_b, int ra, int rb,
                                                  int tig, int first, int count, int h, int heads, bf16_t* out,
                                                  const bf16_t* gate, long long gate_stride, int gate_head_stride) {
    softmax_row_sums(l_a, l_b);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rb : ra;
        if (r >= count) continue;
        const long long tok = first + r;
        const float inv_l = 1.0f / (half ? l_b : l_a);
        const bf16_t* gh = gate + tok * gate_stride + (long long)h * gate_head_stride;
        unsigned* oh = (unsigned*)(out + tok * heads * HD + (long long)h * HD);
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt) {
            const int d = nt * 8 + tig * 2;
            const float v0 = o[nt][half * 2] * inv_l * sigmoidf(to_f(gh[d]));
            const float v1 = o[nt][half * 2 + 1] * inv_l * sigmoidf(to_f(gh[d + 1]));
            oh[d >> 1] = pack_bf16(v0, v1);
        }
    }
}
