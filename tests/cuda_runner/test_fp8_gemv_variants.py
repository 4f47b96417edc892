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
@pytest.mark.parametrize("n, took, kernel", [
    (5120, "gemv_stream3", "fp8_gemv_o3_bf16_t1"),  # 320 tiles: 1.2 waves at 2 an SM (264 of 132 SMs), one at 3
    (6336, "gemv_stream3", "fp8_gemv_o3_bf16_t1"),  # 396 tiles: still one wave at 3
    (4224, "gemv_stream", "fp8_gemv_bf16_t1"),  # 264 tiles: one wave at 2 already
    (6352, "gemv_stream", "fp8_gemv_bf16_t1"),  # 397 tiles: more than a wave either way
    (16384, "gemv_stream", "fp8_gemv_bf16_t1"),
])
def test_decode_batches_pick_the_variant_by_waves(m, n, took, kernel):
    took_now, calls = run(m, "auto", n=n)
    assert took_now == took
    (name, grid, block, *args), = calls
    assert (name, grid, block, int(args[-3])) == (kernel, -(-n // 16), 256, m)


@pytest.mark.parametrize("m, tokens", [(1, [1]), (8, [8]), (12, [8, 4]), (32, [8, 8, 8, 8])])
def test_stream3_launches_the_same_grid_eight_tokens_at_a_time(m, tokens):
    ctx = Launches()
    y, xa, w = ctx.empty((m, 5120), "bf16", "y"), fp8_ops.act_buffers(ctx, m, 17408), weight(ctx, 5120, 17408)
    assert fp8_ops.fp8_matmul(ctx, y, xa, w, path="gemv_stream3") == "gemv_stream3"
    calls = list(ctx.calls)
    assert [(c[0], c[1], c[2]) for c in calls] == [("fp8_gemv_o3_bf16_t1", 320, 256)] * len(tokens)
    assert [int(c[-3]) for c in calls] == tokens
    y0, x0, s0 = calls[0][3], calls[0][5], calls[0][7]
    for i, c in enumerate(calls):  # each launch starts at its first token's row of y, xq and the scales
        assert (c[3] - y0, c[5] - x0, c[7] - s0) == (i * 8 * 5120 * 2, i * 8 * 17408, i * 8 * 4)
    ctx.calls.clear()
    fp8_ops.fp8_gemv(ctx, y, xa, w, tokens=tokens[0], variant="stream")
    assert ctx.calls[0][3:] == calls[0][3:]  # the tile-grid kernel's argument list, unchanged


@pytest.mark.parametrize("forced", ["stream3", "auto"])
def test_a_stream3_pick_hands_larger_batches_to_the_tile_grid(monkeypatch, forced):
    monkeypatch.setattr(fp8_ops, "GEMV_VARIANT", forced)
    assert run(8, "gemv")[0] == "gemv_stream3"
    took, calls = run(9, "gemv")
    assert took == "gemv_stream" and [c[0] for c in calls] == ["fp8_gemv_bf16_t2"]


def test_a_forced_variant_overrides_the_pick(monkeypatch):
    monkeypatch.setattr(fp8_ops, "GEMV_VARIANT", "stream")
    assert run(1, "auto")[0] == "gemv_stream"  # n = 5120, where "auto" takes stream3
    monkeypatch.setattr(fp8_ops, "GEMV_VARIANT", "splitk")
    assert run(1, "auto")[0] == "gemv_splitk"


def test_refusals():
    ctx = Launches()
    w = weight(ctx, 256, 512)
    y = ctx.empty((9, 256), "bf16", "y")
    with pytest.raises(ShapeError):  # one 8-token tile a launch
        fp8_ops.fp8_gemv(ctx, y, fp8_ops.act_buffers(ctx, 9, 512), w, variant="stream3")
    for gone in ("streamk_d4p", "stream2"):
        with pytest.raises(ShapeError):
            fp8_ops.fp8_gemv(ctx, y, fp8_ops.act_buffers(ctx, 1, 512), w, variant=gone)
        with pytest.raises(ShapeError):
            run(1, f"gemv_{gone}")
    assert ctx.calls == []


def test_every_kernel_the_launchers_name_is_an_entry_of_fp8_cu_with_its_residency():
    """fp8_gemv_o3_bf16_t1 must stay at 3 blocks an SM (its reason to exist), the tile grid's at 2."""
    text = FP8_CU.read_text()
    assert re.search(r"__launch_bounds__\(FP8_GEMV_WARPS \* 32, 3\)\s+fp8_gemv_o3_bf16_t1\(", text)
    assert re.search(r"__launch_bounds__\(FP8_GEMV_WARPS \* 32, 2\)\s+\\?\s*fp8_gemv_bf16_t##NT\(", text)
    assert "fp8_streamk" not in text and fp8_ops.GEMV_BLOCKS_PER_SM == 2
