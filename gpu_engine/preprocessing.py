"""Image and video preprocessing for Qwen3.5-family models: sizes, frame sampling, resampling, pixels to patches
(ImageProcessor, VideoProcessor). Numerically follows transformers 5.17 (Qwen2VLImageProcessor,
Qwen3VLVideoProcessor).

Resampling, two paths, each exactly as transformers resizes on CPU:
- images: Pillow bicubic on uint8 RGB, as transformers' PIL image backend (Qwen2VLImageProcessorPil) does; equal
  to it within float32 rounding of the normalisation (1e-6).
- video frames: transformers' video processor hands the uint8 frames to torchvision's resize, which on CPU calls
  torch's native uint8 `interpolate(mode="bicubic", antialias=True, align_corners=False)`: Keys cubic with
  a = -0.5, support scaled by the downscale factor, normalised weights turned into int16 fixed point, a width pass
  then a height pass, each rounding to uint8. `resize_like_torch_uint8` is that computation in numpy, integer for
  integer, so frames equal transformers' bit for bit (tested against torch's kernel here; against torchvision
  0.26 and transformers' Qwen3VLVideoProcessor on the GPU host: no value differed). transformers run with
  device="cuda" would resize in float32 on the GPU instead; that path is not modelled.
Everything else — sizes, sampling, patch order, tokens, positions, timestamps — is exact.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .frame_resize import resize_like_torch_uint8
from .frame_sampling import qwen_frame_indices, spread_indices
from .processing_errors import ProcessorError

# --------------------------------------------------------------------------------------------- sizes and sampling


def smart_resize_image(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ProcessorError(f"image aspect ratio must be at most 200:1, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(
    num_frames: int, height: int, width: int, *, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Like the image rule, but the pixel budget counts all frames (rounded to whole temporal patches)."""
    if num_frames < temporal_factor:
        raise ProcessorError(
            f"a video needs at least {temporal_factor} frames (temporal patch size), got {num_frames}"
        )
    if height < factor or width < factor:  # tiny frames are first scaled up so the short side reaches `factor`
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ProcessorError(f"video aspect ratio must be at most 200:1, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_group_timestamps(frame_times: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Seconds per frame group: the mean time of its first and last frame (the last frame pads an odd count)."""
    times = [float(t) for t in frame_times]
    if len(times) % temporal_patch_size:
        times += [times[-1]] * (temporal_patch_size - len(times) % temporal_patch_size)
    return [
        (times[g] + times[g + temporal_patch_size - 1]) / 2 for g in range(0, len(times), temporal_patch_size)
    ]


# ------------------------------------------------------------------------------------------- pixels to patches


def _patch_view(frames: np.ndarray, patch_size: int, merge_size: int, frames_per_group: int) -> np.ndarray:
    """uint8 [F, H, W, C] (F a multiple of frames_per_group) -> a view
    [groups, gh/m, (gw/m)*m*m, C, frames_per_group, p*p]: frame group, band of merge windows, then the band's
    rows, in the vision tower's row order (group by group, inside a group merge window by merge window, each
    window's merge_size**2 patches adjacent: the order its patch merger expects)."""
    f, h, w, c = frames.shape
    gt, gh, gw = f // frames_per_group, h // patch_size, w // patch_size
    x = frames.reshape(gt, frames_per_group, gh // merge_size, merge_size, patch_size,
                       gw // merge_size, merge_size, patch_size, c)
    # -> (gt, gh/m, gw/m, m_h, m_w, C, tp, p_h, p_w)
    return x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)


@dataclass(frozen=True)
class _PixelParams:
    """What both processors share (preprocessor_config.json / video_preprocessor_config.json fields)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    do_convert_rgb: bool

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str) -> _PixelParams:
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels", size.get("shortest_edge"))
        max_pixels = cfg.get("max_pixels", size.get("longest_edge"))
        if min_pixels is None or max_pixels is None:
            raise ProcessorError(f"{source}: needs size.shortest_edge and size.longest_edge (min/max pixels)")
        resample = cfg.get("resample", 3)
        if resample not in (3, "bicubic", None):
            raise ProcessorError(f"{source}: resample={resample!r} is not supported (only 3 = bicubic)")
        try:
            params = cls(
                patch_size=int(cfg["patch_size"]),
                temporal_patch_size=int(cfg["temporal_patch_size"]),
                merge_size=int(cfg["merge_size"]),
                min_pixels=int(min_pixels),
                max_pixels=int(max_pixels),
                image_mean=tuple(float(v) for v in cfg.get("image_mean", (0.5, 0.5, 0.5))),
                image_std=tuple(float(v) for v in cfg.get("image_std", (0.5, 0.5, 0.5))),
                rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                do_resize=bool(cfg.get("do_resize", True)),
                do_rescale=bool(cfg.get("do_rescale", True)),
                do_normalize=bool(cfg.get("do_normalize", True)),
                do_convert_rgb=bool(cfg.get("do_convert_rgb", True)),
            )
        except KeyError as exc:
            raise ProcessorError(f"{source}: missing key {exc.args[0]!r}") from exc
        if min(params.patch_size, params.temporal_patch_size, params.merge_size) < 1:
            raise ProcessorError(f"{source}: patch_size, temporal_patch_size and merge_size must be positive")
        if len(params.image_mean) != 3 or len(params.image_std) != 3:
            raise ProcessorError(f"{source}: image_mean and image_std need 3 values (RGB)")
        return params

    def patches(self, frames: np.ndarray, *, still: bool = False) -> np.ndarray:
        """uint8 [F, H, W, C] -> float32 [rows, C*tp*p*p]: the vision tower's input rows, normalised.

        `still`: F == 1, a still image repeated to fill one temporal patch (its copies are normalised once and
        duplicated); otherwise F is a multiple of temporal_patch_size. Values equal transformers' (see
        `_mean_std`), whatever the order in which they are computed: each is a function of one pixel.
        """
        tp = self.temporal_patch_size
        per_group = 1 if still else tp
        if frames.shape[0] % per_group or (still and frames.shape[0] != 1):
            raise ProcessorError(f"{frames.shape[0]} frames do not fill whole temporal patches of {per_group}")
        view = _patch_view(frames, self.patch_size, self.merge_size, per_group)
        gt, bands, band_w, m = view.shape[0], view.shape[1], view.shape[2], self.merge_size
        c, pp = frames.shape[3], self.patch_size * self.patch_size
        out = np.empty((gt, bands, band_w * m * m, c, tp, pp), dtype=np.float32)
        mean_std = self._mean_std()
        # One band of merge windows at a time (~0.1-1 MB): the uint8 gather, the normalisation and the copies of a
        # still image stay in the CPU cache, and no full-size temporary is made.
        for g in range(gt):
            for band in range(bands):
                pixels = np.ascontiguousarray(view[g, band]).reshape(-1, c, per_group, pp)
                rows = out[g, band]
                self._normalise_into(rows[:, :, :per_group], pixels, mean_std)
                if per_group < tp:
                    rows[:, :, per_group:] = rows[:, :, :per_group]
        return out.reshape(-1, c * tp * pp)

    def _mean_std(self) -> tuple[np.ndarray, np.ndarray] | None:
        """float32 mean and std per channel, shaped to broadcast over [rows, C, t, p*p]; None without do_normalize.

        transformers folds the rescale into mean/std (mean/rescale, std/rescale, in float32), then subtracts and
        divides in float32; its PIL backend rescales then normalises, which agrees to ~1e-7.
        """
        if not self.do_normalize:
            return None
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        if self.do_rescale:
            inv = np.float32(1.0 / self.rescale_factor)
            mean, std = mean * inv, std * inv
        return mean.reshape(1, -1, 1, 1), std.reshape(1, -1, 1, 1)

    def _normalise_into(self, out: np.ndarray, pixels: np.ndarray,
                        mean_std: tuple[np.ndarray, np.ndarray] | None) -> None:
        """uint8 `pixels` -> float32 `out` (same shape), as transformers' fused torch op computes each value.
        Writing into `out` changes no rounding: uint8 -> float32 is exact, then one float32 subtract and divide."""
        if mean_std is not None:
            np.subtract(pixels, mean_std[0], out=out)
            np.divide(out, mean_std[1], out=out)
        elif self.do_rescale:
            out[...] = pixels.astype(np.float64) * self.rescale_factor  # float64, rounded once to float32
        else:
            out[...] = pixels

    def fingerprint(self, kind: str, extra: Mapping[str, Any] | None = None) -> bytes:
        """Canonical bytes of every parameter that changes pixels: part of each item's content hash."""
        fields = dict(self.__dict__)
        fields["kind"] = kind
        fields.update(extra or {})
        return json.dumps(fields, sort_keys=True, default=list).encode()


def _resize_rgb(image: Image.Image, height: int, width: int) -> Image.Image:
    """Pillow bicubic resize of a uint8 RGB image: transformers' PIL image backend exactly."""
    if image.size == (width, height):
        return image
    return image.resize((width, height), resample=Image.Resampling.BICUBIC)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # float32 [grid_h*grid_w, C*tp*p*p]
    grid_thw: tuple[int, int, int]
    content_hash: str

    @property
    def num_tokens(self) -> int:
        return self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]


@dataclass(frozen=True)
class FrameGroup:
    """One temporal patch of a video (grid t == 1): what one VisionItem of kind "video" carries."""

    pixel_values: np.ndarray  # float32 [grid_h*grid_w, C*tp*p*p]
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w)
    timestamp: float
    content_hash: str


@dataclass(frozen=True)
class ProcessedVideo:
    frame_groups: list[FrameGroup]
    frame_times: list[float]  # seconds of each sampled frame in the source video

    @property
    def grid_thw(self) -> tuple[int, int, int]:  # the whole video, as transformers reports it
        _, gh, gw = self.frame_groups[0].grid_thw
        return (len(self.frame_groups), gh, gw)

    @property
    def pixel_values(self) -> np.ndarray:
        return np.concatenate([g.pixel_values for g in self.frame_groups], axis=0)

    @property
    def timestamps(self) -> list[float]:
        return [g.timestamp for g in self.frame_groups]


def hash_pixels(pixels: np.ndarray, grid_thw: tuple[int, int, int], params: bytes) -> str:
    """The encoder- and prefix-cache key of one vision item: sha256 over its uint8 pixels after resizing
    ([F, H, W, C]: one image, or the frames of one temporal patch), their shape, the grid and the processor
    parameters. The float32 rows are a function of exactly these, so equal keys mean equal rows; hashing the
    uint8 pixels reads a quarter (an image: an eighth) of the bytes."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).data)
    digest.update(json.dumps([list(pixels.shape), list(grid_thw)]).encode())
    digest.update(params)
    return digest.hexdigest()


@dataclass(frozen=True)
class ImageProcessor:
    """Still images -> patches (the image is repeated to fill one temporal patch), like Qwen2VLImageProcessor."""

    params: _PixelParams

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "preprocessor_config.json") -> ImageProcessor:
        return cls(_PixelParams.from_dict(cfg, source))

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ImageProcessor:
        path = Path(folder) / "preprocessor_config.json"
        return cls.from_dict(_read_config(path), str(path))

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        p = self.params
        if not p.do_resize:
            return height, width
        return smart_resize_image(height, width, factor=p.factor, min_pixels=p.min_pixels, max_pixels=p.max_pixels)

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        p = self.params
        if p.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if image.mode != "RGB":
            raise ProcessorError(f"image mode {image.mode!r} is not RGB and do_convert_rgb is off")
        height, width = self.target_size(image.height, image.width)
        if height % p.factor or width % p.factor:
            raise ProcessorError(f"image size {width}x{height} is not a multiple of {p.factor} (do_resize is off)")
        hwc = np.asarray(_resize_rgb(image, height, width), dtype=np.uint8)[None]  # [1, H, W, 3]
        pixel_values = p.patches(hwc, still=True)  # a still image fills one temporal patch
        grid = (1, height // p.patch_size, width // p.patch_size)
        return ProcessedImage(pixel_values, grid, hash_pixels(hwc, grid, p.fingerprint("image")))


@dataclass(frozen=True)
class VideoProcessor:
    """Video frames -> frame groups of patches + timestamps, like Qwen3VLVideoProcessor. The fields are the
    video_preprocessor_config.json keys of the same names; sampling by `fps` and by `num_frames` exclude each other."""

    params: _PixelParams
    _: KW_ONLY
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        if self.do_sample_frames and self.fps is not None and self.num_frames is not None:
            raise ProcessorError("video processor config sets both fps and num_frames; they are mutually exclusive")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "video_preprocessor_config.json") -> VideoProcessor:
        fps = cfg.get("fps", 2.0)
        num_frames = cfg.get("num_frames")
        return cls(
            _PixelParams.from_dict(cfg, source),
            fps=float(fps) if fps is not None else None,
            num_frames=int(num_frames) if num_frames is not None else None,
            min_frames=int(cfg.get("min_frames", 4)),
            max_frames=int(cfg.get("max_frames", 768)),
            do_sample_frames=bool(cfg.get("do_sample_frames", True)),
            cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(cfg.get("max_video_tokens", 768)),
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> VideoProcessor:
        path = Path(folder) / "video_preprocessor_config.json"
        if not path.is_file():  # older checkpoints keep one config for both
            path = Path(folder) / "preprocessor_config.json"
        return cls.from_dict(_read_config(path), str(path))

    def sample_indices(self, total_frames: int, video_fps: float) -> np.ndarray:
        """Frame indices to keep: `fps` frames per second of video, clamped to [min_frames, max_frames]
        (gpu_engine.frame_sampling), or the config's fixed `num_frames`, or every frame."""
        if total_frames < 1:
            raise ProcessorError("the video has no frames")
        if not self.do_sample_frames:
            return np.arange(total_frames)
        if self.num_frames is not None:
            return np.asarray(spread_indices(total_frames, self.num_frames))
        if self.fps is None:
            return np.asarray(spread_indices(total_frames, min(max(total_frames, self.min_frames), self.max_frames)))
        return np.asarray(qwen_frame_indices(total_frames, video_fps, fps=self.fps, min_frames=self.min_frames,
                                             max_frames=self.max_frames))

    def target_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        p = self.params
        if not p.do_resize:
            if num_frames < p.temporal_patch_size:
                raise ProcessorError(f"a video needs at least {p.temporal_patch_size} frames, got {num_frames}")
            return height, width
        max_pixels = p.max_pixels
        if self.cap_pixels_per_frame:  # per-frame budget as qwen-vl-utils computes it
            frame_cap = self.max_video_tokens * p.factor * p.factor
            per_frame = max(min(frame_cap, p.max_pixels // num_frames), int(p.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return smart_resize_video(
            num_frames, height, width, temporal_factor=p.temporal_patch_size, factor=p.factor,
            min_pixels=p.min_pixels, max_pixels=max_pixels,
        )

    def preprocess(self, frames: Sequence[np.ndarray], frame_times: Sequence[float]) -> ProcessedVideo:
        """`frames`: the SAMPLED frames, uint8 RGB [H, W, 3], all one size; `frame_times`: their times in seconds."""
        p = self.params
        if len(frames) != len(frame_times):
            raise ProcessorError(f"{len(frames)} frames but {len(frame_times)} frame times")
        if not frames:
            raise ProcessorError("the video has no frames")
        shapes = {tuple(f.shape) for f in frames}
        if len(shapes) != 1:
            raise ProcessorError(f"all video frames must have one size, got {sorted(shapes)}")
        height, width = frames[0].shape[:2]
        target_h, target_w = self.target_size(len(frames), height, width)
        if target_h % p.factor or target_w % p.factor:
            raise ProcessorError(f"frame size {target_w}x{target_h} is not a multiple of {p.factor} (do_resize is off)")
        hwc = np.stack([resize_like_torch_uint8(f, target_h, target_w) for f in frames])
        if pad := -len(hwc) % p.temporal_patch_size:  # an odd count is completed with the last frame
            hwc = np.concatenate([hwc, np.repeat(hwc[-1:], pad, axis=0)])
        pixel_values = p.patches(hwc)
        gh, gw = target_h // p.patch_size, target_w // p.patch_size
        group_rows = gh * gw
        tp = p.temporal_patch_size
        timestamps = frame_group_timestamps(frame_times, tp)
        fingerprint = p.fingerprint("video")
        groups = []
        for g, seconds in enumerate(timestamps):
            rows = pixel_values[g * group_rows:(g + 1) * group_rows]
            grid = (1, gh, gw)
            groups.append(FrameGroup(rows, grid, seconds, hash_pixels(hwc[g * tp:(g + 1) * tp], grid, fingerprint)))
        return ProcessedVideo(groups, [float(t) for t in frame_times])


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise ProcessorError(f"processor config not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ProcessorError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ProcessorError(f"{path}: expected a JSON object")
    return data
