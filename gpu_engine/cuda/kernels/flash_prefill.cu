// Tiled causal attention for prefill chunks on the tensor cores (bf16 in, fp32 accumulate), over the paged cache,
// FlashAttention-2 style.
//
// A tile is up to FP_ROWS = 64 consecutive query tokens of ONE sequence (host-built: tiles[t] = {first token,
// count}); the grid is (query heads, tiles) and a block has 4 warps, each owning 16 query rows and the whole head
// width of O (no score is computed twice). The heads of one tile are neighbouring blocks, so the query heads that
// share a KV head stream the same keys at about the same time and all but the first read them from L2. Tiles run
// in reverse order: the last tiles of a chunk see the most keys, and starting them first evens out the tail.
//
// Keys and values stream through shared memory BN at a time with cp.async into two buffers (tile j+1 is in flight
// while tile j is used); rows are padded by 16 bytes so that ldmatrix reads of 8 rows hit 8 different bank groups.
// K fragments come from ldmatrix, V fragments from ldmatrix.trans (V stays row-major). Q lives in registers for
// head dims <= 128; at 256 the O accumulator alone takes 128 registers a thread, so Q stays in shared memory and
// its fragments are re-read per key tile. Key tiles past the tile's last position are never loaded (causal skip);
// only tiles that reach past the first query's position are masked. Keys past the last position inside the final
// tile are zero-filled (a NaN-free V), and masked scores are -inf.
//
// Online softmax in the exp2 domain (scores * scale * log2 e), fp32 running max and sum per row; P is rounded to
// bf16 for the PV product. Output = softmax(q k^T * scale) v * sigmoid(gate), like paged_attention + combine.
// mma.sync m16n8k16 / ldmatrix fragment layouts follow the PTX ISA (groupID g = lane / 4, tig = lane % 4).
//
// FP8 KV cache (flash_prefill_fp8_*, fp8_kv.cuh): the two buffers hold raw e4m3 rows and their scales (every key of
// the sequence, earlier chunks' included, comes from the paged cache); the buffer in use is dequantised into one
// bf16 K and V tile, bf16(e4m3 * scale), which the mma code reads as it reads a bf16 buffer.
#include "common.cuh"
#include "tensor_core.cuh"
#include "fp8_kv.cuh"
#include "flash_epilogue.cuh"

#define FP_ROWS 64     // query rows per tile (4 warps x 16); flash_plan.FLASH_TILE must match
#define FP_THREADS 128
#define FP_PAD 8       // bf16 elements of padding per shared-memory row (16 bytes)

template <int HD, bool FP8 = false> struct FlashShape {
    static constexpr int BN = HD >= 256 ? 32 : 64;    // keys per step
    static constexpr bool Q_IN_REGS = HD <= 128;
    static constexpr int LD = HD + FP_PAD;             // shared row stride, elements
    static constexpr int KV_TILE = BN * LD;            // elements of one K (or V) buffer
    static constexpr int TILES = FP8 ? 1 : 2;          // bf16 K / V buffers
    static constexpr int LDB = HD + 16;                // FP8: raw row stride, bytes
    static constexpr int RAW_TILE = BN * LDB;          // FP8: bytes of one raw K (or V) buffer
    static constexpr int RAW_OFFSET = 2 * (2 * TILES * KV_TILE + (Q_IN_REGS ? 0 : FP_ROWS * LD));  // bytes
    static constexpr int SCALE_OFFSET = RAW_OFFSET + 4 * RAW_TILE;  // [buffer][K, V][BN] float
    // K[2] + V[2] (+ Q), FP8: K + V (+ Q) + raw K[2] + V[2] + scales:
    // must equal flash_plan.flash_shared_bytes(HD, fp8)
    static constexpr int SMEM_BYTES = FP8 ? SCALE_OFFSET + 2 * 2 * BN * 4 : RAW_OFFSET;
};

template <int HD, bool FP8, typename C>
__device__ void flash_prefill_impl(bf16_t* out, const bf16_t* q, long long q_stride, const bf16_t* gate,
                                   long long gate_stride, int gate_head_stride, const C* k_cache,
                                   const C* v_cache, const float* k_scale, const float* v_scale,
                                   const int* block_tables, int max_blocks_per_seq,
                                   const int* token_seq, const int* token_pos, const int* tiles, int heads,
                                   int kv_heads, int block_size, float scale) {
    using S = FlashShape<HD, FP8>;
    constexpr int BN = S::BN, LD = S::LD, KSTEPS = HD / 16, NT_S = BN / 8, NT_O = HD / 8;
    constexpr int CHUNKS_PER_ROW = HD / 8;                       // 16-byte chunks in a head row
    constexpr int ROWS_PER_PASS = FP_THREADS / CHUNKS_PER_ROW;   // rows one pass of the block copies
    static_assert(FP_THREADS % CHUNKS_PER_ROW == 0 && BN % ROWS_PER_PASS == 0, "copy layout");
    extern __shared__ __align__(16) bf16_t smem[];
    bf16_t* Ks = smem;                                // [TILES][BN][LD]
    bf16_t* Vs = smem + S::TILES * S::KV_TILE;        // [TILES][BN][LD]
    bf16_t* Qs = smem + 2 * S::TILES * S::KV_TILE;    // [FP_ROWS][LD] when !Q_IN_REGS

    pdl_entry();
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)S::SMEM_BYTES) __trap();  // host/kernel mismatch

    const int h = blockIdx.x;
    const int tile = gridDim.y - 1 - blockIdx.y;   // heaviest (latest) tiles first
    const int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int kvh = h / (heads / kv_heads);
    const int* table = block_tables + (long long)token_seq[first] * max_blocks_per_seq;
    const int p_first = token_pos[first], p_last = token_pos[first + count - 1];
    const long long row_width = (long long)kv_heads * HD;
    const float sl = scale * 1.4426950408889634f;   // scores -> exp2 domain

    // this warp's rows g and g+8: absolute positions (-1 = no such row)
    const int ra = warp * 16 + g, rb = ra + 8;
    const int pa = ra < count ? token_pos[first + ra] : -1;
    const int pb = rb < count ? token_pos[first + rb] : -1;

    // ---- async copy of key tile kt.. into buffer `buf` (K and V rows of the same slots)
    const int copy_row0 = threadIdx.x / CHUNKS_PER_ROW, copy_d8 = (threadIdx.x % CHUNKS_PER_ROW) * 8;
    const bf16_t* k_head = reinterpret_cast<const bf16_t*>(k_cache) + (long long)kvh * HD + copy_d8;
    const bf16_t* v_head = reinterpret_cast<const bf16_t*>(v_cache) + (long long)kvh * HD + copy_d8;
    const unsigned ks_base = smem_addr(Ks), vs_base = smem_addr(Vs);
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;   // the usual case: shift, not divide
    const int bs_shift = __ffs(block_size) - 1;
    // FP8: 16-byte chunks of e4m3 rows, and one scale of K (threads 0..BN-1) or V (BN..2BN-1) a row
    constexpr int CHUNKS8 = HD / 16, ROWS8 = FP_THREADS / CHUNKS8;
    static_assert(!FP8 || (FP_THREADS % CHUNKS8 == 0 && BN % ROWS8 == 0 && 2 * BN <= FP_THREADS), "fp8 copy");
    const unsigned raw_base = smem_addr(smem) + S::RAW_OFFSET, sc_base = smem_addr(smem) + S::SCALE_OFFSET;
    const int r8 = threadIdx.x / CHUNKS8, c8 = (threadIdx.x % CHUNKS8) * 16;
    auto load_kv8 = [&](int kt, int buf) {
        const unsigned char* kb8 = reinterpret_cast<const unsigned char*>(k_cache) + (long long)kvh * HD + c8;
        const unsigned char* vb8 = reinterpret_cast<const unsigned char*>(v_cache) + (long long)kvh * HD + c8;
#pragma unroll
        for (int i = 0; i < BN / ROWS8; ++i) {
            const int r = r8 + i * ROWS8, kp = kt + r;
            const bool valid = kp <= p_last;
            long long slot = 0;
            if (valid) {
                const int blk = bs_pow2 ? kp >> bs_shift : kp / block_size;
                slot = (long long)table[blk] * block_size + (kp - blk * block_size);
            }
            const unsigned so = (unsigned)(buf * S::RAW_TILE + r * S::LDB + c8);
            cp_async16(raw_base + so, kb8 + slot * row_width, valid ? 16 : 0);
            cp_async16(raw_base + 2 * S::RAW_TILE + so, vb8 + slot * row_width, valid ? 16 : 0);
        }
        if (threadIdx.x < 2 * BN) {
            const int r = threadIdx.x % BN, kp = kt + r;
            const bool valid = kp <= p_last;
            long long row = 0;
            if (valid) {
                const int blk = bs_pow2 ? kp >> bs_shift : kp / block_size;
                row = ((long long)table[blk] * block_size + (kp - blk * block_size)) * kv_heads + kvh;
            }
            const float* src = threadIdx.x < BN ? k_scale : v_scale;
            cp_async4(sc_base + (unsigned)(((buf * 2 + threadIdx.x / BN) * BN + r) * 4), src + row, valid ? 4 : 0);
        }
    };
    auto load_kv16 = [&](int kt, int buf) {
#pragma unroll
        for (int i = 0; i < BN / ROWS_PER_PASS; ++i) {
            const int r = copy_row0 + i * ROWS_PER_PASS, kp = kt + r;
            const bool valid = kp <= p_last;
            long long off = 0;
            if (valid) {
                const int blk = bs_pow2 ? kp >> bs_shift : kp / block_size;
                off = ((long long)table[blk] * block_size + (kp - blk * block_size)) * row_width;
            }
            const unsigned so = (unsigned)((buf * S::KV_TILE + r * LD + copy_d8) * 2);
            cp_async16(ks_base + so, k_head + off, valid ? 16 : 0);
            cp_async16(vs_base + so, v_head + off, valid ? 16 : 0);
        }
    };
    auto load_kv = [&](int kt, int buf) {
        if constexpr (FP8) load_kv8(kt, buf);
        else load_kv16(kt, buf);
    };

    // ---- Q: registers (hd <= 128, straight from global) or shared memory (hd 256, with the first K/V tile)
    unsigned qa[S::Q_IN_REGS ? KSTEPS : 1][4];
    if constexpr (S::Q_IN_REGS) {
        const unsigned* qra = (const unsigned*)(q + (first + (pa >= 0 ? ra : 0)) * q_stride + (long long)h * HD);
        const unsigned* qrb = (const unsigned*)(q + (first + (pb >= 0 ? rb : 0)) * q_stride + (long long)h * HD);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            qa[kk][0] = pa >= 0 ? qra[kk * 8 + tig] : 0u;
            qa[kk][1] = pb >= 0 ? qrb[kk * 8 + tig] : 0u;
            qa[kk][2] = pa >= 0 ? qra[kk * 8 + 4 + tig] : 0u;
            qa[kk][3] = pb >= 0 ? qrb[kk * 8 + 4 + tig] : 0u;
        }
    } else {
        const unsigned qs_base = smem_addr(Qs);
#pragma unroll
        for (int i = 0; i < FP_ROWS / ROWS_PER_PASS; ++i) {
            const int r = copy_row0 + i * ROWS_PER_PASS;
            const bool valid = r < count;
            const bf16_t* src = q + (first + (valid ? r : 0)) * q_stride + (long long)h * HD + copy_d8;
            cp_async16(qs_base + (unsigned)((r * LD + copy_d8) * 2), src, valid ? 16 : 0);
        }
    }

    float o[NT_O][4];
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;

    // per-lane ldmatrix offsets (elements within a buffer)
    const int mat = lane >> 3, mrow = lane & 7;
    const int k_lane = ((mat >> 1) * 8 + mrow) * LD + (mat & 1) * 8;   // K: 2 key n-tiles x (dims lo, hi)
    const int v_lane = ((mat & 1) * 8 + mrow) * LD + (mat >> 1) * 8;   // V: (keys lo, hi) x 2 dim n-tiles
    const int q_lane = (warp * 16 + (lane & 15)) * LD + (lane >> 4) * 8;

    const int n_kt = p_last / BN + 1;   // key tiles 0 .. the one holding p_last (causal skip beyond)
    load_kv(0, 0);
    cp_async_commit();
    for (int j = 0; j < n_kt; ++j) {
        const int kt = j * BN, buf = j & 1;
        if (j + 1 < n_kt) {
            load_kv(kt + BN, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if constexpr (FP8) {  // raw buffer buf -> the bf16 K and V tile (free since the previous iteration's barrier)
            const unsigned char* raw = reinterpret_cast<const unsigned char*>(smem) + S::RAW_OFFSET;
            const float* sc = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(smem)
                                                             + S::SCALE_OFFSET) + buf * 2 * BN;
            dequant_tile<HD, BN, S::LDB, LD, FP_THREADS>(Ks, raw + buf * S::RAW_TILE, sc);
            dequant_tile<HD, BN, S::LDB, LD, FP_THREADS>(Vs, raw + (2 + buf) * S::RAW_TILE, sc + BN);
            __syncthreads();
        }
        const int tb = FP8 ? 0 : buf;
        const unsigned kb = ks_base + (unsigned)(tb * S::KV_TILE * 2), vb = vs_base + (unsigned)(tb * S::KV_TILE * 2);

        // ---- scores: 16 rows x BN keys
        float s[NT_S][4];
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            unsigned a[4];
            if constexpr (S::Q_IN_REGS) {
                a[0] = qa[kk][0]; a[1] = qa[kk][1]; a[2] = qa[kk][2]; a[3] = qa[kk][3];
            } else {
                ldsm_x4(a, smem_addr(Qs) + (unsigned)((q_lane + kk * 16) * 2));
            }
#pragma unroll
            for (int np = 0; np < NT_S / 2; ++np) {
                unsigned b[4];
                ldsm_x4(b, kb + (unsigned)((k_lane + np * 16 * LD + kk * 16) * 2));
                mma_bf16(s[2 * np], a, b[0], b[1]);
                mma_bf16(s[2 * np + 1], a, b[2], b[3]);
            }
        }

        // ---- causal mask (only tiles reaching past the first query's position), row maxima
        if (kt + BN - 1 > p_first) {
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = kt + nt * 8 + tig * 2 + c;
                    if (key > pa) s[nt][c] = NEG_INF;
                    if (key > pb) s[nt][2 + c] = NEG_INF;
                }
        }
        float base_a, base_b;
        softmax_rescale<true>(s, sl, m_a, m_b, l_a, l_b, o, base_a, base_b);
        // ---- P (bf16 A fragments: score n-tiles 2k, 2k+1 make k-step k) and O += P V
#pragma unroll
        for (int k2 = 0; k2 < BN / 16; ++k2) {
            unsigned pf[4];
            softmax_p_fragment(s, k2, sl, base_a, base_b, l_a, l_b, pf);
#pragma unroll
            for (int dp = 0; dp < NT_O / 2; ++dp) {
                unsigned b[4];
                ldsm_x4_trans(b, vb + (unsigned)((v_lane + k2 * 16 * LD + dp * 16) * 2));
                mma_bf16(o[2 * dp], pf, b[0], b[1]);
                mma_bf16(o[2 * dp + 1], pf, b[2], b[3]);
            }
        }
        __syncthreads();  // this buffer is refilled by the next iteration's copy
    }

    // ---- normalise, gate, store
    flash_store_gated<HD>(o, l_a, l_b, ra, rb, tig, first, count, h, heads, out, gate, gate_stride,
                          gate_head_stride);
}

#define DEFINE(HD)                                                                                                \
    extern "C" __global__ void __launch_bounds__(FP_THREADS, 2) flash_prefill_bf16_hd##HD(                        \
        bf16_t* out, const bf16_t* q, long long q_stride, const bf16_t* gate, long long gate_stride,              \
        int gate_head_stride, const bf16_t* k_cache, const bf16_t* v_cache, const int* block_tables,              \
        int max_blocks_per_seq, const int* token_seq, const int* token_pos, const int* tiles, int heads,          \
        int kv_heads, int block_size, float scale) {                                                              \
        flash_prefill_impl<HD, false, bf16_t>(out, q, q_stride, gate, gate_stride, gate_head_stride, k_cache,     \
                                              v_cache, nullptr, nullptr, block_tables, max_blocks_per_seq,        \
                                              token_seq, token_pos, tiles, heads, kv_heads, block_size, scale);   \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(FP_THREADS, 2) flash_prefill_fp8_bf16_hd##HD(                    \
        bf16_t* out, const bf16_t* q, long long q_stride, const bf16_t* gate, long long gate_stride,              \
        int gate_head_stride, const unsigned char* k_cache, const unsigned char* v_cache, const float* k_scale,   \
        const float* v_scale, const int* block_tables, int max_blocks_per_seq, const int* token_seq,             \
        const int* token_pos, const int* tiles, int heads, int kv_heads, int block_size, float scale) {           \
        flash_prefill_impl<HD, true, unsigned char>(out, q, q_stride, gate, gate_stride, gate_head_stride,        \
                                                    k_cache, v_cache, k_scale, v_scale, block_tables,             \
                                                    max_blocks_per_seq, token_seq, token_pos, tiles, heads,       \
                                                    kv_heads, block_size, scale);                                 \
    }
DEFINE(64)
DEFINE(128)
DEFINE(256)
#undef DEFINE
