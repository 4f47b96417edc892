"""Host side of the norm fused with the FP8 activation quantisation (fp8_ops.norm_quant) and of the linear layers
taking its output (linear.py `xq`): which kernels are launched, with what, and when the layers fall back to
quantising themselves. The kernels' numbers are tests/cuda_runner/check_fp8.py's (GPU)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import fp8_ops
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.linear import ConcatLinear, DenseLinear, Fp8Linear, SwigluMlp
from gpu_engine.cuda.ops import _threads


class LaunchLog:
    """empty() hands out distinct pointers; kernel launches and cuBLASLt calls are recorded by name."""

    def __init__(self) -> None:
        self._next = 1 << 20
        self.calls: list[tuple[str, tuple]] = []
        self.device = SimpleNamespace(launch=self._launch)
        self.blas = SimpleNamespace(linear=lambda *a, **k: self.calls.append(("blas.linear", a)),
                                    linear_fp8=lambda *a, **k: self.calls.append(("blas.linear_fp8", a)))

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        ptr, self._next = self._next, self._next + (1 << 20)
        return DArray(ptr, tuple(shape), dtype)

    def _launch(self, module: str, kernel: str, grid, block, *args) -> None:
        self.calls.append((kernel, (grid, block, *args)))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def fp8_linear(ctx: LaunchLog, n: int, k: int) -> Fp8Linear:
    grid = (-(-n // 128), -(-fp8_ops.groups(k) // 4) * 4)
    return Fp8Linear(fp8_ops.Fp8Weight(ctx.empty((n, k), "u8", "w"), ctx.empty(grid, "f32", "s"), grid[1], 1))


@pytest.mark.parametrize("m, ok", [(1, True), (5, True), (8, True), (9, False), (11, False), (12, True),
                                   (32, True), (33, False), (8192, True)])
def test_fused_quant_only_where_the_rows_go_in_one_slice(m, ok):
    assert fp8_ops.fused_quant_ok(m) is ok


@pytest.mark.parametrize("add", [False, True])
def test_norm_quant_launches_one_kernel_with_the_norms_block_size(add):
    ctx = LaunchLog()
    m, dim = 3, 5120
    x, out, resid = (ctx.empty((m, dim), "bf16", n) for n in ("x", "out", "r"))
    w = ctx.empty((dim,), "bf16", "w")
    xa = fp8_ops.norm_quant(ctx, out, x, w, m, 1e-6, True, residual=resid if add else None)
    assert ctx.names() == ["fp8_add_rmsnorm_quant_bf16" if add else "fp8_rmsnorm_quant_bf16"]
    grid, block, *args = ctx.calls[0][1]
    assert (grid, block) == (m, _threads(dim))  # the same sums as ops.add_rmsnorm / ops.rmsnorm: the same bits
    assert args[0] == out.ptr and (args[1] == resid.ptr and args[2] == x.ptr if add else args[1] == x.ptr)
    assert xa.q.shape == (m, dim) and xa.scales.shape == (dim // 128, 4) and (xa.g_stride, xa.t_stride) == (4, 1)
    assert xa.q.ptr in args and xa.scales.ptr in args


def test_norm_quant_refuses_what_the_kernel_cannot_take():
    ctx = LaunchLog()
    x, out = ctx.empty((2, 72), "bf16", "x"), ctx.empty((2, 72), "bf16", "o")
    with pytest.raises(ShapeError):  # 72 % 16
        fp8_ops.norm_quant(ctx, out, x, ctx.empty((72,), "bf16", "w"), 2, 1e-6, True)
    x32 = ctx.empty((2, 128), "f32", "x")
    with pytest.raises(ShapeError):
        fp8_ops.norm_quant(ctx, ctx.empty((2, 128), "bf16", "o"), x32, ctx.empty((128,), "bf16", "w"), 2, 1e-6, True)
    assert not ctx.calls


@pytest.mark.parametrize("m, kernel", [(1, "fp8_gemv_bf16_t1"), (8, "fp8_gemv_bf16_t1"), (32, "blas.linear_fp8")])
def test_fp8_linear_takes_the_norms_quantised_rows(m, kernel):
    ctx = LaunchLog()
    layer = fp8_linear(ctx, 256, 512)
    xq = fp8_ops.act_buffers(ctx, m, 512)
    layer(ctx, ctx.empty((m, 256), "bf16", "y"), ctx.empty((m, 512), "bf16", "x"), m, xq=xq)
    assert ctx.names() == [kernel]  # no quantisation launch of its own
    assert xq.q.ptr in ctx.calls[0][1]


def test_fp8_linear_quantises_itself_where_the_rows_split():
    ctx = LaunchLog()
    layer = fp8_linear(ctx, 256, 512)
    m = 33  # cuBLASLt on 32 rows, the streaming kernel on 1: each slice quantised on its own
    xq = fp8_ops.act_buffers(ctx, m, 512)
    layer(ctx, ctx.empty((m, 256), "bf16", "y"), ctx.empty((m, 512), "bf16", "x"), m, xq=xq)
    assert ctx.names() == ["fp8_quant_act_bf16", "blas.linear_fp8", "fp8_quant_act_bf16", "fp8_gemv_bf16_t1"]
    assert not any(xq.q.ptr in c[1] for c in ctx.calls)


def test_quantised_rows_of_the_wrong_shape_are_refused():
    ctx = LaunchLog()
    layer = fp8_linear(ctx, 256, 512)
    with pytest.raises(ShapeError):
        layer(ctx, ctx.empty((2, 256), "bf16", "y"), ctx.empty((2, 512), "bf16", "x"), 2,
              xq=fp8_ops.act_buffers(ctx, 3, 512))


def test_concat_and_mlp_pass_the_quantised_rows_to_their_fp8_parts():
    ctx = LaunchLog()
    concat = ConcatLinear((fp8_linear(ctx, 128, 512), DenseLinear(ctx.empty((64, 512), "bf16", "d"))))
    assert concat.fp8_input and not DenseLinear(ctx.empty((4, 4), "bf16", "d")).fp8_input
    xq = fp8_ops.act_buffers(ctx, 1, 512)
    concat(ctx, ctx.empty((1, 192), "bf16", "y"), ctx.empty((1, 512), "bf16", "x"), 1, xq=xq)
    assert ctx.names() == ["blas.linear", "fp8_gemv_bf16_t1"]
    ctx.calls.clear()
    mlp = SwigluMlp(fp8_linear(ctx, 2 * 256, 512), fp8_linear(ctx, 512, 256))
    assert mlp.fp8_input
    mlp(ctx, ctx.empty((1, 512), "bf16", "y"), ctx.empty((1, 512), "bf16", "x"), 1, xq)
    assert ctx.names() == ["fp8_gemv_bf16_t1", "fp8_silu_mul_quant_bf16", "fp8_gemv_bf16_t1"]
