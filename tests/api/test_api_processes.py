"""`docpipe serve --workers N`: one listening socket per process, the supervisor's restarts and its give-up rule."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from apitest_support import REPO, free_port
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db
from test_api_http import random_png, upload
from test_api_serve import LAUNCH

from api.processes import Supervisor, bind_sockets, reuse_port_supported

linux_only = pytest.mark.skipif(not reuse_port_supported(), reason="SO_REUSEPORT balancing is Linux-only")


@linux_only
def test_each_process_gets_its_own_socket_on_the_same_port() -> None:
    port = free_port()
    sockets = bind_sockets("127.0.0.1", port, 3)
    try:
        assert len({s.fileno() for s in sockets}) == 3
        assert {s.getsockname() for s in sockets} == {("127.0.0.1", port)}
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening: the kernel queues the connection on one of them
    finally:
        for s in sockets:
            s.close()


def test_a_port_taken_by_another_server_is_an_error_with_nothing_left_open() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    before = len(psutil.Process().net_connections(kind="tcp"))
    try:
        with pytest.raises(OSError):
            bind_sockets("127.0.0.1", port, 2)
        assert len(psutil.Process().net_connections(kind="tcp")) == before
    finally:
        taken.close()


def exit_at_once(options: dict[str, object], sock: socket.socket, counts: object, index: int,
                 rate_buckets: object) -> None:
    """A server process whose set-up fails (runs in a spawned child: module level, so it can be pickled)."""
    sys.exit(3)


def test_supervisor_stops_when_a_process_keeps_dying_right_after_start(capfd: pytest.CaptureFixture[str]) -> None:
    sockets = bind_sockets("127.0.0.1", free_port(), 1)
    started = time.monotonic()
    status = Supervisor({}, sockets, 1, target=exit_at_once, poll_s=0.05, max_quick_exits=3).run()
    assert status == 1
    assert time.monotonic() - started < 60
    err = capfd.readouterr().err
    assert err.count("starting another") == 2 and "exited 3 times right after starting (exit code 3)" in err
    assert all(s.fileno() == -1 for s in sockets)  # closed on the way out


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    base: str
    key: str
    redis: Any  # the broker's database (claimed for this test)
    banner: str  # the line `docpipe serve` printed first


@pytest.fixture()
def two_process_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    """`docpipe serve --workers 2` in broker mode; an indirect parameter sets DOCPIPE_API_RATE_LIMIT_PER_MINUTE."""
    db, client = _claim_redis_db()
    key = "serve-key-" + uuid.uuid4().hex
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), DOCPIPE_DATA_DIR=str(tmp_path), DOCPIPE_API_KEYS=key,
               DOCPIPE_API_RATE_LIMIT_PER_MINUTE=str(getattr(request, "param", 100000)),
               DOCPIPE_BROKER_URL=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--port", str(port), "--workers", "2",
                             "--log-level", "warning"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        banner = proc.stdout.readline().decode() if proc.stdout else ""
        wait_ready(proc, base, expected_children=2)
        yield Served(proc, base, key, client, banner)
    finally:
        children = psutil.Process(proc.pid).children() if proc.poll() is None else []
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        client.flushdb()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"server processes left running: {alive}"


def server_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """The supervisor's server processes (not multiprocessing's resource tracker)."""
    return [c.pid for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]


def wait_ready(proc: subprocess.Popen[bytes], base: str, expected_children: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        ready = 0
        for _ in range(8):  # new connections land on either process: both must answer
            try:
                ready += httpx.get(base + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
        if ready == 8 and len(server_pids(proc)) == expected_children:
            return
        time.sleep(0.3)
    raise AssertionError("server did not become ready")


def established_per_process(pids: list[int], port: int) -> dict[int, int]:
    return {pid: sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port) for pid in pids}


def test_two_processes_take_uploads_into_one_database(two_process_server: Served) -> None:
    served = two_process_server
    assert "processes: 2" in served.banner
    with httpx.Client(base_url=served.base, headers={"X-API-Key": served.key}, timeout=30) as c:
        ids = [upload(c, random_png()).json()["job"]["id"] for _ in range(6)]
    assert len(set(ids)) == 6  # one database behind both processes: distinct jobs, nothing lost
    # Publishing runs on each process's publisher thread, after the answer: wait for it, then count exactly.
    deadline = time.monotonic() + 30
    while served.redis.llen("ingest") < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served.redis.llen("ingest") == 6


@linux_only
def test_keep_alive_connections_end_up_evenly_spread(two_process_server: Served) -> None:
    """The kernel's hash places 32 connections unevenly; the busier process closes one now and then (Connection:
    close) and the client reconnects, until the two hold 16 +- 1 each."""
    proc, base, key = two_process_server.proc, two_process_server.base, two_process_server.key
    port = int(base.rsplit(":", 1)[1])
    pids = server_pids(proc)
    clients = [httpx.Client(base_url=base, headers={"X-API-Key": key}, timeout=30) for _ in range(32)]
    closed_by_server = 0
    try:
        for _ in range(40):  # rounds: every client makes one request (a closed connection reopens on the next)
            closes = 0
            for c in clients:
                r = c.get("/v1/schemas")
                assert r.status_code == 200
                closes += r.headers.get("connection", "").lower() == "close"
                time.sleep(0.002)  # a little time between requests, as real clients have
            closed_by_server += closes
            spread = established_per_process(pids, port)
            if closes == 0 and sum(spread.values()) == 32:
                break
        assert sum(spread.values()) == 32, spread
        assert max(spread.values()) - min(spread.values()) <= 2, (spread, closed_by_server)
    finally:
        for c in clients:
            c.close()


def test_the_busier_process_moves_one_connection_per_interval() -> None:
    from api.processes import SHED_INTERVAL_S, ConnectionShare

    now = [100.0]
    counts = [19, 13]
    a, b = ConnectionShare(counts, 0, clock=lambda: now[0]), ConnectionShare(counts, 1, clock=lambda: now[0])
    assert a.should_move() and not b.should_move()
    assert not a.should_move()  # once per interval: the move shows in the counts only after the close
    now[0] += 2 * SHED_INTERVAL_S
    assert a.should_move()
    counts[:] = [17, 16]
    now[0] += 2 * SHED_INTERVAL_S
    assert not a.should_move() and not b.should_move()  # one apart: moving would only swap the imbalance
    counts[:] = [0, 0]
    assert not a.should_move()
    a.set_mine(5)
    assert counts == [5, 0]


def test_a_killed_process_is_replaced_and_serving_goes_on(two_process_server: Served) -> None:
    proc, base, key = two_process_server.proc, two_process_server.base, two_process_server.key
    victim = psutil.Process(server_pids(proc)[0])
    victim.kill()
    victim.wait(10)
    wait_ready(proc, base, expected_children=2)
    assert victim.pid not in server_pids(proc)
    with httpx.Client(base_url=base, headers={"X-API-Key": key}, timeout=30) as c:
        assert all(c.get("/v1/schemas").status_code == 200 for _ in range(10))


@pytest.mark.parametrize("two_process_server", [20], indirect=True)  # 20 a minute: a burst of 10, then 1 per 3 s
def test_an_api_keys_request_rate_is_one_budget_across_the_processes(two_process_server: Served) -> None:
    served = two_process_server
    port = int(served.base.rsplit(":", 1)[1])
    clients = [httpx.Client(base_url=served.base, headers={"X-API-Key": served.key}, timeout=30) for _ in range(16)]
    try:
        codes = [c.get("/v1/schemas").status_code for c in clients]  # 16 connections: both processes get some
        spread = established_per_process(server_pids(served.proc), port)
        assert min(spread.values()) >= 1, spread
        # the readiness probes carried no key; the burst of 10 is the key's across both processes (not 10 each)
        assert codes.count(200) in (10, 11) and codes.count(429) == 16 - codes.count(200), codes
    finally:
        for c in clients:
            c.close()


def _take_tokens(buckets: object, name: str, tries: int, admitted: object) -> None:
    for _ in range(tries):
        if buckets.take(name, time.monotonic(), 1e-9, 8.0) is None:  # type: ignore[attr-defined]  # the shared buckets' proxy
            with admitted.get_lock():  # type: ignore[attr-defined]  # a multiprocessing.Value
                admitted.value += 1  # type: ignore[attr-defined]  # a multiprocessing.Value


def test_shared_buckets_are_one_budget_for_several_processes() -> None:
    import multiprocessing

    from api.limits import SharedBuckets

    buckets = SharedBuckets(["key-a", "key-b"])
    spawn = multiprocessing.get_context("spawn")
    admitted = spawn.Value("i", 0)
    workers = [spawn.Process(target=_take_tokens, args=(buckets, "key-a", 10, admitted)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    assert admitted.value == 8  # the burst, once, whatever process took it
    assert buckets.take("key-b", time.monotonic(), 1e-9, 8.0) is None  # another key has its own bucket


def test_rate_limiter_uses_the_shared_buckets_for_configured_keys_only() -> None:
    from api.errors import RateLimited
    from api.limits import RateLimiter, SharedBuckets

    buckets = SharedBuckets(["key-a"])
    now = [1000.0]
    first, second = (RateLimiter(60, 2, clock=lambda: now[0], shared=buckets) for _ in range(2))
    first.check("key-a")
    second.check("key-a")
    with pytest.raises(RateLimited):
        first.check("key-a")  # the two limiters (two processes) drew on one bucket of 2
    for limiter in (first, second):  # addresses of refused logins stay per process
        limiter.check("addr-10.0.0.1")
        limiter.check("addr-10.0.0.1")
    assert first.tracked() == second.tracked() == 1
