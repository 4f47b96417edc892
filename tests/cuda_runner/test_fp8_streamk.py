"""The stream-K FP8 streaming GEMM on the CPU: its work split (fp8_streamk_emulation, the kernel's twin) against
float64, whatever order the warps finish in, and its launcher (grid, warps, what it refuses)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import fp8_ops
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.errors import ShapeError
from tests.cuda_runner import fp8_streamk_emulation as emu

H200_SMS = 132
SHAPES_27B = {"gate_up": (34816, 5120), "down": (5120, 17408), "in_proj": (16384, 5120), "qkv": (14336, 5120),
              "o_proj": (5120, 6144)}


def operands(rng: np.random.Generator, m: int, n: int, k: int):
    """e4m3-valued-ish integers (exactly representable sums) and random positive block / group scales."""
    wq = rng.integers(-16, 17, (n, k)).astype(np.float32)
    xq = rng.integers(-16, 17, (m, k)).astype(np.float32)
    sw = rng.uniform(0.5, 2.0, (-(-n // 128), -(-k // 128))).astype(np.float32)
    sx = rng.uniform(0.5, 2.0, (-(-k // 128), m)).astype(np.float32)
    return wq, sw, xq, sx


def truth(wq, sw, xq, sx) -> np.ndarray:
    n, k = wq.shape
    w = wq.astype(np.float64) * np.repeat(np.repeat(sw, 128, 0), 128, 1)[:n, :k]
    x = xq.astype(np.float64) * np.repeat(sx.T, 128, 1)[:, :k]
    return x @ w.T


@pytest.mark.parametrize("m, n, k, warps", [(1, 256, 64, 16), (5, 200, 336, 7), (8, 1024, 1280, 24),
                                            (3, 48, 1152, 27), (1, 16, 128, 1), (2, 80, 640, 25), (7, 130, 2048, 9)])
def test_every_output_once_and_right_whatever_the_finishing_order(m, n, k, warps):
    rng = np.random.default_rng(n * k + m)
    ops = operands(rng, m, n, k)
    first = emu.streamk(*ops, warps)
    assert np.all(first.consumed == 1)  # each (tile, group) unit read by exactly one warp
    assert np.all(first.writes == 1)  # each output stored once: by its warp or by its tile's last arrival
    assert np.all(first.counters == 0)  # left zero for the next launch (graph replay)
    ref = truth(*ops)
    assert np.max(np.abs(first.y - ref)) <= 1e-5 * np.max(np.abs(ref))
    for _ in range(3):
        again = emu.streamk(*ops, warps, order=rng.permutation(warps))
        assert np.array_equal(again.y, first.y)  # the partials are added in warp order: the same bits


def test_shared_tiles_get_an_arrival_from_each_of_their_warps():
    groups, tiles, warps = 5, 12, 17  # ranges of 3-4 units: most tiles shared by two or three warps
    units = groups * tiles
    run = emu.streamk(*operands(np.random.default_rng(1), 2, tiles * 16, groups * 128), warps)
    for t in range(tiles):
        wf, wl = emu.owner(t * groups, units, warps), emu.owner(t * groups + groups - 1, units, warps)
        assert run.arrivals.get(t, 0) == (wl - wf + 1 if wl > wf else 0)


@pytest.mark.parametrize("units, warps", [(10, 10), (87040, 2112), (15360, 2112), (7, 3), (1000, 999)])
def test_owner_is_the_warp_whose_range_holds_the_unit(units, warps):
    us = np.unique(np.linspace(0, units - 1, 500).astype(int))
    for u in us:
        w = emu.owner(int(u), units, warps)
        assert emu.lo(w, units, warps) <= u < emu.lo(w + 1, units, warps)


@pytest.mark.parametrize("name", sorted(SHAPES_27B))
@pytest.mark.parametrize("variant", sorted(fp8_ops.STREAMK_BLOCKS_PER_SM))
def test_27b_shapes_fill_every_resident_warp_with_a_balanced_share(name, variant):
    n, k = SHAPES_27B[name]
    warps = fp8_ops.streamk_warps(n, k, H200_SMS, variant)
    assert warps == H200_SMS * fp8_ops.STREAMK_BLOCKS_PER_SM[variant] * fp8_ops.STREAMK_WARPS
    units = -(-n // 16) * fp8_ops.groups(k)
    shares = {emu.lo(w + 1, units, warps) - emu.lo(w, units, warps) for w in range(warps)}
    assert max(shares) - min(shares) <= 1 and min(shares) >= fp8_ops.STREAMK_MIN_UNITS


@pytest.mark.parametrize("n, k", [(16, 32), (17, 144), (200, 336), (256, 64)])
def test_small_shapes_launch_fewer_warps_than_units(n, k):
    warps = fp8_ops.streamk_warps(n, k, H200_SMS, "d4")
    assert 1 <= warps <= max(1, -(-n // 16) * fp8_ops.groups(k) // fp8_ops.STREAMK_MIN_UNITS)


class Launches:
    """empty() hands out distinct pointers; launches are recorded."""

    def __init__(self) -> None:
        self._next = 1 << 20
        self.calls: list[tuple] = []
        self.device = SimpleNamespace(launch=lambda *a: self.calls.append(a), info=SimpleNamespace(sm_count=132),
                                      upload=lambda ptr, host: None)

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        ptr, self._next = self._next, self._next + (1 << 24)
        return DArray(ptr, tuple(shape), dtype)


def weight(ctx: Launches, n: int, k: int, counters: bool = True) -> fp8_ops.Fp8Weight:
    grid = (-(-n // 128), -(-fp8_ops.groups(k) // 4) * 4)
    return fp8_ops.Fp8Weight(ctx.empty((n, k), "u8", "w"), ctx.empty(grid, "f32", "s"), grid[1], 1,
                             fp8_ops.tile_counters(ctx, "w", n) if counters else None)


@pytest.mark.parametrize("m", [1, 8])
def test_gemv_path_runs_the_tile_grid_kernel_by_default(m):
    ctx = Launches()
    w = weight(ctx, 5120, 17408)
    xa = fp8_ops.act_buffers(ctx, m, 17408)
    took = fp8_ops.fp8_matmul(ctx, ctx.empty((m, 5120), "bf16", "y"), xa, w)
    assert took == "gemv_stream"
    (module, kernel, grid, block, *args), = ctx.calls
    assert (kernel, grid, block) == ("fp8_gemv_bf16_t1", 320, 256) and int(args[-3]) == m


def test_more_tokens_or_no_counters_take_the_tile_grid_kernel():
    ctx = Launches()
    for m, counters, kernel in ((9, True, "fp8_gemv_bf16_t2"), (1, False, "fp8_gemv_bf16_t1")):
        ctx.calls.clear()
        w = weight(ctx, 256, 512, counters)
        took = fp8_ops.fp8_matmul(ctx, ctx.empty((m, 256), "bf16", "y"),
                                  fp8_ops.act_buffers(ctx, m, 512), w, path="gemv")
        assert took == "gemv_stream" and [c[1] for c in ctx.calls] == [kernel]


def test_streamk_refuses_more_than_one_tile_of_tokens_and_unknown_depths():
    ctx = Launches()
    w = weight(ctx, 256, 512)
    y = ctx.empty((9, 256), "bf16", "y")
    with pytest.raises(ShapeError):
        fp8_ops.fp8_gemv(ctx, y, fp8_ops.act_buffers(ctx, 9, 512), w, variant="streamk_d4")
    with pytest.raises(ShapeError):
        fp8_ops.fp8_gemv(ctx, y, fp8_ops.act_buffers(ctx, 1, 512), w, variant="streamk_d3")
    with pytest.raises(ShapeError):
        fp8_ops.fp8_gemv(ctx, y, fp8_ops.act_buffers(ctx, 1, 512), weight(ctx, 256, 512, False),
                         variant="streamk_d4")


@pytest.mark.parametrize("depth, burst", [(2, False), (4, False), (4, True), (6, True), (2, True), (6, False)])
@pytest.mark.parametrize("u0, u1, groups", [(0, 1, 40), (3, 5, 4), (37, 79, 40), (130, 151, 136), (5, 12, 3),
                                            (0, 48, 48), (11, 18, 48)])
def test_every_unit_is_consumed_from_the_slot_that_holds_it(depth, burst, u0, u1, groups):
    steps = emu.ring_schedule(u0, u1, groups, depth, burst)
    assert [s[0] for s in steps] == list(range(u0, u1))
    for u, w_unit, x_group in steps:
        assert w_unit == divmod(u, groups) and x_group == u % groups
