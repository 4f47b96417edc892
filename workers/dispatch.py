"""The broker side of pipeline.dispatch: Celery publishing for processes that only enqueue (the API), done on a
background thread so that no request waits on the broker.

Registered in pyproject.toml as the `docpipe.dispatch` entry point `broker`."""
from __future__ import annotations

from pipeline.dispatch import Dispatcher
from pipeline.settings import Settings

from .config import WorkerSettings, check_consistency, redis_url
from .enqueue import enqueue_prepare
from .markers import redis_client
from .publisher import BackgroundPublisher


def broker_dispatcher(settings: Settings) -> Dispatcher:
    worker_settings = WorkerSettings()
    check_consistency(settings, worker_settings)  # a broker set-up that cannot work fails at start-up, in words
    url = redis_url(settings)
    # Off the request path: an upload's thread never waits on the broker (workers/publisher.py).
    publisher = BackgroundPublisher(
        lambda job_id: enqueue_prepare(job_id, settings=settings, worker_settings=worker_settings))
    return Dispatcher(send=publisher.send, ping=lambda: redis_client(url).ping())
