"""The Qwen3.5 vision tower on the GPU: the same function as gpu_engine/reference/vision_tower.py.

Per item (an image, or one video frame group; a video item with grid t > 1 also works: its frame groups are
attention segments of h*w rows each):

    pixels [n, C*T*P*P] --GEMM--> x [n, hidden] --patch_pos--> + bias + resampled position table
    depth x: LayerNorm -> qkv GEMM (+bias) -> 2-D rotary on q and k -> segment attention -> proj GEMM (+bias, +x)
             LayerNorm -> fc1 GEMM (+bias, GELU) -> fc2 GEMM (+bias, +x)
             (biases in the GEMM epilogue, residual adds as the GEMM accumulating into x; where cuBLASLt has no
             epilogue algorithm for a shape, the GEMM + bias_act / bias_residual kernels instead)
    merger:  LayerNorm -> rows viewed as [n / merge^2, merge^2 * hidden] (the processors emit each merge window's
             patches consecutively, so the window gather is a reshape) -> fc1 (+bias, exact GELU) -> fc2 (+bias)

Attention, per segment (the `attention` mode): "flash" is the fused tensor-core kernel (kernels/vision_flash.cu,
bf16 towers with head_dim in vision_flash.HEAD_DIMS; no score matrix is materialised); "kernel" is the CUDA-core
kernel (kernels/vision.cu, vision_attention); "gemm" is the GEMM path below; "auto" picks flash where it applies,
else the kernel for short segments and the GEMM path from GEMM_ATTENTION_MIN rows on (so fp32 towers keep their
exact paths). The GEMM path: per block of query rows on the tensor cores, all heads in each launch: S = Q K^T
(cuBLASLt strided-batched over the heads, fp32 out), P = softmax(scale * S) (one kernel, P in the storage type),
O = P V (batched again); Q, K, V and O are column slices of the fused qkv and the output buffers, read in place.
S takes at most SCORES_BYTES per block of query rows.

Geometry that depends only on the grid (bilinear taps and weights of the position table, (row, col) of each
patch for the rotary) is computed on the host in float64 and uploaded with the pixels; the arithmetic runs on
the device in the runner's dtype with fp32 accumulation. Activations are per-call scratch from the arena.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ..vision_geometry import bilinear_taps, merge_window_coords
from . import ops, rotary, vision_flash, vision_ops
from .context import DArray, GpuContext
from .errors import CudaBackendError, ShapeError
from .gemm import EpilogueUnsupported
from .weights import _Uploader

LAYER_NORM_EPS = 1e-6  # fixed in the model code, as in the reference tower
GEMM_ATTENTION_MIN = 256  # segment rows from which attention runs as GEMMs (the kernel is CUDA-core and O(n^2))
SCORES_BYTES = 256 << 20  # fp32 score block of the GEMM attention (all heads)
ATTENTION_MODES = ("auto", "kernel", "gemm", "flash")
_BLOCK_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
# cuBLASLt's GELU epilogue is the tanh approximation: on the H200 (bench/results/s2/run8_kernels.log) the f32
# "gemm ... +bias gelu_tanh" rows match the tanh form to 1.8e-6 and differ from exact (erf) GELU by 1.8e-4. So fc1's
# bias + GELU go into the epilogue for gelu_pytorch_tanh towers; exact-GELU layers keep the bias_act kernel.
GELU_EPILOGUE_IS_TANH = True


class VisionEncodeError(CudaBackendError, ValueError):
    """pixel values / grid that the tower cannot encode (the message says what is wrong)."""


@dataclass(frozen=True)
class _Block:
    norm1_w: DArray
    norm1_b: DArray
    qkv_w: DArray
    qkv_b: DArray
    proj_w: DArray
    proj_b: DArray
    norm2_w: DArray
    norm2_b: DArray
    fc1_w: DArray
    fc1_b: DArray
    fc2_w: DArray
    fc2_b: DArray


@dataclass(frozen=True)
class FrameGeometry:
    """Host-side tables of one h x w frame, rows in the processors' merge-window order."""

    taps: np.ndarray  # int32 [h*w, 4]: rows of the (side*side, hidden) position table
    weights: np.ndarray  # float32 [h*w, 4]: bilinear weights of those rows
    rowcol: np.ndarray  # int32 [2, h*w]: (row, col) of each patch, the 2-D rotary positions


@lru_cache(maxsize=64)
def frame_geometry(h: int, w: int, merge: int, side: int) -> FrameGeometry:
    """Position-table taps/weights and rotary positions of an h x w frame (h, w multiples of `merge`); cached per
    grid (pages of one document share it), so the arrays must not be written to."""
    row, col = merge_window_coords(h, w, merge)
    r0, r1, fr = bilinear_taps(row, h, side)
    c0, c1, fc = bilinear_taps(col, w, side)
    taps = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], axis=1)
    weights = np.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], axis=1)
    geo = FrameGeometry(taps.astype(np.int32), weights.astype(np.float32), np.stack([row, col]).astype(np.int32))
    for arr in (geo.taps, geo.weights, geo.rowcol):
        arr.setflags(write=False)
    return geo


class GpuVisionTower:
    """Vision weights uploaded once (runner dtype; biases and norms too), encode() per item."""

    def __init__(self, ctx: GpuContext, vision_config: Any, weights: dict[str, np.ndarray], dtype: str,
                 attention: str = "auto", flash_variant: str | None = None) -> None:
        from ..reference.vision_tower import VisionDims, _check_weights, vision_weight_shapes

        if attention not in ATTENTION_MODES:
            raise ShapeError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.ctx, self.dtype, self.attention = ctx, dtype, attention
        self.flash_variant = flash_variant  # vision_flash.VARIANTS name; None: its DEFAULT_VARIANT
        self.dims = d = VisionDims.from_config(vision_config)
        _check_weights(vision_weight_shapes(vision_config), weights)
        if d.head_dim > 256:
            raise ShapeError(f"vision head_dim {d.head_dim} > 256 is not supported by the attention kernel")
        self.flash = vision_flash.supported(dtype, d.head_dim)
        if attention == "flash" and not self.flash:
            raise ShapeError(f"attention='flash' needs a bf16 tower with head_dim in {vision_flash.HEAD_DIMS}, got "
                             f"{dtype} head_dim {d.head_dim}")
        self.act = _BLOCK_ACTS[d.hidden_act]
        up = _Uploader(ctx, dtype)

        def put(name: str) -> DArray:
            return up.put("visual." + name, np.asarray(weights[name]))

        self.patch_w = up.put("visual.patch_embed", np.asarray(weights["patch_embed.proj.weight"]).reshape(
            d.hidden_size, d.patch_dim))
        self.patch_b = put("patch_embed.proj.bias")
        side = d.pos_grid_side
        self.pos_table = up.put("visual.pos_embed", np.asarray(weights["pos_embed.weight"])[: side * side])
        names = ("norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                 "attn.proj.bias", "norm2.weight", "norm2.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
        self.blocks = [_Block(*(put(f"blocks.{i}.{n}") for n in names)) for i in range(d.depth)]
        self.merger = [put("merger." + n) for n in ("norm.weight", "norm.bias", "linear_fc1.weight",
                                                     "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")]
        self.nbytes = up.nbytes
        inv, axis = rotary.vision_tables(d.head_dim, d.rope_theta)
        self.rope_inv = ctx.to_device(inv, "f32", "visual.rope_inv")
        self.rope_axis = ctx.to_device(axis, "i32", "visual.rope_axis")

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.dims.merge_unit

    def _check(self, parts: list[np.ndarray], grid_thw: tuple[int, ...], out: DArray) -> None:
        d = self.dims
        if len(grid_thw) != 3 or min(grid_thw) < 1:
            raise VisionEncodeError(f"grid_thw must be three positive integers, got {grid_thw!r}")
        t, h, w = grid_thw
        if h % d.spatial_merge_size or w % d.spatial_merge_size:
            raise VisionEncodeError(f"grid {grid_thw}: h and w must be multiples of spatial_merge_size "
                                    f"{d.spatial_merge_size}")
        shapes = [p.shape for p in parts]
        if any(len(s) != 2 or s[1] != d.patch_dim for s in shapes) or sum(s[0] for s in shapes) != t * h * w:
            raise VisionEncodeError(f"pixel_values must be [{t * h * w}, {d.patch_dim}] for grid {grid_thw}, got "
                                    f"{shapes[0] if len(shapes) == 1 else shapes}")
        want = (self.num_tokens((t, h, w)), d.out_hidden_size)
        if out.shape != want or out.dtype != self.dtype:
            raise VisionEncodeError(f"output buffer {out.shape} {out.dtype}, expected {want} {self.dtype}")

    def encode(self, pixel_values: np.ndarray | list[np.ndarray], grid_thw: tuple[int, int, int],
               out: DArray) -> DArray:
        """Encode one item into `out` [t*h*w / merge^2, out_hidden] (enqueued on the context's stream).
        `pixel_values` may be a list of consecutive row blocks (the items of encode_vision_batch): they are
        uploaded into one buffer, with no host-side concatenation of tens of MB a page."""
        blocks = pixel_values if isinstance(pixel_values, list) else [pixel_values]
        parts = [np.asarray(p, np.float32) for p in blocks]
        grid = tuple(int(g) for g in grid_thw)
        self._check(parts, grid, out)
        ctx, d, t_ = self.ctx, self.dims, self.dtype
        t, h, w = grid
        n, H, seg = t * h * w, d.hidden_size, h * w
        geo = frame_geometry(h, w, d.spatial_merge_size, d.pos_grid_side)
        mark = ctx.arena.mark()
        try:
            pixels = ctx.empty((n, d.patch_dim), "f32", "visual.pixels")
            row = 0
            for block in parts:  # staged uploads (device.upload): the host copies while the GPU works
                ctx.device.upload(pixels.ptr + row * d.patch_dim * 4, block)
                row += block.shape[0]
            if t_ != "f32":  # round on the device: numpy's bf16 rounding costs tens of ms for one large image
                rounded = ctx.empty(pixels.shape, t_, "visual.pixels_" + t_)
                vision_ops.cast_from_f32(ctx, rounded, pixels)
                pixels = rounded
            taps = ctx.to_device(np.tile(geo.taps, (t, 1)), "i32", "visual.taps")
            tap_w = ctx.to_device(np.tile(geo.weights, (t, 1)), "f32", "visual.tap_weights")
            rowcol = ctx.to_device(np.tile(geo.rowcol, (1, t)), "i32", "visual.rowcol")
            x = ctx.empty((n, H), t_, "visual.x")
            normed = ctx.empty((n, H), t_, "visual.normed")
            qkv = ctx.empty((n, 3 * H), t_, "visual.qkv")
            attn = ctx.empty((n, H), t_, "visual.attn")
            tmp = ctx.empty((n, H), t_, "visual.tmp")
            mlp = ctx.empty((n, d.intermediate_size), t_, "visual.mlp")
            ctx.blas.linear(x.ptr, pixels.ptr, self.patch_w.ptr, n, H, d.patch_dim, dtype=t_)
            vision_ops.patch_pos(ctx, x, self.patch_b, self.pos_table, taps, tap_w)
            for b in self.blocks:
                vision_ops.layernorm(ctx, normed, x, b.norm1_w, b.norm1_b, LAYER_NORM_EPS)
                self._linear_bias(qkv, normed, b.qkv_w, b.qkv_b)
                for part in (0, H):  # q, then k: rotary over the whole head, (row, col) angles
                    ops.rope(ctx, qkv.at(part), n, d.num_heads, d.head_dim, 3 * H, d.head_dim, rowcol,
                             self.rope_inv, self.rope_axis)
                self._attend(attn, qkv, n, seg)
                self._residual_linear(x, attn, b.proj_w, b.proj_b, tmp)
                vision_ops.layernorm(ctx, normed, x, b.norm2_w, b.norm2_b, LAYER_NORM_EPS)
                self._linear_bias(mlp, normed, b.fc1_w, b.fc1_b, self.act)
                self._residual_linear(x, mlp, b.fc2_w, b.fc2_b, tmp)
            norm_w, norm_b, fc1_w, fc1_b, fc2_w, fc2_b = self.merger
            vision_ops.layernorm(ctx, normed, x, norm_w, norm_b, LAYER_NORM_EPS)
            rows, M = n // d.merge_unit, d.merged_size
            windows = normed.view((rows, M))  # each merge window's patches are consecutive rows
            hidden = ctx.empty((rows, M), t_, "visual.merger_hidden")
            ctx.blas.linear(hidden.ptr, windows.ptr, fc1_w.ptr, rows, M, M, dtype=t_)
            vision_ops.bias_act(ctx, hidden, hidden, fc1_b, "gelu")
            ctx.blas.linear(out.ptr, hidden.ptr, fc2_w.ptr, rows, d.out_hidden_size, M, dtype=t_)
            vision_ops.bias_act(ctx, out, out, fc2_b)
        except BaseException:
            ctx.device.sync()  # a half-enqueued tower: let it finish before its scratch goes back
            ctx.arena.release(mark)
            raise
        # No sync: every later use of this scratch is a kernel or a copy on the same stream, ordered after these
        # (uploads are stream-ordered too), so the host goes on while the tower runs.
        ctx.arena.release(mark)
        return out

    def _linear_bias(self, out: DArray, inp: DArray, w: DArray, bias: DArray, act: str = "none") -> None:
        """out = act(inp @ w^T + bias): bias (and a tanh GELU, see GELU_EPILOGUE_IS_TANH) in the GEMM epilogue."""
        ctx, t = self.ctx, self.dtype
        (rows, k), cols = inp.shape, out.shape[1]
        if act == "none" or (act == "gelu_tanh" and GELU_EPILOGUE_IS_TANH):
            try:
                ctx.blas.linear(out.ptr, inp.ptr, w.ptr, rows, cols, k, dtype=t, bias=bias.ptr, act=act)
                return
            except EpilogueUnsupported:  # raised before any launch: the separate kernels below instead
                pass
        ctx.blas.linear(out.ptr, inp.ptr, w.ptr, rows, cols, k, dtype=t)
        vision_ops.bias_act(ctx, out, out, bias, act)

    def _residual_linear(self, x: DArray, inp: DArray, w: DArray, bias: DArray, tmp: DArray) -> None:
        """x += inp @ w^T + bias: the GEMM accumulates into the residual stream (beta = 1), bias in its epilogue;
        tmp [rows, cols] is the fallback's GEMM output."""
        ctx, t = self.ctx, self.dtype
        (rows, k), cols = inp.shape, x.shape[1]
        try:
            ctx.blas.linear(x.ptr, inp.ptr, w.ptr, rows, cols, k, dtype=t, accumulate=True, bias=bias.ptr)
            return
        except EpilogueUnsupported:
            pass
        ctx.blas.linear(tmp.ptr, inp.ptr, w.ptr, rows, cols, k, dtype=t)
        vision_ops.bias_residual(ctx, x, tmp, bias)

    def _attend(self, out: DArray, qkv: DArray, n: int, seg: int) -> None:
        """Bidirectional attention within each segment of `seg` rows: out [n, H] from qkv [n, 3H]."""
        ctx, d, t = self.ctx, self.dims, self.dtype
        H, hd, scale = d.hidden_size, d.head_dim, d.head_dim ** -0.5
        if self.attention == "flash" or (self.attention == "auto" and self.flash):
            vision_flash.vision_flash_attention(ctx, out, qkv, d.num_heads, hd, seg, scale, self.flash_variant)
            return
        use_gemm = self.attention == "gemm" or (self.attention == "auto" and seg >= GEMM_ATTENTION_MIN)
        if not use_gemm:
            vision_ops.vision_attention(ctx, out, qkv, d.num_heads, hd, seg, scale)
            return
        item, heads = qkv.itemsize, d.num_heads
        q_rows = max(1, min(seg, SCORES_BYTES // (4 * seg * heads)))
        mark = ctx.arena.mark()
        scores = ctx.empty((heads * q_rows, seg), "f32", "visual.scores")  # [head, query row, key]
        probs = ctx.empty((heads * q_rows, seg), t, "visual.probs")
        for start in range(0, n, seg):  # one frame group
            k_ptr = qkv.ptr + (start * 3 * H + H) * item
            v_ptr = qkv.ptr + (start * 3 * H + 2 * H) * item
            for q0 in range(0, seg, q_rows):
                rows = min(q_rows, seg - q0)
                q_ptr = qkv.ptr + (start + q0) * 3 * H * item
                o_ptr = out.ptr + (start + q0) * H * item
                # head h: Q/K/V/O start hd elements after head h-1; its scores rows * seg after
                ctx.blas.linear(scores.ptr, q_ptr, k_ptr, rows, seg, hd, dtype=t, y_dtype="f32", x_ld=3 * H,
                                w_ld=3 * H, batch=heads, strides=(hd, hd, rows * seg))
                s, p = scores.view((heads * rows, seg)), probs.view((heads * rows, seg))
                vision_ops.softmax_rows(ctx, p, s, scale)
                ctx.blas.linear(o_ptr, p.ptr, v_ptr, rows, hd, seg, dtype=t, y_ld=H, w_ld=3 * H, w_layout="kn",
                                batch=heads, strides=(rows * seg, hd, hd))
        ctx.arena.release(mark)  # stream order: later allocations are written only after these reads

    def flops(self, grid_thw: tuple[int, int, int]) -> float:
        """Multiply-adds x 2 of one item (GEMMs and attention), for rates in the benchmark."""
        d = self.dims
        t, h, w = grid_thw
        n, H, M = t * h * w, d.hidden_size, d.merged_size
        per_block = 2 * n * H * (3 * H + H + 2 * d.intermediate_size) + 4 * n * h * w * H
        return float(2 * n * H * d.patch_dim + d.depth * per_block + 2 * (n // d.merge_unit) * M * (
            M + d.out_hidden_size))
