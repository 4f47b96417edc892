"""Rendering: a stored original becomes page/frame rows with PNG blobs (the CPU-heavy half of intake).

Intake has two halves. Receiving (`pipeline.ingest.receive_file`) is cheap and runs where the file arrives (an HTTP
request): store the bytes, sniff the type by magic bytes, write a `received` document and a `queued` job.
Rendering (`render_document`, here) costs 16-32 ms of CPU per page, in an isolated render process under the
budgets of `vision.MediaLimits` (a page over `page_render_timeout_s` fails alone; a document past
`document_render_timeout_s` keeps the pages it has, or fails when it has none; a document none of whose pages
rendered fails with its first page's reason). It runs in the job's own time:
on the `ingest` queue in broker mode, in the job thread in embedded mode, and `run_job` renders a still-`received`
document itself before claiming the job, so no path can skip it.

Document states (explicit, every change one transaction, compare-and-set on `received`):

    received --render ok--> ingested
    received --unreadable-> failed   (reason on the document; its queued jobs fail with the same reason)
    failed   --same bytes uploaded again, or a job retried--> received / ingested (read again)

Rendering twice (two workers, a redelivered message) is harmless: page blobs are content-addressed, and only the
first render to finish writes the rows; a later one finds the document no longer `received` and keeps the rows.
A render whose rows are not written (the document was deleted meanwhile, or another render won) removes the page
blobs it stored that no row names, so deleted content does not stay on disk.
"""
from __future__ import annotations

import json
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

import vision

from .context import Pipeline
from .db import rows_matched
from .errors import NotFoundError
from .extraction import png_bytes
from .models import Document, DocumentStatus, Job, JobState, Page, utcnow
from .retention import drop_unreferenced

log = logging.getLogger(__name__)
_ENCODE_AHEAD = 2


@dataclass
class Rendered:
    kind: str | None
    media_type: str | None
    metadata: dict[str, Any]
    pages: list[dict[str, Any]]


def render_pages(p: Pipeline, path: Path, name: str, password: str | None) -> Rendered:
    """Render every page; PNG encoding and blob writes run on a small thread pool (zlib releases the GIL) so the
    next page renders meanwhile. At most `_ENCODE_AHEAD` encoded-but-unstored pages are held at once.
    Raises `vision.MediaError` for an unreadable file, and for a file none of whose pages rendered."""
    pages: list[dict[str, Any]] = []
    first_error: vision.MediaError | None = None

    def store(image: Any) -> str:
        key = p.blobs.put_bytes(png_bytes(image), durable=False)  # derived: re-renderable from the original
        p.images.put(key, image)
        return key

    def finish(row: dict[str, Any], future: Future[str] | None) -> None:
        if future is not None:
            row["blob"] = future.result()
        pages.append(row)

    # Isolated: MuPDF and Pillow hold the GIL while they work, so rendering here would freeze every thread of this
    # process (the API's /healthz included) for as long as a hostile page takes; in a render process the budgets
    # of `MediaLimits` apply and this thread only waits on a pipe.
    with vision.open_isolated(path, password=password, limits=p.settings.media_limits(),
                              options=p.settings.render_options(), name=name) as doc, \
            ThreadPoolExecutor(max_workers=_ENCODE_AHEAD, thread_name_prefix="docpipe-png") as pool:
        pending: deque[tuple[dict[str, Any], Future[str] | None]] = deque()
        for page in doc.pages():
            row: dict[str, Any] = {"index": page.index, "kind": page.kind, "timestamp": page.timestamp,
                                   "error": str(page.error) if page.error else None,
                                   "blob": None, "width": None, "height": None, "text": page.text}
            future = None
            if first_error is None and page.error is not None:
                first_error = page.error
            if page.ok and page.image is not None:
                row["width"], row["height"] = page.image.size
                future = pool.submit(store, page.image)
            pending.append((row, future))
            while len(pending) > _ENCODE_AHEAD:
                finish(*pending.popleft())
        while pending:
            finish(*pending.popleft())
        if pages and not any(pg["blob"] for pg in pages):
            raise _nothing_rendered(name, len(pages), first_error)
        metadata = json.loads(json.dumps(doc.metadata, default=str))  # plain JSON for the database
        return Rendered(kind=doc.kind, media_type=doc.media_type, metadata=metadata, pages=pages)


def _nothing_rendered(name: str, count: int, first: vision.MediaError | None) -> vision.MediaError:
    """A document without a single rendered page is unreadable, like one past its budget with none: there is
    nothing to extract from, and a password upload could not render it again later. Its reason is the first page's,
    with that page's error class (a page stopped at its budget is a `RenderTimeoutError`)."""
    if first is None:
        return vision.CorruptMediaError(f"{name} has no page that could be rendered; export it again.")
    return type(first)(f"none of the {count} pages of {name} could be rendered; the first one's reason: {first}")


def try_render(p: Pipeline, path: Path, name: str, password: str | None) -> tuple[Rendered | None, Exception | None]:
    """(rendered, None) or (None, the reason). A reader bug must not lose the file: it becomes a reason too."""
    try:
        return render_pages(p, path, name, password), None
    except vision.MediaError as exc:
        return None, exc
    except Exception as exc:
        log.exception("reading %s failed unexpectedly", name)
        return None, RuntimeError(f"internal error while reading {name}: {type(exc).__name__}: {exc}")


def error_text(error: Exception) -> str:
    return str(error) or type(error).__name__


def write_render(s: Session, doc: Document, rendered: Rendered | None, error: Exception | None) -> None:
    """Replace the document's pages with a render's outcome: `ingested` with pages, or `failed` with the reason."""
    for old in list(doc.pages):
        s.delete(old)
    s.flush()
    if rendered is None:
        assert error is not None
        doc.status, doc.page_count = DocumentStatus.failed.value, 0
        doc.error, doc.error_type = error_text(error), type(error).__name__
        doc.media_metadata, doc.repaired = {}, False
        return
    doc.status, doc.error, doc.error_type = DocumentStatus.ingested.value, None, None
    doc.kind, doc.media_type, doc.media_metadata = rendered.kind, rendered.media_type, rendered.metadata
    doc.repaired = bool(rendered.metadata.get("repaired"))  # MuPDF rebuilt a damaged file: pages may be missing
    doc.page_count = len(rendered.pages)
    for pg in rendered.pages:
        s.add(Page(document=doc, index=pg["index"], kind=pg["kind"], width=pg["width"], height=pg["height"],
                   timestamp=pg["timestamp"], image_blob=pg["blob"], text_layer=pg["text"], error=pg["error"]))


def fail_document_jobs(s: Session, document_id: int, reason: str) -> int:
    """Fail every queued job of an unreadable document with the document's reason (they can never run)."""
    now = utcnow()
    return rows_matched(s.execute(
        update(Job)
        .where(Job.document_id == document_id, Job.state == JobState.queued.value)
        .values(state=JobState.failed.value, error=reason[:2000], finished_at=now, updated_at=now,
                owner=None, lease_until=None)
    ))


def requeue_document_jobs(s: Session, document_id: int) -> list[int]:
    """A failed document is read again: its jobs failed only because it could not be read (they never ran a
    page), so they go back to `queued` as new. Returns their ids."""
    ids = list(s.scalars(select(Job.id).where(Job.document_id == document_id,
                                                Job.state == JobState.failed.value)))
    if ids:
        s.execute(update(Job).where(Job.id.in_(ids)).values(
            state=JobState.queued.value, error=None, attempts=0, owner=None, lease_until=None, started_at=None,
            finished_at=None, updated_at=utcnow()))
    return ids


def render_document(p: Pipeline, document_id: int, *, password: str | None = None) -> str:
    """Render a `received` document; returns its status afterwards (`ingested` or `failed`, or what another
    process made of it meanwhile). Never raises for a bad file; raises NotFoundError for an unknown id."""
    with p.db.read_session() as s:
        row = s.execute(select(Document.status, Document.sha256, Document.original_name)
                        .where(Document.id == document_id)).first()
    if row is None:
        raise NotFoundError("document", document_id)
    if row.status != DocumentStatus.received.value:
        return str(row.status)
    rendered, error = try_render(p, p.blobs.path(row.sha256), row.original_name, password)
    written = False
    try:
        with p.db.session() as s:
            doc = s.scalars(select(Document).where(Document.id == document_id).with_for_update()).first()
            if doc is None:
                raise NotFoundError("document", document_id)  # deleted while it rendered
            if doc.status != DocumentStatus.received.value:
                return doc.status  # another render finished first: keep its rows
            write_render(s, doc, rendered, error)
            if rendered is None:
                fail_document_jobs(s, document_id, doc.error or "")
            written = True
            return doc.status
    finally:
        if not written and rendered is not None:  # committed rows name them otherwise; these pages went nowhere
            drop_unreferenced(p, {pg["blob"] for pg in rendered.pages if pg["blob"]})


def job_document(p: Pipeline, job_id: int) -> tuple[int, str]:
    """(document id, document status) of a job."""
    with p.db.read_session() as s:
        row = s.execute(select(Document.id, Document.status).join(Job, Job.document_id == Document.id)
                        .where(Job.id == job_id)).first()
    if row is None:
        raise NotFoundError("job", job_id)
    return row.id, row.status


def render_for_job(p: Pipeline, job_id: int) -> str:
    """Render the job's document if it is still `received`; returns the document's status."""
    document_id, status = job_document(p, job_id)
    if status != DocumentStatus.received.value:
        return status
    return render_document(p, document_id)


def jobs_awaiting_render(p: Pipeline, job_ids: list[int]) -> set[int]:
    """The jobs among `job_ids` whose document is still `received` (the reconciler sends those to rendering)."""
    if not job_ids:
        return set()
    with p.db.read_session() as s:
        return set(s.scalars(select(Job.id).join(Document, Job.document_id == Document.id)
                             .where(Job.id.in_(job_ids), Document.status == DocumentStatus.received.value)))
