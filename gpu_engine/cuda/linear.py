"""Linear layer types of the CUDA decoder: what text_model.py asks for y = x W^T, whatever W's format.

- `DenseLinear`: W in the runner's dtype (bf16 / f32), one cuBLASLt GEMM.
- `Fp8Linear`: W block-FP8 (128x128 scales); x is quantised per token and 128-group, then the FP8 GEMM
  (fp8_ops.fp8_matmul: the streaming kernel for decode-sized batches, cuBLASLt above).
- `ConcatLinear`: several of those side by side, each writing its columns of one output (a fused projection whose
  parts cannot share one matrix: DeltaNet's in_proj with FP8 qkv|z beside BF16 b|a, or FP8 parts whose scale
  grids do not join). Its FP8 parts quantise x once.
Each also takes its input as the MLP's gate|up output (`swiglu`: y = (silu(gate) * up) W^T), so that an FP8 down
projection quantises the activation as it computes it, and x already quantised (`xq`, from fp8_ops.norm_quant: the
norm before the layer writes both) where `fp8_input` says the layer reads FP8 and fused_quant_ok(m) holds.
All enqueue on the context's stream (graph-capturable);
scratch comes from the arena, released by the caller.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import ops
from .context import DArray, GpuContext
from .errors import ShapeError
from .fp8_ops import Fp8Activations, Fp8Weight, fp8_matmul, fused_quant_ok, quantize_activations, row_plan


def _rows(arr: DArray, first: int, ld: int) -> DArray:
    """The rows from `first` on of a row-major buffer with row stride `ld` (same shape label: only ptr is read)."""
    return DArray(arr.ptr + first * ld * arr.itemsize, arr.shape, arr.dtype)


def _usable(xq: Fp8Activations, m: int, k: int) -> bool:
    """Whether pre-quantised activations can feed this GEMM as they are (module docstring)."""
    if xq.m != m or xq.k != k:
        raise ShapeError(f"quantised activations {xq.q.shape} for {m} rows of {k}")
    return fused_quant_ok(m)


@dataclass(frozen=True)
class DenseLinear:
    w: DArray  # [out, in] in the runner's dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape[0], self.w.shape[1]

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    fp8_input = False

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int, y_ld: int | None = None,
                 xq: Fp8Activations | None = None) -> None:
        n, k = self.shape
        ctx.blas.linear(y.ptr, x.ptr, self.w.ptr, m, n, k, dtype=self.w.dtype, y_ld=y_ld)

    def swiglu(self, ctx: GpuContext, y: DArray, gate_up: DArray, m: int) -> None:
        """y = (silu(gate) * up) W^T with gate_up [m, 2 * in] (the MLP's down projection)."""
        act = ctx.empty((m, self.shape[1]), self.w.dtype, "act")
        ops.silu_mul(ctx, act, gate_up)
        self(ctx, y, act, m)


@dataclass(frozen=True)
class Fp8Linear:
    w: Fp8Weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    fp8_input = True

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int, y_ld: int | None = None,
                 xq: Fp8Activations | None = None) -> None:
        if xq is not None and _usable(xq, m, self.shape[1]):
            self.apply(ctx, y, xq, y_ld)
        else:
            self._run(ctx, y, x, m, y_ld, swiglu=False)

    def swiglu(self, ctx: GpuContext, y: DArray, gate_up: DArray, m: int) -> None:
        """y = (silu(gate) * up) W^T, the activation computed inside the FP8 quantisation (no bf16 round trip)."""
        self._run(ctx, y, gate_up, m, None, swiglu=True)

    def _run(self, ctx: GpuContext, y: DArray, x: DArray, m: int, y_ld: int | None, swiglu: bool) -> None:
        n, k = self.shape
        y_ld, x_ld = y_ld or n, 2 * k if swiglu else k
        for first, rows, path in row_plan(m):
            xa = quantize_activations(ctx, _rows(x, first, x_ld), rows, k, x_ld, swiglu=swiglu)
            self.apply(ctx, _rows(y, first, y_ld), xa, y_ld, path)

    def apply(self, ctx: GpuContext, y: DArray, xa: Fp8Activations, y_ld: int | None = None,
              path: str = "auto") -> None:
        fp8_matmul(ctx, y, xa, self.w, y_ld, path)


@dataclass(frozen=True)
class ConcatLinear:
    parts: tuple[DenseLinear | Fp8Linear, ...]

    def __post_init__(self) -> None:
        if len({p.shape[1] for p in self.parts}) != 1:
            raise ShapeError(f"concatenated linears differ in input width: {[p.shape for p in self.parts]}")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def fp8_input(self) -> bool:
        return any(p.fp8_input for p in self.parts)

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int, y_ld: int | None = None,
                 xq: Fp8Activations | None = None) -> None:
        n, k = self.shape
        y_ld = y_ld or n
        cols, col = [], 0
        for part in self.parts:
            cols.append(DArray(y.ptr + col * y.itemsize, y.shape, y.dtype))  # columns col.. (row stride y_ld)
            col += part.shape[0]
        for part, out in zip(self.parts, cols):
            if isinstance(part, DenseLinear):
                part(ctx, out, x, m, y_ld)
        if xq is not None and _usable(xq, m, k):
            for part, out in zip(self.parts, cols):
                if isinstance(part, Fp8Linear):
                    part.apply(ctx, out, xq, y_ld)
        elif any(isinstance(p, Fp8Linear) for p in self.parts):
            for first, rows, path in row_plan(m):  # each row slice quantised once for every FP8 part
                xa = quantize_activations(ctx, _rows(x, first, k), rows, k)
                for part, out in zip(self.parts, cols):
                    if isinstance(part, Fp8Linear):
                        part.apply(ctx, _rows(out, first, y_ld), xa, y_ld, path)

    def swiglu(self, ctx: GpuContext, y: DArray, gate_up: DArray, m: int) -> None:
        act = ctx.empty((m, self.shape[1]), "bf16", "act")
        ops.silu_mul(ctx, act, gate_up)
        self(ctx, y, act, m)


Linear = DenseLinear | Fp8Linear | ConcatLinear


@dataclass(frozen=True)
class SwigluMlp:
    """A dense decoder layer's MLP: y = down(silu(gate(x)) * up(x)), gate and up as one projection. (An MoE layer's
    MLP is moe.MoeLayer, called the same way.)"""

    gate_up: Linear  # [2I, hidden]
    down: Linear  # [hidden, I]

    @property
    def fp8_input(self) -> bool:
        return self.gate_up.fp8_input

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int, xq: Fp8Activations | None = None) -> None:
        gu = ctx.empty((m, self.gate_up.shape[0]), x.dtype, "gate_up")
        self.gate_up(ctx, gu, x, m, xq=xq)
        self.down.swiglu(ctx, y, gu, m)  # silu(gate) * up, then down (an FP8 down quantises it on the way)


def concat(parts: Sequence[DenseLinear | Fp8Linear]) -> Linear:
    """One part as itself, several as a ConcatLinear."""
    return parts[0] if len(parts) == 1 else ConcatLinear(tuple(parts))
