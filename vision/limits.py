"""Safety limits and rendering options for `open_media`.

`MediaLimits` holds every cap that protects a worker (file size, pages, pixels, video length, decoder time and
memory, render time per page and per document, drawing work per PDF page). `RenderOptions` holds the choices that
change what comes out (PDF DPI, Qwen's video frame sampling, near-duplicate removal). Both are frozen dataclasses
with defaults that suit a CPU ingest worker; invalid values fail at construction with a `ValueError` naming the
field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

MiB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Caps applied to every input. Exceeding one raises `LimitExceededError` (except `max_page_pixels`, which
    downscales the output instead: it bounds memory per page without refusing large scans)."""

    max_file_bytes: int = 512 * MiB
    max_pages: int = 2000  # PDF pages or TIFF frames; checked before anything is rendered
    max_page_pixels: int = 16_000_000  # output images (pages, photos, frames) are downscaled to at most this
    # Raster images (photos, scans) are downscaled further, to at most this: 2048 x 1536 at 4:3. The model's
    # processor would send a 12 MP phone photo at full size (~11.8k tokens; its vision attention grows with the
    # square of that, ~18 A4 pages of tower time, bench/results/cuda_notes.md, session 7). At this cap an A4 sheet
    # filling 86 % of the photo's long side is still at 150 dpi, the PDF render's resolution (a 300 dpi A4 scan
    # becomes ~180 dpi). PDF pages (pdf_dpi) and video frames (the video processor's budget) are not affected.
    max_photo_pixels: int = 3_145_728
    # Decoded size a raster file may claim; above it is a decompression bomb. Kept just below Pillow's own
    # warning threshold (89.48 M) so Pillow never warns before we refuse.
    max_image_pixels: int = 89_000_000
    max_video_seconds: float = 600.0
    decode_timeout_s: float = 120.0  # wall time for one isolated video probe or decode run
    decode_memory_bytes: int = 3072 * MiB  # address-space limit of the isolated video and render processes
    # Render budgets (the isolated render process, `open_isolated`): a PDF page rendered or an image / TIFF frame
    # decoded may take this much wall time, the whole document (opening included) this much. A clean A4 page at
    # 150 dpi takes 15-60 ms, so a normal 2,000-page scan uses a few minutes of the document budget on a busy core.
    page_render_timeout_s: float = 20.0
    document_render_timeout_s: float = 900.0
    # Drawing operators one PDF page may expand to, counted before it is drawn: a form XObject counts as often as
    # it is drawn, so nested forms fanned out ("billion laughs") are refused at once instead of rendered for hours.
    # Dense vector pages (maps, CAD) draw a few hundred thousand.
    max_page_draw_ops: int = 5_000_000
    # ... and all pages of one document together: a deterministic bound (time budgets depend on the machine). A
    # 2,000-page vector document averaging 100,000 operations a page fits.
    max_document_draw_ops: int = 200_000_000

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"MediaLimits.{f.name} must be > 0, got {getattr(self, f.name)!r}")
        if self.page_render_timeout_s > self.document_render_timeout_s:
            raise ValueError(
                f"MediaLimits.page_render_timeout_s ({self.page_render_timeout_s}) must be <= "
                f"document_render_timeout_s ({self.document_render_timeout_s})"
            )


@dataclass(frozen=True)
class RenderOptions:
    """What the output looks like.

    `frame_sampler(total_frames, video_fps)` chooses a video's frames (source indices); None keeps every frame.
    vision holds no sampling rule of its own: the model's rule lives with the model (docpipe passes
    `gpu_engine.frame_sampling.QwenFrameSampler`), so a video is sampled once, by the rule the engine uses. The plan
    is then padded to a multiple of `pad_frames_to` (Qwen's temporal patch size, 2) by repeating the last frame,
    exactly as the processor pads.
    `dedupe_frames` drops frames whose perceptual hash is within `dedupe_max_distance` bits of the previous kept
    frame (for document videos where a page is held still); off by default because it changes the frame count.
    """

    pdf_dpi: float = 150.0
    frame_sampler: Callable[[int, float], Sequence[int]] | None = None
    pad_frames_to: int = 2
    dedupe_frames: bool = False
    dedupe_max_distance: int = 8  # of 64 bits; the same page re-encoded differs by <= 6, different pages by >= 18

    def __post_init__(self) -> None:
        for name in ("pdf_dpi", "pad_frames_to"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RenderOptions.{name} must be > 0, got {getattr(self, name)!r}")
        if self.frame_sampler is not None and not callable(self.frame_sampler):
            raise ValueError(f"RenderOptions.frame_sampler must be callable, got {self.frame_sampler!r}")
        if self.dedupe_max_distance < 0:
            raise ValueError(f"RenderOptions.dedupe_max_distance must be >= 0, got {self.dedupe_max_distance}")
