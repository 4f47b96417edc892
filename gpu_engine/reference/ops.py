"""Small numpy float32 building blocks shared by the reference layers (text and vision)."""
from __future__ import annotations

import numpy as np

from ..fp8 import fake_quantize_activations


class Fp8InputWeight(np.ndarray):
    """The dequantised float32 weight of a block-FP8 Linear, tagged so that `linear` first sends its input through
    the dynamic FP8 activation quantisation (per token, per 128 input features), as the FP8 kernels do. Made by
    `array.view(Fp8InputWeight)` only when the reference runner is asked to emulate that (fp8_activations)."""


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ weight.T (+ bias), the nn.Linear convention (weight is [out, in])."""
    if isinstance(weight, Fp8InputWeight):
        x, weight = fake_quantize_activations(x), weight.view(np.ndarray)
    y = x @ weight.T
    return y + bias if bias is not None else y


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """The SwiGLU MLP: down(silu(gate(x)) * up(x)), weights [out, in]."""
    return linear(silu(linear(x, gate)) * linear(x, up), down)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm of Qwen3.5: the stored weight is an offset from 1, so the scale is (1 + weight)."""
    x = x.astype(np.float32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv) * (np.float32(1.0) + weight)


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm with a plain (not zero-centred) weight, then multiplied by silu(gate): DeltaNet's output norm."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv) * weight * silu(gate)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive number only, so large |x| neither overflows nor warns
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) computed without overflow (torch uses x itself above 20; the difference is < 1e-8)."""
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(np.float32, copy=False)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (the FLA convention transformers follows)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def mrope_cos_sin(
    positions: np.ndarray, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, rotary_dim] for M-RoPE positions [3, n] (temporal, height, width), interleaved layout.

    Frequency i (of rotary_dim/2) takes its angle from the temporal position, except i = 1, 4, 7, ... below
    3*section[1] (height) and i = 2, 5, 8, ... below 3*section[2] (width). The half-split layout
    [f_0..f_{d/2-1}, f_0..f_{d/2-1}] goes with `rotate_half`.
    """
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))))
    inv_freq = inv_freq.astype(np.float32)
    freqs = positions.astype(np.float32)[:, :, None] * inv_freq[None, None, :]  # [3, n, d/2]
    mixed = freqs[0].copy()
    for axis in (1, 2):
        idx = slice(axis, mrope_section[axis] * 3, 3)
        mixed[:, idx] = freqs[axis][:, idx]
    emb = np.concatenate([mixed, mixed], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """[a, b] -> [-b, a] over the last axis, split in halves."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first rotary_dim dims of x [n, heads, head_dim] (rotate_half convention); the rest passes."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    out = rot * cos[:, None, :] + rotate_half(rot) * sin[:, None, :]
    return np.concatenate([out, rest], axis=-1)
