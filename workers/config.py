"""Queue-side settings and the Celery configuration derived from them.

`pipeline.settings.Settings` holds what every process shares (database, broker URL, job lease, attempt cap, watch
folders, retention). `WorkerSettings` adds the knobs only the queue needs (beat intervals, retry backoff, Redis
visibility timeout). Both read the same `DOCPIPE_` environment variables and `.env` file.

`celery_config()` turns them into Celery's configuration; every reliability setting says why it has its value.
"""
from __future__ import annotations

import ssl
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.settings import Settings

from .broker import TRANSPORT

QUEUE_INGEST = "ingest"  # CPU work: sniff, render pages/frames, store blobs, create jobs; beat's periodic tasks
QUEUE_GPU = "gpu"  # extraction: one worker process per GPU feeding its engine
QUEUES = (QUEUE_INGEST, QUEUE_GPU)

TASK_EXTRACT = "docpipe.extract"
TASK_INGEST = "docpipe.ingest"
TASK_PREPARE = "docpipe.prepare"
TASK_WATCH = "docpipe.watch_folders"
TASK_REQUEUE = "docpipe.requeue_stuck"
TASK_PURGE = "docpipe.purge_retention"
TASK_SWEEP = "docpipe.sweep_blobs"


class WorkerConfigError(ValueError):
    """The queue configuration cannot work (no broker, a broker that is not Redis, inconsistent timeouts)."""


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DOCPIPE_", env_file=".env", env_file_encoding="utf-8", extra="ignore", frozen=True
    )

    # --- redelivery and retries ----------------------------------------------------------------------------------
    visibility_timeout_s: float = Field(
        7200.0, gt=0, description="Redis redelivers an unacknowledged message after this; must exceed the job lease."
    )
    retry_backoff_s: float = Field(2.0, gt=0, description="First retry delay after a transient error.")
    retry_backoff_max_s: float = Field(60.0, gt=0, description="Longest retry delay (doubling, with jitter).")
    transient_max_retries: int = Field(
        8, ge=0, description="Retries of a message whose job could not even be read (database or broker down)."
    )
    # --- reconciler (the database is the source of truth) --------------------------------------------------------
    requeue_interval_s: float = Field(30.0, gt=0, description="How often beat looks for stuck jobs.")
    requeue_queued_after_s: float = Field(
        300.0, gt=0, description="A queued job untouched this long, with no message waiting for it, is sent again."
    )
    heartbeat_interval_s: float = Field(
        10.0, gt=0, description="Workers refresh their liveness key this often; dead after 3 missed beats."
    )
    # --- beat ----------------------------------------------------------------------------------------------------
    watch_interval_s: float = Field(10.0, gt=0, description="How often beat scans the watch folders.")
    retention_interval_s: float = Field(3600.0, gt=0, description="How often beat runs the retention purge.")
    beat_lock_ttl_s: float = Field(30.0, gt=0,
                                   description="The single-beat lock expires this long after its holder died.")
    # --- worker processes ----------------------------------------------------------------------------------------
    ingest_concurrency: int | None = Field(None, ge=1, description="Ingest worker processes; None = CPU count.")
    ingest_max_tasks_per_child: int = Field(
        200, ge=1, description="Recycle an ingest process after this many tasks (bounds leaks in media decoders)."
    )
    ingest_renders_per_key: int | None = Field(
        4, ge=1, description="Documents one API key may have rendering at once across all ingest workers (its "
        "further prepare messages wait while other keys' render); None = no cap. Documents without a key (CLI, "
        "watch folders, an API without keys) count per tenant."
    )
    ingest_renders_per_tenant: int | None = Field(
        None, ge=1, description="Documents one tenant may have rendering at once, all its keys together; None = "
        "no cap beyond the per-key one."
    )
    # --- time limits (derived from the budgets; the margins are what a task may need beyond them) ---------------
    ingest_time_limit_margin_s: float = Field(
        120.0, gt=0, description="The ingest tasks' soft time limit is the document render budget plus this "
        "(storing the pages of a large document); the hard limit half of it later."
    )
    gpu_time_limit_margin_s: float = Field(
        10.0, gt=0, lt=15, description="A GPU run without progress for the request timeout plus this passes its "
        "soft limit, plus twice this its hard limit (below 15 s: both come before the engine client's own "
        "request timeout + 30 s wait)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> "WorkerSettings":
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError("retry_backoff_max_s must be >= retry_backoff_s")
        # A retry waits in a worker's memory (ETA message) with its job `queued`; the reconciler must not mistake
        # it for a lost message and send the job again before the retry is due.
        if self.requeue_queued_after_s <= self.retry_backoff_max_s:
            raise ValueError(
                f"requeue_queued_after_s ({self.requeue_queued_after_s}) must exceed retry_backoff_max_s "
                f"({self.retry_backoff_max_s}), or the reconciler would re-send jobs that wait for their retry"
            )
        return self


def check_consistency(settings: Settings, ws: WorkerSettings) -> None:
    """Cross-checks between the shared settings and the queue settings (raises WorkerConfigError)."""
    redis_url(settings)
    if ws.visibility_timeout_s <= settings.job_lease_s:
        raise WorkerConfigError(
            f"DOCPIPE_VISIBILITY_TIMEOUT_S ({ws.visibility_timeout_s}) must exceed DOCPIPE_JOB_LEASE_S "
            f"({settings.job_lease_s}): Redis would otherwise hand a running job's message to a second worker"
        )
    if settings.job_lease_s <= settings.request_timeout_s:
        raise WorkerConfigError(
            f"DOCPIPE_JOB_LEASE_S ({settings.job_lease_s}) must exceed DOCPIPE_REQUEST_TIMEOUT_S "
            f"({settings.request_timeout_s}): a run renews its lease after each page, and one page may take up to "
            "the request timeout; a shorter lease lets the reconciler hand a healthy job to a second worker"
        )
    if ws.visibility_timeout_s <= ws.retry_backoff_max_s:
        raise WorkerConfigError(
            "DOCPIPE_VISIBILITY_TIMEOUT_S must exceed DOCPIPE_RETRY_BACKOFF_MAX_S (a delayed retry is an "
            "unacknowledged message until it runs)"
        )


def redis_url(settings: Settings) -> str:
    url = settings.broker_url
    if not url:
        raise WorkerConfigError(
            "no broker configured: set DOCPIPE_BROKER_URL=redis://host:6379/0 to use queue workers "
            "(without a broker, `docpipe process` runs jobs in-process)"
        )
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise WorkerConfigError(
            f"DOCPIPE_BROKER_URL={url!r} is not a Redis URL; docpipe's workers need Redis (redis://host:6379/0): "
            "the single-beat lock lives there and the reconciler reads the queues"
        )
    return url


def render_time_limits(settings: Settings, ws: WorkerSettings) -> dict[str, float]:
    """Celery's soft and hard time limits of a task that renders one document, from its render budget."""
    margin = ws.ingest_time_limit_margin_s
    soft = settings.document_render_timeout_s + margin
    return {"soft_time_limit": soft, "time_limit": soft + margin / 2}


def celery_config(settings: Settings, ws: WorkerSettings) -> dict[str, Any]:
    check_consistency(settings, ws)
    url = redis_url(settings)
    return {
        "broker_url": url,
        # kombu's Redis transport, except that an ack Redis could not record still frees its prefetch slot: without
        # that, a worker whose tasks all finished while Redis was down never polls again (see workers.broker).
        "broker_transport": TRANSPORT,
        # kombu guesses TLS from a `rediss://` scheme only when it picks the transport itself; say it here, with
        # certificates verified as docpipe's own Redis clients (redis-py's default) verify them.
        "broker_use_ssl": {"ssl_cert_reqs": ssl.CERT_REQUIRED} if url.startswith("rediss://") else False,
        # No result backend: job state and results live in the database, which every process reads.
        "result_backend": None,
        "task_ignore_result": True,
        "result_expires": None,  # nothing to expire; also keeps beat from scheduling celery.backend_cleanup
        "task_serializer": "json",
        "accept_content": ["json"],
        "timezone": "UTC",
        "enable_utc": True,
        "task_default_queue": QUEUE_INGEST,
        "task_routes": {TASK_EXTRACT: {"queue": QUEUE_GPU}, "docpipe.*": {"queue": QUEUE_INGEST}},
        "task_create_missing_queues": True,
        # Acknowledge a message only after its task returned: a worker that dies mid-job (OOM, SIGKILL, power)
        # leaves the message unacknowledged, so the job is not lost with it.
        "task_acks_late": True,
        # ... and when the pool notices a child died, put the message back instead of acking it as failed.
        "task_reject_on_worker_lost": True,
        # A task that raised is acknowledged: its failure is recorded on the job row (state + reason) and retries
        # are new messages, so redelivering the failed one would only loop.
        "task_acks_on_failure_or_timeout": True,
        # Take one message per free slot, no more: a worker never sits on messages another idle worker could run,
        # and a crash strands at most `concurrency` messages.
        "worker_prefetch_multiplier": 1,
        # Redis has no real acknowledgement: an unacked message is redelivered after the visibility timeout.
        # It must exceed the longest job (the job lease bounds one run) so a slow job is not run twice.
        "broker_transport_options": {
            "visibility_timeout": ws.visibility_timeout_s,
            "socket_timeout": 10,
            "socket_connect_timeout": 5,
            "retry_on_timeout": True,
            "health_check_interval": 10,
        },
        # Keep reconnecting to a restarted broker forever; running jobs go on and write to the database.
        "broker_connection_retry": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        # Threads cannot be cancelled; a job that outlives the connection still writes its results.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Publishing gives up after a few seconds instead of hanging an API request: the job row is already
        # `queued` in the database and the reconciler sends it later.
        "task_publish_retry": True,
        "task_publish_retry_policy": {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2},
        # Celery's time limits need signals and a prefork child; the GPU worker's thread pool ignores them. The
        # GPU task's soft and hard limits are enforced by the worker's watchdog instead (workers.gpu_watch, from
        # request_timeout_s), and a run's lease (job_lease_s, renewed per page) bounds how long a dead run keeps
        # its job.
        "task_time_limit": None,
        "task_soft_time_limit": None,
        # The ingest tasks render (prefork: the limits apply). The render budget stops a slow file inside the task
        # (vision.isolated); these limits are the backstop for what lies outside it (PNG encoding, blob and
        # database writes of 2,000 pages). Soft: the task raises and is retried; hard: the child is killed and the
        # reconciler sends the job again. Each render is counted on the document (pipeline.attempts), so a file
        # that keeps hitting them ends `failed` after job_max_attempts, with the reason.
        "task_annotations": {name: render_time_limits(settings, ws) for name in (TASK_PREPARE, TASK_INGEST)},
        "worker_max_tasks_per_child": ws.ingest_max_tasks_per_child,
        # No remote control: it listens on a Redis pub/sub connection, and when Redis restarts, redis-py silently
        # reconnects that connection and then blocks the worker's event loop reading a subscription the new
        # server never had (observed: a worker that stopped consuming until killed). docpipe workers are
        # controlled by signals and observed through `docpipe status`, so `celery inspect/control` is not used.
        "worker_enable_remote_control": False,
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
        "broker_channel_error_retry": True,
    }
