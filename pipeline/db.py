"""Database engines and sessions. SQLite gets WAL + foreign keys + a busy timeout; PostgreSQL goes through psycopg 3.

`Database(url)` owns one SQLAlchemy engine and a session factory; `Database.upgrade()` runs the Alembic
migrations shipped inside the package (the same as `docpipe db upgrade`).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def normalise_url(url: str) -> str:
    """`postgresql://` means psycopg 3 here (SQLAlchemy would otherwise pick psycopg2, which we do not ship)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer (API reads while jobs write)
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")  # wait for the writer lock instead of failing at once
    # With WAL, NORMAL stays consistent: a process crash loses nothing, a power loss at most the last commits.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(conn: Any) -> None:
    immediate = conn.get_execution_options().get("docpipe_write", True)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def make_engine(url: str) -> Engine:
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        # pysqlite's own transaction handling defers BEGIN until the first write, which lets two writers read
        # the same row and both decide to act. Emit BEGIN IMMEDIATE ourselves so a transaction owns the write
        # lock from its start: state transitions are then true compare-and-set operations.
        event.listen(engine, "connect", lambda conn, _rec: setattr(conn, "isolation_level", None))
        # Read-only sessions (Database.read_session) opt out: they must not queue behind writers.
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_pre_ping=True)


class Database:
    def __init__(self, url: str) -> None:
        self.url = normalise_url(url)
        self.engine = make_engine(self.url)
        self.session_factory = sessionmaker(self.engine, expire_on_commit=False)
        self.read_session_factory = sessionmaker(
            self.engine.execution_options(docpipe_write=False), expire_on_commit=False
        )
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        # SQLite has one writer at a time. Threads of this process that wait for it queue on this lock (woken the
        # moment the writer commits) instead of inside SQLite's busy handler, which sleeps in growing steps of up
        # to 100 ms between retries: with many concurrent uploads that sleep, not the work, made the latency tail.
        # Other processes still wait through busy_timeout. Reentrant: a nested write session behaves as before.
        self._write_lock = threading.RLock() if self.is_sqlite else None

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session whose transaction commits on success and rolls back on any exception."""
        with self._write_lock or nullcontext(), self.session_factory() as session, session.begin():
            yield session

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """A session for queries only (on SQLite it does not take the write lock); rolled back at the end."""
        with self.read_session_factory() as session:  # closing the session rolls its transaction back
            yield session

    def upgrade(self, revision: str = "head") -> None:
        """Apply the packaged Alembic migrations up to `revision`."""
        from alembic import command

        command.upgrade(alembic_config(self.url), revision)

    def dispose(self) -> None:
        self.engine.dispose()


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalise_url(url).replace("%", "%%"))
    return cfg
