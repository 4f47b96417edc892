"""Read side: documents, results, batch progress and job counts as JSON-ready dicts (CLI, API and workers use
these, so every surface shows the same thing)."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from .context import Pipeline
from .errors import NotFoundError
from .models import Batch, BatchItem, Document, DocumentStatus, Job, Page, Result, Schema


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def document_status(doc: Document, jobs: list[Job]) -> str:
    """One word for a document: `failed` if unreadable, else its latest job's state (`ingested` without jobs)."""
    if doc.status == DocumentStatus.failed.value:
        return "failed"
    return jobs[-1].state if jobs else doc.status


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
) -> list[dict[str, Any]]:
    """Documents by id (ascending), `after_id` as the cursor. `status` matches the document's word (see
    `document_status`); `schema` keeps documents with a job for that schema."""
    with p.db.read_session() as s:
        stmt = select(Document).order_by(Document.id)
        if after_id is not None:
            stmt = stmt.where(Document.id > after_id)
        if created_after is not None:
            stmt = stmt.where(Document.created_at >= created_after)
        if created_before is not None:
            stmt = stmt.where(Document.created_at < created_before)
        if schema is not None:
            stmt = stmt.where(Document.id.in_(
                select(Job.document_id).join(Schema, Schema.id == Job.schema_id).where(Schema.name == schema)))
        if status is not None:
            latest_state = (select(Job.state).where(Job.document_id == Document.id).order_by(Job.id.desc())
                            .limit(1).correlate(Document).scalar_subquery())
            word = case((Document.status == DocumentStatus.failed.value, "failed"),
                        else_=func.coalesce(latest_state, Document.status))
            stmt = stmt.where(word == status)
        return [document_dict(d, with_pages=False) for d in s.scalars(stmt.limit(limit))]


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
    counts = {name: 0 for name in ("queued", "running", "succeeded", "partial", "failed")}
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


def jobs_by_state(p: Pipeline) -> dict[str, int]:
    with p.db.read_session() as s:
        rows = s.execute(select(Job.state, func.count(Job.id)).group_by(Job.state)).all()
    counts = {name: 0 for name in ("queued", "running", "succeeded", "partial", "failed")}
    counts.update({name: n for name, n in rows})
    return counts


def queued_job_ids(p: Pipeline, limit: int | None = None) -> list[int]:
    with p.db.read_session() as s:
        stmt = select(Job.id).where(Job.state == "queued").order_by(Job.id)
        return list(s.scalars(stmt.limit(limit) if limit else stmt))
