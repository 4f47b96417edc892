// The warpgroup-MMA (wgmma, sm_90a) building blocks of the vision tower's attention kernels (vision_flash_wg.cu,
// vision_flash_ws.cu): shared-memory descriptors, the m64 Q K^T / P V bodies for head_dim 72 (80 padded), operand
// fences and waits, a key row's cp.async pieces, the in-place online softmax and the bf16 packing of P, the
// normalised row store. Include after common.cuh and tensor_core.cuh. Layouts: vision_flash_wg.cu's header.

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

// This warp's Q A-fragments (the mma.sync A layout: rows ra = first row + g and ra + 8, dims kk*16 + 2*tig (+1) and
// +8), loaded straight from global memory; rows past the segment and dims at or past HD are zero registers.
template <int HD, int KSTEPS>
__device__ __forceinline__ void vw_load_q(unsigned (&qa)[KSTEPS][4], const bf16_t* q_head, long long row_stride,
                                          int ra, int seg_len, int tig) {
    const int rb = ra + 8;
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
