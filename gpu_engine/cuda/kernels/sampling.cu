// sample_rows_f32: the whole sampler of gpu_engine/sampling.py for one logits row per block (1024 threads).
//
// params [rows, 8] float32 per row: temperature (0 = greedy), top_k (0 = off), top_p, min_p, u_hi, u_lo (the
// engine's uniform draw u = u_hi + u_lo, split so that a float64 survives float32 storage), num_logprobs (-1 none,
// 0 chosen only, n <= 20 chosen + top-n), mask_row (row of `masks` holding this row's grammar bitmask, -1 = none).
//
// Semantics (the same as the numpy sampler): x = logits with disallowed tokens at -inf ("processed" logits).
// Greedy: argmax x (lowest index on ties). Sampled: y = x / temperature (IEEE division, bit-equal to numpy),
// then a keep threshold on y: top-k keeps y >= the k-th largest value; top-p keeps y >= the largest value t whose
// set {y >= t} (within the top-k set) holds at least top_p of that set's probability; min-p keeps y >= max + log
// min_p; ties at every cut-off are kept. The token is the first one, in vocabulary order, whose running sum of
// exp(y - max) over kept tokens reaches u * (their total). Logprobs come from log_softmax(x).
//
// No sort: every threshold is found by a radix-style search over the order-preserving 32-bit key of a float.
// Each pass splits the current key interval into 32 buckets (a per-warp histogram of counts and masses in shared
// memory), then keeps the bucket that holds the answer; an interval of 2^32 keys takes 7 passes over the row.
// Summation orders differ from numpy's, so a token (or a top-p cut) can differ only where u (or top_p) falls
// within float rounding of a boundary.
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SEARCH_BUCKETS 32
#define MAX_TOP_LOGPROBS 20
#define SAMPLE_PARAMS 8
// Top-p starts its search this far below the max: tokens further down weigh < e^-40 each, too little to reach
// even the smallest float32 gap 1 - top_p (6e-8) with 2^24 tokens; the search checks it and restarts if not.
#define TOP_P_WINDOW 40.0f

// -0.0 and +0.0 get one key: numpy compares them equal, so they tie at a cut-off like any equal values.
__device__ __forceinline__ unsigned int order_key(float v) {
    const unsigned int b = v == 0.0f ? 0u : __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct SampleRow {
    const float* x;
    const unsigned int* mask;  // nullptr: no grammar mask on this row
    int vocab;
    float temp;  // values are x / temp (1.0f: the processed logits themselves, exactly)

    __device__ __forceinline__ float at(int i) const {
        float v = x[i];
        if (mask != nullptr && ((mask[i >> 5] >> (i & 31)) & 1u) == 0u) v = NEG_INF;
        return v / temp;
    }
};

struct SearchOut {
    unsigned int key;  // the largest key K with g(K) >= target
    float count;       // count of values with key >= K (exact below 2^24)
    float mass;        // sum of exp(v - vmax) over them (when by_mass)
    bool ok;           // false: g(lo) < target (the caller's lo was a guess that failed)
};

// Largest key K in [lo, hi] with g(K) >= target, g(K) = count (by_mass false) or mass of the values with key >= K
// (values below lo are ignored altogether). Needs g(hi + 1) < target. Every thread gets the result. with_mass:
// also sum the masses (always on when by_mass), so that a count search reports the mass it keeps.
__device__ SearchOut search_key(const SampleRow& row, unsigned int lo, unsigned int hi, bool by_mass, float target,
                                float vmax, bool with_mass) {
    with_mass = with_mass || by_mass;
    __shared__ int s_cnt[SAMPLE_WARPS][SEARCH_BUCKETS];
    __shared__ float s_mass[SAMPLE_WARPS][SEARCH_BUCKETS];
    __shared__ float scratch[32];
    __shared__ unsigned int s_lo, s_hi;
    __shared__ float s_count, s_massv;
    __shared__ int s_ok;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    SearchOut out;
    out.ok = true;
    do {
        const unsigned long long range = (unsigned long long)hi - lo + 1ull;
        int shift = 0;
        while (((range - 1ull) >> shift) >= SEARCH_BUCKETS) ++shift;
        for (int j = threadIdx.x; j < SAMPLE_WARPS * SEARCH_BUCKETS; j += blockDim.x) {
            (&s_cnt[0][0])[j] = 0;
            (&s_mass[0][0])[j] = 0.0f;
        }
        __syncthreads();
        int above_n = 0;
        float above_m = 0.0f;
        for (int i = threadIdx.x; i < row.vocab; i += blockDim.x) {
            const float v = row.at(i);
            const unsigned int k = order_key(v);
            if (k < lo) continue;
            const float w = with_mass ? expf(v - vmax) : 0.0f;
            if (k > hi) {
                ++above_n;
                above_m += w;
            } else {
                const int b = (int)((k - lo) >> shift);
                atomicAdd(&s_cnt[warp][b], 1);
                if (with_mass) atomicAdd(&s_mass[warp][b], w);
            }
        }
        const float an = block_sum((float)above_n, scratch);
        const float am = block_sum(above_m, scratch);  // its barriers also order the histogram atomics
        if (warp == 0) {
            int c = 0;
            float m = 0.0f;
            for (int w2 = 0; w2 < SAMPLE_WARPS; ++w2) {
                c += s_cnt[w2][lane];
                m += s_mass[w2][lane];
            }
            float gc = (float)c, gm = m;  // suffix sums: g(lo + (lane << shift)) = above + buckets >= lane
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float tc = __shfl_down_sync(0xffffffffu, gc, o);
                const float tm = __shfl_down_sync(0xffffffffu, gm, o);
                if (lane + o < 32) {
                    gc += tc;
                    gm += tm;
                }
            }
            gc += an;
            gm += am;
            const unsigned long long cj = (unsigned long long)lo + ((unsigned long long)lane << shift);
            const bool ok = cj <= hi && (by_mass ? gm >= target : gc >= target);
            const unsigned int ballot = __ballot_sync(0xffffffffu, ok);
            const int j = ballot ? 31 - __clz(ballot) : 0;
            if (lane == j) {
                const unsigned long long top = cj + (1ull << shift) - 1ull;
                s_lo = (unsigned int)cj;
                s_hi = top < hi ? (unsigned int)top : hi;
                s_count = gc;
                s_massv = gm;
                s_ok = ballot != 0u;
            }
        }
        __syncthreads();
        lo = s_lo;
        hi = s_hi;
        out.count = s_count;
        out.mass = s_massv;
        if (!s_ok) out.ok = false;
        __syncthreads();  // s_lo & co. are rewritten by the next pass
    } while (out.ok && lo < hi);
    out.key = lo;
    return out;
}

// Block-wide: max value, sum of exp(v - max) (online, one read), and the lowest index of the max.
struct RowStats {
    float max;
    float sum;
    int argmax;
};

__device__ RowStats row_stats(const SampleRow& row) {
    __shared__ float s_m[SAMPLE_WARPS], s_s[SAMPLE_WARPS];
    __shared__ int s_i[SAMPLE_WARPS];
    __shared__ RowStats s_out;
    float m = NEG_INF, s = 0.0f;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < row.vocab; i += blockDim.x) {
        const float v = row.at(i);
        if (v > m) {
            s = (m == NEG_INF ? 0.0f : s * expf(m - v)) + 1.0f;
            m = v;
            best_i = i;
        } else if (v != NEG_INF) {
            s += expf(v - m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, m, o);
        const float os = __shfl_xor_sync(0xffffffffu, s, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        const float nm = fmaxf(m, om);
        s = (m == NEG_INF ? 0.0f : s * expf(m - nm)) + (om == NEG_INF ? 0.0f : os * expf(om - nm));
        if (om > m || (om == m && oi < best_i)) best_i = oi;
        m = nm;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        s_m[warp] = m;
        s_s[warp] = s;
        s_i[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        RowStats r{NEG_INF, 0.0f, 0x7fffffff};
        for (int w = 0; w < SAMPLE_WARPS; ++w) r.max = fmaxf(r.max, s_m[w]);
        for (int w = 0; w < SAMPLE_WARPS; ++w) {
            if (s_m[w] != NEG_INF) r.sum += s_s[w] * expf(s_m[w] - r.max);
            if (s_m[w] == r.max && s_i[w] < r.argmax) r.argmax = s_i[w];
        }
        if (r.argmax == 0x7fffffff) r.argmax = 0;  // all -inf: token 0, never garbage
        s_out = r;
    }
    __syncthreads();
    return s_out;
}

// The first kept token (key >= keep) in vocabulary order at which the running sum of exp(v - vmax) reaches
// u * total. Each warp owns one contiguous slice of the row: slice totals first, then one warp walks the slice
// that holds the target. Rounding fallback: the last kept token.
__device__ int draw_token(const SampleRow& row, unsigned int keep, float vmax, double u) {
    __shared__ float s_tot[SAMPLE_WARPS];
    __shared__ int s_last[SAMPLE_WARPS];
    __shared__ int s_sel, s_token;
    __shared__ float s_prefix;
    __shared__ double s_target;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = ((row.vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS + 31) / 32 * 32;
    const int begin = warp * slice, end = min(row.vocab, begin + slice);
    float tot = 0.0f;
    int last = -1;
    for (int i = begin + lane; i < end; i += 32) {
        const float v = row.at(i);
        if (order_key(v) >= keep && v != NEG_INF) {
            tot += expf(v - vmax);
            last = i;
        }
    }
    tot = warp_sum(tot);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    if (lane == 0) {
        s_tot[warp] = tot;
        s_last[warp] = last;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < SAMPLE_WARPS; ++w) total += s_tot[w];
        const double target = fmax(u * (double)total, 1.1754943508222875e-38);  // numpy: max(u, float32 tiny)
        float prefix = 0.0f;
        int sel = -1, fallback = -1;
        for (int w = 0; w < SAMPLE_WARPS; ++w) {
            if (s_last[w] >= 0) fallback = w;
            if (sel < 0 && s_tot[w] > 0.0f && (double)(prefix + s_tot[w]) >= target) {
                sel = w;
                break;
            }
            prefix += s_tot[w];
        }
        s_sel = sel >= 0 ? sel : fallback;
        s_prefix = sel >= 0 ? prefix : 0.0f;
        s_target = target;
        s_token = s_sel >= 0 ? s_last[s_sel] : 0;
    }
    __syncthreads();
    if (warp == s_sel) {
        float running = s_prefix;
        const double target = s_target;
        for (int base = begin; base < end; base += 32) {
            const int i = base + lane;
            float w = 0.0f;
            if (i < end) {
                const float v = row.at(i);
                if (order_key(v) >= keep && v != NEG_INF) w = expf(v - vmax);
            }
            float scan = w;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float t = __shfl_up_sync(0xffffffffu, scan, o);
                if (lane >= o) scan += t;
            }
            const unsigned int hit = __ballot_sync(0xffffffffu, w > 0.0f && (double)(running + scan) >= target);
            if (hit) {
                if (lane == 0) s_token = base + __ffs(hit) - 1;
                break;
            }
            running += __shfl_sync(0xffffffffu, scan, 31);
        }
    }
    __syncthreads();
    return s_token;
}

// The n largest processed logits (ties: lowest index), best first, as log-probabilities.
__device__ void top_logprobs(const SampleRow& row, int n, float lse_max, float lse_log, int* ids_out,
                             float* lp_out) {
    __shared__ int s_ids[MAX_TOP_LOGPROBS];
    __shared__ float s_vals[MAX_TOP_LOGPROBS];
    __shared__ int s_ties[SAMPLE_WARPS][MAX_TOP_LOGPROBS];
    __shared__ int s_tie_n[SAMPLE_WARPS];
    __shared__ int s_greater;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const SearchOut nth = search_key(row, 0u, order_key(lse_max), false, (float)n, lse_max, false);
    if (threadIdx.x == 0) s_greater = 0;
    __syncthreads();
    const int slice = ((row.vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS + 31) / 32 * 32;
    const int begin = warp * slice, end = min(row.vocab, begin + slice);
    int ties = 0;
    for (int base = begin; base < end; base += 32) {
        const int i = base + lane;
        const float v = i < end ? row.at(i) : NEG_INF;
        const unsigned int k = i < end ? order_key(v) : 0u;
        if (i < end && k > nth.key) {  // fewer than n of these: key is the largest with count(>= key) >= n
            const int slot = atomicAdd(&s_greater, 1);
            s_ids[slot] = i;
            s_vals[slot] = v;
        }
        const unsigned int tie = __ballot_sync(0xffffffffu, i < end && k == nth.key);
        const int rank = ties + __popc(tie & ((1u << lane) - 1u));
        if (i < end && k == nth.key && rank < MAX_TOP_LOGPROBS) s_ties[warp][rank] = i;
        ties += __popc(tie);
    }
    if (lane == 0) s_tie_n[warp] = min(ties, MAX_TOP_LOGPROBS);
    __syncthreads();
    if (threadIdx.x == 0) {
        int count = s_greater;
        for (int w = 0; w < SAMPLE_WARPS && count < n; ++w)
            for (int t = 0; t < s_tie_n[w] && count < n; ++t) {
                s_ids[count] = s_ties[w][t];
                s_vals[count] = row.at(s_ties[w][t]);
                ++count;
            }
        for (int a = 1; a < count; ++a) {  // insertion sort: value descending, index ascending
            const int id = s_ids[a];
            const float v = s_vals[a];
            int b = a - 1;
            while (b >= 0 && (s_vals[b] < v || (s_vals[b] == v && s_ids[b] > id))) {
                s_ids[b + 1] = s_ids[b];
                s_vals[b + 1] = s_vals[b];
                --b;
            }
            s_ids[b + 1] = id;
            s_vals[b + 1] = v;
        }
        for (int t = 0; t < MAX_TOP_LOGPROBS; ++t) {
            ids_out[t] = t < count ? s_ids[t] : -1;
            lp_out[t] = t < count ? (s_vals[t] - lse_max) - lse_log : NEG_INF;
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows_f32(int* tokens, float* chosen_lp, int* top_ids, float* top_lp, const float* logits,
                const unsigned int* masks, const float* params, int rows, int vocab, int words) {
    pdl_entry();
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* p = params + (long long)r * SAMPLE_PARAMS;
    const float temperature = p[0], top_p = p[2], min_p = p[3];
    const int top_k = (int)p[1], num_logprobs = (int)p[6], mask_row = (int)p[7];
    SampleRow raw{logits + (long long)r * vocab, mask_row >= 0 ? masks + (long long)mask_row * words : nullptr,
                  vocab, 1.0f};
    const RowStats xs = row_stats(raw);
    int token = xs.argmax;
    if (temperature > 0.0f && xs.max != NEG_INF) {
        SampleRow y = raw;
        y.temp = temperature;
        const RowStats ys = row_stats(y);  // max(x / T) == max(x) / T, but the sum needs its own pass
        const unsigned int top = order_key(ys.max);
        unsigned int keep = 0u;
        float kept_mass = ys.sum;
        if (top_k > 0 && top_k < vocab) {
            const SearchOut k = search_key(y, 0u, top, false, (float)top_k, ys.max, true);
            keep = k.key;
            kept_mass = k.mass;
        }
        if (top_p < 1.0f) {
            const float target = top_p * kept_mass;
            const unsigned int guess = max(keep, order_key(ys.max - TOP_P_WINDOW));
            SearchOut q = search_key(y, guess, top, true, target, ys.max, true);
            if (!q.ok) q = search_key(y, keep, top, true, target, ys.max, true);
            keep = max(keep, q.key);
        }
        if (min_p > 0.0f) keep = max(keep, order_key(ys.max + logf(min_p)));
        token = draw_token(y, keep, ys.max, (double)p[4] + (double)p[5]);
    }
    if (num_logprobs > 0)
        top_logprobs(raw, min(num_logprobs, min(MAX_TOP_LOGPROBS, vocab)), xs.max, logf(xs.sum),
                     top_ids + (long long)r * MAX_TOP_LOGPROBS, top_lp + (long long)r * MAX_TOP_LOGPROBS);
    if (threadIdx.x == 0) {
        tokens[r] = token;
        chosen_lp[r] = num_logprobs >= 0 ? (raw.at(token) - xs.max) - logf(xs.sum) : __int_as_float(0x7fc00000);
    }
}
