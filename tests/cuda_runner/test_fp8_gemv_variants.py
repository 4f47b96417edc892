"""The FP8 streaming kernels' launchers on the CPU: which kernel each variant of fp8_ops.GEMV_VARIANTS launches, on
what grid and with which tokens, and what they refuse. The numbers are tests/cuda_runner/check_fp8.py's (GPU)."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_engine.cuda import fp8_ops
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.errors import ShapeError

FP8_CU = Path(fp8_ops.__file__).parent / "kernels" / "fp8.cu"


class Launches:
    """empty() hands out distinct pointers; launches are recorded as (kernel, grid, block, args)."""

    def __init__(self) -> None:
        self._next = 1 << 20
        self.calls: list[tuple] = []
        self.device = SimpleNamespace(launch=lambda module, *a: self.calls.append(a),
                                      info=SimpleNamespace(sm_count=132))

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        ptr, self._next = self._next, self._next + (1 << 24)
        return DArray(ptr, tuple(shape), dtype)


def weight(ctx: Launches, n: int, k: int) -> fp8_ops.Fp8Weight:
    grid = (-(-n // 128), -(-fp8_ops.groups(k) // 4) * 4)
    return fp8_ops.Fp8Weight(ctx.empty((n, k), "u8", "w"), ctx.empty(grid, "f32", "s"), grid[1], 1)


def run(m: int, path: str, n: int = 5120, k: int = 17408) -> tuple[str, list[tuple]]:
    ctx = Launches()
    took = fp8_ops.fp8_matmul(ctx, ctx.empty((m, n), "bf16", "y"), fp8_ops.act_buffers(ctx, m, k),
                              weight(ctx, n, k), path=path)
    return took, ctx.calls


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n", [4224, 5120, 6336, 16384])
def test_decode_batches_take_the_tile_grid_kernel(m, n):
    took, calls = run(m, "auto", n=n)
    assert took == "gemv_stream"
    (name, grid, block, *args), = calls
    assert (name, grid, block, int(args[-3])) == ("fp8_gemv_bf16_t1", -(-n // 16), 256, m)


def test_the_tile_grid_launches_32_tokens_at_a_time():
    ctx = Launches()
    y, xa, w = ctx.empty((40, 5120), "bf16", "y"), fp8_ops.act_buffers(ctx, 40, 17408), weight(ctx, 5120, 17408)
    assert fp8_ops.fp8_matmul(ctx, y, xa, w, path="gemv") == "gemv_stream"
    assert [(c[0], c[1], c[2], int(c[-3])) for c in ctx.calls] == [("fp8_gemv_bf16_t4", 320, 256, 32),
                                                                 ("fp8_gemv_bf16_t1", 320, 256, 8)]
    (a, b) = ctx.calls  # the second launch starts at token 32's row of y, xq and the scales
    assert (b[3] - a[3], b[5] - a[5], b[7] - a[7]) == (32 * 5120 * 2, 32 * 17408, 32 * 4)


@pytest.mark.parametrize("path", ["auto", "gemv"])
def test_gemv_variant_forces_the_variant_path_gemv_runs(monkeypatch, path):
    monkeypatch.setattr(fp8_ops, "GEMV_VARIANT", "splitk")
    took, calls = run(1, path)
    assert took == "gemv_splitk" and [c[0] for c in calls] == ["fp8_gemv_splitk_t1", "fp8_splitk_reduce_bf16"]


def test_refusals():
    ctx = Launches()
    w = weight(ctx, 256, 512)
    y = ctx.empty((33, 256), "bf16", "y")
    with pytest.raises(ShapeError):  # at most 4 8-token tiles a launch
        fp8_ops.fp8_gemv(ctx, y, fp8_ops.act_buffers(ctx, 33, 512), w, variant="stream")
    for gone in ("stream3", "streamk_d4p", "stream2"):  # removed variants are unknown ones
        with pytest.raises(ShapeError, match="unknown FP8 GEMV variant"):
            fp8_ops.fp8_gemv(ctx, y, fp8_ops.act_buffers(ctx, 1, 512), w, variant=gone)
        with pytest.raises(ShapeError, match="unknown FP8 GEMM path"):
            run(1, f"gemv_{gone}")
    assert ctx.calls == [] and fp8_ops.GEMV_VARIANTS == ("stream", "splitk") and fp8_ops.GEMV_VARIANT == "stream"


def test_every_kernel_the_launchers_name_is_an_entry_of_fp8_cu_with_its_residency():
    """The tile grid's and split-K's entries, each at 2 blocks an SM (no other residency)."""
    text = FP8_CU.read_text()
    assert re.search(r"__launch_bounds__\(FP8_GEMV_WARPS \* 32, 2\)\s+\\?\s*fp8_gemv_bf16_t##NT\(", text)
    assert re.search(r"__launch_bounds__\(FP8_GEMV_WARPS \* 32, 2\)\s+\\?\s*fp8_gemv_splitk_t##NT\(", text)
    assert re.findall(r"FP8_GEMV_ENTRY\((\d)\)", text) == ["1", "2", "3", "4"] and fp8_ops.GEMV_MAX_TILES == 4
    assert "fp8_splitk_reduce_bf16(" in text
    assert re.findall(r"__launch_bounds__\(FP8_GEMV_WARPS \* 32, (\d)\)", text) == ["2", "2"]
    assert "fp8_streamk" not in text and fp8_ops.GEMV_BLOCKS_PER_SM == 2
