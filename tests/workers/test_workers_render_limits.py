"""The ingest tasks' Celery time limits come from the render budget (workers.config.render_time_limits)."""
from __future__ import annotations

from celery import Celery

from pipeline.settings import Settings
from workers.config import (
    TASK_EXTRACT,
    TASK_INGEST,
    TASK_PREPARE,
    WorkerSettings,
    celery_config,
)


def _task_body() -> None:
    """Celery reads a task's signature from its source: a named function, not a lambda."""


def test_render_tasks_are_time_limited_by_the_render_budget_and_extraction_is_not() -> None:
    settings = Settings(broker_url="redis://127.0.0.1:6379/0", document_render_timeout_s=300.0)
    app = Celery("render-limits-test")
    app.conf.update(celery_config(settings, WorkerSettings(ingest_time_limit_margin_s=40.0)))
    for name in (TASK_PREPARE, TASK_INGEST, TASK_EXTRACT):
        app.task(name=name)(_task_body)
    app.finalize()
    for name in (TASK_PREPARE, TASK_INGEST):
        task = app.tasks[name]
        assert (task.soft_time_limit, task.time_limit) == (340.0, 360.0)
    # the GPU worker's thread pool cannot enforce Celery's limits: its watchdog does (workers.gpu_watch)
    assert app.tasks[TASK_EXTRACT].time_limit is None and app.tasks[TASK_EXTRACT].soft_time_limit is None


def test_a_larger_render_budget_raises_the_limits_with_it() -> None:
    small = celery_config(Settings(broker_url="redis://h:6379/0", document_render_timeout_s=60.0), WorkerSettings())
    large = celery_config(Settings(broker_url="redis://h:6379/0", document_render_timeout_s=3600.0), WorkerSettings())
    assert large["task_annotations"][TASK_PREPARE]["time_limit"] - small["task_annotations"][TASK_PREPARE][
        "time_limit"] == 3540.0
