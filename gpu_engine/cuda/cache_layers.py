"""The device cache's per-layer arrays: paged K/V blocks of the full-attention layers (bf16 / f32, or e4m3 with
scales: kv_fp8.py) and the conv + recurrent state slots of the DeltaNet layers, zeroed; a slot's states copied."""
from __future__ import annotations

from ..config import TextConfig
from .context import GpuContext
from .kv_fp8 import allocate_layer
from .text_model import AttentionCache, DeltaNetCache, DeviceCache


def allocate_layers(ctx: GpuContext, cfg: TextConfig, cache: DeviceCache, blocks: int, slots: int, dtype: str,
                    kv_cache_dtype: str) -> None:
    """Fill `cache` (empty, its block size set) with `blocks` KV blocks per attention layer and `slots` state
    slots per DeltaNet layer, all zeroed."""
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            shape = (blocks, cache.block_size, cfg.num_key_value_heads, cfg.head_dim)
            cache.attention[i] = AttentionCache(*allocate_layer(ctx, kv_cache_dtype, shape, dtype, i))
        else:
            conv = ctx.empty((slots, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), dtype, f"conv{i}")
            state = ctx.empty((slots, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                               cfg.linear_key_head_dim), "f32", f"state{i}")
            cache.deltanet[i] = DeltaNetCache(conv, state)
    arrays = [arr for a in cache.attention.values() for arr in (a.k, a.v, a.k_scale, a.v_scale) if arr is not None]
    arrays += [arr for d in cache.deltanet.values() for arr in (d.conv, d.state)]
    for arr in arrays:  # deterministic contents (fresh sequences never read them anyway)
        ctx.device.memset(arr.ptr, 0, arr.nbytes)


def copy_slot_states(ctx: GpuContext, cache: DeviceCache, src: int, dst: int) -> None:
    """State slot `dst` of every DeltaNet layer becomes a copy of `src` (conv and recurrent state), enqueued on the
    stream: every reader of the states is a kernel on that stream, so no sync (a prefix snapshot taken while the
    next step is being built must not drain the GPU)."""
    for c in cache.deltanet.values():
        for arr in (c.conv, c.state):
            row = arr.nbytes // arr.shape[0]
            ctx.device.copy(arr.ptr + dst * row, arr.ptr + src * row, row)
