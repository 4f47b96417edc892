"""numpy mirror of kernels/moe.cu's fused small-batch decode kernels in their arithmetic order (moe_decode.py):
every fmaf of a lane's chain (its 16-byte pieces g = 0, 1, ... at element (32 g + lane) V, values in order), the
xor butterfly, the slots' weighted sum in slot order, the bf16 roundings where the kernels store. fmaf is taken in
float64 then rounded: exact for bf16 operands (their products fit float32), a double rounding in rare f32 cases;
expf / division are numpy's float32 ones (within an ulp of CUDA's). So a right kernel matches this bit for bit in
nearly every value and within an ulp elsewhere; moe_emulation.EmulatedContext runs these for the kernels' names.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpu_engine.cuda.bf16 import round_to_bf16

LANES = np.arange(32)
PER_PIECE = {"bf16": 8, "f32": 4}  # values a 16-byte load
f32 = np.float32


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(f32)


def _round(v: np.ndarray, dtype: str) -> np.ndarray:
    return round_to_bf16(np.asarray(v, f32)) if dtype == "bf16" else np.asarray(v, f32)


def lane_partials(w: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """[..., 32]: each lane's fmaf chain over w . x along the last axis (broadcast over the others)."""
    v, n = PER_PIECE[dtype], w.shape[-1]
    acc = np.zeros(np.broadcast_shapes(w.shape[:-1], x.shape[:-1]) + (32,), f32)
    for g in range(-(-n // (32 * v))):
        for i in range(v):
            idx = (32 * g + LANES) * v + i
            ok, at = idx < n, np.minimum(idx, n - 1)
            acc = np.where(ok, _fma(w[..., at], x[..., at], acc), acc)
    return acc


def warp_sum(v: np.ndarray) -> np.ndarray:
    """common.cuh's warp_sum over the last axis (32 lanes): lane 0's value."""
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., LANES ^ o]).astype(f32)
    return v[..., 0]


def router_logits(x: np.ndarray, router: np.ndarray, dtype: str) -> np.ndarray:
    """f32 [m, E + 1]: moe_decode_route's GEMVs (a warp a router row)."""
    return warp_sum(lane_partials(router[None, :, :], x[:, None, :], dtype))


def route_token(z: np.ndarray, experts: int, k: int) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(ids [k + 1], weights [k + 1], shared gate) of one token's logits z [>= E + 1] (decode_route_token)."""
    e = experts
    slots = -(-e // 32)
    grid = np.full((slots, 32), -np.inf, f32)  # [slot, lane]: expert lane + 32 slot
    grid.reshape(-1)[:e] = z[:e]
    valid = (LANES[None, :] + 32 * np.arange(slots)[:, None]) < e
    mx = grid.max()
    lane_sum = np.zeros(32, f32)
    for s in range(slots):
        lane_sum = np.where(valid[s], (lane_sum + np.exp((grid[s] - mx).astype(f32))).astype(f32), lane_sum)
    total = warp_sum(lane_sum)
    p = (np.exp((z[:e] - mx).astype(f32)) / total).astype(f32)
    chosen = np.argsort(-p, kind="stable")[:k]  # largest p first, ties toward the lower expert
    top_sum = f32(0)
    for c in chosen:
        top_sum = f32(top_sum + p[c])
    sg = f32(1) / (f32(1) + np.exp(-z[e]).astype(f32))
    ids = np.concatenate([chosen, [e]]).astype(np.int32)
    return ids, np.concatenate([(p[chosen] / top_sum).astype(f32), [sg]]).astype(f32), f32(sg)


def gate_up(x: np.ndarray, ids: np.ndarray, stacks: np.ndarray, dtype: str) -> np.ndarray:
    """act [m * (k + 1), I] of moe_decode_gate_up: entry (token, slot) = silu(gate) * up of the slot's expert."""
    m, slots = ids.shape
    inter = stacks.shape[1] // 2
    w = stacks[ids.reshape(-1)]  # [entries, 2I, H]
    xs = np.repeat(x, slots, axis=0)[:, None, :]
    g = warp_sum(lane_partials(w[:, :inter], xs, dtype))
    u = warp_sum(lane_partials(w[:, inter:], xs, dtype))
    g, u = _round(g, dtype), _round(u, dtype)
    return _round(g / (f32(1) + np.exp(-g).astype(f32)) * u, dtype)


def down(act: np.ndarray, ids: np.ndarray, weights: np.ndarray, stacks: np.ndarray, dtype: str) -> np.ndarray:
    """y [m, H] of moe_decode_down: per lane fmaf(w_j, part_j, acc) over slots j in order, then the butterfly."""
    m, slots = ids.shape
    h = stacks.shape[1]
    out = np.empty((m, h), f32)
    for t in range(m):
        acc = np.zeros((h, 32), f32)
        for j in range(slots):
            part = lane_partials(stacks[ids[t, j]], act[t * slots + j][None, :], dtype)
            acc = _fma(weights[t, j], part, acc)
        out[t] = _round(warp_sum(acc), dtype)
    return out


@dataclass(frozen=True)
class FusedResult:
    logits: np.ndarray  # f32 [m, E + 1]
    ids: np.ndarray  # i32 [m, k + 1]
    weights: np.ndarray  # f32 [m, k + 1]
    shared_gate: np.ndarray  # f32 [m]
    act: np.ndarray  # [m * (k + 1), I]
    y: np.ndarray  # [m, H]


def fused_layer(x: np.ndarray, router: np.ndarray, gate_up_stacks: np.ndarray, down_stacks: np.ndarray, k: int,
                dtype: str) -> FusedResult:
    """The three kernels on float32 arrays holding the device's values (bf16-representable for bf16): router
    [E + 1, H], stacks [E + 1, 2I, H] and [E + 1, H, I] with the shared expert last."""
    e = router.shape[0] - 1
    logits = router_logits(x, router, dtype)
    routed = [route_token(z, e, k) for z in logits]
    ids = np.stack([r[0] for r in routed])
    weights = np.stack([r[1] for r in routed])
    gate = np.array([r[2] for r in routed], f32)
    act = gate_up(x, ids, gate_up_stacks, dtype)
    return FusedResult(logits, ids, weights, gate, act, down(act, ids, weights, down_stacks, dtype))
