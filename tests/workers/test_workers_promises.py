"""workers/README promises with no test before (issue #22): publishing is best effort (`enqueue_job` answers
False, never raises, when the broker is down, and the message really lands when it is up), and Celery remote
control is off in the configuration every worker gets."""
from __future__ import annotations

from pathlib import Path

import redis
from workers_harness import free_port

from pipeline.settings import Settings
from workers.config import QUEUE_GPU, WorkerSettings
from workers.enqueue import enqueue_job


def test_enqueue_job_answers_false_when_the_broker_is_down_and_publishes_when_it_is_up(redis_url: str,
                                                                                      tmp_path: Path) -> None:
    ws = WorkerSettings()
    down = Settings(data_dir=tmp_path / "a", broker_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    assert enqueue_job(41, settings=down, worker_settings=ws) is False
    up = Settings(data_dir=tmp_path / "b", broker_url=redis_url)
    assert enqueue_job(42, settings=up, worker_settings=ws) is True
    client = redis.Redis.from_url(redis_url)
    try:
        # kombu's Redis transport keeps a queue as a list named after it: the message for job 42 is waiting there
        messages = client.lrange(QUEUE_GPU, 0, -1)
        assert len(messages) == 1 and b"docpipe.extract" in messages[0] and b"42" in messages[0]
    finally:
        client.close()


def test_celery_remote_control_is_off_for_the_workers_app(tmp_path: Path) -> None:
    from workers.app import get_app
    from workers.runtime import configure_process, reset_process

    configure_process(Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/9"), WorkerSettings())
    try:
        app = get_app()
        assert app.conf.worker_enable_remote_control is False  # no pidbox subscription (see workers/config.py)
        assert app.conf.worker_send_task_events is False
    finally:
        reset_process()
