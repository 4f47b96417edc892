"""What the GPU worker does with a run stuck past its hard time limit (workers.gpu_watch), before it exits.

The run's own thread cannot be stopped, so the watchdog ends the run from outside, in the database: the job,
still `running` under this process, is charged the attempt its claim took and goes back to `queued` with the
reason, marked to run alone next (so its next hang stops no other run), or ends `failed` at the attempt cap.
Its retry is published here, because the message of the stuck task is never acknowledged (the process exits).
The stuck thread's later writes, if it ever wakes, are refused by the run's fencing token (pipeline.jobs).
"""
from __future__ import annotations

import logging

from sqlalchemy import select

from pipeline.context import Pipeline
from pipeline.leases import this_owner
from pipeline.models import Job, JobState, utcnow

from .config import WorkerSettings
from .enqueue import enqueue_job
from .failures import backoff_seconds

log = logging.getLogger(__name__)


def release_stuck_run(p: Pipeline, job_id: int, reason: str, *, owner: str | None = None) -> str | None:
    """End this process's run of `job_id` (see the module docstring): the job's state afterwards, or None when
    the run is not this process's any more (finished, or taken over)."""
    now = utcnow()
    with p.db.session() as s:
        job = s.scalars(select(Job).where(Job.id == job_id, Job.state == JobState.running.value,
                                          Job.owner == (owner or this_owner())).with_for_update()).first()
        if job is None:
            return None
        spent = job.attempts >= p.settings.job_max_attempts  # the claim charged this run already
        job.state = (JobState.failed if spent else JobState.queued).value
        job.error = f"gave up after {job.attempts} attempts; last error: {reason}" if spent else reason
        job.isolated = True
        job.owner, job.lease_until, job.updated_at = None, None, now
        if spent:
            job.finished_at = now
        return job.state


def release_and_retry(p: Pipeline, ws: WorkerSettings, job_id: int, reason: str) -> str | None:
    """`release_stuck_run`, then publish the job's retry when it went back to `queued` (best effort: the
    reconciler sends a queued job without a message later)."""
    try:
        state = release_stuck_run(p, job_id, reason)
        if state == JobState.queued.value:
            with p.db.read_session() as s:
                attempts = s.scalar(select(Job.attempts).where(Job.id == job_id)) or 1
            enqueue_job(job_id, settings=p.settings, worker_settings=ws,
                        countdown=backoff_seconds(max(1, attempts), ws.retry_backoff_s, ws.retry_backoff_max_s))
        return state
    except Exception:  # the process exits next whatever happens; the reconciler recovers the job then
        log.exception("job %s: could not release the stuck run; it is recovered after the process exits", job_id)
        return None
