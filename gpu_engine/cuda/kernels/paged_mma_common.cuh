// What the paged-attention mma kernels (paged_attention_mma in attention.cu, its FP8 form in paged_mma_fp8.cuh)
// share (the FP8 form takes the merge only: its pipeline through these helpers compiled to other PTX): one block
// of PM_WARPS warps per (query token, KV head, key split), each warp's 16 keys of a stage in an m16n8 score
// fragment (lane (g, tig): keys g and g + 8, heads 2 tig and 2 tig + 1), the exp2-domain online
// softmax over them, P^T staged through shared memory as the PV product's B fragment, and the merge of the warps'
// states into paged_attention's partial form. The two differ in how K / V reach the mma (ldmatrix of bf16 rows vs
// e4m3 bytes widened in registers) and so in which head dims an O^T fragment row holds: the merge takes that
// mapping as a parameter. Include after tensor_core.cuh, with PM_WARPS and PM_BN defined.

// this split's keys [lo, hi) of a query at position `last` (split-K in equal parts), in n_tiles tiles of PM_BN
struct PmSplit {
    int lo, hi, n_tiles;
};
__device__ __forceinline__ PmSplit pm_split(int last, int split, int splits) {
    const int per_split = (last + splits) / splits;
    const int lo = split * per_split, hi = min(last + 1, lo + per_split);
    return {lo, hi, hi > lo ? (hi - lo + PM_BN - 1) / PM_BN : 0};
}

// the cache slot (block * block_size + row) of key position kp through the sequence's block table
__device__ __forceinline__ long long pm_slot(const int* table, int kp, int block_size, bool bs_pow2, int bs_shift) {
    const int blk = bs_pow2 ? kp >> bs_shift : kp / block_size;
    return (long long)table[blk] * block_size + (kp - blk * block_size);
}

// cp.async pipeline of STAGES buffers: fill STAGES - 1 of them, then per tile t wait for it and start t + STAGES - 1
template <int STAGES, typename Load>
__device__ __forceinline__ void pm_pipeline_fill(int n_tiles, const Load& load_kv) {
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < n_tiles) load_kv(t, t);
        cp_async_commit();  // empty groups keep the count uniform
    }
}
template <int STAGES, typename Load>
__device__ __forceinline__ void pm_pipeline_next(int t, int n_tiles, const Load& load_kv) {
    cp_async_wait<STAGES - 2>();  // tile t has landed (for this thread) ...
    __syncthreads();              // ... for every thread, and stage (t - 1) % STAGES is free again
    if (t + STAGES - 1 < n_tiles) load_kv(t + STAGES - 1, (t + STAGES - 1) % STAGES);
    cp_async_commit();
}

// P^T [16 k indices][8 heads] bf16 into the warp's 256 bytes at ps_base (read back with ldsm_x2_trans as the PV
// product's B fragment): k index `row` gets heads 2 tig, 2 tig + 1 = (a0, a1), row + 8 gets (b0, b1)
__device__ __forceinline__ void pm_stage_pt(unsigned ps_base, int row, int tig, float a0, float a1, float b0,
                                            float b1) {
    __syncwarp();
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ps_base + (unsigned)((row * 8 + 2 * tig) * 2)),
                 "r"(pack_bf16(a0, a1)) : "memory");
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ps_base + (unsigned)(((row + 8) * 8 + 2 * tig) * 2)),
                 "r"(pack_bf16(b0, b1)) : "memory");
    __syncwarp();
}

// an O^T m-tile's accumulators (rows: heads 2 tig, 2 tig + 1 alternating) rescaled to the new running max
__device__ __forceinline__ void pm_rescale(float (&o)[4], float corr0, float corr1) {
    o[0] *= corr0;
    o[1] *= corr1;
    o[2] *= corr0;
    o[3] *= corr1;
}

// After the key loop: the warps' states merged through shared memory (the pipeline's, `smem`, now free) and written
// in paged_attention's partial form (max in scale * score units, sum, unnormalised accumulator), so that
// attention_combine is unchanged. O^T m-tile mt of lane group g holds dims dim_of(mt) (o[mt][0], o[mt][1]) and
// dim_of(mt) + ROW_B (o[mt][2], o[mt][3]).
template <int HD, int ROW_B, typename DimOf>
__device__ __forceinline__ void pm_merge_write(void* smem, const float (&o)[HD / 16][4], float m0, float m1, float l0,
                                               float l1, DimOf dim_of, int warp, int g, int tig, float* part_acc,
                                               float* part_ml, int token, int kvh, int kv_heads, int group, int split,
                                               int splits, float sl, float scale) {
    constexpr int THREADS = PM_WARPS * 32;
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory now holds the warps' states
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {  // each group summed its own keys
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    float* s_acc = reinterpret_cast<float*>(smem);  // [PM_WARPS][8 heads][HD]
    float* s_m = s_acc + PM_WARPS * 8 * HD;         // [PM_WARPS][8]
    float* s_l = s_m + PM_WARPS * 8;
    const int h0 = 2 * tig, h1 = h0 + 1;
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) {
        const int d = dim_of(mt);
        s_acc[(warp * 8 + h0) * HD + d] = o[mt][0];
        s_acc[(warp * 8 + h1) * HD + d] = o[mt][1];
        s_acc[(warp * 8 + h0) * HD + d + ROW_B] = o[mt][2];
        s_acc[(warp * 8 + h1) * HD + d + ROW_B] = o[mt][3];
    }
    if (g == 0) {
        s_m[warp * 8 + h0] = m0;
        s_m[warp * 8 + h1] = m1;
        s_l[warp * 8 + h0] = l0;
        s_l[warp * 8 + h1] = l1;
    }
    __syncthreads();
    const int heads = kv_heads * group;
    for (int i = threadIdx.x; i < group * HD; i += THREADS) {
        const int hh = i / HD, d = i % HD;
        float m_blk = NEG_INF;
#pragma unroll
        for (int w = 0; w < PM_WARPS; ++w) m_blk = fmaxf(m_blk, s_m[w * 8 + hh]);
        float acc = 0.0f, l_blk = 0.0f;
#pragma unroll
        for (int w = 0; w < PM_WARPS; ++w) {
            const float mw = s_m[w * 8 + hh];
            if (mw == NEG_INF) continue;
            const float c = exp2_ftz((mw - m_blk) * sl);
            acc += s_acc[(w * 8 + hh) * HD + d] * c;
            l_blk += s_l[w * 8 + hh] * c;
        }
        const long long part = ((long long)token * heads + kvh * group + hh) * splits + split;
        part_acc[part * HD + d] = acc;
        if (d == 0) {
            part_ml[2 * part] = m_blk == NEG_INF ? NEG_INF : m_blk * scale;  // paged_attention's units
            part_ml[2 * part + 1] = l_blk;
        }
    }
}
