"""Sending work to the queue: what the CLI, the API and the tasks themselves call.

    from workers.enqueue import enqueue_job, enqueue_prepare, enqueue_ingest
    enqueue_prepare(job_id)                            # a queued job whose document may still need rendering:
                                                       # the ingest queue renders it, then sends it to `gpu`
    enqueue_job(job_id)                                # a queued job whose document is rendered -> `gpu`
    enqueue_ingest(path_or_bytes, name="scan.pdf")     # a file not yet ingested (rendered on an ingest worker)

Both use the broker from `Settings.broker_url`. Publishing is best effort by design: the database row (or the
staged file) is the record, and the reconciler sends again whatever has no message waiting. So `enqueue_job`
returns False instead of raising when the broker is unreachable; the job is still `queued` and nothing is lost.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from celery import Celery
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError

from pipeline.settings import Settings

from . import staging
from .config import QUEUE_GPU, QUEUE_INGEST, TASK_EXTRACT, TASK_INGEST, TASK_PREPARE, WorkerSettings, celery_config
from .markers import ingest_task_id, job_task_id

log = logging.getLogger(__name__)

_producers: dict[str, Celery] = {}
_producers_lock = threading.Lock()

BROKER_ERRORS = (KombuOperationalError, RedisError, ConnectionError, OSError)


def producer(settings: Settings, ws: WorkerSettings) -> Celery:
    """A send-only Celery app for this broker (tasks are sent by name; no task code is imported)."""
    config = celery_config(settings, ws)
    with _producers_lock:
        app = _producers.get(config["broker_url"])
        if app is None:
            app = Celery("docpipe-producer", set_as_current=False)
            app.conf.update(config)
            _producers[config["broker_url"]] = app
        return app


def _settings(settings: Settings | None, ws: WorkerSettings | None) -> tuple[Settings, WorkerSettings]:
    if settings is None or ws is None:
        from .runtime import process_config

        cfg = process_config()
        settings, ws = settings or cfg.settings, ws or cfg.worker_settings
    return settings, ws


def enqueue_job(job_id: int, *, settings: Settings | None = None, worker_settings: WorkerSettings | None = None,
                countdown: float | None = None, takeover_from: str | None = None) -> bool:
    """Publish the extraction of one job to the `gpu` queue. False when the broker is unreachable (the reconciler
    sends it later; the job stays `queued`). `takeover_from` (the reconciler's) names the dead worker whose
    running job this message may take over."""
    settings, ws = _settings(settings, worker_settings)
    app = producer(settings, ws)
    kwargs: dict[str, object] = {"takeover_from": takeover_from} if takeover_from else {}
    if _publish(app, TASK_EXTRACT, [int(job_id)], QUEUE_GPU, job_task_id(job_id), countdown, kwargs):
        return True
    log.warning("job %s stays queued in the database; the broker is unreachable: the reconciler will send it "
                "once the broker answers", job_id)
    return False


def enqueue_prepare(job_id: int, *, settings: Settings | None = None,
                    worker_settings: WorkerSettings | None = None) -> bool:
    """Publish the preparation of one queued job to the `ingest` queue: render its document if it is still
    `received` (stored by an upload, not rendered), then send the job to `gpu`. False when the broker is
    unreachable (the job stays `queued`; the reconciler sends it later)."""
    settings, ws = _settings(settings, worker_settings)
    if _publish(producer(settings, ws), TASK_PREPARE, [int(job_id)], QUEUE_INGEST, job_task_id(job_id)):
        return True
    log.warning("job %s stays queued in the database; the broker is unreachable: the reconciler will send it "
                "once the broker answers", job_id)
    return False


def _publish(app: Celery, task: str, args: list[object], queue: str, task_id: str,
             countdown: float | None = None, kwargs: dict[str, object] | None = None) -> bool:
    try:
        app.send_task(task, args=args, kwargs=kwargs or {}, queue=queue, countdown=countdown, task_id=task_id)
        return True
    except BROKER_ERRORS as exc:
        log.debug("publishing %s%s failed: %s", task, args, exc)
        return False


@dataclass
class StagedIngest:
    stage_id: str
    published: bool  # False: the broker was unreachable; the reconciler sends it once the broker answers


def enqueue_ingest(source: Path | str | bytes | BinaryIO, *, name: str | None = None, schema: str | None = None,
                   batch_id: int | None = None, settings: Settings | None = None,
                   worker_settings: WorkerSettings | None = None) -> StagedIngest:
    """Stage one file under <data_dir>/incoming and publish its ingestion to the `ingest` queue.

    Raises OSError when the file cannot be read or staged; a broker that is down is not an error (the staged
    file is the record of the submission, the reconciler sends it).
    """
    settings, ws = _settings(settings, worker_settings)
    label = name or (Path(source).name if isinstance(source, (str, Path)) else "upload")
    staged = staging.stage(settings.data_dir, Path(source) if isinstance(source, str) else source,
                           name=label, schema=schema, batch_id=batch_id)
    return StagedIngest(staged.stage_id, publish_ingest(staged.stage_id, settings=settings, worker_settings=ws))


def publish_ingest(stage_id: str, *, settings: Settings | None = None,
                   worker_settings: WorkerSettings | None = None) -> bool:
    settings, ws = _settings(settings, worker_settings)
    app = producer(settings, ws)
    if _publish(app, TASK_INGEST, [stage_id], QUEUE_INGEST, ingest_task_id(stage_id)):
        return True
    log.warning("staged intake %s waits for the reconciler; the broker is unreachable", stage_id)
    return False
