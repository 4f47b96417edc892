"""The processor's one-pass pixel path (uint8 gather, normalise into the output, still images normalised once)
equals the straightforward path it replaced (repeat -> float32 -> normalise -> patchify, as transformers computes
it) bit for bit, on fresh random inputs; and the cache key (sha256 over uint8 pixels) keeps content identity.
Parity with transformers itself is pinned in test_engine_processor.py."""
from __future__ import annotations

import io
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps

from gpu_engine.frame_resize import resize_like_torch_uint8
from gpu_engine.media_io import load_image
from gpu_engine.preprocessing import ImageProcessor, VideoProcessor
from gpu_engine.processing_errors import ProcessorError

QWEN: dict[str, Any] = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                        "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 1024 * 32 * 32}}
VARIANTS: dict[str, dict[str, Any]] = {
    "qwen": QWEN,
    "clip_patch14": {**QWEN, "patch_size": 14, "image_mean": [0.4815, 0.4578, 0.4082],
                     "image_std": [0.2686, 0.2613, 0.2758], "size": {"shortest_edge": 3136, "longest_edge": 401408}},
    "temporal1_merge1": {**QWEN, "temporal_patch_size": 1, "merge_size": 1},
    "temporal3": {**QWEN, "temporal_patch_size": 3},
    "normalise_only": {**QWEN, "do_rescale": False, "image_mean": [100.0, 120.0, 90.0],
                       "image_std": [50.0, 60.0, 55.0]},
    "rescale_only": {**QWEN, "do_normalize": False, "rescale_factor": 1 / 7},
    "raw": {**QWEN, "do_rescale": False, "do_normalize": False},
}


def reference_rows(cfg: dict[str, Any], frames: np.ndarray) -> np.ndarray:
    """uint8 [F, C, H, W] (F a multiple of the temporal patch) -> float32 rows, the way the code before the one-pass
    path computed them (transformers' fused rescale+normalise in float32, then the patch gather)."""
    p, tp, m = cfg["patch_size"], cfg["temporal_patch_size"], cfg["merge_size"]
    rescale, normalise = cfg.get("do_rescale", True), cfg.get("do_normalize", True)
    factor = np.float32(1.0 / cfg.get("rescale_factor", 1 / 255))
    mean = np.asarray(cfg.get("image_mean", [0.5] * 3), np.float32)
    std = np.asarray(cfg.get("image_std", [0.5] * 3), np.float32)
    x = frames.astype(np.float32)
    if rescale and normalise:
        x = (x - (mean * factor)[None, :, None, None]) / (std * factor)[None, :, None, None]
    elif normalise:
        x = (x - mean[None, :, None, None]) / std[None, :, None, None]
    elif rescale:
        x = (frames.astype(np.float64) * cfg["rescale_factor"]).astype(np.float32)
    f, c, h, w = x.shape
    gt, gh, gw = f // tp, h // p, w // p
    x = x.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p))


def reference_image_rows(cfg: dict[str, Any], image: Image.Image) -> np.ndarray:
    ip = ImageProcessor.from_dict(cfg)
    rgb = image.convert("RGB") if image.mode != "RGB" else image
    h, w = ip.target_size(rgb.height, rgb.width)
    resized = rgb if rgb.size == (w, h) else rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
    chw = np.asarray(resized, np.uint8).transpose(2, 0, 1)
    return reference_rows(cfg, np.repeat(chw[None], cfg["temporal_patch_size"], axis=0))


def random_image(rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> Image.Image:
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "P":
        return image.quantize(colors=200)
    return image.convert(mode) if mode != "RGB" else image


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("size", [(37, 61), (333, 517), (64, 64), (1240, 1755), (700, 96)])
def test_image_rows_equal_the_reference_path(variant: str, size: tuple[int, int]) -> None:
    cfg = VARIANTS[variant]
    rng = np.random.default_rng(zlib.crc32(f"{variant} {size}".encode()))
    image = random_image(rng, *size)
    got = ImageProcessor.from_dict(cfg).preprocess(image)
    want = reference_image_rows(cfg, image)
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    assert got.pixel_values.shape == want.shape
    assert np.array_equal(got.pixel_values, want)  # bit for bit: no rounding changed
    assert got.num_tokens == len(want)


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "CMYK", "1", "I"])
def test_other_modes_are_converted_to_rgb_first(mode: str) -> None:
    rng = np.random.default_rng(7)
    image = random_image(rng, 91, 143, mode)
    got = ImageProcessor.from_dict(QWEN).preprocess(image)
    assert np.array_equal(got.pixel_values, reference_image_rows(QWEN, image))


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_exif_orientation_is_honoured_as_before(orientation: int, fmt: str) -> None:
    rng = np.random.default_rng(orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    random_image(rng, 75, 41).save(out, format=fmt, exif=exif)
    data = out.getvalue()
    want = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))  # a copy, as transformers' load_image makes
    got = load_image(data)
    assert got.size == want.size and got.mode == want.mode
    assert np.array_equal(np.asarray(got), np.asarray(want))
    if orientation in (5, 6, 7, 8):
        assert got.size == (41, 75)
    rows = ImageProcessor.from_dict(QWEN).preprocess(got).pixel_values
    assert np.array_equal(rows, reference_image_rows(QWEN, want))


# clips of at least one temporal patch (2 frames cannot fill temporal3's patch of 3)
VIDEO_CASES = [(v, n) for v in ("qwen", "temporal3", "temporal1_merge1", "normalise_only") for n in (2, 5, 8)
               if n >= VARIANTS[v]["temporal_patch_size"]]


@pytest.mark.parametrize(("variant", "count"), VIDEO_CASES)
def test_video_rows_equal_the_reference_path(variant: str, count: int) -> None:
    cfg = VARIANTS[variant]
    rng = np.random.default_rng(count)
    frames = [rng.integers(0, 256, (197, 333, 3), dtype=np.uint8) for _ in range(count)]
    vp = VideoProcessor.from_dict(cfg)
    video = vp.preprocess(frames, [i / 2 for i in range(count)])
    h, w = vp.target_size(count, 197, 333)
    chw = np.stack([resize_like_torch_uint8(f, h, w).transpose(2, 0, 1) for f in frames])
    tp = cfg["temporal_patch_size"]
    if pad := -count % tp:
        chw = np.concatenate([chw, np.repeat(chw[-1:], pad, axis=0)])
    want = reference_rows(cfg, chw)
    assert np.array_equal(video.pixel_values, want)
    assert len(video.frame_groups) == len(chw) // tp


def test_identical_content_gives_one_key_and_any_change_another() -> None:
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 256, (150, 220, 3), dtype=np.uint8)
    ip = ImageProcessor.from_dict(QWEN)
    png = io.BytesIO()
    Image.fromarray(arr).save(png, format="PNG")
    keys = {ip.preprocess(Image.fromarray(arr.copy())).content_hash, ip.preprocess(Image.fromarray(arr)).content_hash,
            ip.preprocess(load_image(png.getvalue())).content_hash}
    assert len(keys) == 1  # fresh objects and a decoded PNG of the same pixels: one encoder/prefix-cache entry
    changed = arr.copy()
    changed[149, 219, 2] ^= 1  # one bit of the last pixel
    assert ip.preprocess(Image.fromarray(changed)).content_hash not in keys
    assert ip.preprocess(Image.fromarray(arr.transpose(1, 0, 2))).content_hash not in keys  # same bytes, other shape
    other = ImageProcessor.from_dict({**QWEN, "image_std": [0.5, 0.5, 0.25]})
    assert other.preprocess(Image.fromarray(arr)).content_hash not in keys  # same pixels, other rows


def test_video_group_keys_follow_their_frames() -> None:
    rng = np.random.default_rng(4)
    still = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    vp = VideoProcessor.from_dict(QWEN)
    frames = [still] * 4
    groups = vp.preprocess(frames, [0.0, 0.5, 1.0, 1.5]).frame_groups
    assert groups[0].content_hash == groups[1].content_hash  # identical frame pairs: one entry
    moved = frames[:3] + [np.roll(still, 1, axis=1)]
    groups2 = vp.preprocess(moved, [0.0, 0.5, 1.0, 1.5]).frame_groups
    assert groups2[0].content_hash == groups[0].content_hash and groups2[1].content_hash != groups[1].content_hash
    image = ImageProcessor.from_dict(QWEN).preprocess(Image.fromarray(still))
    assert image.content_hash not in {g.content_hash for g in groups}  # a still image is not a video group


def test_patches_refuse_frames_that_do_not_fill_temporal_patches() -> None:
    params = ImageProcessor.from_dict(QWEN).params
    frames = np.zeros((3, 64, 64, 3), np.uint8)
    with pytest.raises(ProcessorError, match="temporal patches"):
        params.patches(frames)
    with pytest.raises(ProcessorError, match="temporal patches"):
        params.patches(frames[:2], still=True)
