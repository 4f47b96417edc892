"""The read model of documents and jobs: one status rule, one listing, one count by state (API, CLI and workers
map these rows to their outputs, so every surface shows the same thing), plus JSON-ready dicts for the CLI.

Every listing and count takes an `Access` (pipeline.tenancy): the tenant filter lives here, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, case, exists, false, func, select
from sqlalchemy.orm import Session, aliased, selectinload

from .context import Pipeline
from .errors import NotFoundError
from .models import Batch, BatchItem, Document, DocumentStatus, Job, JobState, Page, Result, Schema
from .storable_text import storable
from .tenancy import EVERYONE, Access

JOB_STATES = tuple(state.value for state in JobState)


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


# --- the one status rule ----------------------------------------------------------------------------------------


def status_word(document_status: str, latest_job_state: str | None) -> str:
    """A document's status, on every surface: `failed` when its file could not be read, else the state of its
    latest job. A readable document without a job counts as `queued` (intake writes its job with it)."""
    if document_status == DocumentStatus.failed.value:
        return JobState.failed.value
    return latest_job_state or JobState.queued.value


def status_expression() -> ColumnElement[str]:
    """`status_word` in SQL, for filters: the same rule, evaluated by the database for each document row."""
    j = aliased(Job)
    latest = (select(j.state).where(j.document_id == Document.id).order_by(j.id.desc()).limit(1)
              .correlate(Document).scalar_subquery())
    return case((Document.status == DocumentStatus.failed.value, JobState.failed.value),
                else_=func.coalesce(latest, JobState.queued.value))


def document_status(doc: Document, jobs: list[Job]) -> str:
    return status_word(doc.status, jobs[-1].state if jobs else None)


# --- the one listing --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocumentFilter:
    status: str | None = None  # a status word: queued | running | succeeded | partial | failed
    schema: str | None = None  # documents with a job read with this schema (any version)
    created_after: datetime | None = None
    created_before: datetime | None = None


def select_documents(s: Session, flt: DocumentFilter, access: Access, *, limit: int, newest_first: bool,
                     before_id: int | None = None, after_id: int | None = None) -> list[Document]:
    """The documents `access` sees that match `flt`, with their jobs and the jobs' schemas loaded; ordered by id
    (newest first or oldest first), optionally after/before an id (cursor pagination: ids only grow)."""
    stmt = (select(Document).where(access.owns(Document.tenant))
            .options(selectinload(Document.jobs).selectinload(Job.schema)))
    if before_id is not None:
        stmt = stmt.where(Document.id < before_id)
    if after_id is not None:
        stmt = stmt.where(Document.id > after_id)
    if flt.created_after is not None:
        stmt = stmt.where(Document.created_at >= flt.created_after)
    if flt.created_before is not None:
        stmt = stmt.where(Document.created_at < flt.created_before)
    if flt.schema is not None:
        # A name the database cannot store names no schema (and PostgreSQL would refuse it as a parameter).
        of_schema = and_(Job.document_id == Document.id,
                         Job.schema_id.in_(select(Schema.id).where(Schema.name == flt.schema)))
        stmt = stmt.where(exists().where(of_schema) if storable(flt.schema) else false())
    if flt.status is not None:
        stmt = stmt.where(status_expression() == flt.status)
    order = Document.id.desc() if newest_first else Document.id
    return list(s.scalars(stmt.order_by(order).limit(limit)))


# --- the one count by state -------------------------------------------------------------------------------------


def count_jobs_by_state(s: Session, access: Access = EVERYONE) -> dict[str, int]:
    """Jobs per state (every state present, 0 when none) among the documents `access` sees."""
    stmt = select(Job.state, func.count(Job.id)).group_by(Job.state)
    if not access.admin:
        stmt = stmt.join(Document, Document.id == Job.document_id).where(access.owns(Document.tenant))
    counts = dict.fromkeys(JOB_STATES, 0)
    counts.update({state: int(n) for state, n in s.execute(stmt)})
    return counts


def jobs_by_state(p: Pipeline, access: Access = EVERYONE) -> dict[str, int]:
    with p.db.read_session() as s:
        return count_jobs_by_state(s, access)


# --- JSON-ready dicts (the CLI) ---------------------------------------------------------------------------------


def job_dict(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "document_id": job.document_id, "schema": job.schema.name,
        "schema_version": job.schema.version, "state": job.state, "attempts": job.attempts, "error": job.error,
        "created_at": _iso(job.created_at), "started_at": _iso(job.started_at), "finished_at": _iso(job.finished_at),
        "model_seconds": job.model_seconds, "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
    }


def page_dict(page: Page) -> dict[str, Any]:
    return {"index": page.index, "kind": page.kind, "width": page.width, "height": page.height,
            "timestamp": page.timestamp, "has_image": page.image_blob is not None,
            "has_text_layer": bool(page.text_layer), "error": page.error}


def document_dict(doc: Document, *, with_pages: bool = True) -> dict[str, Any]:
    jobs = list(doc.jobs)
    out: dict[str, Any] = {
        "id": doc.id, "sha256": doc.sha256, "name": doc.original_name, "media_type": doc.media_type,
        "kind": doc.kind, "size_bytes": doc.size_bytes, "page_count": doc.page_count,
        "status": document_status(doc, jobs), "error": doc.error, "error_type": doc.error_type,
        "repaired": doc.repaired, "created_at": _iso(doc.created_at), "jobs": [job_dict(j) for j in jobs],
    }
    if with_pages:
        out["pages"] = [page_dict(pg) for pg in doc.pages]
    return out


def result_dict(row: Result) -> dict[str, Any]:
    return {
        "unit": row.unit, "page_index": row.page_index, "ok": row.ok, "data": row.data,
        "confidence": row.confidence, "error": row.error, "raw_text": row.raw_text,
        "provenance": {"model_fingerprint": row.model_fingerprint, "engine_version": row.engine_version,
                       "schema": row.schema_name, "schema_version": row.schema_version, "sampling": row.sampling},
        "prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens,
    }


def _document(s: Session, document_id: int) -> Document:
    doc = s.get(Document, document_id)
    if doc is None:
        raise NotFoundError("document", document_id)
    return doc


def get_document(p: Pipeline, document_id: int) -> dict[str, Any]:
    with p.db.read_session() as s:
        return document_dict(_document(s, document_id))


def get_results(p: Pipeline, document_id: int, *, schema: str | None = None) -> dict[str, Any]:
    """The document and, per job (newest first; optionally one schema), the merged result and the unit results."""
    with p.db.read_session() as s:
        doc = _document(s, document_id)
        out = document_dict(doc, with_pages=True)
        jobs = [j for j in reversed(list(doc.jobs)) if schema is None or j.schema.name == schema]
        out["results"] = []
        for job in jobs:
            rows = list(job.results)
            merged = next((r for r in rows if r.unit == "document"), None)
            # every unit of a repaired file says so: its pages may be incomplete
            out["results"].append({
                "job_id": job.id, "schema": job.schema.name, "state": job.state, "error": job.error,
                "document": {**result_dict(merged), "repaired": doc.repaired} if merged else None,
                "units": [{**result_dict(r), "repaired": doc.repaired}
                          for r in sorted((r for r in rows if r.unit != "document"),
                                          key=lambda r: (r.page_index is None, r.page_index or 0))],
            })
        return out


def document_repaired(p: Pipeline, document_id: int) -> bool:
    """Whether the document's file was damaged and rebuilt to be read (its pages may be missing)."""
    with p.db.read_session() as s:
        return bool(s.scalar(select(Document.repaired).where(Document.id == document_id)))


def get_job(p: Pipeline, job_id: int) -> dict[str, Any]:
    with p.db.read_session() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFoundError("job", job_id)
        return job_dict(job)


def list_documents(
    p: Pipeline, *, status: str | None = None, schema: str | None = None, created_after: datetime | None = None,
    created_before: datetime | None = None, after_id: int | None = None, limit: int = 50,
    access: Access = EVERYONE,
) -> list[dict[str, Any]]:
    """`select_documents` oldest first as dicts, `after_id` as the cursor."""
    flt = DocumentFilter(status=status, schema=schema, created_after=created_after, created_before=created_before)
    with p.db.read_session() as s:
        rows = select_documents(s, flt, access, limit=limit, newest_first=False, after_id=after_id)
        return [document_dict(d, with_pages=False) for d in rows]


def batch_progress(p: Pipeline, batch_id: int) -> dict[str, Any]:
    """Counts by state for one batch, in one query: items with a job count by the job's state, items that failed
    at intake (no job) count as `failed`."""
    with p.db.read_session() as s:
        if s.get(Batch, batch_id) is None:
            raise NotFoundError("batch", batch_id)
        state = func.coalesce(Job.state, "failed").label("state")
        rows = s.execute(
            select(state, func.count(BatchItem.id)).select_from(BatchItem)
            .outerjoin(Job, Job.id == BatchItem.job_id).where(BatchItem.batch_id == batch_id).group_by(state)
        ).all()
    counts = dict.fromkeys(JOB_STATES, 0)
    counts.update({name: n for name, n in rows})
    total = sum(counts.values())
    done = counts["succeeded"] + counts["partial"] + counts["failed"]
    return {"batch_id": batch_id, "total": total, "done": done, "finished": total > 0 and done == total,
            "counts": counts}


def batch_items(p: Pipeline, batch_id: int) -> list[dict[str, Any]]:
    with p.db.read_session() as s:
        rows = s.execute(
            select(BatchItem, Job.state, Job.error).outerjoin(Job, Job.id == BatchItem.job_id)
            .where(BatchItem.batch_id == batch_id).order_by(BatchItem.id)
        ).all()
        return [{"name": item.name, "outcome": item.outcome, "document_id": item.document_id,
                 "job_id": item.job_id, "state": job_state or "failed", "error": item.error or job_error}
                for item, job_state, job_error in rows]

