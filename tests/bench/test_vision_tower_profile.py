"""bench/vision_tower_profile.py on the CPU: the grids it profiles are the processor's, its photo cap is the product's
(and vision/raster's arithmetic), the run-mix sums, and its per-op CUDA-event wiring on the emulated tower (every
launch the tower makes is counted under the right label, with the right FLOPs)."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import vision_tower_profile as vtp

from gpu_engine.cuda import ops, vision_flash, vision_ops
from gpu_engine.cuda.vision import GpuVisionTower
from tests.cuda_runner.check_vision import CONFIGS, random_vision_weights
from tests.cuda_runner.test_vision_flash_tower import flash_context
from vision.limits import MediaLimits
from vision.raster import _fit


def test_grids_are_what_the_processor_makes_of_the_document_run_inputs() -> None:
    grids = vtp.kind_grids([3_145_728])
    # A4 at 150 dpi: 1760 x 1248 px after smart resize (multiples of 32) = 110 x 78 patches = 8,580 (2,145 tokens);
    # the 12 MP photo at full size 188 x 252 = 47,376; capped 1536 x 2048 px = 96 x 128; video 8 frame groups of
    # 544 x 960 px = 34 x 60
    assert grids == {"page": (1, 110, 78), "photo": (1, 188, 252), "photo_cap3145728": (1, 96, 128),
                     "video": (8, 34, 60)}


def test_the_photo_cap_is_the_products_and_applied_as_raster_applies_it() -> None:
    assert vtp.photo_caps(None) == [MediaLimits().max_photo_pixels]
    assert vtp.photo_caps("100,200") == [100, 200]
    for size, cap in [((4032, 3024), 3_145_728), ((3024, 4032), 2_359_296), ((1000, 700), 3_145_728)]:
        assert vtp.capped(size, cap) == _fit(size, cap)


def test_run_mix_multiplies_by_units_per_kind() -> None:
    rows = [{"variant": "v", "kind": k, "encode_ms": ms, "limit_ms": lim}
            for k, ms, lim in [("page", 10.0, 2.0), ("photo", 100.0, 40.0), ("photo_cap9", 20.0, 5.0),
                               ("video", 30.0, 6.0)]]
    mix = {m["photo_kind"]: m for m in vtp.run_mix(rows, [3, 2, 1])}
    assert mix["photo"]["vision_s"] == (3 * 10 + 2 * 100 + 30) / 1e3
    assert mix["photo_cap9"]["by_kind_s"] == {"page": 0.03, "photo": 0.04, "video": 0.03}
    assert mix["photo_cap9"]["limit_s"] == (3 * 2 + 2 * 5 + 6) / 1e3


class _Event:
    """Stands in for a CUDA event: `stop - start` is the number of records between them (a positive 'ms')."""

    _clock = itertools.count()

    def record(self) -> None:
        self.t = next(self._clock)

    def __sub__(self, other: "_Event") -> float:
        return float(self.t - other.t)


def test_every_launch_of_the_tower_is_timed_under_its_label() -> None:
    rng = np.random.default_rng()
    cfg = SimpleNamespace(**CONFIGS["hd72 exact-gelu"])  # depth 2, hidden 144, 2 heads of 72, MLP 256
    ctx = flash_context()
    ctx.device.event = _Event
    ctx.device.stream = SimpleNamespace(record=lambda ev: ev.record())
    ctx.device.sync = lambda: None
    tower = GpuVisionTower(ctx, cfg, random_vision_weights(cfg, rng), "bf16")
    originals, linear = _originals(), ctx.blas.linear
    grid = (2, 4, 6)  # two frame groups of 24 patches
    row = vtp.profile_kind(ctx, tower, rng, grid, 1, 1e12)
    by_op, depth, n = row["ops"], cfg.depth, 48
    assert by_op["attention"]["launches"] == depth
    assert by_op["attention"]["flops"] == depth * 4.0 * n * 24 * cfg.hidden_size  # 4 n seg d per head, all heads
    assert by_op["layernorm"]["launches"] == 2 * depth + 1 and by_op["rope"]["launches"] == 2 * depth
    for gemm in ("gemm qkv", "gemm proj", "gemm fc1", "gemm fc2"):
        assert by_op[gemm]["launches"] == depth
    assert by_op["gemm qkv"]["flops"] == depth * 2.0 * n * 3 * cfg.hidden_size * cfg.hidden_size
    assert by_op["gemm patch"]["launches"] == 1 and by_op["gemm merger"]["launches"] == 2
    assert row["patches"] == n and row["tokens"] == n // 4 and row["flops"] == tower.flops(grid)
    # the wrappers are gone afterwards
    assert (vision_flash.vision_flash_attention, vision_ops.layernorm, ops.rope) == originals
    assert ctx.blas.linear == linear


def _originals() -> tuple:
    return vision_flash.vision_flash_attention, vision_ops.layernorm, ops.rope
