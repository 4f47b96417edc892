"""The Celery tasks. Each is a thin shell around a pipeline function; the shell's job is failure handling.

    docpipe.extract(job_id)      gpu queue      run_job; retries transient errors with backoff until the cap
    docpipe.prepare(job_id)      ingest queue   render the job's `received` document (an upload), then enqueue
                                                the job on gpu; an unreadable file fails the job, no retry; a
                                                file whose reader dies each time fails after the attempt cap
    docpipe.ingest(stage_id)     ingest queue   a staged file -> document + job, rendered here under the
                                                document's render cap, then enqueues the job
    docpipe.watch_folders()      ingest queue   beat: scan every watch folder
    docpipe.requeue_stuck()      ingest queue   beat: the reconciler
    docpipe.purge_retention()    ingest queue   beat: delete documents past retention_days
    docpipe.sweep_blobs()        ingest queue   beat: remove blobs no row names (older than an hour)
"""
from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.exceptions import Retry, SoftTimeLimitExceeded
from sqlalchemy import select

from pipeline.attempts import note_render_stopped, receive_counted, render_for_job_capped
from pipeline.errors import NotFoundError
from pipeline.jobs import fail_job, run_job
from pipeline.models import JobState
from pipeline.render_owner import render_owner

from . import runtime, staging
from .app import app
from .config import (
    TASK_EXTRACT,
    TASK_INGEST,
    TASK_PREPARE,
    TASK_PURGE,
    TASK_REQUEUE,
    TASK_SWEEP,
    TASK_WATCH,
    WorkerSettings,
    render_time_limits,
)
from .enqueue import enqueue_job
from .failures import backoff_seconds, is_permanent, job_state
from .liveness import dead_owners
from .markers import redis_client
from .render_slots import RenderCaps

log = logging.getLogger(__name__)


def _redis() -> Any:
    return redis_client(runtime.process_config().settings.broker_url or "")


def _retry(task: Task, exc: BaseException, delay: float) -> Retry:
    """Publish the delayed retry (raises Retry). The message keeps its task id, so the reconciler still sees
    which job it is for. The cap is the job's attempt count in the database, not Celery's retry counter, which
    a crash or a lost message would reset. If the retry cannot be published (broker down), Celery rejects the
    message; the job row stays `queued` and the reconciler sends it once the broker is back."""
    return task.retry(exc=exc, countdown=delay)


def _next_backoff(task: Task, ws: WorkerSettings) -> float:
    """The delay before this message's next retry after an infrastructure error (counted per message)."""
    return backoff_seconds(task.request.retries + 1, ws.retry_backoff_s, ws.retry_backoff_max_s)


def _owner_still_dead(p: Any, job_id: int, owner: str) -> bool:
    """A takeover message is honoured only if the job still runs under that owner and its heartbeat is still
    gone (it may have come back, or another worker may have claimed the job since the reconciler looked)."""
    from pipeline.models import Job

    with p.db.read_session() as s:
        row = s.execute(select(Job.state, Job.owner).where(Job.id == job_id)).first()
    if row is None or row.state != JobState.running.value or row.owner != owner:
        return False
    return owner in dead_owners(_redis(), {owner})


def _unrendered(p: Any, job_id: int) -> bool:
    """Whether run_job must render the job's document first (its time then counts in the render budget)."""
    from pipeline.models import Document, DocumentStatus, Job

    with p.db.read_session() as s:
        status = s.scalar(select(Document.status).join(Job, Job.document_id == Document.id).where(Job.id == job_id))
    return status == DocumentStatus.received.value


@app.task(name=TASK_EXTRACT, bind=True, max_retries=None)
def extract(self: Task, job_id: int, takeover_from: str | None = None) -> dict[str, Any]:
    p = runtime.pipeline()
    ws = runtime.process_config().worker_settings
    try:
        takeover = bool(takeover_from) and _owner_still_dead(p, job_id, takeover_from or "")
        watchdog = runtime.gpu_watchdog()
        if watchdog is None:
            run = run_job(p, job_id, takeover=takeover)
        else:  # the soft and hard time limits of a thread-pool task (workers.gpu_watch)
            allowance = p.settings.document_render_timeout_s if _unrendered(p, job_id) else 0.0
            with watchdog.watch(job_id, allowance_s=allowance):
                run = run_job(p, job_id, takeover=takeover)
    except NotFoundError:
        log.warning("job %s no longer exists (deleted or purged); message dropped", job_id)
        return {"job_id": job_id, "state": "missing"}
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        try:
            found = job_state(p, job_id)
        except Exception:  # the database itself is unreachable: retry the message, the job row is untouched
            if self.request.retries >= ws.transient_max_retries:
                log.error("job %s: giving up on this message after %d retries (%s); the reconciler will send the "
                          "job again once the database answers", job_id, self.request.retries, reason)
                return {"job_id": job_id, "state": "unknown", "error": reason}
            delay = _next_backoff(self, ws)
            raise _retry(self, exc, delay) from None
        state, attempts = found if found else ("missing", 0)
        if state == JobState.queued.value and is_permanent(exc):
            # Bad input fails the same way every time: no retry.
            fail_job(p, job_id, f"not retried (the input cannot be processed): {reason}")
            log.warning("job %s failed without retry: %s", job_id, reason)
            return {"job_id": job_id, "state": JobState.failed.value, "error": reason}
        if state == JobState.queued.value:
            delay = backoff_seconds(max(1, attempts), ws.retry_backoff_s, ws.retry_backoff_max_s)
            log.warning("job %s attempt %d failed (%s); retry in %.1f s", job_id, attempts, reason, delay)
            raise _retry(self, exc, delay) from None
        # failed: run_job spent the attempt cap and recorded the reason; running: another run owns it now.
        log.warning("job %s is %s after: %s", job_id, state, reason)
        return {"job_id": job_id, "state": state, "error": reason}
    return {"job_id": job_id, "state": run.state, "ran": run.ran, "note": run.note}


class _WaitForSlot(Exception):
    """The job's key (or tenant) has all its render slots taken already (workers.render_slots)."""


def _render_caps(p: Any, ws: WorkerSettings) -> RenderCaps:
    return RenderCaps(_redis(), per_key=ws.ingest_renders_per_key, per_tenant=ws.ingest_renders_per_tenant,
                      ttl_s=render_time_limits(p.settings, ws)["time_limit"])


@app.task(name=TASK_PREPARE, bind=True, max_retries=None)
def prepare(self: Task, job_id: int) -> dict[str, Any]:
    """Rendering on the CPU queue, so GPU workers only extract. A bad file is not an exception here: rendering
    records it (document `failed`, its queued jobs `failed` with the reason). Each render is counted on the
    document before it starts, so a file that kills this process every time (the message comes back after each
    death) or keeps passing the task's time limits ends `failed` after `job_max_attempts` renders, with that
    reason. Only infrastructure errors (the database is unreachable) raise, and are retried with backoff."""
    p = runtime.pipeline()
    ws = runtime.process_config().worker_settings
    limits = render_time_limits(p.settings, ws)
    caps = _render_caps(p, ws)
    holder = f"job-{job_id}"
    try:
        owner = render_owner(p, job_id) if caps.enabled else None
        full = caps.acquire(owner, holder) if owner is not None else None
        if full is not None:  # that key's (or tenant's) renders all run: other keys' first
            log.info("job %s waits: %s has all its render slots taken", job_id, full)
            raise _WaitForSlot()
        try:
            document_status = render_for_job_capped(p, job_id, stop_note=(
                f"its render task was killed at the hard time limit ({limits['time_limit']:.0f} s: the document "
                "render budget + 1.5 x DOCPIPE_INGEST_TIME_LIMIT_MARGIN_S), or its process died"))
        finally:
            if owner is not None:
                caps.release(owner, holder)
        found = job_state(p, job_id)
    except _WaitForSlot:
        # not a failure: a later delivery of the same message, counted in no attempt
        raise self.retry(countdown=ws.retry_backoff_s, max_retries=None) from None
    except NotFoundError:
        log.warning("job %s no longer exists (deleted or purged); message dropped", job_id)
        return {"job_id": job_id, "state": "missing"}
    except SoftTimeLimitExceeded:
        # Rendering (or storing its pages) outlived the render budget's backstop. The render was counted on the
        # document; the next delivery renders again, and the render cap ends a file that always does this.
        reason = (f"its render task passed the soft time limit ({limits['soft_time_limit']:.0f} s: the document "
                  "render budget + DOCPIPE_INGEST_TIME_LIMIT_MARGIN_S)")
        log.warning("job %s: %s; retried", job_id, reason)
        note_render_stopped(p, job_id, reason)
        raise _retry(self, SoftTimeLimitExceeded(reason), _next_backoff(self, ws)) from None
    except Exception as exc:
        if self.request.retries >= ws.transient_max_retries:
            log.error("job %s: giving up on preparing it in this message (%s); the reconciler sends it again",
                      job_id, exc)
            return {"job_id": job_id, "state": "unknown", "error": f"{type(exc).__name__}: {exc}"}
        delay = _next_backoff(self, ws)
        raise _retry(self, exc, delay) from None
    state = found[0] if found else "missing"
    if state == JobState.queued.value:
        enqueue_job(job_id, settings=p.settings, worker_settings=ws)
    return {"job_id": job_id, "document": document_status, "state": state}


@app.task(name=TASK_INGEST, bind=True, max_retries=None)
def ingest(self: Task, stage_id: str) -> dict[str, Any]:
    p = runtime.pipeline()
    ws = runtime.process_config().worker_settings
    data_dir = p.settings.data_dir
    try:
        staged = staging.load(data_dir, stage_id)
    except staging.StagingError as exc:
        log.warning("%s; message dropped", exc)
        return {"stage_id": stage_id, "outcome": "gone"}
    try:
        # Rows first, then the render: a file that kills this process while it is read is counted on its
        # document each time the message comes back, and ends `failed` at the cap instead of looping.
        out = receive_counted(p, staged.payload_path(data_dir), name=staged.name, schema=staged.schema,
                              batch_id=staged.batch_id)
        found = job_state(p, out.job_id) if out.job_id is not None else None
        # a duplicate whose job already ran needs nothing
        if out.job_id is not None and found and found[0] == JobState.queued.value:
            enqueue_job(out.job_id, settings=p.settings, worker_settings=ws)
    except Exception as exc:
        if is_permanent(exc):  # e.g. the schema was deleted since submission: keep nothing half-done
            log.error("staged intake %s (%s) cannot be ingested: %s", stage_id, staged.name, exc)
            staging.remove(data_dir, stage_id)
            return {"stage_id": stage_id, "outcome": "failed", "error": str(exc)}
        if self.request.retries >= ws.transient_max_retries:
            log.error("staged intake %s: giving up on this message (%s); the reconciler sends it again", stage_id, exc)
            return {"stage_id": stage_id, "outcome": "retry-later", "error": str(exc)}
        delay = _next_backoff(self, ws)
        raise _retry(self, exc, delay) from None
    staging.remove(data_dir, stage_id)  # only now: until here the staged copy is the record of the submission
    return {"stage_id": stage_id, "outcome": out.outcome, "document_id": out.document_id, "job_id": out.job_id,
            "error": out.error}


@app.task(name=TASK_WATCH)
def watch_folders() -> list[dict[str, Any]]:
    from .watch import scan_folder

    p = runtime.pipeline()
    ws = runtime.process_config().worker_settings
    reports = []
    for folder in p.settings.watch_folders:
        report = scan_folder(p, folder, _redis(), lock_ttl_s=max(60.0, 3 * ws.watch_interval_s))
        for job_id in report.jobs_to_run:
            enqueue_job(job_id, settings=p.settings, worker_settings=ws)
        reports.append({"folder": report.folder, "scanned": report.scanned, "files": len(report.outcomes),
                        "jobs": report.jobs_to_run, "unstable": report.unstable})
    return reports


@app.task(name=TASK_REQUEUE)
def requeue_stuck() -> dict[str, Any]:
    from .reconciler import reconcile

    report = reconcile(runtime.pipeline(), runtime.process_config().worker_settings, _redis())
    return {"jobs_sent": report.jobs_sent, "jobs_waiting": report.jobs_waiting, "stages_sent": report.stages_sent}


@app.task(name=TASK_PURGE)
def purge_retention() -> dict[str, Any]:
    from pipeline.retention import purge_older_than

    p = runtime.pipeline()
    days = p.settings.retention_days
    if days is None:
        return {"documents": 0, "blobs": 0, "note": "retention_days is not set: nothing is purged"}
    report = purge_older_than(p, days)
    return {"documents": report.documents, "blobs": report.blobs}


@app.task(name=TASK_SWEEP)
def sweep_blobs() -> dict[str, Any]:
    from pipeline.retention import SWEEP_GRACE_S, sweep_unreferenced_blobs

    return {"blobs": sweep_unreferenced_blobs(runtime.pipeline(), grace_s=SWEEP_GRACE_S)}
