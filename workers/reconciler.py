"""The reconciler: the database (and the staging folder) is the truth, the broker only a delivery mechanism.

On every beat tick (`requeue_interval_s`) it sends again:
  * jobs `running` past their lease, or whose owner process is gone from its host (the worker died mid-job);
  * jobs `running` under a worker whose heartbeat expired (its machine died; see workers.liveness), as takeovers;
  * jobs `queued` and untouched for `requeue_queued_after_s` (their message was lost: a broker restarted without
    persistence, or a worker took it and died before running it);
  * staged intakes older than `requeue_queued_after_s` (submitted files whose ingest message was lost);
unless a message for it is waiting in either queue right now (read from the broker, see workers.markers; a
`prepare` message sends its job on to `gpu` once rendered). A queued job whose document is still `received` (an
upload not rendered yet) goes to the `ingest` queue to be prepared, every other job to `gpu`. Sending
twice is harmless (`run_job` is idempotent and claims with compare-and-set; ingestion dedupes by content), so
the reconciler errs on the side of sending.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis
from sqlalchemy import select

from pipeline.context import Pipeline
from pipeline.jobs import stale_jobs
from pipeline.models import Job, JobState
from pipeline.rendering import jobs_awaiting_render

from . import staging
from .config import QUEUE_GPU, QUEUE_INGEST, WorkerSettings
from .enqueue import enqueue_job, enqueue_prepare, publish_ingest
from .liveness import dead_owners, forget, registered
from .markers import waiting

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    jobs_sent: list[int] = field(default_factory=list)
    jobs_waiting: int = 0  # stale by the database, but a message for them waits in the queue
    stages_sent: list[str] = field(default_factory=list)
    takeovers: dict[int, str] = field(default_factory=dict)  # job id -> the dead worker it was taken from


def _running_owners(p: Pipeline) -> dict[int, str]:
    with p.db.read_session() as s:
        rows = s.execute(select(Job.id, Job.owner).where(Job.state == JobState.running.value)).all()
    return {job_id: owner for job_id, owner in rows if owner}


def reconcile(p: Pipeline, ws: WorkerSettings, client: redis.Redis) -> ReconcileReport:
    report = ReconcileReport()
    stale = stale_jobs(p, queued_for_s=ws.requeue_queued_after_s)
    running = _running_owners(p)
    dead = dead_owners(client, registered(client))
    takeovers = {job_id: owner for job_id, owner in running.items() if owner in dead and job_id not in stale}
    stages = staging.pending(p.settings.data_dir, ws.requeue_queued_after_s)
    unrendered = jobs_awaiting_render(p, stale)
    # Read the queues after the database: a message published in between is seen, not sent twice. The ingest
    # queue is read whenever a job may be sent, not only for unrendered ones: a job's `prepare` message waiting
    # there counts whatever else is stale this tick.
    waiting_jobs = waiting(client, QUEUE_GPU)["job"] if stale or takeovers else set()
    on_ingest = waiting(client, QUEUE_INGEST) if stages or stale or takeovers else {"job": set(), "stage": set()}
    waiting_jobs |= on_ingest["job"]  # `prepare` messages name their job too
    waiting_stages = on_ingest["stage"]
    for job_id in [*stale, *takeovers]:
        owner = takeovers.get(job_id)
        if str(job_id) in waiting_jobs:
            report.jobs_waiting += 1
        elif job_id in unrendered and not owner:
            if enqueue_prepare(job_id, settings=p.settings, worker_settings=ws):
                report.jobs_sent.append(job_id)
        elif enqueue_job(job_id, settings=p.settings, worker_settings=ws, takeover_from=owner):
            report.jobs_sent.append(job_id)
            if owner:
                report.takeovers[job_id] = owner
    forget(client, dead - set(running.values()))  # dead workers that hold no job any more
    for staged in stages:
        if staged.stage_id not in waiting_stages and publish_ingest(staged.stage_id, settings=p.settings,
                                                                     worker_settings=ws):
            report.stages_sent.append(staged.stage_id)
    if report.jobs_sent or report.stages_sent:
        log.warning("reconciler sent again %d job(s) %s and %d staged intake(s) whose messages were lost or "
                    "whose worker died", len(report.jobs_sent), report.jobs_sent[:20], len(report.stages_sent))
    return report
