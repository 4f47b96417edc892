"""Launcher of kernels/vision_flash.cu: the vision tower's fused segment attention on the tensor cores (bf16).

Same function as vision_ops.vision_attention (bidirectional attention inside consecutive segments of seg_len rows,
q, k, v read in place from the fused qkv projection), without materialising scores: one block per (64-row query tile
of a segment, head), keys streamed in steps of KEYS_PER_STEP with an online softmax.
"""
from __future__ import annotations

import numpy as np

from .context import DArray, GpuContext
from .errors import ShapeError
from .ops import _need

HEAD_DIMS = (64, 72, 80, 128)  # instantiated in kernels/vision_flash.cu
TILE_ROWS = 64  # query rows per block (VF_ROWS in the kernel: 4 warps x 16)
KEYS_PER_STEP = 64  # VF_BN in the kernel
_PAD = 8  # bf16 elements of padding per shared-memory row (VF_PAD)
_MAX_GRID_X = 2**31 - 1
_MAX_HEADS = 65535  # heads are gridDim.y


def padded_head_dim(head_dim: int) -> int:
    """Width of the Q K^T product: head_dim rounded up to the mma's k of 16 (72 -> 80)."""
    return -(-head_dim // 16) * 16


def shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of vision_flash_bf16_hd<head_dim> (VisionFlashShape<HD>::SMEM_BYTES, which the kernel
    checks): two K and two V buffers of KEYS_PER_STEP rows, each row padded_head_dim + 8 bf16."""
    return 2 * 4 * KEYS_PER_STEP * (padded_head_dim(head_dim) + _PAD)


def supported(dtype: str, head_dim: int) -> bool:
    """Whether the fused kernel covers this tower (bf16 storage, an instantiated head dim)."""
    return dtype == "bf16" and head_dim in HEAD_DIMS


def tiles_per_segment(seg_len: int) -> int:
    return -(-seg_len // TILE_ROWS)


def vision_flash_attention(ctx: GpuContext, out: DArray, qkv: DArray, heads: int, head_dim: int, seg_len: int,
                           scale: float) -> None:
    """out [n, heads*head_dim] = softmax(scale * q k^T) v inside each segment of seg_len rows; qkv [n, 3*heads*
    head_dim] bf16 (q | k | v per row). Rows are copied in 16-byte pieces: qkv must be 16-byte aligned (head_dim is
    a multiple of 8, so every head's columns are too) and out 4-byte aligned. scale > 0 (the kernel's running max
    starts at -inf and is scaled by it)."""
    for arr, what in ((out, "out"), (qkv, "qkv")):
        _need(arr, "bf16", f"vision_flash_attention {what}")
    n = qkv.shape[0]
    width = heads * head_dim
    if head_dim not in HEAD_DIMS:
        raise ShapeError(f"vision_flash_attention supports head_dim {HEAD_DIMS}, got {head_dim}")
    if (len(qkv.shape) != 2 or qkv.shape != (n, 3 * width) or out.shape != (n, width) or seg_len < 1 or n < 1
            or n % seg_len or not 0 < heads <= _MAX_HEADS or not scale > 0):
        raise ShapeError(f"vision_flash_attention: qkv {qkv.shape}, out {out.shape}, heads {heads}, head_dim "
                         f"{head_dim}, seg_len {seg_len} must divide n >= 1, scale {scale} must be > 0")
    if qkv.ptr % 16 or out.ptr % 4:
        raise ShapeError("vision_flash_attention needs a 16-byte aligned qkv and a 4-byte aligned out")
    tiles = tiles_per_segment(seg_len)
    blocks = n // seg_len * tiles
    if blocks > _MAX_GRID_X:
        raise ShapeError(f"vision_flash_attention: {blocks} query tiles exceed the grid")
    ctx.device.launch("vision_flash", f"vision_flash_bf16_hd{head_dim}", (blocks, heads), 128, out.ptr, qkv.ptr,
                      np.int32(heads), np.int32(seg_len), np.int32(tiles), np.float32(scale),
                      shmem=shared_bytes(head_dim))
