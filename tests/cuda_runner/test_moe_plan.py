"""The CUDA MoE layer's host side on the CPU: the tile bound every grid is sized by, the routing plan's tables (numpy
mirror of kernels/moe.cu's moe_plan), the grouped GEMMs walked tile by tile and combined equal reference/moe.py's
MoeMlp, the tile shapes agree with the kernel file, and MoeLayer.forward enqueues the same launches with the same
grids whatever the routing (what lets a decode step sit in a CUDA graph), inside the memory plan's scratch estimate.
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.config import MoeConfig
from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.context import ITEMSIZE, DArray
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.linear import DenseLinear, SwigluMlp
from gpu_engine.cuda.moe import MoeLayer
from gpu_engine.cuda.moe_plan import (
    TILES,
    TRIAL_TILES,
    choose_tile,
    emulate_grouped_gemm,
    host_plan,
    max_tiles,
    scratch_bytes_per_token,
)
from gpu_engine.reference.moe import MoeMlp

KERNELS = Path(__file__).resolve().parents[2] / "gpu_engine" / "cuda" / "kernels" / "moe.cu"


def _ids(rng: np.random.Generator, n: int, k: int, e: int) -> np.ndarray:
    """Top-k ids as a router makes them: k distinct experts per token."""
    return np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)


def _tiles_needed(ids: np.ndarray, e: int, tile_m: int) -> int:
    counts = np.bincount(ids.reshape(-1), minlength=e)
    return int(np.sum(-(-counts // tile_m)))


@pytest.mark.parametrize("tile_m", [32, 128])
def test_tile_bound_covers_every_routing_and_is_reached(tile_m: int) -> None:
    rng = np.random.default_rng()
    for n, k, e in ((1, 8, 256), (32, 8, 256), (300, 2, 6), (8192, 8, 256), (5, 3, 5)):
        bound = max_tiles(n * k, e, tile_m)
        for _ in range(20):
            assert _tiles_needed(_ids(rng, n, k, e), e, tile_m) <= bound
    # the worst case: every expert one row past a whole number of tiles
    e, q = 8, 3
    counts = np.full(e, q * tile_m + 1)
    ids = np.repeat(np.arange(e), counts)[:, None]
    assert _tiles_needed(ids, e, tile_m) == e * (q + 1) == max_tiles(int(counts.sum()), e, tile_m)
    assert max_tiles(1, 256, tile_m) == 1


def test_plan_tables() -> None:
    rng = np.random.default_rng()
    n, k, e, tile_m = 97, 3, 7, 32
    ids = _ids(rng, n, k, e)
    p = host_plan(ids, e, tile_m)
    flat = ids.reshape(-1)
    np.testing.assert_array_equal(p.counts, np.bincount(flat, minlength=e))
    np.testing.assert_array_equal(p.offsets, np.concatenate([[0], np.cumsum(p.counts)]))
    assert sorted(p.entry_row.tolist()) == list(range(n * k))  # a permutation
    np.testing.assert_array_equal(p.sorted_token[p.entry_row], np.arange(n * k) // k)
    owner = np.full(n * k, -1)
    for expert, first, rows in p.tiles:
        if rows:
            assert 0 < rows <= tile_m and np.all(owner[first: first + rows] == -1)
            owner[first: first + rows] = expert
    np.testing.assert_array_equal(owner[p.entry_row], flat)  # each entry's row lies in a tile of its expert
    used = p.tiles[:, 2] > 0
    assert used.sum() == _tiles_needed(ids, e, tile_m) and not used[used.sum():].any()  # used tiles first


def _moe_weights(rng: np.random.Generator, e: int, h: int, inter: int, shared: int) -> dict[str, np.ndarray]:
    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    return {"gate.weight": w(e, h), "experts.gate_up_proj": w(e, 2 * inter, h), "experts.down_proj": w(e, h, inter),
            "shared_expert.gate_proj.weight": w(shared, h), "shared_expert.up_proj.weight": w(shared, h),
            "shared_expert.down_proj.weight": w(h, shared), "shared_expert_gate.weight": w(1, h)}


@pytest.mark.parametrize("n,e,k,tile", [(1, 8, 2, "decode"), (40, 6, 2, "decode"), (300, 5, 3, "prefill")])
def test_tile_walk_and_combine_equal_the_reference_mlp(n: int, e: int, k: int, tile: str) -> None:
    rng = np.random.default_rng()
    h, inter, shared = 24, 10, 14
    w = _moe_weights(rng, e, h, inter, shared)
    ref = MoeMlp(MoeConfig(e, k, inter, shared), w)
    x = rng.standard_normal((n, h)).astype(np.float32)
    ids, weights = ref.route(x)
    p = host_plan(ids, e, TILES[tile].bm)
    act = emulate_grouped_gemm(x, p.sorted_token, w["experts.gate_up_proj"], p.tiles, n * k, swiglu=True)
    out = emulate_grouped_gemm(act, None, w["experts.down_proj"], p.tiles, n * k, swiglu=False)
    assert np.all(np.isfinite(out))  # every sorted row computed
    routed = np.einsum("nk,nkh->nh", weights.astype(np.float64), out[p.entry_row.reshape(n, k)])
    g, u = x @ w["shared_expert.gate_proj.weight"].T, x @ w["shared_expert.up_proj.weight"].T
    shared_y = (g / (1 + np.exp(-g)) * u) @ w["shared_expert.down_proj.weight"].T
    gate = 1 / (1 + np.exp(-(x @ w["shared_expert_gate.weight"].T)))
    np.testing.assert_allclose(routed + gate * shared_y, ref(x), rtol=1e-4, atol=1e-5)


def test_tile_choice_and_decode_reads_each_expert_once_at_35b_a3b() -> None:
    rng = np.random.default_rng()
    e, k = 256, 8
    assert choose_tile(1, k, e).name == "decode" and choose_tile(32, k, e).name == "decode"
    assert choose_tile(8192, k, e).name == "prefill"
    for n in (1, 32):
        p = host_plan(_ids(rng, n, k, e), e, choose_tile(n, k, e).bm)
        experts = p.tiles[p.tiles[:, 2] > 0, 0]
        assert len(experts) == len(set(experts.tolist())) == np.count_nonzero(p.counts)  # one tile per expert


def test_tile_shapes_match_the_kernel_file_and_fit_shared_memory() -> None:
    source = KERNELS.read_text()
    entries = re.findall(r"MOE_GEMM_ENTRY\(moe_gemm_(\w+?)_(swiglu|plain)_bf16, (\d+), (\d+), (\d+), (\d+), (\d+), "
                         r"(\d+), (true|false)\)", source)
    tiles = {**TILES, **TRIAL_TILES}  # the trial shapes' kernels are compiled and timed too
    assert {(name, kind) for name, kind, *_ in entries} == {(t, kind) for t in tiles for kind in ("swiglu", "plain")}
    for name, kind, bm, bn, bk, stages, wms, wns, sw in entries:
        t = tiles[name]
        assert (t.bm, t.bn, t.bk, t.stages, t.warps) == (int(bm), int(bn), int(bk), int(stages), int(wms) * int(wns))
        assert (sw == "true") == (kind == "swiglu")
        assert t.shared_bytes() <= 227 * 1024  # sm_90's per-block limit with the opt-in


class _Recorder:
    """A GpuContext stand-in that records launches and cuBLASLt calls (nothing runs)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.arena = Arena(base=1 << 30, capacity=1 << 34)
        self.device = SimpleNamespace(info=SimpleNamespace(sm_count=132), launch=self._launch)
        self.blas = SimpleNamespace(linear=self._linear)

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        arr = DArray(0, tuple(int(s) for s in shape), dtype)
        return DArray(self.arena.alloc(arr.nbytes, name), arr.shape, dtype)

    def _launch(self, family: str, name: str, grid, block, *args, shmem: int = 0) -> None:
        self.calls.append(("launch", family, name, grid, block, shmem, args))

    def _linear(self, y, x, w, m, n, k, **kw) -> None:
        self.calls.append(("gemm", m, n, k, kw.get("dtype"), kw.get("y_dtype"), kw.get("y_ld")))


def _layer(ctx: _Recorder, cfg: MoeConfig, h: int, dtype: str, stacked: bool = False) -> MoeLayer:
    """stacked: the shared expert as expert E of the stacks (its width must be the experts')."""
    e, inter, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    stacks = e + stacked
    shared = None if stacked else SwigluMlp(DenseLinear(ctx.empty((2 * s, h), dtype, "sgu")),
                                            DenseLinear(ctx.empty((h, s), dtype, "sd")))
    return MoeLayer(e, cfg.num_experts_per_tok, ctx.empty((e + 1, h), dtype, "router"),
                    ctx.empty((stacks, 2 * inter, h), dtype, "gu"), ctx.empty((stacks, h, inter), dtype, "down"),
                    shared)


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("m", [1, 32, 8192])
def test_forward_launches_depend_on_the_token_count_only_and_fit_the_scratch_estimate(m: int, stacked: bool) -> None:
    cfg, h, dtype = MoeConfig(256, 8, 512, 512), 2048, "bf16"
    ctx = _Recorder()
    layer = _layer(ctx, cfg, h, dtype, stacked)
    x, y = ctx.empty((m, h), dtype, "x"), ctx.empty((m, h), dtype, "y")
    before = ctx.arena.used
    layer.forward(ctx, y, x, m)
    scratch = ctx.arena.used - before
    names = [c[2] if c[0] == "launch" else "gemm" for c in ctx.calls]
    slots, stacks = 8 + stacked, 256 + stacked
    tile = choose_tile(m, slots, stacks)
    shared = [] if stacked else ["gemm", "silu_mul_bf16", "gemm"]
    plan_name = "moe_plan_v2" if tile.name == "decode" else "moe_plan"  # moe.plan_kernel: v2's scan at decode
    assert names == ["gemm", "moe_route", plan_name, f"moe_gemm_{tile.name}_swiglu_bf16",
                     f"moe_gemm_{tile.name}_plain_bf16", *shared, "moe_combine_bf16"]
    if plan_name == "moe_plan_v2":  # its shared_last flag: set exactly when the shared expert rides in the stacks
        assert int(ctx.calls[2][6][6]) == int(stacked)
    bound = max_tiles(m * slots, stacks, tile.bm)
    gate_up, down = ctx.calls[3], ctx.calls[4]
    assert gate_up[3] == (512 // (tile.bn // 2), bound) and down[3] == (-(-h // tile.bn), bound)
    assert ctx.calls[0][1:] == (m, 257, h, dtype, "f32", 264)  # router + shared gate: one GEMM, f32 logits
    text = SimpleNamespace(moe=cfg, hidden_size=h)
    assert scratch <= m * scratch_bytes_per_token(text, ITEMSIZE[dtype]) + 64 * 256  # + alignment of 16 buffers


def test_odd_shapes_take_the_plain_kernel_and_bad_layers_are_refused() -> None:
    ctx = _Recorder()
    cfg = MoeConfig(6, 2, 21, 37)
    layer = _layer(ctx, cfg, 64, "bf16")
    x, y = ctx.empty((5, 64), "bf16", "x"), ctx.empty((5, 64), "bf16", "y")
    layer.forward(ctx, y, x, 5)
    gemms = [c[2] for c in ctx.calls if c[0] == "launch" and "moe_gemm" in c[2]]
    assert gemms == ["moe_gemm_decode_swiglu_bf16", "moe_gemm_simple_plain_bf16"]  # K = 21: no 16-byte rows
    f32 = _layer(ctx, cfg, 64, "f32")
    ctx.calls.clear()
    f32.forward(ctx, ctx.empty((5, 64), "f32", "y"), ctx.empty((5, 64), "f32", "x"), 5)
    assert [c[2] for c in ctx.calls if c[0] == "launch" and "moe_gemm" in c[2]] == [
        "moe_gemm_simple_swiglu_f32", "moe_gemm_simple_plain_f32"]
    with pytest.raises(ShapeError, match="disagree"):
        MoeLayer(6, 2, layer.router, layer.gate_up, ctx.empty((6, 64, 20), "bf16", "d"), layer.shared)
    with pytest.raises(ShapeError, match="disagree"):  # a stack without the shared expert's slot
        MoeLayer(6, 2, layer.router, layer.gate_up, layer.down, None)
    with pytest.raises(ShapeError, match="top-k"):
        MoeLayer(6, 7, layer.router, layer.gate_up, layer.down, layer.shared)
    assert scratch_bytes_per_token(SimpleNamespace(moe=None, hidden_size=64), 2) == 0
