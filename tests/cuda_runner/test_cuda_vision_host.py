"""Host-side parts of the GPU vision tower, checked without a GPU: the per-frame geometry tables (applied here in
numpy exactly as the kernels apply them) against the numpy reference tower, the encoder-cache block pool, the
device-embeddings views, and bad inputs to the vision op launchers."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import rotary, vision_ops
from gpu_engine.cuda.arena import ALIGN
from gpu_engine.cuda.embeddings import BlockPool, DeviceEmbeddings
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.vision import frame_geometry
from gpu_engine.reference.vision_tower import VisionTower, vision_weight_shapes
from tests.cuda_runner.no_launch import arr, no_launch_ctx


def _tower(rng: np.random.Generator, hidden: int = 16, heads: int = 2, side: int = 5) -> VisionTower:
    cfg = SimpleNamespace(depth=1, hidden_size=hidden, num_heads=heads, intermediate_size=8, patch_size=2,
                          temporal_patch_size=1, spatial_merge_size=2, in_channels=1, out_hidden_size=8,
                          num_position_embeddings=side * side, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0)
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in vision_weight_shapes(cfg).items()}
    return VisionTower(cfg, weights)


@pytest.mark.parametrize("h,w", [(4, 6), (8, 2), (6, 10), (2, 2)])
def test_position_taps_reproduce_the_reference_resampling(h: int, w: int) -> None:
    rng = np.random.default_rng()
    tower = _tower(rng)
    geo = frame_geometry(h, w, 2, tower.dims.pos_grid_side)
    table = tower.pos_table.reshape(-1, tower.dims.hidden_size).astype(np.float64)
    ours = (geo.weights[:, :, None] * table[geo.taps]).sum(axis=1)  # what patch_pos computes per row
    ref = tower._position_embedding(h, w)
    assert geo.taps.min() >= 0 and geo.taps.max() < table.shape[0]
    np.testing.assert_allclose(geo.weights.sum(axis=1), 1.0, atol=1e-6)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-6


@pytest.mark.parametrize("h,w", [(4, 6), (6, 10)])
def test_rotary_positions_and_tables_reproduce_the_reference_angles(h: int, w: int) -> None:
    rng = np.random.default_rng()
    tower = _tower(rng, hidden=32, heads=2)
    hd = tower.dims.head_dim
    geo = frame_geometry(h, w, 2, tower.dims.pos_grid_side)
    inv, axis = rotary.vision_tables(hd, tower.dims.rope_theta)
    angle = geo.rowcol[axis].T.astype(np.float32) * inv  # what the rope kernel computes: [n, hd/2] fp32
    cos, sin = tower._rotary(h, w)
    np.testing.assert_allclose(np.cos(angle), cos[:, : hd // 2], atol=2e-6)
    np.testing.assert_allclose(np.sin(angle), sin[:, : hd // 2], atol=2e-6)
    np.testing.assert_array_equal(cos[:, : hd // 2], cos[:, hd // 2:])  # rotate-half pairs share angles


def test_pool_first_fit_reuse_and_coalescing() -> None:
    pool = BlockPool(base=1 << 20, capacity=4 * ALIGN)
    a, b, c = pool.alloc(10), pool.alloc(ALIGN + 1), pool.alloc(ALIGN)
    assert (a, b, c) == (1 << 20, (1 << 20) + ALIGN, (1 << 20) + 3 * ALIGN)
    assert pool.alloc(1) is None  # full
    pool.release(b, ALIGN + 1)
    assert pool.alloc(2 * ALIGN + 1) is None  # two free units, not three
    pool.release(a, 10)
    assert pool.free == [(0, 3 * ALIGN)]  # a and b merged
    pool.release(c, ALIGN)
    assert pool.free == [(0, 4 * ALIGN)] and pool.free_bytes == 4 * ALIGN


def test_pool_refuses_double_release_and_foreign_blocks() -> None:
    pool = BlockPool(base=0, capacity=2 * ALIGN)
    a = pool.alloc(ALIGN)
    pool.release(a, ALIGN)
    with pytest.raises(ValueError, match="twice"):
        pool.release(a, ALIGN)
    with pytest.raises(ValueError, match="outside"):
        pool.release(4 * ALIGN, ALIGN)


def test_device_embeddings_slices_share_the_block_and_free_it_last() -> None:
    pool = BlockPool(base=4096, capacity=8 * ALIGN)
    seen = []
    emb = DeviceEmbeddings.allocate(pool, (6, 8), "bf16", 2, lambda e: seen.append(e) or np.ones(e.shape, np.float32))
    assert emb is not None and emb.nbytes == 96 and len(emb) == 6
    part = emb[2:5]
    assert part.shape == (3, 8) and part.ptr == emb.ptr + 2 * 8 * 2 and emb[4:2].shape == (0, 8)
    assert np.asarray(part).shape == (3, 8) and seen[-1] is part
    with pytest.raises(ShapeError, match="contiguous row slices"):
        emb[::2]
    del emb
    gc.collect()
    assert pool.free_bytes < 8 * ALIGN  # the slice keeps the block
    del part
    seen.clear()  # the download log held the slice too
    gc.collect()
    assert pool.free_bytes == 8 * ALIGN
    assert DeviceEmbeddings.allocate(pool, (1000, 1000), "f32", 4, lambda e: None) is None  # too big: caller falls back


@pytest.fixture()
def ctx() -> SimpleNamespace:
    return no_launch_ctx()


def test_vision_launchers_refuse_bad_shapes(ctx) -> None:
    with pytest.raises(ShapeError, match="layernorm shapes"):
        vision_ops.layernorm(ctx, arr((4, 8)), arr((4, 8)), arr((8,)), arr((7,)), 1e-6)
    with pytest.raises(ShapeError, match="unknown activation"):
        vision_ops.bias_act(ctx, arr((4, 8)), arr((4, 8)), arr((8,)), "relu")
    with pytest.raises(ShapeError, match="bias_residual shapes"):
        vision_ops.bias_residual(ctx, arr((4, 8)), arr((4, 9)), arr((8,)))
    with pytest.raises(ShapeError, match="taps"):
        vision_ops.patch_pos(ctx, arr((4, 8)), arr((8,)), arr((25, 8)), arr((4, 4), "f32"), arr((4, 4), "f32"))
    with pytest.raises(ShapeError, match="seg_len"):
        vision_ops.vision_attention(ctx, arr((6, 48)), arr((6, 48 * 3)), 2, 24, 4, 0.2)
    with pytest.raises(ShapeError, match="max 256"):
        vision_ops.vision_attention(ctx, arr((4, 512)), arr((4, 1536)), 1, 512, 4, 0.2)


class _Launches:
    info = SimpleNamespace(sm_count=132)

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def launch(self, family, name, grid, block, *args, **kwargs):
        self.calls.append((family, name, grid, block))


@pytest.mark.parametrize("dtype,dim,ptr,kernel", [
    ("bf16", 1152, 1 << 20, "layernorm_rows_bf16"),  # the 9B tower: a warp a row, 8 rows a block
    ("f32", 1024, 1 << 20, "layernorm_rows_f32"),
    ("bf16", 2056, 1 << 20, "layernorm_bf16"),  # past 32 lanes x 8 vectors
    ("bf16", 1156, 1 << 20, "layernorm_bf16"),  # not whole 16-byte vectors
    ("bf16", 1152, (1 << 20) + 8, "layernorm_bf16"),  # unaligned rows
])
def test_layernorm_picks_the_warp_per_row_kernel_where_it_applies(dtype, dim, ptr, kernel) -> None:
    from gpu_engine.cuda.context import DArray

    ctx = SimpleNamespace(device=_Launches())
    x = DArray(ptr, (8580, dim), dtype)
    vision_ops.layernorm(ctx, x, x, arr((dim,), dtype), arr((dim,), dtype), 1e-6)
    ((family, name, grid, block),) = ctx.device.calls
    assert (family, name) == ("vision", kernel)
    assert (grid, block) == ((1073, 256) if "rows" in kernel else (8580, vision_ops._threads(dim)))
