"""Launchers of kernels/spec_verify.cu (verify windows, verify.py): the batched state copy and the window forms of
the decode conv and delta-rule kernels; plus the device rows the copies move between (VerifyRows)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .context import DArray, GpuContext
from .errors import ShapeError
from .verify import Copy, Strategy, VerifyBook

if TYPE_CHECKING:  # text_model imports this module for the window kernels
    from .text_model import DeviceCache

i32, i64 = np.int32, np.int64
COPY_THREADS = 256


@dataclass
class VerifyRows:
    """One linear-attention layer's rollback storage: the slots' own arrays and the runner's verify rows (snapshot
    rows [rows, ...] for recompute, window rows [windows * window_tokens, ...] for the window strategy)."""

    conv: DArray  # [slots, K-1, conv_dim]
    state: DArray  # f32 [slots, Hv, dv, dk]
    extra_conv: DArray  # [rows, K-1, conv_dim]
    extra_state: DArray  # f32 [rows, Hv, dv, dk]


@dataclass(frozen=True)
class WindowArgs:
    conv: DArray  # window rows of the conv state
    state: DArray  # window rows of the recurrent state
    base: DArray  # i32 [seqs] first window row of each sequence, -1 = none


def window_rows(base: DArray | None, conv: DArray | None, state: DArray | None) -> WindowArgs | None:
    """A layer's window arguments when the step keeps window states (its tables carry `win`), else None."""
    if base is None or conv is None or state is None:
        return None
    return WindowArgs(conv, state, base)


def allocate_verify_rows(ctx: GpuContext, cache: DeviceCache, dtype: str, strategy: Strategy, wanted: int,
                         window_tokens: int, memory_fraction: float) -> tuple[VerifyBook, list[VerifyRows]]:
    """The rows verify windows roll back from, taken from the arena after the cache: `wanted` snapshot rows
    (recompute) or windows of `window_tokens` rows (window strategy, wired into the cache's DeltaNet layers for
    the window kernels), cut to what fits in `memory_fraction` of the free arena."""
    per_row = window_tokens if strategy == "window" else 1
    row_bytes = sum(d.conv.nbytes // d.conv.shape[0] + d.state.nbytes // d.state.shape[0]
                    for d in cache.deltanet.values())
    if not cache.deltanet or row_bytes == 0 or per_row == 0:
        return VerifyBook(strategy, 0, window_tokens), []
    rows = max(0, min(wanted, int(ctx.arena.free_bytes * memory_fraction) // (row_bytes * per_row)))
    layers = []
    for i, d in cache.deltanet.items():
        conv = ctx.empty((max(rows * per_row, 1), *d.conv.shape[1:]), dtype, f"verify-conv{i}")
        state = ctx.empty((max(rows * per_row, 1), *d.state.shape[1:]), "f32", f"verify-state{i}")
        layers.append(VerifyRows(d.conv, d.state, conv, state))
        if strategy == "window":
            d.window_conv, d.window_state = conv, state
    return VerifyBook(strategy, rows, window_tokens), layers


def copy_table(copies: Sequence[Copy], layers: Sequence[VerifyRows]) -> np.ndarray:
    """int64 [count, 3] (dst, src, bytes): every copy for every layer, conv and recurrent state."""
    rows = []
    for c in copies:
        for layer in layers:
            for slots, extra in ((layer.conv, layer.extra_conv), (layer.state, layer.extra_state)):
                size = slots.nbytes // slots.shape[0]
                slot_ptr, row_ptr = slots.ptr + c.slot * size, extra.ptr + c.row * size
                dst, src = (row_ptr, slot_ptr) if c.kind == "slot_to_snap" else (slot_ptr, row_ptr)
                rows.append((dst, src, size))
    return np.asarray(rows, np.int64).reshape(-1, 3)


def copy_segments(ctx: GpuContext, table: np.ndarray) -> None:
    """Run a copy_table in one launch (its table is uploaded into this step's arena space first)."""
    if table.shape[0] == 0:
        return
    if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] > 65535:
        raise ShapeError(f"copy table must be [1..65535, 3], got {table.shape}")
    # int64 rows travel as int32 pairs (the arena's arrays have no int64 dtype; its blocks are 8-byte aligned)
    dev = ctx.to_device(np.ascontiguousarray(table, np.int64).view(np.int32), "i32", "verify-copies")
    per = int(table[:, 2].max())
    blocks = max(1, min(64, -(-per // (16 * COPY_THREADS))))
    ctx.device.launch("spec_verify", "copy_segments", (blocks, table.shape[0]), COPY_THREADS, dev.ptr,
                      i32(table.shape[0]))


def conv1d_silu_window(ctx: GpuContext, out: DArray, out_stride: int, x: DArray, x_stride: int, w: DArray,
                       conv_state: DArray, window: DArray, win_base: DArray, cu_seqlens: DArray,
                       state_slots: DArray, fresh: DArray) -> None:
    """ops.conv1d_silu's decode form that also writes the conv state after each window token but the last to
    window rows win_base[s] + i (window [rows, K-1, conv_dim]; win_base -1 = not a window)."""
    conv_dim, K = w.shape
    if K > 8 or conv_state.shape[1:] != (K - 1, conv_dim) or window.shape[1:] != (K - 1, conv_dim):
        raise ShapeError(f"conv1d window: K={K} (max 8), conv_state {conv_state.shape}, window {window.shape}")
    t = out.dtype
    ctx.device.launch("spec_verify", f"conv1d_silu_window_{t}", ((conv_dim + 127) // 128, state_slots.size), 128,
                      out.ptr, i64(out_stride), x.ptr, i64(x_stride), w.ptr, conv_state.ptr, window.ptr, win_base.ptr,
                      cu_seqlens.ptr, state_slots.ptr, fresh.ptr, i32(conv_dim), i32(K))


def gated_delta_rule_window(ctx: GpuContext, out: DArray, q: DArray, k: DArray, v: DArray, qkv_stride: int,
                            a: DArray, b: DArray, ab_stride: int, A_log: DArray, dt_bias: DArray, state: DArray,
                            cu_seqlens: DArray, state_slots: DArray, fresh: DArray, k_heads: int, v_heads: int,
                            dk: int, dv: int, *, window: DArray, win_base: DArray) -> None:
    """ops.gated_delta_rule's one-pass form (same arguments) that also writes the state after each window token
    but the last to window rows win_base[s] + i (window f32 [rows, v_heads, dv, dk])."""
    if dk > 256 or v_heads % k_heads or state.shape[1:] != (v_heads, dv, dk) or window.shape[1:] != state.shape[1:]:
        raise ShapeError(f"gated_delta_rule window: dk={dk}, heads {k_heads}/{v_heads}, state {state.shape}, "
                         f"window {window.shape}")
    if state.dtype != "f32" or window.dtype != "f32":
        raise ShapeError("gated_delta_rule window: state and window rows are f32")
    t = out.dtype
    grid = ((dv + 7) // 8, v_heads, state_slots.size)
    ctx.device.launch("spec_verify", f"gated_delta_rule_window_{t}", grid, 256, out.ptr, q.ptr, k.ptr, v.ptr,
                      i64(qkv_stride), a.ptr, b.ptr, i64(ab_stride), A_log.ptr, dt_bias.ptr, state.ptr, window.ptr,
                      win_base.ptr, cu_seqlens.ptr, state_slots.ptr, fresh.ptr, i32(k_heads), i32(v_heads), i32(dk),
                      i32(dv))
