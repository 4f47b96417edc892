// One token of the token-by-token gated delta rule, shared by gated_delta_rule (deltanet.cu) and
// gated_delta_rule_window (spec_verify.cu, which also snapshots the state after each token): one block of warps per
// group of value columns of head h, one warp per column, lane l holding rows l + 32 e of it in Sr[e].
// Include after common.cuh (expand_source inlines one level only, so this header includes nothing).

struct GdnGates {
    float q_inv, k_inv;  // L2-norm scales of q (times 1/sqrt(dk)) and k
    float decay, beta;   // exp(g) and sigmoid(b) of value head h
};

// Block-wide part: key head kh's q and k rows of token t into q_s / k_s (fp32), their scales, and head h's gates.
// block_sum's barriers also publish q_s / k_s; the caller syncs before the next token overwrites them.
template <typename T>
__device__ __forceinline__ GdnGates gdn_token_gates(float* q_s, float* k_s, float* scratch, const T* q, const T* k,
                                                    long long qkv_stride, const T* a, const T* b, long long ab_stride,
                                                    const float* dt_bias, float neg_A, float q_scale, int t, int h,
                                                    int kh, int dk) {
    const T* qt = q + t * qkv_stride + (long long)kh * dk;
    const T* kt = k + t * qkv_stride + (long long)kh * dk;
    float qss = 0.0f, kss = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float qi = to_f(qt[i]), ki = to_f(kt[i]);
        q_s[i] = qi;
        k_s[i] = ki;
        qss += qi * qi;
        kss += ki * ki;
    }
    GdnGates g;
    g.q_inv = rsqrtf(block_sum(qss, scratch) + 1e-6f) * q_scale;
    g.k_inv = rsqrtf(block_sum(kss, scratch) + 1e-6f);
    g.decay = expf(neg_A * softplusf(to_f(a[t * ab_stride + h]) + dt_bias[h]));
    g.beta = sigmoidf(to_f(b[t * ab_stride + h]));
    return g;
}

// The warp's column: S *= decay; kv = S^T k; delta = (v_j - kv) * beta; S += k delta. Returns o = S^T q (warp-summed:
// every lane has it). vj: this token's value of the column.
template <typename T, int DKL>
__device__ __forceinline__ float gdn_column_step(float (&Sr)[DKL], const float* q_s, const float* k_s, GdnGates g,
                                                 const T* vj, int lane, int dk) {
    float kv = 0.0f;
#pragma unroll
    for (int e = 0; e < DKL; ++e)
        if (lane + 32 * e < dk) {
            Sr[e] *= g.decay;
            kv += Sr[e] * k_s[lane + 32 * e] * g.k_inv;
        }
    kv = warp_sum(kv);
    const float delta = (to_f(*vj) - kv) * g.beta;
    float o = 0.0f;
#pragma unroll
    for (int e = 0; e < DKL; ++e)
        if (lane + 32 * e < dk) {
            Sr[e] += k_s[lane + 32 * e] * g.k_inv * delta;
            o += Sr[e] * q_s[lane + 32 * e] * g.q_inv;
        }
    return warp_sum(o);
}
