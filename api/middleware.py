"""The one ASGI middleware every HTTP request passes through, outside FastAPI's own stack.

In order: time and count the request (metrics), authenticate and rate-limit it from its headers (before any body
byte is read), refuse a declared Content-Length over the route's limit, count the body bytes actually received,
and turn an exception nothing else handled into a 500 problem document; every response gets the safety headers
(`safety_headers`: nosniff, and no-store on JSON). With several server processes it also
closes a keep-alive connection now and then where this process holds more than its share (api/processes.py).
One layer instead of four: each ASGI layer is another await chain and another send/receive wrapper on every
request, which on a small machine is measurable CPU per upload (bench/api_upload_latency.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import Gate, refusal_response
from .bodylimit import counting_receive, declared_too_large
from .errors import ApiError, unexpected_error_response
from .metrics import HttpMetrics, route_of
from .processes import connection_share

_JSON_TYPES = (b"application/json", b"application/problem+json")


def safety_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Every response: `X-Content-Type-Options: nosniff` (a browser never reinterprets a body as another type);
    JSON (documents, results, errors) also `Cache-Control: no-store` unless the route set its own caching: no
    proxy or browser cache keeps a copy of a tenant's data."""
    out = list(headers)
    names = {name.lower() for name, _ in out}
    if b"x-content-type-options" not in names:
        out.append((b"x-content-type-options", b"nosniff"))
    content_type = next((value for name, value in out if name.lower() == b"content-type"), b"")
    if b"cache-control" not in names and content_type.split(b";")[0].strip().lower() in _JSON_TYPES:
        out.append((b"cache-control", b"no-store"))
    return out


class ApiMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: HttpMetrics, gate: Gate,
                 limit_for: Callable[[str, str], int]) -> None:
        """`limit_for(method, path)` gives the byte limit of a request's body."""
        self.app = app
        self.metrics = metrics
        self.gate = gate
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        method: str = scope["method"]
        path: str = scope["path"]
        status = 500
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                self.metrics.response_started(method, route_of(scope), time.perf_counter() - start)
                headers = safety_headers(message.get("headers", ()))
                share = connection_share()
                if share is not None and share.should_move():  # this process holds more than its share
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            headers = dict(scope["headers"])
            try:
                self.gate.admit(scope, headers)
            except ApiError as exc:
                await refusal_response(exc, path)(scope, receive, tracked_send)
                return
            limit = self.limit_for(method, path)
            too_large = declared_too_large(headers, limit, path)
            if too_large is not None:
                await too_large(scope, receive, tracked_send)
                return
            await self.app(scope, counting_receive(receive, limit), tracked_send)
        except Exception:  # from the routes, or from the checks above: either way a 500 with a logged incident
            if started:  # part of a response is out: nothing sensible can follow it
                raise
            # Starlette's own last-resort handler answers and then re-raises, and uvicorn then closes the
            # connection (a client reusing it would see a reset): here the exception is logged and swallowed.
            await unexpected_error_response(method, path)(scope, receive, tracked_send)
        finally:
            self.metrics.finished(method, route_of(scope), status)
