"""Numpy twin of kernels/fp8.cu's stream-K streaming GEMM (fp8_streamk_d*), for CPU tests of its work split.

What is emulated as the kernel does it: the balanced unit ranges lo(w) = w * U / W and sk_owner, each warp's walk
over its units in order (tile-major (16-row tile, 128-group) units, the per-unit f32 sums scaled by sw * sx and
added to the f32 accumulator), the end-of-tile rule (a tile inside the warp's range stored, else its partial to
slot 0 for the warp's first tile and slot 1 for its last), the lane layout of the partials (lane * 4 + i: rows
gid / gid + 8, tokens 2 tig / 2 tig + 1), and sk_settle (the counter, the last arrival adding the partials in warp
order, the counter re-zeroed). Warps finish in any order (`order`), which is what the settling must not depend on.
A unit's products are summed in float64 and rounded to float32 once (the mma's accumulation order is not
modelled); the CUDA itself is checked on the GPU (tests/cuda_runner/check_fp8.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ROWS, GROUP, MAX_TOKENS = 16, 128, 8


def lo(w: int, units: int, warps: int) -> int:
    return w * units // warps


def owner(u: int, units: int, warps: int) -> int:
    """sk_owner: the largest w with lo(w) <= u."""
    return ((u + 1) * warps - 1) // units


def lane_of(row: int, tok: int) -> tuple[int, int]:
    """(lane, i) holding output (row within the tile, token) in the mma's C fragment, as sk_store reads it."""
    gid, i_hi = row % 8, row // 8
    return gid * 4 + tok // 2, 2 * i_hi + tok % 2


def fragment(block: np.ndarray) -> np.ndarray:
    """[16 rows, 8 tokens] -> [32 lanes, 4] in the kernel's register layout."""
    out = np.zeros((32, 4), np.float32)
    for row in range(ROWS):
        for tok in range(MAX_TOKENS):
            lane, i = lane_of(row, tok)
            out[lane, i] = block[row, tok]
    return out


def unfragment(frag: np.ndarray) -> np.ndarray:
    out = np.zeros((ROWS, MAX_TOKENS), np.float32)
    for row in range(ROWS):
        for tok in range(MAX_TOKENS):
            lane, i = lane_of(row, tok)
            out[row, tok] = frag[lane, i]
    return out


@dataclass
class StreamkRun:
    y: np.ndarray  # [m, n] float32 (NaN: never written)
    writes: np.ndarray  # [m, n] how many times each output was stored
    counters: np.ndarray  # [tiles] after the launch (the kernel leaves them zero)
    consumed: np.ndarray  # [units] how many warps consumed each unit
    arrivals: dict[int, int] = field(default_factory=dict)  # tile -> warps that arrived at its counter


def streamk(wq: np.ndarray, sw: np.ndarray, xq: np.ndarray, sx: np.ndarray, warps: int,
            order: np.ndarray | None = None) -> StreamkRun:
    """y = (xq * sx) @ (wq * sw)^T the way fp8_streamk splits it. wq [n, k] and xq [m, k] are the dequantised e4m3
    values (no scales), sw [ceil(n/128), ceil(k/128)] the weight's block scales, sx [ceil(k/128), m] the
    activations' group scales; `order`: the order in which the warps finish their walk and settle."""
    n, k = wq.shape
    m = xq.shape[0]
    assert m <= MAX_TOKENS and xq.shape[1] == k
    groups, tiles = -(-k // GROUP), -(-n // ROWS)
    units = tiles * groups
    assert 1 <= warps <= units, "the kernel counts on no empty warp"
    part = np.full((warps, 2, 32, 4), np.nan, np.float32)
    run = StreamkRun(np.full((m, n), np.nan, np.float32), np.zeros((m, n), int), np.zeros(tiles, np.int64),
                     np.zeros(units, int))
    shared = {w: _walk(w, wq, sw, xq, sx, warps, part, run) for w in range(warps)}
    for w in (range(warps) if order is None else order):
        for t in shared[w]:
            _settle(t, groups, units, warps, part, run)
    return run


def _unit(wq, sw, xq, sx, t: int, g: int) -> np.ndarray:
    """One unit's scaled f32 sums [16 rows, 8 tokens] (rows past n, tokens past m are zero)."""
    n, k = wq.shape
    m = xq.shape[0]
    rows, cols = slice(t * ROWS, min(n, (t + 1) * ROWS)), slice(g * GROUP, min(k, (g + 1) * GROUP))
    block = np.zeros((ROWS, MAX_TOKENS), np.float32)
    prod = wq[rows, cols].astype(np.float64) @ xq[:, cols].astype(np.float64).T
    scale = (sx[g, :m].astype(np.float32) * np.float32(sw[t * ROWS // 128, g])).astype(np.float32)
    block[: prod.shape[0], :m] = prod.astype(np.float32) * scale
    return block


def _walk(w: int, wq, sw, xq, sx, warps: int, part: np.ndarray, run: StreamkRun) -> list[int]:
    """One warp's main loop; returns the tiles it left a partial of (shared0, then shared1)."""
    groups = -(-wq.shape[1] // GROUP)
    units = -(-wq.shape[0] // ROWS) * groups
    u0, u1 = lo(w, units, warps), lo(w + 1, units, warps)
    t_first = u0 // groups
    ct, cg = t_first, u0 % groups
    acc = np.zeros((32, 4), np.float32)
    shared: list[int] = []
    for u in range(u0, u1):
        run.consumed[u] += 1
        assert (ct, cg) == divmod(u, groups)
        acc = (acc + fragment(_unit(wq, sw, xq, sx, ct, cg))).astype(np.float32)
        cg += 1
        if cg == groups or u + 1 == u1:
            ts = ct * groups
            if ts >= u0 and ts + groups <= u1:
                _store(run, acc, ct)
            else:
                slot = 0 if ct == t_first else 1
                part[w, slot] = acc
                shared.append(ct)
            acc = np.zeros((32, 4), np.float32)
            cg, ct = 0, ct + 1
    assert len(shared) <= 2 and (len(shared) < 2 or shared[0] == t_first)
    return shared


def _settle(t: int, groups: int, units: int, warps: int, part: np.ndarray, run: StreamkRun) -> None:
    wf, wl = owner(t * groups, units, warps), owner(t * groups + groups - 1, units, warps)
    seen = int(run.counters[t])
    run.counters[t] += 1
    run.arrivals[t] = run.arrivals.get(t, 0) + 1
    if seen != wl - wf:
        return
    v = np.zeros((32, 4), np.float32)
    for o in range(wf, wl + 1):
        slot = 0 if lo(o, units, warps) // groups == t else 1
        assert not np.isnan(part[o, slot]).any(), f"tile {t}: warp {o}'s partial (slot {slot}) was never written"
        v = (v + part[o, slot]).astype(np.float32)
    _store(run, v, t)
    run.counters[t] = 0


def _store(run: StreamkRun, frag: np.ndarray, t: int) -> None:
    m, n = run.y.shape
    block = unfragment(frag)
    rows = slice(t * ROWS, min(n, (t + 1) * ROWS))
    height = rows.stop - rows.start
    run.y[:, rows] = block[:height, :m].T
    run.writes[:, rows] += 1


def ring_schedule(u0: int, u1: int, groups: int, depth: int, burst: bool) -> list[tuple]:
    """fp8_streamk's prologue and unrolled loop over one warp's range, slots and cursors as the kernel keeps them:
    per consumed unit u, (u, (tile, group) of the weight slot read, group of the activation slot read). MODE
    SK_BURST (burst) refills slots [0, DEPTH/2) after slot DEPTH/2 - 1 is read and the rest after the last; the
    other modes refill each slot as soon as it is read. The activation ring has DEPTH / 2 slots (XD)."""
    assert depth % 2 == 0
    half = xdepth = depth // 2
    lt, lg = divmod(u0, groups)
    xg = lg
    wr: list = [None] * depth
    xr: list = [None] * xdepth

    def next_w() -> tuple[int, int]:
        nonlocal lt, lg
        unit = (lt, lg)
        lg += 1
        if lg == groups:
            lg, lt = 0, lt + 1
        return unit

    def next_x() -> int:
        nonlocal xg
        g = xg
        xg = 0 if xg + 1 == groups else xg + 1
        return g

    for d in range(depth):
        if u0 + d < u1:
            wr[d] = next_w()
    for d in range(xdepth):
        if u0 + d < u1:
            xr[d] = next_x()
    out = []
    for base in range(u0, u1, depth):
        for d in range(depth):
            u = base + d
            if u >= u1:
                continue
            out.append((u, wr[d], xr[d % xdepth]))
            wr[d] = xr[d % xdepth] = None  # read: a stale slot shows up as None
            if not burst and u + depth < u1:
                wr[d] = next_w()
            if u + xdepth < u1:
                xr[d % xdepth] = next_x()
            if burst and d in (half - 1, depth - 1):
                for s in range(d + 1 - half, d + 1):
                    if base + s + depth < u1:
                        wr[s] = next_w()
    return out
