"""vision: media in. Turns a PDF, image or short video into an ordered, lazy stream of RGB page/frame images.

Public API (stable; the pipeline codes against these names):

    from vision import open_media, MediaLimits, RenderOptions, MediaPage, MediaError

    with open_media(path_or_bytes, password=None, limits=MediaLimits(), options=RenderOptions()) as doc:
        doc.kind          # "pdf" | "image" | "video"
        doc.media_type    # MIME type found from the content (magic bytes), never from the name
        doc.page_count    # pages, or the planned number of sampled video frames
        doc.metadata      # dict of facts (repaired, encrypted, fps, duration, rotation, frame_indices, ...)
        for page in doc.pages():          # lazy: one page/frame rendered at a time
            page.image                    # PIL RGB image, or None if this page failed
            page.index, page.kind         # output position; "page" | "frame"
            page.timestamp                # seconds (frames only)
            page.source_size, page.dpi    # source size (PDF points / pixels) and render DPI
            page.text                     # PDF text layer (lazy), None for rasters/frames
            page.error                    # MediaError for this page only, or None
            page.warnings                 # what the decoder worked around (e.g. a repaired PDF page)
        doc.frames_at([0.0, 1.5])         # video only: decode just the frames shown at these times

Accepted (by content): PDF; JPEG, PNG (APNG: first frame), TIFF (all frames are pages), WebP, BMP, GIF (first
frame only), HEIC (pillow-heif); MP4, MOV, MKV, WebM video. AVIF and everything else are refused, naming the type.

Errors (all subclasses of `MediaError`, each message says what was found and what to do):
`UnsupportedMediaError` (`AmbiguousMediaError` for polyglots, `NoVideoStreamError`), `EncryptedDocumentError`
(`WrongPasswordError`), `CorruptMediaError` (`EmptyMediaError`, `DecoderCrashedError`), `LimitExceededError`
(`DecodeTimeoutError`, `RenderTimeoutError`). Video decoding runs in a separate process with time and memory
limits, so a crashing decoder raises `DecoderCrashedError` instead of killing the caller. `open_isolated(path, ...)`
does the same for PDF pages and images (a render process, killed when `MediaLimits.page_render_timeout_s` or
`document_render_timeout_s` is spent): use it wherever a slow file must not stall the calling process.
"""

from .document import MediaDocument
from .errors import (
    AmbiguousMediaError,
    CorruptMediaError,
    DecoderCrashedError,
    DecodeTimeoutError,
    EmptyMediaError,
    EncryptedDocumentError,
    LimitExceededError,
    MediaError,
    NoVideoStreamError,
    RenderTimeoutError,
    UnsupportedMediaError,
    WrongPasswordError,
)
from .isolated import open_isolated
from .limits import MediaLimits, RenderOptions
from .opener import open_media
from .page import MediaPage
from .probe import ImageSize, image_size
from .sniff import ACCEPTED as ACCEPTED_MEDIA_TYPES
from .sniff import SNIFF_BYTES, Sniffed, sniff
from .video.sampling import pad_indices

__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "AmbiguousMediaError",
    "CorruptMediaError",
    "DecodeTimeoutError",
    "DecoderCrashedError",
    "EmptyMediaError",
    "EncryptedDocumentError",
    "LimitExceededError",
    "MediaDocument",
    "MediaError",
    "MediaLimits",
    "ImageSize",
    "MediaPage",
    "NoVideoStreamError",
    "RenderOptions",
    "RenderTimeoutError",
    "SNIFF_BYTES",
    "Sniffed",
    "UnsupportedMediaError",
    "WrongPasswordError",
    "open_isolated",
    "image_size",
    "open_media",
    "pad_indices",
    "sniff",
]
