"""uvicorn's h11 protocol with the limits a server facing the network needs: a header deadline and a cap on open
connections.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but any byte
cancels that timer, and a new connection has no timer at all: a client that sends half a request line and then
nothing holds a socket (and a file descriptor) for good. 3,000 such connections ran the server out of file
descriptors. Here:

- the request line and headers must be complete within `header_timeout_s` (`DOCPIPE_API_HEADER_TIMEOUT_S`, 10 s)
  of the connection opening (or of the previous response on a keep-alive connection), or the connection is closed;
- a connection beyond `max_connections` (`DOCPIPE_API_MAX_CONNECTIONS`) open ones is closed as soon as it is
  accepted, before it costs more than its socket. By default the cap is half the process's file-descriptor limit
  (at most 4,096), so the database, blobs and the model always find descriptors left. (uvicorn's
  `limit_concurrency` answers 503 only once a request is complete, and counts every connection below it, so it is
  no cap on connections.)

`docpipe serve` uses this class through `guarded_protocol(settings)` (api/cli.py, `server_options`); the h11
choice is explained there. The keep-alive timeout is uvicorn's own (`DOCPIPE_API_KEEP_ALIVE_TIMEOUT_S`).
"""
from __future__ import annotations

import asyncio
import functools
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.settings import Settings


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(4096, soft // 2)) if soft != resource.RLIM_INFINITY else 4096


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = Settings.model_fields["api_header_timeout_s"].default
    max_connections: int = default_max_connections()  # per process

    _header_deadline: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, header_timeout_s: float | None = None, max_connections: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if header_timeout_s is not None:
            self.header_timeout_s = header_timeout_s
        if max_connections is not None:
            self.max_connections = max_connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # TCP: a Transport
        if len(self.connections) >= self.max_connections:
            transport.abort()  # over the cap: not registered, nothing read, the socket closed at once
            return
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        if self.transport is None:  # refused in connection_made: nothing of uvicorn's was set up
            return
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in (or the connection is done)
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request on this keep-alive connection gets the same deadline

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(settings: Settings) -> functools.partial[GuardedH11Protocol]:
    """The protocol factory uvicorn is given (`http=`): a partial, so it pickles into `docpipe serve --workers`
    processes by reference, limits included."""
    return functools.partial(GuardedH11Protocol, header_timeout_s=settings.api_header_timeout_s,
                             max_connections=settings.api_max_connections or default_max_connections())
