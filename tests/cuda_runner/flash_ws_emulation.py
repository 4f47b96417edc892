"""numpy emulation of kernels/flash_prefill_ws.cu's tile bookkeeping, for CPU tests (the kernel: check_flash).

Emulated as the kernel does it: the host's 128-row tiles (flash_plan.flash_tiles(lens, FLASH_TILE_ROWS["ws"])), tiles in
reverse order; per tile the producer's key tiles 0 .. p_last // 64 (keys past p_last zero-filled); per consumer
warpgroup c (rows 64 c .. 64 c + 63): no real rows -> nothing computed; else key tiles 0 .. its last row's position
// 64 (the later ones only passed through), the mask applied only to key tiles reaching past its first row, rows
past count as zero queries at its last real row's position, the exp2-domain online softmax whose running max is
finite from tile 0 on, P rounded to bf16 for P V, fp32 O and sums, then O / l * sigmoid(gate) rounded to bf16 for
the real rows only. Not emulated: the CUDA code itself (descriptors, fragments, barriers).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.bf16 import round_to_bf16

LOG2E = 1.4426950408889634
BN = 64  # FW_BN
WG_ROWS = 64  # rows per consumer warpgroup


@dataclass
class WsTrace:
    """(tile, warpgroup) -> key tiles computed; tile -> key tiles the producer copied and the largest key read."""

    computed: dict[tuple[int, int], int] = field(default_factory=dict)
    copied: dict[int, int] = field(default_factory=dict)
    max_key: dict[int, int] = field(default_factory=dict)
    masked: int = 0
    stored_rows: list[int] = field(default_factory=list)


def warpgroup_tiles(pos: np.ndarray, c: int) -> int:
    """Key tiles consumer warpgroup c computes for a tile whose real rows have positions `pos` (0: no rows)."""
    rows = pos[WG_ROWS * c : WG_ROWS * (c + 1)]
    return 0 if rows.size == 0 else int(rows[-1]) // BN + 1


def flash_prefill_ws_emulated(q: np.ndarray, gate: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                              tables: np.ndarray, token_seq: np.ndarray, token_pos: np.ndarray, tiles: np.ndarray,
                              heads: int, kv_heads: int, scale: float, *, computed_tiles=warpgroup_tiles,
                              apply_mask: bool = True, trace: WsTrace | None = None) -> np.ndarray:
    """q/gate [n, heads, 256]; cache_k/v [blocks, block_size, kv_heads, 256]; out [n, heads*256] (bf16 values).
    computed_tiles(pos, c): the kernel's per-warpgroup key-tile count (a test swaps in wrong ones)."""
    n, _, hd = q.shape
    block_size = cache_k.shape[1]
    rows_per_tile = flash_plan.FLASH_TILE_ROWS["ws"]
    sl = np.float32(scale * LOG2E)
    out = np.full((n, heads, hd), np.nan, np.float32)
    for tile in reversed(range(tiles.shape[0])):
        first, count = int(tiles[tile, 0]), int(tiles[tile, 1])
        assert 0 < count <= rows_per_tile, "a ws tile holds 1..128 rows"
        table = tables[token_seq[first]]
        pos = token_pos[first : first + count].astype(np.int64)
        p_last = int(pos[-1])
        n_kt = p_last // BN + 1
        key_pos = np.arange(n_kt * BN)
        valid = key_pos <= p_last
        kp = key_pos[valid]
        slots = table[kp // block_size], kp % block_size
        if trace is not None:
            trace.copied[tile], trace.max_key[tile] = n_kt, int(kp.max())
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            k = np.zeros((n_kt * BN, hd), np.float32)
            v = np.zeros((n_kt * BN, hd), np.float32)
            k[valid], v[valid] = cache_k[slots][:, kvh], cache_v[slots][:, kvh]
            for c in range(rows_per_tile // WG_ROWS):
                real = pos[WG_ROWS * c : WG_ROWS * (c + 1)]
                n_c = computed_tiles(pos, c)
                if trace is not None and h == 0:
                    trace.computed[(tile, c)] = n_c
                if real.size == 0:
                    continue
                assert n_c <= n_kt, "a warpgroup never waits for a key tile the producer does not copy"
                qt = np.zeros((WG_ROWS, hd), np.float32)
                qt[: real.size] = q[first + WG_ROWS * c : first + WG_ROWS * c + real.size, h]
                row_pos = np.full(WG_ROWS, real[-1])
                row_pos[: real.size] = real
                m = np.full(WG_ROWS, -np.inf, np.float32)
                l = np.zeros(WG_ROWS, np.float32)
                o = np.zeros((WG_ROWS, hd), np.float32)
                for j in range(n_c):
                    kj = key_pos[j * BN : (j + 1) * BN]
                    s = np.einsum("rd,kd->rk", qt, k[j * BN : (j + 1) * BN])
                    if apply_mask and j * BN + BN - 1 > real[0]:
                        s = np.where(kj[None, :] > row_pos[:, None], np.float32(-np.inf), s)
                        if trace is not None:
                            trace.masked += 1
                    mx = np.maximum(m, s.max(1))
                    corr = np.exp2(m * sl - mx * sl)
                    p = np.exp2(s * sl - (mx * sl)[:, None])
                    m, l = mx, l * corr + p.sum(1)
                    o = o * corr[:, None] + np.einsum("rk,kd->rd", round_to_bf16(p.astype(np.float32)),
                                                      v[j * BN : (j + 1) * BN])
                g = gate[first + WG_ROWS * c : first + WG_ROWS * c + real.size, h].astype(np.float64)
                res = o[: real.size] / l[: real.size, None] / (1.0 + np.exp(-g))
                out[first + WG_ROWS * c : first + WG_ROWS * c + real.size, h] = round_to_bf16(res.astype(np.float32))
                if trace is not None and h == 0:
                    trace.stored_rows.extend(range(first + WG_ROWS * c, first + WG_ROWS * c + real.size))
    return out.reshape(n, heads * hd)
