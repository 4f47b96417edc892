"""The Celery application. Its configuration comes from the docpipe settings of this process (workers.runtime),
read lazily the first time Celery needs it, so importing this module never touches the network.

    celery -A workers.app worker ...   works, but `docpipe worker` picks the right pool and concurrency for you.
"""
from __future__ import annotations

from typing import Any

from celery import Celery

from .config import celery_config
from .runtime import process_config

app = Celery("docpipe", include=["workers.tasks"])


@app.on_configure.connect
def _configure_from_settings(sender: Celery, **_: Any) -> None:
    cfg = process_config()
    sender.conf.update(celery_config(cfg.settings, cfg.worker_settings))


def get_app() -> Celery:
    """The configured app, with its tasks registered."""
    import workers.tasks  # noqa: F401 - imported to register the tasks on `app`

    app.loader.import_default_modules()
    return app
