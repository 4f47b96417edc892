"""The database tables (SQLAlchemy 2.x typed ORM). Alembic revisions in pipeline/migrations create them.

Documents are unique by content (sha256). A job is one document read with one schema by one model, unique on that
triple, so re-submitting the same file + schema + model finds the existing job and its results. Results are unique
per (job, unit) where a unit is a page, the whole video, or the merged document: a job run twice cannot write two
result sets, whatever the timing.
"""
from __future__ import annotations

import enum
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from .tenancy import DEFAULT_TENANT, SHARED


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class JobState(str, enum.Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    partial = "partial"  # some pages failed; their reasons are kept in the page results
    failed = "failed"

    @property
    def finished(self) -> bool:
        return self in (JobState.succeeded, JobState.partial, JobState.failed)


class DocumentStatus(str, enum.Enum):
    """received -> ingested | failed (see pipeline.rendering for the transitions)."""

    received = "received"  # original stored, type sniffed from its bytes; pages not rendered yet
    ingested = "ingested"  # stored and rendered
    failed = "failed"  # could not be read at all (bad file); `error` says why


class Document(Base):
    __tablename__ = "documents"
    # Unique per tenant: two tenants uploading the same bytes get a document each (and share the blob).
    __table_args__ = (UniqueConstraint("tenant", "sha256", name="uq_documents_tenant_sha256"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)  # see pipeline.tenancy
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    original_name: Mapped[str] = mapped_column(String(1024))
    media_type: Mapped[str | None] = mapped_column(String(128))  # sniffed from content; None when unreadable
    kind: Mapped[str | None] = mapped_column(String(16))  # pdf | image | video
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    page_count: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), default=DocumentStatus.ingested.value, index=True)
    error: Mapped[str | None] = mapped_column(Text)
    error_type: Mapped[str | None] = mapped_column(String(64))  # exception class name, stable for clients
    render_attempts: Mapped[int] = mapped_column(Integer, default=0)  # renders started (pipeline.attempts caps it)
    media_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # MuPDF had to rebuild a damaged file (e.g. truncated): its pages may be incomplete or missing
    repaired: Mapped[bool] = mapped_column(Boolean, default=False)
    # the id (api.auth.key_id, never the key) of the API key that uploaded it; None from the CLI, watch folders,
    # staged submissions and an API without keys. Render fairness is per key (api.fair_queue, workers.render_slots)
    uploaded_by: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)

    pages: Mapped[list[Page]] = relationship(
        back_populates="document", order_by="Page.index", cascade="all, delete-orphan", passive_deletes=True
    )
    jobs: Mapped[list[Job]] = relationship(
        back_populates="document", order_by="Job.id", cascade="all, delete-orphan", passive_deletes=True
    )

    @property
    def blob_key(self) -> str:
        return self.sha256


class Page(Base):
    __tablename__ = "pages"
    __table_args__ = (UniqueConstraint("document_id", "index", name="uq_pages_document_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # page | frame
    width: Mapped[int | None] = mapped_column(Integer)  # rendered pixels
    height: Mapped[int | None] = mapped_column(Integer)
    timestamp: Mapped[float | None] = mapped_column(Float)  # seconds, video frames only
    image_blob: Mapped[str | None] = mapped_column(String(64))  # sha256 of the rendered PNG in the blob store
    text_layer: Mapped[str | None] = mapped_column(Text)  # PDF text layer (anchor text), None for rasters
    error: Mapped[str | None] = mapped_column(Text)  # this page could not be rendered

    document: Mapped[Document] = relationship(back_populates="pages")


class Schema(Base):
    __tablename__ = "schemas"
    __table_args__ = (UniqueConstraint("tenant", "name", "version", name="uq_schemas_tenant_name_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default=SHARED, index=True)  # SHARED: built-in, seen by all
    name: Mapped[str] = mapped_column(String(64), index=True)
    version: Mapped[int] = mapped_column(Integer)
    json_schema: Mapped[dict[str, Any]] = mapped_column(JSON)
    prompt: Mapped[str] = mapped_column(Text)
    merge_rules: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    builtin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Batch(Base):
    """Documents submitted together (a folder, a multi-file upload, a scheduled run)."""

    __tablename__ = "batches"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    source: Mapped[str] = mapped_column(String(1024))  # e.g. "cli", "folder:/in", "upload", "watch:/in"
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    items: Mapped[list[BatchItem]] = relationship(
        back_populates="batch", order_by="BatchItem.id", cascade="all, delete-orphan", passive_deletes=True
    )


class BatchItem(Base):
    """One submitted file in a batch and what happened to it at intake (new, duplicate, failed)."""

    __tablename__ = "batch_items"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    document_id: Mapped[int | None] = mapped_column(ForeignKey("documents.id", ondelete="SET NULL"), index=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), index=True)
    name: Mapped[str] = mapped_column(String(1024))  # the path or upload name as submitted
    outcome: Mapped[str] = mapped_column(String(16))  # new | duplicate | failed
    error: Mapped[str | None] = mapped_column(Text)

    batch: Mapped[Batch] = relationship(back_populates="items")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("document_id", "schema_id", "model_key", name="uq_jobs_doc_schema_model"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id", ondelete="CASCADE"), index=True)
    schema_id: Mapped[int] = mapped_column(ForeignKey("schemas.id"), index=True)
    model_key: Mapped[str] = mapped_column(String(64))  # cheap identity of the model folder (see engine_client)
    state: Mapped[str] = mapped_column(String(16), default=JobState.queued.value, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # runs charged to this job (pipeline.attempts)
    runs: Mapped[int] = mapped_column(Integer, default=0)  # every claim adds one: the fencing token of a run
    isolated: Mapped[bool] = mapped_column(Boolean, default=False)  # the next run must be alone in its process
    owner: Mapped[str | None] = mapped_column(String(255))  # host:pid of the process running it
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)  # last transition
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    model_seconds: Mapped[float] = mapped_column(Float, default=0.0)  # wall time spent waiting on the engine
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)

    document: Mapped[Document] = relationship(back_populates="jobs")
    schema: Mapped[Schema] = relationship()
    results: Mapped[list[Result]] = relationship(
        back_populates="job", order_by="Result.id", cascade="all, delete-orphan", passive_deletes=True
    )


class Result(Base):
    """One extraction unit's answer: a page, a whole video, or the merged document (unit == "document")."""

    __tablename__ = "results"
    __table_args__ = (UniqueConstraint("job_id", "unit", name="uq_results_job_unit"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id", ondelete="CASCADE"), index=True)
    unit: Mapped[str] = mapped_column(String(32))  # "page:3" | "video" | "document"
    page_index: Mapped[int | None] = mapped_column(Integer)  # for page units
    ok: Mapped[bool] = mapped_column(Boolean)
    data: Mapped[Any | None] = mapped_column(JSON)  # schema-valid JSON, None when this unit failed
    confidence: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # {"overall": p, "fields": {pointer: p}}
    raw_text: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    # provenance
    model_fingerprint: Mapped[str | None] = mapped_column(String(128))
    engine_version: Mapped[str | None] = mapped_column(String(32))
    schema_name: Mapped[str] = mapped_column(String(64))
    schema_version: Mapped[int] = mapped_column(Integer)
    sampling: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    job: Mapped[Job] = relationship(back_populates="results")
