"""The vision flash kernel variant as a runner setting (CudaOptions.vision_flash, DOCPIPE_CUDA_VISION_FLASH): read
from the environment, refused when unknown, and handed to the tower's attention launches. No GPU needed."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import vision_flash
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.options import CudaOptions
from gpu_engine.cuda.vision import GpuVisionTower
from tests.cuda_runner.check_vision import CONFIGS, random_vision_weights
from tests.cuda_runner.test_vision_flash_tower import flash_context


@pytest.mark.parametrize("variant", sorted(vision_flash.VARIANTS))
def test_variant_is_read_from_the_environment(variant: str) -> None:
    assert CudaOptions.from_env({"DOCPIPE_CUDA_VISION_FLASH": variant}).vision_flash == variant
    assert CudaOptions.from_env({}).vision_flash is None
    assert CudaOptions.from_env({"DOCPIPE_CUDA_VISION_FLASH": ""}).vision_flash is None  # empty = unset


@pytest.mark.parametrize("bad", ["m3", "M1", "flash"])
def test_unknown_variant_is_refused(bad: str) -> None:
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_VISION_FLASH"):
        CudaOptions.from_env({"DOCPIPE_CUDA_VISION_FLASH": bad})
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_VISION_FLASH"):
        CudaOptions(vision_flash=bad)


@pytest.mark.parametrize("variant", sorted(vision_flash.VARIANTS))
def test_tower_launches_the_chosen_variant(variant: str) -> None:
    rng = np.random.default_rng()
    cfg = SimpleNamespace(**{**CONFIGS["hd72 exact-gelu"], "depth": 1})
    ctx = flash_context()
    tower = GpuVisionTower(ctx, cfg, random_vision_weights(cfg, rng), "bf16", flash_variant=variant)
    grid = (1, 4, 6)
    out = ctx.empty((tower.num_tokens(grid), cfg.out_hidden_size), "bf16", "out")
    tower.encode(rng.standard_normal((24, tower.dims.patch_dim)).astype(np.float32), grid, out)
    assert ctx.device.attention_launches == [vision_flash.kernel_name(72, variant)]  # sm_90: every variant runs


def test_the_wgmma_variant_falls_back_off_hopper_and_at_other_head_dims() -> None:
    assert vision_flash.resolve_variant(72, "wg64", "sm_90") == "wg64"
    assert vision_flash.resolve_variant(72, "wg64", "sm_80") == "m2n32"  # wgmma is sm_90a only
    assert vision_flash.resolve_variant(72, "wg64", None) == "m2n32"
    assert vision_flash.resolve_variant(80, "wg64", "sm_90") == "m2n32"  # instantiated for head_dim 72 only
    assert vision_flash.resolve_variant(128, "wg64", "sm_90") == "m1"
    rng = np.random.default_rng()
    cfg = SimpleNamespace(**{**CONFIGS["hd72 exact-gelu"], "depth": 1})
    ctx = flash_context(arch="sm_89")
    tower = GpuVisionTower(ctx, cfg, random_vision_weights(cfg, rng), "bf16", flash_variant="wg64")
    out = ctx.empty((tower.num_tokens((1, 4, 6)), cfg.out_hidden_size), "bf16", "out")
    tower.encode(rng.standard_normal((24, tower.dims.patch_dim)).astype(np.float32), (1, 4, 6), out)
    assert ctx.device.attention_launches == [vision_flash.kernel_name(72, "m2n32")]


def test_the_wgmma_kernel_file_is_built_for_the_arch_specific_target() -> None:
    from pathlib import Path

    from gpu_engine.cuda.device import KERNEL_DIR, compile_arch, expand_source

    wg = expand_source(Path(KERNEL_DIR) / "vision_flash_wg.cu")
    assert compile_arch("sm_90", wg) == "sm_90a" and compile_arch("sm_80", wg) == "sm_80"
    assert compile_arch("sm_90", expand_source(Path(KERNEL_DIR) / "vision_flash.cu")) == "sm_90"
    for name in vision_flash.WG_VARIANTS:
        for hd in vision_flash.WG_HEAD_DIMS:
            assert f"void __launch_bounds__(VW_THREADS, 2) {vision_flash.kernel_name(hd, name)}(" in wg
