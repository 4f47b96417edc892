"""Upload latency of the REST API over loopback: N distinct uploads from a bounded pool of concurrent clients.

    python3 bench/api_upload_latency.py [--uploads 200] [--concurrency 1,8,32] [--mode broker|embedded]
                                        [--server-processes N] [--client raw|httpx]
                                        [--json bench/results/api_upload_latency.json]

The server runs in its own process (`docpipe serve`, configured through DOCPIPE_*), the
client has at most `concurrency` requests in flight, one keep-alive connection each. Latency is the time from
sending a request to having its full response. Every upload is a different small PNG (fresh random pixels), so each
one is stored and sniffed (no dedupe shortcut).

`--client raw` (default): a minimal HTTP/1.1 client on asyncio streams; each request's bytes (headers + multipart
body) are built before the round starts, and a response is read by its Content-Length. The client shares the
machine's cores with the server, so its own CPU per request is kept to a fraction of the server's; `--client
httpx` (the usual library, a few times the CPU per request) shows how much a heavier client inflates the numbers
on a small machine.

Modes: `broker` (default when Redis answers on 127.0.0.1:6379): jobs are only enqueued, on a Redis database number
claimed for the run and flushed afterwards, so the numbers are the API's own upload path. `embedded`: the server
also runs the extraction jobs in-process with the tiny model, competing for the same CPU cores.
`--server-processes N` (broker mode) runs `docpipe serve --workers N`: N server processes on the port, each with its
own listening socket (the kernel spreads the clients' connections over them, the processes even the spread out);
the round records how many of the keep-alive connections each process held, and the server CPU of all of them
together. Default: as many as the machine has cores, at most 2, in broker mode (how api/README.md says to serve
uploads on a multi-core machine); 1 in embedded mode, which cannot have more.

Each round also reads the server's own `docpipe_http_request_seconds` histogram (from /metrics, before and after)
for POST /v1/documents: the time from the request reaching the app to its response starting. Client latency minus
that is time spent queued in the server's event loop and socket buffers and in this client; on a small machine the
client itself competes for the same cores, so both are reported.

Checks after each round: 0 errors, and the server lists exactly as many new documents as were uploaded.
Prints a table; writes JSON with the command, the date, the machine's load average, versions and every number.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key-" + uuid.uuid4().hex
CLAIM_KEY = "docpipe:test:claim"  # shared convention with the test suites: one user per Redis database number


def png(width: int = 320, height: int = 240) -> bytes:
    rng = random.Random()
    img = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


# `docpipe serve`, with its command handed to the CLI explicitly (works from a checkout that was never installed).
SERVE = ("import sys; from importlib import metadata; from pipeline import cli; "
         "cli.load_plugins(cli.app, [metadata.EntryPoint(name='serve', value='api.cli:register', "
         "group='docpipe.commands')]); cli.app(args=sys.argv[1:], prog_name='docpipe')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def claim_redis_db() -> tuple[int, object] | None:
    try:
        import redis

        redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=2).ping()
    except Exception:
        return None
    token = uuid.uuid4().hex
    for db in random.sample(range(1, 16), 15):
        client = redis.Redis(host="127.0.0.1", port=6379, db=db)
        if client.set(CLAIM_KEY, token, nx=True, ex=1800):
            if client.dbsize() == 1:
                return db, client
            client.delete(CLAIM_KEY)
    return None


def start_server(data_dir: Path, broker_url: str | None, processes: int = 1) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               DOCPIPE_DATA_DIR=str(data_dir), DOCPIPE_API_KEYS=f"*:{KEY}",  # admin: /metrics shows the HTTP histogram
               DOCPIPE_API_RATE_LIMIT_PER_MINUTE="10000000", DOCPIPE_API_MAX_INFLIGHT_PER_KEY="100000",
               DOCPIPE_MAX_TOKENS="256", DOCPIPE_GRAMMAR_MAX_STRING_LENGTH="8", DOCPIPE_GRAMMAR_MAX_ARRAY_ITEMS="1")
    env.pop("DOCPIPE_BROKER_URL", None)
    if broker_url:
        env["DOCPIPE_BROKER_URL"] = broker_url
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
         "--workers", str(processes)],
        cwd=ROOT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("server did not become ready")


def server_processes(pid: int) -> list[psutil.Process]:
    """The server: `docpipe serve` itself and, with --workers, its server processes."""
    top = psutil.Process(pid)
    return [top, *(c for c in top.children() if "spawn_main" in " ".join(c.cmdline()))]


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of all server processes so far."""
    return sum(sum(p.cpu_times()[:2]) for p in server_processes(pid))


def connections_per_process(pid: int, port: int) -> list[int]:
    """Established connections to `port` held by each server process (sorted, largest first)."""
    counts = [sum(1 for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED
                  and c.laddr.port == port) for p in server_processes(pid)]
    return sorted((n for n in counts if n), reverse=True)


def python_speed_ms() -> float:
    """CPU ms this process needs for a fixed pure-Python loop: how fast a core is right now (a shared or
    oversubscribed host reads slower), recorded so that runs on different days can be compared."""
    start = time.process_time()
    total = 0
    for i in range(2_000_000):
        total += i
    return (time.process_time() - start) * 1000


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))  # nearest-rank percentile
    return ordered[k]


def upload_request(base: str, i: int, body: bytes) -> bytes:
    """The whole HTTP/1.1 request (head + multipart body) uploading `body` as form field `file`."""
    boundary = uuid.uuid4().hex
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="u{i}.png"\r\n'
            f"Content-Type: image/png\r\n\r\n").encode() + body + f"\r\n--{boundary}--\r\n".encode()
    host = base.split("://", 1)[1]
    head = (f"POST /v1/documents HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(form)}\r\n\r\n")
    return head.encode() + form


class RawConnection:
    """One keep-alive HTTP/1.1 connection: send a prepared request, read the response by its Content-Length."""

    def __init__(self, base: str) -> None:
        host, port = base.split("://", 1)[1].rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:] if line)}
        if b"content-length" not in fields:
            raise ValueError(f"response without Content-Length: {head[:200]!r}")
        body = await self.reader.readexactly(int(fields[b"content-length"]))
        if fields.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _raw_uploads(base: str, bodies: list[bytes], concurrency: int, latencies: list[float],
                       errors: list[str]) -> None:
    requests = [upload_request(base, i, b) for i, b in enumerate(bodies)]  # built before the clock starts
    pool = [RawConnection(base) for _ in range(concurrency)]
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)

    async def worker(conn: RawConnection) -> None:
        while not queue.empty():
            request = queue.get_nowait()
            start = time.perf_counter()
            try:
                status, body = await conn.exchange(request)
                if status != 202:
                    errors.append(f"{status}: {body[:200]!r}")
            except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                conn.close()
                errors.append(f"{type(exc).__name__}: {exc}")
            latencies.append(time.perf_counter() - start)
        conn.close()

    await asyncio.gather(*(worker(c) for c in pool))


async def _httpx_uploads(base: str, bodies: list[bytes], concurrency: int, latencies: list[float],
                         errors: list[str]) -> None:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers={"X-API-Key": KEY}, limits=limits, timeout=120) as client:
        async def one(i: int, body: bytes) -> None:
            async with gate:
                start = time.perf_counter()
                try:
                    r = await client.post("/v1/documents", files={"file": (f"u{i}.png", body, "image/png")})
                    if r.status_code != 202:
                        errors.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


async def round_of_uploads(base: str, bodies: list[bytes], concurrency: int, client: str = "raw"
                           ) -> dict[str, object]:
    latencies: list[float] = []
    errors: list[str] = []
    run = _raw_uploads if client == "raw" else _httpx_uploads
    cpu, wall = time.process_time(), time.perf_counter()
    await run(base, bodies, concurrency, latencies, errors)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    ms = [x * 1000 for x in latencies]
    return {
        "concurrency": concurrency, "uploads": len(bodies), "errors": len(errors), "error_samples": errors[:5],
        "wall_s": wall, "uploads_per_s": len(bodies) / wall,
        "p50_ms": pct(ms, 50), "p95_ms": pct(ms, 95), "p99_ms": pct(ms, 99), "max_ms": max(ms),
        "mean_ms": statistics.fmean(ms), "client_cpu_ms_per_upload": cpu * 1000 / len(bodies),
    }


UPLOAD_LABELS = 'method="POST",route="/v1/documents"'


def upload_histogram(base: str) -> dict[float, float]:
    """Cumulative bucket counts {upper bound s: uploads} of the server-side upload latency."""
    with httpx.Client(base_url=base, headers={"X-API-Key": KEY}, timeout=60) as c:
        text = c.get("/metrics").text
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("docpipe_http_request_seconds_bucket{") and UPLOAD_LABELS in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


def server_side(before: dict[float, float], after: dict[float, float]) -> dict[str, object]:
    """Share of this round's uploads answered within each bucket bound, and the bound that holds 99 % of them."""
    delta = {b: after.get(b, 0.0) - before.get(b, 0.0) for b in sorted(after)}
    total = delta.get(float("inf"), 0.0)
    if not total:
        return {"uploads": 0}
    p99_bound = next(b for b, n in delta.items() if n >= 0.99 * total)
    return {"uploads": int(total), "p99_at_most_ms": None if p99_bound == float("inf") else p99_bound * 1000,
            "share_within_ms": {f"{b * 1000:g}": round(n / total, 4) for b, n in delta.items()
                                if b != float("inf")}}


class ConnectionSampler:
    """While a round runs, samples how the clients' connections are spread over the server processes, until one
    sample sees all `expected` (two samples at most: each one scans the socket table in this client's process,
    CPU the round would otherwise have)."""

    def __init__(self, pid: int, port: int, expected: int) -> None:
        self.pid, self.port, self.expected = pid, port, expected
        self.busiest: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for _ in range(2):
            if self._done.wait(0.3):
                return
            try:
                sample = connections_per_process(self.pid, self.port)
            except psutil.Error:
                continue
            if sum(sample) > sum(self.busiest):
                self.busiest = sample
            if sum(sample) >= self.expected:
                return

    def __enter__(self) -> "ConnectionSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def count_documents(base: str) -> int:
    total, cursor = 0, None
    with httpx.Client(base_url=base, headers={"X-API-Key": KEY}, timeout=60) as c:
        while True:
            params: dict[str, object] = {"limit": 200}
            if cursor:
                params["cursor"] = cursor
            page = c.get("/v1/documents", params=params).json()
            total += len(page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uploads", type=int, default=200)
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated client pool sizes, one round each")
    ap.add_argument("--mode", choices=["broker", "embedded"], default=None)
    ap.add_argument("--server-processes", type=int, default=None,
                    help="server processes (docpipe serve --workers; broker mode only). Default: min(2, cores) in "
                         "broker mode, 1 in embedded mode")
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw",
                    help="raw: prepared requests on asyncio streams (cheap); httpx: the library client")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "api_upload_latency.json")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]

    claimed = claim_redis_db() if args.mode in (None, "broker") else None
    if args.mode == "broker" and claimed is None:
        print("broker mode needs Redis on 127.0.0.1:6379 with a free database number", file=sys.stderr)
        return 2
    mode = "broker" if claimed else "embedded"
    if args.server_processes is None:
        args.server_processes = min(2, os.cpu_count() or 1) if mode == "broker" else 1
    if args.server_processes > 1 and mode != "broker":
        print("--server-processes needs broker mode (embedded mode runs jobs inside the one server process)",
              file=sys.stderr)
        return 2
    broker_url = f"redis://127.0.0.1:6379/{claimed[0]}" if claimed else None
    rounds = []
    load_before = os.getloadavg()
    speed_before = python_speed_ms()
    with tempfile.TemporaryDirectory(prefix="docpipe-bench-api-") as tmp:
        proc, base = start_server(Path(tmp), broker_url, args.server_processes)
        try:
            # warm-up: as many connections as the largest round, so that every server process (each still
            # starting, loading its modules, opening its database and broker connections) has served some
            warm = max(levels)
            asyncio.run(round_of_uploads(base, [png() for _ in range(2 * warm)], warm, args.client))
            for level in levels:
                before = count_documents(base)
                bodies = [png() for _ in range(args.uploads)]
                histogram = upload_histogram(base)
                load = os.getloadavg()[0]
                server_cpu = server_cpu_s(proc.pid)
                with ConnectionSampler(proc.pid, int(base.rsplit(":", 1)[1]), level) as split:
                    result = asyncio.run(round_of_uploads(base, bodies, level, args.client))
                result["server_cpu_ms_per_upload"] = (server_cpu_s(proc.pid) - server_cpu) * 1000 / len(bodies)
                result["connections_per_process"] = split.busiest
                # /metrics counts one process's requests: with several, the server-side split is not measured.
                result["server_side"] = (server_side(histogram, upload_histogram(base)) if args.server_processes == 1
                                         else {"note": "not measured: /metrics is per server process"})
                result["documents_created"] = count_documents(base) - before
                result["loadavg_1m_before"] = load
                result["loadavg_1m_after"] = os.getloadavg()[0]
                rounds.append(result)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            if claimed:
                claimed[1].flushdb()  # type: ignore[attr-defined]  # claimed = (db number, redis client)

    print(f"\nAPI upload latency, {args.uploads} uploads of distinct 320x240 PNGs per round, mode={mode}, "
          f"client={args.client}, "
          f"{args.server_processes} server process(es), loopback, {os.cpu_count()} CPU cores, load average before "
          f"{load_before[0]:.1f}, Python loop {speed_before:.0f} ms "
          "(other work on the machine inflates the tail)")
    print(f"{'clients':>8} {'errors':>6} {'docs':>5} {'upl/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
          f"{'max ms':>8} {'server p99 <=':>14} {'srv cpu':>8} {'cli cpu':>8} {'load':>5}  connections/process")
    for r in rounds:
        bound = r["server_side"].get("p99_at_most_ms")  # type: ignore[union-attr]  # a dict in every round
        print(f"{r['concurrency']:>8} {r['errors']:>6} {r['documents_created']:>5} {r['uploads_per_s']:>7.1f} "
              f"{r['p50_ms']:>8.1f} {r['p95_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} "
              f"{(f'{bound:g} ms' if bound else '-'):>14} {_ms(r.get('server_cpu_ms_per_upload')):>8} "
              f"{_ms(r['client_cpu_ms_per_upload']):>8} {r['loadavg_1m_after']:>5.1f}  "
              f"{'/'.join(map(str, r['connections_per_process'])) or '-'}")
    report = {
        "bench": "api_upload_latency", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "bench/api_upload_latency.py", *sys.argv[1:]]),
        "mode": mode, "server_processes": args.server_processes, "client": args.client,
        "cpu_note": "server_cpu_ms_per_upload / client_cpu_ms_per_upload: CPU time per upload of the server "
                    "processes (all of them) and of this client during the round; connections_per_process: the "
                    "clients' keep-alive connections held by each server process, sampled during the round",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "python_loop_ms_before": round(speed_before, 1),
                    "python_loop_ms_after": round(python_speed_ms(), 1),
                    "python_loop_note": "CPU ms of a fixed 2M-iteration Python loop in the client process; larger "
                                        "means slower cores (shared host)"},
        "goal": "p99 <= 150 ms at 32 concurrent clients, 0 errors, nothing lost", "rounds": rounds,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    bad = [r for r in rounds if r["errors"] or r["documents_created"] != r["uploads"]]
    return 1 if bad else 0


def _ms(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "-"


if __name__ == "__main__":
    raise SystemExit(main())
