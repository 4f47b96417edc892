// Fused bidirectional attention of the vision tower on the tensor cores (bf16 in, fp32 accumulate),
// FlashAttention-2 style; the same function as vision.cu's vision_attention and the GEMM path of vision.py.
//
// Layout: qkv [n, 3 * heads * HD] (q | k | v per row, rotary already applied), out [n, heads * HD]. Attention runs
// inside consecutive segments of seg_len rows (one frame group each); every query sees every key of its segment.
//
// Grid: x = segment * tiles_per_segment + query tile (64 * MT rows, the last one of a segment may be short),
// y = head. Neighbouring blocks are the query tiles of one (segment, head): they stream the same keys at about
// the same time, so all but the first read them from L2. A block has 4 warps, each owning MT m-tiles of 16 query
// rows and the whole head width of O (MT = 2: each K / V fragment from shared memory feeds two mma). Q lives in
// registers (A fragments straight from global memory).
//
// Head dims that are not a multiple of 16 (Qwen3.5's 72) are padded to HDP = the next multiple of 16 for Q K^T:
// the padded Q fragment halves are zero registers and the padded K columns are zero-filled in shared memory, so
// they add exactly 0 to the scores. V is not padded: O has HD / 8 n-tiles, the last one (HD % 16 == 8) read with
// an ldmatrix x2.trans. Keys stream through shared memory BN at a time with cp.async into two buffers (each thread
// copies fixed 16-byte pieces of one key row: vf_load_kv); rows are
// padded by 16 bytes (LD = HDP + 8 elements: an odd number of 16-byte units, so ldmatrix reads of 8 rows are
// conflict-free). Keys past the segment end in the last key tile are zero-filled and their scores set to -inf;
// query rows past the segment end are zero queries that are never stored. Key tile 0 always holds the segment's
// first key, so every running max is finite after the first step (no -inf guard is needed).
//
// Online softmax in the exp2 domain (scores * scale * log2 e), fp32 running max and sum per row; P is rounded to
// bf16 for the PV product. mma.sync m16n8k16 / ldmatrix layouts follow the PTX ISA (g = lane / 4, tig = lane % 4).
#include "common.cuh"
#include "tensor_core.cuh"

#define VF_ROWS 64     // query rows per block (4 warps x 16); vision_flash.TILE_ROWS must match
#define VF_THREADS 128
#define VF_BN 64       // keys per step; vision_flash.KEYS_PER_STEP must match
#define VF_PAD 8       // bf16 elements of padding per shared-memory row (16 bytes)

template <int HD, int BN = VF_BN> struct VisionFlashShape {
    static constexpr int HDP = (HD + 15) / 16 * 16;   // Q K^T width (zero-padded)
    static constexpr int LD = HDP + VF_PAD;           // shared row stride, elements
    static constexpr int KV_TILE = BN * LD;           // elements of one K (or V) buffer
    static constexpr int SMEM_BYTES = 2 * 4 * KV_TILE;  // K[2] + V[2]: must equal vision_flash.shared_bytes(HD)
};

// Async copy of one key row's K and V (the first HD columns of each) into this thread's row of a K/V buffer pair:
// VF_THREADS / BN threads share a row, thread p of them copying the 16-byte pieces p, p + TPR, ... (so a warp's
// copies of one instruction cover whole 32-byte sectors of consecutive pieces). All offsets are compile-time
// immediates from two per-thread bases: the copy of a tile is a straight run of cp.async, no index arithmetic.
// valid = false (rows at or past the segment's end) zero-fills the row (src is then not read). K's padded columns
// (HDP > HD) are written once by vf_zero_k_pad, never here.
template <int HD, int BN>
__device__ __forceinline__ void vf_load_kv(unsigned ks_row, unsigned vs_row, const bf16_t* k_src, const bf16_t* v_src,
                                           bool valid) {
    constexpr int CH = HD / 8, TPR = VF_THREADS / BN;   // 16-byte pieces per row; threads per row
    static_assert(VF_THREADS % BN == 0, "BN must divide the block's threads");
    const int p = threadIdx.x % TPR;
    const int bytes = valid ? 16 : 0;
#pragma unroll
    for (int j = 0; j < (CH + TPR - 1) / TPR; ++j) {
        if (CH % TPR == 0 || j * TPR + p < CH) {
            cp_async16(ks_row + (unsigned)(j * TPR * 16), k_src + j * TPR * 8, bytes);
            cp_async16(vs_row + (unsigned)(j * TPR * 16), v_src + j * TPR * 8, bytes);
        }
    }
}

// Zero K's padded columns [HD, HDP) in both K buffers, once per block (the copies never touch them); made visible to
// the ldmatrix reads by the first loop iteration's barrier.
template <int HD, int BN>
__device__ __forceinline__ void vf_zero_k_pad(bf16_t* smem) {
    using S = VisionFlashShape<HD, BN>;
    if constexpr (S::HDP > HD) {
        constexpr int PIECES = (S::HDP - HD) / 8;   // 16-byte pieces per row (HD is a multiple of 8)
        for (int c = threadIdx.x; c < 2 * BN * PIECES; c += VF_THREADS) {
            const int row = c / PIECES, piece = c - row * PIECES;   // row of the two buffers (BN rows each)
            const int buf = row / BN, r = row - buf * BN;
            *reinterpret_cast<uint4*>(smem + buf * S::KV_TILE + r * S::LD + HD + piece * 8) = make_uint4(0, 0, 0, 0);
        }
    }
}

template <int HD, int MT, int BN>
__device__ void vision_flash_impl(bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg,
                                  float scale) {
    using S = VisionFlashShape<HD, BN>;
    constexpr int LD = S::LD, KSTEPS = S::HDP / 16, NT_S = BN / 8, NT_O = HD / 8;
    constexpr int ROWS = VF_ROWS * MT;   // query rows per block: 4 warps x MT m-tiles of 16
    extern __shared__ __align__(16) bf16_t smem[];

    pdl_entry();
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)S::SMEM_BYTES) __trap();  // host/kernel mismatch

    const int h = blockIdx.y;
    const int segment = blockIdx.x / tiles_per_seg, q0 = (blockIdx.x - segment * tiles_per_seg) * ROWS;
    const long long seg_first = (long long)segment * seg_len;   // first row of the segment
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const long long width = (long long)heads * HD, row_stride = 3 * width;
    const float sl = scale * 1.4426950408889634f;   // scores -> exp2 domain

    const bf16_t* k_head = qkv + seg_first * row_stride + width + (long long)h * HD;
    const bf16_t* v_head = qkv + seg_first * row_stride + 2 * width + (long long)h * HD;
    const unsigned ks_base = smem_addr(smem), vs_base = ks_base + (unsigned)(2 * S::KV_TILE * 2);

    const int n_kt = (seg_len + BN - 1) / BN;
    // this thread's copy slot: key row kr of every tile, pieces from kp (vf_load_kv)
    const int kr = threadIdx.x / (VF_THREADS / BN), kp = threadIdx.x % (VF_THREADS / BN);
    const unsigned slot = (unsigned)((kr * LD + kp * 8) * 2);
    const bf16_t* k_src = k_head + (long long)kr * row_stride + kp * 8;   // advanced by BN rows per tile
    const long long tile_step = (long long)BN * row_stride;
    vf_zero_k_pad<HD, BN>(smem);
    vf_load_kv<HD, BN>(ks_base + slot, vs_base + slot, kr < seg_len ? k_src : k_head,
                       kr < seg_len ? k_src + width : v_head, kr < seg_len);
    cp_async_commit();

    // m-tile mt of this warp: rows g and g+8 of its 16 (segment-relative query indices); rows past the segment are
    // zero queries. Q A-fragments: dims kk*16 + 2*tig (+1) and +8; pairs at or past HD are the zero padding.
    // MT > 1: each K / V fragment read from shared memory feeds MT mma (half the ldmatrix traffic per mma at MT 2),
    // and the block's key tiles serve twice the query rows (half the L2 traffic).
    unsigned qa[MT][KSTEPS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ra = q0 + (warp * MT + mt) * 16 + g, rb = ra + 8;
        const bool va = ra < seg_len, vb = rb < seg_len;
        const unsigned* qra = (const unsigned*)(qkv + (seg_first + (va ? ra : 0)) * row_stride + (long long)h * HD);
        const unsigned* qrb = (const unsigned*)(qkv + (seg_first + (vb ? rb : 0)) * row_stride + (long long)h * HD);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const bool lo_in = kk * 16 + 8 <= HD, hi_in = kk * 16 + 16 <= HD;   // compile-time per kk
            qa[mt][kk][0] = va && lo_in ? qra[kk * 8 + tig] : 0u;
            qa[mt][kk][1] = vb && lo_in ? qrb[kk * 8 + tig] : 0u;
            qa[mt][kk][2] = va && hi_in ? qra[kk * 8 + 4 + tig] : 0u;
            qa[mt][kk][3] = vb && hi_in ? qrb[kk * 8 + 4 + tig] : 0u;
        }
    }

    float o[MT][NT_O][4];
    float m_a[MT], m_b[MT], l_a[MT], l_b[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
        m_a[mt] = m_b[mt] = NEG_INF;
        l_a[mt] = l_b[mt] = 0.0f;
    }

    // per-lane ldmatrix offsets (elements within a buffer)
    const int mat = lane >> 3, mrow = lane & 7;
    const int k_lane = ((mat >> 1) * 8 + mrow) * LD + (mat & 1) * 8;   // K: 2 key n-tiles x (dims lo, hi)
    const int v_lane = ((mat & 1) * 8 + mrow) * LD + (mat >> 1) * 8;   // V: (keys lo, hi) x 2 dim n-tiles

    for (int j = 0; j < n_kt; ++j) {
        const int kt = j * BN, buf = j & 1;
        if (j + 1 < n_kt) {
            const unsigned next = (unsigned)((buf ^ 1) * S::KV_TILE * 2) + slot;
            k_src += tile_step;
            const bool valid = kt + BN + kr < seg_len;
            vf_load_kv<HD, BN>(ks_base + next, vs_base + next, valid ? k_src : k_head, valid ? k_src + width : v_head,
                               valid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const unsigned buf_off = (unsigned)(buf * S::KV_TILE * 2);
        const unsigned k_buf = ks_base + buf_off, v_buf = vs_base + buf_off;

        // ---- scores: MT x 16 rows x BN keys
        float s[MT][NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int np = 0; np < NT_S / 2; ++np) {
                unsigned b[4];
                ldsm_x4(b, k_buf + (unsigned)((k_lane + np * 16 * LD + kk * 16) * 2));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][2 * np], qa[mt][kk], b[0], b[1]);
                    mma_bf16(s[mt][2 * np + 1], qa[mt][kk], b[2], b[3]);
                }
            }
        }

        // ---- keys past the segment end (last tile only), row maxima
        if (kt + BN > seg_len) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        if (kt + nt * 8 + tig * 2 + c >= seg_len) {
                            s[mt][nt][c] = NEG_INF;
                            s[mt][nt][2 + c] = NEG_INF;
                        }
                    }
        }
        // mx is finite: key tile 0 holds the segment's first key (m = -inf only before it, where corr is 0)
        float base_a[MT], base_b[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            softmax_rescale<false>(s[mt], sl, m_a[mt], m_b[mt], l_a[mt], l_b[mt], o[mt], base_a[mt], base_b[mt]);
        // ---- P (bf16 A fragments: score n-tiles 2k, 2k+1 make k-step k) and O += P V
#pragma unroll
        for (int k2 = 0; k2 < BN / 16; ++k2) {
            unsigned pf[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                softmax_p_fragment(s[mt], k2, sl, base_a[mt], base_b[mt], l_a[mt], l_b[mt], pf[mt]);
#pragma unroll
            for (int dp = 0; dp < NT_O / 2; ++dp) {
                unsigned b[4];
                ldsm_x4_trans(b, v_buf + (unsigned)((v_lane + k2 * 16 * LD + dp * 16) * 2));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(o[mt][2 * dp], pf[mt], b[0], b[1]);
                    mma_bf16(o[mt][2 * dp + 1], pf[mt], b[2], b[3]);
                }
            }
            if constexpr (NT_O % 2) {   // the last 8 dims (HD % 16 == 8): lanes 0-15 address keys lo, hi
                unsigned b[2];
                ldsm_x2_trans(b, v_buf + (unsigned)((v_lane + k2 * 16 * LD + (NT_O - 1) * 8) * 2));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_bf16(o[mt][NT_O - 1], pf[mt], b[0], b[1]);
            }
        }
        __syncthreads();  // this buffer is refilled by the next iteration's copy
    }

    // ---- normalise, store
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        softmax_row_sums(l_a[mt], l_b[mt]);
        const int ra = q0 + (warp * MT + mt) * 16 + g, rb = ra + 8;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            if ((half ? rb : ra) >= seg_len) continue;
            const long long tok = seg_first + (half ? rb : ra);
            const float inv_l = 1.0f / (half ? l_b[mt] : l_a[mt]);
            unsigned* oh = (unsigned*)(out + tok * width + (long long)h * HD);
#pragma unroll
            for (int nt = 0; nt < NT_O; ++nt)
                oh[(nt * 8 + tig * 2) >> 1] = pack_bf16(o[mt][nt][half * 2] * inv_l, o[mt][nt][half * 2 + 1] * inv_l);
        }
    }
}

// MT = 1 (64 query rows a block): blocks per SM the register budget is sized for: 3 keeps hd <= 80 spill-free
// (168 registers), 2 for hd 128. MT = 2 (128 rows a block, the tower's default where instantiated): 2 blocks.
#define DEFINE(HD, MIN_BLOCKS)                                                                                    \
    extern "C" __global__ void __launch_bounds__(VF_THREADS, MIN_BLOCKS) vision_flash_bf16_hd##HD(                \
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {                \
        vision_flash_impl<HD, 1, VF_BN>(out, qkv, heads, seg_len, tiles_per_seg, scale);                                 \
    }
#define DEFINE2(HD, BN, MIN_BLOCKS)                                                                               \
    extern "C" __global__ void __launch_bounds__(VF_THREADS, MIN_BLOCKS) vision_flash_bf16_hd##HD##_m2_n##BN(     \
        bf16_t* out, const bf16_t* qkv, int heads, int seg_len, int tiles_per_seg, float scale) {                \
        vision_flash_impl<HD, 2, BN>(out, qkv, heads, seg_len, tiles_per_seg, scale);                                 \
    }
DEFINE(64, 3)
DEFINE(72, 3)
DEFINE(80, 3)
DEFINE(128, 2)
DEFINE2(64, 64, 2)
DEFINE2(72, 64, 2)
DEFINE2(80, 64, 2)
DEFINE2(64, 32, 2)
DEFINE2(72, 32, 2)
DEFINE2(80, 32, 2)
#undef DEFINE
#undef DEFINE2
