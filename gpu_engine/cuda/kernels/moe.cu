// Mixture-of-experts kernels (qwen3_5_moe; host side gpu_engine/cuda/moe.py, tables gpu_engine/cuda/moe_plan.py):
// the router's top-k, the routing plan built on the device (per-expert counts and offsets, the tile table of the
// grouped GEMMs, token rows in expert order), the grouped expert GEMMs and the weighted combine.
// Nothing here needs the host to read a count: every grid is sized from the token count alone (tiles past the
// used ones have rows = 0 and return), so a decode step with its routing can be captured in a CUDA graph.
#include "common.cuh"
#include "tensor_core.cuh"

// ---- router ------------------------------------------------------------------------------------------------
struct RoutePick {
    float p;
    int e;
};
// The warp's best of the lanes' (p, expert) picks, returned in every lane: the largest p, ties toward the lower expert.
__device__ __forceinline__ RoutePick warp_best(float bv, int be) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oe = __shfl_xor_sync(0xffffffffu, be, off);
        if (ov > bv || (ov == bv && oe < be)) { bv = ov; be = oe; }
    }
    return {bv, be};
}

// One warp per token. logits f32 [n, ld]: columns 0..E-1 the router's, column E the shared expert gate's.
// p = softmax(logits[:E]); the k largest p by falling value, ties toward the lower expert id (reference/moe.py's
// stable sort); w = p / sum(p of the k). ids i32 [n, stride], weights f32 [n, stride], shared f32 [n] =
// sigmoid(logit E). stride = k + 1: the shared expert is expert E of the stacks, and every token's entry k is
// (E, sigmoid(logit E)), so the grouped GEMMs run it with the routed experts.
// Expert e lives in lane e % 32, slot e / 32 (E <= 1024: one bit a slot marks it taken).
extern "C" __global__ void moe_route(const float* __restrict__ logits, int ld, int n, int E, int k, int stride,
                                     int* __restrict__ ids, float* __restrict__ weights,
                                     float* __restrict__ shared_gate) {
    pdl_entry();
    const int tok = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (tok >= n) return;
    const float* row = logits + (long long)tok * ld;
    float mx = NEG_INF;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, row[e]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) sum += expf(row[e] - mx);
    sum = warp_sum(sum);
    unsigned taken = 0u;
    float top_sum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int j = 0; j < k; ++j) {
        float bv = -1.f;
        int be = 0x7fffffff;
        for (int e = lane, s = 0; e < E; e += 32, ++s) {
            if (taken & (1u << s)) continue;
            const float p = expf(row[e] - mx) / sum;
            if (p > bv) { bv = p; be = e; }  // e rises within a lane: the first of equal p is the lower id
        }
        const RoutePick best = warp_best(bv, be);
        bv = best.p;
        be = best.e;
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
        top_sum += bv;
        if (lane == j) { my_p = bv; my_id = be; }
    }
    if (lane < k) {
        ids[(long long)tok * stride + lane] = my_id;
        weights[(long long)tok * stride + lane] = my_p / top_sum;
    }
    if (lane == 0) {
        const float sg = sigmoidf(row[E]);
        shared_gate[tok] = sg;
        if (stride > k) {
            ids[(long long)tok * stride + k] = E;
            weights[(long long)tok * stride + k] = sg;
        }
    }
}

// moe_route_v2 (on trial: moe.route(kernel="moe_route_v2"); bench/moe_layer_bench.py times it beside moe_route):
// the same arguments and the same values bit for bit (the same expressions in the same order), with the row's
// probabilities kept in registers (32 a lane: E <= 1024) instead of re-read from memory for each of the k picks.
extern "C" __global__ void moe_route_v2(const float* __restrict__ logits, int ld, int n, int E, int k, int stride,
                                        int* __restrict__ ids, float* __restrict__ weights,
                                        float* __restrict__ shared_gate) {
    pdl_entry();
    const int tok = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (tok >= n) return;
    const float* row = logits + (long long)tok * ld;
    float p[32];
    float mx = NEG_INF;
#pragma unroll
    for (int s = 0; s < 32; ++s) {
        const int e = lane + 32 * s;
        p[s] = e < E ? row[e] : NEG_INF;
        mx = fmaxf(mx, p[s]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < 32; ++s)
        if (lane + 32 * s < E) sum += expf(p[s] - mx);
    sum = warp_sum(sum);
#pragma unroll
    for (int s = 0; s < 32; ++s) p[s] = lane + 32 * s < E ? expf(p[s] - mx) / sum : -1.f;  // -1: never picked
    unsigned taken = 0u;
    float top_sum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int j = 0; j < k; ++j) {
        float bv = -1.f;
        int be = 0x7fffffff;
#pragma unroll
        for (int s = 0; s < 32; ++s) {
            if (!(taken & (1u << s)) && p[s] > bv) { bv = p[s]; be = lane + 32 * s; }
        }
        const RoutePick best = warp_best(bv, be);
        bv = best.p;
        be = best.e;
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
        top_sum += bv;
        if (lane == j) { my_p = bv; my_id = be; }
    }
    if (lane < k) {
        ids[(long long)tok * stride + lane] = my_id;
        weights[(long long)tok * stride + lane] = my_p / top_sum;
    }
    if (lane == 0) {
        const float sg = sigmoidf(row[E]);
        shared_gate[tok] = sg;
        if (stride > k) {
            ids[(long long)tok * stride + k] = E;
            weights[(long long)tok * stride + k] = sg;
        }
    }
}

// ---- routing plan ------------------------------------------------------------------------------------------
// One block. ids [entries] (entry i = token i / k, slot i % k). Writes
//   offsets [E + 1]: expert e's rows are offsets[e] .. offsets[e + 1] of the expert-sorted order;
//   tiles [max_tiles, 3]: (expert, first sorted row, rows <= tile_m), experts in order; unused tiles rows = 0;
//   sorted_token [entries]: the token of each sorted row; entry_row [entries]: the sorted row of each entry.
// Within an expert the rows come in atomic order: each row's GEMM result does not depend on its neighbours, and
// the combine reads by entry, so the order changes no value.
extern "C" __global__ void moe_plan(const int* __restrict__ ids, int entries, int k, int E, int tile_m,
                                    int max_tiles, int* __restrict__ offsets, int* __restrict__ tiles,
                                    int* __restrict__ sorted_token, int* __restrict__ entry_row) {
    pdl_entry();
    extern __shared__ int sh[];
    int* counts = sh;              // [E]
    int* cursor = sh + E;          // [E]
    int* tile_start = sh + 2 * E;  // [E + 1]
    int* first = sh + 3 * E + 1;   // [E]
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int e = tid; e < E; e += nt) counts[e] = 0;
    __syncthreads();
    for (int i = tid; i < entries; i += nt) {
        const int e = ids[i];
        if (e >= 0 && e < E) atomicAdd(&counts[e], 1);
    }
    __syncthreads();
    if (tid == 0) {
        int off = 0, t = 0;
        for (int e = 0; e < E; ++e) {
            first[e] = off;
            cursor[e] = off;
            tile_start[e] = t;
            off += counts[e];
            t += (counts[e] + tile_m - 1) / tile_m;
        }
        tile_start[E] = t;
        offsets[E] = off;
    }
    __syncthreads();
    for (int e = tid; e < E; e += nt) {
        offsets[e] = first[e];
        for (int t = tile_start[e]; t < tile_start[e + 1]; ++t) {
            const int r0 = (t - tile_start[e]) * tile_m;
            tiles[3 * t] = e;
            tiles[3 * t + 1] = first[e] + r0;
            tiles[3 * t + 2] = min(tile_m, counts[e] - r0);
        }
    }
    for (int t = tile_start[E] + tid; t < max_tiles; t += nt) {
        tiles[3 * t] = 0;
        tiles[3 * t + 1] = 0;
        tiles[3 * t + 2] = 0;
    }
    for (int i = tid; i < entries; i += nt) {
        const int e = ids[i];
        if (e < 0 || e >= E) { entry_row[i] = -1; continue; }
        const int pos = atomicAdd(&cursor[e], 1);
        sorted_token[pos] = i / k;
        entry_row[i] = pos;
    }
}

// moe_plan_v2 (on trial: moe.plan(trial=True); bench/moe_layer_bench.py times it beside moe_plan): the same tables,
// with the per-expert offsets from a block-wide scan (one expert a thread: E <= blockDim.x) instead of one thread's
// loop, rows claimed with one shared atomic per distinct expert a warp (__match_any_sync) instead of one an entry,
// and, when shared_last, every token's entry k - 1 (the stacked shared expert, expert E - 1, one row a token) placed
// at first[E - 1] + token without an atomic (in token order).
__device__ __forceinline__ int warp_scan_incl(int v, int lane) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v += o;
    }
    return v;
}

extern "C" __global__ void moe_plan_v2(const int* __restrict__ ids, int entries, int k, int E, int tile_m,
                                       int max_tiles, int shared_last, int* __restrict__ offsets,
                                       int* __restrict__ tiles, int* __restrict__ sorted_token,
                                       int* __restrict__ entry_row) {
    pdl_entry();
    extern __shared__ int sh[];
    int* counts = sh;              // [E]
    int* cursor = sh + E;          // [E]
    int* tile_start = sh + 2 * E;  // [E + 1]
    int* first = sh + 3 * E + 1;   // [E]
    __shared__ int warp_rows[32], warp_tiles[32];
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += nt) counts[e] = 0;
    __syncthreads();
    for (int i0 = tid - lane; i0 < entries; i0 += nt) {  // warp-uniform bounds: every lane takes part in the match
        const int i = i0 + lane;
        const int e = i < entries ? ids[i] : -1;
        const bool valid = e >= 0 && e < E && !(shared_last && i % k == k - 1);
        const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
        if (valid && lane == __ffs(peers) - 1) atomicAdd(&counts[e], __popc(peers));
    }
    __syncthreads();
    if (shared_last && tid == 0) counts[E - 1] += entries / k;
    __syncthreads();
    const int c = tid < E ? counts[tid] : 0, t = (c + tile_m - 1) / tile_m;
    const int rows_in = warp_scan_incl(c, lane), tiles_in = warp_scan_incl(t, lane);
    if (lane == 31) { warp_rows[warp] = rows_in; warp_tiles[warp] = tiles_in; }
    __syncthreads();
    if (warp == 0) {  // exclusive prefix of the warp totals (nt / 32 <= 32 warps)
        const int nw = nt >> 5;
        const int wr = lane < nw ? warp_rows[lane] : 0, wt = lane < nw ? warp_tiles[lane] : 0;
        const int r_in = warp_scan_incl(wr, lane), t_in = warp_scan_incl(wt, lane);
        if (lane < nw) { warp_rows[lane] = r_in - wr; warp_tiles[lane] = t_in - wt; }
        if (lane == 31) { offsets[E] = r_in; tile_start[E] = t_in; }
    }
    __syncthreads();
    if (tid < E) {
        first[tid] = cursor[tid] = warp_rows[warp] + rows_in - c;
        tile_start[tid] = warp_tiles[warp] + tiles_in - t;
    }
    __syncthreads();
    for (int e = tid; e < E; e += nt) {
        offsets[e] = first[e];
        for (int q = tile_start[e]; q < tile_start[e + 1]; ++q) {
            const int r0 = (q - tile_start[e]) * tile_m;
            tiles[3 * q] = e;
            tiles[3 * q + 1] = first[e] + r0;
            tiles[3 * q + 2] = min(tile_m, counts[e] - r0);
        }
    }
    for (int q = tile_start[E] + tid; q < max_tiles; q += nt) {
        tiles[3 * q] = 0;
        tiles[3 * q + 1] = 0;
        tiles[3 * q + 2] = 0;
    }
    for (int i0 = tid - lane; i0 < entries; i0 += nt) {
        const int i = i0 + lane;
        const int e = i < entries ? ids[i] : -1;
        const bool shared = shared_last && i < entries && i % k == k - 1;
        const bool valid = e >= 0 && e < E && !shared;
        const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
        const int leader = __ffs(peers) - 1;
        int base = 0;
        if (valid && lane == leader) base = atomicAdd(&cursor[e], __popc(peers));
        base = __shfl_sync(0xffffffffu, base, leader);
        if (i >= entries) continue;
        const int pos = shared ? first[E - 1] + i / k : valid ? base + __popc(peers & ((1u << lane) - 1u)) : -1;
        if (pos >= 0) sorted_token[pos] = i / k;
        entry_row[i] = pos;
    }
}

// ---- grouped expert GEMM on the tensor cores (bf16, fp32 accumulate) ----------------------------------------
// Block (blockIdx.x = output column block, blockIdx.y = tile): rows tile.first .. +tile.rows of the sorted order,
// y[row, :] = x[src(row), :] @ W[expert]^T with W[expert] [N, K] row-major (nn.Linear's [out, in]); src(row) is
// sorted_token[row] (gather: the gate|up GEMM reads the layer input) or row itself (row_src == nullptr: the down
// GEMM reads the activations in sorted order). Each block streams its column slice of its expert's W once.
// SWIGLU: W is [2I, K] (gate rows, then up rows); the block's B tile holds, per warp and 8-column fragment f, gate
// rows (f < NT/2) and the up rows of the same features (f >= NT/2), so the epilogue writes
// y[row, feature] = bf16(silu(bf16(gate)) * bf16(up)) (silu_mul's rounding) with y [rows, I].
// Needs K % 8 == 0, x_ld % 8 == 0 and 16-byte aligned bases (16-byte cp.async rows); tile rows <= BM.
template <int BM, int BN, int BK, int STAGES, int WARPS_M, int WARPS_N, bool SWIGLU>
__device__ __forceinline__ void grouped_gemm(bf16_t* __restrict__ y, long long y_ld, const bf16_t* __restrict__ x,
                                             long long x_ld, const int* __restrict__ row_src,
                                             const bf16_t* __restrict__ w, int N, int K,
                                             const int* __restrict__ tiles) {
    pdl_entry();
    constexpr int THREADS = WARPS_M * WARPS_N * 32, WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MT = WM / 16, NT = WN / 8, LDS = BK + 8, CH = BK / 8;
    static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "warp tile");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* As = reinterpret_cast<bf16_t*>(smem_raw);
    bf16_t* Bs = As + STAGES * BM * LDS;
    int* srow = reinterpret_cast<int*>(Bs + STAGES * BN * LDS);  // [BM] source row of each tile row (-1: none)
    const int* tile = tiles + 3 * blockIdx.y;
    const int expert = tile[0], row0 = tile[1], rows = tile[2];
    if (rows <= 0) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int I = N / 2;  // SWIGLU: features
    const int col0 = SWIGLU ? blockIdx.x * (BN / 2) : blockIdx.x * BN;
    const bf16_t* wbase = w + (long long)expert * N * K;
    for (int r = tid; r < BM; r += THREADS) srow[r] = r < rows ? (row_src ? row_src[row0 + r] : row0 + r) : -1;
    __syncthreads();

    auto b_row = [&](int j, bool& ok) -> int {  // weight row of B-tile row j
        if constexpr (SWIGLU) {
            const int wq = j / WN, jj = j % WN, f = jj / 8, half = NT / 2;
            const int feat = col0 + wq * (WN / 2) + (f % half) * 8 + (jj & 7);
            ok = feat < I;
            return f < half ? feat : I + feat;
        } else {
            const int r = col0 + j;
            ok = r < N;
            return r;
        }
    };
    auto load = [&](int stage, int k0) {
        const unsigned a_base = smem_addr(As + stage * BM * LDS), b_base = smem_addr(Bs + stage * BN * LDS);
        for (int c = tid; c < BM * CH; c += THREADS) {
            const int r = c / CH, kc = (c % CH) * 8, src = srow[r];
            const bool ok = src >= 0 && k0 + kc < K;
            const bf16_t* p = x + (ok ? (long long)src * x_ld + k0 + kc : 0);
            cp_async16(a_base + (unsigned)((r * LDS + kc) * 2), p, ok ? 16 : 0);
        }
        for (int c = tid; c < BN * CH; c += THREADS) {
            const int j = c / CH, kc = (c % CH) * 8;
            bool ok;
            const int wr = b_row(j, ok);
            ok = ok && k0 + kc < K;
            const bf16_t* p = wbase + (ok ? (long long)wr * K + k0 + kc : 0);
            cp_async16(b_base + (unsigned)((j * LDS + kc) * 2), p, ok ? 16 : 0);
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

    const int KT = (K + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, s * BK);
        cp_async_commit();
    }
    const int mat = lane >> 3, mrow = lane & 7;
    const int a_lane = (wm * WM + (lane & 15)) * LDS + (lane >> 4) * 8;
    const int b_lane = (wn * WN + (mat >> 1) * 8 + mrow) * LDS + (mat & 1) * 8;
    const int live_mt = min(MT, max(0, (rows - wm * WM + 15) / 16));  // warp-uniform: fragments holding rows
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage kt landed for all; everyone is done with the stage the next load overwrites
        const int nk = kt + STAGES - 1;
        if (nk < KT) load(nk % STAGES, nk * BK);
        cp_async_commit();
        const int stage = kt % STAGES;
        const unsigned a_s = smem_addr(As + stage * BM * LDS), b_s = smem_addr(Bs + stage * BN * LDS);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                if (mt < live_mt) ldsm_x4(a[mt], a_s + (unsigned)((a_lane + mt * 16 * LDS + kk * 16) * 2));
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned b[4];
                ldsm_x4(b, b_s + (unsigned)((b_lane + np * 16 * LDS + kk * 16) * 2));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if (mt >= live_mt) continue;  // a 16-row fragment wholly past the tile's rows: nothing to add
                    mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
                    mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    const int g = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * WM + mt * 16 + g + 8 * h;
            if (r >= rows) continue;
            bf16_t* out = y + (long long)(row0 + r) * y_ld;
            if constexpr (SWIGLU) {
#pragma unroll
                for (int nt = 0; nt < NT / 2; ++nt) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int feat = col0 + wn * (WN / 2) + nt * 8 + 2 * tig + c;
                        if (feat >= I) continue;
                        const float gv = to_f(from_f<bf16_t>(acc[mt][nt][2 * h + c]));
                        const float uv = to_f(from_f<bf16_t>(acc[mt][nt + NT / 2][2 * h + c]));
                        out[feat] = from_f<bf16_t>(silu(gv) * uv);
                    }
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int col = col0 + wn * WN + nt * 8 + 2 * tig + c;
                        if (col < N) out[col] = from_f<bf16_t>(acc[mt][nt][2 * h + c]);
                    }
                }
            }
        }
    }
}

// Tile shapes (moe_plan.py TILES mirrors them): "decode" (few rows an expert: 32-row tiles, the weight streamed in
// 128-wide k steps, 3 stages) and "prefill" (128 x 128 tiles, 64-wide k steps, 3 stages: 1.23-1.25x faster than
// 32-wide k steps with 4 stages at 35B-A3B's shapes, bench/results/cuda_notes.md 2026-12-02, same sums).
#define MOE_GEMM_ENTRY(NAME, BM, BN, BK, ST, WMS, WNS, SW)                                                         \
    extern "C" __global__ void __launch_bounds__(WMS * WNS * 32)                                                   \
        NAME(bf16_t* y, long long y_ld, const bf16_t* x, long long x_ld, const int* row_src, const bf16_t* w,     \
             int N, int K, const int* tiles) {                                                                     \
        grouped_gemm<BM, BN, BK, ST, WMS, WNS, SW>(y, y_ld, x, x_ld, row_src, w, N, K, tiles);                   \
    }
MOE_GEMM_ENTRY(moe_gemm_decode_swiglu_bf16, 32, 64, 128, 3, 1, 4, true)
MOE_GEMM_ENTRY(moe_gemm_decode_plain_bf16, 32, 64, 128, 3, 1, 4, false)
MOE_GEMM_ENTRY(moe_gemm_prefill_swiglu_bf16, 128, 128, 64, 3, 2, 4, true)
MOE_GEMM_ENTRY(moe_gemm_prefill_plain_bf16, 128, 128, 64, 3, 2, 4, false)
// On trial (moe_plan.TRIAL_TILES; bench/moe_layer_bench.py times it on the decode tile's tables, choose_tile never
// picks it): decode with half-width blocks, twice the blocks (slower at batch 32; batch 1 not yet timed in a graph).
MOE_GEMM_ENTRY(moe_gemm_decode_bn32_swiglu_bf16, 32, 32, 128, 3, 1, 2, true)
MOE_GEMM_ENTRY(moe_gemm_decode_bn32_plain_bf16, 32, 32, 128, 3, 1, 2, false)

// ---- grouped expert GEMM, plain arithmetic (f32 runners; bf16 shapes the tensor-core kernel cannot load, such as
// an odd K). Same tables and meaning as grouped_gemm; 256 threads = 16 rows x 16 output columns (SWIGLU:
// features), the tile's rows 16 at a time, k in steps of 16 through shared memory.
template <typename T, bool SWIGLU>
__device__ __forceinline__ void grouped_gemm_simple(T* __restrict__ y, long long y_ld, const T* __restrict__ x,
                                                    long long x_ld, const int* __restrict__ row_src,
                                                    const T* __restrict__ w, int N, int K,
                                                    const int* __restrict__ tiles) {
    pdl_entry();
    __shared__ float xs[16][17], gs[16][17], us[16][17];
    const int* tile = tiles + 3 * blockIdx.y;
    const int expert = tile[0], row0 = tile[1], rows = tile[2];
    if (rows <= 0) return;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int outs = SWIGLU ? N / 2 : N;
    const int c0 = blockIdx.x * 16;
    const T* wbase = w + (long long)expert * N * K;
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int r = r0 + ty;
        const long long src = r < rows ? (row_src ? row_src[row0 + r] : row0 + r) : -1;
        float ag = 0.f, au = 0.f;
        for (int k0 = 0; k0 < K; k0 += 16) {
            const int kk = k0 + tx, wc = c0 + ty;  // this thread loads x[row ty][kk] and W rows of column ty
            xs[ty][tx] = (src >= 0 && kk < K) ? to_f(x[src * x_ld + kk]) : 0.f;
            gs[ty][tx] = (wc < outs && kk < K) ? to_f(wbase[(long long)wc * K + kk]) : 0.f;
            if (SWIGLU) us[ty][tx] = (wc < outs && kk < K) ? to_f(wbase[(long long)(outs + wc) * K + kk]) : 0.f;
            __syncthreads();
#pragma unroll
            for (int q = 0; q < 16; ++q) {
                ag = fmaf(xs[ty][q], gs[tx][q], ag);
                if (SWIGLU) au = fmaf(xs[ty][q], us[tx][q], au);
            }
            __syncthreads();
        }
        const int col = c0 + tx;
        if (r < rows && col < outs) {
            float v = ag;
            if (SWIGLU) v = silu(to_f(from_f<T>(ag))) * to_f(from_f<T>(au));
            y[(long long)(row0 + r) * y_ld + col] = from_f<T>(v);
        }
    }
}

#define MOE_SIMPLE_ENTRY(NAME, T, SW)                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        NAME(T* y, long long y_ld, const T* x, long long x_ld, const int* row_src, const T* w, int N, int K,      \
             const int* tiles) {                                                                                   \
        grouped_gemm_simple<T, SW>(y, y_ld, x, x_ld, row_src, w, N, K, tiles);                                   \
    }
MOE_SIMPLE_ENTRY(moe_gemm_simple_swiglu_f32, float, true)
MOE_SIMPLE_ENTRY(moe_gemm_simple_plain_f32, float, false)
MOE_SIMPLE_ENTRY(moe_gemm_simple_swiglu_bf16, bf16_t, true)
MOE_SIMPLE_ENTRY(moe_gemm_simple_plain_bf16, bf16_t, false)

// ---- combine -----------------------------------------------------------------------------------------------
// out[t, c] = sum_j weights[t, j] * y_sorted[entry_row[t * k + j], c] + shared_gate[t] * shared_y[t, c], in fp32,
// rounded once (shared_y == nullptr: the shared expert is one of the k entries). One block per token.
template <typename T>
__device__ __forceinline__ void combine(T* __restrict__ out, const T* __restrict__ y_sorted,
                                        const int* __restrict__ entry_row, const float* __restrict__ weights,
                                        int k, const float* __restrict__ shared_gate, const T* __restrict__ shared_y,
                                        int n, int H) {
    pdl_entry();
    const int t = blockIdx.x;
    if (t >= n) return;
    const float sg = shared_y ? shared_gate[t] : 0.f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float v = shared_y ? sg * to_f(shared_y[(long long)t * H + c]) : 0.f;
        for (int j = 0; j < k; ++j) {
            const int r = entry_row[t * k + j];
            if (r >= 0) v = fmaf(weights[t * k + j], to_f(y_sorted[(long long)r * H + c]), v);
        }
        out[(long long)t * H + c] = from_f<T>(v);
    }
}

// combine_vec (on trial: moe.combine(kernel="moe_combine_v2_*")): the same sums in the same order, each thread 16
// bytes of a row (V values) and grid (n, ceil(H / (V * blockDim.x))), so every expert row is read with 16-byte
// loads, all k of them in flight at once. Needs H % V == 0 and 16-byte aligned rows.
template <typename T, int V>
__device__ __forceinline__ void combine_vec(T* __restrict__ out, const T* __restrict__ y_sorted,
                                            const int* __restrict__ entry_row, const float* __restrict__ weights,
                                            int k, const float* __restrict__ shared_gate,
                                            const T* __restrict__ shared_y, int n, int H) {
    pdl_entry();
    const int t = blockIdx.x, c0 = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (t >= n || c0 >= H) return;
    union Pack { uint4 u; T v[V]; };
    float acc[V];
    if (shared_y) {
        const float sg = shared_gate[t];
        Pack s;
        s.u = *reinterpret_cast<const uint4*>(shared_y + (long long)t * H + c0);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = sg * to_f(s.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = 0.f;
    }
    for (int j = 0; j < k; ++j) {
        const int r = entry_row[t * k + j];
        if (r < 0) continue;
        const float w = weights[t * k + j];
        Pack y;
        y.u = *reinterpret_cast<const uint4*>(y_sorted + (long long)r * H + c0);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = fmaf(w, to_f(y.v[i]), acc[i]);
    }
    Pack o;
#pragma unroll
    for (int i = 0; i < V; ++i) o.v[i] = from_f<T>(acc[i]);
    *reinterpret_cast<uint4*>(out + (long long)t * H + c0) = o.u;
}

extern "C" __global__ void moe_combine_v2_f32(float* out, const float* y_sorted, const int* entry_row,
                                              const float* weights, int k, const float* shared_gate,
                                              const float* shared_y, int n, int H) {
    combine_vec<float, 4>(out, y_sorted, entry_row, weights, k, shared_gate, shared_y, n, H);
}
extern "C" __global__ void moe_combine_v2_bf16(bf16_t* out, const bf16_t* y_sorted, const int* entry_row,
                                               const float* weights, int k, const float* shared_gate,
                                               const bf16_t* shared_y, int n, int H) {
    combine_vec<bf16_t, 8>(out, y_sorted, entry_row, weights, k, shared_gate, shared_y, n, H);
}

extern "C" __global__ void moe_combine_f32(float* out, const float* y_sorted, const int* entry_row,
                                           const float* weights, int k, const float* shared_gate,
                                           const float* shared_y, int n, int H) {
    combine<float>(out, y_sorted, entry_row, weights, k, shared_gate, shared_y, n, H);
}
extern "C" __global__ void moe_combine_bf16(bf16_t* out, const bf16_t* y_sorted, const int* entry_row,
                                            const float* weights, int k, const float* shared_gate,
                                            const bf16_t* shared_y, int n, int H) {
    combine<bf16_t>(out, y_sorted, entry_row, weights, k, shared_gate, shared_y, n, H);
}

// ---- fused small-batch decode (host side gpu_engine/cuda/moe_decode.py; CudaOptions.moe_decode = "fused") --------
// A few tokens (moe_decode.MAX_ROWS), three launches and no plan: at batch 1 the grouped path's six launches spend
// ~65 of their ~79 us in per-kernel latency (35B-A3B, H200), while its bytes need ~14 us. Here every block is a
// GEMV slice whose 16-byte weight loads are all issued at once (P or R pieces a lane in flight), so the launches are
// bandwidth-bound, and each is one dependent step of the chain
//   moe_decode_route:   logits = [router; shared gate] x (a warp a router row), then the last block to finish
//                       (a self-resetting arrival counter) takes top-k / weights / sigmoid of every token,
//   moe_decode_gate_up: act[entry] = silu(gate) * up, a block (entry, 4 features), entry = (token, slot); slot k is
//                       the stacked shared expert (expert E of the stacks, weight sigmoid(gate)),
//   moe_decode_down:    y[t, c] = sum over the token's slots in order of w_j (down_j[c] . act[t, j]), a block
//                       (token, 4 columns): the combine is fused, fp32 throughout, one rounding at the store.
// Weights a launch knows before its predecessor ends (the router rows; the shared expert's rows) are loaded into
// registers between griddepcontrol.launch_dependents and griddepcontrol.wait, so with PDL they stream during the
// previous kernel. Grids put the entry (gate_up) or the token (down) fastest: blocks that read the same expert (two
// tokens that chose it, the shared expert of every token) run side by side and meet in L2, so DRAM reads each
// chosen expert about once without a dedup table.
// Determinism: every sum has a fixed order (a lane's 16-byte pieces g = 0, 1, ... at element (32 g + lane) V, then
// the xor butterfly; slots 0..k in order), no atomics touch values (the arrival counter only elects the block that
// routes, which reads the complete logits), so outputs are bit-identical across runs and graph replays.
// tests/cuda_runner/moe_decode_emulation.py mirrors this arithmetic order in numpy. Needs H and I multiples of
// 16 / sizeof(T), 16-byte aligned bases, E <= 1024, k <= 32 (the host checks: moe_decode.fused_problem).

// Blocks of the running moe_decode_route that have finished their rows (zero at module load; atomicInc wraps it
// back to zero in the last block, so each launch finds it at zero). One moe_decode_route runs at a time per loaded
// module: launches on one stream, and a PDL-early launch does not reach the counter before its griddepcontrol.wait.
__device__ unsigned int moe_decode_route_arrivals;

__device__ __forceinline__ void moe_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void moe_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename T>
union Piece16 {
    uint4 u;
    T v[16 / sizeof(T)];
};

// acc + w . x over one 16-byte piece, one fmaf a value in order (bf16 products are exact in fp32).
template <typename T>
__device__ __forceinline__ float piece_dot(uint4 w, uint4 x, float acc) {
    Piece16<T> a, b;
    a.u = w;
    b.u = x;
#pragma unroll
    for (int i = 0; i < (int)(16 / sizeof(T)); ++i) acc = fmaf(to_f(a.v[i]), to_f(b.v[i]), acc);
    return acc;
}

__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// One token's routing by one warp from its logits row (written by other blocks of this launch: read through L2):
// moe_route_v2's arithmetic, expression for expression (the same ids and weights from the same logits), with the
// warp's pick taken by two redux.sync (sm_80+, as cp.async above: largest p; among equal p the lowest expert)
// instead of a shuffle butterfly.
// Expert e is lane e % 32, slot e / 32 (E <= 32 * SLOTS).
template <int SLOTS>
__device__ __forceinline__ void decode_route_token(const float* row, int E, int k, int* __restrict__ ids,
                                                   float* __restrict__ weights, float* __restrict__ shared_gate) {
    const int lane = threadIdx.x & 31;
    float p[SLOTS];
    float mx = NEG_INF;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        const int e = lane + 32 * s;
        p[s] = e < E ? __ldcg(row + e) : NEG_INF;
        mx = fmaxf(mx, p[s]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < SLOTS; ++s)
        if (lane + 32 * s < E) sum += expf(p[s] - mx);
    sum = warp_sum(sum);
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) p[s] = lane + 32 * s < E ? expf(p[s] - mx) / sum : -1.f;  // -1: never picked
    unsigned taken = 0u;
    float top_sum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int j = 0; j < k; ++j) {
        unsigned bk = 0u;  // key: p's bits + 1 (p >= 0 orders as its bits); 0: nothing left in this lane
        int be = 0x7fffffff;
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            const unsigned key = __float_as_uint(p[s]) + 1u;
            if (!(taken & (1u << s)) && p[s] >= 0.f && key > bk) { bk = key; be = lane + 32 * s; }
        }
        const unsigned wk = __reduce_max_sync(0xffffffffu, bk);
        be = (int)__reduce_min_sync(0xffffffffu, bk == wk ? (unsigned)be : 0xffffffffu);
        const float bv = __uint_as_float(wk - 1u);
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
        top_sum += bv;
        if (lane == j) { my_p = bv; my_id = be; }
    }
    if (lane < k) {
        ids[lane] = my_id;
        weights[lane] = my_p / top_sum;
    }
    if (lane == 0) {
        const float sg = sigmoidf(__ldcg(row + E));
        *shared_gate = sg;
        ids[k] = E;
        weights[k] = sg;
    }
}

// Block = ROUTE warps, warp w of block b owns router row b * warps + w (E + 1 rows: the experts', then the shared
// gate's). x [m, H] packed; logits f32 [m, ld]; ids / weights [m, k + 1]; shared_gate [m]. Dynamic smem: m * H * T.
template <typename T, int SLOTS>
__device__ __forceinline__ void decode_route(const T* __restrict__ x, int m, int H, const T* __restrict__ router,
                                             int E, int k, float* __restrict__ logits, int ld, int* __restrict__ ids,
                                             float* __restrict__ weights, float* __restrict__ shared_gate) {
    constexpr int V = 16 / sizeof(T), P = 8;  // P pieces a lane in flight: 32 * P * V values of a row a pass
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint4* xs = reinterpret_cast<uint4*>(smem_raw);  // [m, H / V]
    __shared__ int last;
    const int tid = threadIdx.x, lane = tid & 31, warps = blockDim.x >> 5, row = blockIdx.x * warps + (tid >> 5);
    const bool live = row <= E;  // warp-uniform
    const T* w = router + (long long)(live ? row : 0) * H;
    uint4 w0[P];
    moe_pdl_launch_dependents();
#pragma unroll
    for (int i = 0; i < P; ++i) {  // the router is a weight: its row streams before the input is ready
        const int c = (i * 32 + lane) * V;
        w0[i] = live && c < H ? ldg16(w + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    moe_pdl_wait();
    const int hv = H / V;
    for (int i = tid; i < m * hv; i += blockDim.x) xs[i] = reinterpret_cast<const uint4*>(x)[i];
    __syncthreads();
    if (live) {
        for (int t = 0; t < m; ++t) {
            const uint4* xt = xs + t * hv;
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < P; ++i) {
                const int c = (i * 32 + lane) * V;
                if (c < H) acc = piece_dot<T>(w0[i], xt[c / V], acc);
            }
            for (int c0 = 32 * P * V; c0 < H; c0 += 32 * P * V) {  // rows longer than one pass
#pragma unroll
                for (int i = 0; i < P; ++i) {
                    const int c = c0 + (i * 32 + lane) * V;
                    if (c < H) acc = piece_dot<T>(ldg16(w + c), xt[c / V], acc);
                }
            }
            acc = warp_sum(acc);
            if (lane == 0) logits[(long long)t * ld + row] = acc;
        }
    }
    __threadfence();  // this block's logits reach L2 before its arrival is counted
    __syncthreads();
    if (tid == 0) last = atomicInc(&moe_decode_route_arrivals, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = tid >> 5; t < m; t += warps)
        decode_route_token<SLOTS>(logits + (long long)t * ld, E, k, ids + t * (k + 1), weights + t * (k + 1),
                                  shared_gate + t);
}

// Block (entry = token * (k + 1) + slot, WARPS features); warp: feature f's gate row f and up row I + f of the
// slot's expert (slot k: expert E, the stacked shared expert, known before the wait). act [m * (k + 1), I] =
// from_f(silu(from_f(gate)) * from_f(up)) (the grouped kernels' rounding). Dynamic smem: H * T (the token's x).
template <typename T, int WARPS>
__device__ __forceinline__ void decode_gate_up(const T* __restrict__ x, int H, const int* __restrict__ ids, int k,
                                               int E, const T* __restrict__ gate_up, int I, T* __restrict__ act) {
    constexpr int V = 16 / sizeof(T), P = 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint4* xs = reinterpret_cast<uint4*>(smem_raw);  // [H / V]
    const int tid = threadIdx.x, lane = tid & 31, entry = blockIdx.x, stride = k + 1;
    const int t = entry / stride, slot = entry - t * stride, f = blockIdx.y * WARPS + (tid >> 5);
    const bool live = f < I, shared = slot == k;
    uint4 g0[P], u0[P];
    const T* g = gate_up + ((long long)E * 2 * I + (live ? f : 0)) * H;  // the shared expert's; routed: below
    moe_pdl_launch_dependents();
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int c = (i * 32 + lane) * V;
        const bool ok = shared && live && c < H;
        g0[i] = ok ? ldg16(g + c) : make_uint4(0u, 0u, 0u, 0u);
        u0[i] = ok ? ldg16(g + (long long)I * H + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    moe_pdl_wait();
    if (!shared && live) {  // the routed expert: its rows in flight while x is staged
        g = gate_up + ((long long)ids[entry] * 2 * I + f) * H;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int c = (i * 32 + lane) * V;
            g0[i] = c < H ? ldg16(g + c) : make_uint4(0u, 0u, 0u, 0u);
            u0[i] = c < H ? ldg16(g + (long long)I * H + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    const int hv = H / V;
    for (int i = tid; i < hv; i += blockDim.x) xs[i] = reinterpret_cast<const uint4*>(x + (long long)t * H)[i];
    __syncthreads();
    if (!live) return;
    float ag = 0.f, au = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int c = (i * 32 + lane) * V;
        if (c < H) {
            ag = piece_dot<T>(g0[i], xs[c / V], ag);
            au = piece_dot<T>(u0[i], xs[c / V], au);
        }
    }
    for (int c0 = 32 * P * V; c0 < H; c0 += 32 * P * V) {
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int c = c0 + (i * 32 + lane) * V;
            if (c < H) {
                ag = piece_dot<T>(ldg16(g + c), xs[c / V], ag);
                au = piece_dot<T>(ldg16(g + (long long)I * H + c), xs[c / V], au);
            }
        }
    }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) act[(long long)entry * I + f] = from_f<T>(silu(to_f(from_f<T>(ag))) * to_f(from_f<T>(au)));
}

// Block (token t, WARPS output columns); warp: column c, y[t, c] = sum over slots j = 0..k in order of
// fmaf(w_j, part_j, .) with part_j a lane's share of down_j[c, :] . act[t * (k + 1) + j, :], then the butterfly.
// Routed slots' pieces go R at a time in flight (across slots), the first R issued before the activations are
// staged; the shared slot's row (expert E) is loaded before the wait (SP pieces: I <= 32 * SP * V, more are read
// after). Lane j holds slot j's expert and weight (shuffled out). Dynamic smem: (k + 1) * I * T (the activations).
template <typename T, int WARPS, int R, int SP>
__device__ __forceinline__ void decode_down(const T* __restrict__ act, const int* __restrict__ ids,
                                            const float* __restrict__ weights, int k, int E,
                                            const T* __restrict__ down, int I, int H, T* __restrict__ y) {
    constexpr int V = 16 / sizeof(T);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint4* as = reinterpret_cast<uint4*>(smem_raw);  // [(k + 1) * I / V]
    const int tid = threadIdx.x, lane = tid & 31, t = blockIdx.x, stride = k + 1;
    const int col = blockIdx.y * WARPS + (tid >> 5);
    const bool live = col < H;  // warp-uniform
    const T* sw = down + ((long long)E * H + (live ? col : 0)) * I;  // the shared expert's row
    uint4 s0[SP];
    moe_pdl_launch_dependents();
#pragma unroll
    for (int i = 0; i < SP; ++i) {
        const int c = (i * 32 + lane) * V;
        s0[i] = live && c < I ? ldg16(sw + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    moe_pdl_wait();
    const int my_id = lane < k ? ids[t * stride + lane] : 0;
    const float my_w = lane < stride ? weights[t * stride + lane] : 0.f;
    const int CH = (I + 32 * V - 1) / (32 * V), Q = live ? k * CH : 0;
    uint4 wv[R];
    int j0 = 0, g0 = 0;  // slot and piece of the batch's first load (q0 = j0 * CH + g0)
    auto load = [&](int q0) {
        int j = j0, gq = g0;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int c = (gq * 32 + lane) * V;
            const long long row = (long long)__shfl_sync(0xffffffffu, my_id, j & 31) * H + col;
            wv[r] = q0 + r < Q && c < I ? ldg16(down + row * I + c) : make_uint4(0u, 0u, 0u, 0u);
            if (++gq == CH) { gq = 0; ++j; }
        }
    };
    if (live) load(0);
    const int iv = I / V;
    for (int i = tid; i < stride * iv; i += blockDim.x)
        as[i] = reinterpret_cast<const uint4*>(act + (long long)t * stride * I)[i];
    __syncthreads();
    if (!live) return;
    float acc = 0.f, part = 0.f;
    for (int q0 = 0; q0 < Q; q0 += R) {
        if (q0) load(q0);
        int j = j0, gq = g0;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int c = (gq * 32 + lane) * V;
            const float w = __shfl_sync(0xffffffffu, my_w, j & 31);
            if (q0 + r < Q) {
                if (c < I) part = piece_dot<T>(wv[r], as[(j * I + c) / V], part);
                if (gq == CH - 1) {
                    acc = fmaf(w, part, acc);
                    part = 0.f;
                }
            }
            if (++gq == CH) { gq = 0; ++j; }
        }
        j0 = j;
        g0 = gq;
    }
#pragma unroll
    for (int i = 0; i < SP; ++i) {
        const int c = (i * 32 + lane) * V;
        if (c < I) part = piece_dot<T>(s0[i], as[(k * I + c) / V], part);
    }
    for (int c0 = 32 * SP * V; c0 < I; c0 += 32 * V) {  // shared rows longer than the preloaded pieces
        const int c = c0 + lane * V;
        if (c < I) part = piece_dot<T>(ldg16(sw + c), as[(k * I + c) / V], part);
    }
    acc = fmaf(__shfl_sync(0xffffffffu, my_w, k), part, acc);
    acc = warp_sum(acc);
    if (lane == 0) y[(long long)t * H + col] = from_f<T>(acc);
}

// Entries (moe_decode.py names them): route by dtype and experts a lane (e256: E <= 256, e1024: E <= 1024).
#define MOE_DECODE_ROUTE_ENTRY(NAME, T, SLOTS)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        NAME(const T* x, int m, int H, const T* router, int E, int k, float* logits, int ld, int* ids,            \
             float* weights, float* shared_gate) {                                                                 \
        decode_route<T, SLOTS>(x, m, H, router, E, k, logits, ld, ids, weights, shared_gate);                     \
    }
MOE_DECODE_ROUTE_ENTRY(moe_decode_route_bf16_e256, bf16_t, 8)
MOE_DECODE_ROUTE_ENTRY(moe_decode_route_bf16_e1024, bf16_t, 32)
MOE_DECODE_ROUTE_ENTRY(moe_decode_route_f32_e256, float, 8)
MOE_DECODE_ROUTE_ENTRY(moe_decode_route_f32_e1024, float, 32)

// 4 blocks an SM at least: ptxas otherwise settles on 80 registers and spills (NVRTC 13.5, sm_90).
#define MOE_DECODE_GATE_UP_ENTRY(NAME, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(128, 4)                                                           \
        NAME(const T* x, int H, const int* ids, int k, int E, const T* gate_up, int I, T* act) {                  \
        decode_gate_up<T, 4>(x, H, ids, k, E, gate_up, I, act);                                                    \
    }
MOE_DECODE_GATE_UP_ENTRY(moe_decode_gate_up_bf16, bf16_t)
MOE_DECODE_GATE_UP_ENTRY(moe_decode_gate_up_f32, float)

#define MOE_DECODE_DOWN_ENTRY(NAME, T, SP)                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                                              \
        NAME(const T* act, const int* ids, const float* weights, int k, int E, const T* down, int I, int H,       \
             T* y) {                                                                                               \
        decode_down<T, 4, 16, SP>(act, ids, weights, k, E, down, I, H, y);                                         \
    }
MOE_DECODE_DOWN_ENTRY(moe_decode_down_bf16, bf16_t, 2)
MOE_DECODE_DOWN_ENTRY(moe_decode_down_f32, float, 4)
