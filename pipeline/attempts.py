"""Attempt caps counted in the database, for both stages a document goes through, and who pays for a crash.

Rendering (the `ingest` stage): every render of a `received` document is counted on the document before it
starts (`documents.render_attempts`). A file that kills its reader process each time (the message comes back
through `task_reject_on_worker_lost`) is counted each time, and once `job_max_attempts` renders were started
without one finishing, the document ends `failed` with that reason and so do its queued jobs.

Files taken in by a queue worker (staged submissions, watch folders) go the same way: `receive_counted` writes the
document and its job first (`pipeline.ingest.receive_file`), then renders under the cap, so a file that kills
the worker while it is read is counted there too.

Extraction (the `gpu` stage): claiming a job charges it an attempt (pipeline.jobs). When a run dies without
releasing its job (the process was killed, or hung past its lease), the next claim cannot tell which of the jobs
that ran in that process caused it. So a run that died among others is refunded its attempt and its job is marked
`isolated`: the next run of it waits until it is alone in its process (`RunGate`). A run that died alone is the
cause, and keeps its charge. A poison document thus ends `failed` after `job_max_attempts` runs on its own, and
the jobs that shared a worker with it lose nothing.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import select

from .context import Pipeline
from .ingest import IngestOutcome, Source, outcome_after_render, receive_file, record_once
from .models import Document, DocumentStatus
from .rendering import fail_document_jobs, job_document, render_document


def _render_gave_up(attempts: int, last: str | None) -> str:
    return (f"gave up after {attempts} attempts to read the file: the process reading it stopped each time (it "
            "crashes or hangs the reader); the file cannot be processed" + (f"; last: {last}" if last else ""))


def note_render_stopped(p: Pipeline, job_id: int, reason: str) -> None:
    """Say on the job's still `received` document why its last render stopped (a queue task's time limit), so
    the reason reaches the document and its jobs if the render cap ends it (a finished render clears it)."""
    document_id, status = job_document(p, job_id)
    if status != DocumentStatus.received.value:
        return
    with p.db.session() as s:
        doc = s.get(Document, document_id, with_for_update=True)
        if doc is not None and doc.status == DocumentStatus.received.value:
            doc.error = reason[:2000]


def charge_render(p: Pipeline, document_id: int, stop_note: str | None = None) -> bool:
    """Count one render of a `received` document; False (and the document and its queued jobs `failed`) when
    the cap was spent already. True also when the document is no longer `received` (nothing to charge).
    `stop_note`: what most likely stopped the earlier renders when none left a reason (a queue task's hard time
    limit), named in the cap's reason."""
    with p.db.session() as s:
        doc = s.scalars(select(Document).where(Document.id == document_id).with_for_update()).first()
        if doc is None or doc.status != DocumentStatus.received.value:
            return True
        if doc.render_attempts >= p.settings.job_max_attempts:
            doc.status = DocumentStatus.failed.value
            doc.error = _render_gave_up(doc.render_attempts, doc.error or stop_note)
            doc.error_type = "RenderAttemptsExceeded"
            fail_document_jobs(s, document_id, doc.error)
            return False
        doc.render_attempts += 1
        return True


def render_for_job_capped(p: Pipeline, job_id: int, stop_note: str | None = None) -> str:
    """`pipeline.rendering.render_for_job` with the render attempt cap: the document's status afterwards."""
    document_id, status = job_document(p, job_id)
    if status != DocumentStatus.received.value:
        return status
    if not charge_render(p, document_id, stop_note):
        return DocumentStatus.failed.value
    return render_document(p, document_id)


def receive_counted(p: Pipeline, source: Source, *, name: str, schema: str | None = None,
                    batch_id: int | None = None) -> IngestOutcome:
    """Receive a file, render it under the render cap, then record it in `batch_id` once (a message delivered
    again after its worker died records nothing twice). The outcome says `failed` for an unreadable file."""
    out = receive_file(p, source, name=name, schema=schema)
    if out.job_id is not None:
        render_for_job_capped(p, out.job_id)
        out = outcome_after_render(p, out)
    return record_once(p, batch_id, out)


class RunGate:
    """Runs of jobs in one process: any number together (`shared`), or one alone (`alone`). A run waiting to be
    alone is let in as soon as the running ones finish; runs arriving after it wait behind it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._alone = False
        self._waiting_alone = 0
        self._waiting: set[int] = set()  # threads waiting to be let in (a time limit does not run for them)

    def is_waiting(self, thread_id: int) -> bool:
        with self._cond:
            return thread_id in self._waiting

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        """Condition.wait_for, with the calling thread counted as waiting meanwhile (call with _cond held)."""
        me = threading.get_ident()
        self._waiting.add(me)
        try:
            self._cond.wait_for(ready)
        finally:
            self._waiting.discard(me)

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._wait_for(lambda: not self._alone and not self._waiting_alone)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting_alone += 1
            try:
                self._wait_for(lambda: not self._alone and self._running == 0)
            finally:
                self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


RUN_GATE = RunGate()  # one per process: what "alone in its process" means
