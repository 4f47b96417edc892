"""Typed launchers for the vision tower's kernels (kernels/vision.cu): LayerNorm (a warp or a block per row), bias +
activation, the patch embedding's position taps, segment attention on the CUDA cores, row softmax and the f32 cast.
Same conventions as ops.py (enqueue only; row-major shapes, strides in elements, scalars with explicit C types)."""
from __future__ import annotations

import numpy as np

from .context import DArray, GpuContext
from .errors import ShapeError
from .ops import _grid_1d, _need, _same_float, _threads

i32, i64, f32 = np.int32, np.int64, np.float32

VISION_ACTS = {"none": 0, "gelu_tanh": 1, "gelu": 2}  # gelu = exact (erf) GELU


LAYERNORM_ROWS_MAX = {"bf16": 32 * 8 * 8, "f32": 32 * 8 * 4}  # layernorm_rows: 32 lanes x LN_VECS x 16 bytes
_ROWS_PER_BLOCK = 8  # layernorm_rows: one warp per row


def layernorm(ctx: GpuContext, out: DArray, x: DArray, w: DArray, b: DArray, eps: float) -> None:
    """out = LayerNorm(x) * w + b over the last dim (biased variance, like torch). x/out [rows, dim]; may alias.
    Rows of whole 16-byte vectors up to LAYERNORM_ROWS_MAX run one warp a row (layernorm_rows), others a block."""
    t = _same_float(out, x, w, b)
    rows, dim = x.shape
    if out.shape != x.shape or w.size != dim or b.size != dim:
        raise ShapeError(f"layernorm shapes: x {x.shape}, out {out.shape}, w {w.shape}, b {b.shape}")
    per = 16 // out.itemsize
    if dim % per == 0 and dim <= LAYERNORM_ROWS_MAX[t] and not (out.ptr | x.ptr | w.ptr | b.ptr) % 16:
        ctx.device.launch("vision", f"layernorm_rows_{t}", -(-rows // _ROWS_PER_BLOCK), 32 * _ROWS_PER_BLOCK,
                          out.ptr, x.ptr, w.ptr, b.ptr, i32(rows), i32(dim), f32(eps))
        return
    ctx.device.launch("vision", f"layernorm_{t}", rows, _threads(dim), out.ptr, x.ptr, w.ptr, b.ptr, i32(rows),
                      i32(dim), f32(eps))


def bias_act(ctx: GpuContext, out: DArray, x: DArray, bias: DArray, act: str = "none") -> None:
    """out[r, c] = act(x[r, c] + bias[c]); act in VISION_ACTS. x/out [rows, cols]; out may alias x."""
    t = _same_float(out, x, bias)
    if act not in VISION_ACTS:
        raise ShapeError(f"unknown activation {act!r}; have {sorted(VISION_ACTS)}")
    rows, cols = x.shape
    if out.shape != x.shape or bias.size != cols:
        raise ShapeError(f"bias_act shapes: x {x.shape}, out {out.shape}, bias {bias.shape}")
    ctx.device.launch("vision", f"bias_act_{t}", _grid_1d(ctx, x.size), 256, out.ptr, x.ptr, bias.ptr, i32(rows),
                      i32(cols), i32(VISION_ACTS[act]))


def bias_residual(ctx: GpuContext, x: DArray, y: DArray, bias: DArray) -> None:
    """x[r, c] += y[r, c] + bias[c] (a projection's bias and the residual add in one pass)."""
    t = _same_float(x, y, bias)
    rows, cols = x.shape
    if y.shape != x.shape or bias.size != cols:
        raise ShapeError(f"bias_residual shapes: x {x.shape}, y {y.shape}, bias {bias.shape}")
    ctx.device.launch("vision", f"bias_residual_{t}", _grid_1d(ctx, x.size), 256, x.ptr, y.ptr, bias.ptr, i32(rows),
                      i32(cols))


def patch_pos(ctx: GpuContext, x: DArray, bias: DArray, table: DArray, taps: DArray, weights: DArray) -> None:
    """x[r] += bias + sum_k weights[r, k] * table[taps[r, k]] (patch-embed bias + resampled position table).
    x [rows, hidden]; table [entries, hidden]; taps i32 [rows, 4] (< entries); weights f32 [rows, 4]."""
    t = _same_float(x, bias, table)
    _need(taps, "i32", "taps")
    _need(weights, "f32", "weights")
    rows, cols = x.shape
    if bias.size != cols or table.shape[1] != cols or taps.shape != (rows, 4) or weights.shape != (rows, 4):
        raise ShapeError(f"patch_pos shapes: x {x.shape}, bias {bias.shape}, table {table.shape}, taps {taps.shape}, "
                         f"weights {weights.shape}")
    ctx.device.launch("vision", f"patch_pos_{t}", _grid_1d(ctx, x.size), 256, x.ptr, bias.ptr, table.ptr, taps.ptr,
                      weights.ptr, i32(rows), i32(cols))


def vision_attention(ctx: GpuContext, out: DArray, qkv: DArray, heads: int, head_dim: int, seg_len: int,
                     scale: float) -> None:
    """Bidirectional attention within consecutive segments of seg_len rows (one frame group each).
    qkv [n, 3 * heads * head_dim] (q | k | v, rotary already applied); out [n, heads * head_dim]."""
    t = _same_float(out, qkv)
    n = qkv.shape[0]
    width = heads * head_dim
    if head_dim > 256 or qkv.shape != (n, 3 * width) or out.shape != (n, width) or seg_len < 1 or n % seg_len:
        raise ShapeError(f"vision_attention: qkv {qkv.shape}, out {out.shape}, heads {heads}, head_dim {head_dim} "
                         f"(max 256), seg_len {seg_len} must divide {n}")
    ctx.device.launch("vision", f"vision_attention_{t}", (n, heads), 128, out.ptr, qkv.ptr, i32(n), i32(heads),
                      i32(head_dim), i32(seg_len), f32(scale))


SOFTMAX_CACHED_MAX = 8 * 1024  # row length the register-cached softmax handles (8 values x 1024 threads)


def softmax_rows(ctx: GpuContext, out: DArray, scores: DArray, scale: float, method: str = "auto") -> None:
    """out[r] = softmax(scale * scores[r]) (scale > 0); scores f32 [rows, cols], out [rows, cols] bf16 or f32.
    method: "cached" (row read once into registers; cols <= SOFTMAX_CACHED_MAX), "loop" (three passes, any
    length) or "auto" (cached where it fits)."""
    t = _same_float(out)
    _need(scores, "f32", "scores")
    rows, cols = scores.shape
    if out.shape != scores.shape or scale <= 0 or method not in ("auto", "cached", "loop"):
        raise ShapeError(f"softmax_rows: scores {scores.shape}, out {out.shape}, scale {scale} (must be > 0), "
                         f"method {method!r}")
    if method == "auto":
        method = "cached" if cols <= SOFTMAX_CACHED_MAX else "loop"
    if method == "cached":
        if cols > SOFTMAX_CACHED_MAX:
            raise ShapeError(f"softmax_rows cached handles rows of at most {SOFTMAX_CACHED_MAX}, got {cols}")
        per_thread = -(-cols // 8)  # ceil: threads * 8 must cover the row
        threads = min(1024, max(32, (per_thread + 31) // 32 * 32))
        ctx.device.launch("vision", f"softmax_rows_cached_{t}", rows, threads, out.ptr, scores.ptr, i32(rows),
                          i32(cols), f32(scale))
        return
    ctx.device.launch("vision", f"softmax_rows_{t}", rows, _threads(cols), out.ptr, scores.ptr, i32(rows), i32(cols),
                      f32(scale))


def cast_from_f32(ctx: GpuContext, out: DArray, x: DArray) -> None:
    """out = x rounded to out's dtype (round to nearest even, as the host's f32_to_bf16_bits); same element count."""
    t = _same_float(out)
    _need(x, "f32", "x")
    if out.size != x.size:
        raise ShapeError(f"cast_from_f32: {x.shape} -> {out.shape} changes the element count")
    ctx.device.launch("vision", f"cast_from_f32_{t}", _grid_1d(ctx, x.size), 256, out.ptr, x.ptr, i64(x.size))
