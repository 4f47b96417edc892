"""The CUDA runner's FP8 (e4m3) KV cache: what a full-attention layer's cache holds when kv_cache_dtype="fp8_e4m3",
and how the attention launchers recognise it.

Layout (kernels/fp8_kv.cuh): k and v are u8 [blocks, block_size, kv_heads, head_dim] e4m3 bytes, k_scale and v_scale
f32 [blocks, block_size, kv_heads], one scale per (token, kv head) = amax / 448 — reference/fp8_kv.py's rule, so
the reference runner with the same setting is the oracle. Bytes per token and layer: 2 * kv_heads * (head_dim + 4),
reference/fp8_kv.kv_bytes_per_element's count, which the cache sizing reads.
"""
from __future__ import annotations

from ..config import TextConfig
from ..reference.fp8_kv import SCALE_BYTES, check_kv_cache_dtype
from .context import DArray, GpuContext
from .errors import ShapeError

FP8 = "fp8_e4m3"


def kv_operands(k_cache: DArray, v_cache: DArray, k_scale: DArray | None,
                v_scale: DArray | None) -> tuple[str, tuple[int, ...]]:
    """("_fp8", (k_scale.ptr, v_scale.ptr)) for an FP8 cache, ("", ()) for one in the compute dtype: the kernel
    name suffix and the extra launch arguments. Scales must come exactly with u8 caches, shaped as the caches' rows."""
    fp8 = k_cache.dtype == "u8"
    if fp8 != (v_cache.dtype == "u8") or fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ShapeError(f"an FP8 KV cache is u8 k_cache and v_cache with k_scale and v_scale (got {k_cache.dtype}, "
                         f"{v_cache.dtype}, scales given: {k_scale is not None}, {v_scale is not None})")
    if k_scale is None or v_scale is None:
        return "", ()
    for scale, cache, name in ((k_scale, k_cache, "k_scale"), (v_scale, v_cache, "v_scale")):
        if scale.dtype != "f32" or scale.shape != cache.shape[:-1]:
            raise ShapeError(f"{name} must be f32 {cache.shape[:-1]} (the cache's rows), got {scale.dtype} "
                             f"{scale.shape}")
    return "_fp8", (k_scale.ptr, v_scale.ptr)


def layer_kv_bytes_per_token(kv_cache_dtype: str, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V of one token in one full-attention layer: 2 * kv_heads * head_dim * itemsize, or with FP8
    2 * kv_heads * (head_dim + 4) (a byte per element and a float32 scale per kv head)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == FP8:
        return 2 * kv_heads * (head_dim + SCALE_BYTES)
    return 2 * kv_heads * head_dim * itemsize


def allocate_layer(ctx: GpuContext, kv_cache_dtype: str, shape: tuple[int, int, int, int], dtype: str,
                   layer: int) -> tuple[DArray, DArray, DArray | None, DArray | None]:
    """(k, v, k_scale, v_scale) of one full-attention layer; the scales are None unless the cache is FP8."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != FP8:
        return ctx.empty(shape, dtype, f"k{layer}"), ctx.empty(shape, dtype, f"v{layer}"), None, None
    rows = shape[:-1]
    return (ctx.empty(shape, "u8", f"k{layer}"), ctx.empty(shape, "u8", f"v{layer}"),
            ctx.empty(rows, "f32", f"k_scale{layer}"), ctx.empty(rows, "f32", f"v_scale{layer}"))



def kv_bytes_per_block(cfg: TextConfig, block_size: int, itemsize: int, kv_cache_dtype: str) -> int:
    """One KV block of the trunk's full-attention layers: runner_rules.kv_bytes_per_block's count at `itemsize`,
    or the FP8 layout's per-token bytes."""
    per_token = layer_kv_bytes_per_token(kv_cache_dtype, cfg.num_key_value_heads, cfg.head_dim, itemsize)
    return len(cfg.full_attention_layers) * block_size * per_token
