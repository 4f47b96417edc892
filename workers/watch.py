"""Watch folders: beat runs `scan_folder` for each configured folder; new stable files become documents and jobs.

A file is processed once, however often beat ticks:
  * one scan per folder at a time (a Redis lease lock; a tick that finds it taken does nothing),
  * the pipeline dedupes by content: the same bytes find the same document and job, never a second run,
  * with `watch_action=leave`, a file whose (size, mtime) was already taken is skipped without being read again
    (remembered in Redis; if Redis forgets, the content dedupe above still holds).
With `watch_action=move`, a file goes to `<folder>/done/` once stored (its bytes are in the blob store and its
job is queued; results appear when the job finishes) or to `<folder>/failed/` when it could not be read (the
reason is on the document row and in `docpipe status`). Relative paths are kept; name clashes get a suffix.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from sqlalchemy import select

from pipeline.attempts import receive_counted
from pipeline.context import Pipeline
from pipeline.ingest import IngestOutcome, create_batch
from pipeline.models import Job, JobState
from pipeline.walk import EXCLUDED_DIRS, stable_files

from .locks import RedisLock
from .markers import PREFIX, reply_text

log = logging.getLogger(__name__)


@dataclass
class ScanReport:
    folder: str
    scanned: bool  # False when another scan of this folder held the lock
    outcomes: list[IngestOutcome] = field(default_factory=list)
    skipped_seen: int = 0
    unstable: int = 0
    jobs_to_run: list[int] = field(default_factory=list)


def _folder_key(folder: Path) -> str:
    return hashlib.sha256(str(folder).encode()).hexdigest()[:16]


def lock_key(folder: Path) -> str:
    return f"{PREFIX}watch:lock:{_folder_key(folder)}"


def seen_key(folder: Path) -> str:
    return f"{PREFIX}watch:seen:{_folder_key(folder)}"


def stats_key(folder: Path) -> str:
    return f"{PREFIX}watch:stats:{_folder_key(folder)}"


def _move(path: Path, root: Path, target_dir: str) -> Path:
    destination = root / target_dir / path.relative_to(root)
    destination.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = destination, 1
    while candidate.exists():
        candidate = destination.with_name(f"{destination.stem}-{n}{destination.suffix}")
        n += 1
    path.rename(candidate)
    return candidate


def _job_needs_run(p: Pipeline, job_id: int) -> bool:
    with p.db.read_session() as s:
        state = s.scalar(select(Job.state).where(Job.id == job_id))
    return state == JobState.queued.value


def scan_folder(p: Pipeline, folder: Path, client: redis.Redis, *, lock_ttl_s: float) -> ScanReport:
    """Ingest the stable files of one watch folder; returns what happened (jobs to enqueue are listed)."""
    root = Path(folder).expanduser().resolve()
    report = ScanReport(str(root), scanned=False)
    client.hincrby(stats_key(root), "ticks", 1)
    if not root.is_dir():
        log.warning("watch folder %s does not exist or is not a folder; skipped", root)
        return report
    lock = RedisLock(client, lock_key(root), lock_ttl_s)
    if not lock.acquire_or_extend():
        return report
    try:
        report.scanned = True
        action = p.settings.watch_action
        stable, unstable = stable_files(root, p.settings.stable_seconds, EXCLUDED_DIRS)
        report.unstable = len(unstable)
        seen = ({reply_text(k): reply_text(v) for k, v in client.hgetall(seen_key(root)).items()}
                if action == "leave" else {})
        batch_id: int | None = None
        for path in stable:
            rel = str(path.relative_to(root))
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # removed since the walk
            signature = f"{st.st_size}:{st.st_mtime_ns}"
            if seen.get(rel) == signature:
                report.skipped_seen += 1
                continue
            if batch_id is None:
                batch_id = create_batch(p, f"watch:{root}")
            out = receive_counted(p, path, name=rel, batch_id=batch_id)  # a file that kills us is counted
            report.outcomes.append(out)
            if out.job_id is not None and _job_needs_run(p, out.job_id):
                report.jobs_to_run.append(out.job_id)
            if action == "move":
                _move(path, root, "failed" if out.outcome == "failed" else "done")
            else:
                client.hset(seen_key(root), rel, signature)
            lock.acquire_or_extend()  # long folders: keep the lease while working
        client.hset(stats_key(root), mapping={"last_scan": f"{time.time():.3f}", "last_files": len(report.outcomes)})
        client.hincrby(stats_key(root), "scans", 1)
    finally:
        lock.release()
    return report
