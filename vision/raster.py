"""Raster images through Pillow: JPEG, PNG, TIFF, WebP, BMP, GIF.

- Only the decoder of the sniffed format is allowed to open the bytes (`Image.open(formats=...)`).
- A file claiming more than `MediaLimits.max_image_pixels` pixels (checked from the header, before decoding) is a
  decompression bomb: `LimitExceededError`. Pillow's own bomb error (above 2 x `PIL.Image.MAX_IMAGE_PIXELS`) maps
  to the same class.
- EXIF orientation is applied; every mode becomes 8-bit RGB (see `colour.to_rgb`).
- Outputs above `MediaLimits.max_page_pixels` are downscaled (JPEGs are decoded at reduced size directly).
- Multi-frame TIFF: every frame is a page (a scanner's multi-page output). GIF, animated WebP and APNG: the first
  frame only — animation in these formats is decoration, not pages; `metadata["frames_in_file"]` shows the count.
- A single-image file is decoded when opened, so a truncated JPEG raises `CorruptMediaError` from `open_media`.
  In a multi-page TIFF a damaged frame becomes a page with `error` set and the other frames still come out.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Iterator

from PIL import Image, ImageOps

from .colour import to_rgb
from .document import MediaDocument
from .errors import CorruptMediaError, LimitExceededError, MediaError, UnsupportedMediaError
from .limits import MediaLimits
from .page import MediaPage

PILLOW_FORMAT = {
    "image/jpeg": "JPEG",
    "image/png": "PNG",
    "image/apng": "PNG",
    "image/tiff": "TIFF",
    "image/webp": "WEBP",
    "image/bmp": "BMP",
    "image/gif": "GIF",
}
_PAGED_FORMATS = {"TIFF"}  # formats whose frames are pages; others contribute their first frame only
_EXIF_ORIENTATION = 0x0112


def _fit(size: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    w, h = size
    if w * h <= max_pixels:
        return size
    scale = math.sqrt(max_pixels / (w * h))
    return max(1, int(w * scale)), max(1, int(h * scale))


class ImageDocument(MediaDocument):
    kind = "image"

    def __init__(self, source: bytes | Path, *, media_type: str, name: str, limits: MediaLimits) -> None:
        self.media_type = media_type
        self._name = name
        self._limits = limits
        fmt = PILLOW_FORMAT.get(media_type)
        if fmt is None:
            raise UnsupportedMediaError(f"{name} is {media_type}, which is not an accepted image format.")
        fp = source if isinstance(source, Path) else io.BytesIO(source)
        try:
            img = Image.open(fp, formats=[fmt])
        except Image.DecompressionBombError as exc:
            raise LimitExceededError(
                f"{name} claims a pixel count Pillow refuses as a decompression bomb ({exc}). Reduce the image size, "
                f"or raise both MediaLimits.max_image_pixels and PIL.Image.MAX_IMAGE_PIXELS."
            ) from exc
        except (OSError, ValueError, SyntaxError) as exc:  # Pillow reports bad headers with all three
            raise CorruptMediaError(
                f"{name} is {media_type} by its signature but its header cannot be read ({exc}); "
                f"the file is damaged — export it again."
            ) from exc
        self._img = img
        frames = int(getattr(img, "n_frames", 1))
        self._count = frames if img.format in _PAGED_FORMATS else 1
        if self._count > limits.max_pages:
            img.close()
            raise LimitExceededError(
                f"{name} has {self._count} pages; the limit is {limits.max_pages} (MediaLimits.max_pages)."
            )
        self.metadata: dict[str, Any] = {
            "format": img.format,
            "frames_in_file": frames,
            "page_count": self._count,
            "mode": img.mode,
            "size": img.size,
        }
        self._first: MediaPage | None = None
        if self._count == 1:
            # The only page: decode now so damage surfaces as an exception from open_media.
            try:
                self._first = self._render(0)
            except BaseException:
                img.close()
                raise
            self._img.close()

    @property
    def page_count(self) -> int:
        return self._count

    def _check_size(self, size: tuple[int, int], number: int) -> None:
        w, h = size
        if w * h > self._limits.max_image_pixels:
            where = f"frame {number + 1} of {self._name}" if self._count > 1 else self._name
            raise LimitExceededError(
                f"{where} claims {w} x {h} = {w * h:,} pixels, above MediaLimits.max_image_pixels "
                f"({self._limits.max_image_pixels:,}); treated as a decompression bomb. Downscale the image or raise "
                f"the limit."
            )

    def _render(self, number: int) -> MediaPage:
        img = self._img
        try:
            img.seek(number)
        except (EOFError, OSError, ValueError) as exc:
            raise CorruptMediaError(f"frame {number + 1} of {self._name} cannot be read ({exc}).") from exc
        self._check_size(img.size, number)
        orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
        w, h = img.size
        source_size = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
        target = _fit(img.size, self._limits.max_page_pixels)
        if img.format == "JPEG" and target != img.size:
            img.draft("RGB", target)  # DCT-domain downscale: decode a smaller image instead of resizing a large one
        try:
            img.load()
            frame = ImageOps.exif_transpose(img)
        except Image.DecompressionBombError as exc:
            raise LimitExceededError(f"{self._name}: {exc}") from exc
        except (OSError, ValueError, SyntaxError) as exc:
            raise CorruptMediaError(
                f"{self._name} could not be decoded ({exc}); it is truncated or damaged — upload it again."
            ) from exc
        rgb = to_rgb(frame)
        fitted = _fit(rgb.size, self._limits.max_page_pixels)
        if fitted != rgb.size:
            rgb = rgb.resize(fitted, Image.Resampling.BICUBIC, reducing_gap=2.0)
        if rgb is img:
            rgb = img.copy()  # detach from the file object, which we close
        dpi = img.info.get("dpi")
        return MediaPage(
            index=number,
            kind="page",
            image=rgb,
            source_size=source_size,
            dpi=float(dpi[0]) if dpi else None,
            frame_index=number,
        )

    def pages(self) -> Iterator[MediaPage]:
        if self._first is not None:
            yield self._first
            return
        for number in range(self._count):
            try:
                yield self._render(number)
            except MediaError as exc:
                yield MediaPage(index=number, kind="page", image=None, source_size=(0, 0), frame_index=number, error=exc)

    def close(self) -> None:
        self._img.close()
