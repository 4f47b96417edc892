"""Lane-level numpy emulation of kernels/paged_mma_fp8.cuh (paged_attention_mma_fp8), for CPU tests of its layouts.

What is emulated as the kernel writes it: load_kv's copy (thread -> row, 16-byte chunk of the e4m3 rows through the
flat global addresses; threads 0..63 copy K scales, 64..127 V scales; rows past the split's end zero-filled) into
the padded stage, the K reads (k_chunk), the e4m3 -> bf16 bit trick with its x 2^120 (e4m3x4_to_bf16x2, on the
bits), the byte permutes (prmt) of the Q fragments and of the V words, the mma fragments (paged_mma_emulation.mma,
the PTX ISA's layout), the per-key scales on the score and on P' = bf16(p * v_scale), P'^T's rows (p_row), and the
merge with the V dims (v_dim). The softmax is paged_mma_emulation's. Multiply-adds are float64, so the roundings
modelled are the bf16 ones (P'), not the tensor cores' accumulation order. The CUDA itself is checked on the GPU
(tests/cuda_runner/check_fp8_kv.py).
"""
from __future__ import annotations

import numpy as np

from gpu_engine.cuda.bf16 import round_to_bf16
from tests.cuda_runner.paged_mma_emulation import (
    BN,
    G_OF,
    LANES,
    LOG2E,
    WARPS,
    combine_splits,
    ldmatrix,
    merge_warps,
    mma,
    shfl_xor_max,
    shfl_xor_sum,
)

STAGES = 4  # PM8_STAGES
THREADS = 32 * WARPS


def ldb(hd: int) -> int:
    """PagedMmaFp8Shape<HD>::LDB, the raw row stride in bytes."""
    return hd + 32 if hd >= 128 else hd + 16


def k_chunk(hd: int, tig: int, j: int) -> int:
    return (tig & 1) + 4 * (tig >> 1) + 2 * (j & 1) + 8 * (j >> 1) if hd >= 128 else tig


def v_dim(hd: int, g: int, j: int) -> int:
    return 16 * g + 128 * (j >> 2) + 4 * (j & 3) if hd >= 128 else 8 * g + 4 * j


def prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode): result byte i = byte (sel >> 4 i) & 7 of {b, a} (a = bytes 0..3)."""
    src = (int(b) << 32) | int(a)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def bf16_bits_to_float(bits: int) -> float:
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


def e4m3x4_to_bf16x2(w: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """fp8_kv.cuh's conversion on the bits: (even = (b0, b2), odd = (b1, b3)) as the bf16 values, each half
    e4m3_pair_bits' bf16 times 2^120 (exact: a power of two, the product a bf16)."""
    def pair(x: int) -> tuple[float, float]:
        bits = (x & 0x80008000) | ((x & 0x7F007F00) >> 4)
        return (bf16_bits_to_float(bits & 0xFFFF) * 2.0 ** 120, bf16_bits_to_float(bits >> 16) * 2.0 ** 120)
    return pair((w << 8) & 0xFFFFFFFF), pair(w)


def words(row: np.ndarray) -> list[int]:
    """A byte row as little-endian 32-bit words."""
    return [int(v) for v in np.ascontiguousarray(row, np.uint8).view("<u4")]


def stage(k_bits: np.ndarray, v_bits: np.ndarray, k_scale: np.ndarray, v_scale: np.ndarray, table: np.ndarray,
          k0: int, hi: int, kvh: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw K [BN * LDB] u8, raw V, scales [2, BN] f32) of the stage for keys k0 .. k0 + BN - 1 (< hi): caches
    uint8 [slots, kv_heads, hd], scales float32 [slots, kv_heads]."""
    slots, kv_heads, hd = k_bits.shape
    stride, chunks = ldb(hd), hd // 16
    rows8 = THREADS // chunks
    gk, gv, gks, gvs = k_bits.reshape(-1), v_bits.reshape(-1), k_scale.reshape(-1), v_scale.reshape(-1)
    raw_k, raw_v = np.zeros(BN * stride, np.uint8), np.zeros(BN * stride, np.uint8)
    sc = np.zeros(2 * BN, np.float32)

    def slot_of(kp: int) -> int:
        blk = kp // block_size
        return int(table[blk]) * block_size + (kp - blk * block_size)

    for tid in range(THREADS):
        r8, c8 = tid // chunks, (tid % chunks) * 16
        for i in range(BN // rows8):
            r = r8 + i * rows8
            if k0 + r < hi:
                src = slot_of(k0 + r) * kv_heads * hd + kvh * hd + c8
                raw_k[r * stride + c8:r * stride + c8 + 16] = gk[src:src + 16]
                raw_v[r * stride + c8:r * stride + c8 + 16] = gv[src:src + 16]
        r = tid % BN
        if k0 + r < hi:
            sc[tid] = (gks if tid < BN else gvs)[slot_of(k0 + r) * kv_heads + kvh]
    return raw_k, raw_v, sc.reshape(2, BN)


def q_fragments(q_row: np.ndarray, kvh: int, group: int, hd: int) -> np.ndarray:
    """qb[lane, ks, reg, half]: the kernel's prmt of q's bf16 words (head g; zero past the group)."""
    qb = np.zeros((32, hd // 16, 2, 2))
    for t in range(32):
        g, tig = t // 4, t % 4
        if g >= group:
            continue
        head = round_to_bf16(np.asarray(q_row[(kvh * group + g) * hd:(kvh * group + g + 1) * hd], np.float32))
        bits = (head.view(np.uint32) >> 16).astype(np.uint32)
        qw = [int(bits[2 * i]) | (int(bits[2 * i + 1]) << 16) for i in range(hd // 2)]
        for j in range(hd // 64):
            for i in range(4):
                w = 8 * k_chunk(hd, tig, j) + 2 * i
                for reg, sel in enumerate((0x5410, 0x7632)):
                    x = prmt(qw[w], qw[w + 1], sel)
                    qb[t, 4 * j + i, reg] = (bf16_bits_to_float(x & 0xFFFF), bf16_bits_to_float(x >> 16))
    return qb


def block_emulated(q_row: np.ndarray, k_bits: np.ndarray, v_bits: np.ndarray, k_scale: np.ndarray,
                   v_scale: np.ndarray, table: np.ndarray, last: int, kvh: int, group: int, split: int, splits: int,
                   block_size: int, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block (token, kvh, split): (acc [group, hd], m [group] in scale * score units, l [group])."""
    hd = k_bits.shape[-1]
    stride, mt_o = ldb(hd), hd // 16
    per_split = (last + splits) // splits
    lo = split * per_split
    hi = min(last + 1, lo + per_split)
    n_tiles = (hi - lo + BN - 1) // BN if hi > lo else 0
    sl = scale * LOG2E
    qb = q_fragments(q_row, kvh, group, hd)
    o = np.zeros((WARPS, mt_o, 32, 4))
    m0, m1 = np.full((WARPS, 32), -np.inf), np.full((WARPS, 32), -np.inf)
    l0, l1 = np.zeros((WARPS, 32)), np.zeros((WARPS, 32))
    for t in range(n_tiles):
        raw_k, raw_v, sc = stage(k_bits, v_bits, k_scale, v_scale, table, lo + t * BN, hi, kvh, block_size)
        for w in range(WARPS):
            sa = np.zeros((32, 4))
            for j in range(hd // 64):
                a = np.zeros((32, 4, 4, 2))  # [lane, i, reg, half]
                for lane in range(32):
                    g, tig = lane // 4, lane % 4
                    c = 16 * k_chunk(hd, tig, j)
                    wa = words(raw_k[(w * 16 + g) * stride + c:][:16])
                    wb = words(raw_k[(w * 16 + g + 8) * stride + c:][:16])
                    for i in range(4):
                        a[lane, i, 0], a[lane, i, 2] = e4m3x4_to_bf16x2(wa[i])
                        a[lane, i, 1], a[lane, i, 3] = e4m3x4_to_bf16x2(wb[i])
                for i in range(4):
                    sa = mma(sa, a[:, i], qb[:, 4 * j + i])
            key_a = lo + t * BN + w * 16 + G_OF
            va, vb = key_a < hi, key_a + 8 < hi
            ks_a, ks_b = sc[0, w * 16 + G_OF].astype(np.float64), sc[0, w * 16 + G_OF + 8].astype(np.float64)
            s0, s1 = np.where(va, sa[:, 0] * ks_a, -np.inf), np.where(va, sa[:, 1] * ks_a, -np.inf)
            s2, s3 = np.where(vb, sa[:, 2] * ks_b, -np.inf), np.where(vb, sa[:, 3] * ks_b, -np.inf)
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
            vs_a, vs_b = sc[1, w * 16 + G_OF].astype(np.float64), sc[1, w * 16 + G_OF + 8].astype(np.float64)
            ps = np.zeros(16 * 8)  # P'^T [k index][head], bf16
            for lane in range(32):
                g, tig = lane // 4, lane % 4
                p_row = ((g & 3) << 1) | (g >> 2)
                pa = np.array([p0[lane], p1[lane]]) * vs_a[lane]
                pb_ = np.array([p2[lane], p3[lane]]) * vs_b[lane]
                ps[p_row * 8 + 2 * tig:p_row * 8 + 2 * tig + 2] = round_to_bf16(pa.astype(np.float32))
                ps[(p_row + 8) * 8 + 2 * tig:(p_row + 8) * 8 + 2 * tig + 2] = round_to_bf16(pb_.astype(np.float32))
            pb = ldmatrix(ps, (LANES & 15) * 8, 2, trans=True)
            av = np.zeros((mt_o, 32, 4, 2))
            for lane in range(32):
                g, tig = lane // 4, lane % 4
                rows = [words(raw_v[(w * 16 + tig + 4 * c) * stride:][:hd]) for c in range(4)]
                for mt in range(mt_o):
                    j, sel = mt >> 1, (0x7632 if mt & 1 else 0x5410)
                    x = v_dim(hd, g, j) // 4  # the word of dims v_dim .. + 3 (pm8_v_row's loads)
                    av[mt, lane, 0], av[mt, lane, 1] = e4m3x4_to_bf16x2(prmt(rows[0][x], rows[1][x], sel))
                    av[mt, lane, 2], av[mt, lane, 3] = e4m3x4_to_bf16x2(prmt(rows[2][x], rows[3][x], sel))
            for mt in range(mt_o):
                o[w, mt] *= np.stack([corr0, corr1, corr0, corr1], axis=1)
                o[w, mt] = mma(o[w, mt], av[mt], pb)
    return merge_warps(o, m0, m1, l0, l1, hd, group, sl, scale,
                       lambda g, mt: v_dim(hd, g, mt >> 1) + 2 * (mt & 1), 1)


def paged_attention_mma_fp8_emulated(q: np.ndarray, k_bits: np.ndarray, v_bits: np.ndarray, k_scale: np.ndarray,
                                     v_scale: np.ndarray, tables: np.ndarray, token_seq: np.ndarray,
                                     token_pos: np.ndarray, heads: int, kv_heads: int, block_size: int,
                                     scale: float, splits: int) -> np.ndarray:
    """Every block, then attention_combine's merge (without the gate): [n, heads, hd] float64."""
    hd = k_bits.shape[-1]
    group = heads // kv_heads
    out = np.zeros((len(token_seq), heads, hd))
    for i, (seq, last) in enumerate(zip(token_seq, token_pos)):
        for kvh in range(kv_heads):
            parts = [block_emulated(q[i], k_bits, v_bits, k_scale, v_scale, tables[seq], int(last), kvh, group, s,
                                    splits, block_size, scale) for s in range(splits)]
            out[i, kvh * group : (kvh + 1) * group] = combine_splits(parts, group)
    return out
