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

// wgmma shared-memory descriptor, no swizzle: start address, leading and stride byte offsets (all >> 4).
__device__ __forceinline__ unsigned long long vw_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}

__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Operand lists and asm bodies of the warpgroup MMAs. Each body fences, issues its k-steps and commits one group;
// the functions below either end the same asm statement with wait_group 0 (WAIT: the phase is synchronous, the
// compiler cannot touch its registers while it runs; wg64, wg64s) or return with the group in flight (wg64p: the
// caller waits with vw_wait<N> on the accumulators, which are fenced as asm operands so they are not moved across).
#define VW_S_OPS(s) \
    "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]), \
    "+f"(s[1][3]), "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]), \
    "+f"(s[3][2]), "+f"(s[3][3]), "+f"(s[4][0]), "+f"(s[4][1]), "+f"(s[4][2]), "+f"(s[4][3]), "+f"(s[5][0]), \
    "+f"(s[5][1]), "+f"(s[5][2]), "+f"(s[5][3]), "+f"(s[6][0]), "+f"(s[6][1]), "+f"(s[6][2]), "+f"(s[6][3]), \
    "+f"(s[7][0]), "+f"(s[7][1]), "+f"(s[7][2]), "+f"(s[7][3])
#define VW_O_OPS(o) \
    "+f"(o[0][0]), "+f"(o[0][1]), "+f"(o[0][2]), "+f"(o[0][3]), "+f"(o[1][0]), "+f"(o[1][1]), "+f"(o[1][2]), \
    "+f"(o[1][3]), "+f"(o[2][0]), "+f"(o[2][1]), "+f"(o[2][2]), "+f"(o[2][3]), "+f"(o[3][0]), "+f"(o[3][1]), \
    "+f"(o[3][2]), "+f"(o[3][3]), "+f"(o[4][0]), "+f"(o[4][1]), "+f"(o[4][2]), "+f"(o[4][3]), "+f"(o[5][0]), \
    "+f"(o[5][1]), "+f"(o[5][2]), "+f"(o[5][3]), "+f"(o[6][0]), "+f"(o[6][1]), "+f"(o[6][2]), "+f"(o[6][3]), \
    "+f"(o[7][0]), "+f"(o[7][1]), "+f"(o[7][2]), "+f"(o[7][3]), "+f"(o[8][0]), "+f"(o[8][1]), "+f"(o[8][2]), \
    "+f"(o[8][3])
#define VW_Q_OPS(q) \
    "r"(q[0][0]), "r"(q[0][1]), "r"(q[0][2]), "r"(q[0][3]), "r"(q[1][0]), "r"(q[1][1]), "r"(q[1][2]), "r"(q[1][3]), \
    "r"(q[2][0]), "r"(q[2][1]), "r"(q[2][2]), "r"(q[2][3]), "r"(q[3][0]), "r"(q[3][1]), "r"(q[3][2]), "r"(q[3][3]), \
    "r"(q[4][0]), "r"(q[4][1]), "r"(q[4][2]), "r"(q[4][3])
#define VW_P_OPS(p) \
    "r"(p[0][0]), "r"(p[0][1]), "r"(p[0][2]), "r"(p[0][3]), "r"(p[1][0]), "r"(p[1][1]), "r"(p[1][2]), "r"(p[1][3]), \
    "r"(p[2][0]), "r"(p[2][1]), "r"(p[2][2]), "r"(p[2][3]), "r"(p[3][0]), "r"(p[3][1]), "r"(p[3][2]), "r"(p[3][3])
#define VW_KD_OPS(kd) "l"(kd[0]), "l"(kd[1]), "l"(kd[2]), "l"(kd[3]), "l"(kd[4])
#define VW_VD_OPS(vd) "l"(vd[0]), "l"(vd[1]), "l"(vd[2]), "l"(vd[3])

// s = Q K^T for this warpgroup's 64 rows x 64 keys (the first k-step overwrites s: scale-d false); Q from registers
#define VW_QK_RS_BODY \
    "{\n.reg .pred zero, one;\n" \
    "setp.ne.b32 zero, %57, 0;\n" \
    "setp.eq.b32 one, %57, 0;\n" \
    "wgmma.fence.sync.aligned;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "{%32,%33,%34,%35}, %52, zero, 1, 1, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "{%36,%37,%38,%39}, %53, one, 1, 1, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "{%40,%41,%42,%43}, %54, one, 1, 1, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "{%44,%45,%46,%47}, %55, one, 1, 1, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "{%48,%49,%50,%51}, %56, one, 1, 1, 0;\n" \
    "wgmma.commit_group.sync.aligned;\n"

// the same with Q from shared memory (A descriptors, K-major like K: imm-trans-a 0)
#define VW_QK_SS_BODY \
    "{\n.reg .pred zero, one;\n" \
    "setp.ne.b32 zero, %42, 0;\n" \
    "setp.eq.b32 one, %42, 0;\n" \
    "wgmma.fence.sync.aligned;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "%32, %37, zero, 1, 1, 0, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "%33, %38, one, 1, 1, 0, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "%34, %39, one, 1, 1, 0, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "%35, %40, one, 1, 1, 0, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
    "%36, %41, one, 1, 1, 0, 0;\n" \
    "wgmma.commit_group.sync.aligned;\n"

// o += P V for this warpgroup's 64 rows x 72 dims over 64 keys (P from registers)
#define VW_PV_BODY \
    "{\n.reg .pred zero, one;\n" \
    "setp.ne.b32 zero, %56, 0;\n" \
    "setp.eq.b32 one, %56, 0;\n" \
    "wgmma.fence.sync.aligned;\n" \
    "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, " \
    "{%36,%37,%38,%39}, %52, one, 1, 1, 1;\n" \
    "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, " \
    "{%40,%41,%42,%43}, %53, one, 1, 1, 1;\n" \
    "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, " \
    "{%44,%45,%46,%47}, %54, one, 1, 1, 1;\n" \
    "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, " \
    "{%48,%49,%50,%51}, %55, one, 1, 1, 1;\n" \
    "wgmma.commit_group.sync.aligned;\n"

template <bool WAIT = true>
__device__ __forceinline__ void vw_qk(float (&s)[8][4], const unsigned (&q)[5][4], const unsigned long long (&kd)[5]) {
    if constexpr (WAIT)
        asm volatile(VW_QK_RS_BODY "wgmma.wait_group.sync.aligned 0;\n}\n"
                     : VW_S_OPS(s) : VW_Q_OPS(q), VW_KD_OPS(kd), "r"(0) : "memory");
    else
        asm volatile(VW_QK_RS_BODY "}\n" : VW_S_OPS(s) : VW_Q_OPS(q), VW_KD_OPS(kd), "r"(0) : "memory");
}

// issue-only (the pipelined kernel waits itself)
__device__ __forceinline__ void vw_qk_ss(float (&s)[8][4], const unsigned long long (&qd)[5],
                                         const unsigned long long (&kd)[5]) {
    asm volatile(VW_QK_SS_BODY "}\n" : VW_S_OPS(s) : VW_KD_OPS(qd), VW_KD_OPS(kd), "r"(0) : "memory");
}

template <bool WAIT = true>
__device__ __forceinline__ void vw_pv(float (&o)[9][4], const unsigned (&p)[4][4], const unsigned long long (&vd)[4]) {
    if constexpr (WAIT)
        asm volatile(VW_PV_BODY "wgmma.wait_group.sync.aligned 0;\n}\n"
                     : VW_O_OPS(o) : VW_P_OPS(p), VW_VD_OPS(vd), "r"(0) : "memory");
    else
        asm volatile(VW_PV_BODY "}\n" : VW_O_OPS(o) : VW_P_OPS(p), VW_VD_OPS(vd), "r"(0) : "memory");
}

// Registers an in-flight wgmma reads or writes, "touched" by an empty asm: the compiler keeps them where they are
// across the issue .. wait window (CUTLASS's warpgroup_fence_operand).
template <int R>
__device__ __forceinline__ void vw_fence_operand(float (&a)[R][4]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(a[r][c])::"memory");
}
template <int R>
__device__ __forceinline__ void vw_fence_operand(unsigned (&a)[R][4]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+r"(a[r][c])::"memory");
}

// until at most N of this warpgroup's committed wgmma groups are still in flight
template <int N> __device__ __forceinline__ void vw_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
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
// After the key loop: a warp's 16 rows (ra = its first + g, and ra + 8) normalised by their sums and stored as bf16
// (rows past the segment skipped); o: the m64nHD accumulator's NT_O n-tiles of this lane.
template <int HD>
__device__ __forceinline__ void vw_store_rows(const float (&o)[HD / 8][4], float l_a, float l_b, int ra, int seg_len,
                                              long long seg_first, bf16_t* out, long long width, int h, int tig) {
    softmax_row_sums(l_a, l_b);
    const int rb = ra + 8;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        if ((half ? rb : ra) >= seg_len) continue;
        const long long tok = seg_first + (half ? rb : ra);
        const float inv_l = 1.0f / (half ? l_b : l_a);
        unsigned* oh = (unsigned*)(out + tok * width + (long long)h * HD);
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt)
            oh[(nt * 8 + tig * 2) >> 1] = pack_bf16(o[nt][half * 2] * inv_l, o[nt][half * 2 + 1] * inv_l);
    }
}

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

// s (scores of one key tile) -> exp2(s sl - base) in place; the rows' running max m and sums l advanced; corr: the
// factor O still needs (applied once the in-flight P V has retired). The first tile's max is finite (key 0 is in
// it), so m = -inf only makes corr 0.
template <int NT_S>
__device__ __forceinline__ void vw_softmax_in_place(float (&s)[NT_S][4], float sl, float& m_a, float& m_b, float& l_a,
                                                    float& l_b, float& corr_a, float& corr_b) {
    float mx_a, mx_b;
    softmax_row_max(s, m_a, m_b, mx_a, mx_b);
    const float base_a = mx_a * sl, base_b = mx_b * sl;
    corr_a = exp2_ftz(m_a * sl - base_a);
    corr_b = exp2_ftz(m_b * sl - base_b);
    m_a = mx_a;
    m_b = mx_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
        s[nt][0] = exp2_ftz(fmaf(s[nt][0], sl, -base_a));
        s[nt][1] = exp2_ftz(fmaf(s[nt][1], sl, -base_a));
        s[nt][2] = exp2_ftz(fmaf(s[nt][2], sl, -base_b));
        s[nt][3] = exp2_ftz(fmaf(s[nt][3], sl, -base_b));
        sum_a += s[nt][0] + s[nt][1];
        sum_b += s[nt][2] + s[nt][3];
    }
    l_a = l_a * corr_a + sum_a;
    l_b = l_b * corr_b + sum_b;
}

// probabilities (fp32, score layout) -> the bf16 A fragments of P V, packed as softmax_p_fragment does (wg64)
template <int NT_S>
__device__ __forceinline__ void vw_pack_p(const float (&s)[NT_S][4], unsigned (&pf)[NT_S / 2][4]) {
#pragma unroll
    for (int k2 = 0; k2 < NT_S / 2; ++k2)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            pf[k2][half * 2 + 0] = pack_bf16(s[2 * k2 + half][0], s[2 * k2 + half][1]);
            pf[k2][half * 2 + 1] = pack_bf16(s[2 * k2 + half][2], s[2 * k2 + half][3]);
        }
}

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
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
            o[nt][0] *= corr_a;
            o[nt][1] *= corr_a;
            o[nt][2] *= corr_b;
            o[nt][3] *= corr_b;
        }
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
