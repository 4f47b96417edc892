"""Which prefill attention kernel a step runs, its query tiles and its shared memory (host arithmetic for ops.
flash_prefill, whose kernels are kernels/flash_prefill.cu and kernels/flash_prefill_ws.cu; step.py builds the
tiles once per step)."""
from __future__ import annotations

import numpy as np

from .errors import ShapeError

FLASH_HEAD_DIMS = (64, 128, 256)  # instantiated in kernels/flash_prefill.cu
FLASH_TILE = 64  # query rows per tile (FP_ROWS in flash_prefill.cu: 4 warps x 16 rows)
FLASH_MAX_TILES = 65535  # the tile index is gridDim.y
# flash_prefill's kernels (CudaOptions.flash_prefill) -> query rows per tile: "fa2" flash_prefill.cu (mma.sync),
# "ws" flash_prefill_ws.cu (warp-specialised wgmma, FW_ROWS: 2 consumer warpgroups x 64 rows; sm_90a, bf16 KV,
# head_dim 256 only: flash_variant); "ws2" the same file's second entry (its header: O's rescale under Q K^T, the
# producer's hand-over by cp.async.mbarrier.arrive), same tiles and shared memory
FLASH_TILE_ROWS = {"fa2": FLASH_TILE, "ws": 128, "ws2": 128}
FLASH_WS_VARIANTS = ("ws", "ws2")  # kernels of flash_prefill_ws.cu: flash_prefill_<variant>_bf16_hd256
FLASH_WS_HEAD_DIM, FLASH_WS_ARCHS, FLASH_WS_THREADS = 256, ("sm_90",), 384


def flash_variant(option: str, head_dim: int, kv_fp8: bool, arch: str | None) -> str:
    """The flash_prefill kernel a runner uses for every prefill step: `option` ("fa2", "ws" or "ws2"), with the ws
    kernels only for a bf16 KV cache at head_dim 256 on an sm_90 device, else "fa2". Its tiles must be built for it
    (flash_tiles(lens, FLASH_TILE_ROWS[variant]))."""
    if option not in FLASH_TILE_ROWS:
        raise ShapeError(f"flash_prefill variant must be one of {sorted(FLASH_TILE_ROWS)}, got {option!r}")
    ws = option in FLASH_WS_VARIANTS and head_dim == FLASH_WS_HEAD_DIM and not kv_fp8 and arch in FLASH_WS_ARCHS
    return option if ws else "fa2"


FLASH_WS_STAGES = (2, 3)  # K and V stages of flash_prefill_ws.cu (FW_K_STAGES, FW_V_STAGES)


def flash_shared_bytes(head_dim: int, fp8: bool = False, ws: bool = False) -> int:
    """Dynamic shared memory of flash_prefill_bf16_hd<head_dim> (FlashShape<HD>::SMEM_BYTES in the kernel, which
    traps if it gets less): double-buffered K and V tiles of `keys` rows, plus the Q tile where Q does not live in
    registers (head_dim 256); every row padded by 8 bf16. fp8 (flash_prefill_fp8_*): one bf16 K and V tile, the
    double-buffered raw e4m3 rows (padded by 16 bytes) and their float32 scales. ws (flash_prefill_ws_bf16_hd256,
    FwShape::SMEM_BYTES): the K and V stages of 64 unpadded rows, then the tile's 128 Q rows (229,376 bytes)."""
    if ws:
        return (sum(FLASH_WS_STAGES) * 64 + FLASH_TILE_ROWS["ws"]) * head_dim * 2
    keys = 32 if head_dim >= 256 else 64
    row = head_dim + 8
    q_rows = 0 if head_dim <= 128 else FLASH_TILE
    tiles = 1 if fp8 else 2
    base = 2 * (2 * tiles * keys * row + q_rows * row)
    return base + 4 * keys * (head_dim + 16) + 2 * 2 * keys * 4 if fp8 else base


def flash_tiles(chunk_lengths: list[int], rows: int = FLASH_TILE) -> np.ndarray:
    """Query tiles for flash_prefill: int32 [tiles, 2] = (first token in the batch, rows), at most `rows` rows each
    (FLASH_TILE_ROWS of the kernel variant), never crossing chunks."""
    tiles: list[tuple[int, int]] = []
    base = 0
    for n in chunk_lengths:
        tiles.extend((base + s, min(rows, n - s)) for s in range(0, n, rows))
        base += n
    return np.array(tiles, np.int32).reshape(-1, 2)
