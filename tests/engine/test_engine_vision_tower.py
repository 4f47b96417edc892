"""The numpy reference vision tower against transformers' Qwen3_5VisionModel (float32, tiny random configs).

Tolerance: relative L2 error <= 1e-4 against transformers (observed ~1e-7); frame-group-at-a-time vs whole-video
and item-at-a-time vs packed are the same computation up to BLAS summation order, checked at 1e-6.
Inputs are fresh random each run; the seed is printed in every failure message (set DOCPIPE_TEST_SEED to replay).
"""
from __future__ import annotations

import math
import os
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
from ci_rule import require_module

torch = require_module("torch")
require_module("transformers")
from safetensors.numpy import load_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from gpu_engine.reference.vision_tower import (
    VisionConfigError,
    VisionInputError,
    VisionTower,
    VisionWeightError,
    gelu_exact,
    split_frame_groups,
    vision_weight_shapes,
)
from gpu_engine.vision_geometry import merge_window_coords

torch.set_num_threads(1)
SEED = int(os.environ.get("DOCPIPE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
PARITY_RTOL = 1e-4
SAME_COMPUTATION_RTOL = 1e-6

# Two tiny towers that differ in every dimension that changes the code path. Both position tables are smaller
# than the grids' sides or differently shaped, so the bilinear resampling really interpolates.
CONFIGS = {
    "tanh-merge2": dict(
        depth=2, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3, out_hidden_size=24, num_position_embeddings=16,
        hidden_act="gelu_pytorch_tanh",
    ),
    # head_dim 16, exact-GELU MLP, merge 3, temporal patch 1, a non-default rotary base, and a table of 27
    # rows of which (like HF) only the first 5 x 5 are used.
    "erf-merge3": dict(
        depth=3, hidden_size=48, num_heads=3, intermediate_size=40, patch_size=2, temporal_patch_size=1,
        spatial_merge_size=3, in_channels=3, out_hidden_size=20, num_position_embeddings=27,
        hidden_act="gelu", rope_parameters={"rope_type": "axial", "rope_theta": 1000.0},
    ),
}

# Grids per config: one non-square image, two images of different sizes, a video with t >= 4, a mixed call.
CASES = {
    "tanh-merge2": {
        "one_image": [(1, 6, 10)],
        "two_images": [(1, 4, 8), (1, 10, 6)],
        "video": [(4, 6, 4)],
        "mixed": [(1, 2, 2), (5, 4, 6), (1, 8, 4)],
    },
    "erf-merge3": {
        "one_image": [(1, 6, 9)],
        "two_images": [(1, 3, 12), (1, 9, 6)],
        "video": [(5, 6, 6)],
        "mixed": [(4, 3, 6), (1, 12, 3)],
    },
}


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (biases and LayerNorm affine too, which HF initialises to constants)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))  # keeps activations O(1) through the tiny tower


def numpy_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def random_pixels(rng: np.random.Generator, grids: list[tuple[int, int, int]], patch_dim: int) -> np.ndarray:
    rows = sum(t * h * w for t, h, w in grids)
    return rng.standard_normal((rows, patch_dim)).astype(np.float32)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tower_pair(request):
    name = request.param
    config = Qwen3_5VisionConfig(**CONFIGS[name])
    config._attn_implementation = "eager"
    model = Qwen3_5VisionModel(config).eval()
    randomize_(model, SEED)
    return name, config, model, VisionTower(config, numpy_weights(model))


def hf_encode(model: torch.nn.Module, pixels: np.ndarray, grids) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(pixels), grid_thw=torch.tensor(grids, dtype=torch.long))
    return out.pooler_output.numpy()


def test_weight_shape_table_matches_transformers(tower_pair):
    _, config, model, _ = tower_pair
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert vision_weight_shapes(config) == expected


@pytest.mark.parametrize("case", ["one_image", "two_images", "video", "mixed"])
def test_matches_transformers(tower_pair, case):
    name, config, model, tower = tower_pair
    grids = CASES[name][case]
    rng = np.random.default_rng([SEED, len(case)])
    pixels = random_pixels(rng, grids, tower.dims.patch_dim)

    ours = tower.encode(pixels, grids)
    theirs = hf_encode(model, pixels, grids)

    n_tokens = sum(t * h * w for t, h, w in grids) // config.spatial_merge_size**2
    assert ours.shape == theirs.shape == (n_tokens, config.out_hidden_size)
    assert ours.dtype == np.float32
    err = rel_l2(ours, theirs)
    assert err <= PARITY_RTOL, f"{name}/{case}: rel L2 {err:.2e} (seed {SEED})"


def test_video_frame_groups_one_at_a_time_equal_whole_video(tower_pair):
    """The engine encodes long videos frame group by frame group; that must be exact, not an approximation."""
    name, _, _, tower = tower_pair
    grid = CASES[name]["video"][0]
    assert grid[0] >= 4
    pixels = random_pixels(np.random.default_rng([SEED, 1]), [grid], tower.dims.patch_dim)

    whole = tower.encode(pixels, grid)
    groups = split_frame_groups(pixels, grid)
    assert len(groups) == grid[0] and all(g == (1, grid[1], grid[2]) for _, g in groups)
    one_by_one = np.concatenate([tower.encode(rows, g) for rows, g in groups])

    err = rel_l2(one_by_one, whole)
    assert err <= SAME_COMPUTATION_RTOL, f"{name}: rel L2 {err:.2e} (seed {SEED})"
    # And the frame groups really differ from each other (the test would be vacuous otherwise).
    per_group = whole.reshape(grid[0], -1, whole.shape[1])
    assert rel_l2(per_group[0], per_group[1]) > 1e-2


def test_items_packed_equal_items_alone(tower_pair):
    name, _, _, tower = tower_pair
    grids = CASES[name]["mixed"]
    pixels = random_pixels(np.random.default_rng([SEED, 2]), grids, tower.dims.patch_dim)

    packed = tower.encode(pixels, grids)
    alone, start = [], 0
    for g in grids:
        rows = g[0] * g[1] * g[2]
        alone.append(tower.encode(pixels[start:start + rows], g))
        start += rows
    err = rel_l2(np.concatenate(alone), packed)
    assert err <= SAME_COMPUTATION_RTOL, f"{name}: rel L2 {err:.2e} (seed {SEED})"
    assert [a.shape[0] for a in alone] == [tower.num_tokens(g) for g in grids]


def test_checkpoint_names_under_model_visual_load_and_match():
    """A saved Qwen3_5ForConditionalGeneration stores the tower under `model.visual.`; stripping that prefix
    gives exactly our weight table, and the tower built from the file equals the model's own tower."""
    vision = dict(CONFIGS["tanh-merge2"], out_hidden_size=32)
    text = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
    )
    config = Qwen3_5Config(text_config=text, vision_config=vision)
    config.vision_config._attn_implementation = "eager"
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize_(model.model.visual, SEED)

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tensors = load_file(os.path.join(folder, "model.safetensors"))
    prefix = "model.visual."
    weights = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    assert {k: v.shape for k, v in weights.items()} == vision_weight_shapes(config.vision_config)

    grids = [(1, 4, 6)]
    pixels = random_pixels(np.random.default_rng([SEED, 3]), grids, 3 * 2 * 4 * 4)
    ours = VisionTower(config.vision_config, weights).encode(pixels, grids)
    err = rel_l2(ours, hf_encode(model.model.visual, pixels, grids))
    assert err <= PARITY_RTOL, f"rel L2 {err:.2e} (seed {SEED})"


def test_row_layout_is_what_the_hf_image_processor_emits():
    """Rows in merge-window order, columns in (C, T, P, P) order with a still image repeated over T: rebuild
    the processor's output from the normalised image with our `merge_window_coords` and compare."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch, temporal, merge = 4, 2, 2
    mean, std = np.array([0.5, 0.4, 0.3]), np.array([0.2, 0.3, 0.25])
    processor = Qwen2VLImageProcessorPil(
        patch_size=patch, temporal_patch_size=temporal, merge_size=merge, min_pixels=16, max_pixels=10**6,
        image_mean=mean.tolist(), image_std=std.tolist(),
    )
    # 24 x 40 is a multiple of patch * merge, so the processor keeps the size (no resampling to reproduce).
    image = np.random.default_rng([SEED, 4]).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    out = processor(images=[image], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 6, 10]]

    chw = ((image / 255.0 - mean) / std).transpose(2, 0, 1)
    rows, cols = merge_window_coords(6, 10, merge)
    expected = np.stack([
        np.stack([chw[:, r * patch:(r + 1) * patch, c * patch:(c + 1) * patch]] * temporal, axis=1).reshape(-1)
        for r, c in zip(rows, cols)
    ])
    assert np.abs(out["pixel_values"] - expected).max() <= 1e-5


def test_gelu_exact_matches_math_erf():
    x = np.concatenate([np.linspace(-12.0, 12.0, 4001), np.random.default_rng(SEED).standard_normal(1000) * 3])
    x = x.astype(np.float32)
    want = np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in x.astype(np.float64)])
    got = gelu_exact(x).astype(np.float64)
    assert np.all(np.abs(got - want) <= 1e-7 + 2e-7 * np.abs(want))


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs: each gets one clear error


def small_config(**overrides) -> SimpleNamespace:
    """A plain duck-typed config (not a transformers object): the tower needs only the field names."""
    return SimpleNamespace(**dict(CONFIGS["tanh-merge2"], rope_parameters=None) | overrides)


def random_weights(config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in vision_weight_shapes(config).items()}


@pytest.fixture(scope="module")
def small_tower() -> VisionTower:
    config = small_config()
    return VisionTower(config, random_weights(config))


def test_duck_typed_config_works(small_tower):
    out = small_tower.encode(np.zeros((2 * 4 * 4, 96), np.float32), (2, 4, 4))
    assert out.shape == (8, 24) and np.all(np.isfinite(out))


@pytest.mark.parametrize(
    "rows, cols, grid, message",
    [
        (47, 96, (1, 6, 8), "rows"),  # rows != t*h*w
        (48, 95, (1, 6, 8), r"\[n_patches, 96\]"),  # wrong patch width
        (42, 96, (1, 6, 7), "multiples of spatial_merge_size"),  # w not divisible by merge
        (60, 96, (1, 5, 12), "multiples of spatial_merge_size"),  # h not divisible by merge
        (0, 96, (0, 4, 4), "positive"),
        (48, 96, (1, 6), "triple"),
    ],
)
def test_bad_inputs_raise(small_tower, rows, cols, grid, message):
    with pytest.raises(VisionInputError, match=message):
        small_tower.encode(np.zeros((rows, cols), np.float32), grid)


def test_rows_must_match_all_items(small_tower):
    with pytest.raises(VisionInputError, match="sum"):
        small_tower.encode(np.zeros((16 + 16, 96), np.float32), [(1, 4, 4), (2, 4, 4)])


def test_wrong_weight_shape_missing_and_unexpected_are_listed():
    config = small_config()
    weights = random_weights(config)
    weights["blocks.1.attn.qkv.weight"] = weights["blocks.1.attn.qkv.weight"][:, :-1]
    del weights["merger.norm.bias"]
    weights["blocks.2.norm1.weight"] = np.ones(32, np.float32)
    with pytest.raises(VisionWeightError) as info:
        VisionTower(config, weights)
    text = str(info.value)
    assert "blocks.1.attn.qkv.weight: expected (96, 32), got (96, 31)" in text
    assert "missing: ['merger.norm.bias']" in text
    assert "unexpected: ['blocks.2.norm1.weight']" in text


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"num_heads": 5}, "not divisible by num_heads"),
        ({"num_heads": 16}, "divisible by 4"),  # head_dim 2
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_type 'default'"),
        ({"patch_size": [4, 4]}, "patch_size"),
        ({"depth": 0}, "depth"),
    ],
)
def test_unsupported_config_raises(overrides, message):
    with pytest.raises(VisionConfigError, match=message):
        vision_weight_shapes(small_config(**overrides))


def test_split_frame_groups_checks_rows():
    with pytest.raises(VisionInputError, match="needs 48"):
        split_frame_groups(np.zeros((47, 96), np.float32), (3, 4, 4))
