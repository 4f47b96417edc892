"""Database engines and sessions. SQLite gets WAL + foreign keys + a busy timeout; PostgreSQL goes through psycopg 3.

`Database(url)` owns one SQLAlchemy engine and a session factory; `Database.upgrade()` runs the Alembic
migrations shipped inside the package (the same as `docpipe db upgrade`).
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

try:
    import fcntl
except ImportError:  # Windows: writers of other processes wait in SQLite's busy handler
    fcntl = None  # type: ignore[assignment]  # the module or None: the lock below checks which

from sqlalchemy import CursorResult, Engine, Result, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
log = logging.getLogger(__name__)


def rows_matched(result: Result[*tuple[Any, ...]]) -> int:
    """Rows an UPDATE or DELETE matched: Session.execute types every result as Result, and a DML statement's is
    a CursorResult, which has the count."""
    return cast(CursorResult, result).rowcount


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


def _sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL; None for an in-memory database (one process only)."""
    database = make_url(url).database
    return None if not database or database == ":memory:" else Path(database).resolve()


def _private_sqlite_files(database_file: Path) -> None:
    """The database and its -wal / -shm files readable by this user only, like the blobs (they hold document text
    and results). Creating the file ourselves, 0600, before SQLite opens it matters: SQLite gives its WAL and
    shared-memory files the database file's mode, and would create the file 0644 itself. Files made by an older
    version are tightened here too."""
    os.close(os.open(database_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    for path in (database_file, Path(f"{database_file}-wal"), Path(f"{database_file}-shm")):
        try:
            if path.exists() and path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
        except OSError as exc:  # e.g. a file owned by another user: it still works, but say so
            log.warning("cannot make %s private (mode 0600): %s", path, exc)


def make_engine(url: str) -> Engine:
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database_file = _sqlite_file(url)
        if database_file is not None:
            database_file.parent.mkdir(parents=True, exist_ok=True)
            _private_sqlite_files(database_file)
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


class SqliteWriteLock:
    """One SQLite writer at a time, queued outside SQLite. SQLite's own busy handler makes a waiting writer sleep
    in growing steps (1, 2, 5 ... 100 ms) between retries: with several writers that sleep, not the work, makes the
    latency tail. Here threads of this process queue on a lock and processes on an flock() of `<db>-writer.lock`;
    both wake a waiter the moment the writer is done. Reentrant within a thread.

    The lock file is opened per process (again after a fork: a forked child sharing the parent's open file would
    share its lock too), and never deleted (removing it while another process waits on it would let a third
    lock a new file)."""

    def __init__(self, database_path: Path | None) -> None:
        self._path = None if database_path is None or fcntl is None else Path(f"{database_path}-writer.lock")
        self._start(os.getpid())

    def _start(self, pid: int) -> None:
        """Fresh state for process `pid` (also in a forked child: the parent's lock file, thread lock and
        nesting depth, copied as they were at the fork, are not this process's)."""
        self._pid = pid
        self._thread_lock = threading.RLock()
        self._fd: int | None = None
        self._depth = 0  # nesting of the thread holding _thread_lock

    def __enter__(self) -> None:
        if self._pid != os.getpid():  # a forked child: drop the parent's open lock file (its lock stays the parent's)
            if self._fd is not None:
                os.close(self._fd)
            self._start(os.getpid())
        self._thread_lock.acquire()
        try:
            if self._depth == 0 and self._path is not None:
                if self._fd is None:
                    self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocks without the GIL until the other writer is done
        except BaseException:
            self._thread_lock.release()
            raise
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        try:
            if self._depth == 0 and self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()


class Database:
    def __init__(self, url: str) -> None:
        self.url = normalise_url(url)
        self.engine = make_engine(self.url)
        self.session_factory = sessionmaker(self.engine, expire_on_commit=False)
        self.read_session_factory = sessionmaker(
            self.engine.execution_options(docpipe_write=False), expire_on_commit=False
        )
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        # SQLite has one writer at a time: write sessions queue for it on a lock (see SqliteWriteLock).
        self._write_lock = SqliteWriteLock(_sqlite_file(self.url)) if self.is_sqlite else None

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

        # SQLite: processes starting at once migrate one at a time, on the writer lock. BEGIN IMMEDIATE alone did
        # not serialise them once migrations rebuild tables in batch mode (two processes both applied 0002->0003).
        with self._write_lock or nullcontext():
            command.upgrade(alembic_config(self.url), revision)

    def dispose(self) -> None:
        self.engine.dispose()


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalise_url(url).replace("%", "%%"))
    return cfg
