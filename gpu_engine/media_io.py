"""Media in for the processor: PIL images from PIL images, bytes, file paths or data: URLs (EXIF orientation
honoured, decompression bombs refused), and decoded video frames checked as uint8 RGB arrays. Remote URLs are
never fetched and video files never decoded here (docpipe decodes them in an isolated process: vision.open_media)."""
from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .data_url import DataUrlError, parse_data_url
from .processing_errors import ProcessorError


def _decode_image_bytes(data: bytes, what: str) -> Image.Image:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # oversized images are errors, not warnings
        try:
            image: Image.Image = Image.open(io.BytesIO(data))
            image.load()
            # Like transformers' load_image for files/URLs: honour the EXIF orientation. In place: the image is
            # ours, and an image without a rotation then costs no full-size copy.
            ImageOps.exif_transpose(image, in_place=True)
        except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ProcessorError(f"{what}: not a decodable image ({exc})") from exc
        except (OSError, ValueError, SyntaxError) as exc:
            raise ProcessorError(f"{what}: damaged or truncated image ({exc})") from exc
    return image


def _data_url_bytes(url: str, what: str) -> bytes:
    try:
        return parse_data_url(url).data
    except DataUrlError as exc:
        raise ProcessorError(f"{what}: {exc}") from exc


def load_image(source: Any, what: str = "image") -> Image.Image:
    """A PIL image from a PIL image, bytes, a file path or a base64 data: URL. Remote URLs are not fetched."""
    if isinstance(source, Image.Image):
        try:
            source.load()
        except (OSError, ValueError) as exc:
            raise ProcessorError(f"{what}: damaged image ({exc})") from exc
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode_image_bytes(bytes(source), what)
    if isinstance(source, (str, Path)):
        text = str(source)
        if text.startswith("data:"):
            return _decode_image_bytes(_data_url_bytes(text, what), what)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text):
            raise ProcessorError(f"{what}: remote URLs are not fetched by the engine ({text[:60]}); pass bytes or "
                                 "a path")
        path = Path(text)
        if not path.is_file():
            raise ProcessorError(f"{what}: file not found: {path}")
        return _decode_image_bytes(path.read_bytes(), f"{what} ({path})")
    raise ProcessorError(f"{what}: unsupported image value of type {type(source).__name__}")


def frame_array(frame: Any, what: str) -> np.ndarray:
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB") if frame.mode != "RGB" else frame, dtype=np.uint8)
    array = np.asarray(frame)
    if array.ndim == 3 and array.shape[-1] == 3 and array.dtype == np.uint8:
        return array
    raise ProcessorError(f"{what}: frames must be PIL images or uint8 [H, W, 3] arrays, got {array.dtype} "
                         f"{array.shape}")
