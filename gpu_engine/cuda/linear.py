"""Linear layer types of the CUDA decoder: what text_model.py asks for y = x W^T, whatever W's format.

- `DenseLinear`: W in the runner's dtype (bf16 / f32), one cuBLASLt GEMM.
- `Fp8Linear`: W block-FP8 (128x128 scales); x is quantised per token and 128-group, then the FP8 GEMM
  (fp8_ops.fp8_matmul: the streaming kernel for decode-sized batches, cuBLASLt above).
- `ConcatLinear`: several of those side by side, each writing its columns of one output (a fused projection whose
  parts cannot share one matrix: DeltaNet's in_proj with FP8 qkv|z beside BF16 b|a, or FP8 parts whose scale
  grids do not join). Its FP8 parts quantise x once.
All enqueue on the context's stream (graph-capturable); scratch comes from the arena, released by the caller.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .context import DArray, GpuContext
from .errors import ShapeError
from .fp8_ops import Fp8Activations, Fp8Weight, fp8_matmul, quantize_activations


@dataclass(frozen=True)
class DenseLinear:
    w: DArray  # [out, in] in the runner's dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape[0], self.w.shape[1]

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int, y_ld: int | None = None) -> None:
        n, k = self.shape
        ctx.blas.linear(y.ptr, x.ptr, self.w.ptr, m, n, k, dtype=self.w.dtype, y_ld=y_ld)


@dataclass(frozen=True)
class Fp8Linear:
    w: Fp8Weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int, y_ld: int | None = None) -> None:
        self.apply(ctx, y, quantize_activations(ctx, x, m, self.shape[1]), y_ld)

    def apply(self, ctx: GpuContext, y: DArray, xa: Fp8Activations, y_ld: int | None = None) -> None:
        fp8_matmul(ctx, y, xa, self.w, y_ld)


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

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int, y_ld: int | None = None) -> None:
        n, k = self.shape
        y_ld = y_ld or n
        xa: Fp8Activations | None = None
        col = 0
        for part in self.parts:
            out = DArray(y.ptr + col * y.itemsize, y.shape, y.dtype)  # columns col.. of every row (stride y_ld)
            if isinstance(part, Fp8Linear):
                xa = xa or quantize_activations(ctx, x, m, k)
                part.apply(ctx, out, xa, y_ld)
            else:
                part(ctx, out, x, m, y_ld)
            col += part.shape[0]


Linear = DenseLinear | Fp8Linear | ConcatLinear


def concat(parts: Sequence[DenseLinear | Fp8Linear]) -> Linear:
    """One part as itself, several as a ConcatLinear."""
    return parts[0] if len(parts) == 1 else ConcatLinear(tuple(parts))
