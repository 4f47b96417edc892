"""Raster images through Pillow: JPEG, PNG, TIFF, WebP, BMP, GIF, and HEIC (through the pillow-heif plugin).

- Only the decoder of the sniffed format is allowed to open the bytes (`Image.open(formats=...)`).
- A file claiming more than `MediaLimits.max_image_pixels` pixels (checked from the header, before decoding) is a
  decompression bomb: `LimitExceededError`. Pillow's own bomb error (above 2 x `PIL.Image.MAX_IMAGE_PIXELS`) maps
  to the same class.
- EXIF orientation is applied; every mode becomes 8-bit RGB (see `colour.to_rgb`).
- Outputs above `MediaLimits.max_photo_pixels` (or `max_page_pixels`, if lower) are downscaled (JPEGs are decoded at
  reduced size directly).
- Multi-frame TIFF: every frame is a page (a scanner's multi-page output). GIF, animated WebP and APNG: the first
  frame only — animation in these formats is decoration, not pages; `metadata["frames_in_file"]` shows the count.
- A single-image file is decoded when opened, so a truncated JPEG raises `CorruptMediaError` from `open_media`.
  In a multi-page TIFF a damaged frame becomes a page with `error` set and the other frames still come out.
"""

from __future__ import annotations

import io
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pillow_heif
from PIL import Image, ImageOps, UnidentifiedImageError

from .colour import to_rgb
from .document import MediaDocument
from .errors import CorruptMediaError, LimitExceededError, MediaError, UnsupportedMediaError
from .limits import MediaLimits
from .page import MediaPage
from .sniff import IMAGE_FORMATS

# Makes the "HEIF" format known to Pillow (process-wide, harmless to other users). libheif applies the file's own
# rotation ('irot') and resets the EXIF orientation, so exif_transpose below does not rotate twice.
pillow_heif.register_heif_opener()
_PAGED_FORMATS = {"TIFF"}  # formats whose frames are pages; others contribute their first frame only
_EXIF_ORIENTATION = 0x0112


@contextmanager
def _decoding(what: str) -> Iterator[None]:
    """Map failures while Pillow parses untrusted bytes to our errors.

    Pillow's plugins report malformed input with many exception types (OSError, ValueError, SyntaxError, TypeError,
    KeyError, struct.error, EOFError...), so this boundary catches Exception; MemoryError is re-raised untouched.
    """
    try:
        yield
    except (MediaError, MemoryError):
        raise
    except Image.DecompressionBombError as exc:
        raise LimitExceededError(
            f"{what} claims a pixel count Pillow refuses as a decompression bomb ({exc}). Reduce the image size, "
            f"or raise both MediaLimits.max_image_pixels and PIL.Image.MAX_IMAGE_PIXELS."
        ) from exc
    except Exception as exc:  # noqa: BLE001 — Pillow raises many kinds for a broken file (see docstring)
        # UnidentifiedImageError's text names a Python object; say what it means instead
        detail = ("the header cannot be parsed" if isinstance(exc, UnidentifiedImageError)
                  else f"{type(exc).__name__}: {exc}")
        raise CorruptMediaError(
            f"{what} cannot be decoded ({detail}); the file is truncated or damaged — export or upload it again."
        ) from exc


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
        fmt = IMAGE_FORMATS.get(media_type)
        if fmt is None:
            raise UnsupportedMediaError(f"{name} is {media_type}, which is not an accepted image format.")
        fp = source if isinstance(source, Path) else io.BytesIO(source)
        with _decoding(name):
            img = Image.open(fp, formats=[fmt])
        self._img = img
        try:
            with _decoding(name):
                frames = int(getattr(img, "n_frames", 1))  # TIFF walks its whole page chain here
            self._count = frames if img.format in _PAGED_FORMATS else 1
            if self._count > limits.max_pages:
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
            # The only page: decode now, so damage surfaces as an exception from open_media.
            self._first = self._render(0) if self._count == 1 else None
        except BaseException:
            img.close()
            raise
        if self._first is not None:
            img.close()

    @property
    def page_count(self) -> int:
        return self._count

    def _render(self, number: int) -> MediaPage:
        img = self._img
        where = f"page {number + 1} of {self._name}" if self._count > 1 else self._name
        with _decoding(where):
            img.seek(number)
            w, h = img.size
            if w * h > self._limits.max_image_pixels:
                raise LimitExceededError(
                    f"{where} claims {w} x {h} = {w * h:,} pixels, above MediaLimits.max_image_pixels "
                    f"({self._limits.max_image_pixels:,}); treated as a decompression bomb. Downscale the image or "
                    f"raise the limit."
                )
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
            source_size = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
            cap = min(self._limits.max_page_pixels, self._limits.max_photo_pixels)
            target = _fit((w, h), cap)
            if img.format == "JPEG" and target != (w, h):
                img.draft("RGB", target)  # DCT-domain downscale: decode a smaller image instead of shrinking a big one
            img.load()
            rgb = to_rgb(ImageOps.exif_transpose(img))
        fitted = _fit(rgb.size, cap)
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

    def render_page(self, number: int) -> MediaPage:
        """Decode one page (0-based). Failures come back as a page with `error` set, never as an exception."""
        if self._first is not None and number == 0:
            return self._first
        try:
            return self._render(number)
        except MediaError as exc:
            return MediaPage(index=number, kind="page", image=None, source_size=(0, 0), frame_index=number, error=exc)

    def pages(self) -> Iterator[MediaPage]:
        for number in range(self._count):
            yield self.render_page(number)

    def close(self) -> None:
        self._img.close()
