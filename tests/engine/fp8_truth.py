"""Independent float64 truth for block-FP8 tests: e4m3fn from its bit layout, rounding by nearest-value search,
block scales by explicit block indices. None of it uses ml_dtypes or gpu_engine.fp8, which it checks."""
from __future__ import annotations

import numpy as np


def e4m3_value(byte: int) -> float:
    """The value of one e4m3fn byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf, S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8.0 * 2.0**-6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


TABLE = np.array([e4m3_value(b) for b in range(256)])
_POSITIVE = np.arange(127)  # bytes 0x00..0x7E: every finite non-negative value, increasing


def decode(bits: np.ndarray) -> np.ndarray:
    return TABLE[np.asarray(bits, dtype=np.uint8)]


def round_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float64 values -> nearest e4m3fn value (ties to the even mantissa), saturating at 448, as float64."""
    x = np.clip(np.asarray(x, dtype=np.float64), -448.0, 448.0)
    mags = np.abs(x).reshape(-1, 1)
    dist = np.abs(mags - TABLE[_POSITIVE][None, :])
    best = dist.min(axis=1, keepdims=True)
    ties = dist == best
    odd = (_POSITIVE & 1).astype(bool)[None, :]
    pick = np.where(ties & ~odd, _POSITIVE[None, :], 255).min(axis=1)  # an even-mantissa nearest value if any
    pick = np.where(pick == 255, np.where(ties, _POSITIVE[None, :], 255).min(axis=1), pick)
    return (np.sign(x).reshape(-1) * TABLE[pick]).reshape(x.shape)


def dequantize64(bits: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    rows = np.arange(bits.shape[0]) // block[0]
    cols = np.arange(bits.shape[1]) // block[1]
    return decode(bits) * np.asarray(scale_inv, dtype=np.float64)[rows[:, None], cols[None, :]]


def fake_quantize64(x: np.ndarray, group: int = 128) -> np.ndarray:
    """Per token, per `group` features: s = max(amax, 1e-10) / 448, x -> e4m3(x / s) * s (float64 arithmetic,
    except s and x / s, which the scheme computes in float32)."""
    x = np.asarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.float64)
    for start in range(0, x.shape[-1], group):
        part = x[..., start:start + group]
        amax = np.maximum(np.abs(part).max(axis=-1, keepdims=True), np.float32(1e-10))
        s = (amax / np.float32(448.0)).astype(np.float32)
        out[..., start:start + group] = round_to_e4m3((part / s).astype(np.float64)) * s.astype(np.float64)
    return out


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), as float32; written out here rather than imported."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)
