"""`MediaDocument`: the opened file, whatever its kind. Subclasses live in pdf.py, raster.py and video/."""

from __future__ import annotations

import abc
from typing import Any, Iterator, Literal

from .page import MediaPage

MediaKind = Literal["pdf", "image", "video"]


class MediaDocument(abc.ABC):
    """An opened, sniffed and validated input.

    Attributes: `kind` ("pdf" | "image" | "video"), `media_type` (the MIME type found by content), `page_count`
    (PDF pages, image frames, or for video the planned number of sampled frames; with near-duplicate removal on,
    `pages()` may yield fewer) and `metadata` (a plain dict of facts about the file; keys depend on the kind).

    `pages()` renders lazily: one page or frame at a time, so memory stays bounded whatever the page count.
    Use as a context manager (or call `close()`) to release file handles and temporary files promptly.
    """

    kind: MediaKind
    media_type: str
    metadata: dict[str, Any]

    @property
    @abc.abstractmethod
    def page_count(self) -> int: ...

    @abc.abstractmethod
    def pages(self) -> Iterator[MediaPage]: ...

    def close(self) -> None:  # noqa: B027 - a deliberate no-op default, not abstract
        """Release resources; the default has none."""

    def __enter__(self) -> "MediaDocument":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.media_type} pages={self.page_count}>"
