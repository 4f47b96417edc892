"""Safety limits and rendering options for `open_media`.

`MediaLimits` holds every cap that protects a worker (file size, pages, pixels, video length, decoder time and
memory). `RenderOptions` holds the choices that change what comes out (PDF DPI, Qwen's video frame sampling,
near-duplicate removal). Both are frozen dataclasses with defaults that suit a CPU ingest worker; invalid values
fail at construction with a `ValueError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MiB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Caps applied to every input. Exceeding one raises `LimitExceededError` (except `max_page_pixels`, which
    downscales the output instead: it bounds memory per page without refusing large scans)."""

    max_file_bytes: int = 512 * MiB
    max_pages: int = 2000  # PDF pages or TIFF frames; checked before anything is rendered
    max_page_pixels: int = 16_000_000  # output images (pages, photos, frames) are downscaled to at most this
    # Decoded size a raster file may claim; above it is a decompression bomb. Kept just below Pillow's own
    # warning threshold (89.48 M) so Pillow never warns before we refuse.
    max_image_pixels: int = 89_000_000
    max_video_seconds: float = 600.0
    decode_timeout_s: float = 120.0  # wall time for one isolated video probe or decode run
    decode_memory_bytes: int = 3072 * MiB  # address-space limit of the isolated video decoder process

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"MediaLimits.{f.name} must be > 0, got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class RenderOptions:
    """What the output looks like.

    Video frames follow Qwen3-VL's sampling rule (the defaults of transformers' `Qwen3VLVideoProcessor`):
    `fps` frames per second of video, at least `min_frames` and at most `max_frames` (never more than the clip has),
    spread evenly with linspace over the whole clip; the count is then padded to a multiple of
    `pad_frames_to` (Qwen's temporal patch size, 2) by repeating the last frame, exactly as the processor pads.
    `dedupe_frames` drops frames whose perceptual hash is within `dedupe_max_distance` bits of the previous kept
    frame (for document videos where a page is held still); off by default because it changes the frame count.
    """

    pdf_dpi: float = 150.0
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    pad_frames_to: int = 2
    dedupe_frames: bool = False
    dedupe_max_distance: int = 8  # of 64 bits; the same page re-encoded differs by <= 6, different pages by >= 18

    def __post_init__(self) -> None:
        for name in ("pdf_dpi", "video_fps", "video_min_frames", "video_max_frames", "pad_frames_to"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RenderOptions.{name} must be > 0, got {getattr(self, name)!r}")
        if self.video_min_frames > self.video_max_frames:
            raise ValueError(
                f"RenderOptions.video_min_frames ({self.video_min_frames}) must be <= video_max_frames "
                f"({self.video_max_frames})"
            )
        if self.dedupe_max_distance < 0:
            raise ValueError(f"RenderOptions.dedupe_max_distance must be >= 0, got {self.dedupe_max_distance}")
