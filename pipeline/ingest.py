"""Intake: a file becomes a stored Document and a queued Job for a schema.

Two ways in, one set of rows:

* `receive_file` — the fast half only (what an HTTP upload does): store the bytes, sniff the type from its magic
  bytes, write the document as `received` and its job as `queued`. Pages are rendered later, in the job's own
  time (`pipeline.rendering`): by the `ingest` queue in broker mode, by `run_job` itself otherwise.
* `ingest_file` — store, sniff *and render* now (the CLI, folder ingestion, the ingest queue's staged files, and
  uploads that carry a PDF password, which is never stored): the document is `ingested` or `failed` on return.

`pipeline.walk.iter_folder` walks a folder (the CLI, watch folders) through `ingest_file`. Each file's outcome is
recorded — `new` (its job was queued by this intake), `duplicate` (same content, schema and model already had a job: its
results are reused), `failed` (the file cannot be read; the reason is stored on the document row), or
`unstable` (folder walks only: still being written, taken on a later walk) — and a bad file never raises. Bad
arguments (an unknown schema) do raise.

A file refused at intake (not an accepted type, too large, unreadable now) gets a `failed` document and no job.
A `received` file that turns out unreadable while rendering gets a `failed` document and its jobs fail with the
same reason. The same bytes sent again after a failure are read again (and their failed jobs queued again).

Documents belong to a tenant (`tenant=`, pipeline.tenancy) and are unique per tenant and content; with a `cap`
(pipeline.quotas.JobCap) a new job is queued only while the tenant has room, checked in the transaction that
inserts it (QuotaExceededError otherwise, and a blob this intake stored for nothing is removed again).
"""
from __future__ import annotations

import io
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Literal, cast

from sqlalchemy import Connection, Table, bindparam, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import vision
from vision import SNIFF_BYTES, Sniffed, sniff

from .context import Pipeline
from .models import Batch, BatchItem, Document, DocumentStatus, Job
from .quotas import JobCap, take_job_slots
from .rendering import Rendered, requeue_document_jobs, try_render, write_render
from .retention import drop_unreferenced
from .schemas import SchemaRef, latest_schema_ref
from .storable_text import storable_name
from .tenancy import DEFAULT_TENANT

Outcome = Literal["new", "duplicate", "failed", "unstable"]


@dataclass
class IngestOutcome:
    name: str
    outcome: Outcome
    document_id: int | None = None
    job_id: int | None = None
    error: str | None = None
    error_type: str | None = None
    pages: int = 0
    seconds: float = 0.0
    rendered: bool = False  # pages exist now (False: `received`, rendered when the job runs)
    known: bool = False  # these bytes were already a document before this intake
    inserted: InsertedRows | None = None  # set when this intake created the document and its job (receive_file)


@dataclass(frozen=True)
class InsertedRows:
    """The two rows an intake of new bytes inserted, every column as stored (the INSERTs return them), and the job's
    schema, so that the caller can answer without reading anything back."""

    document: dict[str, Any]
    job: dict[str, Any]
    schema: SchemaRef


@dataclass(frozen=True)
class HashedFile:
    """Received bytes whose sha256 and size the caller computed while receiving them (an upload taken in by the
    API): a file on disk (`path`), which intake moves into the blob store, or bytes held in memory (`data`),
    which it writes there; neither is hashed again. `head`, when given, holds the first `HEAD_BYTES` (all of a
    smaller file), kept while receiving, so the type is sniffed without reading the file back."""

    HEAD_BYTES: ClassVar[int] = SNIFF_BYTES

    sha256: str
    size: int
    path: Path | None = None
    data: bytes | None = None
    head: bytes | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.data is None):
            raise ValueError("a HashedFile is either on disk (path) or in memory (data)")


Source = str | os.PathLike[str] | bytes | BinaryIO | HashedFile


def create_batch(p: Pipeline, source: str, tenant: str = DEFAULT_TENANT) -> int:
    with p.db.session() as s:
        batch = Batch(source=storable_name(source)[:1024], tenant=tenant)  # e.g. a watched folder's path
        s.add(batch)
        s.flush()
        return batch.id


def resolve_schema_name(p: Pipeline, schema: str | None, kind: str | None) -> str:
    """No schema given: videos get `video`, everything else the configured default."""
    if schema:
        return schema
    return "video" if kind == "video" else p.settings.default_schema


def schema_ref(p: Pipeline, name: str, tenant: str) -> SchemaRef:
    """The latest version of schema `name` visible to `tenant` (UnknownSchemaError if none)."""
    with p.db.read_session() as s:
        return latest_schema_ref(s, name, tenant)


def _store_original(p: Pipeline, source: Source, label: str) -> tuple[str, int]:
    """Put the original into the blob store; (sha256, size). Raises OSError or vision.LimitExceededError."""
    limit = p.settings.max_file_bytes
    if isinstance(source, HashedFile):
        if source.size > limit:
            raise vision.LimitExceededError(
                f"{label} is {source.size} bytes, more than the limit of {limit} (DOCPIPE_MAX_FILE_BYTES)")
        if source.data is not None:
            p.blobs.put_hashed(source.data, source.sha256)
        else:
            assert source.path is not None
            p.blobs.adopt(source.path, source.sha256)
        return source.sha256, source.size
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.stat().st_size > limit:
            raise vision.LimitExceededError(
                f"{label} is {path.stat().st_size} bytes, more than the limit of {limit} (DOCPIPE_MAX_FILE_BYTES)")
        return p.blobs.put_file(path)
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    try:
        return p.blobs.put_stream(stream, max_bytes=limit)
    except ValueError as exc:
        raise vision.LimitExceededError(f"{label}: {exc} (DOCPIPE_MAX_FILE_BYTES)") from None


def _label(source: Source, name: str | None) -> str:
    # Stored as the document's name: a file name that is not UTF-8 must not stop the intake (storable_name).
    if name:
        return storable_name(name)
    if isinstance(source, HashedFile):
        return storable_name(source.path.name) if source.path is not None else "upload"
    return storable_name(Path(source).name) if isinstance(source, (str, os.PathLike)) else "upload"


_EXISTING = select(Document.id, Document.status, Document.kind, Document.page_count).where(
    Document.sha256 == bindparam("sha"), Document.tenant == bindparam("tenant"))  # built once


def _existing_in(s: Session | Connection, sha: str, tenant: str) -> Any:
    """The tenant's known document with these bytes (id, status, kind, page_count), or None."""
    return s.execute(_EXISTING, {"sha": sha, "tenant": tenant}).first()


def _existing(p: Pipeline, sha: str, tenant: str) -> Any:
    with p.db.read_session() as s:
        return _existing_in(s, sha, tenant)



def _sniff_blob(p: Pipeline, sha: str, label: str) -> Sniffed:
    """The type from the stored bytes' magic bytes (raises an UnsupportedMediaError/EmptyMediaError subclass)."""
    with open(p.blobs.path(sha), "rb") as f:
        return sniff(f.read(SNIFF_BYTES), name=label)


def _sniff_original(p: Pipeline, source: Source, sha: str, size: int, label: str) -> Sniffed:
    """`_sniff_blob`, from the head the caller kept while writing the file when it has one (no read back)."""
    if isinstance(source, HashedFile) and source.head is not None and len(source.head) >= min(size, SNIFF_BYTES):
        return sniff(source.head[:SNIFF_BYTES], name=label)
    return _sniff_blob(p, sha, label)


def _savepoint(p: Pipeline, s: Session | Connection) -> Any:
    """A savepoint around an INSERT that a concurrent intake may win (PostgreSQL: the unique key decides, the
    loser rolls back to here). SQLite needs none: write transactions start with BEGIN IMMEDIATE, so no other
    writer can insert between our lookup and our INSERT."""
    return nullcontext() if p.db.is_sqlite else s.begin_nested()


def _received_fields(sniffed: Sniffed) -> dict[str, Any]:
    return {"status": DocumentStatus.received.value, "error": None, "error_type": None, "kind": sniffed.kind,
            "media_type": sniffed.media_type, "media_metadata": {}, "page_count": 0}


def _store_document(p: Pipeline, sha: str, size: int, name: str, *, sniffed: Sniffed | None = None,
                    rendered: Rendered | None = None, error: Exception | None = None,
                    schema_id: int | None = None, tenant: str = DEFAULT_TENANT,
                    cap: JobCap | None = None,
                    key_id: str | None = None) -> tuple[int, list[int], tuple[int, bool] | None]:
    """Insert (or, for a previously failed file, refresh) the document row: `received` when only `sniffed`,
    else the render's outcome (`ingested` with pages, or `failed` with `error`). With `schema_id`, the job is got
    or created in the same transaction (one commit per upload instead of two). Returns (document id, ids of the
    jobs a refresh put back to `queued`, (job id, created) or None).

    Two intakes of the same bytes may race: the unique sha256 decides, the loser keeps the winner's row."""
    with p.db.session() as s:
        by_sha = select(Document).where(Document.sha256 == sha, Document.tenant == tenant).with_for_update()
        doc = s.scalars(by_sha).first()
        fresh = doc is None
        if doc is None:
            # A received document is complete at its INSERT (no UPDATE after); a rendered one gets its fields below.
            received = _received_fields(sniffed) if sniffed is not None else {}
            try:
                with _savepoint(p, s):
                    doc = Document(sha256=sha, tenant=tenant, original_name=name[:1024], size_bytes=size,
                                   uploaded_by=key_id, **received)
                    s.add(doc)
                    s.flush()
            except IntegrityError:  # the other intake committed first (PostgreSQL; SQLite serialises writers)
                fresh = False
                doc = s.scalars(by_sha).one()
        if doc.status != DocumentStatus.failed.value and not fresh:  # a concurrent intake of the same bytes won
            return doc.id, [], _job_in(s, p, doc.id, schema_id, fresh=False, cap=cap) if schema_id is not None \
                else None
        was_failed = not fresh and doc.status == DocumentStatus.failed.value
        if sniffed is not None and not fresh:  # a failed document read again: back to received
            for old in list(doc.pages):
                s.delete(old)
            for field, value in _received_fields(sniffed).items():
                setattr(doc, field, value)
            s.flush()
        elif sniffed is None:
            write_render(s, doc, rendered, error)
            s.flush()
        requeued = requeue_document_jobs(s, doc.id) if was_failed and doc.status != DocumentStatus.failed.value \
            else []
        job = None
        if schema_id is not None and doc.status != DocumentStatus.failed.value:
            job = _job_in(s, p, doc.id, schema_id, fresh=fresh, cap=cap)
        return doc.id, requeued, job


def _job_in(s: Session, p: Pipeline, document_id: int, schema_id: int, *, fresh: bool,
            cap: JobCap | None = None) -> tuple[int, bool]:
    """Get or create the job inside an open write session: (job id, created). A document inserted by this
    session (`fresh`) has no job yet, so the lookup is skipped. A job is created only within `cap`."""
    key = p.model_key
    same = (Job.document_id == document_id, Job.schema_id == schema_id, Job.model_key == key)
    if not fresh:
        found = s.scalars(select(Job.id).where(*same)).first()
        if found is not None:
            return found, False
    if cap is not None:
        take_job_slots(s, cap)
    if fresh:
        job = Job(document_id=document_id, schema_id=schema_id, model_key=key)
        s.add(job)
        s.flush()
        return job.id, True
    try:
        with _savepoint(p, s):
            job = Job(document_id=document_id, schema_id=schema_id, model_key=key)
            s.add(job)
            s.flush()
            return job.id, True
    except IntegrityError:  # a concurrent intake created it (PostgreSQL): the unique key agrees on one job
        return s.scalars(select(Job.id).where(*same)).one(), False


def _get_or_create_job(p: Pipeline, document_id: int, schema_id: int, cap: JobCap | None) -> tuple[int, bool]:
    """(job id, created). The unique (document, schema, model) key makes concurrent intakes agree on one job."""
    with p.db.session() as s:
        return _job_in(s, p, document_id, schema_id, fresh=False, cap=cap)


def _record(p: Pipeline, batch_id: int | None, out: IngestOutcome) -> IngestOutcome:
    if batch_id is not None and out.outcome != "unstable":
        with p.db.session() as s:
            s.add(BatchItem(batch_id=batch_id, document_id=out.document_id, job_id=out.job_id, name=out.name[:1024],
                            outcome=out.outcome, error=out.error))
    return out


def _failed(p: Pipeline, batch_id: int | None, label: str, error: Exception, started: float,
            document_id: int | None = None) -> IngestOutcome:
    out = IngestOutcome(label, "failed", document_id=document_id, error=str(error) or type(error).__name__,
                        error_type=type(error).__name__, seconds=time.perf_counter() - started)
    return _record(p, batch_id, out)


def record_once(p: Pipeline, batch_id: int | None, out: IngestOutcome) -> IngestOutcome:
    """`out` as an item of the batch, unless the batch holds one for this name and document already: a queue's
    intake that is delivered again (its worker died while rendering) records its file once."""
    if batch_id is None or out.outcome == "unstable":
        return out
    with p.db.read_session() as s:
        known = s.scalar(select(BatchItem.id).where(BatchItem.batch_id == batch_id, BatchItem.name == out.name[:1024],
                                                    BatchItem.document_id == out.document_id).limit(1))
    return out if known is not None else _record(p, batch_id, out)


def outcome_after_render(p: Pipeline, out: IngestOutcome) -> IngestOutcome:
    """A received file's outcome once its document was rendered: `failed` with the document's reason when it
    turned out unreadable (as `ingest_file` reports it), else `out` with the page count."""
    if out.document_id is None:
        return out
    with p.db.read_session() as s:
        doc = s.execute(select(Document.status, Document.error, Document.error_type, Document.page_count)
                        .where(Document.id == out.document_id)).first()
    if doc is None:
        return out
    if doc.status == DocumentStatus.failed.value:
        return IngestOutcome(out.name, "failed", document_id=out.document_id, job_id=out.job_id, error=doc.error,
                             error_type=doc.error_type, seconds=out.seconds, known=out.known)
    out.pages, out.rendered = doc.page_count, doc.status == DocumentStatus.ingested.value
    return out


def record_refused(p: Pipeline, batch_id: int | None, label: str, error: Exception) -> IngestOutcome:
    """The outcome (and batch item) of a file refused before intake wrote anything, e.g. past the job cap."""
    return _failed(p, batch_id, label, error, time.perf_counter())


def _check_arguments(p: Pipeline, schema: str | None, tenant: str) -> SchemaRef | None:
    """Fail fast, before any work, on a bad schema name or a model that cannot be identified on this host.
    Returns the named schema (None when no schema was named), so it need not be looked up again."""
    named = schema_ref(p, schema, tenant) if schema is not None else None
    p.model_key  # noqa: B018 - read for its check: raises when the model cannot be identified
    return named


def _with_job(p: Pipeline, batch_id: int | None, label: str, started: float, document_id: int, kind: str | None,
              schema: str | None, pages: int, rendered: bool, tenant: str, cap: JobCap | None) -> IngestOutcome:
    """The outcome for bytes that are already a usable document: its job for this schema, got or created."""
    schema_id = schema_ref(p, resolve_schema_name(p, schema, kind), tenant).id
    job_id, created = _get_or_create_job(p, document_id, schema_id, cap)
    out = IngestOutcome(label, "new" if created else "duplicate", document_id=document_id, job_id=job_id,
                        pages=pages, seconds=time.perf_counter() - started, rendered=rendered, known=True)
    return _record(p, batch_id, out)


def receive_file(
    p: Pipeline,
    source: Source,
    *,
    name: str | None = None,
    schema: str | None = None,
    batch_id: int | None = None,
    tenant: str = DEFAULT_TENANT,
    cap: JobCap | None = None,
    key_id: str | None = None,
) -> IngestOutcome:
    """Store and sniff one file, then get or create its job, without rendering: the document is `received` (or
    known already) and the job `queued`. A file whose magic bytes are not an accepted type is refused here
    (`failed`, no job). Raises for bad arguments or configuration before any work, QuotaExceededError when a new
    job would pass `cap`; whatever raises after the bytes were stored leaves no blob that no row names. `key_id`:
    the uploading API key's id, stored on a new document (render fairness is per key).

    This is an HTTP upload's whole cost: new bytes and known usable bytes take one write transaction; only a
    refused file or a previously failed document takes the longer way (`_store_document`)."""
    started = time.perf_counter()
    named = _check_arguments(p, schema, tenant)
    label = _label(source, name)
    try:
        sha, size = _store_original(p, source, label)
    except (OSError, vision.MediaError) as exc:  # unreadable source, or larger than the limit: nothing stored
        return _failed(p, batch_id, label, exc, started)
    try:
        return _receive_stored(p, source, sha, size, label, schema, named, batch_id, tenant, cap, started, key_id)
    except Exception:
        drop_unreferenced(p, {sha})  # a failed or refused upload leaves no blob behind
        raise


def _receive_stored(p: Pipeline, source: Source, sha: str, size: int, label: str, schema: str | None,
                    named: SchemaRef | None, batch_id: int | None, tenant: str, cap: JobCap | None,
                    started: float, key_id: str | None = None) -> IngestOutcome:
    """`receive_file` once the bytes are in the blob store: sniff, then the rows (`key_id`: the uploader's)."""
    sniffed: Sniffed | None = None
    refusal: vision.MediaError | None = None
    try:
        sniffed = _sniff_original(p, source, sha, size, label)
    except vision.MediaError as exc:
        refusal = exc
    out = _receive_usable_or_new(p, sha, size, label, sniffed, schema, named, tenant, cap, key_id)
    if out is None and sniffed is None:
        assert refusal is not None
        document_id, _, _ = _store_document(p, sha, size, label, error=refusal, tenant=tenant, key_id=key_id)
        return _failed(p, batch_id, label, refusal, started, document_id)
    if out is None:  # a failed document read again
        assert sniffed is not None
        schema_id = (named or schema_ref(p, resolve_schema_name(p, schema, sniffed.kind), tenant)).id
        document_id, requeued, job = _store_document(p, sha, size, label, sniffed=sniffed, schema_id=schema_id,
                                                     tenant=tenant, cap=cap, key_id=key_id)
        assert job is not None
        out = IngestOutcome(label, "new" if job[1] or job[0] in requeued else "duplicate", document_id=document_id,
                            job_id=job[0], known=True)
    out.seconds = time.perf_counter() - started
    return _record(p, batch_id, out)


# Built once (their cache keys are memoised): an upload executes them without constructing statements.
# RETURNING every column: the outcome carries the rows as stored (defaults included) without reading them back.
_DOCUMENTS, _JOBS = cast(Table, Document.__table__), cast(Table, Job.__table__)  # typed as FromClause, always a Table
_INSERT_DOCUMENT = insert(_DOCUMENTS).returning(*_DOCUMENTS.c)
_INSERT_JOB = insert(_JOBS).returning(*_JOBS.c)


def _receive_usable_or_new(p: Pipeline, sha: str, size: int, label: str, sniffed: Sniffed | None,
                           schema: str | None, named: SchemaRef | None, tenant: str,
                           cap: JobCap | None, key_id: str | None = None) -> IngestOutcome | None:
    """In one write transaction: the job of a known usable document (got or created), or a new `received`
    document with its `queued` job (Core INSERTs: no ORM unit of work for two plain rows). None when these
    bytes need `_store_document`: a failed document, or no document and a refused file. `named`: the schema
    `schema` names, looked up already (None: the default for the document's kind, looked up here)."""
    with p.db.session() as s:
        conn = s.connection()

        def schema_for(kind: str | None) -> SchemaRef:
            return named or latest_schema_ref(s, resolve_schema_name(p, schema, kind), tenant)

        for _ in range(2):  # a second look only after a concurrent intake inserted these bytes first (PostgreSQL)
            existing = _existing_in(conn, sha, tenant)
            if existing is not None:
                if existing.status == DocumentStatus.failed.value:
                    return None
                job_id, created = _job_in(s, p, existing.id, schema_for(existing.kind).id, fresh=False, cap=cap)
                return IngestOutcome(label, "new" if created else "duplicate", document_id=existing.id,
                                     job_id=job_id, pages=existing.page_count,
                                     rendered=existing.status == DocumentStatus.ingested.value, known=True)
            if sniffed is None:
                return None
            job_schema = schema_for(sniffed.kind)
            if cap is not None:
                take_job_slots(s, cap)  # before the document: a refused upload writes no row
            try:
                with _savepoint(p, conn):  # on the connection: a Session savepoint starts only with its next use
                    document = dict(conn.execute(_INSERT_DOCUMENT, {
                        "sha256": sha, "tenant": tenant, "original_name": label[:1024], "size_bytes": size,
                        "uploaded_by": key_id, **_received_fields(sniffed)}).one()._mapping)
            except IntegrityError:
                continue
            job = dict(conn.execute(_INSERT_JOB, {"document_id": document["id"], "schema_id": job_schema.id,
                                                  "model_key": p.model_key}).one()._mapping)
            return IngestOutcome(label, "new", document_id=document["id"], job_id=job["id"],
                                 inserted=InsertedRows(document, job, job_schema))
    return None


def ingest_file(
    p: Pipeline,
    source: Source,
    *,
    name: str | None = None,
    schema: str | None = None,
    password: str | None = None,
    batch_id: int | None = None,
    tenant: str = DEFAULT_TENANT,
    cap: JobCap | None = None,
) -> IngestOutcome:
    """Store, sniff and render one file, then get or create its job (within `cap`, as `receive_file`). Raises only
    for bad arguments (unknown schema) or configuration (model not available), before any work; a bad file is an
    outcome, not an error.
    A document already known (rendered, or `received` and rendered by its job) is not rendered again."""
    started = time.perf_counter()
    _check_arguments(p, schema, tenant)
    label = _label(source, name)
    try:
        sha, size = _store_original(p, source, label)
    except (OSError, vision.MediaError) as exc:
        return _failed(p, batch_id, label, exc, started)
    existing = _existing(p, sha, tenant)
    if existing is not None and existing.status != DocumentStatus.failed.value:
        return _with_job(p, batch_id, label, started, existing.id, existing.kind, schema,
                         existing.page_count, existing.status == DocumentStatus.ingested.value, tenant, cap)
    rendered, error = try_render(p, p.blobs.path(sha), label, password)
    schema_id = (schema_ref(p, resolve_schema_name(p, schema, rendered.kind), tenant).id
                 if rendered is not None else None)
    try:
        document_id, requeued, job = _store_document(p, sha, size, label, rendered=rendered, error=error,
                                                     schema_id=schema_id, tenant=tenant, cap=cap)
    except Exception:  # a failed or refused upload leaves no blob: neither its original nor its rendered pages
        drop_unreferenced(p, {sha} | {pg["blob"] for pg in (rendered.pages if rendered else []) if pg["blob"]})
        raise
    if rendered is None or job is None:
        assert error is not None
        return _failed(p, batch_id, label, error, started, document_id)
    out = IngestOutcome(label, "new" if job[1] or job[0] in requeued else "duplicate", document_id=document_id,
                        job_id=job[0], pages=len(rendered.pages), seconds=time.perf_counter() - started,
                        rendered=True, known=existing is not None)
    return _record(p, batch_id, out)
