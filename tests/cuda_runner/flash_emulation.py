"""numpy emulation of kernels/flash_prefill.cu's schedule, for CPU tests of the tiling itself.

What is emulated, step by step as the kernel does it: the host's tiles (flash_plan.flash_tiles), tiles taken in reverse
order, one query tile of up to FLASH_TILE rows at a time (rows past the tile's count are zero queries that are never
stored), key tiles of BN keys from 0 to the tile holding the last query's position (nothing beyond is read), keys
past that position zero-filled, the causal mask applied only to key tiles that reach past the first query's
position, the exp2-domain online softmax with its -inf guard, P rounded to bf16 for the PV product, fp32 O and row
sums, then O / l * sigmoid(gate) rounded to bf16. K/V are gathered through the block tables exactly as the kernel's
copy loop does. What it cannot check is the CUDA code (fragment layouts, cp.async, barriers): check_flash does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.bf16 import round_to_bf16

LOG2E = 1.4426950408889634


def keys_per_step(head_dim: int) -> int:
    """FlashShape<HD>::BN of the kernel."""
    return 32 if head_dim >= 256 else 64


@dataclass
class Trace:
    """What the emulated launch touched: (tile, head) -> key tiles visited, and the largest key position loaded."""

    key_tiles: dict[tuple[int, int], int] = field(default_factory=dict)
    masked_tiles: int = 0
    max_key_loaded: dict[int, int] = field(default_factory=dict)  # tile -> largest key position read


def flash_prefill_emulated(q: np.ndarray, gate: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                           tables: np.ndarray, token_seq: np.ndarray, token_pos: np.ndarray, tiles: np.ndarray,
                           heads: int, kv_heads: int, scale: float, *, apply_mask: bool = True,
                           trace: Trace | None = None) -> np.ndarray:
    """q/gate [n, heads, hd]; cache_k/v [blocks, block_size, kv_heads, hd]; returns out [n, heads*hd] (bf16 values)."""
    n, _, hd = q.shape
    block_size = cache_k.shape[1]
    bn, rows = keys_per_step(hd), flash_plan.FLASH_TILE
    sl = np.float32(scale * LOG2E)
    out = np.full((n, heads, hd), np.nan, np.float32)  # poisoned: every row must be written
    for tile in reversed(range(tiles.shape[0])):
        first, count = int(tiles[tile, 0]), int(tiles[tile, 1])
        assert 0 < count <= rows, "a tile holds 1..FLASH_TILE rows"
        table = tables[token_seq[first]]
        pos = np.full(rows, -1, np.int64)
        pos[:count] = token_pos[first : first + count]
        p_first, p_last = int(pos[0]), int(pos[count - 1])
        n_kt = p_last // bn + 1
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            qt = np.zeros((rows, hd), np.float32)
            qt[:count] = q[first : first + count, h]
            m = np.full(rows, -np.inf, np.float32)
            l = np.zeros(rows, np.float32)
            o = np.zeros((rows, hd), np.float32)
            for j in range(n_kt):
                kt = j * bn
                key_pos = np.arange(kt, kt + bn)
                valid = key_pos <= p_last
                kp = key_pos[valid]
                k = np.zeros((bn, hd), np.float32)
                v = np.zeros((bn, hd), np.float32)
                k[valid] = cache_k[table[kp // block_size], kp % block_size, kvh]
                v[valid] = cache_v[table[kp // block_size], kp % block_size, kvh]
                if trace is not None:
                    trace.max_key_loaded[tile] = max(trace.max_key_loaded.get(tile, -1), int(kp.max()))
                s = np.einsum("rd,kd->rk", qt, k)  # fp32 accumulate (einsum: no BLAS thread pool)
                if apply_mask and kt + bn - 1 > p_first:
                    s = np.where(key_pos[None, :] > pos[:, None], np.float32(-np.inf), s)
                    if trace is not None:
                        trace.masked_tiles += 1
                mx = np.maximum(m, s.max(1))
                base = np.where(mx == -np.inf, np.float32(0), mx) * sl
                with np.errstate(invalid="ignore"):
                    corr = np.exp2(m * sl - base)
                    p = np.exp2(s * sl - base[:, None])
                m = mx
                l = l * corr + p.sum(1)
                o = o * corr[:, None] + np.einsum("rk,kd->rd", round_to_bf16(p.astype(np.float32)), v)
            if trace is not None:
                trace.key_tiles[(tile, h)] = n_kt
            g = gate[first : first + count, h].astype(np.float64)
            res = o[:count] / l[:count, None] / (1.0 + np.exp(-g))
            out[first : first + count, h] = round_to_bf16(res.astype(np.float32))
    return out.reshape(n, heads * hd)
