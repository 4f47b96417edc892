"""FP8 (e4m3) KV cache of the reference runner: keys and values quantised when written, dequantised when read.

Granularity: one float32 scale per (token, kv head), s = amax(|x[token, head, :]|) / 448, stored bits =
e4m3(x / s) (round to nearest even, saturating), read back as e4m3 * s. A token whose amax is 0 gets s = 1 (its bits
are all zero, so it reads back as exact zeros). The scale is fixed when the token is written, which is what a paged
attention kernel can do cheaply: the writer of a token already holds its head_dim values, so the scale costs one
reduction and is stored beside the token; no block has to be requantised when later tokens arrive, and a prefix
block shared between sequences never changes. bench/fp8_kv_accuracy.py measured this against per-block and
per-tensor scales (bench/results/fp8_kv_accuracy.json).

`Fp8KvArray` stands in for the float32 cache array [num_blocks, block_size, kv_heads, head_dim] of one layer: the
attention code indexes it exactly as it indexes the float32 array (`cache[blocks, offsets] = k`, `cache[blocks,
offsets]`), so the same attention code is the oracle for both cache dtypes.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..fp8 import E4M3_MAX, e4m3_to_float32, float32_to_e4m3

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # "auto": the runner's compute dtype (float32 here)
SCALE_BYTES = 4  # one float32 scale per (token, kv head)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def quantize_kv(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., head_dim] float32 -> (e4m3 bits uint8 [..., head_dim], scale float32 [...]): one scale per row."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    return float32_to_e4m3(x / scale[..., None]), scale


def dequantize_kv(bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 values a kernel reads: e4m3 value x its row's scale."""
    return e4m3_to_float32(bits) * np.asarray(scale, dtype=np.float32)[..., None]


class Fp8KvArray:
    """One layer's K or V cache in e4m3 with per-(token, head) scales, indexed like the float32 array it replaces."""

    def __init__(self, shape: tuple[int, int, int, int]) -> None:
        self.shape = shape
        self.bits = np.zeros(shape, np.uint8)
        self.scale = np.ones(shape[:-1], np.float32)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes + self.scale.nbytes)

    def __setitem__(self, index: Any, values: np.ndarray) -> None:
        bits, scale = quantize_kv(np.broadcast_to(np.asarray(values, np.float32), self.bits[index].shape))
        self.bits[index] = bits
        self.scale[index] = scale

    def __getitem__(self, index: Any) -> np.ndarray:
        return dequantize_kv(self.bits[index], self.scale[index])


KvArray = np.ndarray | Fp8KvArray  # what the attention code writes keys / values into and reads them from


def kv_array(kv_cache_dtype: str, shape: tuple[int, int, int, int]) -> KvArray:
    """A zeroed cache array of one layer's K or V for the chosen cache dtype."""
    check_kv_cache_dtype(kv_cache_dtype)
    return Fp8KvArray(shape) if kv_cache_dtype == "fp8_e4m3" else np.zeros(shape, np.float32)


def kv_bytes_per_element(kv_cache_dtype: str, head_dim: int, compute_itemsize: int) -> float:
    """Bytes one cached K (or V) element costs, the scale shared over its head_dim included."""
    check_kv_cache_dtype(kv_cache_dtype)
    return 1 + SCALE_BYTES / head_dim if kv_cache_dtype == "fp8_e4m3" else compute_itemsize
