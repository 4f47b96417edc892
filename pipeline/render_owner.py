"""Whose render a job's document is, for render fairness: the API key that uploaded it, else its tenant.

One rule for both modes (the embedded runner's lanes, api.fair_queue; the ingest workers' render slots,
workers.render_slots): each key gets its own lane and its own cap, so one key's expensive documents cannot starve
another key's, whether the two keys belong to one tenant or to two. Documents without a key (the CLI, watch
folders, staged submissions, an API without keys, rows from before keys were recorded) share their tenant's lane.
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from .context import Pipeline
from .errors import NotFoundError
from .models import Document, Job


@dataclass(frozen=True)
class RenderOwner:
    tenant: str
    key_id: str | None  # api.auth.key_id of the uploader, None when it came without a key

    @property
    def lane(self) -> str:
        """The label fairness counts by: one per key, or one per tenant for documents without a key."""
        return f"key:{self.key_id}" if self.key_id else f"tenant:{self.tenant}"


def render_owner(p: Pipeline, job_id: int) -> RenderOwner:
    with p.db.read_session() as s:
        row = s.execute(select(Document.tenant, Document.uploaded_by).join(Job, Job.document_id == Document.id)
                        .where(Job.id == job_id)).first()
    if row is None:
        raise NotFoundError("job", job_id)
    return RenderOwner(row.tenant, row.uploaded_by)
