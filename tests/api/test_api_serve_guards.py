"""`docpipe serve` facing the network (issue 21 items 7 and 9): partial-header connections are closed after the
header deadline, connections over the cap are refused at accept, idle keep-alive connections are closed after their
timeout, all three from the settings (DOCPIPE_API_HEADER_TIMEOUT_S, _MAX_CONNECTIONS, _KEEP_ALIVE_TIMEOUT_S), and a
refused setting never prints its value."""
from __future__ import annotations

import os
import pickle
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from apitest_support import REPO, free_port
from test_api_serve import LAUNCH

from api.cli import server_options
from api.http_protocol import GuardedH11Protocol, default_max_connections
from pipeline.settings import Settings


async def hello(scope, receive, send) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


# The 10 s / 5 s / fd-limit defaults of `docpipe serve`, scaled down, through the settings it reads.
QUICK = Settings(api_header_timeout_s=1.0, api_max_connections=40, api_keep_alive_timeout_s=1)


@contextmanager
def guarded_server(settings: Settings = QUICK) -> Iterator[int]:
    port = free_port()
    options = server_options("127.0.0.1", port, "warning", settings)
    config = uvicorn.Config(hello, host="127.0.0.1", port=port, log_level="warning", http=options["http"],
                            timeout_keep_alive=options["timeout_keep_alive"], lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def partial(port: int, data: bytes = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while chunk := sock.recv(4096):
            if b"HTTP/1.1" in chunk:  # an answer (the cap test's 'over the cap' must not get one either)
                return False
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_partial_header_connections_are_closed_after_the_deadline() -> None:
    with guarded_server() as port:
        slow = [partial(port) for _ in range(30)]
        try:
            time.sleep(0.3)
            assert not closed_by_server(slow[0], 0.1)  # still within the deadline
            assert all(closed_by_server(s, 5.0) for s in slow)
        finally:
            for s in slow:
                s.close()
        # A keep-alive connection whose next request stops halfway gets the same deadline.
        sock = partial(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET / HTTP/1.1\r\nHo")
            assert closed_by_server(sock, 5.0)
        finally:
            sock.close()
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "ok"


def test_connections_over_the_cap_are_closed_at_once() -> None:
    with guarded_server() as port:
        held = [partial(port) for _ in range(QUICK.api_max_connections or 0)]
        try:
            time.sleep(0.3)
            extra = partial(port)
            try:
                assert closed_by_server(extra, 0.5)  # long before the 1 s header deadline
            finally:
                extra.close()
        finally:
            for s in held:
                s.close()
        time.sleep(0.3)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "ok"


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout() -> None:
    with guarded_server() as port:
        sock = partial(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            assert not closed_by_server(sock, 0.3)  # kept alive for a while (1 s here)
            assert closed_by_server(sock, 3.0)  # long before the default 5 s
        finally:
            sock.close()


def test_docpipe_serve_takes_its_connection_limits_from_the_settings() -> None:
    defaults = server_options("127.0.0.1", 8000, "info", Settings())
    assert defaults["timeout_keep_alive"] == 5 and defaults["http"].func is GuardedH11Protocol
    assert defaults["http"].keywords == {"header_timeout_s": 10.0, "max_connections": default_max_connections()}
    header, keep_alive, cap = random.uniform(0.5, 60.0), random.randint(1, 300), random.randint(16, 5000)
    env = {"DOCPIPE_API_HEADER_TIMEOUT_S": str(header), "DOCPIPE_API_KEEP_ALIVE_TIMEOUT_S": str(keep_alive),
           "DOCPIPE_API_MAX_CONNECTIONS": str(cap)}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        options = server_options("127.0.0.1", 8000, "info", Settings())
    assert options["timeout_keep_alive"] == keep_alive
    assert options["http"].keywords == {"header_timeout_s": header, "max_connections": cap}
    # `docpipe serve --workers N` hands the options to spawned processes: the factory pickles, limits included
    again = pickle.loads(pickle.dumps(options["http"]))
    assert again.func is GuardedH11Protocol and again.keywords == options["http"].keywords


@pytest.mark.parametrize("name, value", [("api_header_timeout_s", 0), ("api_header_timeout_s", -1.0),
                                         ("api_header_timeout_s", 301), ("api_keep_alive_timeout_s", 0),
                                         ("api_keep_alive_timeout_s", 1.5), ("api_max_connections", 15),
                                         ("api_max_connections", 65537), ("api_max_connections", "many")])
def test_bad_connection_limits_are_refused_by_name(name: str, value: object) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=name):
        Settings(**{name: value})


def test_a_short_key_does_not_print_the_other_keys(tmp_path: Path) -> None:
    good = "goodkey_0123456789abcdef"
    env = dict(os.environ, PYTHONPATH=str(REPO), DOCPIPE_DATA_DIR=str(tmp_path), DOCPIPE_API_KEYS=f"{good},short")
    done = subprocess.run([sys.executable, "-c", LAUNCH, "serve", "--port", str(free_port())],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert good not in done.stdout + done.stderr and "short" not in (done.stdout + done.stderr).replace(
        "shorter", "")
    assert "DOCPIPE_API_KEYS" in done.stderr and "#2" in done.stderr


def test_settings_errors_leave_the_values_out() -> None:
    from pydantic import ValidationError

    from pipeline.settings import Settings

    with pytest.raises(ValidationError) as err:
        Settings(api_keys=["goodkey_0123456789abcdef", "short"])
    assert "goodkey" not in str(err.value) and "goodkey" not in repr(err.value)
