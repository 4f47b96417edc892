"""The GPU worker's pool: Celery's thread pool that also announces `worker_process_init`.

Celery sends `worker_process_init` from prefork children and from the solo pool, but not from the thread pool.
The GPU worker wants threads (many tasks in flight feed one engine's continuous batcher) and wants the engine
built in the same place as every other pool, so this pool sends the signal once, in the worker process, when the
pool starts (after the worker has daemonised or forked, never before).
"""
from __future__ import annotations

from celery import signals
from celery.concurrency.thread import TaskPool


class EngineThreadPool(TaskPool):
    def on_start(self) -> None:
        super().on_start()
        initargs = self.options.get("initargs") or (None, None)
        signals.worker_process_init.send(sender=initargs[1])

    def on_stop(self) -> None:
        super().on_stop()
        signals.worker_process_shutdown.send(sender=None, pid=None, exitcode=0)
