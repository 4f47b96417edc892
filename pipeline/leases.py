"""A running job's lease: who holds it (`host:pid`), whether that holder is gone, and when the lease has lapsed.

A run writes `this_owner()` and a lease time when it claims a job (pipeline.jobs). Another run may take the job
over once `run_lapsed` says so; the reconciler (pipeline.jobs.stale_jobs) asks the same question.
"""
from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from typing import overload


def this_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_is_dead(owner: str | None) -> bool:
    """True only when we can tell: the owner ran on this host and its process no longer exists."""
    if not owner or ":" not in owner:
        return False
    host, _, pid_text = owner.rpartition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@overload
def aware(moment: datetime) -> datetime: ...
@overload
def aware(moment: None) -> None: ...
def aware(moment: datetime | None) -> datetime | None:
    """SQLite hands datetimes back without a zone; we only ever store UTC."""
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment


def run_lapsed(lease: datetime | None, owner: str | None, now: datetime) -> bool:
    """Whether a `running` job's run is over without having said so: no lease, its lease passed, or its owner
    process is gone from this host."""
    lease = aware(lease)
    return lease is None or lease <= now or owner_is_dead(owner)
