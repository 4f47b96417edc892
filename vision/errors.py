"""Exceptions raised by `vision`.

Every failure a caller can meet is a subclass of `MediaError`, and every message says what was found and what a
person can do about it (re-export, send the password, raise a limit...). The classes form a small tree so callers
can catch broadly (`MediaError`) or precisely:

    MediaError
    ├── UnsupportedMediaError      the content is not an accepted type (names what was found)
    │   ├── AmbiguousMediaError    a polyglot: the bytes are valid as two different types
    │   └── NoVideoStreamError     a video container without a video stream (e.g. audio only)
    ├── EncryptedDocumentError     password missing
    │   └── WrongPasswordError     password given but rejected
    ├── CorruptMediaError          the file is damaged / truncated / cannot be decoded
    │   ├── EmptyMediaError        zero bytes
    │   └── DecoderCrashedError    the isolated decoder process died (signal, out of memory)
    └── LimitExceededError         larger / longer than `MediaLimits` allows
        └── DecodeTimeoutError     the isolated decoder ran past its time limit
            └── RenderTimeoutError a page or a document ran past its render budget
"""

from __future__ import annotations


class MediaError(Exception):
    """Base class of every error raised by `vision`."""


class UnsupportedMediaError(MediaError):
    """The content is not one of the accepted media types."""


class AmbiguousMediaError(UnsupportedMediaError):
    """The bytes can be read as two different types (a polyglot file); we refuse rather than guess."""


class NoVideoStreamError(UnsupportedMediaError):
    """A video container holds no video stream (for example an audio-only MP4)."""


class EncryptedDocumentError(MediaError):
    """The document is encrypted and no password was given."""


class WrongPasswordError(EncryptedDocumentError):
    """A password was given but the document did not accept it."""


class CorruptMediaError(MediaError):
    """The file is damaged, truncated, or otherwise cannot be decoded."""


class EmptyMediaError(CorruptMediaError):
    """The file has zero bytes (usually a failed upload or copy)."""


class DecoderCrashedError(CorruptMediaError):
    """The isolated decoder process died (crashed on a damaged stream or ran out of its memory limit)."""


class LimitExceededError(MediaError):
    """The media is larger, longer or has more pages than the configured `MediaLimits` allow."""


class DecodeTimeoutError(LimitExceededError):
    """Decoding ran past `MediaLimits.decode_timeout_s`."""


class RenderTimeoutError(DecodeTimeoutError):
    """Rendering a page, or a whole document, ran past its budget (`MediaLimits.page_render_timeout_s`,
    `MediaLimits.document_render_timeout_s`)."""
