// Paged attention for the full-attention layers (decode and varlen prefill alike).
//
// KV cache of one layer: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; a token at absolute
// position p of a sequence lives in block block_table[p / block_size], row p % block_size.
//
// kv_store: writes this step's K and V rows into their cache slots (slot = block * block_size + row).
// paged_attention: one block of 4 warps per (query token, query head, key split). Query token i of the batch
//   belongs to sequence token_seq[i] and sits at absolute position token_pos[i]; it attends causally to cache
//   positions 0..token_pos[i] (its own chunk included, so kv_store runs first), cut into gridDim.z equal key
//   ranges (split-K, so that a decode step with a handful of queries still fills the GPU). GQA: query head h
//   reads kv head h / (heads / kv_heads). The 4 warps take groups of 4 consecutive keys in turn, each with a
//   running (max, sum, acc) online softmax; the block writes its merged partial state to a float32 workspace.
// attention_combine: merges the splits and multiplies by sigmoid(gate) (Qwen3.5's attention output gate), read
//   in place from the fused q|gate projection (gate_stride per token, gate_head_stride per head).
// Lane l owns dims l, l+32, l+64, ... (coalesced across the warp); head_dim at most 256.
// FP8 KV cache (fp8_kv.cuh, opt-in): the *_fp8 entries take e4m3 caches with float32 scales k_scale, v_scale
//   [num_blocks, block_size, kv_heads]; qk_norm_rope_store_fp8 quantises K and V as it writes them, the per-head
//   kernel widens bytes as it reads them and paged_attention_mma_fp8 (paged_mma_fp8.cuh) builds its mma operands
//   from the staged e4m3 rows in registers, scales applied per key (the grouped kernel has no FP8 form: the host
//   refuses it).
// Not tiled: prefill cost is one pass over the keys per query row. bf16 prefill steps whose longest chunk has 32+
// tokens use the tiled tensor-core kernel instead (flash_prefill.cu); this one serves decode, short chunks and fp32.
#include "common.cuh"
#include "tensor_core.cuh"
#include "fp8_kv.cuh"

#define MAX_PER_LANE 8
#define ATT_WARPS 4
#define KEY_GROUP 4

template <typename T>
__device__ void kv_store_impl(T* k_cache, T* v_cache, const T* k, long long k_stride, const T* v, long long v_stride,
                              const int* slots, int n, int kv_heads, int head_dim) {
    pdl_entry();
    const int token = blockIdx.x;
    if (token >= n) return;
    const long long slot = slots[token];
    const int width = kv_heads * head_dim;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_cache[slot * width + i] = k[token * k_stride + i];
        v_cache[slot * width + i] = v[token * v_stride + i];
    }
}

// a cached element as float: the compute dtype as stored, or e4m3 times its row's scale
template <typename T> __device__ __forceinline__ float kv_at(const T* c, long long i, float) { return to_f(c[i]); }
__device__ __forceinline__ float kv_at(const unsigned char* c, long long i, float s) { return e4m3_to_f(c[i]) * s; }

template <typename T, typename C>
__device__ void paged_attention_impl(float* part_acc, float* part_ml, const T* q, long long q_stride,
                                     const C* k_cache, const C* v_cache, const float* k_scale,
                                     const float* v_scale, const int* block_tables,
                                     int max_blocks_per_seq, const int* token_seq, const int* token_pos, int n,
                                     int heads, int kv_heads, int head_dim, int block_size, float scale) {
    pdl_entry();
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][MAX_PER_LANE * 32];
    const int token = blockIdx.x, h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    if (token >= n || h >= heads) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads);
    const int seq = token_seq[token], last = token_pos[token];
    // this block's share of keys 0..last (split-K: decode has few queries, so the keys are spread over blocks)
    const int per_split = (last + splits) / splits;
    const int lo = split * per_split, hi = min(last + 1, lo + per_split);
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const long long row_width = (long long)kv_heads * head_dim;

    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
    const T* qh = q + token * q_stride + (long long)h * head_dim;
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e) {
        const int d = lane + 32 * e;
        qv[e] = d < head_dim ? to_f(qh[d]) * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    // Each warp takes KEY_GROUP consecutive keys per step: their loads are independent, so they are in flight
    // together (decode is latency-bound: one key per step left the memory system idle between keys).
    for (int base = lo + warp * KEY_GROUP; base < hi; base += ATT_WARPS * KEY_GROUP) {
        float s[KEY_GROUP], vs[KEY_GROUP];
        long long off[KEY_GROUP];
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) {
            const int p = min(base + g, hi - 1);  // clamp: rows past hi are loaded but masked below
            const long long slot = (long long)table[p / block_size] * block_size + p % block_size;
            off[g] = slot * row_width + (long long)kvh * head_dim;
            const long long row = slot * kv_heads + kvh;  // scale index (FP8 caches only)
            const float ks = k_scale != nullptr ? k_scale[row] : 1.0f;
            vs[g] = v_scale != nullptr ? v_scale[row] : 1.0f;
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < MAX_PER_LANE; ++e)
                if (lane + 32 * e < head_dim) dot += qv[e] * kv_at(k_cache, off[g] + lane + 32 * e, ks);
            s[g] = dot;
        }
        float m_new = m;
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) {
            s[g] = base + g < hi ? warp_sum(s[g]) : NEG_INF;
            m_new = fmaxf(m_new, s[g]);
        }
        const float corr = expf(m - m_new);  // 0 on the first group (m = -inf)
        l *= corr;
#pragma unroll
        for (int e = 0; e < MAX_PER_LANE; ++e) acc[e] *= corr;
#pragma unroll
        for (int g = 0; g < KEY_GROUP; ++g) {
            const float pw = expf(s[g] - m_new);  // 0 for masked rows
            l += pw;
#pragma unroll
            for (int e = 0; e < MAX_PER_LANE; ++e)
                if (lane + 32 * e < head_dim) acc[e] += pw * kv_at(v_cache, off[g] + lane + 32 * e, vs[g]);
        }
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; ++e)
        if (lane + 32 * e < head_dim) s_acc[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    float m_blk = NEG_INF;
    for (int w = 0; w < ATT_WARPS; ++w) m_blk = fmaxf(m_blk, s_m[w]);
    // partial state of this split: (max, sum) and the unnormalised accumulator, all relative to m_blk
    const long long part = ((long long)token * heads + h) * splits + split;
    if (threadIdx.x == 0) {
        float l_blk = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) l_blk += s_m[w] == NEG_INF ? 0.0f : s_l[w] * expf(s_m[w] - m_blk);
        part_ml[2 * part] = m_blk;
        part_ml[2 * part + 1] = l_blk;
    }
    float* pa = part_acc + part * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w)
            if (s_m[w] != NEG_INF) o += s_acc[w][d] * expf(s_m[w] - m_blk);
        pa[d] = o;
    }
}

// paged_attention_gqa: the same function as paged_attention, one block of 4 warps per (query token, KV head, key
//   split) instead of per query head. The G = heads / kv_heads query heads that share a KV head are computed
//   together, so each K and V row is read once for all of them (paged_attention reads it G times), and a row is
//   read with 16-byte loads: lane r of a "team" of R = head_dim / 8 lanes holds dims 8r..8r+7, so a warp covers
//   32 / R keys per load (one key at head_dim 256, two at 128). Each team keeps its own online softmax per head;
//   teams, then warps, are merged at the end, and the block writes the same partial state as paged_attention
//   (attention_combine merges the splits). Needs head_dim in {8, 16, ..., 256} (a power of two) and 16-byte
//   aligned rows; the host falls back to paged_attention otherwise.
#define GQA_DIMS 8       // dims per lane
#define GQA_KEY_STEPS 4  // warp load steps in flight per iteration
#define GQA_MIN_BLOCKS 3 // blocks per SM the register budget must allow (loads in flight hide HBM latency)

// Eight consecutive elements of a row, kept as loaded (bf16: one 16-byte register quad) and widened on use: the
// raw form halves the registers that q and the in-flight K/V rows take, which buys occupancy.
template <typename T> struct Row8;
template <> struct Row8<bf16_t> {
    uint4 u;
    __device__ __forceinline__ void load(const bf16_t* p) { u = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ float at(int i) const {  // i is a constant after unrolling: selects fold away
        const unsigned int w = i < 2 ? u.x : i < 4 ? u.y : i < 6 ? u.z : u.w;
        return __uint_as_float((i & 1) ? (w & 0xffff0000u) : (w << 16));
    }
};
template <> struct Row8<float> {
    float4 a, b;
    __device__ __forceinline__ void load(const float* p) {
        a = *reinterpret_cast<const float4*>(p);
        b = *reinterpret_cast<const float4*>(p + 4);
    }
    __device__ __forceinline__ float at(int i) const {
        const float4& h = i < 4 ? a : b;
        const int j = i & 3;
        return j == 0 ? h.x : j == 1 ? h.y : j == 2 ? h.z : h.w;
    }
};

template <typename T, int G>
__device__ void paged_attention_gqa_impl(float* part_acc, float* part_ml, const T* q, long long q_stride,
                                         const T* k_cache, const T* v_cache, const int* block_tables,
                                         int max_blocks_per_seq, const int* token_seq, const int* token_pos, int n,
                                         int kv_heads, int head_dim, int block_size, float scale) {
    pdl_entry();
    __shared__ float s_m[ATT_WARPS][G], s_l[ATT_WARPS][G];
    __shared__ float s_acc[ATT_WARPS][G][256];
    const int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    if (token >= n || kvh >= kv_heads) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int R = head_dim / GQA_DIMS, keys_per_load = 32 / R;
    const int team = lane / R, r = lane % R;
    const int seq = token_seq[token], last = token_pos[token];
    const int per_split = (last + splits) / splits;
    const int lo = split * per_split, hi = min(last + 1, lo + per_split);
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const long long row_width = (long long)kv_heads * head_dim;
    const long long head_off = (long long)kvh * head_dim + r * GQA_DIMS;

    Row8<T> qv[G];
    float acc[G][GQA_DIMS], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        qv[g].load(q + token * q_stride + (long long)(kvh * G + g) * head_dim + r * GQA_DIMS);
#pragma unroll
        for (int d = 0; d < GQA_DIMS; ++d) acc[g][d] = 0.0f;
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    const int keys_per_warp_iter = GQA_KEY_STEPS * keys_per_load;
    for (int base = lo + warp * keys_per_warp_iter; base < hi; base += ATT_WARPS * keys_per_warp_iter) {
        Row8<T> kr[GQA_KEY_STEPS], vr[GQA_KEY_STEPS];
        bool valid[GQA_KEY_STEPS];
#pragma unroll
        for (int j = 0; j < GQA_KEY_STEPS; ++j) {  // every load of the iteration is issued before any is used
            const int p = base + j * keys_per_load + team;
            valid[j] = p < hi;
            const int pc = min(p, hi - 1);
            const long long off = ((long long)table[pc / block_size] * block_size + pc % block_size) * row_width
                                  + head_off;
            kr[j].load(k_cache + off);
            vr[j].load(v_cache + off);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float s[GQA_KEY_STEPS];
            float m_new = m[g];
#pragma unroll
            for (int j = 0; j < GQA_KEY_STEPS; ++j) {
                float dot = 0.0f;
#pragma unroll
                for (int d = 0; d < GQA_DIMS; ++d) dot += qv[g].at(d) * kr[j].at(d);
                for (int o = R >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);  // within the team
                s[j] = valid[j] ? dot * scale : NEG_INF;
                m_new = fmaxf(m_new, s[j]);
            }
            if (m_new == NEG_INF) continue;  // no key of this team yet
            const float corr = expf(m[g] - m_new);  // 0 while m = -inf
            l[g] *= corr;
#pragma unroll
            for (int d = 0; d < GQA_DIMS; ++d) acc[g][d] *= corr;
#pragma unroll
            for (int j = 0; j < GQA_KEY_STEPS; ++j) {
                const float pw = expf(s[j] - m_new);  // 0 for masked keys
                l[g] += pw;
#pragma unroll
                for (int d = 0; d < GQA_DIMS; ++d) acc[g][d] += pw * vr[j].at(d);
            }
            m[g] = m_new;
        }
    }
    // merge the teams of the warp (lanes r, r + R, r + 2R, ... hold the same dims for different keys)
    for (int o = R; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_o = __shfl_xor_sync(0xffffffffu, m[g], o), l_o = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float m_new = fmaxf(m[g], m_o);
            const float a = m[g] == NEG_INF ? 0.0f : expf(m[g] - m_new);
            const float b = m_o == NEG_INF ? 0.0f : expf(m_o - m_new);
            l[g] = l[g] * a + l_o * b;
#pragma unroll
            for (int d = 0; d < GQA_DIMS; ++d) {
                const float acc_o = __shfl_xor_sync(0xffffffffu, acc[g][d], o);
                acc[g][d] = acc[g][d] * a + acc_o * b;
            }
            m[g] = m_new;
        }
    }
    if (team == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (r == 0) {
                s_m[warp][g] = m[g];
                s_l[warp][g] = l[g];
            }
#pragma unroll
            for (int d = 0; d < GQA_DIMS; ++d) s_acc[warp][g][r * GQA_DIMS + d] = acc[g][d];
        }
    }
    __syncthreads();
    const int heads = kv_heads * G;
    for (int i = threadIdx.x; i < G * head_dim; i += blockDim.x) {
        const int g = i / head_dim, d = i % head_dim;
        float m_blk = NEG_INF;
        for (int w = 0; w < ATT_WARPS; ++w) m_blk = fmaxf(m_blk, s_m[w][g]);
        const long long part = ((long long)token * heads + kvh * G + g) * splits + split;
        float o = 0.0f, l_blk = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) {
            if (s_m[w][g] == NEG_INF) continue;
            const float c = expf(s_m[w][g] - m_blk);
            o += s_acc[w][g][d] * c;
            l_blk += s_l[w][g] * c;
        }
        part_acc[part * head_dim + d] = o;
        if (d == 0) {
            part_ml[2 * part] = m_blk;
            part_ml[2 * part + 1] = l_blk;
        }
    }
}

// paged_attention_mma: the same function as paged_attention_gqa (bf16 only), on the tensor cores. Measured at
//   9B shapes, 192 x 8k contexts (bench/results/cuda_notes.md, session 7), paged_attention_gqa reads K/V at ~40% of
//   the copy rate whatever its key splits: it is bound by instructions (five shuffles per key and query head for
//   the dot products, bf16 unpacking), not by bytes in flight. Here one block of PM_WARPS warps per (query token,
//   KV head, key split) streams PM_BN keys at a time through shared memory (cp.async, PM_STAGES buffers, rows
//   padded by 16 bytes), and each warp owns 16 keys of a stage:
//     S^T [16 keys x 8 heads] = K Q^T   (mma m16n8k16: A = K from ldmatrix, B = the G <= 8 query heads sharing
//                                        the KV head, in registers; heads past G are zero columns)
//     online softmax per head over the warp's keys (exp2 domain, running max shared by the warp's 8 groups)
//     O^T [head_dim x 8 heads] += V^T P^T  (A = V from ldmatrix.trans, B = P^T staged as bf16 through 256 bytes of
//                                        shared memory per warp and read back with ldmatrix.trans)
//   The warps' states are merged through shared memory at the end and written in paged_attention's partial form
//   (max in scale * score units, sum, unnormalised accumulator), so attention_combine is unchanged. Keys past the
//   split's end are zero-filled (a NaN-free V) and masked to -inf. P is rounded to bf16 for the PV product, as in
//   flash_prefill. Needs bf16, G <= 8, head_dim in {64, 128, 256} and 16-byte aligned rows (ops.paged_mma_fits).
#define PM_WARPS 4
#define PM_BN (16 * PM_WARPS)  // keys per pipeline stage: 16 per warp
#define PM_STAGES 3            // stages in flight: 2 tiles load while one is used
#define PM_PAD 8               // bf16 elements of padding per shared row (16 bytes: ldmatrix rows hit 8 bank groups)
#include "paged_mma_common.cuh"

template <int HD> struct PagedMmaShape {
    static constexpr int LD = HD + PM_PAD;
    static constexpr int KV_TILE = PM_BN * LD;                             // elements of one K (or V) stage
    static constexpr int PIPE_BYTES = PM_STAGES * 2 * KV_TILE * 2;
    static constexpr int MERGE_BYTES = PM_WARPS * 8 * (HD + 2) * 4;        // reuses the pipeline after the loop
    static constexpr int P_OFFSET = PIPE_BYTES > MERGE_BYTES ? PIPE_BYTES : MERGE_BYTES;
    static constexpr int SMEM_BYTES = P_OFFSET + PM_WARPS * 16 * 8 * 2;  // + P^T [16 keys][8 heads] per warp
};  // SMEM_BYTES must equal ops.paged_mma_shared_bytes(HD)

template <int HD>
__device__ void paged_attention_mma_impl(float* part_acc, float* part_ml, const bf16_t* q, long long q_stride,
                                         const bf16_t* k_cache, const bf16_t* v_cache, const int* block_tables,
                                         int max_blocks_per_seq, const int* token_seq, const int* token_pos, int n,
                                         int kv_heads, int group, int block_size, float scale) {
    using S = PagedMmaShape<HD>;
    constexpr int LD = S::LD, KSTEPS = HD / 16, MT_O = HD / 16, THREADS = PM_WARPS * 32;
    constexpr int CHUNKS_PER_ROW = HD / 8, ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;
    static_assert(THREADS % CHUNKS_PER_ROW == 0 && PM_BN % ROWS_PER_PASS == 0, "copy layout");
    extern __shared__ __align__(16) bf16_t smem[];
    pdl_entry();
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)S::SMEM_BYTES) __trap();  // host/kernel mismatch
    const int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    if (token >= n || kvh >= kv_heads) return;  // whole block: before any barrier
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    const int seq = token_seq[token], last = token_pos[token];
    const PmSplit keys = pm_split(last, split, splits);
    const int lo = keys.lo, hi = keys.hi, n_tiles = keys.n_tiles;
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const long long row_width = (long long)kv_heads * HD;
    const float sl = scale * 1.4426950408889634f;  // scores -> exp2 domain

    // B fragments of Q^T (k = dims, n = heads): lane (g, tig) holds head g's dims 16ks + 2tig (+1) and + 8 (+9)
    unsigned qb[KSTEPS][2];
    {
        const bool head_ok = g < group;
        const unsigned* qr = (const unsigned*)(q + token * q_stride + (long long)(kvh * group + (head_ok ? g : 0)) * HD);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            qb[ks][0] = head_ok ? qr[ks * 8 + tig] : 0u;
            qb[ks][1] = head_ok ? qr[ks * 8 + 4 + tig] : 0u;
        }
    }

    const unsigned ks_base = smem_addr(smem), vs_base = ks_base + PM_STAGES * S::KV_TILE * 2;
    const unsigned ps_base = smem_addr(smem) + S::P_OFFSET + warp * 16 * 8 * 2;
    const int copy_row0 = threadIdx.x / CHUNKS_PER_ROW, copy_d8 = (threadIdx.x % CHUNKS_PER_ROW) * 8;
    const bf16_t* k_head = k_cache + (long long)kvh * HD + copy_d8;
    const bf16_t* v_head = v_cache + (long long)kvh * HD + copy_d8;
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    auto load_kv = [&](int t, int buf) {  // keys lo + t * PM_BN .. of this split into stage `buf`
        const int k0 = lo + t * PM_BN;
#pragma unroll
        for (int i = 0; i < PM_BN / ROWS_PER_PASS; ++i) {
            const int r = copy_row0 + i * ROWS_PER_PASS, kp = k0 + r;
            const bool valid = kp < hi;
            long long off = 0;
            if (valid) off = pm_slot(table, kp, block_size, bs_pow2, bs_shift) * row_width;
            const unsigned so = (unsigned)((buf * S::KV_TILE + r * LD + copy_d8) * 2);
            cp_async16(ks_base + so, k_head + off, valid ? 16 : 0);
            cp_async16(vs_base + so, v_head + off, valid ? 16 : 0);
        }
    };
    // per-lane ldmatrix offsets (elements within a stage): K as A (keys lo/hi x dims lo/hi), V^T as A via .trans
    // (matrices: dims lo/hi x keys lo/hi), P^T as B via .trans (keys lo/hi)
    const int mat = lane >> 3, mrow = lane & 7;
    const int k_lane = (warp * 16 + (lane & 15)) * LD + (lane >> 4) * 8;
    const int v_lane = (warp * 16 + (mat >> 1) * 8 + mrow) * LD + (mat & 1) * 8;
    const unsigned p_lane = ps_base + (unsigned)((lane & 15) * 8 * 2);

    float o[MT_O][4];
#pragma unroll
    for (int mt = 0; mt < MT_O; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;  // heads 2 tig and 2 tig + 1 (raw dot units)

    pm_pipeline_fill<PM_STAGES>(n_tiles, load_kv);
    for (int t = 0; t < n_tiles; ++t) {
        pm_pipeline_next<PM_STAGES>(t, n_tiles, load_kv);
        const int buf = t % PM_STAGES;
        float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // two chains of mma
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned a[4];
            ldsm_x4(a, ks_base + (unsigned)((buf * S::KV_TILE + k_lane + ks * 16) * 2));
            mma_bf16((ks & 1) ? sb : sa, a, qb[ks][0], qb[ks][1]);
        }
        // lane (g, tig): keys g and g + 8 of the warp's 16, heads 2 tig (s0, s2) and 2 tig + 1 (s1, s3)
        const int key_a = lo + t * PM_BN + warp * 16 + g;
        const bool va = key_a < hi, vb = key_a + 8 < hi;
        const float s0 = va ? sa[0] + sb[0] : NEG_INF, s1 = va ? sa[1] + sb[1] : NEG_INF;
        const float s2 = vb ? sa[2] + sb[2] : NEG_INF, s3 = vb ? sa[3] + sb[3] : NEG_INF;
        float mx0 = fmaxf(m0, fmaxf(s0, s2)), mx1 = fmaxf(m1, fmaxf(s1, s3));
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {  // over the 8 groups: the warp's 16 keys
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float base0 = mx0 == NEG_INF ? 0.0f : mx0 * sl, base1 = mx1 == NEG_INF ? 0.0f : mx1 * sl;
        const float corr0 = exp2_ftz(m0 * sl - base0), corr1 = exp2_ftz(m1 * sl - base1);  // 0 while m = -inf
        m0 = mx0;
        m1 = mx1;
        const float p0 = exp2_ftz(fmaf(s0, sl, -base0)), p1 = exp2_ftz(fmaf(s1, sl, -base1));
        const float p2 = exp2_ftz(fmaf(s2, sl, -base0)), p3 = exp2_ftz(fmaf(s3, sl, -base1));
        l0 = l0 * corr0 + p0 + p2;
        l1 = l1 * corr1 + p1 + p3;
        // P^T [key][head] through shared memory, back as the B fragment (k = keys, n = heads)
        pm_stage_pt(ps_base, g, tig, p0, p1, p2, p3);
        unsigned pb[2];
        ldsm_x2_trans(pb, p_lane);
#pragma unroll
        for (int mt = 0; mt < MT_O; ++mt) {  // O^T m-tile mt: dims 16 mt + g (o0, o1), + 8 (o2, o3)
            pm_rescale(o[mt], corr0, corr1);
            unsigned a[4];
            ldsm_x4_trans(a, vs_base + (unsigned)((buf * S::KV_TILE + v_lane + mt * 16) * 2));
            mma_bf16(o[mt], a, pb[0], pb[1]);
        }
    }
    pm_merge_write<HD, 8>(smem, o, m0, m1, l0, l1, [=](int mt) { return 16 * mt + g; }, warp, g, tig, part_acc,
                          part_ml, token, kvh, kv_heads, group, split, splits, sl, scale);
}

// paged_attention_mma_fp8_impl: the same kernel over an FP8 KV cache
#include "paged_mma_fp8.cuh"

// Merge the splits of each (token, head) and apply the output gate: out = (sum_s acc_s e^{m_s - M}) /
// (sum_s l_s e^{m_s - M}) * sigmoid(gate). Splits that saw no key have m = -inf and drop out.
template <typename T>
__device__ void attention_combine_impl(T* out, const float* part_acc, const float* part_ml, int splits,
                                       const T* gate, long long gate_stride, int gate_head_stride, int n, int heads,
                                       int head_dim) {
    pdl_entry();
    const int token = blockIdx.x, h = blockIdx.y;
    if (token >= n || h >= heads) return;
    const long long base = ((long long)token * heads + h) * splits;
    float m_all = NEG_INF;
    for (int s = 0; s < splits; ++s) m_all = fmaxf(m_all, part_ml[2 * (base + s)]);
    float l_all = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float ms = part_ml[2 * (base + s)];
        if (ms != NEG_INF) l_all += part_ml[2 * (base + s) + 1] * expf(ms - m_all);
    }
    const T* gh = gate + token * gate_stride + (long long)h * gate_head_stride;
    T* oh = out + (long long)token * heads * head_dim + (long long)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float ms = part_ml[2 * (base + s)];
            if (ms != NEG_INF) o += part_acc[(base + s) * head_dim + d] * expf(ms - m_all);
        }
        oh[d] = from_f<T>(o / l_all * sigmoidf(to_f(gh[d])));
    }
}

// qk_norm_rope_store: the whole "prepare q and k" stage of a full-attention layer in one launch (it was five).
//   proj rows hold [q_0 gate_0 q_1 gate_1 ... | k_0 .. k_{KV-1} | v_0 .. v_{KV-1}] (head_dim each). One block per
//   (token, head) with heads + kv_heads heads: zero-centred RMSNorm with q_norm / k_norm, rotate-half rotary on
//   the first rot_dim dims (tables as in rope.cu), then q -> q_out [n, heads*head_dim], k and v -> their cache
//   slot. The gate stays in proj, read later by attention_combine. FP8 caches (C = unsigned char): the k / v row is
//   rounded to T as the T cache would hold it, then quantised (fp8_kv.cuh) with its scale into k_scale / v_scale.
template <typename T, typename C>
__device__ void qk_norm_rope_store_impl(T* q_out, C* k_cache, C* v_cache, float* k_scale, float* v_scale,
                                        const T* proj, long long proj_stride,
                                        const T* q_norm_w, const T* k_norm_w, const int* pos, int pos_row_stride,
                                        const float* inv_freq, const int* axis, const int* slots, int n, int heads,
                                        int kv_heads, int head_dim, int rot_dim, float eps, float offset) {
    pdl_entry();
    constexpr bool FP8 = sizeof(C) == 1;
    __shared__ float xs[MAX_PER_LANE * 32], scratch[32];
    __shared__ float ks_row[FP8 ? MAX_PER_LANE * 32 : 1], vs_row[FP8 ? MAX_PER_LANE * 32 : 1];
    const int tok = blockIdx.x, hh = blockIdx.y;
    if (tok >= n) return;
    const bool is_q = hh < heads;
    const int kvh = hh - heads;
    const T* src = proj + tok * proj_stride + (is_q ? (long long)hh * 2 * head_dim
                                                     : (long long)(2 * heads + kvh) * head_dim);
    const T* w = is_q ? q_norm_w : k_norm_w;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const float v = to_f(src[d]);
        xs[d] = v;
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)head_dim + eps);  // its barriers publish xs
    const int half = rot_dim / 2;
    const long long slot = is_q ? 0 : (long long)slots[tok];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const float x = xs[d] * inv * (offset + to_f(w[d]));
        float y = x;
        if (d < rot_dim) {
            const int j = d < half ? d : d - half;
            const int partner = d < half ? d + half : d - half;
            const float xp = xs[partner] * inv * (offset + to_f(w[partner]));
            float sn, cs;
            sincosf((float)pos[axis[j] * pos_row_stride + tok] * inv_freq[j], &sn, &cs);
            y = d < half ? x * cs - xp * sn : x * cs + xp * sn;
        }
        if (is_q) {
            q_out[(long long)tok * heads * head_dim + (long long)hh * head_dim + d] = from_f<T>(y);
        } else if constexpr (FP8) {
            ks_row[d] = to_f(from_f<T>(y));
            vs_row[d] = to_f(src[(long long)kv_heads * head_dim + d]);
        } else {
            const long long dst = (slot * kv_heads + kvh) * head_dim + d;
            k_cache[dst] = from_f<T>(y);
            v_cache[dst] = src[(long long)kv_heads * head_dim + d];  // v sits kv_heads heads after k
        }
    }
    if constexpr (FP8) {
        if (is_q) return;  // whole block
        float ka = 0.0f, va = 0.0f;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {  // each thread reads back what it wrote
            ka = fmaxf(ka, fabsf(ks_row[d]));
            va = fmaxf(va, fabsf(vs_row[d]));
        }
        const float k_s = kv_scale_of(block_max(ka, scratch)), v_s = kv_scale_of(block_max(va, scratch));
        const long long row = slot * kv_heads + kvh;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            k_cache[row * head_dim + d] = e4m3_from_f(ks_row[d] / k_s);
            v_cache[row * head_dim + d] = e4m3_from_f(vs_row[d] / v_s);
        }
        if (threadIdx.x == 0) {
            k_scale[row] = k_s;
            v_scale[row] = v_s;
        }
    }
}

#define DEFINE(S, T)                                                                                             \
    extern "C" __global__ void kv_store_##S(T* k_cache, T* v_cache, const T* k, long long k_stride, const T* v,   \
                                            long long v_stride, const int* slots, int n, int kv_heads,            \
                                            int head_dim) {                                                      \
        kv_store_impl<T>(k_cache, v_cache, k, k_stride, v, v_stride, slots, n, kv_heads, head_dim);               \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) paged_attention_##S(                             \
        float* part_acc, float* part_ml, const T* q, long long q_stride, const T* k_cache, const T* v_cache,      \
        const int* block_tables, int max_blocks_per_seq, const int* token_seq, const int* token_pos, int n,      \
        int heads, int kv_heads, int head_dim, int block_size, float scale) {                                    \
        paged_attention_impl<T, T>(part_acc, part_ml, q, q_stride, k_cache, v_cache, nullptr, nullptr, block_tables,                   \
                                max_blocks_per_seq, token_seq, token_pos, n, heads, kv_heads, head_dim,           \
                                block_size, scale);                                                              \
    }                                                                                                            \
    extern "C" __global__ void attention_combine_##S(T* out, const float* part_acc, const float* part_ml,         \
                                                     int splits, const T* gate, long long gate_stride,            \
                                                     int gate_head_stride, int n, int heads, int head_dim) {      \
        attention_combine_impl<T>(out, part_acc, part_ml, splits, gate, gate_stride, gate_head_stride, n, heads,  \
                                  head_dim);                                                                     \
    }                                                                                                            \
    extern "C" __global__ void qk_norm_rope_store_##S(                                                            \
        T* q_out, T* k_cache, T* v_cache, const T* proj, long long proj_stride, const T* q_norm_w,               \
        const T* k_norm_w, const int* pos, int pos_row_stride, const float* inv_freq, const int* axis,           \
        const int* slots, int n, int heads, int kv_heads, int head_dim, int rot_dim, float eps, float offset) {  \
        qk_norm_rope_store_impl<T, T>(q_out, k_cache, v_cache, nullptr, nullptr, proj, proj_stride, q_norm_w,     \
                                      k_norm_w, pos,                                                             \
                                   pos_row_stride, inv_freq, axis, slots, n, heads, kv_heads, head_dim, rot_dim, \
                                   eps, offset);                                                                 \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE

// FP8 KV cache entries (q, gate and outputs in T; caches e4m3 bytes + float32 scales)
#define DEFINE_FP8(S, T)                                                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) paged_attention_fp8_##S(                         \
        float* part_acc, float* part_ml, const T* q, long long q_stride, const unsigned char* k_cache,            \
        const unsigned char* v_cache, const float* k_scale, const float* v_scale, const int* block_tables,       \
        int max_blocks_per_seq, const int* token_seq, const int* token_pos, int n, int heads, int kv_heads,      \
        int head_dim, int block_size, float scale) {                                                             \
        paged_attention_impl<T, unsigned char>(part_acc, part_ml, q, q_stride, k_cache, v_cache, k_scale,         \
                                               v_scale, block_tables, max_blocks_per_seq, token_seq, token_pos,  \
                                               n, heads, kv_heads, head_dim, block_size, scale);                 \
    }                                                                                                            \
    extern "C" __global__ void qk_norm_rope_store_fp8_##S(                                                        \
        T* q_out, unsigned char* k_cache, unsigned char* v_cache, float* k_scale, float* v_scale, const T* proj,  \
        long long proj_stride, const T* q_norm_w, const T* k_norm_w, const int* pos, int pos_row_stride,         \
        const float* inv_freq, const int* axis, const int* slots, int n, int heads, int kv_heads, int head_dim,   \
        int rot_dim, float eps, float offset) {                                                                  \
        qk_norm_rope_store_impl<T, unsigned char>(q_out, k_cache, v_cache, k_scale, v_scale, proj, proj_stride,   \
                                                  q_norm_w, k_norm_w, pos, pos_row_stride, inv_freq, axis,       \
                                                  slots, n, heads, kv_heads, head_dim, rot_dim, eps, offset);    \
    }
DEFINE_FP8(bf16, bf16_t)
DEFINE_FP8(f32, float)
#undef DEFINE_FP8

#define DEFINE_GQA(S, T, G)                                                                                      \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, GQA_MIN_BLOCKS) paged_attention_gqa##G##_##S(                    \
        float* part_acc, float* part_ml, const T* q, long long q_stride, const T* k_cache, const T* v_cache,      \
        const int* block_tables, int max_blocks_per_seq, const int* token_seq, const int* token_pos, int n,      \
        int kv_heads, int head_dim, int block_size, float scale) {                                               \
        paged_attention_gqa_impl<T, G>(part_acc, part_ml, q, q_stride, k_cache, v_cache, block_tables,            \
                                       max_blocks_per_seq, token_seq, token_pos, n, kv_heads, head_dim,           \
                                       block_size, scale);                                                       \
    }
#define DEFINE_GQA_ALL(S, T) DEFINE_GQA(S, T, 1) DEFINE_GQA(S, T, 2) DEFINE_GQA(S, T, 4) DEFINE_GQA(S, T, 6)      \
    DEFINE_GQA(S, T, 8)
DEFINE_GQA_ALL(bf16, bf16_t)
DEFINE_GQA_ALL(f32, float)
#undef DEFINE_GQA_ALL
#undef DEFINE_GQA

#define DEFINE_MMA(HD)                                                                                           \
    extern "C" __global__ void __launch_bounds__(PM_WARPS * 32, 1) paged_attention_mma_bf16_hd##HD(                \
        float* part_acc, float* part_ml, const bf16_t* q, long long q_stride, const bf16_t* k_cache,              \
        const bf16_t* v_cache, const int* block_tables, int max_blocks_per_seq, const int* token_seq,             \
        const int* token_pos, int n, int kv_heads, int group, int block_size, float scale) {                     \
        paged_attention_mma_impl<HD>(part_acc, part_ml, q, q_stride, k_cache, v_cache, block_tables,             \
                                     max_blocks_per_seq, token_seq, token_pos, n, kv_heads, group, block_size,   \
                                     scale);                                                                     \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(PM_WARPS * 32, 1) paged_attention_mma_fp8_bf16_hd##HD(            \
        float* part_acc, float* part_ml, const bf16_t* q, long long q_stride, const unsigned char* k_cache,       \
        const unsigned char* v_cache, const float* k_scale, const float* v_scale, const int* block_tables,       \
        int max_blocks_per_seq, const int* token_seq, const int* token_pos, int n, int kv_heads, int group,      \
        int block_size, float scale) {                                                                           \
        paged_attention_mma_fp8_impl<HD>(part_acc, part_ml, q, q_stride, k_cache, v_cache, k_scale, v_scale,     \
                                         block_tables, max_blocks_per_seq, token_seq, token_pos, n, kv_heads,    \
                                         group, block_size, scale);                                              \
    }
DEFINE_MMA(64)
DEFINE_MMA(128)
DEFINE_MMA(256)
#undef DEFINE_MMA
