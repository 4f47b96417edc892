// docpipe: arch-specific target
// The vision tower's fused segment attention on Hopper's warpgroup MMA (wgmma, sm_90a): the same function as
// vision_flash.cu (bidirectional attention inside consecutive segments of seg_len rows, q | k | v read in place from
// the fused qkv rows, bf16 in, fp32 accumulate, P rounded to bf16 for P V), for head_dim 72 (Qwen3.5's tower).
//
// Grid as vision_flash.cu: x = segment * tiles_per_segment + query tile of 128 rows, y = head. A block is two
// warpgroups (8 warps); warpgroup wg owns query rows [64 wg, 64 wg + 64) of the tile, warp w of it rows 16 w.. as in
// the m16 fragments (g = lane / 4, tig = lane % 4). Q stays in registers as wgmma A fragments (the mma.sync A layout,
// loaded straight from global memory; dims 72..79 are zero registers). Keys stream BN = 64 at a time through two
// shared-memory stages filled with cp.async by all 256 threads.
//
// Shared layout: "interleave" (no swizzle) core matrices of 8 rows x 16 bytes, 128 contiguous bytes each. Every
// 16-byte piece (key row r, 8-column chunk c) of K and of V lives at (r / 8) * GROUP + c * 128 + (r % 8) * 16, GROUP =
// chunks per row * 128 (K: 10 chunks, the last one the zero padding 72..79 written once per block; V: 9 chunks).
// - S = Q K^T: wgmma m64n64k16, B = K "K-major": leading byte offset (next 8 columns of K) 128, stride byte offset
//   (next 8 keys) K_GROUP; k-step kk starts 256 kk bytes in. 5 k-steps (80 = 72 padded to 16).
// - O += P V: wgmma m64n72k16, A = P from registers (the score accumulators' layout is the A fragment's, as in
//   vision_flash.cu), B = V "N-major" (imm-trans-b 1): leading byte offset (next 8 keys) V_GROUP, stride byte offset
//   (next 8 columns) 128; k-step k2 starts at 2 k2 V_GROUP. 4 k-steps (64 keys).
// Each phase is one asm statement (fence, the k-steps, commit, wait 0), so the compiler cannot touch the accumulator
// registers while the warpgroup's MMAs are in flight. Shared memory written by cp.async (generic proxy) is made
// visible to the tensor cores' async proxy by fence.proxy.async in every writing thread before the barrier.
// Keys past the segment end are zero rows with scores -inf; key tile 0 always holds the segment's first key, so the
// running max is finite from the first step (softmax_rescale<false>).
// wg64p / wg64pr (vw_attention_pipelined, below): four K | V stages, and each step's softmax overlapping the previous
// step's P V on the tensor cores (its comment says how); Q in shared memory (wg64p) or in registers (wg64pr).
#include "common.cuh"
#include "tensor_core.cuh"
#include "vision_wgmma.cuh"

#define VW_THREADS 256  // two warpgroups; vision_flash.WG_THREADS must match
#define VW_ROWS 128     // query rows per block; vision_flash.tile_rows("wg64") must match
#define VW_BN 64        // keys per step; vision_flash.VARIANTS["wg64"][1] must match
#define VW_HD 72

struct VwShape {
    static constexpr int HDP = (VW_HD + 15) / 16 * 16;          // 80: Q K^T width
    static constexpr int K_GROUP = HDP / 8 * 128;                // bytes per 8 keys of K (10 chunks)
    static constexpr int V_GROUP = VW_HD / 8 * 128;              // bytes per 8 keys of V (9 chunks)
    static constexpr int K_TILE = VW_BN / 8 * K_GROUP;
    static constexpr int STAGE = K_TILE + VW_BN / 8 * V_GROUP;  // one K tile + one V tile
    static constexpr int SMEM_BYTES = 2 * STAGE;                 // must equal vision_flash.shared_bytes(72, "wg64")
    static constexpr int Q_TILE = VW_ROWS / 8 * K_GROUP;         // wg64p: the block's Q rows, laid out like K
};

// PREFETCH_AFTER_BARRIER = false (wg64, checked on the H200 in session 7): tile j + 1's copies are issued at the
// top of step j, before this thread's fence.proxy.async and the barrier, and a second barrier ends the step.
// true (wg64s, not yet run on a GPU): wait for tile j, fence, barrier, then issue tile j + 1 into the other stage
// (every warp has passed the barrier, so it is done with step j - 1, the last reader of that stage) and compute:
// one barrier a step, and the fence never has the next tile's copies in flight behind it.
template <bool PREFETCH_AFTER_BARRIER>
__device__ __forceinline__ void vw_attention(bf16_t* out, const bf16_t* qkv, int heads, int seg_len,
                                             int tiles_per_seg, float scale) {
    using S = VwShape;
    constexpr int HD = VW_HD, BN = VW_BN, KSTEPS = S::HDP / 16, NT_S = BN / 8, NT_O = HD / 8;
    extern __shared__ __align__(128) bf16_t smem[];

    pdl_entry();
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)S::SMEM_BYTES) __trap();  // host/kernel mismatch

    const int h = blockIdx.y;
    const int segment = blockIdx.x / tiles_per_seg, q0 = (blockIdx.x - segment * tiles_per_seg) * VW_ROWS;
    const long long seg_first = (long long)segment * seg_len;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const long long width = (long long)heads * HD, row_stride = 3 * width;
    const float sl = scale * 1.4426950408889634f;   // scores -> exp2 domain

    const bf16_t* k_head = qkv + seg_first * row_stride + width + (long long)h * HD;
    const unsigned base = smem_addr(smem);
    const int n_kt = (seg_len + BN - 1) / BN;

    // copy slot: key row kr of every tile, chunks from kp (vw_load_kv)
    const int kr = threadIdx.x >> 2, kp = threadIdx.x & 3;
    const unsigned k_slot = (unsigned)((kr >> 3) * S::K_GROUP + (kr & 7) * 16 + kp * 128);
    const unsigned v_slot = (unsigned)(S::K_TILE + (kr >> 3) * S::V_GROUP + (kr & 7) * 16 + kp * 128);
    const bf16_t* k_src = k_head + (long long)kr * row_stride + kp * 8;   // advanced by BN rows per tile
    const long long tile_step = (long long)BN * row_stride;

    if (threadIdx.x < 2 * BN) {   // K's padded chunk 9 (columns 72..79) in both stages: zeros, once
        const int r = threadIdx.x % BN, stage = threadIdx.x / BN;
        *reinterpret_cast<uint4*>(reinterpret_cast<char*>(smem) + stage * S::STAGE + (r >> 3) * S::K_GROUP +
                                  9 * 128 + (r & 7) * 16) = make_uint4(0, 0, 0, 0);
    }
    vw_load_kv(base + k_slot, base + v_slot, kr < seg_len ? k_src : k_head, (kr < seg_len ? k_src : k_head) + width,
               kp, kr < seg_len);
    cp_async_commit();

    // Q A-fragments of this warp's 16 rows: dims kk*16 + 2*tig (+1) and +8; pairs at or past HD are the zero padding
    const int wrow = q0 + warp * 16;   // warp w of the block: rows 16 w (warpgroup w / 4 owns 64 of them)
    unsigned qa[KSTEPS][4];
    {
        const int ra = wrow + g, rb = ra + 8;
        const bool va = ra < seg_len, vb = rb < seg_len;
        const unsigned* qra = (const unsigned*)(qkv + (seg_first + (va ? ra : 0)) * row_stride + (long long)h * HD);
        const unsigned* qrb = (const unsigned*)(qkv + (seg_first + (vb ? rb : 0)) * row_stride + (long long)h * HD);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const bool lo_in = kk * 16 + 8 <= HD, hi_in = kk * 16 + 16 <= HD;   // compile-time per kk
            qa[kk][0] = va && lo_in ? qra[kk * 8 + tig] : 0u;
            qa[kk][1] = vb && lo_in ? qrb[kk * 8 + tig] : 0u;
            qa[kk][2] = va && hi_in ? qra[kk * 8 + 4 + tig] : 0u;
            qa[kk][3] = vb && hi_in ? qrb[kk * 8 + 4 + tig] : 0u;
        }
    }

    float o[NT_O][4], s[NT_S][4];
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;

    for (int j = 0; j < n_kt; ++j) {
        const int kt = j * BN, stage = j & 1;
        const auto prefetch = [&]() {   // tile j + 1 into the other stage
            const unsigned next = (unsigned)((stage ^ 1) * S::STAGE);
            k_src += tile_step;
            const bool valid = kt + BN + kr < seg_len;
            const bf16_t* src = valid ? k_src : k_head;
            vw_load_kv(base + next + k_slot, base + next + v_slot, src, src + width, kp, valid);
            cp_async_commit();
        };
        if constexpr (PREFETCH_AFTER_BARRIER) {
            cp_async_wait<0>();
        } else if (j + 1 < n_kt) {
            prefetch();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async();   // this thread's copies (and the pad zeros) -> visible to wgmma after the barrier
        __syncthreads();
        if constexpr (PREFETCH_AFTER_BARRIER) {
            if (j + 1 < n_kt) prefetch();
        }
        const unsigned k_buf = base + (unsigned)(stage * S::STAGE), v_buf = k_buf + (unsigned)S::K_TILE;

        unsigned long long kd[KSTEPS];
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) kd[kk] = vw_desc(k_buf + (unsigned)(kk * 256), 128, S::K_GROUP);
        vw_qk(s, qa, kd);

        if (kt + BN > seg_len) {   // keys past the segment end (last tile only)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (kt + nt * 8 + tig * 2 + c >= seg_len) {
                        s[nt][c] = NEG_INF;
                        s[nt][2 + c] = NEG_INF;
                    }
                }
        }
        float base_a, base_b;
        softmax_rescale<false>(s, sl, m_a, m_b, l_a, l_b, o, base_a, base_b);
        unsigned pf[BN / 16][4];
#pragma unroll
        for (int k2 = 0; k2 < BN / 16; ++k2) softmax_p_fragment(s, k2, sl, base_a, base_b, l_a, l_b, pf[k2]);
        unsigned long long vd[BN / 16];
#pragma unroll
        for (int k2 = 0; k2 < BN / 16; ++k2) vd[k2] = vw_desc(v_buf + (unsigned)(k2 * 2 * S::V_GROUP), S::V_GROUP, 128);
        vw_pv(o, pf, vd);
        if constexpr (!PREFETCH_AFTER_BARRIER) __syncthreads();   // this stage is refilled by the next copy
    }

    vw_store_rows<HD>(o, l_a, l_b, wrow + g, seg_len, seg_first, out, width, h, tig);
}

// ---- wg64p: the softmax of key tile j overlaps the tensor cores' P V of tile j - 1 (FlashAttention-3's
// intra-warpgroup pipelining). Step j: issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1}, wait for S_j only (wait_group
// 1: groups retire in order), mask and exponentiate S_j in place, wait for the P V (wait_group 0), then rescale O by
// the step's correction and pack P_j to bf16 for the next step; the last P V after the loop. Shared memory (Q_SMEM,
// wg64p): [Q tile (128 rows x 80 columns, K's core-matrix layout, zero rows past the segment and zero columns
// 72..79)][STAGES stages of K | V as in wg64]; Q is then an SS-form A operand, which frees the 20 registers that keep
// the kernel at two blocks an SM without spills. !Q_SMEM (wg64pr): Q in registers as in wg64 (RS form; ptxas spills a
// little), no Q tile. Tile t lives in stage t % STAGES and is copied DIST = STAGES - 2 steps ahead: the copy issued at
// step j (after its barrier) refills the stage of tile j - 2, whose last reader (P V of j - 2, waited in step j - 1)
// every warp has finished by then. One cp.async group is committed per step, empty past the last tile.

template <int STAGES, bool Q_SMEM>
__device__ __forceinline__ void vw_attention_pipelined(bf16_t* out, const bf16_t* qkv, int heads, int seg_len,
                                                       int tiles_per_seg, float scale) {
    using S = VwShape;
    constexpr int HD = VW_HD, BN = VW_BN, KSTEPS = S::HDP / 16, NT_S = BN / 8, NT_O = HD / 8, DIST = STAGES - 2;
    constexpr int Q_BYTES = Q_SMEM ? S::Q_TILE : 0;
    constexpr int SMEM = Q_BYTES + STAGES * S::STAGE;   // vision_flash.wg_shared_bytes(72, 64, STAGES, Q rows)
    static_assert(DIST >= 1, "a stage is refilled two steps after its tile was read");
    extern __shared__ __align__(128) bf16_t smem[];

    pdl_entry();
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)SMEM) __trap();   // host/kernel mismatch

    const int h = blockIdx.y;
    const int segment = blockIdx.x / tiles_per_seg, q0 = (blockIdx.x - segment * tiles_per_seg) * VW_ROWS;
    const long long seg_first = (long long)segment * seg_len;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int g = lane >> 2, tig = lane & 3;
    const long long width = (long long)heads * HD, row_stride = 3 * width;
    const float sl = scale * 1.4426950408889634f;   // scores -> exp2 domain

    const bf16_t* q_head = qkv + seg_first * row_stride + (long long)h * HD;
    const bf16_t* k_head = q_head + width;
    const unsigned q_buf = smem_addr(smem), stages = q_buf + (unsigned)Q_BYTES;
    const int n_kt = (seg_len + BN - 1) / BN;
    char* const smem_bytes = reinterpret_cast<char*>(smem);

    // zeros in K's padded chunk 9 (columns 72..79) of every stage, and in Q's
    for (int i = threadIdx.x; i < STAGES * BN; i += VW_THREADS) {
        const int r = i % BN, stage = i / BN;
        *reinterpret_cast<uint4*>(smem_bytes + Q_BYTES + stage * S::STAGE + (r >> 3) * S::K_GROUP + 9 * 128 +
                                  (r & 7) * 16) = make_uint4(0, 0, 0, 0);
    }
    if constexpr (Q_SMEM) {   // Q: row qr = tid / 2 of the tile, chunks qc, qc + 2, .. < 9 (zero rows past the
        // segment); odd threads zero the row's chunk 9
        const int qr = threadIdx.x >> 1, qc = threadIdx.x & 1;
        const bool valid = q0 + qr < seg_len;
        const bf16_t* src = valid ? q_head + (long long)(q0 + qr) * row_stride : q_head;
        const unsigned dst = q_buf + (unsigned)((qr >> 3) * S::K_GROUP + (qr & 7) * 16);
#pragma unroll
        for (int c = qc; c < 9; c += 2) cp_async16(dst + (unsigned)(c * 128), src + c * 8, valid ? 16 : 0);
        if (qc)
            *reinterpret_cast<uint4*>(smem_bytes + (qr >> 3) * S::K_GROUP + 9 * 128 + (qr & 7) * 16) =
                make_uint4(0, 0, 0, 0);
    }

    // copy slot: key row kr of every tile, chunks from kp (vw_load_kv); offsets inside a stage
    const int kr = threadIdx.x >> 2, kp = threadIdx.x & 3;
    const unsigned k_slot = (unsigned)((kr >> 3) * S::K_GROUP + (kr & 7) * 16 + kp * 128);
    const unsigned v_slot = (unsigned)(S::K_TILE + (kr >> 3) * S::V_GROUP + (kr & 7) * 16 + kp * 128);
    const bf16_t* k_src = k_head + (long long)kr * row_stride + kp * 8;
    const long long tile_step = (long long)BN * row_stride;
    const auto load_tile = [&](int t) {   // one commit group, empty past the last tile
        if (t < n_kt) {
            const unsigned st = stages + (unsigned)((t % STAGES) * S::STAGE);
            const bool valid = t * BN + kr < seg_len;
            const bf16_t* src = valid ? k_src + t * tile_step : k_head;
            vw_load_kv(st + k_slot, st + v_slot, src, src + width, kp, valid);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int t = 0; t < DIST; ++t) load_tile(t);   // Q rides in tile 0's group
    const auto tile_ready = [&](int j) {   // tile j (and Q, pad zeros) visible to every warpgroup's wgmma
        cp_async_wait<DIST - 1>();
        fence_proxy_async();
        __syncthreads();
        load_tile(j + DIST);
    };

    // this warpgroup's 64 Q rows as A descriptors, k-step kk 256 kk bytes in
    unsigned long long qd[KSTEPS];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
        qd[kk] = vw_desc(q_buf + (unsigned)(wg * 8 * S::K_GROUP + kk * 256), 128, S::K_GROUP);
    // or (!Q_SMEM) the A fragments of this warp's 16 rows in registers, as wg64 loads them
    unsigned qa[KSTEPS][4];
    if constexpr (!Q_SMEM) {
        const int ra = q0 + warp * 16 + g, rb = ra + 8;
        const bool va = ra < seg_len, vb = rb < seg_len;
        const unsigned* qra = (const unsigned*)(q_head + (long long)(va ? ra : 0) * row_stride);
        const unsigned* qrb = (const unsigned*)(q_head + (long long)(vb ? rb : 0) * row_stride);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const bool lo_in = kk * 16 + 8 <= HD, hi_in = kk * 16 + 16 <= HD;   // compile-time per kk
            qa[kk][0] = va && lo_in ? qra[kk * 8 + tig] : 0u;
            qa[kk][1] = vb && lo_in ? qrb[kk * 8 + tig] : 0u;
            qa[kk][2] = va && hi_in ? qra[kk * 8 + 4 + tig] : 0u;
            qa[kk][3] = vb && hi_in ? qrb[kk * 8 + 4 + tig] : 0u;
        }
    }
    const auto k_descs = [&](int j, unsigned long long (&kd)[KSTEPS]) {
        const unsigned k_buf = stages + (unsigned)((j % STAGES) * S::STAGE);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) kd[kk] = vw_desc(k_buf + (unsigned)(kk * 256), 128, S::K_GROUP);
    };
    const auto v_descs = [&](int j, unsigned long long (&vd)[BN / 16]) {
        const unsigned v_buf = stages + (unsigned)((j % STAGES) * S::STAGE + S::K_TILE);
#pragma unroll
        for (int k2 = 0; k2 < BN / 16; ++k2) vd[k2] = vw_desc(v_buf + (unsigned)(k2 * 2 * S::V_GROUP), S::V_GROUP, 128);
    };
    float o[NT_O][4], s[NT_S][4];
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f, corr_a, corr_b;
    const auto issue_qk = [&](const unsigned long long (&kd)[KSTEPS]) {   // S = Q K^T, left in flight
        if constexpr (Q_SMEM)
            vw_qk_ss(s, qd, kd);
        else
            vw_qk<false>(s, qa, kd);
    };
    const auto mask_tail = [&](int j) {   // keys past the segment end (last tile only)
        if (j * BN + BN > seg_len) {
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (j * BN + nt * 8 + tig * 2 + c >= seg_len) {
                        s[nt][c] = NEG_INF;
                        s[nt][2 + c] = NEG_INF;
                    }
                }
        }
    };

    unsigned pf[BN / 16][4];
    unsigned long long kd[KSTEPS], vd[BN / 16];

    // step 0: S_0 alone (o is still 0: no rescale)
    tile_ready(0);
    k_descs(0, kd);
    vw_fence_operand(s);
    issue_qk(kd);
    vw_wait<0>();
    vw_fence_operand(s);
    mask_tail(0);
    vw_softmax_in_place(s, sl, m_a, m_b, l_a, l_b, corr_a, corr_b);
    vw_pack_p(s, pf);

    for (int j = 1; j < n_kt; ++j) {
        tile_ready(j);
        k_descs(j, kd);
        v_descs(j - 1, vd);
        vw_fence_operand(s);
        vw_fence_operand(o);
        vw_fence_operand(pf);
        issue_qk(kd);                 // S_j
        vw_pv<false>(o, pf, vd);      // O += P_{j-1} V_{j-1}, in flight during S_j's softmax
        vw_wait<1>();                 // S_j has retired (groups retire in order)
        vw_fence_operand(s);
        mask_tail(j);
        vw_softmax_in_place(s, sl, m_a, m_b, l_a, l_b, corr_a, corr_b);
        vw_wait<0>();                 // the P V too: O and P's registers are free
        vw_fence_operand(o);
        vw_fence_operand(pf);
        scale_o_rows(o, corr_a, corr_b);
        vw_pack_p(s, pf);
    }
    v_descs(n_kt - 1, vd);
    vw_fence_operand(o);
    vw_fence_operand(pf);
    vw_pv<false>(o, pf, vd);
    vw_wait<0>();
    vw_fence_operand(o);

    vw_store_rows<HD>(o, l_a, l_b, q0 + warp * 16 + g, seg_len, seg_first, out, width, h, tig);
}

extern "C" __global__ void __launch_bounds__(VW_THREADS, 2) vision_flash_wg_bf16_hd72_n64(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vw_attention<false>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(VW_THREADS, 2) vision_flash_wg_bf16_hd72_n64_sb(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vw_attention<true>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(VW_THREADS, 2) vision_flash_wg_bf16_hd72_n64_p(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vw_attention_pipelined<4, true>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(VW_THREADS, 2) vision_flash_wg_bf16_hd72_n64_pr(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vw_attention_pipelined<4, false>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}
