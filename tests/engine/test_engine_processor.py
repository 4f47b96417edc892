"""Processor vs transformers 5.17's Qwen3VLProcessor (AutoProcessor on a tiny qwen3_5 folder).

Tolerances (stated once, used below):
- sizes, grid_thw, token ids, M-RoPE positions, timestamps, frame indices: exact.
- image patches: |ours - transformers' PIL image backend| <= 1e-6 (both resize with Pillow bicubic; only float32
  rounding differs). The reference is the PIL backend even where torchvision is installed.
- resized video frames (uint8): bit-identical to torch's uint8 antialiased bicubic interpolate (no tie
  tolerance is needed: our resize is torch's integer arithmetic); video patches therefore within 1e-6 of
  transformers' (the same uint8 frames through the same float32 normalisation).

transformers' video processor passes the uint8 frames to torchvision.transforms.v2.functional.resize, whose
resize_image (torchvision 0.2x, `_do_native_uint8_resize_on_cpu`: True for BICUBIC) hands uint8 straight to
torch.nn.functional.interpolate(mode="bicubic", antialias=True, align_corners=False) on CPU. Where torchvision is
missing (this CPU image: no CPU build of it matches torch 2.13), `_torchvision_stand_in` provides the three
torchvision functions that code calls, implemented that way; on the GPU host (torch 2.11, torchvision 0.26, AVX512)
the same comparisons against the real torchvision and Qwen3VLVideoProcessor found no differing value.
"""
from __future__ import annotations

import enum
import functools
import importlib
import io
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ci_rule import require_module
from PIL import Image

from gpu_engine.frame_resize import resize_like_torch_uint8
from gpu_engine.preprocessing import ImageProcessor, smart_resize_image, smart_resize_video
from gpu_engine.processing_errors import ProcessorError
from gpu_engine.processor import Processor
from gpu_engine.tiny_assets import write_processor_configs, write_tokenizer_files

torch = require_module("torch")
transformers = require_module("transformers")
av = require_module("av")
torch.set_num_threads(1)

import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as hf_image
import transformers.models.qwen3_5.modeling_qwen3_5 as hf_modeling
import transformers.models.qwen3_vl.video_processing_qwen3_vl as hf_video  # a plain import works without torchvision
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.models.auto.processing_auto import AutoProcessor
from transformers.video_utils import VideoMetadata

IMAGE_ATOL = 1e-6  # also the video patch tolerance (module docstring)

PATCH, TEMPORAL, MERGE = 8, 2, 2


# ------------------------------------------------------------------------------------------------ fixtures


class _InterpolationMode(enum.Enum):
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _torchvision_stand_in(mp: pytest.MonkeyPatch) -> None:
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling

    class TvF:
        InterpolationMode = _InterpolationMode

        @staticmethod
        def resize(image, size, interpolation=None, antialias=True):
            assert interpolation is _InterpolationMode.BICUBIC and image.dtype == torch.uint8 and antialias
            flat = image.reshape(-1, *image.shape[-3:])
            out = torch.nn.functional.interpolate(flat, size=list(size), mode="bicubic", antialias=True,
                                                  align_corners=False)
            return out.reshape(*image.shape[:-3], *out.shape[-3:])

        @staticmethod
        def normalize(image, mean, std, inplace=False):
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return image.sub(mean).div_(std)

        @staticmethod
        def grayscale_to_rgb(video):
            return video if video.shape[-3] != 1 else video.expand(*video.shape[:-3], 3, *video.shape[-2:])

    mp.setattr(backends, "tvF", TvF, raising=False)
    mp.setattr(video_utils, "tvF", TvF, raising=False)
    mp.setattr(backends, "pil_torch_interpolation_mapping", {PILImageResampling.BICUBIC: _InterpolationMode.BICUBIC})
    # Without torchvision the top-level names are placeholders; the processor's class check and the auto class
    # lookup must see the real classes.
    processing_utils = importlib.import_module("transformers.processing_utils")
    mp.setattr(processing_utils.transformers_module, "BaseVideoProcessor", video_utils.BaseVideoProcessor)
    video_auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    by_name = video_auto.video_processor_class_from_name
    mp.setattr(video_auto, "video_processor_class_from_name",
               lambda name: hf_video.Qwen3VLVideoProcessor if name == "Qwen3VLVideoProcessor" else by_name(name))


def _write_folder(folder: Path, **processor_kwargs) -> None:
    write_tokenizer_files(folder)
    params = {"patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE, **processor_kwargs}
    write_processor_configs(folder, **params)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_proc")
    _write_folder(path)
    return path


@pytest.fixture(scope="module")
def hf_proc(folder: Path) -> Iterator:
    with pytest.MonkeyPatch.context() as mp:
        if not transformers.utils.is_torchvision_available():
            _torchvision_stand_in(mp)
        processor = AutoProcessor.from_pretrained(folder)
        # Images: compare with the PIL backend even where torchvision is installed (module docstring).
        processor.image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
        processor.video_processor.cap_pixels_per_frame = False  # silence the v5.22 default-change warning
        yield processor


@pytest.fixture(scope="module")
def ours(folder: Path) -> Processor:
    return Processor.from_pretrained(folder)


def _random_image(rng: np.random.Generator, height: int, width: int, mode: str = "RGB") -> Image.Image:
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return image if mode == "RGB" else image.convert(mode)


def _hf_positions(ids: np.ndarray, types_: np.ndarray, image_grids, video_grids, merge: int) -> tuple[np.ndarray, int]:
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge))
    )
    fake.get_vision_position_ids = functools.partial(hf_modeling.Qwen3_5Model.get_vision_position_ids, fake)
    positions, delta = hf_modeling.Qwen3_5Model.get_rope_index(
        fake, torch.tensor(ids[None]), mm_token_type_ids=torch.tensor(types_[None]),
        image_grid_thw=None if image_grids is None else torch.as_tensor(image_grids),
        video_grid_thw=None if video_grids is None else torch.as_tensor(video_grids),
    )
    return positions[:, 0].numpy(), int(delta[0, 0])


def _assert_same_prompt(ours_prompt, hf_out, merge: int = MERGE) -> None:
    ids = np.asarray(hf_out["input_ids"][0])
    np.testing.assert_array_equal(ours_prompt.token_ids, ids)
    expected_pos, expected_delta = _hf_positions(
        ids, np.asarray(hf_out["mm_token_type_ids"][0]), hf_out.get("image_grid_thw"), hf_out.get("video_grid_thw"),
        merge,
    )
    np.testing.assert_array_equal(ours_prompt.positions, expected_pos)
    assert ours_prompt.rope_delta == expected_delta


def _close_video(ours_pixels: np.ndarray, hf_pixels: np.ndarray) -> None:
    assert ours_pixels.shape == hf_pixels.shape
    np.testing.assert_allclose(ours_pixels, hf_pixels, rtol=0, atol=IMAGE_ATOL)


def _torch_resize(frame: np.ndarray, height: int, width: int, channels_last: bool = False) -> np.ndarray:
    """The independent reference: torch's own uint8 antialiased bicubic kernel, [H, W, C] in and out."""
    x = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1)[None]
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.nn.functional.interpolate(x, size=[height, width], mode="bicubic", antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0).numpy()


def _write_mp4(path: Path, frames: list[np.ndarray], fps: int) -> None:
    """Any container PyAV picks from the suffix (.mp4, .mkv ...), MPEG-4 video."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def _decode_all(path: Path) -> tuple[np.ndarray, float]:
    """Independent decode for the reference: every frame, in order."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def _video_items(prompt):
    return [item for item in prompt.vision_items if item.kind == "video"]


def _image_items(prompt):
    return [item for item in prompt.vision_items if item.kind == "image"]


# -------------------------------------------------------------------------------------------- loading & sizes


def test_auto_classes_load_the_tiny_folder(hf_proc, ours: Processor) -> None:
    assert type(hf_proc).__name__ == "Qwen3VLProcessor"
    assert type(hf_proc.tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert type(hf_proc.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert hf_proc.image_processor.patch_size == ours.image_processor.params.patch_size == PATCH
    assert hf_proc.video_processor.fps == ours.video_processor.fps == 2.0


def test_smart_resize_matches_transformers() -> None:
    rng = np.random.default_rng()
    factor, lo, hi = 28, 56 * 56, 28 * 28 * 300
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(1, 3000, 2))
        if max(h, w) / min(h, w) > 200:
            with pytest.raises(ProcessorError, match="aspect ratio"):
                smart_resize_image(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
            continue
        assert smart_resize_image(h, w, factor=factor, min_pixels=lo, max_pixels=hi) == hf_image.smart_resize(
            h, w, factor=factor, min_pixels=lo, max_pixels=hi
        )
        t = int(rng.integers(2, 40))
        assert smart_resize_video(t, h, w, temporal_factor=2, factor=factor, min_pixels=lo, max_pixels=hi * 8) == (
            hf_video.smart_resize(t, h, w, temporal_factor=2, factor=factor, min_pixels=lo, max_pixels=hi * 8)
        )


# ---------------------------------------------------------------------------------------------------- images


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_image_patches_match_transformers(hf_proc, ours: Processor, mode: str) -> None:
    rng = np.random.default_rng()
    for _ in range(3):
        h, w = (int(v) for v in rng.integers(5, 180, 2) | 1)  # odd sizes
        image = _random_image(rng, h, w, mode)
        expected = hf_proc.image_processor(images=[image], return_tensors="np")
        got = ours.image_processor.preprocess(image)
        assert got.grid_thw == tuple(expected["image_grid_thw"][0])
        np.testing.assert_allclose(got.pixel_values, expected["pixel_values"], rtol=0, atol=IMAGE_ATOL)


def test_image_processor_with_other_parameters(tmp_path: Path) -> None:
    """Patch 14, CLIP mean/std, larger budget: our ImageProcessor reads the config as transformers does."""
    _write_folder(tmp_path, image_min_pixels=20 * 20 * 4, image_max_pixels=28 * 28 * 40,
                  image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711))
    cfg = json.loads((tmp_path / "preprocessor_config.json").read_text())
    cfg.update(patch_size=14)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    hf_ip = AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    ours = ImageProcessor.from_pretrained(tmp_path)
    rng = np.random.default_rng()
    image = _random_image(rng, int(rng.integers(30, 300)), int(rng.integers(30, 300)))
    expected = hf_ip(images=[image], return_tensors="np")
    got = ours.preprocess(image)
    assert got.grid_thw == tuple(expected["image_grid_thw"][0])
    np.testing.assert_allclose(got.pixel_values, expected["pixel_values"], rtol=0, atol=IMAGE_ATOL)


def test_two_images_of_different_sizes(hf_proc, ours: Processor) -> None:
    rng = np.random.default_rng()
    first = _random_image(rng, int(rng.integers(20, 120)) | 1, int(rng.integers(20, 200)) | 1)
    second = _random_image(rng, int(rng.integers(100, 200)), int(rng.integers(10, 60)))
    messages = [{"role": "user", "content": [
        {"type": "image", "image": first}, {"type": "text", "text": "and"}, {"type": "image", "image": second},
        {"type": "text", "text": "Which total is larger?"},
    ]}]
    hf_out = hf_proc.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                         enable_thinking=False, return_tensors="np")
    prompt = ours.prepare(messages, add_generation_prompt=True, enable_thinking=False)
    _assert_same_prompt(prompt, hf_out)
    items = _image_items(prompt)
    assert [it.grid_thw for it in items] == [tuple(g) for g in hf_out["image_grid_thw"]]
    np.testing.assert_allclose(np.concatenate([it.pixel_values for it in items]), hf_out["pixel_values"],
                               rtol=0, atol=IMAGE_ATOL)


def test_image_sources_bytes_path_data_url(ours: Processor, tmp_path: Path) -> None:
    import base64

    rng = np.random.default_rng()
    image = _random_image(rng, 41, 67)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    (tmp_path / "x.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    hashes = set()
    for part in ({"type": "image", "image": image}, {"type": "image", "image": data},
                 {"type": "image", "image": str(tmp_path / "x.png")}, {"type": "image_url", "image_url": {"url": url}}):
        prompt = ours.prepare([{"role": "user", "content": [part]}])
        hashes.add(prompt.vision_items[0].content_hash)
    assert len(hashes) == 1  # same pixels, same hash, whatever the source


def test_image_url_renders_like_transformers(hf_proc, ours: Processor) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "hi"},
    ]}]
    expected = hf_proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert ours.render(messages, add_generation_prompt=True, enable_thinking=True) == expected


# ---------------------------------------------------------------------------------------------------- videos


def test_video_frame_resize_equals_torch_uint8_kernel() -> None:
    """Down, up, mixed (one axis grows while the other shrinks), one axis only, large factors: bit-identical."""
    rng = np.random.default_rng()
    cases = [tuple(int(v) for v in rng.integers(2, 200, 4)) for _ in range(60)]
    cases += [(37, 53, 48, 64), (200, 30, 40, 120), (30, 200, 120, 40), (64, 90, 64, 33), (90, 64, 33, 64),
              (719, 1281, 64, 112), (5, 7, 128, 96), (121, 47, 1, 3)]
    for in_h, in_w, out_h, out_w in cases:
        frame = rng.integers(0, 256, (in_h, in_w, 3), dtype=np.uint8)
        got = resize_like_torch_uint8(frame, out_h, out_w)
        assert got.dtype == np.uint8 and got.shape == (out_h, out_w, 3)
        expected = _torch_resize(frame, out_h, out_w, channels_last=bool(rng.integers(0, 2)))
        np.testing.assert_array_equal(got, expected, err_msg=f"{in_h}x{in_w} -> {out_h}x{out_w}")
    smooth = np.repeat(np.linspace(0, 255, 77).astype(np.uint8)[None, :, None], 3, axis=2).repeat(41, axis=0)
    np.testing.assert_array_equal(resize_like_torch_uint8(smooth, 24, 40), _torch_resize(smooth, 24, 40))
    frame = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    np.testing.assert_array_equal(resize_like_torch_uint8(frame, 16, 24), frame)


def test_video_frame_resize_rejects_bad_frames() -> None:
    with pytest.raises(ProcessorError, match="uint8"):
        resize_like_torch_uint8(np.zeros((8, 8, 3), dtype=np.float32), 4, 4)
    with pytest.raises(ProcessorError, match="uint8"):
        resize_like_torch_uint8(np.zeros((8, 8), dtype=np.uint8), 4, 4)
    with pytest.raises(ProcessorError, match="cannot resize"):
        resize_like_torch_uint8(np.zeros((8, 8, 3), dtype=np.uint8), 0, 4)


def test_decoded_video_file_matches_transformers(hf_proc, ours: Processor, tmp_path: Path) -> None:
    """A decoded clip's frames (the engine decodes no files: its callers hand it frames) sampled as transformers
    samples the same decoded clip."""
    rng = np.random.default_rng()
    num_frames, fps = int(rng.integers(20, 34)), 8
    height, width = 2 * int(rng.integers(20, 40)), 2 * int(rng.integers(20, 50))
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    frames = [np.roll(base, 3 * i, axis=1) for i in range(num_frames)]  # moving content the codec keeps roughly
    path = tmp_path / "clip.mp4"
    _write_mp4(path, frames, fps)

    decoded, decoded_fps = _decode_all(path)
    messages = [{"role": "user", "content": [{"type": "video", "video": list(decoded), "fps": decoded_fps},
                                             {"type": "text", "text": "Summary?"}]}]
    text = hf_proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    hf_out = hf_proc(text=[text], videos=[decoded], return_tensors="np", return_metadata=True, videos_kwargs={
        "video_metadata": [VideoMetadata(total_num_frames=len(decoded), fps=decoded_fps)],
    })
    prompt = ours.prepare(messages, add_generation_prompt=True, enable_thinking=False)

    _assert_same_prompt(prompt, hf_out)
    items = _video_items(prompt)
    t, gh, gw = (int(v) for v in hf_out["video_grid_thw"][0])
    assert len(items) == t and all(it.grid_thw == (1, gh, gw) for it in items)
    _close_video(np.concatenate([it.pixel_values for it in items]), hf_out["pixel_values_videos"])
    metadata = hf_out["video_metadata"][0]
    expected_times = hf_proc._calculate_timestamps(list(metadata.frames_indices), metadata.fps, TEMPORAL)
    assert [it.timestamp for it in items] == pytest.approx(expected_times, abs=1e-12)
    rendered = hf_proc.tokenizer.decode(hf_out["input_ids"][0])
    assert re.findall(r"<(\d+\.\d) seconds>", rendered) == [f"{it.timestamp:.1f}" for it in items]


def test_frame_list_video_with_fps_matches_transformers(hf_proc, ours: Processor) -> None:
    rng = np.random.default_rng()
    count, fps = int(rng.integers(9, 16)), 3.0  # 3 fps -> 2 fps sampling drops frames; odd counts get padded
    frames = [_random_image(rng, 37, 53) for _ in range(count)]
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": fps}]}]
    text = hf_proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    hf_out = hf_proc(text=[text], videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="np",
                     return_metadata=True,
                     videos_kwargs={"video_metadata": [VideoMetadata(total_num_frames=count, fps=fps)]})
    prompt = ours.prepare(messages)
    _assert_same_prompt(prompt, hf_out)
    items = _video_items(prompt)
    _close_video(np.concatenate([it.pixel_values for it in items]), hf_out["pixel_values_videos"])
    metadata = hf_out["video_metadata"][0]
    assert ours.video_processor.sample_indices(count, fps).tolist() == list(metadata.frames_indices)


def test_frame_list_without_fps_defaults_like_transformers(hf_proc, ours: Processor) -> None:
    """No fps given: both take the list as a 24 fps clip (so 2 fps sampling keeps few frames)."""
    rng = np.random.default_rng()
    frames = [_random_image(rng, 30, 30) for _ in range(int(rng.integers(30, 60)))]
    messages = [{"role": "user", "content": [{"type": "video", "video": frames}]}]
    text = hf_proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    hf_out = hf_proc(text=[text], videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="np")
    _assert_same_prompt(ours.prepare(messages), hf_out)


def test_per_frame_pixel_cap_matches_transformers(tmp_path: Path) -> None:
    """cap_pixels_per_frame (qwen-vl-utils budget) read from the config and applied as transformers does."""
    _write_folder(tmp_path, video_max_pixels=2000 * 16 * 16)
    cfg = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    cfg.update(cap_pixels_per_frame=True, max_video_tokens=6)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng()
    frames = np.stack([np.asarray(_random_image(rng, 90, 70)) for _ in range(8)])
    messages = [{"role": "user", "content": [{"type": "video", "video": list(frames), "fps": 2.0}]}]
    with pytest.MonkeyPatch.context() as mp:
        if not transformers.utils.is_torchvision_available():
            _torchvision_stand_in(mp)
        hf = AutoProcessor.from_pretrained(tmp_path)
        assert hf.video_processor.cap_pixels_per_frame is True
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        hf_out = hf(text=[text], videos=[frames], return_tensors="np",
                    videos_kwargs={"video_metadata": [VideoMetadata(total_num_frames=8, fps=2.0)]})
    prompt = Processor.from_pretrained(tmp_path).prepare(messages)
    _assert_same_prompt(prompt, hf_out)
    _, gh, gw = (int(v) for v in hf_out["video_grid_thw"][0])
    assert gh * gw // MERGE**2 <= 6 < 2000  # the cap, not the total budget, set the size


def test_mixed_multi_turn_conversation(hf_proc, ours: Processor) -> None:
    rng = np.random.default_rng()
    frames = [_random_image(rng, 40, 30) for _ in range(6)]
    first, second = _random_image(rng, 33, 77), _random_image(rng, 90, 45)
    messages = [
        {"role": "system", "content": "You read documents."},
        {"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "Read it."}]},
        {"role": "assistant", "content": "<think>\nlooking\n</think>\n\nIt says 42."},
        {"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0}, {"type": "image", "image": second},
                                     {"type": "text", "text": "Now these?"}]},
    ]
    text = hf_proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    hf_out = hf_proc(text=[text], images=[first, second], videos=[np.stack([np.asarray(f) for f in frames])],
                     return_tensors="np",
                     videos_kwargs={"video_metadata": [VideoMetadata(total_num_frames=6, fps=2.0)]})
    prompt = ours.prepare(messages, add_generation_prompt=True, enable_thinking=True)
    _assert_same_prompt(prompt, hf_out)
    assert [it.kind for it in prompt.vision_items] == ["image"] + ["video"] * 3 + ["image"]
    np.testing.assert_allclose(np.concatenate([it.pixel_values for it in _image_items(prompt)]),
                               hf_out["pixel_values"], rtol=0, atol=IMAGE_ATOL)
    _close_video(np.concatenate([it.pixel_values for it in _video_items(prompt)]), hf_out["pixel_values_videos"])


# ------------------------------------------------------------------------------------ the ProcessedPrompt contract


def test_vision_items_point_at_their_placeholders(ours: Processor) -> None:
    rng = np.random.default_rng()
    image = _random_image(rng, 50, 70)
    frames = [_random_image(rng, 24, 40) for _ in range(8)]
    prompt = ours.prepare([{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "video", "video": frames, "fps": 2.0},
        {"type": "image", "image": image}, {"type": "text", "text": "?"},
    ]}])
    items = prompt.vision_items
    assert [it.kind for it in items] == ["image", "video", "video", "video", "video", "image"]
    for it in items:
        expected_id = ours.image_token_id if it.kind == "image" else ours.video_token_id
        assert it.num_tokens == np.prod(it.grid_thw) // MERGE**2 == it.token_end - it.token_start
        assert (prompt.token_ids[it.token_start:it.token_end] == expected_id).all()
        assert prompt.token_ids[it.token_start - 1] == ours.tokenizer.token_to_id("<|vision_start|>")
        assert prompt.token_ids[it.token_end] == ours.tokenizer.token_to_id("<|vision_end|>")
        assert it.grid_thw[0] == 1 and it.pixel_values.shape == (np.prod(it.grid_thw), 3 * TEMPORAL * PATCH * PATCH)
        assert it.pixel_values.dtype == np.float32
    assert items[0].content_hash == items[-1].content_hash  # same image twice: one encoder-cache entry
    assert len({it.content_hash for it in items[1:5]}) == 4
    assert [it.timestamp for it in items[1:5]] == [0.25, 1.25, 2.25, 3.25]
    assert items[0].timestamp is None
    assert prompt.token_ids.dtype == np.int64 and prompt.positions.shape == (3, len(prompt))
    assert [it.token_start for it in items] == sorted(it.token_start for it in items)


def test_content_hash_depends_on_processor_parameters(tmp_path: Path, ours: Processor) -> None:
    _write_folder(tmp_path, image_mean=(0.4, 0.5, 0.6))
    other = Processor.from_pretrained(tmp_path)
    image = _random_image(np.random.default_rng(), 40, 40)
    ours_item = ours.prepare([{"role": "user", "content": [{"type": "image", "image": image}]}]).vision_items[0]
    other_item = other.prepare([{"role": "user", "content": [{"type": "image", "image": image}]}]).vision_items[0]
    assert ours_item.content_hash != other_item.content_hash


def test_text_only_messages_and_token_ids(hf_proc, ours: Processor) -> None:
    messages = [{"role": "user", "content": "Plain question, no media."}]
    prompt = ours.prepare(messages)
    expected = hf_proc.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                           enable_thinking=False, return_tensors="np")
    np.testing.assert_array_equal(prompt.token_ids, expected["input_ids"][0])
    np.testing.assert_array_equal(prompt.positions, np.tile(np.arange(len(prompt)), (3, 1)))
    assert prompt.rope_delta == 0 and prompt.vision_items == []
    again = ours.prepare(prompt.token_ids.tolist())
    np.testing.assert_array_equal(again.token_ids, prompt.token_ids)
    np.testing.assert_array_equal(again.positions, prompt.positions)


# -------------------------------------------------------------------------------------------------- bad input


def _user(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part]}]


def test_undecodable_image_bytes(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="message 0, part 0: not a decodable image"):
        ours.prepare(_user({"type": "image", "image": b"definitely not an image"}))


def test_truncated_image(ours: Processor) -> None:
    buffer = io.BytesIO()
    _random_image(np.random.default_rng(), 64, 64).save(buffer, format="PNG")
    with pytest.raises(ProcessorError, match="damaged or truncated|not a decodable"):
        ours.prepare(_user({"type": "image", "image": buffer.getvalue()[:200]}))


def test_missing_image_file(ours: Processor, tmp_path: Path) -> None:
    with pytest.raises(ProcessorError, match="file not found"):
        ours.prepare(_user({"type": "image", "image": str(tmp_path / "nope.png")}))


def test_remote_url_is_refused(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="remote URLs are not fetched"):
        ours.prepare(_user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}))


def test_bad_data_url(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="invalid base64"):
        ours.prepare(_user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}))


def test_decompression_bomb_is_an_error(ours: Processor, monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buffer, format="PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ProcessorError, match="not a decodable image"):
        ours.prepare(_user({"type": "image", "image": buffer.getvalue()}))


def test_extreme_aspect_ratio(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="aspect ratio"):
        ours.prepare(_user({"type": "image", "image": Image.new("RGB", (402, 2))}))


def test_unsupported_part_and_malformed_messages(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="unsupported content type 'audio'"):
        ours.prepare(_user({"type": "audio", "audio": b""}))
    with pytest.raises(ProcessorError, match="needs one of the keys"):
        ours.prepare(_user({"type": "image"}))
    with pytest.raises(ProcessorError, match="non-empty list"):
        ours.prepare([])
    with pytest.raises(ProcessorError, match="string 'role'"):
        ours.prepare([{"content": "x"}])


def test_video_files_are_not_decoded_by_the_engine(ours: Processor, tmp_path: Path) -> None:
    """The engine holds no video decoder (a damaged stream must not crash the process running the model)."""
    path = tmp_path / "clip.mp4"
    _write_mp4(path, [np.zeros((32, 32, 3), dtype=np.uint8)] * 4, 2)
    for source in (str(path), path, "data:video/mp4;base64,AAAA"):
        with pytest.raises(ProcessorError, match="message 0, part 0: a video must be a list of decoded frames"):
            ours.prepare(_user({"type": "video", "video": source}))


def test_presampled_frames_keep_their_timestamps(ours: Processor) -> None:
    """Frames already sampled (by the caller, with gpu_engine.frame_sampling) are not sampled again: each frame
    group is stamped with the mean time of its frames, as transformers stamps the frames it sampled itself."""
    rng = np.random.default_rng()
    frames = [rng.integers(0, 256, (32, 48, 3), dtype=np.uint8) for _ in range(5)]
    times = [0.0, 0.5, 1.0, 4.0, 9.0]
    prompt = ours.prepare(_user({"type": "video", "video": frames, "timestamps": times}))
    items = _video_items(prompt)
    assert [it.timestamp for it in items] == pytest.approx([0.25, 2.5, 9.0])  # 5 frames padded to 6 (last repeated)
    sampled = ours.prepare(_user({"type": "video", "video": frames, "fps": 2.0}))  # 5 frames at 2 fps: sampled
    assert [it.timestamp for it in _video_items(sampled)] == pytest.approx([0.25, 1.25, 2.0])
    with pytest.raises(ProcessorError, match="5 frames but 4 timestamps"):
        ours.prepare(_user({"type": "video", "video": frames, "timestamps": times[:4]}))
    with pytest.raises(ProcessorError, match="not both"):
        ours.prepare(_user({"type": "video", "video": frames, "timestamps": times, "fps": 2.0}))
    with pytest.raises(ProcessorError, match="must not decrease"):
        ours.prepare(_user({"type": "video", "video": frames, "timestamps": times[::-1]}))


def test_video_needs_two_frames(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="at least 2 frames"):
        ours.prepare(_user({"type": "video", "video": [Image.new("RGB", (32, 32))], "fps": 2.0}))


def test_video_frames_of_different_sizes(ours: Processor) -> None:
    frames = [Image.new("RGB", (32, 32)), Image.new("RGB", (48, 32))] * 2
    with pytest.raises(ProcessorError, match="one size"):
        ours.prepare(_user({"type": "video", "video": frames, "fps": 2.0}))


def test_bad_fps(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="fps must be a positive number"):
        ours.prepare(_user({"type": "video", "video": [Image.new("RGB", (32, 32))] * 4, "fps": 0}))


def test_literal_placeholder_in_text(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="placeholder"):
        ours.prepare([{"role": "user", "content": "sneaky <|image_pad|> token"}])


def test_token_ids_with_placeholders(ours: Processor) -> None:
    with pytest.raises(ProcessorError, match="carry no pixels"):
        ours.prepare([1, 2, ours.image_token_id, 3])


def test_missing_processor_config(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    with pytest.raises(ProcessorError, match="preprocessor_config.json"):
        Processor.from_pretrained(tmp_path)


def test_video_config_with_both_fps_and_num_frames(tmp_path: Path) -> None:
    """Sampling by rate and by count exclude each other (transformers raises too); without sampling both may stay."""
    from gpu_engine.preprocessing import VideoProcessor

    _write_folder(tmp_path)
    cfg = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    count = int(np.random.default_rng().integers(4, 64))
    cfg.update(fps=2.0, num_frames=count)
    with pytest.raises(ProcessorError, match="both fps and num_frames"):
        VideoProcessor.from_dict(cfg)
    cfg.update(do_sample_frames=False)
    unsampled = VideoProcessor.from_dict(cfg)
    assert (unsampled.num_frames, unsampled.do_sample_frames) == (count, False)
    assert list(unsampled.sample_indices(count + 3, 30.0)) == list(range(count + 3))  # every frame, no sampling


def test_placeholder_ids_outside_the_vocabulary(ours: Processor) -> None:
    from gpu_engine.tokenizer import TokenizerError

    outside = ours.tokenizer.vocab_size + int(np.random.default_rng().integers(0, 1000))
    for image_id, video_id in ((outside, ours.video_token_id), (ours.image_token_id, outside)):
        with pytest.raises(TokenizerError, match=f"{outside}.*not in the vocabulary"):
            Processor(ours.tokenizer, ours.image_processor, ours.video_processor, image_token_id=image_id,
                      video_token_id=video_id, spatial_merge_size=ours.spatial_merge_size)
    again = Processor(ours.tokenizer, ours.image_processor, ours.video_processor, image_token_id=ours.image_token_id,
                      video_token_id=ours.video_token_id, spatial_merge_size=ours.spatial_merge_size)
    assert (again.image_token, again.video_token) == (ours.image_token, ours.video_token) == ("<|image_pad|>",
                                                                                            "<|video_pad|>")


def test_model_config_disagreement(folder: Path, ours: Processor) -> None:
    vision = types.SimpleNamespace(spatial_merge_size=MERGE)
    wrong_ids = types.SimpleNamespace(image_token_id=1, video_token_id=2, vision=vision)
    with pytest.raises(ProcessorError, match="token ids"):
        Processor.from_pretrained(folder, wrong_ids)
    wrong_merge = types.SimpleNamespace(image_token_id=ours.image_token_id, video_token_id=ours.video_token_id,
                                        vision=types.SimpleNamespace(spatial_merge_size=MERGE + 1))
    with pytest.raises(ProcessorError, match="spatial_merge_size"):
        Processor.from_pretrained(folder, wrong_merge)
