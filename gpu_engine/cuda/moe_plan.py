"""The routing plan of a qwen3_5_moe layer on the GPU, host side: tile shapes, table sizes, scratch bytes, and a numpy
mirror of what kernels/moe.cu's moe_plan and grouped GEMMs compute (CPU tests and check_moe compare against it).

The device builds the plan itself (no host read of a count, so routing can sit inside a CUDA graph): per-expert
counts and offsets of the expert-sorted rows, the tile table [max_tiles, 3] = (expert, first sorted row, rows) that
the grouped GEMMs' blocks read (blockIdx.y = tile; a tile of 0 rows returns), the token of every sorted row and the
sorted row of every (token, slot) entry. Every grid is sized from the token count alone: `max_tiles` bounds the
tiles any routing of `entries` rows over `experts` can need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class GemmTile:
    """One tensor-core tile shape of kernels/moe.cu (its MOE_GEMM_ENTRY lines)."""

    name: str
    bm: int  # rows a tile (= the plan's tile_m)
    bn: int  # output columns a block (SWIGLU: bn / 2 features)
    bk: int
    stages: int
    warps: int

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: STAGES x (A + B tiles, rows padded by 8 bf16) + the tile's source rows."""
        return self.stages * (self.bm + self.bn) * (self.bk + 8) * 2 + self.bm * 4


TILES = {
    "decode": GemmTile("decode", bm=32, bn=64, bk=128, stages=3, warps=4),
    "prefill": GemmTile("prefill", bm=128, bn=128, bk=64, stages=3, warps=8),
}
# On trial (kernels/moe.cu's last MOE_GEMM_ENTRY lines): timed by bench/moe_layer_bench.py on the plan of the tile
# with the same bm, never chosen by choose_tile.
TRIAL_TILES = {"decode_bn32": GemmTile("decode_bn32", bm=32, bn=32, bk=128, stages=3, warps=2)}
DECODE_MAX_ROWS_PER_EXPERT = 16  # mean rows an expert up to which the 32-row tiles win (few tokens: decode)
SIMPLE_COLS = 16  # output columns (features) a block of the plain kernel
PLAN_THREADS = 1024
MAX_EXPERTS = 1024  # moe_route marks taken experts in one 32-bit word a lane
MAX_TOP_K = 32  # one lane holds each chosen expert


def choose_tile(tokens: int, top_k: int, experts: int) -> GemmTile:
    """The tile shape for a step of `tokens` tokens: decode tiles while an expert gets few rows on average."""
    return TILES["decode"] if tokens * top_k <= DECODE_MAX_ROWS_PER_EXPERT * experts else TILES["prefill"]


def max_tiles(entries: int, experts: int, tile_m: int) -> int:
    """Most tiles any routing of `entries` rows over `experts` experts needs: sum over the a <= min(E, entries)
    experts with rows of ceil(c_e / tile_m) <= (entries + (tile_m - 1) * a) / tile_m."""
    active = min(experts, entries)
    return max(1, (entries + (tile_m - 1) * active) // tile_m)


def plan_shared_bytes(experts: int) -> int:
    """moe_plan's dynamic shared memory: counts, cursors, tile starts (E + 1), first rows."""
    return (4 * experts + 1) * 4


def tensor_core_fits(dtype: str, k: int, x_ld: int, *ptrs: int) -> bool:
    """Whether the tensor-core grouped GEMM can load these operands: bf16, 16-byte rows and bases."""
    return dtype == "bf16" and k % 8 == 0 and x_ld % 8 == 0 and all(p % 16 == 0 for p in ptrs)


def scratch_bytes_per_token(text: Any, itemsize: int) -> int:
    """Upper estimate of one MoE layer's step scratch per token (moe.py's buffers; 0 for a dense model): router
    logits (E + 1 padded, f32), the k + 1 entries' ids / weights / rows / sorted tokens (k routed and, when it is
    stacked, the shared expert), their activations [I] and outputs [H], else the shared expert's gate|up, activation
    and output, and the tile table (the tile bound's fixed part is left to the plan's margin)."""
    moe = getattr(text, "moe", None)
    if moe is None:
        return 0
    e, slots = int(moe.num_experts), int(moe.num_experts_per_tok) + 1
    inter, shared, hidden = int(moe.moe_intermediate_size), int(moe.shared_expert_intermediate_size), int(
        text.hidden_size)
    return ((_round_up(e + 1, 8) + 4 * slots + 1) * 4 + slots * (inter + hidden) * itemsize
            + (3 * shared + hidden) * itemsize + 3 * 4 * slots)


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


# ---- numpy mirror --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostPlan:
    """What moe_plan writes, with the rows of each expert in entry order (the device's order within an expert is
    atomic: compare those segments as sets)."""

    counts: np.ndarray  # int32 [E]
    offsets: np.ndarray  # int32 [E + 1]
    tiles: np.ndarray  # int32 [max_tiles, 3]
    sorted_token: np.ndarray  # int32 [entries]
    entry_row: np.ndarray  # int32 [entries]


def host_plan(ids: np.ndarray, experts: int, tile_m: int) -> HostPlan:
    """The plan of top-k ids [n, k] as moe_plan builds it."""
    flat = np.asarray(ids, np.int64).reshape(-1)
    k = ids.shape[1] if ids.ndim == 2 else 1
    counts = np.bincount(flat, minlength=experts).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    bound = max_tiles(flat.size, experts, tile_m)
    tiles = np.zeros((bound, 3), np.int32)
    t = 0
    for e in range(experts):
        for r0 in range(0, int(counts[e]), tile_m):
            tiles[t] = (e, offsets[e] + r0, min(tile_m, int(counts[e]) - r0))
            t += 1
    order = np.argsort(flat, kind="stable")  # rows of each expert in entry order
    entry_row = np.empty(flat.size, np.int32)
    entry_row[order] = np.arange(flat.size, dtype=np.int32)
    return HostPlan(counts, offsets, tiles, (order // k).astype(np.int32), entry_row)


def emulate_grouped_gemm(x: np.ndarray, row_src: np.ndarray | None, w: np.ndarray, tiles: np.ndarray, rows: int,
                         swiglu: bool) -> np.ndarray:
    """float64 result of the grouped GEMM by walking the tile table as the kernels' blocks do: each tile's rows
    times its expert's W^T. x [*, K], w [E, N, K]; rows: the sorted rows (entries). Rows no tile covers stay NaN
    (as a poisoned output would)."""
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    out = np.full((rows, n_out), np.nan)
    for expert, first, count in np.asarray(tiles):
        if count <= 0:
            continue
        sorted_rows = np.arange(first, first + count)
        src = sorted_rows if row_src is None else np.asarray(row_src)[sorted_rows]
        prod = np.asarray(x, np.float64)[src] @ np.asarray(w[expert], np.float64).T
        if swiglu:
            g, u = prod[:, :n_out], prod[:, n_out:]
            prod = g / (1.0 + np.exp(-g)) * u
        out[sorted_rows] = prod
    return out
