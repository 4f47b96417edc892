"""SQLite writers of several processes queue on one file lock (pipeline.db.SqliteWriteLock)."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from pipeline.db import Database, SqliteWriteLock

fcntl = pytest.importorskip("fcntl", reason="the cross-process writer lock uses flock (POSIX)")


def _held_elsewhere(lock_file: Path) -> bool:
    """True when some other open file of `lock_file` holds the flock (a new open file cannot take it)."""
    fd = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock this probe took
    return False


def _count_up(db_file: str, counter: str, times: int) -> None:
    """A writer process: read-modify-write of a counter file under the lock, with a pause that invites races."""
    lock = SqliteWriteLock(Path(db_file))
    for _ in range(times):
        with lock:
            value = int(Path(counter).read_text())
            time.sleep(0.001)
            Path(counter).write_text(str(value + 1))


def test_processes_take_turns(tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_count_up, args=(str(tmp_path / "d.db"), str(counter), 25)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    assert int(counter.read_text()) == 75  # every increment survived: no two processes were inside at once


def test_nested_use_keeps_the_file_lock_until_the_outermost_exit(tmp_path: Path) -> None:
    lock = SqliteWriteLock(tmp_path / "d.db")
    lock_file = tmp_path / "d.db-writer.lock"
    with lock:
        with lock:
            assert _held_elsewhere(lock_file)
        assert _held_elsewhere(lock_file)  # the inner exit must not release the outer holder's lock
    assert not _held_elsewhere(lock_file)


def _take_and_mark(lock: SqliteWriteLock, marker: str) -> None:
    with lock:
        Path(marker).write_text("in")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method")
def test_a_forked_child_does_not_share_the_parents_lock(tmp_path: Path) -> None:
    lock = SqliteWriteLock(tmp_path / "d.db")
    marker = tmp_path / "child-was-in"
    with lock:  # the parent's open lock file now exists and holds the flock; a forked child inherits that file
        child = multiprocessing.get_context("fork").Process(target=_take_and_mark, args=(lock, str(marker)))
        child.start()
        time.sleep(0.5)
        assert not marker.exists(), "the child got in while the parent held the lock"
    child.join(30)
    assert child.exitcode == 0 and marker.read_text() == "in"


def test_database_sessions_use_it_only_for_a_sqlite_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_disk = Database(f"sqlite:///{tmp_path / 'x.db'}")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a lock file made for an in-memory database would land here
    in_memory = Database("sqlite://")
    try:
        with on_disk.session():
            assert _held_elsewhere(tmp_path / "x.db-writer.lock")
        assert not _held_elsewhere(tmp_path / "x.db-writer.lock")
        # In memory: one process only, so no lock file, but threads of this process still take turns.
        holder_in, other_in = threading.Event(), threading.Event()

        def other_writer() -> None:
            with in_memory.session():
                other_in.set()

        with in_memory.session():
            holder_in.set()
            other = threading.Thread(target=other_writer)
            other.start()
            assert not other_in.wait(0.5), "a second thread's write session got in while the first held it"
        other.join(30)
        assert other_in.is_set()
        assert list(elsewhere.iterdir()) == []
        assert [f.name for f in tmp_path.iterdir() if f.name.endswith("writer.lock")] == ["x.db-writer.lock"]
    finally:
        on_disk.dispose()
        in_memory.dispose()
