"""Video frame resizing exactly as transformers does it on the CPU, bit for bit: torch's uint8 antialiased bicubic.

What torch computes for a uint8 tensor in interpolate(mode="bicubic", antialias=True, align_corners=False)
(aten UpSampleKernel.cpp: _compute_indices_min_size_weights_aa, _compute_index_ranges_int16_weights, and the
separable uint8 loops). The float arithmetic of the weights follows torch's operation order so that the
int16 weights come out identical; the convolution itself is integer arithmetic, hence exact.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .processing_errors import ProcessorError


@dataclass(frozen=True)
class _AxisFilter:
    """One axis of the resize: output i = clamp((2**(p-1) + sum_k weights[i, k] * in[taps[i, k]]) >> p)."""

    taps: np.ndarray  # int64 [out, K] input indices (clamped into range where the weight is 0)
    weights: np.ndarray  # int32 [out, K] fixed-point weights, scaled by 2**precision
    precision: int


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5 (Pillow's and torch's antialiased bicubic), float64."""
    a = -0.5
    x = np.abs(x)
    inner = ((a + 2) * x - (a + 3)) * x * x + 1
    outer = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


@functools.lru_cache(maxsize=64)
def _axis_filter(size_in: int, size_out: int) -> _AxisFilter:
    scale = size_in / size_out
    support = 2.0 * scale if scale >= 1.0 else 2.0  # bicubic's radius 2, widened by the downscale factor
    k_max = int(math.ceil(support)) * 2 + 1
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    centers = scale * (np.arange(size_out) + 0.5)
    starts = np.maximum((centers - support + 0.5).astype(np.int64), 0)  # astype truncates toward zero, like C
    ends = np.minimum((centers + support + 0.5).astype(np.int64), size_in)
    sizes = np.clip(ends - starts, 0, k_max)
    offsets = np.arange(k_max)
    inside = offsets[None, :] < sizes[:, None]
    raw = _keys_cubic(((starts[:, None] + offsets[None, :]) - centers[:, None] + 0.5) * inv_scale)
    raw = np.where(inside, raw, 0.0)
    totals = np.cumsum(raw, axis=1)[:, -1]  # a running sum, in torch's order (np.sum would pair terms)
    normalized = np.divide(raw, totals[:, None], out=raw.copy(), where=totals[:, None] != 0.0)
    w_max = float(np.max(np.where(totals[:, None] != 0.0, normalized, 0.0), initial=0.0))
    precision = 0  # as many fraction bits as keep 2 * w_max within int16 (at most 22)
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = normalized * (1 << precision)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5))  # C's (int)(v +- 0.5)
    taps = np.minimum(starts[:, None] + offsets[None, :], size_in - 1)
    return _AxisFilter(taps, fixed.astype(np.int32), precision)


def _resample_axis(x: np.ndarray, axis: int, size_out: int) -> np.ndarray:
    """Resize one axis of a uint8 array; rounds to uint8 like torch's uint8 loops (int32 accumulation).

    Each tap gathers uint8 slices along `axis` (np.take: no transposed copy for the width pass, no int32 copy of
    the input) and adds weight * pixel in int32; taps whose weight is 0 for every output are skipped. Integer
    arithmetic, so the result is torch's whatever the order.
    """
    f = _axis_filter(x.shape[axis], size_out)
    shape = list(x.shape)
    shape[axis] = size_out
    weight_shape = [1] * x.ndim
    weight_shape[axis] = size_out
    acc = np.full(shape, 1 << (f.precision - 1), dtype=np.int32)
    term = np.empty(shape, dtype=np.int32)
    for k in range(f.weights.shape[1]):
        weights = f.weights[:, k]
        if not weights.any():
            continue
        np.multiply(np.take(x, f.taps[:, k], axis=axis), weights.reshape(weight_shape), out=term)
        acc += term
    np.right_shift(acc, f.precision, out=acc)  # arithmetic shift: floor, as torch's srai / >>
    np.clip(acc, 0, 255, out=acc)
    return acc.astype(np.uint8)


def resize_like_torch_uint8(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> [height, width, C], equal to torch's uint8 antialiased bicubic interpolate.

    Width first, then height, with a uint8 image in between, as torch does; an axis that keeps its size is not
    touched.
    """
    if frame.dtype != np.uint8 or frame.ndim != 3:
        raise ProcessorError(f"frames must be uint8 [H, W, C], got {frame.dtype} {frame.shape}")
    if height < 1 or width < 1:
        raise ProcessorError(f"cannot resize to {width}x{height}")
    out = frame
    if out.shape[1] != width:
        out = _resample_axis(out, 1, width)
    if out.shape[0] != height:
        out = _resample_axis(out, 0, height)
    return np.ascontiguousarray(out)
