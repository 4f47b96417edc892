// Tensor-core and async-copy building blocks shared by the tiled attention and chunked delta-rule kernels
// (sm_80+ PTX: cp.async, ldmatrix, mma.sync m16n8k16 bf16 with fp32 accumulate). Include after common.cuh.
// Fragment layouts follow the PTX ISA (groupID g = lane / 4, tig = lane % 4).

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte async copy global -> shared; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// c += a b (16 x 16 bf16 A fragment, 16 x 8 bf16 B fragment), fp32 accumulators
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two floats -> packed bf16 pair (lo in the low half), round to nearest even like from_f<bf16_t>, one instruction
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x in one MUFU.EX2 (ex2.approx.ftz): exp2f without fast-math adds a range test and two multiplies per call to
// keep denormal results, which the softmax does not need (a probability below 2^-126 flushes to 0, exp2(-inf) = 0).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- online softmax over mma score blocks (flash_prefill.cu, vision_flash.cu). A warp holds 16 query rows of an
// (8 * NT_S)-key score block as m16n8 accumulators s[nt][0..3]: lane rows a = lane / 4 (elements 0, 1) and
// b = a + 8 (elements 2, 3), each row spread over the 4 lanes of its group. Scores times `sl` are in the exp2 domain.

// The two rows' max (rows g and g + 8 of an m16 score fragment, over the 4 lanes of the group) of scores s and the
// running maxes m_a / m_b.
template <int NT_S>
__device__ __forceinline__ void softmax_row_max(const float (&s)[NT_S][4], float m_a, float m_b, float& mx_a,
                                                float& mx_b) {
    mx_a = m_a;
    mx_b = m_b;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
        mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {   // the 4 lanes of a group share a row
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
    }
}

// O's rows g (accumulators 0, 1 of each n-tile) and g + 8 (2, 3) scaled by the online softmax's corrections.
template <int NT_O>
__device__ __forceinline__ void scale_o_rows(float (&o)[NT_O][4], float corr_a, float corr_b) {
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) {
        o[nt][0] *= corr_a;
        o[nt][1] *= corr_a;
        o[nt][2] *= corr_b;
        o[nt][3] *= corr_b;
    }
}

// The rows' new running max m (over the group), with the sums l and the output accumulators o rescaled to it;
// base_a / base_b: what this block's probabilities subtract. ROWS_MAY_BE_EMPTY: a row that has seen no visible key
// yet keeps max -inf, and subtracts 0 instead (its p and corr are then 0).
template <bool ROWS_MAY_BE_EMPTY, int NT_S, int NT_O>
__device__ __forceinline__ void softmax_rescale(const float (&s)[NT_S][4], float sl, float& m_a, float& m_b,
                                                float& l_a, float& l_b, float (&o)[NT_O][4], float& base_a,
                                                float& base_b) {
    float mx_a, mx_b;
    softmax_row_max(s, m_a, m_b, mx_a, mx_b);
    if constexpr (ROWS_MAY_BE_EMPTY) {
        base_a = (mx_a == NEG_INF ? 0.0f : mx_a) * sl;
        base_b = (mx_b == NEG_INF ? 0.0f : mx_b) * sl;
    } else {
        base_a = mx_a * sl;
        base_b = mx_b * sl;
    }
    const float corr_a = exp2_ftz(m_a * sl - base_a), corr_b = exp2_ftz(m_b * sl - base_b);
    m_a = mx_a;
    m_b = mx_b;
    l_a *= corr_a;
    l_b *= corr_b;
    scale_o_rows(o, corr_a, corr_b);
}

// The probabilities of score n-tiles 2 k2 and 2 k2 + 1 as the bf16 A fragment of P V's k-step k2, added to the sums.
template <int NT_S>
__device__ __forceinline__ void softmax_p_fragment(const float (&s)[NT_S][4], int k2, float sl, float base_a,
                                                   float base_b, float& l_a, float& l_b, unsigned (&pf)[4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int nt = 2 * k2 + half;
        const float p0 = exp2_ftz(fmaf(s[nt][0], sl, -base_a)), p1 = exp2_ftz(fmaf(s[nt][1], sl, -base_a));
        const float p2 = exp2_ftz(fmaf(s[nt][2], sl, -base_b)), p3 = exp2_ftz(fmaf(s[nt][3], sl, -base_b));
        l_a += p0 + p1;
        l_b += p2 + p3;
        pf[half * 2 + 0] = pack_bf16(p0, p1);
        pf[half * 2 + 1] = pack_bf16(p2, p3);
    }
}

// The rows' full sums: each lane of a group held a part.
__device__ __forceinline__ void softmax_row_sums(float& l_a, float& l_b) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
    }
}

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
