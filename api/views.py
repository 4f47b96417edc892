"""Response bodies of the REST API (pydantic), built from the pipeline's ORM rows.

The public shape is defined here, not by the tables: renaming a column must not change the API.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

# SQLite returns datetimes without a zone; everything is stored in UTC, so the API says so (`utc`).
from pipeline.leases import aware as utc
from pipeline.models import Document, Job, Page, Result, Schema
from pipeline.queries import status_word

from .queries import DocumentSummary, JobRow

Status = Literal["queued", "running", "succeeded", "partial", "failed"]


class JobOut(BaseModel):
    id: int
    document_id: int
    schema_name: str = Field(serialization_alias="schema")
    schema_version: int
    state: Status
    attempts: int
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    model_seconds: float
    prompt_tokens: int
    completion_tokens: int


class PageOut(BaseModel):
    index: int
    kind: str
    width: int | None
    height: int | None
    timestamp: float | None
    error: str | None
    image_url: str | None


class DocumentOut(BaseModel):
    id: int
    name: str
    sha256: str
    media_type: str | None
    kind: str | None
    size_bytes: int
    page_count: int
    status: Status = Field(description="failed if the file could not be read, else the state of its latest job")
    error: str | None
    error_type: str | None
    repaired: bool = Field(description="true when the file was damaged (e.g. truncated) and had to be rebuilt to be "
                           "read: pages may be missing or incomplete")
    created_at: datetime
    jobs: list[JobOut]


class DocumentDetail(DocumentOut):
    pages: list[PageOut]
    metadata: dict[str, Any]


class DocumentPage(BaseModel):
    items: list[DocumentOut]
    next_cursor: str | None = Field(description="Pass as `cursor` to get the next page; null at the end.")


class UploadOut(BaseModel):
    document: DocumentOut
    job: JobOut | None = Field(description="null when the file could not be read (see document.error)")
    duplicate: bool = Field(description="true when these bytes were uploaded before (the existing document)")


class UnitOut(BaseModel):
    unit: str = Field(description='"page:N", "video" or "document"')
    page_index: int | None
    ok: bool
    data: Any | None
    confidence: dict[str, Any] | None = Field(description='{"overall": p, "fields": {json_pointer: p}}')
    error: str | None
    repaired: bool = Field(description="true when this unit's pages come from a file that had to be rebuilt to be "
                           "read (see the document's `repaired`)")


class ProvenanceOut(BaseModel):
    model_fingerprint: str | None
    engine_version: str | None
    schema_name: str = Field(serialization_alias="schema")
    schema_version: int
    sampling: dict[str, Any] | None


class ResultOut(BaseModel):
    document_id: int
    job_id: int
    schema_name: str = Field(serialization_alias="schema")
    schema_version: int
    state: Status
    error: str | None
    document: UnitOut | None = Field(description="The merged document result; null until the job finished")
    units: list[UnitOut] = Field(description="Per page (or per video) results")
    provenance: ProvenanceOut | None


class SchemaOut(BaseModel):
    name: str
    version: int
    builtin: bool
    json_schema: dict[str, Any]
    prompt: str
    merge_rules: dict[str, str]
    created_at: datetime


class SchemaList(BaseModel):
    items: list[SchemaOut]


class SchemaIn(BaseModel):
    name: str = Field(min_length=1, max_length=64, description="lowercase letters, digits, '_' or '-'")
    json_schema: dict[str, Any]
    prompt: str | None = Field(None, max_length=20_000)
    merge_rules: dict[str, str] | None = None


class BatchItemOut(BaseModel):
    name: str
    outcome: str = Field(description="new | duplicate | failed")
    document_id: int | None
    job_id: int | None
    error: str | None


class BatchOut(BaseModel):
    id: int
    source: str
    created_at: datetime
    counts: dict[str, int] = Field(description="jobs by state, plus 'intake_failed' for files never read")
    total: int
    done: bool
    items: list[BatchItemOut]


class DeletedOut(BaseModel):
    id: int
    deleted: bool


# --- conversions ------------------------------------------------------------------------------------------------


def _job_out(job: Job | JobRow, schema_name: str, schema_version: int) -> JobOut:
    """A job's answer from its ORM object or its summary row: the same names, but for its schema's."""
    return JobOut(
        id=job.id, document_id=job.document_id, schema_name=schema_name, schema_version=schema_version,
        state=job.state, attempts=job.attempts, error=job.error, created_at=utc(job.created_at),
        started_at=utc(job.started_at), finished_at=utc(job.finished_at), model_seconds=job.model_seconds,
        prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens,
    )


def job_out(job: Job) -> JobOut:
    return _job_out(job, job.schema.name, job.schema.version)


def _status(doc_status: str, latest_job_state: str | None) -> Status:
    """The pipeline's one status rule (`pipeline.queries.status_word`): its words are the job states."""
    return status_word(doc_status, latest_job_state)  # type: ignore[return-value]  # its words are Status's


def document_status(doc: Document) -> Status:
    return _status(doc.status, doc.jobs[-1].state if doc.jobs else None)


def document_out(doc: Document) -> DocumentOut:
    return DocumentOut(
        id=doc.id, name=doc.original_name, sha256=doc.sha256, media_type=doc.media_type, kind=doc.kind,
        size_bytes=doc.size_bytes, page_count=doc.page_count, status=document_status(doc), error=doc.error,
        error_type=doc.error_type, repaired=doc.repaired, created_at=utc(doc.created_at),
        jobs=[job_out(j) for j in doc.jobs],
    )


def summary_out(summary: DocumentSummary) -> DocumentOut:
    """The same as `document_out`, from rows (`queries.document_summary`) instead of ORM objects."""
    doc = summary.document
    jobs = [_job_out(j, j.schema_name, j.schema_version) for j in summary.jobs]
    status = _status(doc.status, jobs[-1].state if jobs else None)
    return DocumentOut(
        id=doc.id, name=doc.original_name, sha256=doc.sha256, media_type=doc.media_type, kind=doc.kind,
        size_bytes=doc.size_bytes, page_count=doc.page_count, status=status, error=doc.error,
        error_type=doc.error_type, repaired=bool(doc.repaired), created_at=utc(doc.created_at), jobs=jobs,
    )


def page_out(doc_id: int, page: Page) -> PageOut:
    return PageOut(
        index=page.index, kind=page.kind, width=page.width, height=page.height, timestamp=page.timestamp,
        error=page.error, image_url=f"/v1/documents/{doc_id}/pages/{page.index}.png" if page.image_blob else None,
    )


def document_detail(doc: Document) -> DocumentDetail:
    base = document_out(doc)
    return DocumentDetail(
        **base.model_dump(), pages=[page_out(doc.id, p) for p in doc.pages], metadata=doc.media_metadata or {}
    )


def unit_out(result: Result, *, repaired: bool) -> UnitOut:
    return UnitOut(unit=result.unit, page_index=result.page_index, ok=result.ok, data=result.data,
                   confidence=result.confidence, error=result.error, repaired=repaired)


def result_out(job: Job) -> ResultOut:
    repaired = bool(job.document.repaired)  # every page of a rebuilt file came from it
    merged = next((r for r in job.results if r.unit == "document"), None)
    units = sorted((r for r in job.results if r.unit != "document"),
                   key=lambda r: (r.page_index if r.page_index is not None else -1, r.unit))
    source = merged or (units[0] if units else None)
    provenance = None
    if source is not None:
        provenance = ProvenanceOut(
            model_fingerprint=source.model_fingerprint, engine_version=source.engine_version,
            schema_name=source.schema_name, schema_version=source.schema_version, sampling=source.sampling,
        )
    return ResultOut(
        document_id=job.document_id, job_id=job.id, schema_name=job.schema.name, schema_version=job.schema.version,
        state=job.state, error=job.error, document=unit_out(merged, repaired=repaired) if merged else None,
        units=[unit_out(r, repaired=repaired) for r in units], provenance=provenance,
    )


def schema_out(row: Schema) -> SchemaOut:
    return SchemaOut(name=row.name, version=row.version, builtin=row.builtin,
                     json_schema=row.json_schema, prompt=row.prompt, merge_rules=row.merge_rules or {},
                     created_at=utc(row.created_at))
