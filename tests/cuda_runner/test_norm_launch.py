"""Launch shapes of the RMSNorm kernels (norm_launch, and what ops.rmsnorm / add_rmsnorm / rmsnorm_gated send):
32 rows a block up to 256 wide, a row per block of up to 256 threads above, shared memory for the staged rows,
and vt = ops._threads(dim) always (the sum order the fused FP8 norms share). The numbers are check_kernels' (GPU).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import ops
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.norm_launch import BLOCK_THREADS, NORM_MAX_SHARED, SHORT_ROWS, norm_launch


class Launches:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object, object, tuple, int]] = []
        self.device = SimpleNamespace(launch=self._launch)

    def _launch(self, module: str, kernel: str, grid, block, *args, shmem: int = 0) -> None:
        self.calls.append((kernel, grid, block, args, shmem))


def arr(shape: tuple[int, ...], dtype: str = "bf16", ptr: int = 1 << 20) -> DArray:
    return DArray(ptr, shape, dtype)


def test_9b_hidden_rows_go_one_per_block_with_the_scalar_kernels_sum_layout():
    lp = norm_launch(8192, 4096, 2, ops._threads(4096))
    assert (lp.grid, lp.block, lp.shmem, lp.vt, lp.block_rows) == (8192, BLOCK_THREADS, 8192, 1024, 1)


def test_deltanet_heads_go_32_a_block_with_x_and_z_staged():
    lp = norm_launch(8192 * 32, 128, 2, ops._threads(128), staged=2)
    assert (lp.grid, lp.block, lp.vt, lp.block_rows) == (8192 * 32 // SHORT_ROWS, BLOCK_THREADS, 64, SHORT_ROWS)
    assert lp.shmem == SHORT_ROWS * 2 * 128 * 2


@pytest.mark.parametrize("rows, dim, itemsize, grid, block, shmem", [
    (13 * 16, 256, 2, 7, BLOCK_THREADS, SHORT_ROWS * 512),  # the 9B q heads: vt 128, still short rows
    (9, 40, 4, 1, BLOCK_THREADS, SHORT_ROWS * 160),  # one partly filled block
    (5, 1001, 2, 5, BLOCK_THREADS, 2016),  # vt 512; a row of 2002 bytes staged as 126 16-byte chunks
    (3, 300, 2, 3, 160, 608),  # vt 160: fewer threads than BLOCK_THREADS
])
def test_rows_threads_and_shared_memory(rows, dim, itemsize, grid, block, shmem):
    lp = norm_launch(rows, dim, itemsize, ops._threads(dim))
    assert (lp.grid, lp.block, lp.shmem) == (grid, block, shmem)


def test_the_scalar_kernels_launch_can_be_asked_for_and_bad_layouts_are_refused():
    lp = norm_launch(21, 128, 2, 64, threads=64)
    assert (lp.grid, lp.block, lp.shmem, lp.block_rows) == (21, 64, 256, 1)
    assert norm_launch(2, 4096, 2, 1024, threads=1024).block == 1024
    with pytest.raises(ShapeError, match="multiple of 32 from"):
        norm_launch(4, 100, 2, 48)
    with pytest.raises(ShapeError, match="up to vt"):
        norm_launch(4, 100, 2, 64, threads=128)
    with pytest.raises(ShapeError, match="shared memory"):
        norm_launch(4, NORM_MAX_SHARED // 2 + 8, 2, 1024)


def test_launchers_pass_the_layout_and_the_shared_memory():
    ctx = Launches()
    x, out, w = arr((6, 4096)), arr((6, 4096)), arr((4096,))
    ops.add_rmsnorm(ctx, out, x, x, w, 1e-6, True)
    ops.rmsnorm(ctx, out, x, w, 6, 4096, 1e-6, True)
    xs, z, wg = arr((64, 128)), arr((2, 32 * 128 + 64)), arr((128,))
    ops.rmsnorm_gated(ctx, arr((64, 128)), xs, z, wg, 1e-6, 32, 32 * 128 + 64)
    (k1, g1, b1, a1, s1), (k2, g2, b2, a2, s2), (k3, g3, b3, a3, s3) = ctx.calls
    assert (k1, g1, b1, s1, a1[-2:]) == ("add_rmsnorm_bf16", 6, BLOCK_THREADS, 8192, (np.int32(1024), np.int32(1)))
    assert (k2, g2, b2, s2, a2[-2:]) == ("rmsnorm_bf16", 6, BLOCK_THREADS, 8192, (np.int32(1024), np.int32(1)))
    assert (k3, g3, b3, s3, a3[-2:]) == ("rmsnorm_gated_bf16", 2, BLOCK_THREADS, SHORT_ROWS * 2 * 256,
                                         (np.int32(64), np.int32(SHORT_ROWS)))
