"""Qwen3.5 vision tower in plain numpy float32 — the oracle every faster vision runner is checked against.

Data flow for one call (`VisionTower.encode`):

    pixel rows [n_patches, C*T*P*P]         flattened patches, as the HF image / video processors emit them
      -> patch embedding                    a Conv3d whose kernel == stride == one patch, i.e. one matmul
      -> + learned position embedding       a square table, bilinearly resampled (align_corners) to each grid
      -> depth x block                      pre-LayerNorm; attention with 2-D (row, col) rotary, confined to
                                            one frame group of one item; GELU MLP
      -> merger                             LayerNorm, concatenate each merge x merge window, MLP (exact GELU)
    = [n_patches // merge**2, out_hidden_size]

Row order: within each frame group the processors emit patches window by window (merge x merge windows in
raster order, patches inside a window in raster order), so every `merge**2` consecutive rows form one merged
token. Items follow each other; a video item's frame groups (grid t) follow each other.

Attention never crosses a frame group (nor an item), and the position embedding and rotary angles depend only
on a patch's (row, col) inside its frame. So encoding a video one frame group at a time (grid (1, h, w) each)
gives the same embeddings as encoding it whole — the engine relies on this for bounded-memory chunked encoding.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EngineError
from ..vision_geometry import bilinear_taps, merge_window_coords
from .ops import linear, rotate_half, softmax

GridTHW = tuple[int, int, int]

_LAYER_NORM_EPS = 1e-6  # fixed in the model code (blocks and merger), not read from config.json


class VisionTowerError(EngineError, ValueError):
    """Base class of every error this module raises."""


class VisionConfigError(VisionTowerError):
    """The vision config has a value this tower does not support."""


class VisionWeightError(VisionTowerError):
    """The weights do not match the vision config (missing, unexpected or mis-shaped tensors)."""


class VisionInputError(VisionTowerError):
    """pixel_values / grid_thw passed to `encode` are inconsistent."""


# ---------------------------------------------------------------------------------------------------------------
# Activations (computed in float64, returned as float32)


def _erfc(x: np.ndarray) -> np.ndarray:
    """Complementary error function, fractional error < 1.2e-7 everywhere (Chebyshev fit, Numerical Recipes
    `erfcc`). numpy has no erf and we do not want scipy just for this; float32 results need no better."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    r = t * np.exp(-z * z + poly)
    return np.where(x >= 0.0, r, 2.0 - r)


def gelu_exact(x: np.ndarray) -> np.ndarray:
    """GELU with the exact Gaussian CDF: x * Phi(x) = 0.5 * x * erfc(-x / sqrt(2)) (stays accurate for x << 0)."""
    x64 = x.astype(np.float64)
    return (0.5 * x64 * _erfc(-x64 / math.sqrt(2.0))).astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (HF `gelu_pytorch_tanh` / `gelu_new`)."""
    x64 = x.astype(np.float64)
    inner = math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)
    return (0.5 * x64 * (1.0 + np.tanh(inner))).astype(np.float32)


# HF `hidden_act` names of the block MLP that we implement. The merger always uses exact GELU (fixed in the model).
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu": gelu_exact,
}


# ---------------------------------------------------------------------------------------------------------------
# Config


def _int_field(cfg: Any, name: str) -> int:
    if not hasattr(cfg, name):
        raise VisionConfigError(f"vision config has no field {name!r}")
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise VisionConfigError(f"vision config field {name!r} must be a positive integer, got {value!r}")
    return int(value)


def _rope_theta(cfg: Any) -> float:
    """Rotary base: HF keeps it in `rope_parameters` (type must be 'axial'); older configs have `rope_theta`."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(params, Mapping):
        raise VisionConfigError(f"vision config rope_parameters must be a mapping, got {params!r}")
    rope_type = params.get("rope_type", "axial")
    if rope_type != "axial":
        raise VisionConfigError(f"vision rope_type {rope_type!r} is not supported (only 'axial')")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    return 10000.0 if theta is None else float(theta)  # 10000 is the HF default for this config class


@dataclass(frozen=True)
class VisionDims:
    """Every number the tower needs, read once from a (duck-typed) HF `Qwen3_5VisionConfig`."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Columns of pixel_values: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token."""
        return self.spatial_merge_size ** 2

    @property
    def merged_size(self) -> int:
        return self.hidden_size * self.merge_unit

    @property
    def pos_grid_side(self) -> int:
        """Side of the square learned position table; like HF, rows beyond side**2 (if any) are never used."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_config(cls, cfg: Any) -> VisionDims:
        hidden_act = getattr(cfg, "hidden_act", None)
        if hidden_act not in ACTIVATIONS:
            raise VisionConfigError(
                f"vision hidden_act {hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}"
            )
        dims = cls(
            depth=_int_field(cfg, "depth"),
            hidden_size=_int_field(cfg, "hidden_size"),
            num_heads=_int_field(cfg, "num_heads"),
            intermediate_size=_int_field(cfg, "intermediate_size"),
            patch_size=_int_field(cfg, "patch_size"),
            temporal_patch_size=_int_field(cfg, "temporal_patch_size"),
            spatial_merge_size=_int_field(cfg, "spatial_merge_size"),
            in_channels=_int_field(cfg, "in_channels"),
            out_hidden_size=_int_field(cfg, "out_hidden_size"),
            num_position_embeddings=_int_field(cfg, "num_position_embeddings"),
            hidden_act=hidden_act,
            rope_theta=_rope_theta(cfg),
        )
        if dims.hidden_size % dims.num_heads:
            raise VisionConfigError(
                f"vision hidden_size {dims.hidden_size} is not divisible by num_heads {dims.num_heads}"
            )
        # The rotary splits each head in half (rotate_half) and each half between row and column angles.
        if dims.head_dim % 4:
            raise VisionConfigError(f"vision head_dim {dims.head_dim} must be divisible by 4 for the 2-D rotary")
        head_dim = getattr(cfg, "head_dim", None)
        if head_dim is not None and head_dim != dims.head_dim:
            raise VisionConfigError(
                f"vision head_dim {head_dim} != hidden_size // num_heads = {dims.head_dim} (unsupported)"
            )
        return dims


def vision_weight_shapes(vision_config: Any) -> dict[str, tuple[int, ...]]:
    """Exact tensor name -> shape table of the vision tower, names relative to the checkpoint's `model.visual.`."""
    d = VisionDims.from_config(vision_config)
    h, m = d.hidden_size, d.merged_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (h, d.in_channels, d.temporal_patch_size, d.patch_size, d.patch_size),
        "patch_embed.proj.bias": (h,),
        "pos_embed.weight": (d.num_position_embeddings, h),
    }
    for i in range(d.depth):
        p = f"blocks.{i}."
        shapes |= {
            p + "norm1.weight": (h,), p + "norm1.bias": (h,),
            p + "norm2.weight": (h,), p + "norm2.bias": (h,),
            p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,),
            p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
            p + "mlp.linear_fc1.weight": (d.intermediate_size, h), p + "mlp.linear_fc1.bias": (d.intermediate_size,),
            p + "mlp.linear_fc2.weight": (h, d.intermediate_size), p + "mlp.linear_fc2.bias": (h,),
        }
    shapes |= {
        "merger.norm.weight": (h,), "merger.norm.bias": (h,),  # applied per patch, before the windows are joined
        "merger.linear_fc1.weight": (m, m), "merger.linear_fc1.bias": (m,),
        "merger.linear_fc2.weight": (d.out_hidden_size, m), "merger.linear_fc2.bias": (d.out_hidden_size,),
    }
    return shapes


def _check_weights(expected: Mapping[str, tuple[int, ...]], weights: Mapping[str, Any]) -> None:
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    misshaped = [
        f"{name}: expected {expected[name]}, got {tuple(np.shape(weights[name]))}"
        for name in sorted(set(expected) & set(weights))
        if tuple(np.shape(weights[name])) != expected[name]
    ]
    problems = []
    if missing:
        problems.append(f"missing: {missing}")
    if unexpected:
        problems.append(f"unexpected: {unexpected}")
    if misshaped:
        problems.append("wrong shape: " + "; ".join(misshaped))
    if problems:
        raise VisionWeightError("vision tower weights do not match the vision config — " + " | ".join(problems))


# ---------------------------------------------------------------------------------------------------------------
# Input checks


def _normalize_grids(grid_thw: GridTHW | Sequence[GridTHW] | np.ndarray) -> list[GridTHW]:
    arr = np.asarray(grid_thw)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise VisionInputError(
            f"grid_thw must be one (t, h, w) triple of integers or a non-empty list of them, got {grid_thw!r}"
        )
    grids = [(int(t), int(h), int(w)) for t, h, w in arr]
    for g in grids:
        if min(g) <= 0:
            raise VisionInputError(f"grid_thw entries must be positive, got {g}")
    return grids


def split_frame_groups(pixel_values: np.ndarray, grid_thw: GridTHW) -> list[tuple[np.ndarray, GridTHW]]:
    """Split one video item into its frame groups: [(rows, (1, h, w)), ...]. Each can be encoded on its own
    with exactly the same result as encoding the whole item (see module docstring)."""
    t, h, w = grid_thw
    if pixel_values.shape[0] != t * h * w:
        raise VisionInputError(f"pixel_values has {pixel_values.shape[0]} rows, grid {grid_thw} needs {t * h * w}")
    n = h * w
    return [(pixel_values[i * n:(i + 1) * n], (1, h, w)) for i in range(t)]


# ---------------------------------------------------------------------------------------------------------------
# Building blocks


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased variance, as torch.nn.LayerNorm
    return ((x - mean) / np.sqrt(var + _LAYER_NORM_EPS) * weight + bias).astype(np.float32)


@dataclass(frozen=True)
class _Block:
    norm1_w: np.ndarray
    norm1_b: np.ndarray
    qkv_w: np.ndarray
    qkv_b: np.ndarray
    proj_w: np.ndarray
    proj_b: np.ndarray
    norm2_w: np.ndarray
    norm2_b: np.ndarray
    fc1_w: np.ndarray
    fc1_b: np.ndarray
    fc2_w: np.ndarray
    fc2_b: np.ndarray


class VisionTower:
    """Numpy float32 Qwen3.5 vision tower (HF `Qwen3_5VisionModel`; output = its `pooler_output`)."""

    def __init__(self, vision_config: Any, weights: Mapping[str, np.ndarray]):
        self.dims = VisionDims.from_config(vision_config)
        _check_weights(vision_weight_shapes(vision_config), weights)
        d = self.dims

        def w(name: str) -> np.ndarray:
            return np.ascontiguousarray(np.asarray(weights[name], dtype=np.float32))

        # Conv3d with kernel == stride == one patch over a patch-sized input is a dot product with the flattened
        # kernel; pixel rows are flattened in the kernel's own (C, T, P, P) order.
        self.patch_w = w("patch_embed.proj.weight").reshape(d.hidden_size, d.patch_dim)
        self.patch_b = w("patch_embed.proj.bias")
        side = d.pos_grid_side
        self.pos_table = w("pos_embed.weight")[: side * side].reshape(side, side, d.hidden_size)
        self.blocks = [
            _Block(*(w(f"blocks.{i}.{n}") for n in (
                "norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                "attn.proj.bias", "norm2.weight", "norm2.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")))
            for i in range(d.depth)
        ]
        self.merger_norm_w = w("merger.norm.weight")
        self.merger_norm_b = w("merger.norm.bias")
        self.merger_fc1_w = w("merger.linear_fc1.weight")
        self.merger_fc1_b = w("merger.linear_fc1.bias")
        self.merger_fc2_w = w("merger.linear_fc2.weight")
        self.merger_fc2_b = w("merger.linear_fc2.bias")
        self.act = ACTIVATIONS[d.hidden_act]
        # Rotary frequencies: head_dim // 4 of them, shared by the row and the column angle.
        quarter = d.head_dim // 4
        self.inv_freq = (1.0 / d.rope_theta ** (np.arange(quarter) * 2.0 / (d.head_dim // 2))).astype(np.float32)

    def num_tokens(self, grid_thw: GridTHW) -> int:
        """Merged tokens (= placeholder tokens in the prompt) of one item."""
        t, h, w = grid_thw
        return t * h * w // self.dims.merge_unit

    # -- per-frame geometry ------------------------------------------------------------------------------------

    def _position_embedding(self, h: int, w: int) -> np.ndarray:
        """Learned position table bilinearly resampled to an h x w frame, rows in merge-window order."""
        side = self.dims.pos_grid_side
        row, col = merge_window_coords(h, w, self.dims.spatial_merge_size)
        r0, r1, fr = bilinear_taps(row, h, side)
        c0, c1, fc = bilinear_taps(col, w, side)
        fr, fc = fr[:, None], fc[:, None]
        t = self.pos_table
        out = ((1 - fr) * (1 - fc) * t[r0, c0] + (1 - fr) * fc * t[r0, c1]
               + fr * (1 - fc) * t[r1, c0] + fr * fc * t[r1, c1])
        return out.astype(np.float32)

    def _rotary(self, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [h*w, head_dim]: angle layout per head = [row angles, col angles] repeated twice."""
        row, col = merge_window_coords(h, w, self.dims.spatial_merge_size)
        inv = self.inv_freq.astype(np.float64)
        half = np.concatenate([row[:, None] * inv, col[:, None] * inv], axis=1)
        angles = np.concatenate([half, half], axis=1)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    # -- layers ------------------------------------------------------------------------------------------------

    def _attention(self, blk: _Block, x: np.ndarray, segments: list[tuple[int, int]],
                   cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Bidirectional multi-head attention inside each [start, end) segment (one frame group of one item)."""
        d = self.dims
        n = x.shape[0]
        qkv = linear(x, blk.qkv_w, blk.qkv_b).reshape(n, 3, d.num_heads, d.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [n, heads, head_dim]
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        scale = np.float32(d.head_dim ** -0.5)
        out = np.empty_like(q)
        for start, end in segments:
            for head in range(d.num_heads):  # one head at a time keeps the score matrix at seg x seg
                qh, kh, vh = q[start:end, head], k[start:end, head], v[start:end, head]
                out[start:end, head] = softmax((qh @ kh.T) * scale) @ vh
        return linear(out.reshape(n, d.hidden_size), blk.proj_w, blk.proj_b)

    def _block(self, blk: _Block, x: np.ndarray, segments: list[tuple[int, int]],
               cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        x = x + self._attention(blk, _layer_norm(x, blk.norm1_w, blk.norm1_b), segments, cos, sin)
        hidden = self.act(linear(_layer_norm(x, blk.norm2_w, blk.norm2_b), blk.fc1_w, blk.fc1_b))
        return x + linear(hidden, blk.fc2_w, blk.fc2_b)

    def _merge(self, x: np.ndarray) -> np.ndarray:
        x = _layer_norm(x, self.merger_norm_w, self.merger_norm_b).reshape(-1, self.dims.merged_size)
        x = gelu_exact(linear(x, self.merger_fc1_w, self.merger_fc1_b))
        return linear(x, self.merger_fc2_w, self.merger_fc2_b).astype(np.float32)

    # -- entry point -------------------------------------------------------------------------------------------

    def _check_inputs(self, pixel_values: np.ndarray, grids: list[GridTHW]) -> None:
        d = self.dims
        for g in grids:
            if g[1] % d.spatial_merge_size or g[2] % d.spatial_merge_size:
                raise VisionInputError(
                    f"grid {g}: h and w must be multiples of spatial_merge_size {d.spatial_merge_size}"
                )
        if pixel_values.ndim != 2 or pixel_values.shape[1] != d.patch_dim:
            raise VisionInputError(
                f"pixel_values must be [n_patches, {d.patch_dim}] (C*T*P*P = {d.in_channels}*"
                f"{d.temporal_patch_size}*{d.patch_size}*{d.patch_size}), got shape {pixel_values.shape}"
            )
        rows = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != rows:
            raise VisionInputError(
                f"pixel_values has {pixel_values.shape[0]} rows but grids {grids} need sum(t*h*w) = {rows}"
            )

    def encode(self, pixel_values: np.ndarray,
               grid_thw: GridTHW | Sequence[GridTHW] | np.ndarray) -> np.ndarray:
        """Encode one or several items (images / videos) -> [sum(t*h*w) // merge**2, out_hidden_size] float32,
        items in the order given. Attention never crosses an item or a frame group."""
        grids = _normalize_grids(grid_thw)
        pixel_values = np.asarray(pixel_values)
        self._check_inputs(pixel_values, grids)

        pos, cos, sin, segments = [], [], [], []
        start = 0
        for t, h, w in grids:
            frame_pos = self._position_embedding(h, w)
            frame_cos, frame_sin = self._rotary(h, w)
            for _ in range(t):  # every frame group of an item sees the same spatial geometry
                pos.append(frame_pos)
                cos.append(frame_cos)
                sin.append(frame_sin)
                segments.append((start, start + h * w))
                start += h * w
        cos_all, sin_all = np.concatenate(cos), np.concatenate(sin)

        x = linear(pixel_values.astype(np.float32), self.patch_w, self.patch_b) + np.concatenate(pos)
        for blk in self.blocks:
            x = self._block(blk, x, segments, cos_all, sin_all)
        return self._merge(x)
