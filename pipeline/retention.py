"""Retention purge: documents older than `retention_days` go, with their pages, jobs and results (database
cascades), and every blob no remaining row refers to (the original file and rendered pages).

Documents with a job still queued or running are kept until it finishes. Blobs are content-addressed and may be
shared (the same page rendered for two documents), so a blob is deleted only when no document or page still
names it. The purge runs in small batches so it never holds the database's write lock for long.

A storage operation of the pipeline; the workers' beat task (`docpipe.purge_retention`) calls it on a schedule.
The same beat task sweeps the blob store for blobs no row names (`sweep_unreferenced_blobs`), with or without a
retention period.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from .context import Pipeline
from .models import Document, Job, JobState, Page, utcnow

# A blob younger than this may belong to an intake or a render that has not written its row yet.
SWEEP_GRACE_S = 3600.0


@dataclass
class PurgeReport:
    documents: int = 0
    blobs: int = 0


def purge_older_than(p: Pipeline, days: int, *, batch_size: int = 200) -> PurgeReport:
    if days < 1:
        raise ValueError(f"retention must be at least 1 day, got {days}")
    cutoff = utcnow() - timedelta(days=days)
    busy = (JobState.queued.value, JobState.running.value)
    report = PurgeReport()
    while True:
        with p.db.session() as s:
            has_busy_job = exists().where(Job.document_id == Document.id, Job.state.in_(busy))
            ids = list(s.scalars(select(Document.id).where(Document.created_at < cutoff, ~has_busy_job)
                                 .order_by(Document.id).limit(batch_size)))
            if not ids:
                return report
            keys = set(s.scalars(select(Document.sha256).where(Document.id.in_(ids))))
            keys |= {k for k in s.scalars(select(Page.image_blob).where(Page.document_id.in_(ids))) if k}
            for doc in s.scalars(select(Document).where(Document.id.in_(ids))):
                s.delete(doc)  # ORM cascade: pages, jobs, results; batch items keep their row (document SET NULL)
            s.flush()
            still_used = set(s.scalars(select(Document.sha256).where(Document.sha256.in_(keys))))
            still_used |= set(s.scalars(select(Page.image_blob).where(Page.image_blob.in_(keys))))
        report.documents += len(ids)
        for key in sorted(keys - still_used):
            report.blobs += int(p.blobs.delete(key))



def referenced_blobs(s: Session, keys: set[str]) -> set[str]:
    """The keys among `keys` that a document (its original) or a page (its image) still names."""
    if not keys:
        return set()
    used = set(s.scalars(select(Document.sha256).where(Document.sha256.in_(keys))))
    used |= set(s.scalars(select(Page.image_blob).where(Page.image_blob.in_(keys))))
    return used


def drop_unreferenced(p: Pipeline, keys: set[str]) -> int:
    """Remove the blobs among `keys` that no row names (after a delete, or a render whose document went away)."""
    with p.db.read_session() as s:
        unused = set(keys) - referenced_blobs(s, set(keys))
    return sum(int(p.blobs.delete(key)) for key in sorted(unused))


def sweep_unreferenced_blobs(p: Pipeline, *, grace_s: float = SWEEP_GRACE_S, chunk: int = 500) -> int:
    """Remove every blob no row names that was written more than `grace_s` ago (younger ones may belong to an
    intake or a render that has not written its row yet). What a crash between a blob write and its row, or
    between a delete's commit and its blob removal, left behind. Returns the number removed."""
    removed = 0
    batch: list[str] = []
    for key in p.blobs.keys_older_than(grace_s):
        batch.append(key)
        if len(batch) >= chunk:
            removed += drop_unreferenced(p, set(batch))
            batch.clear()
    if batch:
        removed += drop_unreferenced(p, set(batch))
    return removed
