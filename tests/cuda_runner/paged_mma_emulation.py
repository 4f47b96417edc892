"""Lane-level numpy emulation of kernels/attention.cu's paged_attention_mma, for CPU tests of its index arithmetic.

What is emulated as the kernel writes it: the split's key range, the copy loop (rows gathered through the block
table into padded shared-memory stages, rows past the split's end zero-filled), the per-lane ldmatrix addresses
(k_lane, v_lane, p_lane) fed to ldmatrix / ldmatrix.trans as the PTX ISA defines them (thread t of matrix j gets
row t / 4, elements 2 (t % 4) and + 1; .trans gets the transpose), mma.sync m16n8k16 on the fragments the PTX ISA
defines (A: a0 = [g][2 tig..], a1 = [g + 8][..], a2 = [g][2 tig + 8..], a3 = [g + 8][2 tig + 8..]; B: b0 = [2 tig..][g],
b1 = [2 tig + 8..][g]; C: c0, c1 = [g][2 tig..], c2, c3 = [g + 8][2 tig..]), the Q fragments, the masks, the
exp2-domain online softmax with its shuffles over the 8 groups, P^T staged as bf16, and the warps' merge into
paged_attention's partial form. What it cannot check is the CUDA itself (cp.async ordering, barriers, the
compiler): check_kernels does that on the GPU. Multiply-adds are float64 here, so only the bf16 rounding of P
is modelled, not the tensor cores' accumulation order.

The FP8 KV cache form (kernels/paged_mma_fp8.cuh) has its own emulation: paged_mma_fp8_emulation.py.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_engine.cuda.bf16 import round_to_bf16
from gpu_engine.fp8 import e4m3_to_float32

WARPS, BN, STAGES, PAD = 4, 64, 3, 8  # PM_WARPS, PM_BN, PM_STAGES, PM_PAD
LOG2E = 1.4426950408889634
LANES = np.arange(32)
G_OF, TIG_OF = LANES >> 2, LANES & 3


def ldmatrix(mem: np.ndarray, addrs: np.ndarray, count: int, trans: bool) -> np.ndarray:
    """[32 lanes, count regs, 2 halves]: matrix j's 8 rows start at addrs[8 j .. 8 j + 7] (elements of mem)."""
    regs = np.zeros((32, count, 2))
    for j in range(count):
        m = np.stack([mem[a:a + 8] for a in addrs[8 * j:8 * j + 8]])  # [row][col]
        for t in range(32):
            r, c = t // 4, 2 * (t % 4)
            regs[t, j] = (m[c, r], m[c + 1, r]) if trans else (m[r, c], m[r, c + 1])
    return regs


def mma(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """c [32, 4] += A B from the lanes' fragments: a [32, 4 regs, 2], b [32, 2 regs, 2]."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for t in range(32):
        g, tig = t // 4, t % 4
        for reg, (row, col) in enumerate(((g, 2 * tig), (g + 8, 2 * tig), (g, 2 * tig + 8), (g + 8, 2 * tig + 8))):
            A[row, col:col + 2] = a[t, reg]
        B[2 * tig:2 * tig + 2, g] = b[t, 0]
        B[2 * tig + 8:2 * tig + 10, g] = b[t, 1]
        C[g, 2 * tig:2 * tig + 2] = c[t, 0:2]
        C[g + 8, 2 * tig:2 * tig + 2] = c[t, 2:4]
    D = A @ B + C
    out = np.empty((32, 4))
    for t in range(32):
        g, tig = t // 4, t % 4
        out[t] = (*D[g, 2 * tig:2 * tig + 2], *D[g + 8, 2 * tig:2 * tig + 2])
    return out


def shfl_xor_max(v: np.ndarray, offsets=(4, 8, 16)) -> np.ndarray:
    for off in offsets:
        v = np.maximum(v, v[LANES ^ off])
    return v


def shfl_xor_sum(v: np.ndarray, offsets=(4, 8, 16)) -> np.ndarray:
    for off in offsets:
        v = v + v[LANES ^ off]
    return v


THREADS = 32 * WARPS


def merge_warps(o: np.ndarray, m0: np.ndarray, m1: np.ndarray, l0: np.ndarray, l1: np.ndarray, hd: int, group: int,
                sl: float, scale: float, dim_of: Callable[[int, int], int], row_b: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """paged_mma_common.cuh's pm_merge_write: the warps' states through shared s_acc [warp][8 heads][hd] and s_m /
    s_l [warp][8] into (acc, max in scale units, sum); O^T m-tile mt of lane group g holds dims dim_of(g, mt) and
    dim_of(g, mt) + row_b."""
    mt_o = hd // 16
    s_acc, s_m, s_l = np.zeros((WARPS, 8, hd)), np.full((WARPS, 8), -np.inf), np.zeros((WARPS, 8))
    for w in range(WARPS):
        lw0, lw1 = shfl_xor_sum(l0[w]), shfl_xor_sum(l1[w])
        for lane in range(32):
            g, tig = lane // 4, lane % 4
            for mt in range(mt_o):
                d = dim_of(g, mt)
                s_acc[w, 2 * tig, d], s_acc[w, 2 * tig + 1, d] = o[w, mt, lane, 0], o[w, mt, lane, 1]
                s_acc[w, 2 * tig, d + row_b], s_acc[w, 2 * tig + 1, d + row_b] = o[w, mt, lane, 2], o[w, mt, lane, 3]
            if g == 0:
                s_m[w, 2 * tig], s_m[w, 2 * tig + 1] = m0[w, lane], m1[w, lane]
                s_l[w, 2 * tig], s_l[w, 2 * tig + 1] = lw0[lane], lw1[lane]
    acc, m_out, l_out = np.zeros((group, hd)), np.full(group, -np.inf), np.zeros(group)
    for hh in range(group):
        m_blk = s_m[:, hh].max()
        for w in range(WARPS):
            if s_m[w, hh] == -np.inf:
                continue
            c = np.exp2((s_m[w, hh] - m_blk) * sl)
            acc[hh] += s_acc[w, hh] * c
            l_out[hh] += s_l[w, hh] * c
        m_out[hh] = -np.inf if m_blk == -np.inf else m_blk * scale
    return acc, m_out, l_out


def combine_splits(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], group: int) -> np.ndarray:
    """attention_combine's merge of the splits' (acc, max, sum) of one (token, KV head), without the gate:
    [group, hd] float64."""
    out = np.zeros((group, parts[0][0].shape[-1]))
    for hh in range(group):
        ms = np.array([p[1][hh] for p in parts])
        w = np.where(ms == -np.inf, 0.0, np.exp(ms - ms.max()))
        out[hh] = sum(wi * p[0][hh] for wi, p in zip(w, parts)) / sum(wi * p[2][hh] for wi, p in zip(w, parts))
    return out


def block_emulated(q_row: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, table: np.ndarray, last: int,
                   kvh: int, group: int, split: int, splits: int, block_size: int,
                   scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block (token, kvh, split): (acc [group, hd], m [group] in scale * score units, l [group])."""
    hd = k_cache.shape[-1]
    ld, ksteps, mt_o = hd + PAD, hd // 16, hd // 16
    per_split = (last + splits) // splits
    lo = split * per_split
    hi = min(last + 1, lo + per_split)
    n_tiles = (hi - lo + BN - 1) // BN if hi > lo else 0
    sl = scale * LOG2E
    # Q^T fragments: qb[lane, ks, reg, half]
    qb = np.zeros((32, ksteps, 2, 2))
    for t in range(32):
        g, tig = t // 4, t % 4
        if g < group:
            head = q_row[(kvh * group + g) * hd:(kvh * group + g + 1) * hd]
            for ks in range(ksteps):
                qb[t, ks, 0] = head[16 * ks + 2 * tig:16 * ks + 2 * tig + 2]
                qb[t, ks, 1] = head[16 * ks + 8 + 2 * tig:16 * ks + 8 + 2 * tig + 2]
    mat, mrow = LANES >> 3, LANES & 7
    o = np.zeros((WARPS, mt_o, 32, 4))
    m0, m1 = np.full((WARPS, 32), -np.inf), np.full((WARPS, 32), -np.inf)
    l0, l1 = np.zeros((WARPS, 32)), np.zeros((WARPS, 32))
    for t in range(n_tiles):
        ks_mem, vs_mem = np.zeros(BN * ld), np.zeros(BN * ld)  # one stage (the kernel's buffer t % STAGES)
        for r in range(BN):
            kp = lo + t * BN + r
            if kp < hi:
                slot = table[kp // block_size] * block_size + kp % block_size
                ks_mem[r * ld:r * ld + hd] = k_cache[slot, kvh]
                vs_mem[r * ld:r * ld + hd] = v_cache[slot, kvh]
        for w in range(WARPS):
            k_lane = (w * 16 + (LANES & 15)) * ld + (LANES >> 4) * 8
            v_lane = (w * 16 + (mat >> 1) * 8 + mrow) * ld + (mat & 1) * 8
            sa = np.zeros((32, 4))
            for ks in range(ksteps):
                sa = mma(sa, ldmatrix(ks_mem, k_lane + ks * 16, 4, trans=False), qb[:, ks])
            key_a = lo + t * BN + w * 16 + G_OF
            va, vb = key_a < hi, key_a + 8 < hi
            s0, s1 = np.where(va, sa[:, 0], -np.inf), np.where(va, sa[:, 1], -np.inf)
            s2, s3 = np.where(vb, sa[:, 2], -np.inf), np.where(vb, sa[:, 3], -np.inf)
            mx0 = shfl_xor_max(np.maximum(m0[w], np.maximum(s0, s2)))
            mx1 = shfl_xor_max(np.maximum(m1[w], np.maximum(s1, s3)))
            base0, base1 = np.where(mx0 == -np.inf, 0.0, mx0 * sl), np.where(mx1 == -np.inf, 0.0, mx1 * sl)
            with np.errstate(invalid="ignore"):
                corr0, corr1 = np.exp2(m0[w] * sl - base0), np.exp2(m1[w] * sl - base1)
            m0[w], m1[w] = mx0, mx1
            p0, p1 = np.exp2(s0 * sl - base0), np.exp2(s1 * sl - base1)
            p2, p3 = np.exp2(s2 * sl - base0), np.exp2(s3 * sl - base1)
            l0[w] = l0[w] * corr0 + p0 + p2
            l1[w] = l1[w] * corr1 + p1 + p3
            ps = np.zeros(16 * 8)  # P^T [key][head], bf16
            for lane in range(32):
                g, tig = lane // 4, lane % 4
                ps[g * 8 + 2 * tig:g * 8 + 2 * tig + 2] = round_to_bf16(np.array([p0[lane], p1[lane]]))
                ps[(g + 8) * 8 + 2 * tig:(g + 8) * 8 + 2 * tig + 2] = round_to_bf16(np.array([p2[lane], p3[lane]]))
            pb = ldmatrix(ps, (LANES & 15) * 8, 2, trans=True)
            for mt in range(mt_o):
                o[w, mt] *= np.stack([corr0, corr1, corr0, corr1], axis=1)
                o[w, mt] = mma(o[w, mt], ldmatrix(vs_mem, v_lane + mt * 16, 4, trans=True), pb)
    return merge_warps(o, m0, m1, l0, l1, hd, group, sl, scale, lambda g, mt: 16 * mt + g, 8)


def paged_attention_mma_emulated(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray,
                                 token_seq: np.ndarray, token_pos: np.ndarray, heads: int, kv_heads: int,
                                 block_size: int, scale: float, splits: int) -> np.ndarray:
    """Every block, then attention_combine's merge (without the gate): [n, heads, hd] float64."""
    hd = k_cache.shape[-1]
    group = heads // kv_heads
    out = np.zeros((len(token_seq), heads, hd))
    for i, (seq, last) in enumerate(zip(token_seq, token_pos)):
        for kvh in range(kv_heads):
            parts = [block_emulated(q[i], k_cache, v_cache, tables[seq], int(last), kvh, group, s, splits,
                                    block_size, scale) for s in range(splits)]
            out[i, kvh * group : (kvh + 1) * group] = combine_splits(parts, group)
    return out
