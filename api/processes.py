"""`docpipe serve --workers N`: N server processes on one port, and a supervisor that keeps them running.

Why not uvicorn's own `--workers`: it gives every process the same listening socket, and whichever process wakes
first accepts every connection waiting in the queue. Keep-alive clients that connect in a burst then pile onto
one process while another idles (measured with bench/api_upload_latency.py, 32 clients, 2 processes: p50 49 ms
but p99 166 ms in one run, p50 80 / p99 126 ms in the next). Here, on Linux, every process gets a listening
socket of its own on the same port (SO_REUSEPORT) and the kernel spreads new connections over them by a hash
of the connection's addresses and ports. Elsewhere all processes share one socket, as with uvicorn.

A hash still leaves a few connections more on one process than on another (32 clients over 2 processes: 19/13
is common), and keep-alive clients stay where they landed. So the processes publish how many connections each
holds (shared memory), and a process with more than one above the least loaded answers its next response with
`Connection: close` (at most one such response every SHED_INTERVAL_S): the client reconnects and the kernel
places it again, which evens the spread out within a few reconnections.

The supervisor holds every socket, so connections that arrive while a process restarts wait in that socket's
queue instead of being refused. A process that exits is started again; one that keeps dying within seconds of
starting (a broken set-up) stops the server with an error instead of looping.
"""
from __future__ import annotations

import functools
import multiprocessing
import signal
import socket
import sys
import time
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from typing import Any, Callable

BACKLOG = 2048  # uvicorn's default listen backlog
SHED_INTERVAL_S = 0.05  # at most one connection moved per process and interval (the move takes effect on close)
QUICK_EXIT_S = 10.0  # a process that dies this soon after starting counts as a quick exit
MAX_QUICK_EXITS = 5  # quick exits in a row (of one process slot) that stop the server


def reuse_port_supported() -> bool:
    """True where SO_REUSEPORT balances connections over the sockets (Linux); BSD/macOS only share the port."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def listening_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket for server processes. Made with proto=IPPROTO_TCP on purpose: asyncio sets
    TCP_NODELAY on accepted connections only for such sockets, and one with proto 0 left Nagle's algorithm on:
    every response then waited ~40 ms for a delayed ACK (measured: /healthz 44 ms instead of 1 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets on host:port, one per process where the kernel balances them, else one shared socket.
    Raises OSError (e.g. address in use) with nothing left open."""
    reuse = reuse_port_supported()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count if reuse else 1):
            sockets.append(listening_socket(host, port, reuse_port=reuse))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class ConnectionShare:
    """The client connections each server process holds (one shared int per process; each writes only its own)
    and the rule that moves one: `should_move()` is true for a process holding more than one above the least
    loaded, once per SHED_INTERVAL_S."""

    def __init__(self, counts: Any, index: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._counts, self._index, self._clock = counts, index, clock
        self._last_move = float("-inf")

    def set_mine(self, connections: int) -> None:
        self._counts[self._index] = connections

    def should_move(self) -> bool:
        counts = list(self._counts)
        mine = counts.pop(self._index)
        now = self._clock()
        if counts and mine > min(counts) + 1 and now - self._last_move >= SHED_INTERVAL_S:
            self._last_move = now
            return True
        return False


_share: ConnectionShare | None = None  # set in a server process started by the Supervisor
_rate_buckets: Any = None  # the API keys' shared request-rate buckets (api.limits.SharedBuckets), likewise


def connection_share() -> ConnectionShare | None:
    """This process's ConnectionShare when it is one of several server processes, else None."""
    return _share


def shared_rate_buckets() -> Any:
    """The rate buckets all server processes share (api.limits.SharedBuckets), None in a single process."""
    return _rate_buckets


def _counting_protocol(base: type) -> type:
    """`base` (uvicorn's h11 protocol or our guarded one), publishing this process's connection count as
    connections open and close."""

    class CountingH11Protocol(base):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if _share is not None:
                _share.set_mine(len(self.connections))

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            if _share is not None:
                _share.set_mine(len(self.connections))

    return CountingH11Protocol


def run_server_process(options: dict[str, Any], sock: socket.socket, counts: Any = None, index: int = 0,
                       rate_buckets: Any = None) -> None:
    """Body of one server process: the app built from the DOCPIPE_* environment, served on `sock`. `counts`:
    the processes' shared connection counts (this process's slot is `index`); `rate_buckets`: the API keys'
    shared request-rate buckets."""
    import uvicorn

    global _share, _rate_buckets
    _rate_buckets = rate_buckets
    if counts is not None:
        _share = ConnectionShare(counts, index)
        _share.set_mine(0)
        http = options.get("http", "h11")
        if isinstance(http, functools.partial) and isinstance(http.func, type):  # api.http_protocol's, limits bound
            options = {**options, "http": functools.partial(_counting_protocol(http.func), *http.args,
                                                            **http.keywords)}
        elif http == "h11" or isinstance(http, type):
            from uvicorn.protocols.http.h11_impl import H11Protocol

            options = {**options, "http": _counting_protocol(H11Protocol if http == "h11" else http)}
    config = uvicorn.Config("api.app:create_app", factory=True, **options)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the supervisor reports the shutdown
        pass


@dataclass
class _Slot:
    """One server process and the socket it serves."""

    index: int  # its place in the shared connection counts
    sock: socket.socket
    process: SpawnProcess | None = None
    started_at: float = 0.0
    quick_exits: int = 0


class Supervisor:
    """Starts `count` server processes, restarts those that exit, stops them all on SIGINT/SIGTERM."""

    def __init__(self, options: dict[str, Any], sockets: list[socket.socket], count: int, *,
                 rate_buckets: Any = None, target: Callable[..., None] = run_server_process,
                 poll_s: float = 0.25, max_quick_exits: int = MAX_QUICK_EXITS) -> None:
        """`target(options, sock, counts, index, rate_buckets)` is the body of each process (a module-level
        function: it is pickled); `counts` holds one shared int per process."""
        self._options = options
        self._rate_buckets = rate_buckets
        self._target = target
        self._max_quick_exits = max_quick_exits
        self._slots = [_Slot(i, sockets[i % len(sockets)]) for i in range(count)]
        self._sockets = sockets
        self._poll_s = poll_s
        self._stopping = False
        self._context = multiprocessing.get_context("spawn")  # a clean interpreter: no state forked from here
        self._counts = self._context.RawArray("i", count)

    def _start(self, slot: _Slot) -> None:
        self._counts[slot.index] = 0  # a replaced process's connections are gone with it
        slot.process = self._context.Process(target=self._target,
                                             args=(self._options, slot.sock, self._counts, slot.index,
                                                   self._rate_buckets),
                                             name="docpipe-serve", daemon=False)
        slot.process.start()
        slot.started_at = time.monotonic()

    def _stop_signal(self, signum: int, frame: object) -> None:
        self._stopping = True

    def run(self) -> int:
        """Serve until asked to stop; the exit status: 0 after a requested stop, 1 when processes kept dying."""
        previous = {sig: signal.signal(sig, self._stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        status = 0
        try:
            for slot in self._slots:
                self._start(slot)
            while not self._stopping:
                time.sleep(self._poll_s)
                for slot in self._slots:
                    if self._stopping or slot.process is None or slot.process.is_alive():
                        continue
                    code = slot.process.exitcode
                    quick = time.monotonic() - slot.started_at < QUICK_EXIT_S
                    slot.quick_exits = slot.quick_exits + 1 if quick else 0
                    if slot.quick_exits >= self._max_quick_exits:
                        print(f"docpipe serve: a server process exited {slot.quick_exits} times right after "
                              f"starting (exit code {code}); see its log above. Stopping.", file=sys.stderr)
                        self._stopping, status = True, 1
                        break
                    print(f"docpipe serve: server process {slot.process.pid} exited (code {code}); starting "
                          "another", file=sys.stderr)
                    self._start(slot)
        finally:
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return status

    def _shutdown(self, grace_s: float = 30.0) -> None:
        """SIGTERM (uvicorn's graceful shutdown: finish requests in flight), then SIGKILL after `grace_s`."""
        alive = [s.process for s in self._slots if s.process is not None and s.process.is_alive()]
        for process in alive:
            process.terminate()
        deadline = time.monotonic() + grace_s
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for sock in self._sockets:
            sock.close()
