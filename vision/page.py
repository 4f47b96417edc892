"""`MediaPage`: one rendered PDF page, image page or sampled video frame, as yielded by `MediaDocument.pages()`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from PIL import Image

from .errors import MediaError

PageKind = Literal["page", "frame"]


@dataclass
class MediaPage:
    """One output image and what we know about it.

    - `index`: position in the output sequence (0-based, contiguous).
    - `kind`: "page" (PDF page, image, TIFF frame) or "frame" (sampled video frame).
    - `image`: RGB `PIL.Image.Image`, or None when this page failed (then `error` says why; other pages still come).
    - `source_size`: (width, height) of the source: PDF page in points (after /Rotate), raster image in pixels
      (after EXIF orientation), video frame in pixels (after rotation metadata).
    - `dpi`: the DPI the page was rendered at (PDF; lowered when the pixel cap applied) or the DPI the file states
      (images), else None.
    - `timestamp`: seconds from the start of the video (frames only).
    - `frame_index`: the source frame number (video) or page/frame number in the file (PDF, TIFF).
    - `text`: the embedded text layer of a PDF page ("" when the page has none), None for rasters and frames.
      Read lazily on first access (callers that do not need it do not pay for it); still readable after close().
      A damaged PDF whose text cannot be read raises `CorruptMediaError` here.
    - `error`: a `MediaError` for this page only, or None.
    - `draw_ops`: drawing operations counted for this PDF page before it was drawn (`vision.pdf_work`), also when
      a drawing limit refused it; None for rasters and frames.
    - `warnings`: problems the decoder worked around on this page (e.g. MuPDF's "cannot load content" on a
      repaired PDF): the image exists but may be incomplete. Empty when the page decoded cleanly.
    """

    index: int
    kind: PageKind
    image: Image.Image | None
    source_size: tuple[float, float]
    dpi: float | None = None
    timestamp: float | None = None
    frame_index: int | None = None
    error: MediaError | None = None
    warnings: tuple[str, ...] = ()
    draw_ops: int | None = None
    _text_loader: Callable[[], str] | None = field(default=None, repr=False, compare=False)
    _text: str | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.image is not None

    @property
    def text(self) -> str | None:
        if self._text is None and self._text_loader is not None:
            self._text = self._text_loader()
            self._text_loader = None  # drop the reference to the open document
        return self._text
