"""Per-process state of a worker: the settings it runs with and its `Pipeline` (database, blob store, engine).

A worker process builds its Pipeline in `worker_process_init`, which the prefork pool sends in each child after
the fork, and the GPU worker's thread pool (workers.pool) sends once at start. Nothing that holds sockets, threads
or GPU memory (database connections, the engine) is ever created before a fork.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from celery import signals

from pipeline.attempts import RUN_GATE
from pipeline.context import Pipeline
from pipeline.engine_client import EngineClient
from pipeline.settings import Settings

from .config import WorkerSettings
from .gpu_watch import GpuWatchdog, Watch, WatchedEngine, exit_process, gpu_time_limits
from .liveness import Heartbeat
from .markers import redis_client
from .stuck_runs import release_and_retry

log = logging.getLogger(__name__)


@dataclass
class ProcessConfig:
    settings: Settings
    worker_settings: WorkerSettings
    build_engine: bool = False  # GPU workers load the model at start, not on the first job


_config: ProcessConfig | None = None
_pipeline: Pipeline | None = None
_heartbeat: Heartbeat | None = None
_watchdog: GpuWatchdog | None = None
_watched = False  # this process's engine was built here, behind the watchdog (WatchedEngine)
_lock = threading.Lock()


def configure_process(settings: Settings | None = None, worker_settings: WorkerSettings | None = None,
                      *, build_engine: bool = False, pipeline: Pipeline | None = None) -> ProcessConfig:
    """Fix the settings this process uses (the CLI calls it once; library callers may skip it: env is read).

    `pipeline` hands over a ready Pipeline, e.g. one built with another ExtractionClient (a remote engine);
    its settings then win over `settings`."""
    global _config, _pipeline, _watched
    with _lock:
        _watched = False
        if pipeline is not None:
            settings = pipeline.settings
        _config = ProcessConfig(settings or Settings(), worker_settings or WorkerSettings(), build_engine)
        _pipeline = pipeline
        return _config


def reset_process() -> None:
    """Forget the configuration and Pipeline of this process (the next use reads the environment again)."""
    global _config, _pipeline, _watchdog, _watched
    with _lock:
        _config, _pipeline, _watchdog, _watched = None, None, None, False


def process_config() -> ProcessConfig:
    global _config
    with _lock:
        if _config is None:
            _config = ProcessConfig(Settings(), WorkerSettings())
        return _config


def pipeline() -> Pipeline:
    """This process's Pipeline, built on first use (tasks run on many threads: built once, under a lock). A GPU
    worker's engine is built here too, with the watchdog counting each run's requests (workers.gpu_watch)."""
    global _pipeline, _watched
    cfg = process_config()
    with _lock:
        if _pipeline is None:
            client = None
            if cfg.build_engine:
                watchdog = _gpu_watchdog_locked(cfg)
                client = EngineClient.from_settings(cfg.settings, front=lambda e: WatchedEngine(e, watchdog))
            _pipeline = Pipeline(cfg.settings, client=client)
            _watched = client is not None
        return _pipeline


def gpu_watchdog() -> GpuWatchdog | None:
    """The GPU task's time limits in this process: the watchdog of a GPU worker whose engine it built (it sees
    that engine's requests), None elsewhere (a library caller running the task function, or a Pipeline handed
    over with another client, e.g. a remote engine, keeps its own limits)."""
    with _lock:
        return _watchdog if _watched else None


def _gpu_watchdog_locked(cfg: ProcessConfig) -> GpuWatchdog:
    global _watchdog
    if _watchdog is None:
        limits = gpu_time_limits(cfg.settings.request_timeout_s, cfg.worker_settings.gpu_time_limit_margin_s)

        def on_hard(watch: Watch, reason: str) -> None:
            # The release needs the database; the exit must come whatever it does, so it waits one margin at most.
            release = threading.Thread(target=release_and_retry, name="docpipe-release-stuck-run", daemon=True,
                                       args=(pipeline(), cfg.worker_settings, watch.job_id, reason))
            release.start()
            release.join(cfg.worker_settings.gpu_time_limit_margin_s)
            exit_process(f"job {watch.job_id}: {reason}")

        _watchdog = GpuWatchdog(limits, on_hard=on_hard, idle=RUN_GATE.is_waiting)
    return _watchdog


EXIT_CANNOT_START = 3


@signals.worker_process_init.connect
def _on_process_init(**_: object) -> None:
    global _heartbeat
    cfg = process_config()
    try:
        p = pipeline()
        if cfg.settings.broker_url and _heartbeat is None:
            client = redis_client(cfg.settings.broker_url)
            _heartbeat = Heartbeat(client, cfg.worker_settings.heartbeat_interval_s).start()
        if cfg.build_engine:
            engine = p.client  # loads the weights and starts the engine's step loop, once per process
            log.info("engine ready in pid %d: model %s (%s runner), CUDA_VISIBLE_DEVICES=%s", os.getpid(),
                     engine.model_fingerprint[:16], cfg.settings.runner,
                     os.environ.get("CUDA_VISIBLE_DEVICES", "-"))
    except Exception as exc:
        # Celery logs and ignores exceptions from signal handlers. A worker without its database or engine
        # would take jobs and fail every one of them (burning their attempts), so it stops here instead,
        # before it consumes any message.
        log.critical("worker process %d cannot start: %s: %s", os.getpid(), type(exc).__name__, exc, exc_info=True)
        logging.shutdown()
        os._exit(EXIT_CANNOT_START)


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: object) -> None:
    global _pipeline, _heartbeat
    with _lock:
        p, _pipeline = _pipeline, None
        beat, _heartbeat = _heartbeat, None
    if beat is not None:
        beat.stop()
    if p is not None:
        p.close()  # the engine's step loop is a daemon thread: it ends with the process
