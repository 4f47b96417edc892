"""workers/reconciler.py: what the messages it sends say (the mutation pass of issue #22, tests/MUTATION.md). One
process, the machine's Redis (a claimed empty database), a SQLite file; no worker processes.
"""
from __future__ import annotations

import ast
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

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


def _lost_jobs(p: Any, count: int, *, rendered: bool, seed: int) -> list[int]:
    """`count` queued jobs untouched for a minute (their messages lost), rendered or only received (an upload)."""
    from pipeline.ingest import ingest_file, receive_file
    from pipeline.models import Job, utcnow

    intake = ingest_file if rendered else receive_file
    ids = [intake(p, png(seed=seed + i), name=f"{seed + i}.png", schema="flag").job_id for i in range(count)]
    with p.db.session() as s:
        for job_id in ids:
            s.get(Job, job_id).updated_at = utcnow() - timedelta(seconds=60)
    return [job_id for job_id in ids if job_id is not None]


def _old_stage(p: Any, content: bytes) -> str:
    """A staged intake a minute old (its ingest message lost)."""
    from workers import staging

    staged = staging.stage(p.settings.data_dir, content, name="old.png", schema=None, batch_id=None)
    meta = staging.incoming_dir(p.settings.data_dir) / staged.stage_id / staging.META
    meta.write_text(meta.read_text().replace(str(staged.created), str(staged.created - 60)))
    return staged.stage_id


def _pipeline(tmp_path: Path, redis_url: str, **settings: Any) -> Any:
    from pipeline.context import Pipeline
    from pipeline.schemas import register_schema

    p = Pipeline(Settings(data_dir=tmp_path / "data", broker_url=redis_url, max_tokens=16, **settings))
    with p.db.session() as s:
        register_schema(s, "flag", FLAG_SCHEMA)
    return p


WS = WorkerSettings(requeue_queued_after_s=5, retry_backoff_s=0.5, retry_backoff_max_s=1)


def test_a_prepare_message_waiting_for_a_rendered_job_counts_whatever_else_is_stale(redis_url: str,
                                                                                    client: redis.Redis,
                                                                                    tmp_path: Path) -> None:
    """A `prepare` message sends its job on to `gpu` once rendered: while one waits, the job is not sent again,
    also in a tick where nothing awaits rendering (before, the ingest queue was read only for unrendered jobs or
    staged intakes, so the answer depended on what else was stale)."""
    from workers.enqueue import enqueue_prepare
    from workers.reconciler import reconcile

    p = _pipeline(tmp_path, redis_url)
    [job_id] = _lost_jobs(p, 1, rendered=True, seed=80)
    assert enqueue_prepare(job_id, settings=p.settings, worker_settings=WS)
    report = reconcile(p, WS, client)
    assert (report.jobs_sent, report.jobs_waiting, report.stages_sent) == ([], 1, [])
    assert client.llen("gpu") == 0 and [m[1] for m in _messages(client, "ingest")] == [[job_id]]
    p.close()


def test_the_reconciler_sends_with_the_worker_settings_it_was_given(redis_url: str, client: redis.Redis,
                                                                    tmp_path: Path) -> None:
    """A lease longer than the default visibility timeout (7,200 s), with a visibility timeout to match: the
    process's own default worker settings would refuse this pair, the reconciler's are used for every message."""
    from workers.reconciler import reconcile

    p = _pipeline(tmp_path, redis_url, job_lease_s=10_000)
    ws = WorkerSettings(requeue_queued_after_s=5, retry_backoff_s=0.5, retry_backoff_max_s=1,
                        visibility_timeout_s=20_000)
    [rendered] = _lost_jobs(p, 1, rendered=True, seed=90)
    [received] = _lost_jobs(p, 1, rendered=False, seed=91)
    stage_id = _old_stage(p, b"staged bytes")
    report = reconcile(p, ws, client)
    assert sorted(report.jobs_sent) == sorted([rendered, received]) and report.stages_sent == [stage_id]
    assert [args for _, args, _ in _messages(client, "gpu")] == [[rendered]]
    assert sorted(map(str, (args for _, args, _ in _messages(client, "ingest")))) == sorted(
        [str([received]), str([stage_id])])
    p.close()


def test_what_the_reconciler_logs_when_it_sends(redis_url: str, client: redis.Redis, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from workers.reconciler import reconcile

    p = _pipeline(tmp_path, redis_url)
    ids = _lost_jobs(p, 21, rendered=False, seed=100)
    with caplog.at_level(logging.WARNING, logger="workers.reconciler"):
        report = reconcile(p, WS, client)
    assert sorted(report.jobs_sent) == sorted(ids) and len(ids) == 21
    assert [r.getMessage() for r in caplog.records if r.name == "workers.reconciler"] == [
        f"reconciler sent again 21 job(s) {report.jobs_sent[:20]} and 0 staged intake(s) whose messages were lost "
        "or whose worker died"]  # the first 20 ids only
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.reconciler"):
        assert reconcile(p, WS, client).jobs_waiting == 21  # nothing sent: nothing said
    assert [r for r in caplog.records if r.name == "workers.reconciler"] == []
    stage_id = _old_stage(p, b"late bytes")
    with caplog.at_level(logging.WARNING, logger="workers.reconciler"):
        assert reconcile(p, WS, client).stages_sent == [stage_id]
    assert [r.getMessage() for r in caplog.records if r.name == "workers.reconciler"] == [
        "reconciler sent again 0 job(s) [] and 1 staged intake(s) whose messages were lost or whose worker died"]
    p.close()


def test_a_tick_with_nothing_stale_sends_nothing(redis_url: str, client: redis.Redis, tmp_path: Path) -> None:
    from pipeline.ingest import ingest_file
    from workers.reconciler import ReconcileReport, reconcile

    p = _pipeline(tmp_path, redis_url)
    ingest_file(p, png(seed=130), name="fresh.png", schema="flag")  # queued just now: its message may be on the way
    assert reconcile(p, WS, client) == ReconcileReport()
    assert client.llen("gpu") == 0 and client.llen("ingest") == 0
    p.close()
