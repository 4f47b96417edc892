// docpipe: arch-specific target
// The vision tower's segment attention (vision_flash.cu's function, head_dim 72) on Hopper's warpgroup MMA with warp
// specialisation (FlashAttention-3's structure): a block is one producer warpgroup that only copies key tiles, and
// CONSUMERS warpgroups of 64 query rows each that only compute. No block-wide barrier after the start: the stages of
// the K | V ring are handed over through mbarriers (full: the producer's copies have landed; empty: every consumer
// warp's MMAs that read the stage have retired), so a consumer's softmax never waits for the other warpgroups, and
// the producer keeps copying while they compute. setmaxnreg moves registers from the producer to the consumers.
//
// Grid as vision_flash_wg.cu: x = segment * tiles_per_segment + query tile of 64 * CONSUMERS rows, y = head.
// Shared layout, descriptors, Q K^T and P V bodies: vision_flash_wg.cu's (vision_wgmma.cuh); BN = 128 keys run as
// two m64n64 halves for Q K^T and two 64-key P V groups. Each consumer step is wg64pr's (Q in registers, RS form):
// issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1}, wait for S_j, its softmax while the P V runs, wait for the P V,
// release stage j - 1, rescale O, pack P_j.
// Producer: tile t goes to stage t % STAGES once the consumers released tile t - STAGES; after issuing tile t it waits
// for its own copies of tile t - 1, fences them for the async proxy and arrives on full[t - 1] (two tiles in flight,
// hence STAGES >= 3: tile t - STAGES is released in consumer step t - STAGES + 1, which needs tile t - 2 only).
#include "common.cuh"
#include "tensor_core.cuh"
#include "vision_wgmma.cuh"
#include "mbarrier.cuh"

#define VS_HD 72
// setmaxnreg per warpgroup role: 128 x producer + CONSUMERS x 128 x consumer <= 65,536 registers
template <int CONSUMERS> struct VsRegs {
    static constexpr int PRODUCER = CONSUMERS == 2 ? 40 : CONSUMERS == 3 ? 32 : 24;
    static constexpr int CONSUMER = CONSUMERS == 2 ? 232 : CONSUMERS == 3 ? 160 : 120;
    static_assert(128 * PRODUCER + CONSUMERS * 128 * CONSUMER <= 65536, "more registers than an SM has");
};

template <int BN>
struct VsShape {
    static constexpr int HDP = (VS_HD + 15) / 16 * 16;   // 80
    static constexpr int K_GROUP = HDP / 8 * 128;         // bytes per 8 keys of K
    static constexpr int V_GROUP = VS_HD / 8 * 128;       // bytes per 8 keys of V
    static constexpr int K_TILE = BN / 8 * K_GROUP;
    static constexpr int STAGE = K_TILE + BN / 8 * V_GROUP;  // vision_flash.wg_shared_bytes(72, BN, 1)
};

// The producer warpgroup (threads 0..127): every key tile of the segment through the stage ring.
template <int CONSUMERS, int BN, int STAGES>
__device__ __forceinline__ void vs_produce(char* smem_bytes, unsigned full0, unsigned empty0, const bf16_t* k_head,
                                           long long row_stride, long long width, int seg_len, int n_kt) {
    using S = VsShape<BN>;
    const int p = threadIdx.x, kp = p & 3, r0 = p >> 2;   // rows r0 + 32 i of a tile, chunks from kp (vw_load_kv)
    const unsigned stages = smem_addr(smem_bytes);
    for (int i = p; i < STAGES * BN; i += 128) {   // K's padded chunk 9 (columns 72..79) of every stage: zeros
        const int r = i % BN, st = i / BN;
        *reinterpret_cast<uint4*>(smem_bytes + st * S::STAGE + (r >> 3) * S::K_GROUP + 9 * 128 + (r & 7) * 16) =
            make_uint4(0, 0, 0, 0);
    }
    for (int t = 0; t < n_kt; ++t) {
        const int st = t % STAGES;
        if (t >= STAGES) mbar_wait(empty0 + 8 * st, (unsigned)(t / STAGES - 1) & 1u);
        const unsigned base = stages + (unsigned)(st * S::STAGE);
#pragma unroll
        for (int i = 0; i < BN / 32; ++i) {
            const int r = r0 + 32 * i, key = t * BN + r;
            const bool valid = key < seg_len;
            const bf16_t* src = valid ? k_head + (long long)key * row_stride + kp * 8 : k_head;
            vw_load_kv(base + (unsigned)((r >> 3) * S::K_GROUP + (r & 7) * 16 + kp * 128),
                       base + (unsigned)(S::K_TILE + (r >> 3) * S::V_GROUP + (r & 7) * 16 + kp * 128), src,
                       src + width, kp, valid);
        }
        cp_async_commit();
        if (t >= 1) {   // tile t - 1 (this thread's part) has landed: make it the tensor cores' to read
            cp_async_wait<1>();
            fence_proxy_async();
            mbar_arrive(full0 + 8 * ((t - 1) % STAGES));
        }
    }
    cp_async_wait<0>();
    fence_proxy_async();
    mbar_arrive(full0 + 8 * ((n_kt - 1) % STAGES));
}

// A consumer warpgroup (c = 0 .. CONSUMERS - 1): query rows q0 + 64 c .. + 64 over every key tile. Q_SMEM: its Q rows
// go to its own part of shared memory at q_buf (K's layout, zero columns 72..79 and rows past the segment) and Q K^T
// takes them as an SS-form operand (wg64p's), which frees the 20 registers of the A fragments.
template <int CONSUMERS, int BN, int STAGES, bool Q_SMEM>
__device__ __forceinline__ void vs_consume(int c, unsigned stages, unsigned q_buf, unsigned full0, unsigned empty0,
                                           bf16_t* out,
                                           const bf16_t* q_head, long long row_stride, long long width, int h,
                                           int q0, int seg_len, long long seg_first, int n_kt, float scale) {
    using S = VsShape<BN>;
    constexpr int HD = VS_HD, KSTEPS = S::HDP / 16, NH = BN / 64, NT_S = BN / 8, NT_O = HD / 8;
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, tig = lane & 3;
    const int row0 = q0 + 64 * c + 16 * w;   // this warp's first row (m64 fragment rows 16 w + g, + 8)
    const float sl = scale * 1.4426950408889634f;   // scores -> exp2 domain

    unsigned qa[KSTEPS][4];   // !Q_SMEM: Q A-fragments (dims 72..79 zero), as wg64 loads them
    unsigned long long qd[KSTEPS];   // Q_SMEM: its descriptors, k-step kk 256 kk bytes in
    if constexpr (Q_SMEM) {
        const int t = threadIdx.x & 127;
        char* const q_bytes = reinterpret_cast<char*>(__cvta_shared_to_generic(q_buf));
        for (int i = t; i < 64 * 10; i += 128) {   // row r, chunk ch (9: the zero padding)
            const int r = i / 10, ch = i - r * 10, row = q0 + 64 * c + r;
            const unsigned off = (unsigned)((r >> 3) * S::K_GROUP + ch * 128 + (r & 7) * 16);
            if (ch == 9) {
                *reinterpret_cast<uint4*>(q_bytes + off) = make_uint4(0, 0, 0, 0);
            } else {
                const bool valid = row < seg_len;
                cp_async16(q_buf + off, q_head + (long long)(valid ? row : 0) * row_stride + ch * 8, valid ? 16 : 0);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");   // this warpgroup's Q rows written
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) qd[kk] = vw_desc(q_buf + (unsigned)(kk * 256), 128, S::K_GROUP);
    } else {
        vw_load_q<HD, KSTEPS>(qa, q_head, row_stride, row0 + g, seg_len, tig);
    }
    float o[NT_O][4], s[NT_S][4];
    unsigned pf[NT_S / 2][4];
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f, corr_a, corr_b;

    const auto issue_qk = [&](int j) {   // NH groups: S_j's 64-key halves
        const unsigned k_buf = stages + (unsigned)((j % STAGES) * S::STAGE);
#pragma unroll
        for (int half = 0; half < NH; ++half) {
            unsigned long long kd[KSTEPS];
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
                kd[kk] = vw_desc(k_buf + (unsigned)(half * 8 * S::K_GROUP + kk * 256), 128, S::K_GROUP);
            if constexpr (Q_SMEM)
                vw_qk_ss(*reinterpret_cast<float(*)[8][4]>(&s[8 * half][0]), qd, kd);
            else
                vw_qk<false>(*reinterpret_cast<float(*)[8][4]>(&s[8 * half][0]), qa, kd);
        }
    };
    const auto issue_pv = [&](int j) {   // NH groups: O += P_j V_j over the two 64-key halves
        const unsigned v_buf = stages + (unsigned)((j % STAGES) * S::STAGE + S::K_TILE);
#pragma unroll
        for (int half = 0; half < NH; ++half) {
            unsigned long long vd[4];
#pragma unroll
            for (int k2 = 0; k2 < 4; ++k2)
                vd[k2] = vw_desc(v_buf + (unsigned)((half * 8 + k2 * 2) * S::V_GROUP), S::V_GROUP, 128);
            vw_pv<false>(o, *reinterpret_cast<unsigned(*)[4][4]>(&pf[4 * half][0]), vd);
        }
    };
    const auto mask_tail = [&](int j) {   // keys past the segment end (last tile only)
        if (j * BN + BN > seg_len) {
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (j * BN + nt * 8 + tig * 2 + e >= seg_len) {
                        s[nt][e] = NEG_INF;
                        s[nt][2 + e] = NEG_INF;
                    }
                }
        }
    };

    // step 0: S_0 alone (o is still 0: no rescale); tile 0 holds key 0, so the running max is finite from here
    mbar_wait(full0, 0u);
    vw_fence_operand(s);
    issue_qk(0);
    vw_wait<0>();
    vw_fence_operand(s);
    mask_tail(0);
    vw_softmax_in_place(s, sl, m_a, m_b, l_a, l_b, corr_a, corr_b);
    vw_pack_p(s, pf);

    for (int j = 1; j < n_kt; ++j) {
        mbar_wait(full0 + 8 * (j % STAGES), (unsigned)(j / STAGES) & 1u);
        vw_fence_operand(s);
        vw_fence_operand(o);
        vw_fence_operand(pf);
        issue_qk(j);                 // S_j
        issue_pv(j - 1);             // O += P_{j-1} V_{j-1}, in flight during S_j's softmax
        vw_wait<NH>();               // S_j has retired (groups retire in order)
        vw_fence_operand(s);
        mask_tail(j);
        vw_softmax_in_place(s, sl, m_a, m_b, l_a, l_b, corr_a, corr_b);
        vw_wait<0>();                // the P V too: O and P's registers, and stage j - 1, are free
        vw_fence_operand(o);
        vw_fence_operand(pf);
        if (lane == 0) mbar_arrive(empty0 + 8 * ((j - 1) % STAGES));
        scale_o_rows(o, corr_a, corr_b);
        vw_pack_p(s, pf);
    }
    vw_fence_operand(o);
    vw_fence_operand(pf);
    issue_pv(n_kt - 1);
    vw_wait<0>();
    vw_fence_operand(o);

    vw_store_rows<HD>(o, l_a, l_b, row0 + g, seg_len, seg_first, out, width, h, tig);
}

template <int CONSUMERS, int BN, int STAGES, bool Q_SMEM>
__device__ __forceinline__ void vs_attention(bf16_t* out, const bf16_t* qkv, int heads, int seg_len,
                                             int tiles_per_seg, float scale) {
    using S = VsShape<BN>;
    static_assert(STAGES >= 3, "the producer keeps two tiles in flight (see the header)");
    static_assert(BN == 64 || BN == 128, "key tiles run as 64-key wgmma halves");
    extern __shared__ __align__(128) bf16_t smem[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];   // full[STAGES], then empty[STAGES]

    pdl_entry();
    constexpr int Q_PART = Q_SMEM ? 8 * S::K_GROUP : 0;   // a consumer's 64 Q rows, after the stages
    // host/kernel mismatch: vision_flash.wg_shared_bytes(72, BN, STAGES, Q rows)
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)(STAGES * S::STAGE + CONSUMERS * Q_PART)) __trap();

    const int h = blockIdx.y, wg = threadIdx.x >> 7;
    const int segment = blockIdx.x / tiles_per_seg, q0 = (blockIdx.x - segment * tiles_per_seg) * 64 * CONSUMERS;
    const long long seg_first = (long long)segment * seg_len;
    const long long width = (long long)heads * VS_HD, row_stride = 3 * width;
    const bf16_t* q_head = qkv + seg_first * row_stride + (long long)h * VS_HD;
    const unsigned stages = smem_addr(smem), full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;
    const int n_kt = (seg_len + BN - 1) / BN;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(full0 + 8 * st, 128);              // every producer thread, once its copies landed
            mbar_init(empty0 + 8 * st, 4 * CONSUMERS);   // lane 0 of every consumer warp
        }
    }
    __syncthreads();   // the barriers initialised before anyone arrives; the last block-wide barrier

    if (wg == 0) {
        setmaxnreg_dec<VsRegs<CONSUMERS>::PRODUCER>();
        vs_produce<CONSUMERS, BN, STAGES>(reinterpret_cast<char*>(smem), full0, empty0, q_head + width, row_stride,
                                          width, seg_len, n_kt);
    } else {
        setmaxnreg_inc<VsRegs<CONSUMERS>::CONSUMER>();
        vs_consume<CONSUMERS, BN, STAGES, Q_SMEM>(wg - 1, stages, stages + STAGES * S::STAGE + (wg - 1) * Q_PART,
                                                  full0, empty0, out, q_head, row_stride, width, h, q0,
                                          seg_len, seg_first, n_kt, scale);
    }
}

// name: consumers, keys per step (vision_flash.WS_VARIANTS); threads 128 (1 + consumers); shared STAGES stages
extern "C" __global__ void __launch_bounds__(384, 1) vision_flash_ws_bf16_hd72_c2_n128(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vs_attention<2, 128, 3, false>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(384, 1) vision_flash_ws_bf16_hd72_c2_n64(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vs_attention<2, 64, 4, false>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) vision_flash_ws_bf16_hd72_c3_n64(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vs_attention<3, 64, 4, false>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) vision_flash_ws_bf16_hd72_c3_n128_q(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vs_attention<3, 128, 3, true>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(512, 1) vision_flash_ws_bf16_hd72_c3_n64_q(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vs_attention<3, 64, 4, true>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(640, 1) vision_flash_ws_bf16_hd72_c4_n64_q(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vs_attention<4, 64, 4, true>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}
