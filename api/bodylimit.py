"""Request body size limits counted on the bytes actually received (applied by api.middleware).

A declared Content-Length above the limit is refused before reading anything; otherwise every chunk passed to
the app is counted, so a chunked body or a Content-Length that lies still stops at the limit (413).
"""
from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import Message, Receive

from .errors import BodyTooLarge, problem_response


def declared_too_large(headers: dict[bytes, bytes], limit: int, path: str) -> JSONResponse | None:
    """The 413 answer for a request whose Content-Length already exceeds `limit`, else None. The connection is
    closed after it: the unread body must not be taken for the next request."""
    declared = _content_length(headers)
    if declared is None or declared <= limit:
        return None
    exc = BodyTooLarge(limit)
    return problem_response(413, exc.code, exc.detail, instance=path, extra=exc.extra,
                            headers={"Connection": "close"})


def counting_receive(receive: Receive, limit: int) -> Receive:
    """`receive` that raises BodyTooLarge once more than `limit` body bytes arrived; raised inside the route's
    body read, the app's error handler turns it into a 413."""
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
        return message

    return counted


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None
