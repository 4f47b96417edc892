"""Request body size limits counted on the bytes actually received.

A declared Content-Length above the limit is refused before reading anything; otherwise every chunk passed to
the app is counted, so a chunked body or a Content-Length that lies still stops at the limit (413).
"""
from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import BodyTooLarge, problem_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit_for: Callable[[str, str], int]) -> None:
        """`limit_for(method, path)` gives the byte limit of a request's body."""
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["method"], scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            exc = BodyTooLarge(limit)
            response = problem_response(413, exc.code, exc.detail, instance=scope["path"], extra=exc.extra,
                                        headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the route's body read; the app's error handler turns it into a 413.
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
