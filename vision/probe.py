"""`image_size`: what a raster image will cost to decode, read from its header only.

A caller that must budget memory across several images (a chat request with many image parts) asks this before
`open_media` decodes any pixel: Pillow's `Image.open` parses the header lazily, under the sniffed format only.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from .errors import UnsupportedMediaError
from .raster import _decoding
from .sniff import IMAGE_FORMATS, SNIFF_BYTES, sniff


@dataclass(frozen=True)
class ImageSize:
    media_type: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def image_size(data: bytes, *, name: str = "the input") -> ImageSize:
    """Width and height an image claims (first frame), without decoding it. Raises `UnsupportedMediaError` when
    `data` is not an accepted image, `LimitExceededError` for sizes Pillow refuses as decompression bombs, and
    `CorruptMediaError` when the header cannot be parsed."""
    found = sniff(data[:SNIFF_BYTES], name=name)
    fmt = IMAGE_FORMATS.get(found.media_type)
    if found.kind != "image" or fmt is None:
        raise UnsupportedMediaError(f"{name} is {found.media_type}, not an image.")
    with _decoding(name), Image.open(io.BytesIO(data), formats=[fmt]) as img:
        width, height = img.size
    return ImageSize(found.media_type, width, height)
