"""bfloat16 <-> float32 on the host with numpy alone (numpy has no bf16 dtype; we carry the raw 16 bits).

The rounding matches torch and the kernels' from_f<bf16_t>: round to nearest, ties to even; NaN stays NaN.
"""
from __future__ import annotations

import numpy as np


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 array of bf16 bit patterns (same shape)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 array of bf16 bit patterns -> float32 array (exact)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, returned as float32 (for building exact references)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))
