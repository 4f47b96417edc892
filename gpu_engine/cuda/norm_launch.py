"""Launch shape of the RMSNorm kernels in kernels/norm.cu: rows a block, threads a block, and the shared memory
that stages the rows.

`vt` is the block size the one-block-per-row scalar kernels had (ops._threads(dim)). The kernels keep that
layout's order of the sum of squares whatever shape they are launched with, so their results stay bit-identical
to those kernels and to fp8.cu's norm_quant (launched with vt threads itself).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ShapeError

PER_WARP_MAX_VT = 128  # rows whose layout is at most 4 warps (dim <= 256: q/k heads, DeltaNet heads) go a warp each
BLOCK_THREADS = 256  # threads a block in both forms
SHORT_ROWS = 32  # short rows a block (4 a warp), staged together (norm.cu's NORM_MAX_BLOCK_ROWS is the cap)
NORM_MAX_SHARED = 96 * 1024  # staged rows of a block: inside the opt-in shared memory of every sm_80+ card


@dataclass(frozen=True)
class NormLaunch:
    """grid x block threads, `shmem` dynamic shared bytes; vt and block_rows are the kernels' last two arguments."""

    grid: int
    block: int
    shmem: int
    vt: int
    block_rows: int

    def args(self) -> tuple[np.int32, np.int32]:
        return np.int32(self.vt), np.int32(self.block_rows)


def norm_launch(rows: int, dim: int, itemsize: int, vt: int, staged: int = 1, threads: int | None = None) -> NormLaunch:
    """Launch shape for `rows` rows of `dim` elements of `itemsize` bytes; `staged` rows of shared memory per row
    (2 for rmsnorm_gated: x and z), each padded to whole 16-byte chunks. Short rows (vt <= PER_WARP_MAX_VT) go
    SHORT_ROWS a block, each summed by one warp; wider ones a block each, shared by min(vt, BLOCK_THREADS) threads.
    `threads` (a multiple of 32 up to vt) forces a row per block of that many threads: threads == vt is the
    scalar kernels' own launch, which check_kernels compares the default with."""
    if vt % 32 or not 32 <= vt <= 1024:
        raise ShapeError(f"norm layout of {vt} threads: a multiple of 32 from 32 to 1024")
    if threads is not None and (threads % 32 or not 32 <= threads <= vt):
        raise ShapeError(f"a norm row shared by {threads} threads: a multiple of 32 up to vt = {vt}")
    if threads is None and vt <= PER_WARP_MAX_VT:
        block, block_rows = BLOCK_THREADS, SHORT_ROWS
    else:
        block, block_rows = threads or min(vt, BLOCK_THREADS), 1
    shmem = block_rows * staged * -(-dim * itemsize // 16) * 16
    if shmem > NORM_MAX_SHARED:
        raise ShapeError(f"norm rows of {dim} elements need {shmem} bytes of shared memory "
                         f"(at most {NORM_MAX_SHARED})")
    return NormLaunch(max(1, -(-rows // block_rows)), block, shmem, vt, block_rows)
