"""Shared by the API tests (imported by name; not a conftest so that no other test folder is affected): real

PostgreSQL (127.0.0.1:5432, db `test`, user postgres, trust auth) gets a private schema per server, so tests of
other packages using the same database never see our tables. Unreachable -> skipped with the reason printed,
or failed when CI=true.
"""
from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from ci_rule import missing

from api.app import create_app
from api.limits import ApiLimits
from pipeline.settings import Settings

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples"
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

KEY = "test-key-" + uuid.uuid4().hex  # fresh per run
OTHER_KEY = "other-key-" + uuid.uuid4().hex
ADMIN_KEY = "admin-key-" + uuid.uuid4().hex  # sees every tenant's rows and the deployment's /metrics

# Small, fast extraction on the bundled tiny model: bounded strings/arrays keep every answer well under max_tokens.
FAST = dict(
    max_tokens=256,
    grammar_max_string_length=8,
    grammar_max_array_items=1,
    pdf_dpi=50.0,
    video_max_frames=4,
    max_page_pixels=200_000,
    engine_max_num_seqs=8,
    engine_max_batched_tokens=1024,
)
# Generous request limits: tests poll a lot; the limits test builds its own server with tight ones.
OPEN_LIMITS = ApiLimits(rate_per_minute=1_000_000, burst=100_000, max_inflight_jobs=1000,
                        max_upload_bytes=2 * 1024 * 1024, max_completion_tokens=64)


@dataclass
class LiveServer:
    base: str
    settings: Settings
    app: Any

    def client(self, key: str | None = KEY, timeout: float = 60.0) -> httpx.Client:
        headers = {"X-API-Key": key} if key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live_server(settings: Settings, limits: ApiLimits | None = OPEN_LIMITS,
                ready_timeout: float = 60.0) -> Iterator[LiveServer]:
    app = create_app(settings, limits=limits)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http="h11"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    live = LiveServer(base=f"http://127.0.0.1:{port}", settings=settings, app=app)
    try:
        if ready_timeout > 0:
            wait_ready(live, ready_timeout)
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        app.state.ctx.pipeline.close()


def wait_ready(live: LiveServer, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = httpx.get(live.base + "/readyz", timeout=10)
        if last.status_code == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"server not ready: {last.text if last else 'no answer'}")


def _postgres_or_skip() -> None:
    import psycopg

    try:
        psycopg.connect("host=127.0.0.1 port=5432 dbname=test user=postgres connect_timeout=3").close()
    except Exception as exc:
        reason = f"PostgreSQL at 127.0.0.1:5432 (db test) is not reachable: {exc}".splitlines()[0]
        missing(reason)


@contextmanager
def database_url(backend: str, data_dir: Path) -> Iterator[str | None]:
    """None means the default SQLite file in the data dir; for PostgreSQL a private schema, dropped afterwards."""
    if backend == "sqlite":
        yield None
        return
    _postgres_or_skip()
    import psycopg

    schema = "api_test_" + uuid.uuid4().hex[:10]
    with psycopg.connect("host=127.0.0.1 port=5432 dbname=test user=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect("host=127.0.0.1 port=5432 dbname=test user=postgres", autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_settings(data_dir: Path, db_url: str | None = None, **overrides: Any) -> Settings:
    values: dict[str, Any] = dict(FAST, data_dir=data_dir, database_url=db_url,
                                  api_keys=[KEY, OTHER_KEY, f"*:{ADMIN_KEY}"], broker_url=None,
                                  max_file_bytes=OPEN_LIMITS.max_upload_bytes)
    values.update(overrides)
    return Settings(**values)


test_settings.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp(f"api-{request.param}")
    with database_url(request.param, data_dir) as url, live_server(test_settings(data_dir, url)) as live:
        yield live


@pytest.fixture(scope="module")
def sqlite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("api-sqlite-only")
    with live_server(test_settings(data_dir)) as live:
        yield live


def sample_files() -> list[Path]:
    """The media in samples/ (its generator script and README are not samples)."""
    if not SAMPLES.is_dir():
        return []
    return sorted(p for p in SAMPLES.iterdir()
                  if p.is_file() and p.suffix not in (".py", ".md") and not p.name.startswith("."))


def wait_finished(client: httpx.Client, doc_id: int, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get(f"/v1/documents/{doc_id}/result")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["state"] in ("succeeded", "partial", "failed"):
            return body
        time.sleep(0.2)
    raise AssertionError(f"document {doc_id} not finished after {timeout} s: {body}")
