// The first tensor-core prefill attention (32-row tiles, 4 warps, plain shared-memory staging), kept only so that
// bench/cuda_attention_bench.py can compare flash_prefill.cu against it. Nothing in the engine launches it.
// Tiles: 32 rows (bench builds them); otherwise the same arguments as flash_prefill.
//
// Tiled causal attention for prefill chunks on the tensor cores (bf16 in, fp32 accumulate), over the paged cache.
//
// A tile is up to 32 consecutive query tokens of ONE sequence (host-built: tiles[t] = {first token, count}); the
// grid is (tiles, query heads) with 4 warps per block. Warps 0,1 own query rows 0-15 and warps 2,3 rows 16-31;
// within a pair each warp owns half of the head's output dims (so the O accumulator fits in registers) and both
// compute the same 16 x 32 score block. Keys stream through shared memory 32 at a time (K row-major, V
// transposed so that PV's B fragments are single 32-bit loads); online softmax in fp32; the causal mask uses each
// query's absolute position. Output = softmax(q k^T * scale) v * sigmoid(gate), like paged_attention+combine.
// mma.sync m16n8k16 fragment layouts follow the PTX ISA (groupID = lane / 4, tig = lane % 4).
#include "common.cuh"

#define FP_ROWS 32
#define FP_KEYS 32

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)from_f<bf16_t>(lo) | ((unsigned)from_f<bf16_t>(hi) << 16);
}

template <int HD>
__device__ void flash_prefill_v1_impl(bf16_t* out, const bf16_t* q, long long q_stride, const bf16_t* gate,
                                   long long gate_stride, int gate_head_stride, const bf16_t* k_cache,
                                   const bf16_t* v_cache, const int* block_tables, int max_blocks_per_seq,
                                   const int* token_seq, const int* token_pos, const int* tiles, int heads,
                                   int kv_heads, int block_size, float scale) {
    pdl_entry();
    constexpr int KSTEPS = HD / 16;      // k-steps of q k^T
    constexpr int NT_OUT = HD / 2 / 8;   // output n-tiles per warp (half the dims)
    __shared__ __align__(16) bf16_t Ks[FP_KEYS][HD + 8];   // +8: spread rows over banks
    __shared__ __align__(16) bf16_t Vt[HD][FP_KEYS + 8];
    const int tile = blockIdx.x, h = blockIdx.y;
    const int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int row0 = (warp >> 1) * 16;            // this warp's first query row in the tile
    const int dim0 = (warp & 1) * (HD / 2);       // this warp's first output dim
    const int kvh = h / (heads / kv_heads);
    const int seq = token_seq[first];
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const int p_last = token_pos[first + count - 1];
    const long long row_width = (long long)kv_heads * HD;

    // query rows g and g+8 of this warp: absolute positions (-1 = no such row)
    const int ra = row0 + g, rb = row0 + g + 8;
    const int pa = ra < count ? token_pos[first + ra] : -1;
    const int pb = rb < count ? token_pos[first + rb] : -1;

    unsigned qa[KSTEPS][4];
    {
        const unsigned* qra = (const unsigned*)(q + (first + (ra < count ? ra : 0)) * q_stride + (long long)h * HD);
        const unsigned* qrb = (const unsigned*)(q + (first + (rb < count ? rb : 0)) * q_stride + (long long)h * HD);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            qa[kk][0] = pa >= 0 ? qra[kk * 8 + tig] : 0u;
            qa[kk][1] = pb >= 0 ? qrb[kk * 8 + tig] : 0u;
            qa[kk][2] = pa >= 0 ? qra[kk * 8 + 4 + tig] : 0u;
            qa[kk][3] = pb >= 0 ? qrb[kk * 8 + 4 + tig] : 0u;
        }
    }
    float o[NT_OUT][4];
#pragma unroll
    for (int nt = 0; nt < NT_OUT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;

    for (int kt = 0; kt <= p_last; kt += FP_KEYS) {
        // ---- stage 32 keys: K rows as they are, V transposed (16-byte global loads)
        constexpr int CHUNKS = FP_KEYS * HD / 8;
        for (int c = threadIdx.x; c < CHUNKS; c += blockDim.x) {
            const int key = c / (HD / 8), d8 = (c % (HD / 8)) * 8;
            const int kp = kt + key;
            uint4 kv4 = make_uint4(0u, 0u, 0u, 0u), vv4 = make_uint4(0u, 0u, 0u, 0u);
            if (kp <= p_last) {
                const long long slot = (long long)table[kp / block_size] * block_size + kp % block_size;
                const long long off = slot * row_width + (long long)kvh * HD + d8;
                kv4 = *(const uint4*)(k_cache + off);
                vv4 = *(const uint4*)(v_cache + off);
            }
            *(uint4*)&Ks[key][d8] = kv4;
            const bf16_t* vv = (const bf16_t*)&vv4;
#pragma unroll
            for (int i = 0; i < 8; ++i) Vt[d8 + i][key] = vv[i];
        }
        __syncthreads();
        // ---- scores for 16 rows x 32 keys
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                const unsigned b0 = *(const unsigned*)&Ks[j * 8 + g][kk * 16 + tig * 2];
                const unsigned b1 = *(const unsigned*)&Ks[j * 8 + g][kk * 16 + 8 + tig * 2];
                mma_bf16(s[j], qa[kk], b0, b1);
            }
        }
        // ---- mask, online softmax (rows g and g+8; the 4 lanes of a group share a row)
        float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int key = kt + j * 8 + tig * 2 + c;
                s[j][c] = key <= pa ? s[j][c] * scale : NEG_INF;
                s[j][2 + c] = key <= pb ? s[j][2 + c] * scale : NEG_INF;
                mx_a = fmaxf(mx_a, s[j][c]);
                mx_b = fmaxf(mx_b, s[j][2 + c]);
            }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
        }
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        const float use_a = mn_a == NEG_INF ? 0.0f : mn_a, use_b = mn_b == NEG_INF ? 0.0f : mn_b;
        const float corr_a = expf(m_a - use_a), corr_b = expf(m_b - use_b);
        m_a = mn_a;
        m_b = mn_b;
        l_a *= corr_a;
        l_b *= corr_b;
#pragma unroll
        for (int nt = 0; nt < NT_OUT; ++nt) {
            o[nt][0] *= corr_a;
            o[nt][1] *= corr_a;
            o[nt][2] *= corr_b;
            o[nt][3] *= corr_b;
        }
        unsigned pa_frag[2][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p0 = expf(s[j][0] - use_a), p1 = expf(s[j][1] - use_a);
            const float p2 = expf(s[j][2] - use_b), p3 = expf(s[j][3] - use_b);
            l_a += p0 + p1;
            l_b += p2 + p3;
            // score n-tile j -> A fragment of k-step j/2 (P columns = keys)
            pa_frag[j >> 1][(j & 1) * 2 + 0] = pack_bf16(p0, p1);
            pa_frag[j >> 1][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
        }
        // ---- O += P V over this warp's dims
#pragma unroll
        for (int nt = 0; nt < NT_OUT; ++nt) {
            const int d = dim0 + nt * 8 + g;
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
                const unsigned b0 = *(const unsigned*)&Vt[d][k2 * 16 + tig * 2];
                const unsigned b1 = *(const unsigned*)&Vt[d][k2 * 16 + 8 + tig * 2];
                mma_bf16(o[nt], pa_frag[k2], b0, b1);
            }
        }
        __syncthreads();  // Ks / Vt are refilled next
    }
    // ---- normalise, gate, store
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rb : ra;
        if (r >= count) continue;
        const long long tok = first + r;
        const float inv_l = 1.0f / (half ? l_b : l_a);
        const bf16_t* gh = gate + tok * gate_stride + (long long)h * gate_head_stride;
        bf16_t* oh = out + tok * heads * HD + (long long)h * HD;
#pragma unroll
        for (int nt = 0; nt < NT_OUT; ++nt) {
            const int d = dim0 + nt * 8 + tig * 2;
#pragma unroll
            for (int c = 0; c < 2; ++c)
                oh[d + c] = from_f<bf16_t>(o[nt][half * 2 + c] * inv_l * sigmoidf(to_f(gh[d + c])));
        }
    }
}

// pa_frag layout check: A fragment regs are {a0a1: row g, k 0-7 part; a2a3: row g+8; a4a5: row g, k 8-15;
// a6a7: row g+8}. Score n-tile 2*k2 holds keys k2*16 + 0..7 and n-tile 2*k2+1 keys k2*16 + 8..15, so tile j
// fills regs (j&1)*2 + {0: row g, 1: row g+8} of k-step j/2.

#define DEFINE(HD)                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) flash_prefill_v1_bf16_hd##HD(                               \
        bf16_t* out, const bf16_t* q, long long q_stride, const bf16_t* gate, long long gate_stride,              \
        int gate_head_stride, const bf16_t* k_cache, const bf16_t* v_cache, const int* block_tables,              \
        int max_blocks_per_seq, const int* token_seq, const int* token_pos, const int* tiles, int heads,          \
        int kv_heads, int block_size, float scale) {                                                              \
        flash_prefill_v1_impl<HD>(out, q, q_stride, gate, gate_stride, gate_head_stride, k_cache, v_cache,        \
                               block_tables, max_blocks_per_seq, token_seq, token_pos, tiles, heads, kv_heads,    \
                               block_size, scale);                                                                \
    }
DEFINE(64)
DEFINE(128)
DEFINE(256)
#undef DEFINE
