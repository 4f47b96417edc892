// Chunked (WY-form) gated delta rule for bf16 prefill, on the tensor cores (mma.sync m16n8k16, fp32 accumulate).
// Same function, inputs and state layout as gated_delta_rule in deltanet.cu (read its header for the math and the
// varlen conventions); tests/cuda_runner/chunked_delta_emulation.py is this file's algorithm in numpy, step by step.
//
// Chunks of GC_C = 64 tokens. Chunk slots: chunk c of sequence s lives in slot floor(cu[s] / 64) + s + c (disjoint
// across sequences, fewer than tokens / 64 + seqs in all), so neither kernel needs a host-built table.
//
// gdn_chunk_prep (grid: chunk slots x value heads; fully parallel). Within the chunk, with G the cumulative sum of
//   g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), q/k L2-normalised (q also / sqrt(dk)):
//     A  = strictly-lower(beta_i e^(G_i - G_j) k_i.k_j)        T = (I + A)^-1 (forward substitution, fp32)
//     W  = T diag(beta e^G) K          U  = T diag(beta) V       Qd = diag(e^G) Q
//     Kd = diag(e^(G_last - G)) K (stored transposed)           P  = lower-incl(q_i.k_j e^(G_i - G_j))
//     gc = e^(G_last)
//   Every exponent is <= 0. Rows past a partial chunk's end are zero (g = 0, beta = 0), so they add nothing.
// gdn_chunk_scan (grid: dv slices of GC_SLICE = 32 x value heads x sequences; sequential over the sequence's chunks;
//   gdn_chunk_scan16 is the same with 16-column slices, for grids that would leave SMs idle). The fp32
//   state S^T [dv, dk] lives in registers (4 warps, each 16*DK/64 dk rows of the slice); per chunk:
//     V' = U - W S        O = Qd S + P V'        S = gc S + Kd^T V'
//   with S and V' rounded to bf16 only as tensor-core operands (shared memory).
// Fragment layouts follow the PTX ISA for m16n8k16 (groupID g = lane / 4, tig = lane % 4): A regs {(g, 2tig),
// (g+8, 2tig), (g, 2tig+8), (g+8, 2tig+8)}, B regs {k 2tig.., k 2tig+8..} of column g, C {(g, 2tig..), (g+8, 2tig..)};
// the lower k (or column) index sits in the low 16 bits of a packed pair.
//
// The "states" variant (deltanet_chunked.VARIANTS; DOCPIPE_CUDA_DELTANET_CHUNKED=states) splits the scan as fla's
// chunk_gated_delta_rule does: gdn_chunk_states walks the chunks carrying only the state and stores each chunk's
// entry state Sc = bf16(S) (Sg [slot][head][dv][dk]) and V' (Vg [slot][head][dv][C], transposed); then
// gdn_chunk_output (grid: chunk slots x value heads, fully parallel) computes O = Qd Sc + P V'. Why: the scan is
// the only serial part, and per chunk gdn_chunk_scan reads W, Qd, Kd^T, P and U (56 KB a block at dk = dv = 128,
// again for every dv slice of the head) by 32-bit fragment loads straight from L2 (8 rows x 16 bytes a warp-wide
// load: half-used sectors), twice behind a barrier, so its chain is load-bound, not math-bound. The states scan
// needs only W, Kd^T and U (36 KB), takes them by coalesced 16-byte cp.async into a second shared-memory stage
// while the chunk before computes, and its chain is W Sc, a barrier, Kd^T V'. The output GEMMs (Qd S, P V') and
// the output stores leave the chain for a launch with thousands of blocks. Cost: Sc and V' go through memory
// (bf16, 48 KB per chunk and head at dk = dv = 128, written once and read once). Rounding points are those of
// gdn_chunk_scan (S and V' rounded to bf16 as tensor-core operands, fp32 accumulation in the same order: the same
// mma sequence per value), so its output and state should equal the current variant's bit for bit.
#include "common.cuh"
#include "tensor_core.cuh"

#define GC_C 64
#define GC_SLICE 32
#define GC_THREADS 128

__device__ __forceinline__ unsigned gc_pack(float lo, float hi) {
    return (unsigned)from_f<bf16_t>(lo) | ((unsigned)from_f<bf16_t>(hi) << 16);
}

__device__ __forceinline__ unsigned gc_pair(bf16_t lo, bf16_t hi) { return (unsigned)lo | ((unsigned)hi << 16); }

__device__ __forceinline__ unsigned gc_ld32(const bf16_t* p) { return *(const unsigned*)p; }

__device__ __forceinline__ void gc_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The sequence that owns chunk slot cs: the largest s with floor(cu[s] / GC_C) + s <= cs (that base increases
// strictly with s, and base(0) = 0).
__device__ __forceinline__ int gc_slot_sequence(const int* cu, int seqs, int cs) {
    int lo = 0, hi = seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu[mid] / GC_C + mid <= cs) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// One warp's 16 rows (row0 + g, row0 + g + 8 per lane) of (T diag(coef)) X on the tensor cores: T is fp32 in At
// (row stride TLD), scaled per column by coef and rounded to bf16 as the A operand; X is the first N columns of the
// bf16 rows of Xs; the product goes to dst as bf16 rows of N. Phase 3 of the chunk kernel: W (coef beta e^G, X = K)
// and U (coef beta, X = V).
template <int N, int LD, int TLD>
__device__ __forceinline__ void gc_t_product(const float* At, const float* coef, const bf16_t (*Xs)[LD], bf16_t* dst,
                                             int row0, int g, int tig) {
    float acc[N / 8][4];
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < GC_C / 16; ++ks) {
        const int c0 = 16 * ks + 2 * tig;
        const float2 x0 = *(const float2*)&At[(row0 + g) * TLD + c0];
        const float2 x1 = *(const float2*)&At[(row0 + g + 8) * TLD + c0];
        const float2 x2 = *(const float2*)&At[(row0 + g) * TLD + c0 + 8];
        const float2 x3 = *(const float2*)&At[(row0 + g + 8) * TLD + c0 + 8];
        unsigned af[4];
        af[0] = gc_pack(x0.x * coef[c0], x0.y * coef[c0 + 1]);
        af[1] = gc_pack(x1.x * coef[c0], x1.y * coef[c0 + 1]);
        af[2] = gc_pack(x2.x * coef[c0 + 8], x2.y * coef[c0 + 9]);
        af[3] = gc_pack(x3.x * coef[c0 + 8], x3.y * coef[c0 + 9]);
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            const int n = 8 * nt + g;
            mma_bf16(acc[nt], af, gc_pair(Xs[c0][n], Xs[c0 + 1][n]), gc_pair(Xs[c0 + 8][n], Xs[c0 + 9][n]));
        }
    }
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
            *(unsigned*)(dst + (row0 + g + 8 * hf) * N + 8 * nt + 2 * tig) =
                gc_pack(acc[nt][2 * hf], acc[nt][2 * hf + 1]);
}

template <int DK, int DV>
__device__ void gdn_chunk_prep_impl(bf16_t* Wg, bf16_t* Ug, bf16_t* Qdg, bf16_t* Kdg, bf16_t* Pg, float* gcg,
                                    const bf16_t* q, const bf16_t* k, const bf16_t* v, long long qkv_stride,
                                    const bf16_t* a, const bf16_t* b, long long ab_stride, const float* A_log,
                                    const float* dt_bias, const int* cu, int seqs, int k_heads, int v_heads) {
    pdl_entry();
    constexpr int LD = (DK > DV ? DK : DV) + 8;  // bf16 row stride of the staging rows (+8: spread the banks)
    constexpr int TLD = GC_C + 4;                // fp32 row stride of A / T (16-byte rows for float4 reads)
    static_assert(GC_C * LD * 2 <= GC_C * TLD * 4, "Qs must fit in the A/T buffer it shares");
    __shared__ __align__(16) bf16_t Ks[GC_C][LD];    // normalised K (bf16); later raw V
    __shared__ __align__(16) float At[GC_C * TLD];   // phase 1: normalised Q (bf16, stride LD); then A, then T
    __shared__ float Gs[GC_C], Bs[GC_C], eG[GC_C], eTail[GC_C], cW[GC_C];
    bf16_t* Qs = (bf16_t*)At;

    const int cs = blockIdx.x, h = blockIdx.y;
    const int s = gc_slot_sequence(cu, seqs, cs);
    const int t0 = cu[s] + (cs - (cu[s] / GC_C + s)) * GC_C;
    if (t0 >= cu[s + 1]) return;  // a slot no chunk uses (whole block leaves: no barrier skipped)
    const int L = min(GC_C, cu[s + 1] - t0);
    const int kh = h / (v_heads / k_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const long long ho = (long long)cs * v_heads + h;  // [slot][head] index of every per-chunk output

    // ---- phase 0: gates and the cumulative log-decay G (pads: g = 0, beta = 0)
    if (tid < GC_C) {
        float gv = 0.0f, bv = 0.0f;
        if (tid < L) {
            const long long r = (long long)(t0 + tid) * ab_stride + h;
            gv = -expf(A_log[h]) * softplusf(to_f(a[r]) + dt_bias[h]);
            bv = sigmoidf(to_f(b[r]));
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float up = __shfl_up_sync(0xffffffffu, gv, o);
            if (lane >= o) gv += up;
        }
        Gs[tid] = gv;
        Bs[tid] = bv;
    }
    __syncthreads();
    if (tid >= 32 && tid < GC_C) Gs[tid] += Gs[31];
    __syncthreads();
    if (tid < GC_C) {
        const float G = Gs[tid];
        eG[tid] = expf(G);
        eTail[tid] = expf(Gs[GC_C - 1] - G);  // G is non-increasing: the exponent is <= 0
        cW[tid] = Bs[tid] * expf(G);
    }
    __syncthreads();

    // ---- phase 1: normalised k and q rows (bf16) into shared memory; Qd straight to global
    {
        constexpr int EPL = DK / 32;  // elements per lane, contiguous
        bf16_t* Qd = Qdg + ho * GC_C * DK;
        for (int r = warp; r < GC_C; r += GC_THREADS / 32) {
            float kx[EPL], qx[EPL];
            if (r < L) {
                const bf16_t* kr = k + (long long)(t0 + r) * qkv_stride + (long long)kh * DK + lane * EPL;
                const bf16_t* qr = q + (long long)(t0 + r) * qkv_stride + (long long)kh * DK + lane * EPL;
#pragma unroll
                for (int e = 0; e < EPL; e += 2) {
                    const unsigned kw = gc_ld32(kr + e), qw = gc_ld32(qr + e);
                    kx[e] = to_f((bf16_t)(kw & 0xffffu));
                    kx[e + 1] = to_f((bf16_t)(kw >> 16));
                    qx[e] = to_f((bf16_t)(qw & 0xffffu));
                    qx[e + 1] = to_f((bf16_t)(qw >> 16));
                }
            } else {
#pragma unroll
                for (int e = 0; e < EPL; ++e) kx[e] = qx[e] = 0.0f;
            }
            float kss = 0.0f, qss = 0.0f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                kss += kx[e] * kx[e];
                qss += qx[e] * qx[e];
            }
            const float k_inv = rsqrtf(warp_sum(kss) + 1e-6f);
            const float q_inv = rsqrtf(warp_sum(qss) + 1e-6f) * rsqrtf((float)DK);
            const float eq = eG[r];
#pragma unroll
            for (int e = 0; e < EPL; e += 2) {
                const bf16_t k0 = from_f<bf16_t>(kx[e] * k_inv), k1 = from_f<bf16_t>(kx[e + 1] * k_inv);
                const bf16_t q0 = from_f<bf16_t>(qx[e] * q_inv), q1 = from_f<bf16_t>(qx[e + 1] * q_inv);
                *(unsigned*)&Ks[r][lane * EPL + e] = gc_pair(k0, k1);
                *(unsigned*)&Qs[r * LD + lane * EPL + e] = gc_pair(q0, q1);
                *(unsigned*)(Qd + r * DK + lane * EPL + e) = gc_pack(to_f(q0) * eq, to_f(q1) * eq);
            }
        }
    }
    __syncthreads();

    // ---- Kd^T [DK][GC_C] to global: a warp writes one 128-byte row of token pairs
    {
        bf16_t* Kd = Kdg + ho * DK * GC_C;
        for (int i = tid; i < DK * GC_C / 2; i += GC_THREADS) {
            const int d = i / (GC_C / 2), m = (i % (GC_C / 2)) * 2;
            *(unsigned*)(Kd + d * GC_C + m) = gc_pack(to_f(Ks[m][d]) * eTail[m], to_f(Ks[m + 1][d]) * eTail[m + 1]);
        }
    }

    // ---- K K^T and Q K^T for this warp's 16 rows (only the n-tiles at or below the diagonal)
    const int row0 = 16 * warp;
    float kk[GC_C / 8][4], qk[GC_C / 8][4];
#pragma unroll
    for (int nt = 0; nt < GC_C / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) kk[nt][e] = qk[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
        const int c0 = 16 * ks + 2 * tig;
        unsigned ak[4], aq[4];
        ak[0] = gc_ld32(&Ks[row0 + g][c0]);
        ak[1] = gc_ld32(&Ks[row0 + g + 8][c0]);
        ak[2] = gc_ld32(&Ks[row0 + g][c0 + 8]);
        ak[3] = gc_ld32(&Ks[row0 + g + 8][c0 + 8]);
        aq[0] = gc_ld32(&Qs[(row0 + g) * LD + c0]);
        aq[1] = gc_ld32(&Qs[(row0 + g + 8) * LD + c0]);
        aq[2] = gc_ld32(&Qs[(row0 + g) * LD + c0 + 8]);
        aq[3] = gc_ld32(&Qs[(row0 + g + 8) * LD + c0 + 8]);
#pragma unroll
        for (int nt = 0; nt < GC_C / 8; ++nt) {
            if (nt > 2 * warp + 1) continue;  // entirely above the diagonal (warp-uniform)
            const unsigned b0 = gc_ld32(&Ks[8 * nt + g][c0]);
            const unsigned b1 = gc_ld32(&Ks[8 * nt + g][c0 + 8]);
            mma_bf16(kk[nt], ak, b0, b1);
            mma_bf16(qk[nt], aq, b0, b1);
        }
    }
    // P to global; A (fp32) stays in kk until Qs is dead
    {
        bf16_t* P = Pg + ho * GC_C * GC_C;
#pragma unroll
        for (int nt = 0; nt < GC_C / 8; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = row0 + g + 8 * hf, j = 8 * nt + 2 * tig;
                float pv[2], av[2];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float dec = expf(i >= j + c ? Gs[i] - Gs[j + c] : 0.0f);
                    pv[c] = i >= j + c ? dec * qk[nt][2 * hf + c] : 0.0f;
                    av[c] = i > j + c ? Bs[i] * dec * kk[nt][2 * hf + c] : 0.0f;
                }
                *(unsigned*)(P + i * GC_C + j) = gc_pack(pv[0], pv[1]);
                kk[nt][2 * hf] = av[0];
                kk[nt][2 * hf + 1] = av[1];
            }
    }
    __syncthreads();  // every warp is done with Qs: its space becomes A
#pragma unroll
    for (int nt = 0; nt < GC_C / 8; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
            *(float2*)&At[(row0 + g + 8 * hf) * TLD + 8 * nt + 2 * tig] = make_float2(kk[nt][2 * hf], kk[nt][2 * hf + 1]);
    __syncthreads();

    // ---- phase 2: T = (I + A)^-1, thread j computes column j: T[i][j] = -sum_m A[i][m] T[m][j] for i > j.
    // A[i][m] = 0 for m >= i, so every row may sum over whole float4 groups; four partial sums keep chains short.
    float tc[GC_C];
    if (tid < GC_C) {
#pragma unroll
        for (int i = 0; i < GC_C; ++i) tc[i] = i == tid ? 1.0f : 0.0f;
#pragma unroll
        for (int i = 1; i < GC_C; ++i) {
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll
            for (int m = 0; m < i; m += 4) {
                const float4 a4 = *(const float4*)&At[i * TLD + m];
                s0 += a4.x * tc[m];
                s1 += a4.y * tc[m + 1];
                s2 += a4.z * tc[m + 2];
                s3 += a4.w * tc[m + 3];
            }
            if (i > tid) tc[i] = -((s0 + s1) + (s2 + s3));
        }
    }
    __syncthreads();  // all of A has been read
    if (tid < GC_C) {
#pragma unroll
        for (int i = 0; i < GC_C; ++i) At[i * TLD + tid] = tc[i];
    }
    __syncthreads();

    // ---- phase 3: W = (T diag(beta e^G)) K, then U = (T diag(beta)) V, 16 rows per warp
    gc_t_product<DK, LD, TLD>(At, cW, Ks, Wg + ho * GC_C * DK, row0, g, tig);
    __syncthreads();  // Ks (normalised K) is dead: V goes there
    {
        constexpr int EPL = DV / 32;
        for (int r = warp; r < GC_C; r += GC_THREADS / 32) {
            const bf16_t* vr = v + (long long)(t0 + r) * qkv_stride + (long long)h * DV + lane * EPL;
#pragma unroll
            for (int e = 0; e < EPL; e += 2) *(unsigned*)&Ks[r][lane * EPL + e] = r < L ? gc_ld32(vr + e) : 0u;
        }
    }
    __syncthreads();
    gc_t_product<DV, LD, TLD>(At, Bs, Ks, Ug + ho * GC_C * DV, row0, g, tig);
    if (tid == 0) gcg[ho] = eG[GC_C - 1];
}

// The pieces gdn_chunk_scan and gdn_chunk_states share. The state slice lives in registers sacc[MT][NT][4]:
// element (mt, nt, e) is dk row srow0 + 16 mt + g + 8 (e >> 1), slice column 8 nt + 2 tig + (e & 1).
// St [slice][DK] fp32 into the registers (zeros for a fresh sequence)
template <int DK, int MT, int NT>
__device__ __forceinline__ void gc_state_load(float (&sacc)[MT][NT][4], const float* St, bool is_fresh, int srow0,
                                              int g, int tig) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = srow0 + 16 * mt + g + 8 * (e >> 1), c = 8 * nt + 2 * tig + (e & 1);
                sacc[mt][nt][e] = is_fresh ? 0.0f : St[c * DK + r];
            }
}

// the registers back to St
template <int DK, int MT, int NT>
__device__ __forceinline__ void gc_state_store(float* St, const float (&sacc)[MT][NT][4], int srow0, int g, int tig) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                St[(8 * nt + 2 * tig + (e & 1)) * DK + srow0 + 16 * mt + g + 8 * (e >> 1)] = sacc[mt][nt][e];
}

// the state's bf16 copy, transposed: Sb[slice column][dk row]
template <int LD, int MT, int NT>
__device__ __forceinline__ void gc_state_to_bf16(bf16_t (*Sb)[LD], const float (&sacc)[MT][NT][4], int srow0, int g,
                                                 int tig) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                Sb[8 * nt + 2 * tig + (e & 1)][srow0 + 16 * mt + g + 8 * (e >> 1)] = from_f<bf16_t>(sacc[mt][nt][e]);
}

// S *= gc (the chunk's decay)
template <int MT, int NT>
__device__ __forceinline__ void gc_state_scale(float (&sacc)[MT][NT][4], float gc) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[mt][nt][e] *= gc;
}

template <int DK, int DV, int SLICE>
__device__ void gdn_chunk_scan_impl(bf16_t* out, float* state, const bf16_t* Wg, const bf16_t* Ug,
                                    const bf16_t* Qdg, const bf16_t* Kdg, const bf16_t* Pg, const float* gcg,
                                    const int* cu, const int* state_slots, const int* fresh, int v_heads) {
    pdl_entry();
    constexpr int MT = DK / 64;  // 16-row m-tiles of dk per warp (4 warps cover DK)
    constexpr int NT = SLICE / 8;
    __shared__ __align__(16) bf16_t Sb[SLICE][DK + 8];  // S^T of the slice in bf16: B operand of W S and Qd S
    __shared__ __align__(16) bf16_t Vb[SLICE][GC_C + 8];  // V'^T in bf16: B operand of P V' and Kd^T V'
    const int sl = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int dv0 = sl * SLICE;
    const int t_begin = cu[s], len = cu[s + 1] - t_begin;
    const int nch = (len + GC_C - 1) / GC_C, base = t_begin / GC_C + s;
    const bool is_fresh = fresh[s] != 0;
    float* St = state + ((long long)state_slots[s] * v_heads + h) * DV * DK + (long long)dv0 * DK;  // [slice][DK]
    const int srow0 = warp * 16 * MT;  // first dk row of this warp's part of S
    const int row0 = 16 * warp;        // first token row of this warp in V' and O

    // S accumulator element (mt, nt, e): dk row srow0 + 16 mt + g + 8 (e >> 1), slice column 8 nt + 2 tig + (e & 1)
    float sacc[MT][NT][4];
    gc_state_load<DK>(sacc, St, is_fresh, srow0, g, tig);

    for (int ch = 0; ch < nch; ++ch) {
        const long long ho = (long long)(base + ch) * v_heads + h;
        const bf16_t* W = Wg + ho * GC_C * DK;
        const bf16_t* Qd = Qdg + ho * GC_C * DK;
        const bf16_t* Kd = Kdg + ho * DK * GC_C;
        const bf16_t* P = Pg + ho * GC_C * GC_C;
        const bf16_t* U = Ug + ho * GC_C * DV + dv0;
        const float gc = gcg[ho];
        if (ch + 1 < nch) {  // pull the next chunk into L2 while this one computes (128-byte lines)
            const long long nx = ho + v_heads;
            constexpr int LINES = GC_C * DK * 2 / 128;
            for (int i = tid; i < LINES; i += GC_THREADS) {
                gc_prefetch_l2(Wg + nx * GC_C * DK + i * 64);
                gc_prefetch_l2(Qdg + nx * GC_C * DK + i * 64);
                gc_prefetch_l2(Kdg + nx * DK * GC_C + i * 64);
            }
            if (tid < GC_C) {
                gc_prefetch_l2(Pg + nx * GC_C * GC_C + tid * 64);
                gc_prefetch_l2(Ug + nx * GC_C * DV + dv0 + tid * DV);
            }
        }
        // 1. the state's bf16 copy
        gc_state_to_bf16(Sb, sacc, srow0, g, tig);
        __syncthreads();
        // 2. W S and Qd S for this warp's 16 tokens
        float vacc[NT][4], oacc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) vacc[nt][e] = oacc[nt][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            const int c0 = 16 * ks + 2 * tig;
            unsigned aw[4], aq[4];
            aw[0] = gc_ld32(W + (row0 + g) * DK + c0);
            aw[1] = gc_ld32(W + (row0 + g + 8) * DK + c0);
            aw[2] = gc_ld32(W + (row0 + g) * DK + c0 + 8);
            aw[3] = gc_ld32(W + (row0 + g + 8) * DK + c0 + 8);
            aq[0] = gc_ld32(Qd + (row0 + g) * DK + c0);
            aq[1] = gc_ld32(Qd + (row0 + g + 8) * DK + c0);
            aq[2] = gc_ld32(Qd + (row0 + g) * DK + c0 + 8);
            aq[3] = gc_ld32(Qd + (row0 + g + 8) * DK + c0 + 8);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned b0 = gc_ld32(&Sb[8 * nt + g][c0]), b1 = gc_ld32(&Sb[8 * nt + g][c0 + 8]);
                mma_bf16(vacc[nt], aw, b0, b1);
                mma_bf16(oacc[nt], aq, b0, b1);
            }
        }
        // V' = U - W S, to shared memory transposed (bf16)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = row0 + g + 8 * hf, c = 8 * nt + 2 * tig;
                const unsigned uw = gc_ld32(U + i * DV + c);
                Vb[c][i] = from_f<bf16_t>(to_f((bf16_t)(uw & 0xffffu)) - vacc[nt][2 * hf]);
                Vb[c + 1][i] = from_f<bf16_t>(to_f((bf16_t)(uw >> 16)) - vacc[nt][2 * hf + 1]);
            }
        __syncthreads();
        // 3. O += P V' (this warp's tokens) and S = gc S + Kd^T V' (this warp's dk rows): same B fragments
        gc_state_scale(sacc, gc);
#pragma unroll
        for (int ks = 0; ks < GC_C / 16; ++ks) {
            const int c0 = 16 * ks + 2 * tig;
            unsigned ap[4];
            ap[0] = gc_ld32(P + (row0 + g) * GC_C + c0);
            ap[1] = gc_ld32(P + (row0 + g + 8) * GC_C + c0);
            ap[2] = gc_ld32(P + (row0 + g) * GC_C + c0 + 8);
            ap[3] = gc_ld32(P + (row0 + g + 8) * GC_C + c0 + 8);
            unsigned ak[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = srow0 + 16 * mt + g;
                ak[mt][0] = gc_ld32(Kd + r * GC_C + c0);
                ak[mt][1] = gc_ld32(Kd + (r + 8) * GC_C + c0);
                ak[mt][2] = gc_ld32(Kd + r * GC_C + c0 + 8);
                ak[mt][3] = gc_ld32(Kd + (r + 8) * GC_C + c0 + 8);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned b0 = gc_ld32(&Vb[8 * nt + g][c0]), b1 = gc_ld32(&Vb[8 * nt + g][c0 + 8]);
                mma_bf16(oacc[nt], ap, b0, b1);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_bf16(sacc[mt][nt], ak[mt], b0, b1);
            }
        }
        const int tok0 = ch * GC_C;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = row0 + g + 8 * hf;
                if (tok0 + i < len)
                    *(unsigned*)(out + (long long)(t_begin + tok0 + i) * v_heads * DV + (long long)h * DV + dv0 +
                                 8 * nt + 2 * tig) = gc_pack(oacc[nt][2 * hf], oacc[nt][2 * hf + 1]);
            }
        // the next chunk's writes to Sb come after this chunk's reads of Sb (barrier above), and its writes to Vb
        // after its own first barrier, which every warp reaches only once done with this chunk's Vb
    }
    gc_state_store<DK>(St, sacc, srow0, g, tig);
}

// ---- the "states" variant (deltanet_chunked.VARIANTS): the scan carries only the state, the output is a third,
// fully parallel launch. See the header's second part for why.

// ROWS x COLS bf16 from global (row stride SRC_LD elements) into shared memory (row stride dst_ld) by 16-byte
// cp.async pieces, consecutive threads on consecutive pieces of a row (coalesced); the caller commits the group.
template <int ROWS, int COLS, int SRC_LD>
__device__ __forceinline__ void gs_stage_rows(bf16_t* dst, int dst_ld, const bf16_t* src, int tid) {
    const unsigned base = smem_addr(dst);
#pragma unroll 4
    for (int i = tid; i < ROWS * COLS / 8; i += GC_THREADS) {
        const int r = i / (COLS / 8), c = (i % (COLS / 8)) * 8;
        cp_async16(base + (unsigned)(r * dst_ld + c) * 2u, src + (long long)r * SRC_LD + c, 16);
    }
}

// ROWS x COLS bf16 from shared memory (row stride src_ld) to global (row stride COLS), 16 bytes a thread and step.
template <int ROWS, int COLS>
__device__ __forceinline__ void gs_store_rows(bf16_t* dst, const bf16_t* src, int src_ld, int tid) {
#pragma unroll 4
    for (int i = tid; i < ROWS * COLS / 8; i += GC_THREADS) {
        const int r = i / (COLS / 8), c = (i % (COLS / 8)) * 8;
        *(uint4*)(dst + (long long)r * COLS + c) = *(const uint4*)(src + r * src_ld + c);
    }
}

// Dynamic shared memory of gdn_chunk_states (bytes; deltanet_chunked.states_shared_bytes mirrors it): two stages of
// the chunk operands on the state's chain (W [C][DK], Kd^T [DK][C], U's slice [C][SLICE]), then Sb and Vb as in
// gdn_chunk_scan. Rows padded by 8 bf16 (16 bytes): 32-bit fragment reads of 8 rows x 4 words hit 32 banks.
template <int DK, int SLICE>
struct GsLayout {
    static constexpr int W_LD = DK + 8, K_LD = GC_C + 8, U_LD = SLICE + 8, S_LD = DK + 8, V_LD = GC_C + 8;
    static constexpr int W_OFF = 0, K_OFF = W_OFF + GC_C * W_LD, U_OFF = K_OFF + DK * K_LD;  // bf16 elements
    static constexpr int STAGE = U_OFF + GC_C * U_LD;
    static constexpr int SB_OFF = 2 * STAGE, VB_OFF = SB_OFF + SLICE * S_LD;
    static constexpr int BYTES = 2 * (VB_OFF + SLICE * V_LD);
};

// gdn_chunk_states: gdn_chunk_scan without the output. Per chunk (grid and state registers as gdn_chunk_scan):
//   Sc = bf16(S) (to Sg, the chunk's entry state)   V' = bf16(U - W Sc) (to Vg, transposed)   S = gc S + Kd^T V'
// W, Kd^T and U of chunk c + 1 arrive by cp.async into the other stage while chunk c computes.
template <int DK, int DV, int SLICE>
__device__ void gdn_chunk_states_impl(bf16_t* Sg, bf16_t* Vg, float* state, const bf16_t* Wg, const bf16_t* Ug,
                                      const bf16_t* Kdg, const float* gcg, const int* cu, const int* state_slots,
                                      const int* fresh, int v_heads) {
    pdl_entry();
    using Ly = GsLayout<DK, SLICE>;
    constexpr int MT = DK / 64, NT = SLICE / 8;
    extern __shared__ __align__(16) bf16_t gs_smem[];
    bf16_t(*Sb)[Ly::S_LD] = (bf16_t(*)[Ly::S_LD])(gs_smem + Ly::SB_OFF);
    bf16_t(*Vb)[Ly::V_LD] = (bf16_t(*)[Ly::V_LD])(gs_smem + Ly::VB_OFF);
    const int sl = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int dv0 = sl * SLICE;
    const int t_begin = cu[s], len = cu[s + 1] - t_begin;
    const int nch = (len + GC_C - 1) / GC_C, base = t_begin / GC_C + s;
    const bool is_fresh = fresh[s] != 0;
    float* St = state + ((long long)state_slots[s] * v_heads + h) * DV * DK + (long long)dv0 * DK;  // [slice][DK]
    const int srow0 = warp * 16 * MT;
    const int row0 = 16 * warp;
    auto stage = [&](int ch) {  // chunk ch's W, Kd^T and U slice into stage ch % 2
        const long long ho = (long long)(base + ch) * v_heads + h;
        bf16_t* dst = gs_smem + (ch & 1) * Ly::STAGE;
        gs_stage_rows<GC_C, DK, DK>(dst + Ly::W_OFF, Ly::W_LD, Wg + ho * GC_C * DK, tid);
        gs_stage_rows<DK, GC_C, GC_C>(dst + Ly::K_OFF, Ly::K_LD, Kdg + ho * DK * GC_C, tid);
        gs_stage_rows<GC_C, SLICE, DV>(dst + Ly::U_OFF, Ly::U_LD, Ug + ho * GC_C * DV + dv0, tid);
    };
    if (nch > 0) stage(0);
    cp_async_commit();
    float gc = nch > 0 ? gcg[(long long)base * v_heads + h] : 1.0f;

    float sacc[MT][NT][4];
    gc_state_load<DK>(sacc, St, is_fresh, srow0, g, tig);

    for (int ch = 0; ch < nch; ++ch) {
        const long long ho = (long long)(base + ch) * v_heads + h;
        // 1. the state's bf16 copy; then chunk ch's operands are in (this thread's copies by the wait, everyone's
        //    by the barrier, which also ends every read of chunk ch - 1's stage, Sb and Vb)
        gc_state_to_bf16(Sb, sacc, srow0, g, tig);
        cp_async_wait<0>();
        __syncthreads();
        float gc_next = 1.0f;
        if (ch + 1 < nch) {
            stage(ch + 1);
            gc_next = gcg[ho + v_heads];
        }
        cp_async_commit();
        gs_store_rows<SLICE, DK>(Sg + ho * DV * DK + (long long)dv0 * DK, &Sb[0][0], Ly::S_LD, tid);
        const bf16_t* Ws = gs_smem + (ch & 1) * Ly::STAGE + Ly::W_OFF;
        const bf16_t* Ks = gs_smem + (ch & 1) * Ly::STAGE + Ly::K_OFF;
        const bf16_t* Us = gs_smem + (ch & 1) * Ly::STAGE + Ly::U_OFF;
        // 2. W Sc for this warp's 16 tokens
        float vacc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) vacc[nt][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            const int c0 = 16 * ks + 2 * tig;
            unsigned aw[4];
            aw[0] = gc_ld32(Ws + (row0 + g) * Ly::W_LD + c0);
            aw[1] = gc_ld32(Ws + (row0 + g + 8) * Ly::W_LD + c0);
            aw[2] = gc_ld32(Ws + (row0 + g) * Ly::W_LD + c0 + 8);
            aw[3] = gc_ld32(Ws + (row0 + g + 8) * Ly::W_LD + c0 + 8);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                mma_bf16(vacc[nt], aw, gc_ld32(&Sb[8 * nt + g][c0]), gc_ld32(&Sb[8 * nt + g][c0 + 8]));
        }
        // V' = U - W Sc, transposed into Vb (bf16)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = row0 + g + 8 * hf, c = 8 * nt + 2 * tig;
                const unsigned uw = gc_ld32(Us + i * Ly::U_LD + c);
                Vb[c][i] = from_f<bf16_t>(to_f((bf16_t)(uw & 0xffffu)) - vacc[nt][2 * hf]);
                Vb[c + 1][i] = from_f<bf16_t>(to_f((bf16_t)(uw >> 16)) - vacc[nt][2 * hf + 1]);
            }
        __syncthreads();
        gs_store_rows<SLICE, GC_C>(Vg + ho * DV * GC_C + (long long)dv0 * GC_C, &Vb[0][0], Ly::V_LD, tid);
        // 3. S = gc S + Kd^T V' (this warp's dk rows)
        gc_state_scale(sacc, gc);
#pragma unroll
        for (int ks = 0; ks < GC_C / 16; ++ks) {
            const int c0 = 16 * ks + 2 * tig;
            unsigned ak[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = srow0 + 16 * mt + g;
                ak[mt][0] = gc_ld32(Ks + r * Ly::K_LD + c0);
                ak[mt][1] = gc_ld32(Ks + (r + 8) * Ly::K_LD + c0);
                ak[mt][2] = gc_ld32(Ks + r * Ly::K_LD + c0 + 8);
                ak[mt][3] = gc_ld32(Ks + (r + 8) * Ly::K_LD + c0 + 8);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned b0 = gc_ld32(&Vb[8 * nt + g][c0]), b1 = gc_ld32(&Vb[8 * nt + g][c0 + 8]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_bf16(sacc[mt][nt], ak[mt], b0, b1);
            }
        }
        gc = gc_next;
    }
    cp_async_wait<0>();  // nothing is outstanding (the last commit was empty); no copy outlives the block
    gc_state_store<DK>(St, sacc, srow0, g, tig);
}

// Dynamic shared memory of gdn_chunk_output (bytes; deltanet_chunked.output_shared_bytes mirrors it): Qd [C][DK],
// P [C][C], Sc^T [DV][DK], V'^T [DV][C], rows padded by 8 bf16.
template <int DK, int DV>
struct GoLayout {
    static constexpr int Q_LD = DK + 8, P_LD = GC_C + 8, S_LD = DK + 8, V_LD = GC_C + 8;
    static constexpr int Q_OFF = 0, P_OFF = GC_C * Q_LD, S_OFF = P_OFF + GC_C * P_LD, V_OFF = S_OFF + DV * S_LD;
    static constexpr int BYTES = 2 * (V_OFF + DV * V_LD);
};

// gdn_chunk_output (grid: chunk slots x value heads, fully parallel): O = Qd Sc + P V' for one chunk and head, all
// DV columns (a warp: 16 tokens), accumulated in the order gdn_chunk_scan uses (Qd Sc over dk, then P V').
template <int DK, int DV>
__device__ void gdn_chunk_output_impl(bf16_t* out, const bf16_t* Qdg, const bf16_t* Pg, const bf16_t* Sg,
                                      const bf16_t* Vg, const int* cu, int seqs, int v_heads) {
    pdl_entry();
    using Ly = GoLayout<DK, DV>;
    constexpr int NT = DV / 8;
    extern __shared__ __align__(16) bf16_t go_smem[];
    const bf16_t* Qs = go_smem + Ly::Q_OFF;
    const bf16_t* Ps = go_smem + Ly::P_OFF;
    const bf16_t* Ss = go_smem + Ly::S_OFF;
    const bf16_t* Vs = go_smem + Ly::V_OFF;
    const int cs = blockIdx.x, h = blockIdx.y;
    const int s = gc_slot_sequence(cu, seqs, cs);
    const int t0 = cu[s] + (cs - (cu[s] / GC_C + s)) * GC_C;
    if (t0 >= cu[s + 1]) return;  // a slot no chunk uses (whole block leaves: no barrier skipped)
    const int L = min(GC_C, cu[s + 1] - t0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const long long ho = (long long)cs * v_heads + h;
    gs_stage_rows<GC_C, DK, DK>(go_smem + Ly::Q_OFF, Ly::Q_LD, Qdg + ho * GC_C * DK, tid);
    gs_stage_rows<DV, DK, DK>(go_smem + Ly::S_OFF, Ly::S_LD, Sg + ho * DV * DK, tid);
    cp_async_commit();
    gs_stage_rows<GC_C, GC_C, GC_C>(go_smem + Ly::P_OFF, Ly::P_LD, Pg + ho * GC_C * GC_C, tid);
    gs_stage_rows<DV, GC_C, GC_C>(go_smem + Ly::V_OFF, Ly::V_LD, Vg + ho * DV * GC_C, tid);
    cp_async_commit();
    const int row0 = 16 * warp;
    float oacc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) oacc[nt][e] = 0.0f;
    cp_async_wait<1>();  // Qd and Sc
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
        const int c0 = 16 * ks + 2 * tig;
        unsigned aq[4];
        aq[0] = gc_ld32(Qs + (row0 + g) * Ly::Q_LD + c0);
        aq[1] = gc_ld32(Qs + (row0 + g + 8) * Ly::Q_LD + c0);
        aq[2] = gc_ld32(Qs + (row0 + g) * Ly::Q_LD + c0 + 8);
        aq[3] = gc_ld32(Qs + (row0 + g + 8) * Ly::Q_LD + c0 + 8);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const bf16_t* sr = Ss + (8 * nt + g) * Ly::S_LD + c0;
            mma_bf16(oacc[nt], aq, gc_ld32(sr), gc_ld32(sr + 8));
        }
    }
    cp_async_wait<0>();  // P and V'
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < GC_C / 16; ++ks) {
        const int c0 = 16 * ks + 2 * tig;
        unsigned ap[4];
        ap[0] = gc_ld32(Ps + (row0 + g) * Ly::P_LD + c0);
        ap[1] = gc_ld32(Ps + (row0 + g + 8) * Ly::P_LD + c0);
        ap[2] = gc_ld32(Ps + (row0 + g) * Ly::P_LD + c0 + 8);
        ap[3] = gc_ld32(Ps + (row0 + g + 8) * Ly::P_LD + c0 + 8);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const bf16_t* vr = Vs + (8 * nt + g) * Ly::V_LD + c0;
            mma_bf16(oacc[nt], ap, gc_ld32(vr), gc_ld32(vr + 8));
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int i = row0 + g + 8 * hf;
            if (i < L)
                *(unsigned*)(out + (long long)(t0 + i) * v_heads * DV + (long long)h * DV + 8 * nt + 2 * tig) =
                    gc_pack(oacc[nt][2 * hf], oacc[nt][2 * hf + 1]);
        }
}

#define DEFINE(DK, DV)                                                                                            \
    extern "C" __global__ void __launch_bounds__(GC_THREADS) gdn_chunk_prep_dk##DK##_dv##DV(                       \
        bf16_t* Wg, bf16_t* Ug, bf16_t* Qdg, bf16_t* Kdg, bf16_t* Pg, float* gcg, const bf16_t* q,                 \
        const bf16_t* k, const bf16_t* v, long long qkv_stride, const bf16_t* a, const bf16_t* b,                 \
        long long ab_stride, const float* A_log, const float* dt_bias, const int* cu, int seqs, int k_heads,      \
        int v_heads) {                                                                                            \
        gdn_chunk_prep_impl<DK, DV>(Wg, Ug, Qdg, Kdg, Pg, gcg, q, k, v, qkv_stride, a, b, ab_stride, A_log,       \
                                    dt_bias, cu, seqs, k_heads, v_heads);                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GC_THREADS) gdn_chunk_scan_dk##DK##_dv##DV(                       \
        bf16_t* out, float* state, const bf16_t* Wg, const bf16_t* Ug, const bf16_t* Qdg, const bf16_t* Kdg,      \
        const bf16_t* Pg, const float* gcg, const int* cu, const int* state_slots, const int* fresh,              \
        int v_heads) {                                                                                            \
        gdn_chunk_scan_impl<DK, DV, GC_SLICE>(out, state, Wg, Ug, Qdg, Kdg, Pg, gcg, cu, state_slots, fresh,      \
                                              v_heads);                                                           \
    }                                                                                                             \
    /* 16-column slices: twice the blocks for low head x sequence counts (the launcher picks) */                  \
    extern "C" __global__ void __launch_bounds__(GC_THREADS) gdn_chunk_scan16_dk##DK##_dv##DV(                     \
        bf16_t* out, float* state, const bf16_t* Wg, const bf16_t* Ug, const bf16_t* Qdg, const bf16_t* Kdg,      \
        const bf16_t* Pg, const float* gcg, const int* cu, const int* state_slots, const int* fresh,              \
        int v_heads) {                                                                                            \
        gdn_chunk_scan_impl<DK, DV, 16>(out, state, Wg, Ug, Qdg, Kdg, Pg, gcg, cu, state_slots, fresh, v_heads);  \
    }
DEFINE(128, 128)
DEFINE(128, 64)
DEFINE(64, 64)
DEFINE(64, 128)
#undef DEFINE

// the "states" variant's two launches after gdn_chunk_prep (32- and 16-column state slices, then the output)
#define DEFINE_STATES(DK, DV)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GC_THREADS) gdn_chunk_states_dk##DK##_dv##DV(                     \
        bf16_t* Sg, bf16_t* Vg, float* state, const bf16_t* Wg, const bf16_t* Ug, const bf16_t* Kdg,              \
        const float* gcg, const int* cu, const int* state_slots, const int* fresh, int v_heads) {                 \
        gdn_chunk_states_impl<DK, DV, GC_SLICE>(Sg, Vg, state, Wg, Ug, Kdg, gcg, cu, state_slots, fresh,          \
                                                v_heads);                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GC_THREADS) gdn_chunk_states16_dk##DK##_dv##DV(                   \
        bf16_t* Sg, bf16_t* Vg, float* state, const bf16_t* Wg, const bf16_t* Ug, const bf16_t* Kdg,              \
        const float* gcg, const int* cu, const int* state_slots, const int* fresh, int v_heads) {                 \
        gdn_chunk_states_impl<DK, DV, 16>(Sg, Vg, state, Wg, Ug, Kdg, gcg, cu, state_slots, fresh, v_heads);      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GC_THREADS) gdn_chunk_output_dk##DK##_dv##DV(                     \
        bf16_t* out, const bf16_t* Qdg, const bf16_t* Pg, const bf16_t* Sg, const bf16_t* Vg, const int* cu,      \
        int seqs, int v_heads) {                                                                                  \
        gdn_chunk_output_impl<DK, DV>(out, Qdg, Pg, Sg, Vg, cu, seqs, v_heads);                                   \
    }
DEFINE_STATES(128, 128)
DEFINE_STATES(128, 64)
DEFINE_STATES(64, 64)
DEFINE_STATES(64, 128)
#undef DEFINE_STATES
