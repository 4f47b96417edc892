"""Block-scaled FP8 (e4m3) numbers on the host: the format of Qwen's official FP8 checkpoints, in numpy.

A quantised Linear weight W [out, in] is stored as e4m3fn values Q (one byte each, same shape) and one inverse
scale per block of `block` = (128, 128) elements, scale_inv [ceil(out/128), ceil(in/128)]; the blocks on the
bottom and right edges may be smaller (ragged). The weight is W = Q * scale_inv[block of the element].

Quantising (at load, from a BF16 checkpoint) follows transformers 5.17's Fp8Quantize bit for bit, block by block:
scale = 448 / amax(|W_block|) (1 for an all-zero block), Q = e4m3(clamp(W_block * scale, -448, 448)) rounded to
nearest even, scale_inv = float32(1 / scale). The division is torch's `448.0 / tensor`, i.e. reciprocal(amax) * 448
in two float32 roundings (Tensor.__rtruediv__), not the correctly rounded quotient. Unlike Fp8Quantize, ragged
edge blocks are quantised too (it leaves such a tensor in BF16); their amax is taken over the elements the block
holds.

Activations (activation_scheme "dynamic") are quantised per token and per `group` = 128 consecutive input
features: s = max(amax(|x_group|), 1e-10) / 448, x ~ e4m3(x_group / s) * s (the per-token-group scheme of the
FP8 GEMM kernels; the floor keeps an all-zero group finite). `fake_quantize_activations` returns that value in
float32, which is what the reference runner multiplies by the dequantised weight when asked to emulate it.

e4m3fn conversion is ml_dtypes' (round to nearest even; it maps out-of-range values to NaN, hence the clamp).
"""
from __future__ import annotations

from functools import cache

import numpy as np

E4M3_MAX = 448.0  # largest finite e4m3fn value
BLOCK = (128, 128)  # the only weight block the engine supports (the official checkpoints' weight_block_size)
GROUP = 128  # input features per dynamic activation scale
_ACT_FLOOR = 1e-10


@cache
def _e4m3() -> np.dtype:
    """ml_dtypes' float8_e4m3fn, imported on first use: the import costs seconds of CPU, which every process that
    imports the loader (the ingest workers among them) would pay for BF16 checkpoints too."""
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """[ceil(out / block_out), ceil(in / block_in)]: the shape of a weight's scale_inv."""
    out, inp = shape
    return -(-out // block[0]), -(-inp // block[1])


def e4m3_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn bit patterns -> float32 (exact: every e4m3 value is a float32)."""
    return np.asarray(bits, dtype=np.uint8).view(_e4m3()).astype(np.float32)


def float32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> uint8 e4m3fn bit patterns, saturating at +-448, round to nearest even."""
    clamped = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return clamped.astype(_e4m3()).view(np.uint8)


def expand_scales(scale_inv: np.ndarray, shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> np.ndarray:
    """The per-element float32 scale of a [out, in] weight: each block's scale repeated over it, edges cropped."""
    s = np.asarray(scale_inv, dtype=np.float32)
    return np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def dequantize(bits: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """float32 weight = e4m3 value x scale_inv of its block. Exact for BF16 scales (4 x 8 significant bits fit a
    float32); for F32 scales the float32 product is the correctly rounded one."""
    return e4m3_to_float32(bits) * expand_scales(scale_inv, bits.shape, block)


def quantize(weight: np.ndarray, block: tuple[int, int] = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (e4m3 bits uint8 [out, in], scale_inv float32 grid), the recipe in the module docstring."""
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"block FP8 quantises 2-D Linear weights, got shape {w.shape}")
    rows, cols = scale_grid(w.shape, block)
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)  # zeros do not change a block's amax
    padded[: w.shape[0], : w.shape[1]] = w
    tiles = padded.reshape(rows, block[0], cols, block[1])
    amax = np.abs(tiles).max(axis=(1, 3))
    reciprocal = (np.float32(1.0) / np.where(amax > 0, amax, np.float32(1.0))).astype(np.float32)
    scale = np.where(amax > 0, reciprocal * np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    bits = float32_to_e4m3(tiles * scale[:, None, :, None]).reshape(padded.shape)[: w.shape[0], : w.shape[1]]
    return np.ascontiguousarray(bits), (np.float32(1.0) / scale).astype(np.float32)


def fake_quantize_activations(x: np.ndarray, group: int = GROUP) -> np.ndarray:
    """x [..., in] as the dynamic scheme sees it: each token's groups of `group` features through e4m3 and back."""
    x = np.asarray(x, dtype=np.float32)
    inp = x.shape[-1]
    groups = -(-inp // group)
    padded = np.zeros((*x.shape[:-1], groups * group), np.float32)
    padded[..., :inp] = x
    tiles = padded.reshape(*x.shape[:-1], groups, group)
    amax = np.maximum(np.abs(tiles).max(axis=-1, keepdims=True), np.float32(_ACT_FLOOR))
    s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    q = e4m3_to_float32(float32_to_e4m3(tiles / s)) * s
    return q.reshape(padded.shape)[..., :inp]
