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
    assert ctx.device.attention_launches == [vision_flash.kernel_name(72, variant)]
