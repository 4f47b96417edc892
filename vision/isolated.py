"""`open_isolated`: `open_media` with PDF rendering and image decoding in a separate process, under time budgets.

Why a process: MuPDF and Pillow hold the GIL while they work, so a page that draws for minutes freezes every
thread of the process that renders it (a web server stops answering, even /healthz). Here the work runs in
`vision.render_worker`; the caller's thread only waits on a pipe, and the child is killed when a budget is spent:

- a page (or the single image, decoded at open) may take `MediaLimits.page_render_timeout_s` of wall time;
  over it, that page comes out with a `RenderTimeoutError`, the child is replaced, and the next page renders;
- the whole document, opening and restarts included, may take `MediaLimits.document_render_timeout_s`; once it is
  spent the pages not yet rendered come out with a `RenderTimeoutError` (or, when no page rendered at all,
  `pages()` raises it: the document failed);
- a PDF's drawing operations are counted before each page is drawn (`vision.pdf_work`) against
  `max_page_draw_ops` and, over the pages drawn so far, `max_document_draw_ops` (the count is kept here, so a
  replaced child goes on from it);
- a child that crashes (MuPDF or a codec on damaged data, the memory limit) costs the page it was on
  (`DecoderCrashedError`); at open it is the document's error.

The budget counts the time spent waiting for the child, not the time the caller spends with the pages it got.
Videos already decode in their own isolated process (`vision.video`); `open_isolated` opens them as `open_media`
does, each decoder run capped at half the document budget (a probe and a decode fit in it).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from PIL import Image

from . import errors
from .child import ChildDied, ChildProcess, ChildTimeout
from .document import MediaDocument
from .errors import DecoderCrashedError, MediaError, RenderTimeoutError
from .limits import MediaLimits, RenderOptions
from .opener import identify
from .page import MediaPage
from .render_pool import RenderChild, RenderPool
from .video import VideoDocument

WORKER_MODULE = "vision.render_worker"
START_TIMEOUT_S = 30.0  # a render process loading Python, MuPDF and Pillow (~0.3 s idle, seconds when overloaded)
_DEFAULT_LIMITS = MediaLimits()
_DEFAULT_OPTIONS = RenderOptions()
POOL = RenderPool(WORKER_MODULE)  # warm render processes shared by the documents of this process


def open_isolated(
    path: str | os.PathLike[str],
    *,
    password: str | None = None,
    limits: MediaLimits = _DEFAULT_LIMITS,
    options: RenderOptions = _DEFAULT_OPTIONS,
    name: str | None = None,
    text: bool = True,
) -> MediaDocument:
    """Like `open_media(path, ...)` (a path only: the child reads the file itself), with the work isolated and
    budgeted as described above. `text`: read each PDF page's text layer in the child too (`page.text`)."""
    source, label, found = identify(path, name=name, limits=limits)
    assert isinstance(source, Path)
    if found.kind == "video":
        capped = replace(limits, decode_timeout_s=min(limits.decode_timeout_s, limits.document_render_timeout_s / 2))
        return VideoDocument(source, media_type=found.media_type, name=label, limits=capped, options=options)
    return IsolatedDocument(source, name=label, password=password, limits=limits, options=options, text=text)


def _media_error(payload: dict[str, Any]) -> MediaError:
    cls = getattr(errors, payload["class"], MediaError)
    if not (isinstance(cls, type) and issubclass(cls, MediaError)):
        cls = MediaError
    return cls(payload["message"])


class IsolatedDocument(MediaDocument):
    """A PDF or image document whose pages render in a child process (see the module docstring)."""

    def __init__(self, path: Path, *, name: str, password: str | None, limits: MediaLimits,
                 options: RenderOptions, text: bool) -> None:
        self._path, self._name, self._password = path, name, password
        self._limits, self._options, self._text = limits, options, text
        self._spent = 0.0  # seconds waited on children for this document
        self._draw_ops_spent = 0  # drawing operations of the pages drawn (MediaLimits.max_document_draw_ops)
        self._child: ChildProcess | None = None
        self._render_child: RenderChild | None = None  # the pool's record of `_child`
        self._in_flight = False  # a request was sent and its reply not read (an interrupted wait): never reuse
        opened = self._start()
        self.kind = opened["kind"]
        self.media_type = opened["media_type"]
        self._count = int(opened["page_count"])
        self.metadata: dict[str, Any] = opened["metadata"]

    @property
    def page_count(self) -> int:
        return self._count

    @property
    def seconds_spent(self) -> float:
        """Wall time this document's rendering has used of `MediaLimits.document_render_timeout_s`."""
        return self._spent

    # --- the budget ----------------------------------------------------------------------------------------------
    def _left(self) -> float:
        return self._limits.document_render_timeout_s - self._spent

    def _document_spent(self) -> RenderTimeoutError:
        return RenderTimeoutError(
            f"rendering {self._name} stopped after {self._spent:.1f} s, the budget of one document "
            f"(MediaLimits.document_render_timeout_s = {self._limits.document_render_timeout_s:g} s); its pages "
            f"are too expensive to draw. Split or simplify the document (e.g. print it to images), or raise the "
            f"limit if the file is trusted."
        )

    def _ask(self, request: dict[str, Any]) -> tuple[dict[str, Any], bytearray]:
        """One request to the child within what is left of both budgets. Raises ChildTimeout / ChildDied (the
        child is then gone) and RenderTimeoutError when the document budget was already spent."""
        if self._child is None:
            raise RuntimeError("no render process")  # callers start one first
        timeout = min(self._limits.page_render_timeout_s, self._left())
        if timeout <= 0:
            raise self._document_spent()
        self._child.request(request)
        self._in_flight = True
        try:
            header, payload, waited = self._child.read(timeout)
        except ChildTimeout:
            self._spent += timeout
            self._child = None
            raise
        except ChildDied:
            self._child = None
            raise
        self._in_flight = False
        self._spent += waited
        return header, payload

    # --- the child -----------------------------------------------------------------------------------------------
    def _start(self) -> dict[str, Any]:
        """A fresh child with the file open; its "opened" reply. Raises the document's MediaError."""
        self._render_child = POOL.take(memory_bytes=self._limits.decode_memory_bytes,
                                       document_budget_s=self._limits.document_render_timeout_s)
        self._child = self._render_child.process
        self._in_flight = False
        if not self._render_child.ready:
            try:
                self._await_ready()
            except BaseException:
                self.close()
                raise
            self._render_child.ready = True
        request = {"op": "open", "path": str(self._path), "password": self._password, "name": self._name,
                   "limits": asdict(self._limits),
                   # PDF and image output depends on the DPI only (video options hold a callable and stay here)
                   "options": {"pdf_dpi": self._options.pdf_dpi}}
        try:
            header, _ = self._ask(request)
        except ChildTimeout:
            if self._left() <= 0:
                raise self._document_spent() from None
            raise RenderTimeoutError(
                f"opening {self._name} took longer than {self._limits.page_render_timeout_s:g} s "
                f"(MediaLimits.page_render_timeout_s); the file is built to be expensive to decode (a huge or "
                f"many-framed image, a damaged PDF that takes long to repair). Re-export it, or raise the limit."
            ) from None
        except ChildDied as died:
            raise self._crashed(died, f"opening {self._name}") from None
        except BaseException:
            self.close()
            raise
        if header["type"] == "error":
            self.close()
            raise _media_error(header["error"])
        return header

    def _await_ready(self) -> None:
        """Wait for the child's interpreter and decoders to load (not a cost of this file's pages, so outside
        the page budget, but inside the document's)."""
        assert self._child is not None
        timeout = min(START_TIMEOUT_S, self._left())
        if timeout <= 0:
            raise self._document_spent()
        try:
            _, _, waited = self._child.read(timeout)
        except ChildTimeout:
            self._child = None
            self._spent += timeout
            if self._left() <= 0:
                raise self._document_spent() from None
            raise DecoderCrashedError(
                f"the render process did not start within {START_TIMEOUT_S:g} s; the machine is overloaded — "
                f"try again later.") from None
        except ChildDied as died:
            self._child = None
            raise self._crashed(died, "starting") from None
        self._spent += waited

    def _crashed(self, died: ChildDied, doing: str) -> DecoderCrashedError:
        detail = f" It said: {died.stderr_tail}" if died.stderr_tail else ""
        return DecoderCrashedError(
            f"the render process {died.how} while {doing}; the file is probably damaged — export or upload it "
            f"again.{detail}"
        )

    # --- pages ---------------------------------------------------------------------------------------------------
    def pages(self) -> Iterator[MediaPage]:
        rendered_ok = False
        for number in range(self._count):
            try:
                if self._child is None:
                    self._start()  # the previous child was killed for its page; this one goes on from here
                page = self._render(number)
            except MediaError as exc:  # the document budget is spent, or the file no longer opens in a new child
                self.close()
                if not rendered_ok:
                    raise
                yield from self._unrendered(number, exc)
                return
            rendered_ok = rendered_ok or page.ok
            yield page

    def _unrendered(self, start: int, error: MediaError) -> Iterator[MediaPage]:
        for number in range(start, self._count):
            yield MediaPage(index=number, kind="page", image=None, source_size=(0.0, 0.0), frame_index=number,
                            error=error)

    def _render(self, number: int) -> MediaPage:
        """Page `number` from the child; a page over its budget or a crash is a page with `error` set. Raises
        RenderTimeoutError when the document budget is spent."""
        try:
            header, payload = self._ask({"op": "page", "index": number, "text": self._text,
                                         "draw_ops_spent": self._draw_ops_spent})
        except ChildTimeout:
            if self._left() <= 0:
                raise self._document_spent() from None
            return self._failed(number, RenderTimeoutError(
                f"page {number + 1} of {self._name} took longer than {self._limits.page_render_timeout_s:g} s to "
                f"render (MediaLimits.page_render_timeout_s) and was stopped; the other pages are unaffected. "
                f"The page is built to be expensive to draw: flatten or rasterise it, or raise the limit."))
        except ChildDied as died:
            return self._failed(number, self._crashed(died, f"rendering page {number + 1} of {self._name}"))
        if header["type"] == "error":
            return self._failed(number, _media_error(header["error"]))
        page = self._page(header, payload)
        if page.ok and page.draw_ops:
            self._draw_ops_spent += page.draw_ops
        return page

    def _failed(self, number: int, error: MediaError) -> MediaPage:
        return MediaPage(index=number, kind="page", image=None, source_size=(0.0, 0.0), frame_index=number,
                         error=error)

    def _page(self, header: dict[str, Any], payload: bytearray) -> MediaPage:
        image = Image.frombytes("RGB", tuple(header["size"]), payload) if header["size"] else None
        text_error = _media_error(header["text_error"]) if header["text_error"] else None

        def text() -> str:
            if text_error is not None:
                raise text_error
            return header["text"] or ""

        return MediaPage(
            index=header["index"], kind=header["kind"], image=image,
            source_size=(float(header["source_size"][0]), float(header["source_size"][1])), dpi=header["dpi"],
            frame_index=header["frame_index"], warnings=tuple(header["warnings"]), draw_ops=header["draw_ops"],
            error=_media_error(header["error"]) if header["error"] else None,
            _text_loader=text if self.kind == "pdf" and self._text else None,
        )

    def close(self) -> None:
        """Hand a cleanly idle render process back to the pool; stop one that was interrupted mid-request."""
        child, render_child = self._child, self._render_child
        self._child, self._render_child = None, None
        if child is None or render_child is None:
            return
        if self._in_flight:
            child.close()
        else:
            POOL.give_back(render_child)
