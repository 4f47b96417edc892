"""Host-side rotary tables (built once, uploaded once): inverse frequencies and the per-frequency position axis.

Computed exactly as transformers does for Qwen3.5 (fp32 inv_freq), so the device angle pos * inv_freq is the
same fp32 product.
"""
from __future__ import annotations

import numpy as np


def inv_freq(theta: float, dim: int) -> np.ndarray:
    """1 / theta^(arange(0, dim, 2) / dim) in float32 (dim = rotary dims of one head, or spatial dims)."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)


def mrope_axis(rot_dim: int, mrope_section: tuple[int, int, int]) -> np.ndarray:
    """Interleaved M-RoPE: frequency j uses h if j % 3 == 1 and j < 3*sec_h, w if j % 3 == 2 and j < 3*sec_w,
    else t (Qwen3.5's layout)."""
    half = rot_dim // 2
    axis = np.zeros(half, np.int32)
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset : mrope_section[dim] * 3 : 3] = dim
    return axis


def vision_tables(head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """2-D vision rotary over the whole head: first quarter of the frequencies from h, second from w."""
    spatial = inv_freq(theta, head_dim // 2)  # head_dim/4 frequencies
    return np.concatenate([spatial, spatial]), np.repeat(np.array([0, 1], np.int32), spatial.size)
