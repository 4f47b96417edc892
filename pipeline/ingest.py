"""Intake: a file becomes a stored Document with rendered pages, and a queued Job for a schema.

`ingest_file` is what an upload, the CLI and the ingest queue call; `ingest_folder` walks a folder (the CLI now,
scheduled watch folders later). Both record each file's outcome — `new`, `duplicate` (same content, schema and
model already had a job: its results are reused), `failed` (the file cannot be read; the reason is stored on the
document row), or `unstable` (folder walks only: still being written, taken on a later walk) — and never raise
for a bad file. Bad arguments (an unknown schema) do raise.
"""
from __future__ import annotations

import io
import json
import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Literal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

import vision

from .context import Pipeline
from .extraction import png_bytes
from .models import Batch, BatchItem, Document, DocumentStatus, Job, Page
from .schemas import get_schema

log = logging.getLogger(__name__)
_ENCODE_AHEAD = 2
Outcome = Literal["new", "duplicate", "failed", "unstable"]
# Folders a watch-folder run moves processed files into; never ingested themselves.
EXCLUDED_DIRS = frozenset({"done", "failed"})


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


@dataclass
class _Rendered:
    kind: str | None
    media_type: str | None
    metadata: dict[str, Any]
    pages: list[dict[str, Any]]


def create_batch(p: Pipeline, source: str) -> int:
    with p.db.session() as s:
        batch = Batch(source=source[:1024])
        s.add(batch)
        s.flush()
        return batch.id


def resolve_schema_name(p: Pipeline, schema: str | None, kind: str | None) -> str:
    """No schema given: videos get `video`, everything else the configured default."""
    if schema:
        return schema
    return "video" if kind == "video" else p.settings.default_schema


def _schema_id(p: Pipeline, name: str) -> int:
    with p.db.read_session() as s:
        return get_schema(s, name).id


def _render(p: Pipeline, path: Path, name: str, password: str | None) -> _Rendered:
    """Render every page; PNG encoding and blob writes run on a small thread pool (zlib releases the GIL) so the
    next page renders meanwhile. At most `_ENCODE_AHEAD` encoded-but-unstored pages are held at once."""
    pages: list[dict[str, Any]] = []

    def store(image: Any) -> str:
        key = p.blobs.put_bytes(png_bytes(image), durable=False)  # derived: re-renderable from the original
        p.images.put(key, image)
        return key

    def finish(row: dict[str, Any], future: Future[str] | None) -> None:
        if future is not None:
            row["blob"] = future.result()
        pages.append(row)

    with vision.open_media(path, password=password, limits=p.settings.media_limits(),
                           options=p.settings.render_options(), name=name) as doc, \
            ThreadPoolExecutor(max_workers=_ENCODE_AHEAD, thread_name_prefix="docpipe-png") as pool:
        pending: deque[tuple[dict[str, Any], Future[str] | None]] = deque()
        for page in doc.pages():
            row: dict[str, Any] = {"index": page.index, "kind": page.kind, "timestamp": page.timestamp,
                                   "error": str(page.error) if page.error else None,
                                   "blob": None, "width": None, "height": None, "text": page.text}
            future = None
            if page.ok and page.image is not None:
                row["width"], row["height"] = page.image.size
                future = pool.submit(store, page.image)
            pending.append((row, future))
            while len(pending) > _ENCODE_AHEAD:
                finish(*pending.popleft())
        while pending:
            finish(*pending.popleft())
        metadata = json.loads(json.dumps(doc.metadata, default=str))  # plain JSON for the database
        return _Rendered(kind=doc.kind, media_type=doc.media_type, metadata=metadata, pages=pages)


def _store_document(p: Pipeline, sha: str, size: int, name: str, rendered: _Rendered | None,
                    error: Exception | None) -> int:
    """Insert (or, for a previously failed file, refresh) the document row and its pages; returns its id.

    Two intakes of the same bytes may race: the unique sha256 decides, the loser keeps the winner's row."""
    with p.db.session() as s:
        by_sha = select(Document).where(Document.sha256 == sha).with_for_update()
        doc = s.scalars(by_sha).first()
        if doc is None:
            try:
                with s.begin_nested():
                    doc = Document(sha256=sha, original_name=name[:1024], size_bytes=size)
                    s.add(doc)
                    s.flush()
            except IntegrityError:  # the other intake committed first (PostgreSQL; SQLite serialises writers)
                doc = s.scalars(by_sha).one()
                if doc.status != DocumentStatus.failed.value:
                    return doc.id
        elif doc.status != DocumentStatus.failed.value:
            return doc.id  # a concurrent intake of the same bytes won
        for old in list(doc.pages):
            s.delete(old)
        s.flush()
        if rendered is None:
            doc.status, doc.page_count = DocumentStatus.failed.value, 0
            doc.error = str(error) or type(error).__name__
            doc.error_type = type(error).__name__
            doc.media_metadata = {}
        else:
            doc.status, doc.error, doc.error_type = DocumentStatus.ingested.value, None, None
            doc.kind, doc.media_type, doc.media_metadata = rendered.kind, rendered.media_type, rendered.metadata
            doc.page_count = len(rendered.pages)
            for pg in rendered.pages:
                s.add(Page(document=doc, index=pg["index"], kind=pg["kind"], width=pg["width"], height=pg["height"],
                           timestamp=pg["timestamp"], image_blob=pg["blob"], text_layer=pg["text"], error=pg["error"]))
        s.flush()
        return doc.id


def _get_or_create_job(p: Pipeline, document_id: int, schema_id: int) -> tuple[int, bool]:
    """(job id, created). The unique (document, schema, model) key makes concurrent intakes agree on one job."""
    key = p.model_key
    with p.db.session() as s:
        found = s.scalars(select(Job.id).where(Job.document_id == document_id, Job.schema_id == schema_id,
                                               Job.model_key == key)).first()
        if found is not None:
            return found, False
        try:
            with s.begin_nested():
                job = Job(document_id=document_id, schema_id=schema_id, model_key=key)
                s.add(job)
                s.flush()
                return job.id, True
        except IntegrityError:
            pass
    with p.db.read_session() as s:
        return s.scalars(select(Job.id).where(Job.document_id == document_id, Job.schema_id == schema_id,
                                              Job.model_key == key)).one(), False


def _record(p: Pipeline, batch_id: int | None, out: IngestOutcome) -> IngestOutcome:
    if batch_id is not None and out.outcome != "unstable":
        with p.db.session() as s:
            s.add(BatchItem(batch_id=batch_id, document_id=out.document_id, job_id=out.job_id, name=out.name[:1024],
                            outcome=out.outcome, error=out.error))
    return out


def ingest_file(
    p: Pipeline,
    source: str | os.PathLike[str] | bytes | BinaryIO,
    *,
    name: str | None = None,
    schema: str | None = None,
    password: str | None = None,
    batch_id: int | None = None,
) -> IngestOutcome:
    """Store, sniff and render one file, then get or create its job. Raises only for bad arguments (unknown
    schema) or configuration (model not available), before any work; a bad file is an outcome, not an error."""
    started = time.perf_counter()
    if schema is not None:
        _schema_id(p, schema)  # fail fast on a bad name, before any work
    p.model_key  # noqa: B018 - fail fast when the model cannot be identified on this host
    label = name or (Path(source).name if isinstance(source, (str, os.PathLike)) else "upload")
    limit = p.settings.max_file_bytes
    try:
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if path.stat().st_size > limit:
                raise vision.LimitExceededError(
                    f"{label} is {path.stat().st_size} bytes, more than the limit of {limit} (DOCPIPE_MAX_FILE_BYTES)")
            sha, size = p.blobs.put_file(path)
        else:
            stream = source if hasattr(source, "read") else io.BytesIO(source)  # type: ignore[arg-type]
            try:
                sha, size = p.blobs.put_stream(stream, max_bytes=limit)  # type: ignore[arg-type]
            except ValueError as exc:
                raise vision.LimitExceededError(f"{label}: {exc} (DOCPIPE_MAX_FILE_BYTES)") from None
    except (OSError, vision.MediaError) as exc:
        out = IngestOutcome(label, "failed", error=str(exc), error_type=type(exc).__name__)
        out.seconds = time.perf_counter() - started
        return _record(p, batch_id, out)

    with p.db.read_session() as s:
        existing = s.execute(select(Document.id, Document.status, Document.kind, Document.page_count)
                             .where(Document.sha256 == sha)).first()
    if existing is not None and existing.status != DocumentStatus.failed.value:
        document_id, kind, pages = existing.id, existing.kind, existing.page_count
    else:
        rendered: _Rendered | None = None
        error: Exception | None = None
        try:
            rendered = _render(p, p.blobs.path(sha), label, password)
        except vision.MediaError as exc:
            error = exc
        except Exception as exc:  # a reader bug must not lose the file: it is stored and marked failed
            log.exception("reading %s failed unexpectedly", label)
            error = RuntimeError(f"internal error while reading {label}: {type(exc).__name__}: {exc}")
        document_id = _store_document(p, sha, size, label, rendered, error)
        if rendered is None:
            out = IngestOutcome(label, "failed", document_id=document_id, error=str(error),
                                error_type=type(error).__name__, seconds=time.perf_counter() - started)
            return _record(p, batch_id, out)
        kind, pages = rendered.kind, len(rendered.pages)

    schema_id = _schema_id(p, resolve_schema_name(p, schema, kind))
    job_id, created = _get_or_create_job(p, document_id, schema_id)
    out = IngestOutcome(label, "new" if created else "duplicate", document_id=document_id, job_id=job_id,
                        pages=pages, seconds=time.perf_counter() - started)
    return _record(p, batch_id, out)


def _snapshot(folder: Path, excluded: frozenset[str]) -> dict[Path, tuple[int, int]]:
    found: dict[Path, tuple[int, int]] = {}
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        # skip hidden folders and, at the top, the done/ and failed/ folders files are moved into
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (here == folder and d in excluded))
        for fname in sorted(files):
            if fname.startswith("."):
                continue  # hidden and partial files (.part, editors' temp files) are not documents
            path = here / fname
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found[path] = (st.st_size, st.st_mtime_ns)
    return found


def stable_files(folder: Path, stable_seconds: float, excluded: frozenset[str] = EXCLUDED_DIRS
                 ) -> tuple[list[Path], list[Path]]:
    """(stable, unstable) files under `folder`: a file is stable when its size and mtime did not change over
    `stable_seconds` (waits once, and only if some file was modified more recently than that)."""
    first = _snapshot(folder, excluded)
    now_ns = time.time_ns()
    young = [p for p, (_, mtime) in first.items() if now_ns - mtime < stable_seconds * 1e9]
    if not young:
        return sorted(first), []
    time.sleep(stable_seconds)
    second = _snapshot(folder, excluded)
    stable = sorted(p for p, sig in first.items() if second.get(p) == sig)
    unstable = sorted(p for p in first if second.get(p) != first[p])
    return stable, unstable


def ingest_folder(
    p: Pipeline,
    folder: str | os.PathLike[str],
    *,
    schema: str | None = None,
    batch_id: int | None = None,
    stable_seconds: float | None = None,
    include: Callable[[Path], bool] | None = None,
) -> list[IngestOutcome]:
    """Ingest every stable file under `folder` (recursively, hidden files skipped, `include` filters paths);
    one outcome per file."""
    return list(iter_folder(p, folder, schema=schema, batch_id=batch_id, stable_seconds=stable_seconds,
                            include=include))


def iter_folder(
    p: Pipeline,
    folder: str | os.PathLike[str],
    *,
    schema: str | None = None,
    batch_id: int | None = None,
    stable_seconds: float | None = None,
    include: Callable[[Path], bool] | None = None,
) -> Iterator[IngestOutcome]:
    """`ingest_folder`, one outcome at a time (callers can start a file's job while the next file is read).
    Argument errors (not a folder, unknown schema) are raised before the first outcome."""
    root = Path(folder)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a folder")
    if schema is not None:
        _schema_id(p, schema)
    wait = p.settings.stable_seconds if stable_seconds is None else stable_seconds
    stable, unstable = stable_files(root, wait)
    if include is not None:
        stable = [f for f in stable if include(f)]
        unstable = [f for f in unstable if include(f)]

    def outcomes() -> Iterator[IngestOutcome]:
        for path in stable:
            yield ingest_file(p, path, name=str(path.relative_to(root)), schema=schema, batch_id=batch_id)
        for path in unstable:
            yield IngestOutcome(str(path.relative_to(root)), "unstable")

    return outcomes()
