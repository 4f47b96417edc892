// docpipe: arch-specific target
// flash_prefill.cu's function at head_dim 256 (bf16 paged KV cache) on Hopper's warpgroup MMA with warp
// specialisation (FlashAttention-3's structure): same arguments, same outputs (ops.flash_prefill, variant "ws").
//
// A tile is up to FW_ROWS = 128 consecutive query tokens of ONE sequence (host-built,
// flash_plan.flash_tiles(lens, 128));
// grid (query heads, tiles) as flash_prefill.cu: the heads sharing a KV head are neighbouring blocks (L2 reuse), and
// the heaviest (latest) tiles run first. A block is one producer warpgroup that only copies keys and values, and two
// consumer warpgroups of 64 query rows each that only compute; setmaxnreg moves registers from the producer to them.
//
// Producer: K and V of key tile t (64 keys) are gathered row by row through the block table with cp.async into their
// own rings (FW_K_STAGES K stages, FW_V_STAGES V stages; keys past the tile's last position are zero-filled). The
// copies go out as groups in the order K_0, V_0, K_1, V_1, ...; once a group has landed the thread fences it for the
// async proxy and arrives on the group's full barrier, one group kept in flight behind the newest. Before a stage is
// refilled the producer waits on its empty barrier, and if that would block it first lands and hands over the group
// in flight, so a consumer never waits for a copy that has landed (no deadlock for any number of stages).
// Consumer c (rows 64 c ..): Q staged once in its part of shared memory (rows past the tile's count zero), then per
// key tile j the wg64pr-style pipelined step: issue S_j = Q K_j^T (SS, m64n64k16, 16 k-steps), issue O += P_{j-1}
// V_{j-1} (RS, m64n256k16, 4 k-steps), wait for S_j and release K_j, mask and softmax S_j while the P V runs, wait
// for it and release V_{j-1}, rescale O, pack P_j. A warpgroup computes key tiles up to the one holding its own
// last row's position; it passes the later ones (the other warpgroup's diagonal, or all for a warpgroup without
// rows) through: wait full, release, no MMA. Masks (-inf, key > the row's position) only where a tile reaches past
// the warpgroup's first row. Output O / l * sigmoid(gate) stored as bf16, rows past count skipped.
//
// Shared layout (vision_flash_wg.cu's "interleave" core matrices, no swizzle): the 16-byte piece (row r, 8-column
// chunk c) of a 64-row K, V or Q block lives at (r / 8) * GROUP + c * 128 + (r % 8) * 16, GROUP = 32 * 128 bytes.
// - Q K^T: A = Q and B = K both K-major: leading byte offset 128 (next 8 dims), stride byte offset GROUP (next 8
//   rows); k-step kk starts 256 kk bytes in.
// - P V: B = V MN-major (imm-trans-b 1): leading byte offset GROUP (next 8 keys), stride byte offset 128 (next 8
//   dims); k-step k2 (16 keys) starts 2 k2 GROUP bytes in.
// Barrier arrivals: full = the 128 producer threads; empty = lane 0 of each of the 8 consumer warps.
//
// flash_prefill_ws2_bf16_hd256 (variant "ws2"): the same kernel with two changes read off ws's code and SASS.
// 1. O's rescale by the previous step's factor moves to just after S_j's issue (FlashAttention-3's order), so its
//    128 multiplies run under Q K^T instead of between P V's retirement and the next issue.
// 2. ws's producer hands a group over only from its own cp.async waits, one group in flight behind the newest, and
//    blocks on them. ws2's threads end each group with cp.async.mbarrier.arrive.noinc on its full barrier (the
//    phase completes when every thread's copies have landed), so the producer only waits for empty stages and
//    keeps every free stage filling; the consumers fence for the async proxy after each full wait (the data was
//    written through the generic proxy, wgmma reads it through the async one).
// Found, not fixed: in ws (and ws2) the softmax does NOT overlap P V. ptxas hoists wgmma.wait_group 0 above the
// row max / exp2 / sum code (SASS: WARPGROUP.DEPBAR.LE gsb0 0x0 before the MUFU.EX2s). Pinning it behind the softmax
// (a never-taken branch on the row sums) makes ptxas serialise every wgmma (C7512, insufficient registers): with P
// still in flight the step needs O 128 + S 32 + P 16 + temporaries, and ptxas allocates the consumers within the
// launch bound's 168 registers (65,536 / 384), not setmaxnreg's 232 (the same code under __launch_bounds__(256, 1)
// compiles to 232 registers, unserialised). Overlap needs that budget first.
// Not done, reasoned: inter-warpgroup ping-pong (the softmax is ~1/4 of a step's MMA time at head_dim 256, and
// FlashAttention-3 turns its scheduler barrier off there); a 128-byte swizzle (every wgmma operand read is a whole
// 128-byte core matrix and every cp.async quarter-warp writes one: conflict-free already); the diagonal (one masked
// key tile per warpgroup, ~64 compares and selects a thread).
#include "common.cuh"
#include "tensor_core.cuh"
#include "vision_wgmma.cuh"
#include "mbarrier.cuh"
#include "flash_epilogue.cuh"

#define FW_HD 256
#define FW_ROWS 128          // query rows per tile; flash_plan.FLASH_TILE_ROWS["ws"] must match
#define FW_BN 64             // keys per step
#define FW_THREADS 384       // producer + 2 consumer warpgroups
#define FW_K_STAGES 2
#define FW_V_STAGES 3        // V is held one step longer than K (released after the next step's P V)
#define FW_PRODUCER_REGS 40  // setmaxnreg: 128 x 40 + 256 x 232 <= 65,536
#define FW_CONSUMER_REGS 232
static_assert(128 * FW_PRODUCER_REGS + 2 * 128 * FW_CONSUMER_REGS <= 65536, "more registers than an SM has");

struct FwShape {
    static constexpr int GROUP = FW_HD / 8 * 128;                 // bytes per 8 rows
    static constexpr int TILE = FW_BN / 8 * GROUP;                // one K or V stage (64 rows), one consumer's Q
    static constexpr int V_OFFSET = FW_K_STAGES * TILE;
    static constexpr int Q_OFFSET = V_OFFSET + FW_V_STAGES * TILE;
    // must equal flash_plan.flash_shared_bytes(256, ws=True)
    static constexpr int SMEM_BYTES = Q_OFFSET + 2 * TILE;
};

// the full barrier's arrival once all of this thread's earlier cp.async copies have landed (counted in its init)
__device__ __forceinline__ void fw_cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void fw_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void fw_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

#define FW_F4(a, i) "+f"(a[i][0]), "+f"(a[i][1]), "+f"(a[i][2]), "+f"(a[i][3])
#define FW_O_OPS(o) \
    FW_F4(o, 0), FW_F4(o, 1), FW_F4(o, 2), FW_F4(o, 3), FW_F4(o, 4), FW_F4(o, 5), FW_F4(o, 6), FW_F4(o, 7), \
    FW_F4(o, 8), FW_F4(o, 9), FW_F4(o, 10), FW_F4(o, 11), FW_F4(o, 12), FW_F4(o, 13), FW_F4(o, 14), FW_F4(o, 15), \
    FW_F4(o, 16), FW_F4(o, 17), FW_F4(o, 18), FW_F4(o, 19), FW_F4(o, 20), FW_F4(o, 21), FW_F4(o, 22), FW_F4(o, 23), \
    FW_F4(o, 24), FW_F4(o, 25), FW_F4(o, 26), FW_F4(o, 27), FW_F4(o, 28), FW_F4(o, 29), FW_F4(o, 30), FW_F4(o, 31)
#define FW_S_REGS \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define FW_O_REGS \
    FW_S_REGS "," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
    "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
    "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
    "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
    "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"

// One k-step (16 dims) of S = Q K^T for this warpgroup's 64 rows x 64 keys; acc = 0 overwrites s (the first).
// Issue only: the caller fences before the first and commits after the last (a wgmma group of 16).
__device__ __forceinline__ void fw_qk_step(float (&s)[8][4], unsigned long long qd, unsigned long long kd, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" FW_S_REGS "}, %32, %33, p, 1, 1, 0, 0;\n"
                 "}\n"
                 : VW_S_OPS(s) : "l"(qd), "l"(kd), "r"(acc) : "memory");
}

// One k-step (16 keys) of O += P V for this warpgroup's 64 rows x 256 dims, P from registers (A fragment).
__device__ __forceinline__ void fw_pv_step(float (&o)[32][4], const unsigned (&p)[4], unsigned long long vd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" FW_O_REGS "}, "
                 "{%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
                 : FW_O_OPS(o) : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(vd), "r"(1) : "memory");
}

// This thread's 16 cp.async pieces of a 64-row block (t = thread of the warpgroup): rows t % 8 + 8 i (i = 0..7),
// chunks t / 8 and t / 8 + 16. A quarter-warp writes 8 rows of one core-matrix column (no bank conflict), a warp
// reads 64 contiguous bytes of each of 8 rows. row(r) gives row r's first element, or nullptr: zero-fill (`any`, a
// valid address, is then passed and not read).
template <typename Row>
__device__ __forceinline__ void fw_copy_block(unsigned dst, int t, const Row& row, const bf16_t* any) {
    const int r_lo = t & 7, c_lo = t >> 3;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const bf16_t* src = row(r_lo + 8 * i);
        const int bytes = src ? 16 : 0;
        src = src ? src : any;
        const unsigned d = dst + (unsigned)(i * FwShape::GROUP + c_lo * 128 + r_lo * 16);
        cp_async16(d, src + c_lo * 8, bytes);
        cp_async16(d + 16 * 128, src + (c_lo + 16) * 8, bytes);
    }
}

// The producer warpgroup (threads 0..127): K_0, V_0, K_1, V_1, ... of the tile's n_kt key tiles through the rings.
// TRACKED (ws2): each group's full arrival is the cp.async completion's (fw_cp_async_arrive), no waits of its own.
template <bool TRACKED>
__device__ __forceinline__ void fw_produce(unsigned smem, unsigned bars, const bf16_t* k_head, const bf16_t* v_head,
                                           const int* table, long long row_width, int block_size, int p_last,
                                           int n_kt) {
    using S = FwShape;
    const int t = threadIdx.x;
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;   // the usual case: shift, not divide
    const int bs_shift = __ffs(block_size) - 1;
    const unsigned k_full = bars, k_empty = bars + 8 * FW_K_STAGES;
    const unsigned v_full = bars + 16 * FW_K_STAGES, v_empty = v_full + 8 * FW_V_STAGES;
    bool pending = false;   // a committed group not yet handed over, and its full barrier
    unsigned pending_bar = 0;
    for (int grp = 0; grp < 2 * n_kt; ++grp) {
        const int kt = grp >> 1;
        const bool is_v = grp & 1;
        const int stages = is_v ? FW_V_STAGES : FW_K_STAGES, st = kt % stages;
        const unsigned full = (is_v ? v_full : k_full) + 8 * st, empty = (is_v ? v_empty : k_empty) + 8 * st;
        if (kt >= stages) {   // the stage's previous tile must have been released by both consumers
            const unsigned parity = (unsigned)(kt / stages - 1) & 1u;
            // about to block: hand over what is in flight first
            if (!TRACKED && pending && !mbar_test(empty, parity)) {
                cp_async_wait<0>();
                fence_proxy_async();
                mbar_arrive(pending_bar);
                pending = false;
            }
            mbar_wait(empty, parity);
        }
        const bf16_t* head = is_v ? v_head : k_head;
        const auto row = [&](int r) -> const bf16_t* {
            const int key = kt * FW_BN + r;
            if (key > p_last) return nullptr;
            const int blk = bs_pow2 ? key >> bs_shift : key / block_size;
            return head + ((long long)table[blk] * block_size + (key - blk * block_size)) * row_width;
        };
        fw_copy_block(smem + (unsigned)((is_v ? S::V_OFFSET : 0) + st * S::TILE), t, row, head);
        if (TRACKED) {
            fw_cp_async_arrive(full);
            continue;
        }
        cp_async_commit();
        if (pending) {   // the previous group (this thread's part) has landed: the tensor cores' to read
            cp_async_wait<1>();
            fence_proxy_async();
            mbar_arrive(pending_bar);
        }
        pending = true;
        pending_bar = full;
    }
    if (TRACKED) {
        asm volatile("cp.async.wait_all;\n" ::: "memory");   // nothing left in flight when the thread ends
        return;
    }
    cp_async_wait<0>();
    fence_proxy_async();
    mbar_arrive(pending_bar);
}

// Consumer warpgroup c: query rows 64 c .. 64 c + 63 of the tile (first .. first + count - 1 are real).
// WS2: the header's ws2 changes (the rescale after S_j's issue, a proxy fence after each full wait).
template <bool WS2>
__device__ __forceinline__ void fw_consume(int c, unsigned smem, unsigned bars, bf16_t* out, const bf16_t* q,
                                           long long q_stride, const bf16_t* gate, long long gate_stride,
                                           int gate_head_stride, const int* token_pos, int first, int count, int h,
                                           int heads, int n_kt, float scale) {
    using S = FwShape;
    constexpr int NT_S = FW_BN / 8, NT_O = FW_HD / 8;
    const int t = threadIdx.x & 127, lane = t & 31, w = t >> 5, g = lane >> 2, tig = lane & 3;
    const unsigned k_full = bars, k_empty = bars + 8 * FW_K_STAGES;
    const unsigned v_full = bars + 16 * FW_K_STAGES, v_empty = v_full + 8 * FW_V_STAGES;
    const auto k_stage = [&](int j) { return (unsigned)(8 * (j % FW_K_STAGES)); };
    const auto k_parity = [&](int j) { return (unsigned)(j / FW_K_STAGES) & 1u; };
    const auto v_stage = [&](int j) { return (unsigned)(8 * (j % FW_V_STAGES)); };
    const auto v_parity = [&](int j) { return (unsigned)(j / FW_V_STAGES) & 1u; };
    const auto wait_full = [&](unsigned bar, unsigned parity) {   // a stage's copies landed, visible to wgmma
        mbar_wait(bar, parity);
        if (WS2) fence_proxy_async();
    };

    const int r0 = 64 * c, rows = min(64, count - r0);   // this warpgroup's real rows (may be none)
    const int ra = r0 + 16 * w + g, rb = ra + 8;         // this thread's rows (m64 fragment rows 16 w + g, + 8)
    float o[NT_O][4], s[NT_S][4];
    unsigned pf[NT_S / 2][4];
    float l_a = 0.0f, l_b = 0.0f;
    int n_c = 0;   // key tiles this warpgroup computes: up to the one holding its last row's position
    if (rows > 0) {
        const int p_first_c = token_pos[first + r0], p_last_c = token_pos[first + r0 + rows - 1];
        n_c = p_last_c / FW_BN + 1;
        // rows past count: zero queries at the last real row's position (finite, never stored)
        const int pa = ra < count ? token_pos[first + ra] : p_last_c;
        const int pb = rb < count ? token_pos[first + rb] : p_last_c;
        const float sl = scale * 1.4426950408889634f;   // scores -> exp2 domain

        const unsigned q_buf = smem + (unsigned)(S::Q_OFFSET + c * S::TILE);
        const bf16_t* q_head = q + (long long)h * FW_HD;
        const auto q_row = [&](int r) -> const bf16_t* {
            return r < rows ? q_head + (long long)(first + r0 + r) * q_stride : nullptr;
        };
        fw_copy_block(q_buf, t, q_row, q_head);
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");   // this warpgroup's Q rows written
        const unsigned long long qd = vw_desc(q_buf, 128, S::GROUP);

#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        float m_a = NEG_INF, m_b = NEG_INF, corr_a, corr_b;

        const auto issue_qk = [&](int j) {   // one group: S_j's 16 k-steps
            const unsigned long long kd = vw_desc(smem + (unsigned)((j % FW_K_STAGES) * S::TILE), 128, S::GROUP);
            fw_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < FW_HD / 16; ++kk) fw_qk_step(s, qd + 16 * kk, kd + 16 * kk, kk);   // +256 bytes
            fw_wgmma_commit();
        };
        const auto issue_pv = [&](int j) {   // one group: O += P_j V_j, 4 k-steps of 16 keys
            const unsigned long long vd =
                vw_desc(smem + (unsigned)(S::V_OFFSET + (j % FW_V_STAGES) * S::TILE), S::GROUP, 128);
            fw_wgmma_fence();
#pragma unroll
            for (int k2 = 0; k2 < FW_BN / 16; ++k2) fw_pv_step(o, pf[k2], vd + (2 * k2 * S::GROUP >> 4));
            fw_wgmma_commit();
        };
        const auto mask = [&](int j) {   // tiles reaching past this warpgroup's first row: key > row position
            if (j * FW_BN + FW_BN - 1 > p_first_c) {
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = j * FW_BN + nt * 8 + tig * 2 + e;
                        if (key > pa) s[nt][e] = NEG_INF;
                        if (key > pb) s[nt][2 + e] = NEG_INF;
                    }
            }
        };

        const auto rescale_o = [&]() {
            scale_o_rows(o, corr_a, corr_b);
        };

        // step 0: S_0 alone (O is still 0); key 0 is visible to every row, so the running max is finite from here
        wait_full(k_full + k_stage(0), k_parity(0));
        vw_fence_operand(s);
        issue_qk(0);
        vw_wait<0>();
        vw_fence_operand(s);
        if (lane == 0) mbar_arrive(k_empty + k_stage(0));
        mask(0);
        vw_softmax_in_place(s, sl, m_a, m_b, l_a, l_b, corr_a, corr_b);
        vw_pack_p(s, pf);

        for (int j = 1; j < n_c; ++j) {
            wait_full(k_full + k_stage(j), k_parity(j));
            vw_fence_operand(s);
            vw_fence_operand(o);
            vw_fence_operand(pf);
            issue_qk(j);                                                  // S_j
            if (WS2) rescale_o();                                         // O to step j-1's max, under S_j
            wait_full(v_full + v_stage(j - 1), v_parity(j - 1));
            if (WS2) vw_fence_operand(o);
            issue_pv(j - 1);                                              // O += P_{j-1} V_{j-1}, in flight ...
            vw_wait<1>();                                                 // ... while S_j (retired first) ...
            vw_fence_operand(s);
            if (lane == 0) mbar_arrive(k_empty + k_stage(j));          // K_j is free
            mask(j);
            vw_softmax_in_place(s, sl, m_a, m_b, l_a, l_b, corr_a, corr_b);   // ... goes through the softmax
            vw_wait<0>();
            vw_fence_operand(o);
            vw_fence_operand(pf);
            if (lane == 0) mbar_arrive(v_empty + v_stage(j - 1));      // V_{j-1} is free
            if (!WS2) rescale_o();
            vw_pack_p(s, pf);
        }
        wait_full(v_full + v_stage(n_c - 1), v_parity(n_c - 1));
        if (WS2) rescale_o();   // O to the last step's max before its P V
        vw_fence_operand(o);
        vw_fence_operand(pf);
        issue_pv(n_c - 1);
        vw_wait<0>();
        vw_fence_operand(o);
        if (lane == 0) mbar_arrive(v_empty + v_stage(n_c - 1));
    }
    // key tiles past this warpgroup's rows: released as soon as they are there (the ring needs every consumer)
    for (int j = n_c; j < n_kt; ++j) {
        mbar_wait(k_full + k_stage(j), k_parity(j));
        if (lane == 0) mbar_arrive(k_empty + k_stage(j));
        mbar_wait(v_full + v_stage(j), v_parity(j));
        if (lane == 0) mbar_arrive(v_empty + v_stage(j));
    }
    if (rows <= 0) return;

    // ---- normalise, gate, store
    flash_store_gated<FW_HD>(o, l_a, l_b, ra, rb, tig, first, count, h, heads, out, gate, gate_stride,
                             gate_head_stride);
}

#define FW_PARAMS \
        bf16_t* out, const bf16_t* q, long long q_stride, const bf16_t* gate, long long gate_stride, \
        int gate_head_stride, const bf16_t* k_cache, const bf16_t* v_cache, const int* block_tables, \
        int max_blocks_per_seq, const int* token_seq, const int* token_pos, const int* tiles, int heads, \
        int kv_heads, int block_size, float scale
#define FW_ARGS \
        out, q, q_stride, gate, gate_stride, gate_head_stride, k_cache, v_cache, block_tables, max_blocks_per_seq, \
        token_seq, token_pos, tiles, heads, kv_heads, block_size, scale

template <bool WS2>
__device__ __forceinline__ void fw_kernel(FW_PARAMS) {
    extern __shared__ __align__(128) bf16_t smem[];
    // K full[K_STAGES], K empty[K_STAGES], V full[V_STAGES], V empty[V_STAGES]
    __shared__ __align__(8) unsigned long long bars[2 * (FW_K_STAGES + FW_V_STAGES)];

    pdl_entry();
    if (threadIdx.x == 0 && dynamic_smem_bytes() < (unsigned)FwShape::SMEM_BYTES) __trap();  // host/kernel mismatch

    const int h = blockIdx.x;
    const int tile = gridDim.y - 1 - blockIdx.y;   // heaviest (latest) tiles first
    const int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    const int p_last = token_pos[first + count - 1];
    const int n_kt = p_last / FW_BN + 1;   // key tiles 0 .. the one holding p_last (causal skip beyond)
    const unsigned base = smem_addr(smem), bar0 = smem_addr(bars);
    if (threadIdx.x == 0) {
#pragma unroll
        for (int st = 0; st < FW_K_STAGES; ++st) {
            mbar_init(bar0 + 8 * st, 128);                       // every producer thread, its copies landed
            mbar_init(bar0 + 8 * (FW_K_STAGES + st), 8);         // lane 0 of every consumer warp
        }
#pragma unroll
        for (int st = 0; st < FW_V_STAGES; ++st) {
            mbar_init(bar0 + 8 * (2 * FW_K_STAGES + st), 128);
            mbar_init(bar0 + 8 * (2 * FW_K_STAGES + FW_V_STAGES + st), 8);
        }
    }
    __syncthreads();   // the barriers initialised before anyone arrives; the last block-wide barrier

    if (threadIdx.x < 128) {
        setmaxnreg_dec<FW_PRODUCER_REGS>();
        const int kvh = h / (heads / kv_heads);
        const long long row_width = (long long)kv_heads * FW_HD;
        const int* table = block_tables + (long long)token_seq[first] * max_blocks_per_seq;
        fw_produce<WS2>(base, bar0, k_cache + (long long)kvh * FW_HD, v_cache + (long long)kvh * FW_HD, table,
                        row_width, block_size, p_last, n_kt);
    } else {
        setmaxnreg_inc<FW_CONSUMER_REGS>();
        fw_consume<WS2>((threadIdx.x >> 7) - 1, base, bar0, out, q, q_stride, gate, gate_stride,
                        gate_head_stride, token_pos, first, count, h, heads, n_kt, scale);
    }
}

// Same parameters as flash_prefill_bf16_hd256; tiles of up to FW_ROWS rows; FW_THREADS threads a block.
extern "C" __global__ void __launch_bounds__(FW_THREADS, 1) flash_prefill_ws_bf16_hd256(FW_PARAMS) {
    fw_kernel<false>(FW_ARGS);
}

// The same with the header's ws2 changes (ops.flash_prefill variant "ws2"): same arguments, tiles, shared memory.
extern "C" __global__ void __launch_bounds__(FW_THREADS, 1) flash_prefill_ws2_bf16_hd256(FW_PARAMS) {
    fw_kernel<true>(FW_ARGS);
}
