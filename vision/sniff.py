"""Type detection by content (magic bytes), never by file name or a client's content type.

Library choice: `filetype` (pure Python, no system library, reads only the first bytes) over `python-magic`, which
needs the libmagic shared library and its database on every host (ingest workers, GPU boxes, CI) and whose
answers change with the installed database version. `filetype` recognises every type we accept; what it does not
recognise we refuse anyway, so libmagic's wider catalogue would only improve the wording of refusals.

On top of the library we add one rule of our own: a file that starts as one accepted type but carries a PDF header
within the first 1024 bytes (where PDF readers look for it) is a polyglot. Two readers would see two different
documents, so we refuse it instead of guessing.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import filetype

from .document import MediaKind
from .errors import AmbiguousMediaError, EmptyMediaError, UnsupportedMediaError

SNIFF_BYTES = 8192  # filetype never looks further than this
_PDF_HEADER_WINDOW = 1024  # PDF readers accept "%PDF-" anywhere in the first 1 KiB

# Accepted image types and the Pillow format that must decode each one (raster.py checks the decoder agrees).
IMAGE_FORMATS: dict[str, str] = {
    "image/jpeg": "JPEG",
    "image/png": "PNG",
    "image/apng": "PNG",
    "image/tiff": "TIFF",
    "image/webp": "WEBP",
    "image/bmp": "BMP",
    "image/gif": "GIF",
    "image/heic": "HEIF",
}

ACCEPTED: dict[str, MediaKind] = {
    "application/pdf": "pdf",
    **{media_type: "image" for media_type in IMAGE_FORMATS},
    "video/mp4": "video",
    "video/x-m4v": "video",
    "video/quicktime": "video",
    "video/x-matroska": "video",
    "video/webm": "video",
}

_REFUSAL_HINTS = {
    "image/avif": "AVIF is not supported; convert the image to PNG or JPEG.",
    "application/zip": "archives are not unpacked; upload the files inside it one by one.",
}


@dataclass(frozen=True)
class Sniffed:
    kind: MediaKind
    media_type: str


def _text_start(head: bytes) -> str | None:
    """The first 512 bytes as text when they are printable UTF-8 (a script, a README, notes), else None."""
    try:
        # incremental: a multi-byte character cut at byte 512 is not a reason to call text binary
        text = codecs.getincrementaldecoder("utf-8")().decode(head[:512], final=False)
    except UnicodeDecodeError:
        return None
    return text if text and all(c.isprintable() or c in "\r\n\t" for c in text) else None


def is_plain_text(head: bytes) -> bool:
    """True when `head` is printable UTF-8 text with no accepted media signature: no page can come from it."""
    return _text_start(head) is not None and filetype.guess(head) is None


def _describe_unknown(head: bytes) -> str:
    text = _text_start(head)
    if text is not None:
        return f"plain text starting with {text[:40]!r}"
    return f"unrecognised data starting with {head[:8].hex(' ')}"


def sniff(head: bytes, *, name: str = "input") -> Sniffed:
    """Classify `head` (the first `SNIFF_BYTES` of a file, or all of it). Raises an `UnsupportedMediaError`
    subclass (or `EmptyMediaError`) naming what was found."""
    if not head:
        raise EmptyMediaError(f"{name} is empty (0 bytes); the upload or copy probably failed — send the file again.")
    found = filetype.guess(head)
    if found is None:
        raise UnsupportedMediaError(
            f"{name} is not an accepted media type: found {_describe_unknown(head)}. "
            f"Accepted: PDF, JPEG, PNG, TIFF, WebP, BMP, GIF, HEIC, MP4, MOV, MKV, WebM."
        )
    mime = found.mime
    if mime not in ACCEPTED:
        hint = _REFUSAL_HINTS.get(mime, "convert it to PDF, PNG/JPEG or MP4.")
        raise UnsupportedMediaError(f"{name} is {mime} (.{found.extension}), which is not accepted: {hint}")
    kind = ACCEPTED[mime]
    if kind != "pdf":
        at = head.find(b"%PDF-", 0, _PDF_HEADER_WINDOW)
        if at >= 0:
            raise AmbiguousMediaError(
                f"{name} starts as {mime} but also carries a PDF header at byte {at}, so it reads as two different "
                f"documents (a polyglot file). Re-export it from the original application as a single format."
            )
    return Sniffed(kind=kind, media_type=mime)
