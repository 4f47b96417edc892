"""uvicorn's h11 protocol with the limits a server facing the network needs: a header deadline and a cap on open
connections.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but any byte
cancels that timer, and a new connection has no timer at all: a client that sends half a request line and then
nothing holds a socket (and a file descriptor) for good. 3,000 such connections ran the server out of file
descriptors. Here:

- the request line and headers must be complete within `HEADER_TIMEOUT_S` of the connection opening (or of the
  previous response on a keep-alive connection), or the connection is closed;
- a connection beyond `max_connections` open ones is closed as soon as it is accepted, before it costs more than
  its socket. The cap is half the process's file-descriptor limit (at most 4,096), so the database, blobs and
  the model always find descriptors left. (uvicorn's `limit_concurrency` answers 503 only once a request is
  complete, and counts every connection below it, so it is no cap on connections.)

`docpipe serve` uses this class (api/cli.py, `server_options`); the h11 choice is explained there.
"""
from __future__ import annotations

import asyncio
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # a request line and headers, however slow the client's network, arrive well within this
KEEP_ALIVE_TIMEOUT_S = 5  # idle time after a response before a keep-alive connection is closed (uvicorn's default)


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(4096, soft // 2)) if soft != resource.RLIM_INFINITY else 4096


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int = default_max_connections()  # per process

    _header_deadline: asyncio.TimerHandle | None = None

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
