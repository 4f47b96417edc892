"""Read queries behind the REST routes (documents list with filters and cursor pagination, lookups, delete); the
listing itself is the pipeline's read model (`pipeline.queries`), with the API's cursor around it.

Every lookup takes the caller's `Access` (pipeline.tenancy): a row of another tenant is not found (404, as an id
that does not exist), never forbidden, so ids reveal nothing across tenants."""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Self

from sqlalchemy import Connection, bindparam, select
from sqlalchemy.orm import Session, joinedload, selectinload

from pipeline.models import Batch, Document, Job, JobState, Page, Schema
from pipeline.queries import DocumentFilter, select_documents
from pipeline.tenancy import Access

from .bounds import MAX_ROW_ID
from .errors import ApiError, NotFound


class BadCursor(ApiError):
    def __init__(self) -> None:
        super().__init__(400, "invalid_cursor", "The cursor is not one this server issued; start again without it.")


def encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"d:{last_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        prefix, _, value = raw.partition(":")
        if prefix != "d" or not value.isascii() or not value.isdigit() or int(value) > MAX_ROW_ID:
            raise ValueError(raw)  # out of the id range: no id we issued, and PostgreSQL would overflow on it
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise BadCursor() from None


def list_documents(s: Session, flt: DocumentFilter, limit: int, cursor: str | None,
                   access: Access) -> tuple[list[Document], str | None]:
    """The caller's documents, newest first (`pipeline.queries.select_documents`). A cursor is the last id of the
    previous page (ids only grow, so pages never overlap)."""
    before = decode_cursor(cursor) if cursor is not None else None
    rows = select_documents(s, flt, access, limit=limit + 1, newest_first=True, before_id=before)
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (encode_cursor(rows[-1].id) if more and rows else None)


def load_document(s: Session, doc_id: int, access: Access, *, pages: bool = False) -> Document:
    # One statement for the document, its jobs and their schemas (joined: a document has few jobs); pages, which
    # can be thousands, in a second one rather than multiplying the joined rows.
    opts = [joinedload(Document.jobs).joinedload(Job.schema)]
    if pages:
        opts.append(selectinload(Document.pages))
    doc = s.scalars(select(Document).where(Document.id == doc_id, access.owns(Document.tenant))
                    .options(*opts)).unique().first()
    if doc is None:
        raise NotFound("document", doc_id)
    return doc


@dataclass(frozen=True)
class _FromMapping:
    @classmethod
    def of(cls, row: Mapping[Any, Any]) -> Self:
        """From a mapping holding (at least) its fields: a summary query's row, or an INSERT's RETURNING."""
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class DocumentRow(_FromMapping):
    """The document columns an upload's answer shows."""

    id: int
    original_name: str
    sha256: str
    media_type: str | None
    kind: str | None
    size_bytes: int
    page_count: int
    status: str
    error: str | None
    error_type: str | None
    repaired: bool | None
    created_at: datetime


@dataclass(frozen=True)
class JobRow(_FromMapping):
    """A job's columns as an upload's answer shows them, with its schema's name and version."""

    id: int
    document_id: int
    schema_name: str
    schema_version: int
    state: str
    attempts: int
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    model_seconds: float
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class DocumentSummary:
    """A document and its jobs as plain rows: read by `document_summary`, or (api.intake.inserted_out) taken from
    the rows intake inserted, so that an upload's answer needs no ORM objects and no read back."""

    document: DocumentRow
    jobs: list[JobRow]


# Built once (their cache keys are memoised): the upload route's read constructs no statement.
_SUMMARY_DOCUMENT = (select(Document.id, Document.original_name, Document.sha256, Document.media_type, Document.kind,
                            Document.size_bytes, Document.page_count, Document.status, Document.error,
                            Document.error_type, Document.repaired, Document.created_at)
                     .where(Document.id == bindparam("doc_id")))
_SUMMARY_JOBS = (select(Job.id, Job.document_id, Schema.name.label("schema_name"),
                        Schema.version.label("schema_version"), Job.state, Job.attempts, Job.error, Job.created_at,
                        Job.started_at, Job.finished_at, Job.model_seconds, Job.prompt_tokens, Job.completion_tokens)
                 .join(Schema, Job.schema_id == Schema.id).where(Job.document_id == bindparam("doc_id"))
                 .order_by(Job.id))


def document_summary(s: Session | Connection, doc_id: int) -> DocumentSummary:
    """What an upload answers, read as rows: the upload route's hottest read, where building ORM objects (with
    joined collections) cost more CPU than the rest of the intake's database work."""
    doc = s.execute(_SUMMARY_DOCUMENT, {"doc_id": doc_id}).first()
    if doc is None:
        raise NotFound("document", doc_id)
    jobs = s.execute(_SUMMARY_JOBS, {"doc_id": doc_id}).all()
    return DocumentSummary(DocumentRow.of(doc._mapping), [JobRow.of(j._mapping) for j in jobs])


def load_job(s: Session, job_id: int, access: Access, *, results: bool = False) -> Job:
    opts = [selectinload(Job.schema)]
    if results:
        opts.append(selectinload(Job.results))
    mine = select(Document.id).where(Document.id == Job.document_id, access.owns(Document.tenant)).exists()
    job = s.scalars(select(Job).where(Job.id == job_id, mine).options(*opts)).first()
    if job is None:
        raise NotFound("job", job_id)
    return job


def result_job(s: Session, doc_id: int, schema: str | None, access: Access) -> Job:
    """The document's latest job (of `schema` if given), with its results."""
    doc = load_document(s, doc_id, access)
    jobs = [j for j in doc.jobs if schema is None or j.schema.name == schema]
    if not jobs:
        what = f" with schema {schema!r}" if schema else ""
        raise ApiError(404, "result_not_found", f"Document {doc_id} has no extraction job{what}"
                       + (f" ({doc.error})" if doc.error else "."))
    return load_job(s, jobs[-1].id, access, results=True)


def page_blob(s: Session, doc_id: int, index: int, access: Access) -> str:
    load_document(s, doc_id, access)
    page = s.scalars(select(Page).where(Page.document_id == doc_id, Page.index == index)).first()
    if page is None:
        raise NotFound("page", f"{doc_id}/{index}")
    if page.image_blob is None:
        raise ApiError(404, "page_not_rendered", f"Page {index} of document {doc_id} has no image"
                       + (f": {page.error}" if page.error else "."))
    return page.image_blob


def load_batch(s: Session, batch_id: int, access: Access) -> Batch:
    batch = s.scalars(select(Batch).where(Batch.id == batch_id, access.owns(Batch.tenant))
                      .options(selectinload(Batch.items))).first()
    if batch is None:
        raise NotFound("batch", batch_id)
    return batch


def batch_job_states(s: Session, batch: Batch) -> dict[int, str]:
    ids = [i.job_id for i in batch.items if i.job_id is not None]
    if not ids:
        return {}
    return dict(s.execute(select(Job.id, Job.state).where(Job.id.in_(ids))).all())


def active_job_ids(s: Session, job_ids: list[int]) -> set[int]:
    rows = s.scalars(select(Job.id).where(Job.id.in_(job_ids),
                                          Job.state.in_([JobState.queued.value, JobState.running.value])))
    return set(rows)


def delete_document(s: Session, doc_id: int, access: Access) -> set[str]:
    """Delete the document with its pages, jobs and results (batch items keep their row, without the link).

    Returns the blob keys no other row uses any more; the caller removes them once the transaction committed
    (removing them earlier could lose a blob that a rolled-back delete still needs).
    """
    doc = load_document(s, doc_id, access, pages=True)
    if any(j.state == JobState.running.value for j in doc.jobs):
        raise ApiError(409, "document_busy", f"Document {doc_id} is being processed right now; delete it when its "
                       "job has finished.")
    keys = {doc.sha256} | {p.image_blob for p in doc.pages if p.image_blob}
    s.delete(doc)
    s.flush()
    # Blobs are content-addressed: an identical page image may belong to another document too.
    still_used = set(s.scalars(select(Page.image_blob).where(Page.image_blob.in_(keys))))
    still_used |= set(s.scalars(select(Document.sha256).where(Document.sha256.in_(keys))))
    return keys - still_used
