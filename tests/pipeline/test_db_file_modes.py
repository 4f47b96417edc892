"""The embedded SQLite database and its WAL / shared-memory files are private to this user (0600), like the blobs
(issue 21 item 10): they hold documents' text layers and results."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from sqlalchemy import text

from pipeline.db import Database


def modes(path: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm"))
            if p.exists()}


def test_new_database_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "docpipe.sqlite"
    old = os.umask(0o022)  # the usual umask, under which SQLite makes 0644 files
    try:
        db = Database(f"sqlite:///{path}")
        with db.session() as s:
            s.execute(text("CREATE TABLE t (x INTEGER)"))
            s.execute(text("INSERT INTO t VALUES (1)"))
        found = modes(path)
        db.dispose()
    finally:
        os.umask(old)
    assert set(found) >= {"docpipe.sqlite", "docpipe.sqlite-wal"}, found  # WAL mode: the -wal file exists
    assert set(found.values()) == {0o600}, found


def test_existing_open_database_files_are_tightened(tmp_path: Path) -> None:
    path = tmp_path / "docpipe.sqlite"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    Database(f"sqlite:///{path}").dispose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
