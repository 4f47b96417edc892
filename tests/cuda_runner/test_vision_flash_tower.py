"""GpuVisionTower's flash dispatch without a GPU: on the emulated device of test_cuda_vision_emulated, with the
vision_flash kernel emulated by its tiling (tests/cuda_runner/vision_flash_emulation.py). Checks that "auto" picks the
fused kernel for bf16 towers with a supported head dim (and only there), that the launch arguments address the right
buffers (the tower output matches the numpy reference tower), and that "flash" is refused where it cannot run."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import vision_flash
from gpu_engine.cuda.bf16 import round_to_bf16
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.vision import GpuVisionTower
from gpu_engine.reference.vision_tower import VisionTower
from tests.cuda_runner.check_vision import CONFIGS, random_vision_weights
from tests.cuda_runner.test_cuda_vision_emulated import FakeDevice, fake_context
from tests.cuda_runner.vision_flash_emulation import vision_flash_emulated

FLASH_FAMILIES = ("vision_flash", "vision_flash_wg", "vision_flash_ws")


class FlashFakeDevice(FakeDevice):
    """FakeDevice plus the vision_flash kernels; records which attention kernels ran. `arch` is what the launcher
    reads to pick a variant (sm_90: the wgmma kernel may run)."""

    def __init__(self, nbytes: int, arch: str = "sm_90") -> None:
        super().__init__(nbytes)
        self.info = SimpleNamespace(**vars(self.info), arch=arch)
        self.attention_launches: list[str] = []

    def launch(self, family: str, name: str, grid, block, *args, shmem: int = 0) -> None:
        if "attention" in name or family in FLASH_FAMILIES:
            self.attention_launches.append(name)
        if family not in FLASH_FAMILIES:
            super().launch(family, name, grid, block, *args)
            return
        out, qkv, heads, seg, tiles = (int(a) for a in args[:5])
        scale = float(args[5])
        kernel = r"vision_flash(?:_wg|_ws)?_bf16_hd(\d+)(_[mc]\d+)?(_n\d+)?(_sb|_p|_pr|_q)?"
        head_dim = int(re.fullmatch(kernel, name).group(1))
        variant = next(v for v in vision_flash.VARIANTS if vision_flash.kernel_name(head_dim, v) == name)
        blocks, grid_heads = grid
        rows = vision_flash.tile_rows(variant)
        assert grid_heads == heads and tiles == -(-seg // rows) and blocks % tiles == 0
        assert (family, block, shmem) == vision_flash.launch_shape(head_dim, variant)
        n = blocks // tiles * seg
        values = self.read(qkv, n * 3 * heads * head_dim, "bf16").reshape(n, -1)
        self.write(out, vision_flash_emulated(values, heads, head_dim, seg, scale, variant=variant), "bf16")


def flash_context(nbytes: int = 64 << 20, arch: str = "sm_90"):
    ctx = fake_context(nbytes)
    ctx.device = FlashFakeDevice(nbytes, arch)
    ctx.blas.dev = ctx.device
    return ctx


@pytest.mark.parametrize("mode", ["auto", "flash"])
def test_bf16_tower_runs_flash_and_matches_reference(mode: str) -> None:
    rng = np.random.default_rng()
    cfg = SimpleNamespace(**CONFIGS["hd72 exact-gelu"])
    weights = random_vision_weights(cfg, rng)
    ref_tower = VisionTower(cfg, {k: round_to_bf16(v) for k, v in weights.items()})
    ctx = flash_context()
    tower = GpuVisionTower(ctx, cfg, weights, "bf16", attention=mode)
    for grid in [(1, 4, 6), (2, 6, 4)]:  # two frame groups = two attention segments
        t, h, w = grid
        pixels = rng.standard_normal((t * h * w, ref_tower.dims.patch_dim)).astype(np.float32)
        ref = ref_tower.encode(round_to_bf16(pixels), grid)
        mark = ctx.arena.mark()
        out = ctx.empty(ref.shape, "bf16", "out")
        ctx.poison(out)
        ctx.device.attention_launches.clear()
        tower.encode(pixels, grid, out)
        got = ctx.to_host(out)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert np.all(np.isfinite(got)) and err <= 1e-2, (grid, err)
        assert ctx.device.attention_launches == [vision_flash.kernel_name(72, vision_flash.DEFAULT_VARIANT)] * cfg.depth
        ctx.arena.release(mark)


@pytest.mark.parametrize("config,dtype", [("hd72 exact-gelu", "f32"), ("tiny hd16 gelu-tanh", "bf16")])
def test_auto_keeps_the_old_paths_where_flash_does_not_apply(config: str, dtype: str) -> None:
    rng = np.random.default_rng()
    cfg = SimpleNamespace(**CONFIGS[config])
    ctx = flash_context()
    tower = GpuVisionTower(ctx, cfg, random_vision_weights(cfg, rng), dtype, attention="auto")
    pixels = rng.standard_normal((24, tower.dims.patch_dim)).astype(np.float32)
    out = ctx.empty((24 // tower.dims.merge_unit, cfg.out_hidden_size), dtype, "out")
    tower.encode(pixels, (1, 4, 6), out)
    assert ctx.device.attention_launches == [f"vision_attention_{dtype}"] * cfg.depth  # 24 rows: the kernel


@pytest.mark.parametrize("config,dtype", [("hd72 exact-gelu", "f32"), ("tiny hd16 gelu-tanh", "bf16")])
def test_flash_mode_is_refused_where_it_cannot_run(config: str, dtype: str) -> None:
    cfg = SimpleNamespace(**CONFIGS[config])
    with pytest.raises(ShapeError, match="flash"):
        GpuVisionTower(flash_context(), cfg, random_vision_weights(cfg, np.random.default_rng()), dtype,
                       attention="flash")
