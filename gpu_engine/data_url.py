"""`data:` URL parsing, in its one home (the engine's messages and docpipe's chat endpoint both use it).

Only inline data is read: fetching a remote URL would let whoever writes the message make the process reach hosts
on its network (SSRF). Sizes are checked before and after base64 decoding, so an oversized payload is refused
before it is decoded.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote_to_bytes

from .processing_errors import ProcessorError

_REMOTE_SCHEMES = ("http", "https", "ftp", "file")


class DataUrlError(ProcessorError):
    """A media URL that is not a readable data: URL. `reason` tells callers which kind of refusal it is."""

    def __init__(self, reason: Literal["remote", "not_data", "malformed", "too_large"], message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DataUrl:
    media_type: str  # as the URL declares it (callers sniff the bytes; this is never trusted)
    data: bytes


def parse_data_url(url: str, max_bytes: int | None = None) -> DataUrl:
    """Split and decode a `data:[<media type>][;base64],<data>` URL; every other scheme is refused."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme != "data":
        if scheme in _REMOTE_SCHEMES:
            raise DataUrlError("remote", f"{scheme}: URLs are not fetched; send the media inline as a data: URL "
                                         "(data:image/png;base64,...).")
        raise DataUrlError("not_data", "Media must be given as a data: URL (data:image/png;base64,...).")
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise DataUrlError("malformed", "The data: URL has no ',' separating its header from the data.")
    params = [p.strip() for p in header.split(";")]
    media_type = params[0].lower() or "text/plain"
    is_base64 = any(p.lower() == "base64" for p in params[1:])
    # base64 grows data by 4/3: refuse before decoding when even the encoded text is clearly too large.
    if max_bytes is not None and len(payload) > (max_bytes * 4) // 3 + 4:
        raise DataUrlError("too_large", f"The data: URL carries more than {max_bytes:,} bytes.")
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as exc:
        raise DataUrlError("malformed", f"The data: URL has invalid base64 data ({exc}).") from exc
    if max_bytes is not None and len(data) > max_bytes:
        raise DataUrlError("too_large", f"The data: URL carries {len(data):,} bytes; the limit is {max_bytes:,}.")
    return DataUrl(media_type=media_type, data=data)
