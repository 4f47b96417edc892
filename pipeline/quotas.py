"""The in-flight job cap of a tenant, taken in the same transaction that queues the job.

Counting first and inserting later lets parallel uploads all see room and all insert (32 clients against a cap of
32 once queued 60). So the count and the INSERT share one write transaction, and writers of one tenant are
serialised for it: SQLite has one writer at a time anyway (BEGIN IMMEDIATE, see pipeline.db); on PostgreSQL a
transaction-scoped advisory lock per tenant does it, released by the commit that makes the new job visible.
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from .errors import PipelineError
from .models import Document, Job, JobState

ACTIVE_STATES = (JobState.queued.value, JobState.running.value)
_LOCK_NAMESPACE = "docpipe-jobs:"


@dataclass(frozen=True)
class JobCap:
    """At most `limit` queued + running jobs for `tenant`'s documents."""

    tenant: str
    limit: int

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"a job cap must be at least 1, got {self.limit}")


class QuotaExceededError(PipelineError):
    def __init__(self, cap: JobCap, active: int) -> None:
        super().__init__(f"tenant {cap.tenant!r} has {active} jobs queued or running (limit {cap.limit}); wait for "
                         "some to finish")
        self.cap = cap
        self.active = active


def active_jobs(s: Session, tenant: str) -> int:
    """Queued + running jobs of the tenant's documents."""
    stmt = (select(func.count(Job.id)).join(Document, Document.id == Job.document_id)
            .where(Document.tenant == tenant, Job.state.in_(ACTIVE_STATES)))
    return int(s.scalar(stmt) or 0)


def take_job_slots(s: Session, cap: JobCap, adding: int = 1) -> None:
    """Inside a write transaction, before inserting (or re-queueing) `adding` jobs: raise QuotaExceededError when
    they do not fit. Holds the tenant's lock until the transaction ends, so the jobs it then writes are counted
    by the next caller."""
    bind = s.get_bind()
    if bind.dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": _LOCK_NAMESPACE + cap.tenant})
    active = active_jobs(s, cap.tenant)
    if active + adding > cap.limit:
        raise QuotaExceededError(cap, active)
