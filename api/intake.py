"""Uploaded files -> the pipeline's intake: documents, jobs, batches.

An upload only *receives* the file (`pipeline.ingest.receive_file`): the spooled bytes move into the blob store,
the type is sniffed from the magic bytes (an unsupported type is refused at once: 422 `unreadable_file`), and the
document (`received`) and its `queued` job are written. Rendering the pages costs 16-32 ms of CPU per page, so it
happens in the job (the in-process worker thread, or the broker's `ingest` queue), never inside the request. A
file that turns out unreadable then ends `failed` with the reason, on the document and on the job.

One exception: an upload with a PDF `password` is rendered during the request (`ingest_file`), because the
password is used once and never stored or queued.

Documents, batches and jobs belong to the caller's tenant; the tenant's in-flight job cap is taken in the
transaction that queues each job (pipeline.quotas), so parallel uploads cannot pass it.

Runs in a worker thread (blocking DB and file work). The spooled upload is always gone afterwards: moved into the
blob store, or removed.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.ingest import IngestOutcome, InsertedRows, create_batch, ingest_file, receive_file, record_refused
from pipeline.jobs import retry_job as pipeline_retry_job
from pipeline.quotas import JobCap, QuotaExceededError
from pipeline.schemas import get_schema
from pipeline.storable_text import clean_display_name

from .auth import Principal
from .context import ApiContext
from .errors import ApiError, RateLimited
from .queries import DocumentRow, DocumentSummary, JobRow, document_summary, load_job
from .uploads import ReceivedForm, SpooledFile
from .views import DocumentOut, JobOut, UploadOut, job_out, summary_out

MAX_NAME = 255


class ContentLocks:
    """One lock per content hash being ingested: the same bytes arriving twice at once (a double-clicked upload)
    are taken one after the other, so the second finds the first's document instead of racing it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}  # sha256 -> (lock, holders + waiters)

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)


_CONTENT_LOCKS = ContentLocks()


def upload_form_openapi(multiple: bool) -> dict[str, Any]:
    """OpenAPI description of the multipart body (the route reads the stream itself, so FastAPI cannot infer it)."""
    file_schema = {"type": "string", "format": "binary"}
    files = {"files": {"type": "array", "items": file_schema, "minItems": 1}} if multiple else {"file": file_schema}
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["files" if multiple else "file"],
                        "properties": {
                            **files,
                            "schema": {"type": "string", "description": "Extraction schema name (default: generic, "
                                                                        "video for videos)"},
                            "password": {"type": "string", "description": "Password of an encrypted PDF"},
                        },
                    }
                }
            },
        }
    }


def _options(form: ReceivedForm) -> tuple[str | None, str | None]:
    schema = form.fields.get("schema") or None
    password = form.fields.get("password") or None
    return schema, password


def _display_name(f: SpooledFile) -> str:
    # The client's name is only shown, never used as a path; keep its last component, bounded, without the
    # control characters (NUL among them) that the database cannot store or a screen cannot show.
    name = clean_display_name(f.filename).replace("\\", "/").rsplit("/", 1)[-1].strip() or "upload"
    return name[:MAX_NAME]


def _job_cap(ctx: ApiContext, who: Principal) -> JobCap:
    return JobCap(who.tenant, ctx.limits.max_inflight_jobs)


def _too_many_jobs(exc: QuotaExceededError) -> RateLimited:
    return RateLimited("too_many_jobs", f"This tenant has {exc.active} jobs queued or running (limit "
                       f"{exc.cap.limit}); wait for some to finish.", 5.0)


def _take_in(ctx: ApiContext, f: SpooledFile, schema: str | None, password: str | None, who: Principal,
             batch_id: int | None = None) -> IngestOutcome:
    spooled = f.hashed()
    tenant, cap = who.tenant, _job_cap(ctx, who)
    if password is not None:  # rendered now: the password is never stored or queued
        return ingest_file(ctx.pipeline, spooled, name=_display_name(f), schema=schema, password=password,
                           batch_id=batch_id, tenant=tenant, cap=cap)
    return receive_file(ctx.pipeline, spooled, name=_display_name(f), schema=schema, batch_id=batch_id,
                        tenant=tenant, cap=cap, key_id=who.key_id if who.authenticated else None)


def _unreadable(out: IngestOutcome) -> ApiError:
    return ApiError(422, "unreadable_file", f"{out.name} could not be read: {out.error}",
                    extra={"document_id": out.document_id, "error_type": out.error_type})


def accept_upload(ctx: ApiContext, form: ReceivedForm, who: Principal) -> tuple[UploadOut, list[int]]:
    """Take in the single uploaded file (the route checked the key's job quota before reading the body) and
    hand a new job to the runner. Returns the response body and the job ids handed on (empty: nothing new).
    All blocking work of an upload is here, so the route needs one hop to a worker thread."""
    try:
        files = [f for name, f in form.files if name == "file"]
        if len(files) != 1:
            raise ApiError(400, "file_missing", "Send exactly one file in the form field 'file'.")
        upload = files[0]
        schema, password = _options(form)
        try:
            with _CONTENT_LOCKS.hold(upload.sha256):
                out = _take_in(ctx, upload, schema, password, who)
        except QuotaExceededError as exc:
            raise _too_many_jobs(exc) from None
    finally:
        form.discard()
    if out.outcome == "failed" or out.document_id is None or out.job_id is None:
        raise _unreadable(out)
    new_jobs = [out.job_id] if out.outcome == "new" else []
    if new_jobs:
        ctx.jobs.record(who.tenant, new_jobs)
        ctx.runner.submit(new_jobs)  # may publish to the broker: blocking I/O, kept off the event loop
    if out.inserted is not None:  # new bytes: the answer is what intake wrote (reading it back cost ~12% CPU)
        document = inserted_out(out.inserted)
    else:
        with ctx.pipeline.db.read_session() as s:  # Core rows through the session's connection: no ORM layer
            document = summary_out(document_summary(s.connection(), out.document_id))  # with its jobs' schemas
    job = next(j for j in document.jobs if j.id == out.job_id)
    return UploadOut(document=document, job=job, duplicate=out.known or out.outcome == "duplicate"), new_jobs


def inserted_out(rows: InsertedRows) -> DocumentOut:
    """The upload's answer from the rows intake inserted (a `received` document with one `queued` job) and the
    job's schema, which intake looked up to queue the job."""
    job = JobRow.of({**rows.job, "schema_name": rows.schema.name, "schema_version": rows.schema.version})
    return summary_out(DocumentSummary(DocumentRow.of(rows.document), [job]))


def accept_batch(ctx: ApiContext, form: ReceivedForm, who: Principal) -> tuple[int, list[int]]:
    """Ingest every file of the form field 'files' into one new batch of the caller's tenant; bad files, and
    files past the tenant's job cap, become failed batch items."""
    try:
        files = [f for name, f in form.files if name == "files"]
        if not files:
            raise ApiError(400, "file_missing", "Send one or more files in the form field 'files'.")
        ctx.jobs.check(who.tenant, adding=len(files))
        schema, password = _options(form)
        if schema is not None:  # fail before creating an empty batch
            with ctx.pipeline.db.read_session() as s:
                get_schema(s, schema, tenant=who.tenant)
        batch_id = create_batch(ctx.pipeline, "upload", tenant=who.tenant)
        outcomes = []
        for f in files:
            try:
                with _CONTENT_LOCKS.hold(f.sha256):
                    outcomes.append(_take_in(ctx, f, schema, password, who, batch_id))
            except QuotaExceededError as exc:
                outcomes.append(record_refused(ctx.pipeline, batch_id, _display_name(f), exc))
    finally:
        form.discard()
    new_jobs = [o.job_id for o in outcomes if o.outcome == "new" and o.job_id is not None]
    ctx.jobs.record(who.tenant, new_jobs)
    return batch_id, new_jobs


def retry_job(ctx: ApiContext, job_id: int, who: Principal) -> JobOut:
    """Queue a finished job of the caller's tenant again (404 for another tenant's), within its tenant's cap."""
    with ctx.pipeline.db.read_session() as s:
        load_job(s, job_id, who.access)
    try:
        pipeline_retry_job(ctx.pipeline, job_id, cap_limit=ctx.limits.max_inflight_jobs)
    except QuotaExceededError as exc:
        raise _too_many_jobs(exc) from None
    with ctx.pipeline.db.read_session() as s:
        return job_out(load_job(s, job_id, who.access))
