"""Block-FP8 on the GPU: the device form of FP8 weights and activations, their scale layouts, and the launchers of
kernels/fp8.cu and of cuBLASLt's block-scaled FP8 GEMM.

Formats are gpu_engine/fp8.py's. The scale tensors are float32 laid out the way cuBLASLt's block-scaled FP8
matmul reads them on sm_90 (the TN product of gemm.py: A = W, B = X):
- a weight's 128x128 block scales (BLK128x128_32F): [ceil(n/128), ld] row-major, the k-block index contiguous,
  ld = ceil(k/128) rounded up to 4 (16-byte rows);
- an activation's per-token 128-group scales (VEC128_32F): [ceil(k/128), ld] row-major, the token index
  contiguous, ld = m rounded up to 4.
Both are (row stride, column stride) pairs here, so the kernels would take another layout unchanged.

`row_plan` picks the path by the number of tokens: up to GEMV_MAX_M the weight-streaming kernel of fp8.cu
(tensor-core mma.sync, the weight read once), above it cuBLASLt on the rows up to a multiple of CUBLAS_M_MULTIPLE
and the streaming kernel for the rest (cuBLASLt 13.1 has no block-scaled algorithm for m % 4 != 0).
Each slice of rows is quantised on its own, since cuBLASLt derives the activation scales' row stride from its m.
`fp8_matmul` falls back to the streaming kernel, 32 tokens a launch, where cuBLASLt refuses (correct, slow).
Streaming kernels (fp8_gemv's `variant`; GEMV_VARIANT, "stream", is the one path "gemv" runs): "stream" the tile
grid (a block a 16-row tile, 2 resident an SM), "splitk" K split over blocks and a reduction pass.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..tensors import Fp8Tensor
from .context import DArray, GpuContext
from .errors import CudaBackendError, ShapeError
from .ops import _threads as norm_threads  # the norms' block size: the same sums, so the same bits

i32, i64 = np.int32, np.int64
BLOCK = 128
GEMV_TOKENS = 8  # tokens per mma n-tile
GEMV_MAX_TILES = 4  # kernel instances fp8_gemv_bf16_t1..t4
GEMV_MAX_M = 8  # up to this many tokens the streaming kernel beats cuBLASLt (bench/fp8_gemm_bench.py, 2026-12-02)
CUBLAS_M_MULTIPLE = 4  # cuBLASLt 13.1's block-scaled matmul refuses other row counts (m 33, 34; 36, 40, 44 run)
GEMV_ROWS = 16  # weight rows a block
GEMV_WARPS = 8  # FP8_GEMV_WARPS: a split's groups are a multiple of it, so its warps get equal work
GEMV_BLOCKS_PER_SM = 2  # the streaming kernels' __launch_bounds__(256, 2)
SPLITK_WAVES = 4  # split K until the grid is at least this many waves of resident blocks
GEMV_VARIANTS = ("stream", "splitk")
GEMV_VARIANT = "stream"  # path "gemv" (bench/results/cuda_notes.md, session 13 #15: stream3, auto no faster at 27B)


def split_k_plan(n: int, k: int, sm_count: int) -> tuple[int, int]:
    """(splits, groups a split) for the split-K streaming kernel: enough splits that ceil(n/16) * splits fills
    SPLITK_WAVES waves of the device's resident blocks, each split a whole multiple of GEMV_WARPS groups, no split
    empty. (1, groups) = no split."""
    tiles, g = -(-n // GEMV_ROWS), groups(k)
    want = max(1, -(-SPLITK_WAVES * GEMV_BLOCKS_PER_SM * sm_count // tiles))
    gps = _round_up(-(-g // want), GEMV_WARPS)
    return -(-g // gps), gps


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def groups(k: int) -> int:
    return -(-k // BLOCK)


@dataclass(frozen=True)
class Fp8Weight:
    """A block-FP8 weight on the device: e4m3 bytes [n, k] and its block scales (float32, strides in elements)."""

    bits: DArray  # u8 [n, k]
    scales: DArray  # f32 [ceil(n/128), ld]
    scale_row_stride: int  # per 128-row block
    scale_col_stride: int  # per 128-column block

    @property
    def shape(self) -> tuple[int, int]:
        return self.bits.shape[0], self.bits.shape[1]

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class Fp8Activations:
    """Dynamically quantised activations: e4m3 bytes [m, k] and scale (group g, token t) at g * g_stride + t."""

    q: DArray  # u8 [m, k]
    scales: DArray  # f32 [ceil(k/128), ld]
    g_stride: int
    t_stride: int

    @property
    def m(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]


def weight_scale_grid(scale_inv: np.ndarray) -> np.ndarray:
    """The [ceil(n/128), ceil(k/128)] scale grid padded on the right to a multiple of 4 columns (ones)."""
    grid = np.asarray(scale_inv, np.float32)
    padded = np.ones((grid.shape[0], _round_up(grid.shape[1], 4)), np.float32)
    padded[:, : grid.shape[1]] = grid
    return padded


def join_fp8(parts: Sequence[Fp8Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise concatenation of block-FP8 weights (bits, scale grid). Every part but the last must end on a block
    boundary, or the joined grid would give its last rows the next part's scales."""
    if not parts:
        raise ValueError("join_fp8 needs at least one part")
    for p in parts:
        if p.block != (BLOCK, BLOCK):
            raise CudaBackendError(f"the CUDA FP8 kernels take {BLOCK}x{BLOCK} weight blocks, got {p.block}")
    for p in parts[:-1]:
        if p.shape[0] % BLOCK:
            raise ValueError(f"a part of {p.shape[0]} rows does not end on a {BLOCK}-row block: cannot join")
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"parts differ in input width: {[p.shape for p in parts]}")
    bits = np.concatenate([np.asarray(p.bits, np.uint8) for p in parts], axis=0)
    grid = np.concatenate([np.asarray(p.scale_inv, np.float32) for p in parts], axis=0)
    return bits, grid


def upload_fp8_weight(ctx: GpuContext, name: str, parts: Sequence[Fp8Tensor]) -> Fp8Weight:
    bits, grid = join_fp8(parts)
    if bits.shape[1] % 16:
        raise CudaBackendError(f"{name}: FP8 rows of {bits.shape[1]} bytes; the kernels need a multiple of 16")
    scales = weight_scale_grid(grid)
    d_bits = ctx.empty(bits.shape, "u8", name)
    ctx.device.upload(d_bits.ptr, np.ascontiguousarray(bits))
    d_scales = ctx.empty(scales.shape, "f32", name + ".scale_inv")
    ctx.device.upload(d_scales.ptr, scales)
    return Fp8Weight(d_bits, d_scales, scales.shape[1], 1)


def act_buffers(ctx: GpuContext, m: int, k: int) -> Fp8Activations:
    """Arena buffers for m quantised rows of k features, in the layout cuBLASLt reads."""
    ld = _round_up(m, 4)
    return Fp8Activations(ctx.empty((m, k), "u8", "fp8.act"), ctx.empty((groups(k), ld), "f32", "fp8.act_scale"),
                          ld, 1)


def row_plan(m: int) -> list[tuple[int, int, str]]:
    """(first row, rows, path) slices of an m-token FP8 GEMM (module docstring)."""
    main = m - m % CUBLAS_M_MULTIPLE
    if m <= GEMV_MAX_M or main == 0:
        return [(0, m, "gemv")]
    return [(0, main, "cublaslt")] + ([(main, m - main, "gemv")] if main < m else [])


def quantize_activations(ctx: GpuContext, x: DArray, m: int, k: int, x_ld: int | None = None,
                         out: Fp8Activations | None = None, swiglu: bool = False) -> Fp8Activations:
    """Per-token, per-128-group e4m3 quantisation of the bf16 rows x[:m, :k] (row stride x_ld) into `out`, by
    default fresh arena buffers (the caller's scratch). swiglu=True: x is a gate|up projection [m, 2k] and the
    rows quantised are silu(gate) * up (rounded to bf16 first, as ops.silu_mul stores them)."""
    if x.dtype != "bf16":
        raise ShapeError(f"FP8 activation quantisation reads bf16, got {x.dtype}")
    x_ld = x_ld or (2 * k if swiglu else k)
    if k % 16 or x_ld % 8 or m < 1:
        raise ShapeError(f"FP8 activations need k % 16 == 0 and 16-byte rows (k={k}, x_ld={x_ld}, m={m})")
    xa = out or act_buffers(ctx, m, k)
    if xa.q.shape != (m, k) or xa.scales.shape[0] < groups(k):
        raise ShapeError(f"quantised-activation buffers {xa.q.shape} / {xa.scales.shape} for {m} rows of {k}")
    kernel = "fp8_silu_mul_quant_bf16" if swiglu else "fp8_quant_act_bf16"
    ctx.device.launch("fp8", kernel, (m, -(-groups(k) // 8)), 128, x.ptr, i64(x_ld), xa.q.ptr, i64(k),
                      xa.scales.ptr, i64(xa.g_stride), i64(xa.t_stride), i32(m), i32(k))
    return xa


def fused_quant_ok(m: int) -> bool:
    """Whether m rows quantised at once (by norm_quant) can feed an FP8 GEMM: only where row_plan takes them in one
    slice, since cuBLASLt reads the activation scales with a row stride of its own m rounded to 4."""
    return len(row_plan(m)) == 1


def norm_quant(ctx: GpuContext, out: DArray, x: DArray, w: DArray, rows: int, eps: float, zero_centred: bool,
               residual: DArray | None = None) -> Fp8Activations:
    """ops.rmsnorm (residual None: out = rmsnorm(x)) or ops.add_rmsnorm (residual += x, out = rmsnorm(residual)) on
    bf16 rows [rows, dim], bit for bit, and `out` quantised as quantize_activations would (fresh arena buffers,
    the caller's scratch): one launch for the norm and the next FP8 linear's input."""
    dim = x.shape[1]
    if {a.dtype for a in (out, x, w)} != {"bf16"} or (residual is not None and residual.dtype != "bf16"):
        raise ShapeError("norm_quant reads and writes bf16")
    if x.shape[0] < rows or out.shape[0] < rows or out.shape[1] != dim or w.size != dim or dim % 16:
        raise ShapeError(f"norm_quant shapes: x {x.shape}, out {out.shape}, w {w.shape}, rows {rows}")
    if residual is not None and (residual.shape[0] < rows or residual.shape[1] != dim):
        raise ShapeError(f"norm_quant residual {residual.shape} for x {x.shape}")
    xa = act_buffers(ctx, rows, dim)
    offset = np.float32(1.0 if zero_centred else 0.0)
    tail = (w.ptr, xa.q.ptr, i64(dim), xa.scales.ptr, i64(xa.g_stride), i64(xa.t_stride), i32(rows), i32(dim),
            np.float32(eps), offset)
    if residual is None:
        ctx.device.launch("fp8", "fp8_rmsnorm_quant_bf16", rows, norm_threads(dim), out.ptr, x.ptr, *tail)
    else:
        ctx.device.launch("fp8", "fp8_add_rmsnorm_quant_bf16", rows, norm_threads(dim), out.ptr, residual.ptr,
                          x.ptr, *tail)
    return xa


def fp8_gemv(ctx: GpuContext, y: DArray, xa: Fp8Activations, w: Fp8Weight, y_ld: int | None = None,
             first_token: int = 0, tokens: int | None = None, variant: str = "stream") -> None:
    """y[t, :n] = xa[t] @ W^T for the tokens first_token .. +tokens (at most 32), with the streaming kernel of
    `variant` (module docstring); "splitk": K split over blocks (split_k_plan), f32 partials summed in split order
    by a second pass."""
    n, k = w.shape
    if variant not in GEMV_VARIANTS:
        raise ShapeError(f"unknown FP8 GEMV variant {variant!r} (one of {', '.join(GEMV_VARIANTS)})")
    tokens = xa.m - first_token if tokens is None else tokens
    if xa.k != k or not 0 < tokens <= GEMV_TOKENS * GEMV_MAX_TILES or first_token + tokens > xa.m:
        raise ShapeError(f"fp8_gemv: activations {xa.q.shape} (tokens {first_token}+{tokens}) vs weight {w.shape}")
    if y.dtype != "bf16":
        raise ShapeError(f"fp8_gemv writes bf16, got {y.dtype}")
    y_ld = y_ld or n
    tiles = -(-tokens // GEMV_TOKENS)
    if variant == "splitk":
        splits, gps = split_k_plan(n, k, ctx.device.info.sm_count)
        part = ctx.empty((splits * tokens, n), "f32", "fp8.splitk")
        ctx.device.launch("fp8", f"fp8_gemv_splitk_t{tiles}", (-(-n // GEMV_ROWS), splits), 256, part.ptr, i32(gps),
                          xa.q.ptr + first_token * k, i64(k), xa.scales.ptr + first_token * xa.t_stride * 4,
                          i64(xa.g_stride), i64(xa.t_stride), w.bits.ptr, i64(k), w.scales.ptr,
                          i64(w.scale_row_stride), i64(w.scale_col_stride), i32(tokens), i32(n), i32(k))
        ctx.device.launch("fp8", "fp8_splitk_reduce_bf16", -(-tokens * n // 256), 256,
                          y.ptr + first_token * y_ld * 2, i64(y_ld), part.ptr, i32(splits), i32(tokens), i32(n))
        return
    ctx.device.launch("fp8", f"fp8_gemv_bf16_t{tiles}", -(-n // GEMV_ROWS), 256,
                      y.ptr + first_token * y_ld * 2, i64(y_ld), xa.q.ptr + first_token * k, i64(k),
                      xa.scales.ptr + first_token * xa.t_stride * 4, i64(xa.g_stride), i64(xa.t_stride),
                      w.bits.ptr, i64(k), w.scales.ptr, i64(w.scale_row_stride), i64(w.scale_col_stride),
                      i32(tokens), i32(n), i32(k))


def fp8_matmul(ctx: GpuContext, y: DArray, xa: Fp8Activations, w: Fp8Weight, y_ld: int | None = None,
               path: str = "auto") -> str:
    """y[m, n] (bf16, row stride y_ld) = dequant(xa) @ dequant(W)^T; path "auto" | "gemv" | "gemv_<variant>"
    (GEMV_VARIANTS) | "cublaslt". "gemv" runs GEMV_VARIANT (also where cuBLASLt refuses), 32 tokens a launch; on
    the H200 "splitk" gained only on the long-K down_proj (0.650 -> 0.695 of the FP8 roofline at M=1). Returns the
    path taken, the variant named ("gemv_stream")."""
    n, k = w.shape
    if path == "auto":
        path = "gemv" if xa.m <= GEMV_MAX_M else "cublaslt"
    if path == "cublaslt":
        if xa.scales.shape[1] < xa.m or xa.g_stride != xa.scales.shape[1] or xa.t_stride != 1 \
                or w.scale_col_stride != 1:
            raise ShapeError("cuBLASLt needs the layouts of fp8_ops' docstring")
        try:
            ctx.blas.linear_fp8(y.ptr, xa.q.ptr, xa.scales.ptr, w.bits.ptr, w.scales.ptr, xa.m, n, k, y_ld=y_ld)
            return "cublaslt"
        except ShapeError:  # no block-scaled algorithm in this cuBLASLt: the streaming kernel, 32 tokens a launch
            path = "gemv"
    if path == "gemv":
        path = f"gemv_{GEMV_VARIANT}"
    variant = path.removeprefix("gemv_")
    if not path.startswith("gemv_") or variant not in GEMV_VARIANTS:
        raise ShapeError(f"unknown FP8 GEMM path {path!r}")
    step = GEMV_TOKENS * GEMV_MAX_TILES
    for first in range(0, xa.m, step):
        fp8_gemv(ctx, y, xa, w, y_ld, first, min(step, xa.m - first), variant=variant)
    return path
