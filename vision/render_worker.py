"""The isolated render process: `python -m vision.render_worker`, started by `vision.isolated`, never imported by it.

It opens one PDF or image file with `open_media` and renders the pages it is asked for, one request at a time,
so that MuPDF and Pillow run outside the caller's process: a page that draws for minutes holds this process's
GIL, not the server's, and the parent kills this process when its budget is spent.

Requests (JSON lines on stdin): {"op": "open", path, password, name, limits, options} then {"op": "page",
"index": n, "text": bool} any number of times; another "open" replaces the document (a pooled process, see
`vision.render_pool`). Replies (framed, see `vision.child`): "ready" once at start (imports done), then "opened"
(kind, media_type, page_count, metadata) or "error" (the MediaError class name and message); "page" with the
page's fields and its RGB pixels as payload.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, BinaryIO

from vision.child import send
from vision.document import MediaDocument
from vision.errors import MediaError
from vision.limits import MediaLimits, RenderOptions
from vision.opener import open_media


def _error(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, MemoryError):
        return {"class": "DecoderCrashedError", "message": "the render process ran out of its memory limit "
                "(MediaLimits.decode_memory_bytes); reduce the page size or DPI, or raise the limit."}
    if isinstance(exc, MediaError):
        return {"class": type(exc).__name__, "message": str(exc)}
    return {"class": "MediaError", "message": f"internal error in the render process: {type(exc).__name__}: {exc}"}


def _open(request: dict[str, Any]) -> MediaDocument:
    return open_media(Path(request["path"]), password=request["password"],
                      limits=MediaLimits(**request["limits"]), options=RenderOptions(**request["options"]),
                      name=request["name"])


def _page(doc: MediaDocument, request: dict[str, Any], out: BinaryIO) -> None:
    # PDF pages count drawing work against the document's budget, kept by the parent across render processes
    spent = {"draw_ops_spent": request["draw_ops_spent"]} if doc.kind == "pdf" else {}
    page = doc.render_page(request["index"], **spent)  # type: ignore[attr-defined]  # PDF and image documents
    header: dict[str, Any] = {
        "type": "page", "index": page.index, "kind": page.kind, "source_size": list(page.source_size),
        "dpi": page.dpi, "frame_index": page.frame_index, "warnings": list(page.warnings), "draw_ops": page.draw_ops,
        "error": _error(page.error) if page.error is not None else None, "size": None, "text": None,
        "text_error": None,
    }
    payload = b""
    if page.image is not None:
        header["size"] = list(page.image.size)
        payload = page.image.tobytes()  # RGB, 3 bytes per pixel
    if request.get("text") and page.ok:
        try:
            header["text"] = page.text
        except MediaError as exc:
            header["text_error"] = _error(exc)
    send(out, header, payload)


def main() -> int:
    # The protocol owns stdout; anything a library prints goes to stderr, which the parent quotes on a crash.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    send(out, {"type": "ready"})  # imports done: from here on the parent's page budget applies
    doc: MediaDocument | None = None
    while line := sys.stdin.readline():
        request = json.loads(line)
        try:
            if request["op"] == "open":
                if doc is not None:  # a pooled process: the previous document is done
                    doc.close()
                    doc = None
                doc = _open(request)
                metadata = json.loads(json.dumps(doc.metadata, default=str))
                send(out, {"type": "opened", "kind": doc.kind, "media_type": doc.media_type,
                           "page_count": doc.page_count, "metadata": metadata})
            else:
                assert doc is not None, "page requested before open"
                _page(doc, request, out)
        except (Exception, MemoryError) as exc:  # noqa: BLE001 — every failure is a reply, the parent decides
            send(out, {"type": "error", "error": _error(exc)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
