// Gated DeltaNet (Qwen3.5 linear-attention layers): causal depthwise conv1d with state, and the gated delta rule.
// Both kernels take a varlen batch: sequence s owns tokens [cu_seqlens[s], cu_seqlens[s+1]) (a decode step is
// one token, a prefill chunk many) and its state slot state_slots[s]; fresh[s] != 0 means "start from zeros".
// These kernels run token by token: decode, short chunks and fp32 models. bf16 prefill chunks of 64+ tokens take
// the chunked WY-form kernels in deltanet_chunked.cu instead (tensor cores).
//
// conv1d_silu: x [tokens, x_stride] holds conv_dim channels; w [conv_dim, K]; conv_state [slots, K-1, conv_dim]
//   (channel-contiguous so that neighbouring threads touch neighbouring words). out = silu(causal conv), and the
//   last K-1 inputs of the sequence become its new state.
// gated_delta_rule: per value head h (key head h / (v_heads / k_heads)), with q, k L2-normalised (eps 1e-6) and
//   q scaled by 1/sqrt(dk), g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b):
//       S = S * exp(g);  S += k (beta * (v - S^T k))^T;  o = S^T q
//   State [slots, v_heads, dv, dk] fp32 (S transposed: one warp owns one value column j and its lanes walk k rows
//   contiguously; dk at most 256). One block of 8 warps = 8 value columns of one head of one sequence.
#include "common.cuh"
#include "deltanet_step.cuh"

#define MAX_CONV 8
#define MAX_DK_PER_LANE 8
#define GDN_WARPS 8

template <typename T>
__device__ void conv1d_silu_impl(T* out, long long out_stride, const T* x, long long x_stride, const T* w,
                                 T* conv_state, const int* cu_seqlens, const int* state_slots, const int* fresh,
                                 int conv_dim, int K) {
    pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (c >= conv_dim) return;
    T* st = conv_state + (long long)state_slots[s] * (K - 1) * conv_dim + c;
    float win[MAX_CONV], wc[MAX_CONV];
#pragma unroll
    for (int k = 0; k < MAX_CONV; ++k) {
        wc[k] = k < K ? to_f(w[(long long)c * K + k]) : 0.0f;
        win[k] = (k < K - 1 && !fresh[s]) ? to_f(st[(long long)k * conv_dim]) : 0.0f;
    }
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        const float xt = to_f(x[t * x_stride + c]);
        float acc = wc[K - 1] * xt;
#pragma unroll
        for (int k = 0; k < MAX_CONV - 1; ++k)
            if (k < K - 1) acc += wc[k] * win[k];
        out[t * out_stride + c] = from_f<T>(silu(acc));
        // slide the window: drop the oldest input, append this one
#pragma unroll
        for (int k = 0; k < MAX_CONV - 1; ++k)
            if (k < K - 2) win[k] = win[k + 1];
#pragma unroll
        for (int k = 0; k < MAX_CONV - 1; ++k)
            if (k == K - 2) win[k] = xt;
    }
#pragma unroll
    for (int k = 0; k < MAX_CONV - 1; ++k)
        if (k < K - 1) st[(long long)k * conv_dim] = from_f<T>(win[k]);
}

template <typename T>
__device__ void gated_delta_rule_impl(T* out, const T* q, const T* k, const T* v, long long qkv_stride, const T* a,
                                      const T* b, long long ab_stride, const float* A_log, const float* dt_bias,
                                      float* state, const int* cu_seqlens, const int* state_slots, const int* fresh,
                                      int k_heads, int v_heads, int dk, int dv) {
    pdl_entry();
    __shared__ float q_s[MAX_DK_PER_LANE * 32], k_s[MAX_DK_PER_LANE * 32], scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.y, s = blockIdx.z;
    const int j = blockIdx.x * GDN_WARPS + warp;  // value column owned by this warp (may be >= dv: idle warp)
    const int kh = h / (v_heads / k_heads);
    float* S = state + (((long long)state_slots[s] * v_heads + h) * dv + (j < dv ? j : 0)) * dk;
    float Sr[MAX_DK_PER_LANE];
#pragma unroll
    for (int e = 0; e < MAX_DK_PER_LANE; ++e)
        Sr[e] = (lane + 32 * e < dk && j < dv && !fresh[s]) ? S[lane + 32 * e] : 0.0f;
    const float neg_A = -expf(A_log[h]);
    const float q_scale = rsqrtf((float)dk);
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        const GdnGates g = gdn_token_gates(q_s, k_s, scratch, q, k, qkv_stride, a, b, ab_stride, dt_bias, neg_A,
                                           q_scale, t, h, kh, dk);
        if (j < dv) {
            const float o = gdn_column_step(Sr, q_s, k_s, g, v + (t * qkv_stride + (long long)h * dv + j), lane, dk);
            if (lane == 0) out[(long long)t * v_heads * dv + (long long)h * dv + j] = from_f<T>(o);
        }
        __syncthreads();  // q_s / k_s are overwritten by the next token
    }
    if (j < dv) {
#pragma unroll
        for (int e = 0; e < MAX_DK_PER_LANE; ++e)
            if (lane + 32 * e < dk) S[lane + 32 * e] = Sr[e];
    }
}


// gdn_decode: the gated delta rule of gated_delta_rule (same arguments, same result) for dk == 128 (every Qwen3.5
//   class), one block per (value head, sequence) instead of one per 8 value columns. Measured at 9B, 192 rows
//   (bench/results/cuda_notes.md, session 7): gated_delta_rule moves its state at ~67% of the copy rate, with 4 KiB
//   of state per 256-thread block, 4-byte loads and two block-wide reductions per token redone by each of a head's
//   16 blocks. Here 8 warps x GDN_DEC_ROWS value columns; lane l holds state elements 4l..4l+3 of each of its warp's
//   columns (16-byte loads, all GDN_DEC_ROWS in flight before the first use); each warp normalises q and k itself
//   (warp sums, no block barrier); the state is read once and written once per step.
#define GDN_DEC_ROWS 16  // value columns per warp: dv <= GDN_WARPS * GDN_DEC_ROWS = 128

template <typename T>
__device__ void gdn_decode_impl(T* out, const T* q, const T* k, const T* v, long long qkv_stride, const T* a,
                                const T* b, long long ab_stride, const float* A_log, const float* dt_bias,
                                float* state, const int* cu_seqlens, const int* state_slots, const int* fresh,
                                int k_heads, int v_heads, int dv) {
    constexpr int DK = 128;
    pdl_entry();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.x, s = blockIdx.y;
    const int kh = h / (v_heads / k_heads), j0 = warp * GDN_DEC_ROWS;
    float* S = state + ((long long)state_slots[s] * v_heads + h) * dv * DK + 4 * lane;
    const bool from_zero = fresh[s] != 0;
    float4 Sr[GDN_DEC_ROWS];
#pragma unroll
    for (int r = 0; r < GDN_DEC_ROWS; ++r)
        Sr[r] = (j0 + r < dv && !from_zero) ? *reinterpret_cast<const float4*>(S + (long long)(j0 + r) * DK)
                                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float neg_A = -expf(A_log[h]);
    const float q_scale = rsqrtf((float)DK);
    for (int t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
        const T* qt = q + t * qkv_stride + (long long)kh * DK + 4 * lane;
        const T* kt = k + t * qkv_stride + (long long)kh * DK + 4 * lane;
        float qv[4], kv4[4], qss = 0.0f, kss = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            qv[e] = to_f(qt[e]);
            kv4[e] = to_f(kt[e]);
            qss += qv[e] * qv[e];
            kss += kv4[e] * kv4[e];
        }
        const float q_inv = rsqrtf(warp_sum(qss) + 1e-6f) * q_scale, k_inv = rsqrtf(warp_sum(kss) + 1e-6f);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            qv[e] *= q_inv;
            kv4[e] *= k_inv;
        }
        const float decay = expf(neg_A * softplusf(to_f(a[t * ab_stride + h]) + dt_bias[h]));
        const float beta = sigmoidf(to_f(b[t * ab_stride + h]));
        const T* vt = v + t * qkv_stride + (long long)h * dv + j0;
        float o_mine = 0.0f;  // lane r < GDN_DEC_ROWS ends with column j0 + r's output
#pragma unroll
        for (int r = 0; r < GDN_DEC_ROWS; ++r) {
            float4& x = Sr[r];
            x.x *= decay;
            x.y *= decay;
            x.z *= decay;
            x.w *= decay;
            const float kv = warp_sum(x.x * kv4[0] + x.y * kv4[1] + x.z * kv4[2] + x.w * kv4[3]);
            const float delta = ((j0 + r < dv ? to_f(vt[r]) : 0.0f) - kv) * beta;
            x.x += kv4[0] * delta;
            x.y += kv4[1] * delta;
            x.z += kv4[2] * delta;
            x.w += kv4[3] * delta;
            const float o = warp_sum(x.x * qv[0] + x.y * qv[1] + x.z * qv[2] + x.w * qv[3]);
            if (lane == r) o_mine = o;
        }
        if (lane < GDN_DEC_ROWS && j0 + lane < dv)
            out[(long long)t * v_heads * dv + (long long)h * dv + j0 + lane] = from_f<T>(o_mine);
    }
#pragma unroll
    for (int r = 0; r < GDN_DEC_ROWS; ++r)
        if (j0 + r < dv) *reinterpret_cast<float4*>(S + (long long)(j0 + r) * DK) = Sr[r];
}

// Prefill form of the gated delta rule, in two passes (the recurrent pass is the sequential part, so it must do
// as little as possible per token):
// gdn_prepare: fully parallel over tokens. Block (t, kh): L2-normalised k and q (q also scaled by 1/sqrt(dk)) in
//   fp32 -> qn, kn [tokens, k_heads, dk]; block (t, 0) also writes decay = exp(g) and beta for every value head
//   -> db [tokens, v_heads, 2].
// gdn_recurrent: same grid and state layout as gated_delta_rule, but per token a warp only loads its lanes' qn/kn
//   values and two scalars (no block reductions, no barriers); the next token's loads are issued before this
//   token's arithmetic.
template <typename T>
__device__ void gdn_prepare_impl(float* qn, float* kn, float* db, const T* q, const T* k, long long qkv_stride,
                                 const T* a, const T* b, long long ab_stride, const float* A_log,
                                 const float* dt_bias, int n, int k_heads, int v_heads, int dk) {
    pdl_entry();
    __shared__ float scratch[32];
    const int t = blockIdx.x, kh = blockIdx.y;
    if (t >= n) return;
    const T* qt = q + t * qkv_stride + (long long)kh * dk;
    const T* kt = k + t * qkv_stride + (long long)kh * dk;
    float qss = 0.0f, kss = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float qi = to_f(qt[i]), ki = to_f(kt[i]);
        qss += qi * qi;
        kss += ki * ki;
    }
    const float q_inv = rsqrtf(block_sum(qss, scratch) + 1e-6f) * rsqrtf((float)dk);
    const float k_inv = rsqrtf(block_sum(kss, scratch) + 1e-6f);
    float* qo = qn + ((long long)t * k_heads + kh) * dk;
    float* ko = kn + ((long long)t * k_heads + kh) * dk;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        qo[i] = to_f(qt[i]) * q_inv;
        ko[i] = to_f(kt[i]) * k_inv;
    }
    if (kh == 0)
        for (int h = threadIdx.x; h < v_heads; h += blockDim.x) {
            db[((long long)t * v_heads + h) * 2] = expf(-expf(A_log[h]) * softplusf(to_f(a[t * ab_stride + h]) + dt_bias[h]));
            db[((long long)t * v_heads + h) * 2 + 1] = sigmoidf(to_f(b[t * ab_stride + h]));
        }
}

template <typename T, int DKL, int ROWS>  // DKL: dk elements per lane (dk <= 32 * DKL); ROWS: state rows per warp
__device__ void gdn_recurrent_impl(T* out, const float* qn, const float* kn, const T* v, long long v_stride,
                                   const float* db, float* state, const int* cu_seqlens, const int* state_slots,
                                   const int* fresh, int k_heads, int v_heads, int dk, int dv) {
    pdl_entry();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.y, s = blockIdx.z;
    const int j0 = (blockIdx.x * GDN_WARPS + warp) * ROWS;  // this warp's first value column
    if (j0 >= dv) return;  // no barriers below: idle warps may leave
    const int kh = h / (v_heads / k_heads);
    float* S = state + (((long long)state_slots[s] * v_heads + h) * dv + j0) * dk;
    // ROWS state rows per warp: their loads are all in flight at once (a decode step is one token, so the
    // kernel is a read-modify-write of the state, bound by how many bytes each warp keeps in flight)
    float Sr[ROWS][DKL], qr[DKL], kr[DKL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < DKL; ++e)
            Sr[r][e] = (j0 + r < dv && lane + 32 * e < dk && !fresh[s]) ? S[(long long)r * dk + lane + 32 * e] : 0.0f;
    const int t0 = cu_seqlens[s], t1 = cu_seqlens[s + 1];
    // registers for token t (loaded one token ahead)
    float vt[ROWS], decay = 1.0f, beta = 0.0f;
    auto load = [&](int t) {
        const float* qp = qn + ((long long)t * k_heads + kh) * dk;
        const float* kp = kn + ((long long)t * k_heads + kh) * dk;
#pragma unroll
        for (int e = 0; e < DKL; ++e) {
            const bool ok = lane + 32 * e < dk;
            qr[e] = ok ? qp[lane + 32 * e] : 0.0f;
            kr[e] = ok ? kp[lane + 32 * e] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            vt[r] = j0 + r < dv ? to_f(v[t * v_stride + (long long)h * dv + j0 + r]) : 0.0f;
        decay = db[((long long)t * v_heads + h) * 2];
        beta = db[((long long)t * v_heads + h) * 2 + 1];
    };
    if (t0 < t1) load(t0);
    for (int t = t0; t < t1; ++t) {
        float q_cur[DKL], k_cur[DKL], v_cur[ROWS];
#pragma unroll
        for (int e = 0; e < DKL; ++e) {
            q_cur[e] = qr[e];
            k_cur[e] = kr[e];
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) v_cur[r] = vt[r];
        const float decay_cur = decay, beta_cur = beta;
        if (t + 1 < t1) load(t + 1);  // in flight while this token computes
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float kv = 0.0f;
#pragma unroll
            for (int e = 0; e < DKL; ++e) {
                Sr[r][e] *= decay_cur;
                kv += Sr[r][e] * k_cur[e];
            }
            kv = warp_sum(kv);
            const float delta = (v_cur[r] - kv) * beta_cur;
            float o = 0.0f;
#pragma unroll
            for (int e = 0; e < DKL; ++e) {
                Sr[r][e] += k_cur[e] * delta;
                o += Sr[r][e] * q_cur[e];
            }
            o = warp_sum(o);
            if (lane == 0 && j0 + r < dv) out[(long long)t * v_heads * dv + (long long)h * dv + j0 + r] = from_f<T>(o);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < DKL; ++e)
            if (j0 + r < dv && lane + 32 * e < dk) S[(long long)r * dk + lane + 32 * e] = Sr[r][e];
}


// Prefill form of the conv, parallel over tokens (the sequential conv1d_silu walks each sequence token by token):
// conv1d_silu_runs: one thread per (V adjacent channels, run of `run` batch rows). It reads the K-1 inputs before
//   its run once (from x, or from the old state / zeros where they precede the sequence), then slides a register
//   window over the run: every x element is read once (plus the K-1 halo rows per run) with V-wide loads (16 bytes
//   for V = 16 / sizeof(T); V = 1 when rows are not 16-byte aligned), and a warp covers 32*V contiguous channels.
//   A run may cross sequence boundaries: the window is refilled there. Taps are right-aligned in KM slots
//   (KM >= K, weights of the unused leading slots are zero) so that every register index is static.
// conv1d_state_update: afterwards, each sequence's last K-1 inputs become its state (one thread per channel reads
//   everything it needs before writing, so old and new state never race).
template <int V>
__device__ __forceinline__ void load_row(const bf16_t* p, float* f) {
    if constexpr (V == 8) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const unsigned int wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(wd[i] << 16);
            f[2 * i + 1] = __uint_as_float(wd[i] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = to_f(p[i]);
    }
}

template <int V>
__device__ __forceinline__ void load_row(const float* p, float* f) {
    if constexpr (V == 4) {
        const float4 u = *reinterpret_cast<const float4*>(p);
        f[0] = u.x, f[1] = u.y, f[2] = u.z, f[3] = u.w;
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = p[i];
    }
}

template <int V>
__device__ __forceinline__ void store_row(bf16_t* p, const float* f) {
    if constexpr (V == 8) {
        unsigned int wd[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            wd[i] = (unsigned int)from_f<bf16_t>(f[2 * i]) | ((unsigned int)from_f<bf16_t>(f[2 * i + 1]) << 16);
        *reinterpret_cast<uint4*>(p) = make_uint4(wd[0], wd[1], wd[2], wd[3]);
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) p[i] = from_f<bf16_t>(f[i]);
    }
}

template <int V>
__device__ __forceinline__ void store_row(float* p, const float* f) {
    if constexpr (V == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) p[i] = f[i];
    }
}

template <typename T, int V, int KM>
__device__ void conv1d_silu_runs_impl(T* out, long long out_stride, const T* x, long long x_stride, const T* w,
                                      const T* conv_state, const int* cu_seqlens, const int* token_seq,
                                      const int* state_slots, const int* fresh, int n, int seqs, int conv_dim, int K,
                                      int run) {
    pdl_entry();
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    const int t0 = blockIdx.y * run, t1 = min(t0 + run, n);
    if (c0 >= conv_dim || t0 >= n) return;
    // wr[j][i]: tap j of channel c0+i, right-aligned (slot KM-1 multiplies the current input)
    float wr[KM][V];
#pragma unroll
    for (int j = 0; j < KM; ++j)
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int k = j - (KM - K);
            wr[j][i] = k >= 0 ? to_f(w[(long long)(c0 + i) * K + k]) : 0.0f;
        }
    float win[KM - 1][V];  // win[j] = input of row t - (KM-1) + j (win[KM-2] the newest)
    int s = token_seq[t0], t = t0;
    while (t < t1 && s < seqs) {
        const int start = cu_seqlens[s], end = min(cu_seqlens[s + 1], t1);
        if (end <= t) { ++s; continue; }  // empty sequence (or none left in this run)
        const bool is_fresh = fresh[s] != 0;
        const T* st = conv_state + (long long)state_slots[s] * (K - 1) * conv_dim + c0;
#pragma unroll
        for (int j = 0; j < KM - 1; ++j) {
            const int src = t - (KM - 1) + j;
            if (j < KM - K) {
#pragma unroll
                for (int i = 0; i < V; ++i) win[j][i] = 0.0f;  // its weight is zero; keep NaN out of 0 * x
            } else if (src >= start) {
                load_row<V>(x + (long long)src * x_stride + c0, win[j]);
            } else if (is_fresh) {
#pragma unroll
                for (int i = 0; i < V; ++i) win[j][i] = 0.0f;
            } else {
                load_row<V>(st + (long long)(K - 1 - (start - src)) * conv_dim, win[j]);
            }
        }
#pragma unroll 4
        for (; t < end; ++t) {
            float xt[V], acc[V];
            load_row<V>(x + (long long)t * x_stride + c0, xt);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float a = wr[KM - 1][i] * xt[i];
#pragma unroll
                for (int j = 0; j < KM - 1; ++j)
                    if (j >= KM - K) a += wr[j][i] * win[j][i];  // unused leading slots: skip, not 0 * x
                acc[i] = silu(a);
            }
            store_row<V>(out + (long long)t * out_stride + c0, acc);
#pragma unroll
            for (int i = 0; i < V; ++i) {
#pragma unroll
                for (int j = 0; j < KM - 2; ++j) win[j][i] = win[j + 1][i];
                win[KM - 2][i] = xt[i];
            }
        }
        ++s;
    }
}

template <typename T>
__device__ void conv1d_state_update_impl(const T* x, long long x_stride, T* conv_state, const int* cu_seqlens,
                                         const int* state_slots, const int* fresh, int conv_dim, int K) {
    pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (c >= conv_dim) return;
    const int start = cu_seqlens[s], len = cu_seqlens[s + 1] - start;
    T* st = conv_state + (long long)state_slots[s] * (K - 1) * conv_dim + c;
    float win[MAX_CONV];
#pragma unroll
    for (int k = 0; k < MAX_CONV - 1; ++k) {
        if (k >= K - 1) break;
        const int rel = len - (K - 1) + k;  // position in the chunk of the input that becomes state[k]
        win[k] = rel >= 0 ? to_f(x[(start + rel) * x_stride + c])
                          : (fresh[s] ? 0.0f : to_f(st[(long long)(K - 1 + rel) * conv_dim]));
    }
#pragma unroll
    for (int k = 0; k < MAX_CONV - 1; ++k)
        if (k < K - 1) st[(long long)k * conv_dim] = from_f<T>(win[k]);
}

// conv1d_silu_runs_<dtype>_<v1|vec>_<k4|k8>: V = 1 or 16 bytes of channels per thread, KM = 4 (K <= 4) or 8
#define CONV_RUNS(S, T, NAME, V, KM)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) conv1d_silu_runs_##S##_##NAME(                              \
        T* out, long long out_stride, const T* x, long long x_stride, const T* w, const T* conv_state,            \
        const int* cu_seqlens, const int* token_seq, const int* state_slots, const int* fresh, int n,             \
        int seqs, int conv_dim, int K, int run) {                                                                 \
        conv1d_silu_runs_impl<T, V, KM>(out, out_stride, x, x_stride, w, conv_state, cu_seqlens, token_seq,       \
                                        state_slots, fresh, n, seqs, conv_dim, K, run);                           \
    }

#define GDN_RECURRENT(S, T, NAME, DKL, ROWS)                                                                   \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) NAME(                                             \
        T* out, const float* qn, const float* kn, const T* v, long long v_stride, const float* db, float* state,  \
        const int* cu_seqlens, const int* state_slots, const int* fresh, int k_heads, int v_heads, int dk,        \
        int dv) {                                                                                                 \
        gdn_recurrent_impl<T, DKL, ROWS>(out, qn, kn, v, v_stride, db, state, cu_seqlens, state_slots, fresh,     \
                                         k_heads, v_heads, dk, dv);                                               \
    }
#define DEFINE(S, T)                                                                                              \
    extern "C" __global__ void conv1d_silu_##S(T* out, long long out_stride, const T* x, long long x_stride,      \
                                               const T* w, T* conv_state, const int* cu_seqlens,                  \
                                               const int* state_slots, const int* fresh, int conv_dim, int K) {   \
        conv1d_silu_impl<T>(out, out_stride, x, x_stride, w, conv_state, cu_seqlens, state_slots, fresh,         \
                            conv_dim, K);                                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gated_delta_rule_##S(                             \
        T* out, const T* q, const T* k, const T* v, long long qkv_stride, const T* a, const T* b,                 \
        long long ab_stride, const float* A_log, const float* dt_bias, float* state, const int* cu_seqlens,       \
        const int* state_slots, const int* fresh, int k_heads, int v_heads, int dk, int dv) {                     \
        gated_delta_rule_impl<T>(out, q, k, v, qkv_stride, a, b, ab_stride, A_log, dt_bias, state, cu_seqlens,    \
                                 state_slots, fresh, k_heads, v_heads, dk, dv);                                   \
    }                                                                                                             \
    extern "C" __global__ void gdn_prepare_##S(float* qn, float* kn, float* db, const T* q, const T* k,            \
                                               long long qkv_stride, const T* a, const T* b, long long ab_stride, \
                                               const float* A_log, const float* dt_bias, int n, int k_heads,      \
                                               int v_heads, int dk) {                                             \
        gdn_prepare_impl<T>(qn, kn, db, q, k, qkv_stride, a, b, ab_stride, A_log, dt_bias, n, k_heads, v_heads,   \
                            dk);                                                                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gdn_decode_##S(                                   \
        T* out, const T* q, const T* k, const T* v, long long qkv_stride, const T* a, const T* b,                 \
        long long ab_stride, const float* A_log, const float* dt_bias, float* state, const int* cu_seqlens,       \
        const int* state_slots, const int* fresh, int k_heads, int v_heads, int dv) {                             \
        gdn_decode_impl<T>(out, q, k, v, qkv_stride, a, b, ab_stride, A_log, dt_bias, state, cu_seqlens,          \
                           state_slots, fresh, k_heads, v_heads, dv);                                             \
    }                                                                                                             \
    GDN_RECURRENT(S, T, gdn_recurrent_##S, MAX_DK_PER_LANE, 1)                                                    \
    GDN_RECURRENT(S, T, gdn_recurrent_r4_##S, MAX_DK_PER_LANE, 4)                                                 \
    GDN_RECURRENT(S, T, gdn_recurrent_dk128_##S, 4, 1)                                                           \
    GDN_RECURRENT(S, T, gdn_recurrent_dk128_r4_##S, 4, 4)                                                        \
    CONV_RUNS(S, T, v1_k4, 1, 4)                                                                                 \
    CONV_RUNS(S, T, v1_k8, 1, 8)                                                                                 \
    CONV_RUNS(S, T, vec_k4, 16 / sizeof(T), 4)                                                                   \
    CONV_RUNS(S, T, vec_k8, 16 / sizeof(T), 8)                                                                   \
    extern "C" __global__ void conv1d_state_update_##S(const T* x, long long x_stride, T* conv_state,              \
                                                       const int* cu_seqlens, const int* state_slots,             \
                                                       const int* fresh, int conv_dim, int K) {                   \
        conv1d_state_update_impl<T>(x, x_stride, conv_state, cu_seqlens, state_slots, fresh, conv_dim, K);        \
    }
DEFINE(bf16, bf16_t)
DEFINE(f32, float)
#undef DEFINE
#undef CONV_RUNS
#undef GDN_RECURRENT
