"""PDF pages through PyMuPDF (MuPDF): lazy, one page rendered at a time.

- Pages render at `RenderOptions.pdf_dpi`; a page whose render would exceed `MediaLimits.max_page_pixels` is
  rendered at a lower DPI instead (the page's `dpi` says which), so a poster-sized page cannot exhaust memory.
- `/Rotate` is honoured: MuPDF's page rectangle and pixmap are already in display orientation.
- More pages than `MediaLimits.max_pages` is refused before anything is rendered.
- Encrypted files need the password (`EncryptedDocumentError` / `WrongPasswordError`). Files that are encrypted
  with an owner password only (anyone may open them) open normally; `metadata["encrypted"]` records it.
- Damaged files MuPDF had to repair open with `metadata["repaired"] = True` (and its messages in
  `metadata["warnings"]`); a page MuPDF renders with complaints carries them in `MediaPage.warnings`; a page that
  fails to render becomes a page with `error` set, and the other pages come out. (MuPDF's warning store is
  process-wide: concurrent renders in threads of one process may see each other's warnings.)
- A page whose drawing work (operators, with nested form XObjects counted as often as drawn, see `pdf_work`)
  exceeds `MediaLimits.max_page_draw_ops`, or would take the document's drawn pages past
  `max_document_draw_ops`, is a page with `error` set (`LimitExceededError`), never drawn.
- Vector pages are drawn by MuPDF straight into the memory of the PIL image they become (`_render_rgb`): no
  intermediate pixmap, no unpacking copy. Pages that are mostly one image (scans) take get_pixmap + frombytes,
  which is faster for them.
- The page's text layer (`MediaPage.text`) is read on first access, in content-stream order (lazily, because text
  extraction costs a third of a simple page's render time and many callers never use it). It stays readable after
  `close()`: an unread page keeps the MuPDF document alive until the page is dropped.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path
from typing import Any, Iterator

import PIL
import pymupdf
from PIL import Image

from .document import MediaDocument
from .errors import CorruptMediaError, EncryptedDocumentError, LimitExceededError, MediaError, WrongPasswordError
from .limits import MediaLimits, RenderOptions
from .page import MediaPage
from .pdf_work import DrawWork

# PyMuPDF is not thread-safe (one global MuPDF context, one warning store), so every call into it from this module
# holds this lock: threaded callers (a web server's thread pool) are safe, processes still render in parallel.
_MUPDF = threading.RLock()

# MuPDF prints every repair warning to stderr; we report damage through metadata, page warnings and page errors.
pymupdf.TOOLS.mupdf_display_errors(False)
pymupdf.TOOLS.mupdf_display_warnings(False)


def _take_warnings() -> tuple[str, ...]:
    """MuPDF's warnings since the last call (MuPDF keeps one process-wide store)."""
    text = pymupdf.TOOLS.mupdf_warnings(reset=True)
    return tuple(line for line in text.splitlines() if line.strip())


def _open(source: bytes | Path, name: str) -> pymupdf.Document:
    try:
        if isinstance(source, Path):
            return pymupdf.open(source, filetype="pdf")
        return pymupdf.open(stream=source, filetype="pdf")
    except Exception as exc:  # MuPDF raises several types (FileDataError, RuntimeError, ValueError)
        # MuPDF's message names the file it was given: a server-side storage path that must not reach clients.
        reason = str(exc).replace(str(source), name) if isinstance(source, Path) else str(exc)
        raise CorruptMediaError(
            f"{name} looks like a PDF but cannot be opened ({reason}); it is probably truncated or damaged — "
            f"download or export it again."
        ) from exc


def _page_text(doc: pymupdf.Document, number: int, name: str) -> str:
    # Bound to the MuPDF document, not to PdfDocument: a page whose text is still unread keeps the MuPDF document
    # alive after PdfDocument.close(), so `page.text` works whenever it is read.
    # MuPDF's content-stream order; sort=True (geometric order) costs ~10x more on text-heavy pages
    with _MUPDF:
        try:
            return doc.load_page(number).get_text("text")
        except Exception as exc:  # MuPDF raises several types (RuntimeError, ValueError) on a damaged page tree
            raise CorruptMediaError(
                f"the text of page {number + 1} of {name} cannot be read ({exc}); the file is damaged — export it "
                f"again."
            ) from exc


def render_scale(width_pt: float, height_pt: float, dpi: float, max_pixels: int) -> float:
    """Pixels per point for `dpi`, lowered so that the rendered page has at most `max_pixels` pixels."""
    scale = dpi / 72.0
    pixels = (width_pt * scale + 1) * (height_pt * scale + 1)  # +1: MuPDF rounds the pixmap outwards
    if pixels > max_pixels:
        scale *= math.sqrt(max_pixels / pixels)
    return scale


# Image.fromarrow re-typing RGBX as RGB without a copy: Pillow 12.3 segfaults in __arrow_c_array__ on an image made
# by frombuffer (seen on the GPU machine's image with Pillow 12.3.0 + Python 3.12, reproduced here); 13.0 is fine.
ARROW_RETYPE_SAFE = int(PIL.__version__.split(".")[0]) >= 13


def _mostly_raster(page: pymupdf.Page, pixels: int) -> bool:
    """Whether the images the page lists hold at least a quarter as many pixels as its render: a scan, not a
    vector page with a logo. (Images inside form XObjects or inline may be missed: then the page is treated as
    vector, which is only slower, never different.)"""
    return 4 * sum(width * height for _, _, width, height, *_ in page.get_images()) >= pixels


def _render_rgb(page: pymupdf.Page, scale: float) -> Image.Image:
    """`page` drawn at `scale` pixels per point as a PIL RGB image, with the size and pixels of
    `page.get_pixmap(matrix=Matrix(scale, scale))` (a few pixels of blended content may differ by one level).

    Why not get_pixmap + Image.frombytes: PIL keeps RGB as 4 bytes per pixel (R, G, B, pad), so building the image
    from MuPDF's 3-byte samples costs a second full-page buffer and an unpacking pass, as much again as drawing a
    vector page. Here MuPDF draws an opaque RGBA pixmap (alpha 255 is the pad byte PIL expects) into a buffer we own,
    and PIL adopts that buffer without copying (`frombuffer` maps it, `fromarrow` re-types RGBX as RGB; both keep
    the buffer alive). Caller holds `_MUPDF`."""
    mu = pymupdf.mupdf
    matrix = mu.FzMatrix(scale, 0, 0, scale, 0, 0)
    # the same pixel box get_pixmap uses: the page's bounds (after /Rotate), transformed, rounded outwards
    box = mu.fz_round_rect(mu.fz_transform_rect(mu.fz_bound_page(page.this), matrix))
    size = (box.x1 - box.x0, box.y1 - box.y0)
    if _mostly_raster(page, size[0] * size[1]):
        # MuPDF paints images into an alpha pixmap more slowly (~2 ms per A4 page at 150 dpi) than the unpacking
        # copy below costs (~1 ms), so scans keep the plain route.
        pix = page.get_pixmap(matrix=pymupdf.Matrix(scale, scale), colorspace=pymupdf.csRGB, alpha=False)
        return Image.frombytes("RGB", size, pix.samples_mv)
    buffer = bytearray(size[0] * size[1] * 4)
    pixmap = mu.fz_new_pixmap_with_bbox_and_data(mu.fz_device_rgb(), box, mu.FzSeparations(), 1,
                                                 mu.python_mutable_buffer_data(buffer))
    mu.fz_clear_pixmap_with_value(pixmap, 0xFF)  # white, alpha 255
    device = mu.fz_new_draw_device(matrix, pixmap)
    mu.fz_run_page(page.this, device, mu.FzMatrix(), mu.FzCookie())  # page contents, annotations, widgets
    mu.fz_close_device(device)
    rgbx = Image.frombuffer("RGBX", size, buffer, "raw", "RGBX", 0, 1)
    if not ARROW_RETYPE_SAFE:
        return rgbx.convert("RGB")  # one extra copy, still no unpacking from 3-byte samples
    return Image.fromarrow(rgbx, "RGB", size)


class PdfDocument(MediaDocument):
    kind = "pdf"
    media_type = "application/pdf"

    def __init__(
        self,
        source: bytes | Path,
        *,
        name: str,
        password: str | None,
        limits: MediaLimits,
        options: RenderOptions,
    ) -> None:
        self._name = name
        self._limits = limits
        self._options = options
        with _MUPDF:
            self._open(source, password)

    def _open(self, source: bytes | Path, password: str | None) -> None:
        name, limits, options = self._name, self._limits, self._options
        _take_warnings()
        doc = _open(source, name)
        open_warnings = _take_warnings()
        try:
            encrypted = doc.is_encrypted
            if doc.needs_pass:
                if password is None:
                    raise EncryptedDocumentError(
                        f"{name} is password-protected; send the password with the document, or upload an "
                        f"unprotected copy."
                    )
                if not doc.authenticate(password):
                    raise WrongPasswordError(f"the password given for {name} is not accepted; check it and retry.")
            try:
                count = doc.page_count
            except RuntimeError as exc:  # a damaged page tree: MuPDF cannot count the pages
                raise CorruptMediaError(
                    f"{name} is a PDF whose page list cannot be read ({exc}); it is damaged — export it again."
                ) from exc
            if count == 0:
                raise CorruptMediaError(f"{name} is a PDF without any readable page; it is damaged or empty.")
            if count > limits.max_pages:
                raise LimitExceededError(
                    f"{name} has {count} pages; the limit is {limits.max_pages} (MediaLimits.max_pages). "
                    f"Split the document or raise the limit."
                )
        except BaseException:
            doc.close()
            raise
        self._doc = doc
        self._count = count
        self._work = DrawWork(doc)
        self.draw_ops_spent = 0  # operations of the pages drawn so far (MediaLimits.max_document_draw_ops)
        info = doc.metadata or {}  # PyMuPDF leaves it None until the document is decrypted
        self.metadata: dict[str, Any] = {
            "page_count": count,
            "repaired": bool(doc.is_repaired),
            # is_encrypted turns False once authenticated and is False for owner-password-only files
            "encrypted": bool(encrypted or info.get("encryption")),
            "encryption": info.get("encryption") or "",
            "format": info.get("format", ""),
            "title": info.get("title", ""),
            "author": info.get("author", ""),
            "producer": info.get("producer", ""),
            "dpi": options.pdf_dpi,
            "warnings": list(open_warnings),
        }

    @property
    def page_count(self) -> int:
        return self._count

    def render_page(self, number: int, *, draw_ops_spent: int | None = None) -> MediaPage:
        """Render one page (0-based). Failures come back as a page with `error` set, never as an exception.
        `draw_ops_spent`: the document's drawing operations so far, when the caller keeps the count (a render
        process replaced mid-document); default: this object's own count."""
        with _MUPDF:
            page = self._render(number, self.draw_ops_spent if draw_ops_spent is None else draw_ops_spent)
        if page.ok and page.draw_ops:
            self.draw_ops_spent += page.draw_ops
        return page

    def _render(self, number: int, spent: int) -> MediaPage:
        _take_warnings()
        try:
            page = self._doc.load_page(number)
            rect = page.rect
            work = self._work.page(page)
            if work > self._limits.max_page_draw_ops or spent + work > self._limits.max_document_draw_ops:
                return self._too_much_drawing(number, work, spent, (rect.width, rect.height))
            scale = render_scale(rect.width, rect.height, self._options.pdf_dpi, self._limits.max_page_pixels)
            image = _render_rgb(page, scale)
        except Exception as exc:
            size = (0.0, 0.0)
            error = CorruptMediaError(
                f"page {number + 1} of {self._name} cannot be rendered ({exc}); the other pages are unaffected. "
                f"Re-export the document to recover this page."
            )
            return MediaPage(index=number, kind="page", image=None, source_size=size, frame_index=number, error=error,
                             warnings=_take_warnings())
        return MediaPage(
            index=number,
            kind="page",
            image=image,
            source_size=(rect.width, rect.height),
            dpi=scale * 72.0,
            frame_index=number,
            warnings=_take_warnings(),
            draw_ops=work,
            _text_loader=functools.partial(_page_text, self._doc, number, self._name),
        )

    def _too_much_drawing(self, number: int, work: int, spent: int, size: tuple[float, float]) -> MediaPage:
        limits = self._limits
        if work > limits.max_page_draw_ops:
            error = LimitExceededError(
                f"page {number + 1} of {self._name} would draw about {work:,} operations (form XObjects drawn "
                f"inside each other), above MediaLimits.max_page_draw_ops ({limits.max_page_draw_ops:,}); it was "
                f"not rendered. Flatten or rasterise the page, or raise the limit if the file is trusted."
            )
        else:
            error = LimitExceededError(
                f"page {number + 1} of {self._name} was not rendered: its {work:,} drawing operations would take "
                f"the document past MediaLimits.max_document_draw_ops ({limits.max_document_draw_ops:,}; "
                f"{spent:,} spent on earlier pages). Split or flatten the document, or raise the limit if the file "
                f"is trusted."
            )
        return MediaPage(index=number, kind="page", image=None, source_size=size, frame_index=number, error=error,
                         warnings=_take_warnings(), draw_ops=work)

    def pages(self) -> Iterator[MediaPage]:
        for number in range(self._count):
            if self._doc is None:
                raise MediaError(f"{self._name} was closed; open it again to read more pages.")
            yield self.render_page(number)

    def close(self) -> None:
        # Drop our reference; MuPDF closes the file when the last page with unread text is gone too.
        self._doc = None  # type: ignore[assignment]  # only pages() reads it after close, and checks
