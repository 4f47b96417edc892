"""workers/reconciler.py: what the messages it sends say (the mutation pass of issue #22, tests/MUTATION.md). One
process, the machine's Redis (a claimed empty database), a SQLite file; no worker processes.
"""
from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from workers_harness import FLAG_SCHEMA, png

from pipeline.settings import Settings
from workers.config import WorkerSettings


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _fresh_process_config() -> Iterator[None]:
    from workers.runtime import reset_process

    yield
    reset_process()


def _messages(client: redis.Redis, queue: str) -> list[tuple[str, list[object], dict[str, object]]]:
    """(task name, args, kwargs) of every message waiting in `queue`."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        headers = json.loads(raw)["headers"]
        out.append((headers["task"], ast.literal_eval(headers["argsrepr"]), ast.literal_eval(headers["kwargsrepr"])))
    return out


def test_a_takeover_message_names_the_dead_worker_and_a_lost_job_message_names_none(redis_url: str,
                                                                                    client: redis.Redis,
                                                                                    tmp_path: Path) -> None:
    from pipeline.context import Pipeline
    from pipeline.ingest import ingest_file
    from pipeline.models import Job, utcnow
    from pipeline.schemas import register_schema
    from workers.liveness import WORKERS_KEY
    from workers.reconciler import reconcile

    p = Pipeline(Settings(data_dir=tmp_path / "data", broker_url=redis_url, max_tokens=16))
    with p.db.session() as s:
        register_schema(s, "flag", FLAG_SCHEMA)
    ws = WorkerSettings(requeue_queued_after_s=5, retry_backoff_s=0.5, retry_backoff_max_s=1)
    dead, lost = (ingest_file(p, png(seed=70 + i), name=f"{i}.png", schema="flag").job_id for i in range(2))
    with p.db.session() as s:
        job = s.get(Job, dead)
        job.state, job.owner, job.attempts = "running", "gone-host:77", 1
        job.lease_until = utcnow() + timedelta(minutes=10)  # its lease is far from over: only the registry tells
        s.get(Job, lost).updated_at = utcnow() - timedelta(seconds=60)
    client.sadd(WORKERS_KEY, "gone-host:77")  # registered, with no heartbeat key: its machine died

    report = reconcile(p, ws, client)
    assert sorted(report.jobs_sent) == sorted([dead, lost]) and report.takeovers == {dead: "gone-host:77"}
    sent = {args[0]: (task, kwargs) for task, args, kwargs in _messages(client, "gpu")}
    assert sent[dead][1] == {"takeover_from": "gone-host:77"}
    assert sent[lost][1] == {}
    assert sent[dead][0] == sent[lost][0]
    assert client.smembers(WORKERS_KEY) == {b"gone-host:77"}  # it still holds a running job: not forgotten
    p.close()
