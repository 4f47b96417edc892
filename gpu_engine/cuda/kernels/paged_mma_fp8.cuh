// paged_attention_mma_fp8: paged_attention_mma (attention.cu) over an FP8 KV cache (fp8_kv.cuh): e4m3 K / V rows
// [blocks, block_size, kv_heads, HD] bytes and one float32 scale per (token, kv head). Included by attention.cu
// after paged_attention_mma, whose block shape (PM_WARPS warps, PM_BN keys a stage, 16 keys a warp), split-K,
// exp2 online softmax, P^T staging and merge into paged_attention's partial form it keeps.
//
// Why not dequantise a tile into bf16 in shared memory (the first FP8 form, 0.79x of the bf16 kernel at 192 x 8k
// and 0.86x at 1 x 128k on the H200): that pass wrote and re-read every element, added a barrier per tile, and its
// bf16 tile left room for only 3 stages of raw rows, so fewer keys were in flight than with bf16. Here the warps
// read the raw e4m3 rows straight from the cp.async stage with 16-byte shared loads and build the mma operands in
// registers (e4m3x4_to_bf16x2: exact e4m3 values as bf16, no scale); the scales apply once per key:
//   S^T = (K_e4m3 Q^T) * k_scale[key]            (fp32 score, then the bf16 kernel's softmax)
//   O^T += V_e4m3^T (P * v_scale[key])^T         (P' = bf16(p * v_scale), staged as P^T is)
// Rounding against the old bf16(e4m3 * s) tiles: K is exact (one fp32 product per score instead of a bf16 rounding
// per element), V is exact and P' = bf16(p * s) is the only rounding of the PV product (it was bf16(p) times
// bf16(e4m3 * s)): never coarser. With no bf16 tile, PM8_STAGES = 4 stages fit (3 tiles in flight, 192 keys).
//
// Fragment layouts (free, because a dot product does not care about the order of its terms, as long as both
// operands agree): K step ks = 4 j + i of lane (g, tig) covers dims d = 16 k_chunk(tig, j) + 4 i .. d + 3, A
// registers a0 / a2 = the even / odd byte pairs (d, d+2) / (d+1, d+3) of row g's word, a1 / a3 of row g + 8's, and
// Q's B fragment is permuted to match. V: lane tig reads keys tig, tig + 4 (k indices 2 tig, 2 tig + 1) and tig + 8,
// tig + 12 (2 tig + 8, 2 tig + 9); a byte permute of two keys' words gives (key, key') pairs per dim; lane group g
// owns dims v_dim(g, j) .. + 3 of word j, which are rows g / g + 8 of m-tiles 2 j (dims d, d+1) and 2 j + 1 (d+2,
// d+3). P^T is written at the k index of its key (p_row). Shared rows are padded so that both reads are free of
// bank conflicts at head_dim 128 and 256 (one 2-way conflict at 64). Needs what paged_attention_mma needs.
#define PM8_STAGES 4  // stages in flight: 3 tiles load while one is used

template <int HD> struct PagedMmaFp8Shape {
    // raw row stride (bytes): HD + 32 puts rows 1 apart 2 bank groups apart (HD = 128, 256), see the layout note
    static constexpr int LDB = HD >= 128 ? HD + 32 : HD + 16;
    static constexpr int RAW_TILE = PM_BN * LDB;                  // bytes of one K (or V) stage
    static constexpr int STAGE = 2 * RAW_TILE + 2 * PM_BN * 4;    // K rows, V rows, K scales, V scales
    static constexpr int PIPE_BYTES = PM8_STAGES * STAGE;
    static constexpr int MERGE_BYTES = PM_WARPS * 8 * (HD + 2) * 4;  // reuses the pipeline after the loop
    static constexpr int P_OFFSET = PIPE_BYTES > MERGE_BYTES ? PIPE_BYTES : MERGE_BYTES;
    static constexpr int SMEM_BYTES = P_OFFSET + PM_WARPS * 16 * 8 * 2;  // + P'^T [16 keys][8 heads] per warp
    // what the host gives: ops.paged_mma_shared_bytes(HD, fp8=True) (the first FP8 form's layout, kept so that the
    // host side is unchanged); the kernel traps on less than SMEM_BYTES
    static constexpr int OLD_PIPE = 2 * PM_BN * (HD + PM_PAD) * 2 + 3 * 2 * PM_BN * (HD + 16) + 3 * 2 * PM_BN * 4;
    static constexpr int HOST_BYTES = (OLD_PIPE > MERGE_BYTES ? OLD_PIPE : MERGE_BYTES) + PM_WARPS * 16 * 8 * 2;
    static_assert(SMEM_BYTES <= HOST_BYTES, "the FP8 mma layout must fit what ops.paged_mma_shared_bytes gives");
};

// the 16-byte chunk of a K row that lane tig reads for k-steps 4 j .. 4 j + 3
template <int HD> __device__ __forceinline__ int pm8_k_chunk(int tig, int j) {
    if constexpr (HD >= 128) return (tig & 1) + 4 * (tig >> 1) + 2 * (j & 1) + 8 * (j >> 1);
    else return tig;
}
// the first of the 4 dims of V word j (of HD / 32) that lane group g reads from each of its key rows
template <int HD> __device__ __forceinline__ int pm8_v_dim(int g, int j) {
    if constexpr (HD >= 128) return 16 * g + 128 * (j >> 2) + 4 * (j & 3);
    else return 8 * g + 4 * j;
}

// the words of a V row lane group g reads: 16-byte loads at 16 g + 128 h (HD >= 128), one 8-byte load at 8 g (64)
template <int HD> __device__ __forceinline__ void pm8_v_row(const unsigned char* row, int g, unsigned* w) {
    if constexpr (HD >= 128) {
#pragma unroll
        for (int h = 0; h < HD / 128; ++h) {
            const uint4 u = *reinterpret_cast<const uint4*>(row + 16 * g + 128 * h);
            w[4 * h] = u.x;
            w[4 * h + 1] = u.y;
            w[4 * h + 2] = u.z;
            w[4 * h + 3] = u.w;
        }
    } else {
        const uint2 u = *reinterpret_cast<const uint2*>(row + 8 * g);
        w[0] = u.x;
        w[1] = u.y;
    }
}

template <int HD>
__device__ void paged_attention_mma_fp8_impl(float* part_acc, float* part_ml, const bf16_t* q, long long q_stride,
                                             const unsigned char* k_cache, const unsigned char* v_cache,
                                             const float* k_scale, const float* v_scale, const int* block_tables,
                                             int max_blocks_per_seq, const int* token_seq, const int* token_pos,
                                             int n, int kv_heads, int group, int block_size, float scale) {
    using S = PagedMmaFp8Shape<HD>;
    constexpr int KSTEPS = HD / 16, MT_O = HD / 16, THREADS = PM_WARPS * 32;
    constexpr int KJ = HD / 64, VW = HD / 32;  // per lane and row: 16-byte K chunks, 4-byte V words
    constexpr int CHUNKS8 = HD / 16, ROWS8 = THREADS / CHUNKS8;
    static_assert(THREADS % CHUNKS8 == 0 && PM_BN % ROWS8 == 0 && THREADS == 2 * PM_BN, "fp8 copy layout");
    extern __shared__ __align__(16) unsigned char smem8[];
    pdl_entry();
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)S::SMEM_BYTES) __trap();  // host/kernel mismatch
    const int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    if (token >= n || kvh >= kv_heads) return;  // whole block: before any barrier
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    const int seq = token_seq[token], last = token_pos[token];
    const int per_split = (last + splits) / splits;
    const int lo = split * per_split, hi = min(last + 1, lo + per_split);
    const int n_tiles = hi > lo ? (hi - lo + PM_BN - 1) / PM_BN : 0;
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const long long row_width = (long long)kv_heads * HD;
    const float sl = scale * 1.4426950408889634f;  // scores -> exp2 domain

    // B fragments of Q^T in the K fragments' dim order: step 4 j + i covers d = 16 k_chunk(tig, j) + 4 i: b0 =
    // (q_d, q_d+2), b1 = (q_d+1, q_d+3), head g (heads past the group are zero columns)
    unsigned qb[KSTEPS][2];
    {
        const bool head_ok = g < group;
        const long long head = kvh * group + (head_ok ? g : 0);
        const unsigned* qr = (const unsigned*)(q + token * q_stride + head * HD);
#pragma unroll
        for (int j = 0; j < KJ; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int w = 8 * pm8_k_chunk<HD>(tig, j) + 2 * i;  // u32 index of (q_d, q_d+1)
                const unsigned w01 = head_ok ? qr[w] : 0u, w23 = head_ok ? qr[w + 1] : 0u;
                qb[4 * j + i][0] = prmt(w01, w23, 0x5410u);
                qb[4 * j + i][1] = prmt(w01, w23, 0x7632u);
            }
    }

    const unsigned smem_base = smem_addr(smem8);
    const unsigned ps_base = smem_base + S::P_OFFSET + warp * 16 * 8 * 2;
    const unsigned p_lane = ps_base + (unsigned)((lane & 15) * 8 * 2);
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    // copy: 16-byte chunks of e4m3 rows (HD / 16 a row), and one scale of K (threads 0..63) or V (64..127) a row
    const int r8 = threadIdx.x / CHUNKS8, c8 = (threadIdx.x % CHUNKS8) * 16;
    const unsigned char* kb8 = k_cache + (long long)kvh * HD + c8;
    const unsigned char* vb8 = v_cache + (long long)kvh * HD + c8;
    auto load_kv = [&](int t, int buf) {  // keys lo + t * PM_BN .. of this split into stage `buf`
        const int k0 = lo + t * PM_BN;
        const unsigned st = smem_base + (unsigned)(buf * S::STAGE);
#pragma unroll
        for (int i = 0; i < PM_BN / ROWS8; ++i) {
            const int r = r8 + i * ROWS8, kp = k0 + r;
            const bool valid = kp < hi;
            long long slot = 0;
            if (valid) {
                const int blk = bs_pow2 ? kp >> bs_shift : kp / block_size;
                slot = (long long)table[blk] * block_size + (kp - blk * block_size);
            }
            const unsigned so = (unsigned)(r * S::LDB + c8);
            cp_async16(st + so, kb8 + slot * row_width, valid ? 16 : 0);  // rows past hi: zeros (a NaN-free V)
            cp_async16(st + S::RAW_TILE + so, vb8 + slot * row_width, valid ? 16 : 0);
        }
        const int r = threadIdx.x % PM_BN, kp = k0 + r;
        const bool valid = kp < hi;
        long long row = 0;
        if (valid) {
            const int blk = bs_pow2 ? kp >> bs_shift : kp / block_size;
            row = ((long long)table[blk] * block_size + (kp - blk * block_size)) * kv_heads + kvh;
        }
        const float* src = threadIdx.x < PM_BN ? k_scale : v_scale;
        cp_async4(st + (unsigned)(2 * S::RAW_TILE + threadIdx.x * 4), src + row, valid ? 4 : 0);
    };

    // this lane's rows in a stage: K keys warp * 16 + g and + 8; V keys warp * 16 + tig + 4 c (c = 0..3)
    const int k_row_a = (warp * 16 + g) * S::LDB, k_row_b = k_row_a + 8 * S::LDB;
    const int v_row = (warp * 16 + tig) * S::LDB;
    const int p_row = ((g & 3) << 1) | (g >> 2);  // k index of key g in the V fragments (key g + 8: p_row + 8)

    float o[MT_O][4];
#pragma unroll
    for (int mt = 0; mt < MT_O; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;  // heads 2 tig and 2 tig + 1 (scaled dot units)

#pragma unroll
    for (int t = 0; t < PM8_STAGES - 1; ++t) {
        if (t < n_tiles) load_kv(t, t);
        cp_async_commit();  // empty groups keep the count uniform
    }
    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<PM8_STAGES - 2>();  // tile t has landed (for this thread) ...
        __syncthreads();                  // ... for every thread, and stage (t - 1) % STAGES is free again
        if (t + PM8_STAGES - 1 < n_tiles) load_kv(t + PM8_STAGES - 1, (t + PM8_STAGES - 1) % PM8_STAGES);
        cp_async_commit();
        const unsigned char* st = smem8 + (t % PM8_STAGES) * S::STAGE;
        const float* k_sc = reinterpret_cast<const float*>(st + 2 * S::RAW_TILE);
        const float* v_sc = k_sc + PM_BN;

        float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // two chains of mma
#pragma unroll
        for (int j = 0; j < KJ; ++j) {
            const int c = 16 * pm8_k_chunk<HD>(tig, j);
            const uint4 ua = *reinterpret_cast<const uint4*>(st + k_row_a + c);
            const uint4 ub = *reinterpret_cast<const uint4*>(st + k_row_b + c);
            const unsigned wa[4] = {ua.x, ua.y, ua.z, ua.w}, wb[4] = {ub.x, ub.y, ub.z, ub.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                unsigned a[4];
                e4m3x4_to_bf16x2(wa[i], a[0], a[2]);  // key g: dims (d, d+2) | (d+1, d+3)
                e4m3x4_to_bf16x2(wb[i], a[1], a[3]);  // key g + 8
                mma_bf16((i & 1) ? sb : sa, a, qb[4 * j + i][0], qb[4 * j + i][1]);
            }
        }
        // lane (g, tig): keys g and g + 8 of the warp's 16, heads 2 tig (s0, s2) and 2 tig + 1 (s1, s3)
        const int key_a = lo + t * PM_BN + warp * 16 + g;
        const bool va = key_a < hi, vb = key_a + 8 < hi;
        const float ks_a = k_sc[warp * 16 + g], ks_b = k_sc[warp * 16 + g + 8];
        const float s0 = va ? (sa[0] + sb[0]) * ks_a : NEG_INF, s1 = va ? (sa[1] + sb[1]) * ks_a : NEG_INF;
        const float s2 = vb ? (sa[2] + sb[2]) * ks_b : NEG_INF, s3 = vb ? (sa[3] + sb[3]) * ks_b : NEG_INF;
        float mx0 = fmaxf(m0, fmaxf(s0, s2)), mx1 = fmaxf(m1, fmaxf(s1, s3));
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {  // over the 8 groups: the warp's 16 keys
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float base0 = mx0 == NEG_INF ? 0.0f : mx0 * sl, base1 = mx1 == NEG_INF ? 0.0f : mx1 * sl;
        const float corr0 = exp2_ftz(m0 * sl - base0), corr1 = exp2_ftz(m1 * sl - base1);  // 0 while m = -inf
        m0 = mx0;
        m1 = mx1;
        const float p0 = exp2_ftz(fmaf(s0, sl, -base0)), p1 = exp2_ftz(fmaf(s1, sl, -base1));
        const float p2 = exp2_ftz(fmaf(s2, sl, -base0)), p3 = exp2_ftz(fmaf(s3, sl, -base1));
        l0 = l0 * corr0 + p0 + p2;
        l1 = l1 * corr1 + p1 + p3;
        // P'^T [k index][head] = bf16(p * v_scale[key]) through shared memory, back as the B fragment
        const float vs_a = v_sc[warp * 16 + g], vs_b = v_sc[warp * 16 + g + 8];
        __syncwarp();
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ps_base + (unsigned)((p_row * 8 + 2 * tig) * 2)),
                     "r"(pack_bf16(p0 * vs_a, p1 * vs_a)) : "memory");
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ps_base + (unsigned)(((p_row + 8) * 8 + 2 * tig) * 2)),
                     "r"(pack_bf16(p2 * vs_b, p3 * vs_b)) : "memory");
        __syncwarp();
        unsigned pb[2];
        ldsm_x2_trans(pb, p_lane);
        unsigned w0[VW], w1[VW], w2[VW], w3[VW];  // V keys tig, tig + 4, tig + 8, tig + 12
        pm8_v_row<HD>(st + S::RAW_TILE + v_row, g, w0);
        pm8_v_row<HD>(st + S::RAW_TILE + v_row + 4 * S::LDB, g, w1);
        pm8_v_row<HD>(st + S::RAW_TILE + v_row + 8 * S::LDB, g, w2);
        pm8_v_row<HD>(st + S::RAW_TILE + v_row + 12 * S::LDB, g, w3);
#pragma unroll
        for (int mt = 0; mt < MT_O; ++mt) {  // O^T m-tile mt: rows g, g + 8 = dims v_dim(g, mt / 2) + 2 (mt & 1) + 0, 1
            const int j = mt >> 1;
            const unsigned sel = (mt & 1) ? 0x7632u : 0x5410u;  // bytes 0, 1 or 2, 3 of the two keys' words
            unsigned a[4];
            e4m3x4_to_bf16x2(prmt(w0[j], w1[j], sel), a[0], a[1]);  // k 2 tig, 2 tig + 1: dims d | d + 1
            e4m3x4_to_bf16x2(prmt(w2[j], w3[j], sel), a[2], a[3]);  // k 2 tig + 8, 2 tig + 9
            o[mt][0] *= corr0;
            o[mt][1] *= corr1;
            o[mt][2] *= corr0;
            o[mt][3] *= corr1;
            mma_bf16(o[mt], a, pb[0], pb[1]);
        }
    }
    pm_merge_write<HD, 1>(smem8, o, m0, m1, l0, l1, [=](int mt) { return pm8_v_dim<HD>(g, mt >> 1) + 2 * (mt & 1); },
                          warp, g, tig, part_acc, part_ml, token, kvh, kv_heads, group, split, splits, sl, scale);
}
