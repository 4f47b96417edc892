"""`open_media`: the single entry point from bytes or a path to a `MediaDocument`."""

from __future__ import annotations

import os
from pathlib import Path

from .document import MediaDocument
from .errors import LimitExceededError
from .limits import MediaLimits, RenderOptions
from .pdf import PdfDocument
from .raster import ImageDocument
from .sniff import SNIFF_BYTES, Sniffed, sniff
from .video import VideoDocument

_DEFAULT_LIMITS = MediaLimits()
_DEFAULT_OPTIONS = RenderOptions()


def open_media(
    path_or_bytes: str | os.PathLike[str] | bytes | bytearray | memoryview,
    *,
    password: str | None = None,
    limits: MediaLimits = _DEFAULT_LIMITS,
    options: RenderOptions = _DEFAULT_OPTIONS,
    name: str | None = None,
) -> MediaDocument:
    """Sniff `path_or_bytes` by content and open it as a PDF, image or video document.

    `password` opens encrypted PDFs. `limits` caps sizes and decoder resources; `options` sets PDF DPI and video
    frame sampling. `name` is used in error messages (default: the file's base name, or "the input" for bytes);
    pass the user's original file name so messages make sense to them.

    Raises a `MediaError` subclass for any problem with the content. A path that does not exist or cannot be read
    raises the usual `OSError` (that is a problem of the caller, not of the media).
    """
    source, label, found = identify(path_or_bytes, name=name, limits=limits)
    if found.kind == "pdf":
        return PdfDocument(source, name=label, password=password, limits=limits, options=options)
    if found.kind == "image":
        return ImageDocument(source, media_type=found.media_type, name=label, limits=limits)
    return VideoDocument(source, media_type=found.media_type, name=label, limits=limits, options=options)


def identify(
    path_or_bytes: str | os.PathLike[str] | bytes | bytearray | memoryview, *, name: str | None, limits: MediaLimits
) -> tuple[bytes | Path, str, Sniffed]:
    """(the source as bytes or a Path, the name for messages, what the content is). Checks the size limit."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
        source: bytes | Path = data
        size = len(data)
        head = data[:SNIFF_BYTES]
        label = name or "the input"
    else:
        source = Path(path_or_bytes)
        size = source.stat().st_size
        with source.open("rb") as f:
            head = f.read(SNIFF_BYTES)
        label = name or source.name
    if size > limits.max_file_bytes:
        raise LimitExceededError(
            f"{label} is {size:,} bytes; the limit is {limits.max_file_bytes:,} (MediaLimits.max_file_bytes)."
        )
    return source, label, sniff(head, name=label)
