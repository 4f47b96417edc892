"""Decoding of `data:` URLs from chat requests into what the engine takes (PIL images, video files).

Only inline data is accepted: fetching remote URLs from the server would let any client make it reach hosts on
its network (SSRF) and would leak documents' existence. Sizes are checked before and after base64 decoding,
and image dimensions are checked before pixels are decoded (decompression bombs).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote_to_bytes

from PIL import Image

from .errors import ApiError, BodyTooLarge

MAX_IMAGE_PIXELS = 50_000_000  # about 7000 x 7000; larger images are refused, not decoded

# Magic bytes of the video containers the engine can decode; anything else is refused up front.
_VIDEO_MAGIC = (
    (4, b"ftyp"),  # MP4 / MOV (ISO BMFF): "ftyp" at offset 4
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska / WebM
    (0, b"RIFF"),  # AVI
)


class MediaError(ApiError):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(400, code, detail)


@dataclass(frozen=True)
class DataUrl:
    media_type: str
    data: bytes


def parse_data_url(url: str, max_bytes: int) -> DataUrl:
    """Split and decode a `data:[<media type>][;base64],<data>` URL. Refuses every other scheme."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme != "data":
        if scheme in ("http", "https", "ftp", "file"):
            raise MediaError(
                "remote_url_refused",
                f"{scheme}: URLs are not fetched by this server; send the image inline as a data: URL "
                "(data:image/png;base64,...).",
            )
        raise MediaError("invalid_media_url", "Media must be given as a data: URL (data:image/png;base64,...).")
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("invalid_media_url", "The data: URL has no ',' separating its header from the data.")
    params = [p.strip() for p in header.split(";")]
    media_type = params[0].lower() or "text/plain"
    is_base64 = any(p.lower() == "base64" for p in params[1:])
    # base64 grows data by 4/3: refuse before decoding when even the encoded text is clearly too large.
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise BodyTooLarge(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as exc:
        raise MediaError("invalid_media_url", f"The data: URL's base64 payload is not valid: {exc}") from exc
    if len(data) > max_bytes:
        raise BodyTooLarge(max_bytes)
    return DataUrl(media_type=media_type, data=data)


def decode_image(url: str, max_bytes: int) -> Image.Image:
    """A fully loaded RGB image from a data: URL."""
    item = parse_data_url(url, max_bytes)
    try:
        image = Image.open(io.BytesIO(item.data))
        width, height = image.size  # read from the header, before any pixel is decoded
        if width * height > MAX_IMAGE_PIXELS:
            raise MediaError(
                "image_too_large",
                f"The image is {width}x{height} pixels; the limit is {MAX_IMAGE_PIXELS} pixels. Downscale it.",
            )
        image.load()
    except MediaError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError("invalid_image", f"The image could not be decoded ({item.media_type}): {exc}") from exc
    return image.convert("RGB")


def write_video(url: str, max_bytes: int, spool_dir: Path) -> Path:
    """Write a data: URL video to a private temporary file (the engine decodes videos from a path).

    The caller deletes the file when the request ends.
    """
    item = parse_data_url(url, max_bytes)
    if not any(item.data[offset:offset + len(magic)] == magic for offset, magic in _VIDEO_MAGIC):
        raise MediaError("invalid_video", "The video is not MP4, MOV, WebM/Matroska or AVI (checked by content).")
    spool_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="chat-video-", suffix=".bin", dir=spool_dir)
    with os.fdopen(fd, "wb") as out:
        out.write(item.data)
    return Path(name)
