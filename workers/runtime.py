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

from pipeline.context import Pipeline
from pipeline.settings import Settings

from .config import WorkerSettings
from .liveness import Heartbeat
from .markers import redis_client

log = logging.getLogger(__name__)


@dataclass
class ProcessConfig:
    settings: Settings
    worker_settings: WorkerSettings
    build_engine: bool = False  # GPU workers load the model at start, not on the first job


_config: ProcessConfig | None = None
_pipeline: Pipeline | None = None
_heartbeat: Heartbeat | None = None
_lock = threading.Lock()


def configure_process(settings: Settings | None = None, worker_settings: WorkerSettings | None = None,
                      *, build_engine: bool = False, pipeline: Pipeline | None = None) -> ProcessConfig:
    """Fix the settings this process uses (the CLI calls it once; library callers may skip it: env is read).

    `pipeline` hands over a ready Pipeline, e.g. one built with another ExtractionClient (a remote engine);
    its settings then win over `settings`."""
    global _config, _pipeline
    with _lock:
        if pipeline is not None:
            settings = pipeline.settings
        _config = ProcessConfig(settings or Settings(), worker_settings or WorkerSettings(), build_engine)
        _pipeline = pipeline
        return _config


def reset_process() -> None:
    """Forget the configuration and Pipeline of this process (the next use reads the environment again)."""
    global _config, _pipeline
    with _lock:
        _config, _pipeline = None, None


def process_config() -> ProcessConfig:
    global _config
    with _lock:
        if _config is None:
            _config = ProcessConfig(Settings(), WorkerSettings())
        return _config


def pipeline() -> Pipeline:
    """This process's Pipeline, built on first use (tasks run on many threads: built once, under a lock)."""
    global _pipeline
    cfg = process_config()
    with _lock:
        if _pipeline is None:
            _pipeline = Pipeline(cfg.settings)
        return _pipeline


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
