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
#include "common.cuh"
#include "tensor_core.cuh"

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
};

// wgmma shared-memory descriptor, no swizzle: start address, leading and stride byte offsets (all >> 4).
__device__ __forceinline__ unsigned long long vw_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}

__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// s = Q K^T for this warpgroup's 64 rows x 64 keys (the first k-step overwrites s: scale-d false)
__device__ __forceinline__ void vw_qk(float (&s)[8][4], const unsigned (&q)[5][4], const unsigned long long (&kd)[5]) {
    asm volatile(
        "{\n.reg .pred zero, one;\n"
        "setp.ne.b32 zero, %57, 0;\n"
        "setp.eq.b32 one, %57, 0;\n"
        "wgmma.fence.sync.aligned;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %52, zero, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%36,%37,%38,%39}, %53, one, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%40,%41,%42,%43}, %54, one, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%44,%45,%46,%47}, %55, one, 1, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%48,%49,%50,%51}, %56, one, 1, 1, 0;\n"
        "wgmma.commit_group.sync.aligned;\n"
        "wgmma.wait_group.sync.aligned 0;\n}\n"
        : "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]), "+f"(s[1][3]),
          "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]), "+f"(s[3][2]), "+f"(s[3][3]),
          "+f"(s[4][0]), "+f"(s[4][1]), "+f"(s[4][2]), "+f"(s[4][3]), "+f"(s[5][0]), "+f"(s[5][1]), "+f"(s[5][2]), "+f"(s[5][3]),
          "+f"(s[6][0]), "+f"(s[6][1]), "+f"(s[6][2]), "+f"(s[6][3]), "+f"(s[7][0]), "+f"(s[7][1]), "+f"(s[7][2]), "+f"(s[7][3])
        : "r"(q[0][0]), "r"(q[0][1]), "r"(q[0][2]), "r"(q[0][3]), "r"(q[1][0]), "r"(q[1][1]), "r"(q[1][2]), "r"(q[1][3]),
          "r"(q[2][0]), "r"(q[2][1]), "r"(q[2][2]), "r"(q[2][3]), "r"(q[3][0]), "r"(q[3][1]), "r"(q[3][2]), "r"(q[3][3]),
          "r"(q[4][0]), "r"(q[4][1]), "r"(q[4][2]), "r"(q[4][3]), "l"(kd[0]), "l"(kd[1]), "l"(kd[2]), "l"(kd[3]),
          "l"(kd[4]), "r"(0)
        : "memory");
}

// o += P V for this warpgroup's 64 rows x 72 dims over 64 keys
__device__ __forceinline__ void vw_pv(float (&o)[9][4], const unsigned (&p)[4][4], const unsigned long long (&vd)[4]) {
    asm volatile(
        "{\n.reg .pred zero, one;\n"
        "setp.ne.b32 zero, %56, 0;\n"
        "setp.eq.b32 one, %56, 0;\n"
        "wgmma.fence.sync.aligned;\n"
        "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, "
        "{%36,%37,%38,%39}, %52, one, 1, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, "
        "{%40,%41,%42,%43}, %53, one, 1, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, "
        "{%44,%45,%46,%47}, %54, one, 1, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, "
        "{%48,%49,%50,%51}, %55, one, 1, 1, 1;\n"
        "wgmma.commit_group.sync.aligned;\n"
        "wgmma.wait_group.sync.aligned 0;\n}\n"
        : "+f"(o[0][0]), "+f"(o[0][1]), "+f"(o[0][2]), "+f"(o[0][3]), "+f"(o[1][0]), "+f"(o[1][1]), "+f"(o[1][2]), "+f"(o[1][3]),
          "+f"(o[2][0]), "+f"(o[2][1]), "+f"(o[2][2]), "+f"(o[2][3]), "+f"(o[3][0]), "+f"(o[3][1]), "+f"(o[3][2]), "+f"(o[3][3]),
          "+f"(o[4][0]), "+f"(o[4][1]), "+f"(o[4][2]), "+f"(o[4][3]), "+f"(o[5][0]), "+f"(o[5][1]), "+f"(o[5][2]), "+f"(o[5][3]),
          "+f"(o[6][0]), "+f"(o[6][1]), "+f"(o[6][2]), "+f"(o[6][3]), "+f"(o[7][0]), "+f"(o[7][1]), "+f"(o[7][2]), "+f"(o[7][3]),
          "+f"(o[8][0]), "+f"(o[8][1]), "+f"(o[8][2]), "+f"(o[8][3])
        : "r"(p[0][0]), "r"(p[0][1]), "r"(p[0][2]), "r"(p[0][3]), "r"(p[1][0]), "r"(p[1][1]), "r"(p[1][2]), "r"(p[1][3]),
          "r"(p[2][0]), "r"(p[2][1]), "r"(p[2][2]), "r"(p[2][3]), "r"(p[3][0]), "r"(p[3][1]), "r"(p[3][2]), "r"(p[3][3]),
          "l"(vd[0]), "l"(vd[1]), "l"(vd[2]), "l"(vd[3]), "r"(0)
        : "memory");
}

// This thread's cp.async pieces of one key tile: row kr = tid / 4 of the tile, chunks kp, kp + 4, kp + 8 (< 9) of K
// and of V (consecutive lanes read consecutive 16-byte pieces of a row). valid = false zero-fills (src not read).
__device__ __forceinline__ void vw_load_kv(unsigned k_dst, unsigned v_dst, const bf16_t* k_src, const bf16_t* v_src,
                                           int kp, bool valid) {
    const int bytes = valid ? 16 : 0;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        if (j < 2 || kp == 0) {   // chunk 8 is kp 0's third
            cp_async16(k_dst + (unsigned)(j * 4 * 128), k_src + j * 32, bytes);
            cp_async16(v_dst + (unsigned)(j * 4 * 128), v_src + j * 32, bytes);
        }
    }
}

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

    softmax_row_sums(l_a, l_b);
    const int ra = wrow + g, rb = ra + 8;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        if ((half ? rb : ra) >= seg_len) continue;
        const long long tok = seg_first + (half ? rb : ra);
        const float inv_l = 1.0f / (half ? l_b : l_a);
        unsigned* oh = (unsigned*)(out + tok * width + (long long)h * HD);
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt)
            oh[(nt * 8 + tig * 2) >> 1] = pack_bf16(o[nt][half * 2] * inv_l, o[nt][half * 2 + 1] * inv_l);
    }
}

extern "C" __global__ void __launch_bounds__(VW_THREADS, 2) vision_flash_wg_bf16_hd72_n64(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vw_attention<false>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}

extern "C" __global__ void __launch_bounds__(VW_THREADS, 2) vision_flash_wg_bf16_hd72_n64_sb(
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {
    vw_attention<true>(out, qkv, heads, seg_len, tiles_per_seg, scale);
}
