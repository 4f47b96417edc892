"""The queue's parts in one process (no worker processes): backoff, configuration checks, the Redis lease lock,
the single-beat scheduler, the reconciler's decisions, watch-folder moves, permanent errors, CLI input errors."""
from __future__ import annotations

import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest
import redis
from typer.testing import CliRunner
from workers_harness import FLAG_SCHEMA, png

from pipeline.settings import Settings
from workers.config import WorkerConfigError, WorkerSettings, celery_config, check_consistency
from workers.failures import backoff_seconds, is_permanent


@pytest.fixture(autouse=True)
def _fresh_process_config() -> Iterator[None]:
    from workers.runtime import reset_process

    yield
    reset_process()  # tests that configure this process must not leak their settings into later tests


# --- backoff and error classes ---------------------------------------------------------------------------------
def test_backoff_doubles_caps_and_jitters_within_half_to_full_ceiling():
    rng = random.Random(random.randrange(1 << 30))
    for attempt in range(1, 12):
        ceiling = min(30.0, 0.5 * 2 ** (attempt - 1))
        delays = [backoff_seconds(attempt, 0.5, 30.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > ceiling / 10  # really jittered, not a constant
    with pytest.raises(ValueError, match="start at 1"):
        backoff_seconds(0, 1.0, 2.0)


def test_bad_input_errors_are_permanent_and_others_are_not():
    import vision
    from gpu_engine.engine import RequestError
    from pipeline.errors import NotFoundError, UnknownSchemaError

    assert is_permanent(UnknownSchemaError("x", ["generic"]))
    assert is_permanent(NotFoundError("job", 3))
    assert is_permanent(vision.CorruptMediaError("broken.pdf is damaged"))
    assert is_permanent(RequestError("prompt too long"))
    assert not is_permanent(RuntimeError("engine stopped"))
    assert not is_permanent(OSError("NFS hiccup"))


# --- configuration ---------------------------------------------------------------------------------------------
def test_configuration_refuses_missing_or_non_redis_broker_and_inconsistent_timeouts(tmp_path):
    ws = WorkerSettings()
    with pytest.raises(WorkerConfigError, match="no broker configured"):
        check_consistency(Settings(data_dir=tmp_path), ws)
    with pytest.raises(WorkerConfigError, match="not a Redis URL"):
        check_consistency(Settings(data_dir=tmp_path, broker_url="amqp://guest@localhost//"), ws)
    with pytest.raises(WorkerConfigError, match="must exceed DOCPIPE_JOB_LEASE_S"):
        check_consistency(Settings(data_dir=tmp_path, broker_url="redis://x", job_lease_s=900),
                          WorkerSettings(visibility_timeout_s=600))
    with pytest.raises(WorkerConfigError, match="must exceed DOCPIPE_REQUEST_TIMEOUT_S"):
        check_consistency(Settings(data_dir=tmp_path, broker_url="redis://x", job_lease_s=60, request_timeout_s=60),
                          ws)
    with pytest.raises(ValueError, match="must exceed retry_backoff_max_s"):
        WorkerSettings(retry_backoff_max_s=60, requeue_queued_after_s=30)


def test_celery_config_has_the_reliability_settings(tmp_path):
    conf = celery_config(Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/3", job_lease_s=100,
                                  request_timeout_s=50),
                         WorkerSettings(visibility_timeout_s=500))
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["broker_transport_options"]["visibility_timeout"] == 500
    assert conf["task_routes"]["docpipe.extract"] == {"queue": "gpu"}
    assert conf["broker_connection_max_retries"] is None


# --- Redis lease lock and the single beat ----------------------------------------------------------------------
@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_lease_lock_has_one_holder_is_extended_by_it_only_and_expires(client):
    from workers.locks import RedisLock

    a, b = RedisLock(client, "docpipe:test:lock", 0.3), RedisLock(client, "docpipe:test:lock", 0.3)
    assert a.acquire_or_extend() and not b.acquire_or_extend()
    assert a.acquire_or_extend()  # extending our own
    b.release()  # not b's to release
    assert a.holder() == a.token
    a.release()
    assert b.acquire_or_extend() and not a.acquire_or_extend()
    time.sleep(0.45)  # b dies without releasing: its lease runs out
    assert a.acquire_or_extend()


def test_only_the_beat_holding_the_lock_sends_and_a_standby_takes_over(redis_url, tmp_path):
    from celery import Celery

    from workers.beat import LockedScheduler
    from workers.runtime import configure_process

    settings = Settings(data_dir=tmp_path, broker_url=redis_url)
    ws = WorkerSettings(beat_lock_ttl_s=0.6)
    configure_process(settings, ws)
    app = Celery("beat-test", set_as_current=False)
    app.conf.update(celery_config(settings, ws))
    app.conf.beat_schedule = {}
    first, second = LockedScheduler(app), LockedScheduler(app)
    first.tick()
    second.tick()
    assert first.holding and not second.holding
    assert second.tick() == pytest.approx(0.2)  # a standby checks again after a third of the TTL
    first.close()  # a clean stop hands over at once
    second.tick()
    assert second.holding
    second.close()


# --- reconciler ------------------------------------------------------------------------------------------------
def _pipeline(tmp_path: Path, redis_url: str, **extra):
    from pipeline.context import Pipeline
    from pipeline.schemas import register_schema

    p = Pipeline(Settings(data_dir=tmp_path / "data", broker_url=redis_url, max_tokens=16, **extra))
    with p.db.session() as s:
        register_schema(s, "flag", FLAG_SCHEMA)
    return p


def test_reconciler_sends_lost_and_abandoned_jobs_only(redis_url, client, tmp_path):
    from pipeline.ingest import ingest_file
    from pipeline.models import Job, utcnow
    from workers import staging
    from workers.enqueue import enqueue_job, publish_ingest
    from workers.reconciler import reconcile

    p = _pipeline(tmp_path, redis_url)
    ws = WorkerSettings(requeue_queued_after_s=5, retry_backoff_s=0.5, retry_backoff_max_s=1)
    ids = [ingest_file(p, png(seed=i), name=f"{i}.png", schema="flag").job_id for i in range(7)]
    lost, waiting, taken, fresh, abandoned, alive, done = ids
    now = utcnow()
    with p.db.session() as s:
        for job_id in (lost, waiting, taken):
            s.get(Job, job_id).updated_at = now - timedelta(seconds=60)
        s.get(Job, fresh).updated_at = now
        job = s.get(Job, abandoned)  # its worker died: lease over
        job.state, job.owner, job.lease_until = "running", "elsewhere:1", now - timedelta(seconds=1)
        job = s.get(Job, alive)
        job.state, job.owner, job.lease_until = "running", "elsewhere:2", now + timedelta(seconds=60)
        s.get(Job, done).state = "succeeded"
    assert enqueue_job(taken, settings=p.settings, worker_settings=ws)
    assert enqueue_job(waiting, settings=p.settings, worker_settings=ws)  # its message still waits in the queue
    assert client.rpop("gpu") is not None  # a worker took the oldest (`taken`'s) and died before running it
    old_stage = staging.stage(p.settings.data_dir, b"bytes", name="old.png", schema=None, batch_id=None)
    meta = staging.incoming_dir(p.settings.data_dir) / old_stage.stage_id / staging.META
    meta.write_text(meta.read_text().replace(str(old_stage.created), str(old_stage.created - 60)))
    waiting_stage = staging.stage(p.settings.data_dir, b"other", name="queued.png", schema=None, batch_id=None)
    meta = staging.incoming_dir(p.settings.data_dir) / waiting_stage.stage_id / staging.META
    meta.write_text(meta.read_text().replace(str(waiting_stage.created), str(waiting_stage.created - 60)))
    assert publish_ingest(waiting_stage.stage_id, settings=p.settings, worker_settings=ws)
    staging.stage(p.settings.data_dir, b"new", name="new.png", schema=None, batch_id=None)  # too recent to judge

    report = reconcile(p, ws, client)
    assert sorted(report.jobs_sent) == sorted([lost, taken, abandoned])
    assert report.jobs_waiting == 1
    assert report.stages_sent == [old_stage.stage_id]
    assert client.llen("gpu") == 4 and client.llen("ingest") == 2
    # Everything stale now has a message waiting: the next tick sends nothing more.
    again = reconcile(p, ws, client)
    assert again.jobs_sent == [] and again.stages_sent == [] and again.jobs_waiting == 4
    p.close()


def test_reconciler_sends_a_lost_job_of_an_unrendered_upload_to_be_prepared(redis_url, client, tmp_path):
    import json

    from pipeline.ingest import receive_file
    from pipeline.models import Job, utcnow
    from workers.enqueue import enqueue_prepare
    from workers.reconciler import reconcile

    p = _pipeline(tmp_path, redis_url)
    ws = WorkerSettings(requeue_queued_after_s=5, retry_backoff_s=0.5, retry_backoff_max_s=1)
    lost, waiting = (receive_file(p, png(seed=40 + i), name=f"up{i}.png", schema="flag").job_id for i in range(2))
    with p.db.session() as s:
        for job_id in (lost, waiting):
            s.get(Job, job_id).updated_at = utcnow() - timedelta(seconds=60)
    assert enqueue_prepare(waiting, settings=p.settings, worker_settings=ws)  # still waits on the ingest queue

    report = reconcile(p, ws, client)
    assert report.jobs_sent == [lost] and report.jobs_waiting == 1
    assert client.llen("gpu") == 0 and client.llen("ingest") == 2  # rendering first: the ingest queue
    tasks = sorted(json.loads(m)["headers"]["argsrepr"] for m in client.lrange("ingest", 0, -1))
    assert tasks == sorted([f"[{lost}]", f"[{waiting}]"])
    assert reconcile(p, ws, client).jobs_sent == []
    p.close()


# --- watch folders ---------------------------------------------------------------------------------------------
def test_watch_scan_moves_good_files_to_done_and_unreadable_ones_to_failed(redis_url, client, tmp_path):
    from workers.locks import RedisLock
    from workers.watch import lock_key, scan_folder

    p = _pipeline(tmp_path, redis_url, watch_action="move", stable_seconds=0, default_schema="flag")
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.png").write_bytes(png(seed=1))
    (folder / "broken.pdf").write_bytes(b"%PDF-1.7\n this is not really a PDF")

    report = scan_folder(p, folder, client, lock_ttl_s=10)
    assert report.scanned and len(report.outcomes) == 2
    assert (folder / "done" / "sub" / "a.png").exists() and (folder / "failed" / "broken.pdf").exists()
    assert not (folder / "sub" / "a.png").exists()
    [good] = [o for o in report.outcomes if o.outcome == "new"]
    assert report.jobs_to_run == [good.job_id]

    (folder / "sub" / "a.png").write_bytes(png(seed=1))  # the same content again: no second job
    again = scan_folder(p, folder, client, lock_ttl_s=10)
    assert [o.outcome for o in again.outcomes] == ["duplicate"] and again.jobs_to_run == [good.job_id]
    assert (folder / "done" / "sub" / "a-1.png").exists()  # no overwrite in done/

    other = RedisLock(client, lock_key(folder.resolve()), 10)
    assert other.acquire_or_extend()  # another scan of this folder is running
    assert not scan_folder(p, folder, client, lock_ttl_s=10).scanned
    p.close()


# --- permanent errors do not retry -----------------------------------------------------------------------------
class _RefusingClient:
    """An ExtractionClient whose engine refuses every request (as it does for a prompt it cannot take)."""

    model_key = "refusing-test-model"
    model_fingerprint = "0" * 64
    engine_version = "test"

    def run(self, requests):
        from gpu_engine.engine import RequestError

        raise RequestError("prompt of 99999 tokens exceeds max_model_len 16384")
        yield  # pragma: no cover  (makes this a generator like the real client)


def test_an_extraction_refused_as_bad_input_fails_at_once_without_retry(redis_url, tmp_path):
    from pipeline.context import Pipeline
    from pipeline.ingest import ingest_file
    from pipeline.models import Job
    from workers import tasks
    from workers.runtime import configure_process

    settings = Settings(data_dir=tmp_path / "data", broker_url=redis_url, job_max_attempts=3)
    p = Pipeline(settings, client=_RefusingClient())
    configure_process(pipeline=p)
    job_id = ingest_file(p, png(seed=7), name="x.png").job_id
    out = tasks.extract(job_id)
    assert out["state"] == "failed"
    with p.db.read_session() as s:
        job = s.get(Job, job_id)
        assert (job.state, job.attempts) == ("failed", 1)
        assert job.error.startswith("not retried (the input cannot be processed): RequestError: prompt of 99999")
    p.close()


# --- CLI input errors ------------------------------------------------------------------------------------------
def _cli():
    import typer

    from workers.cli import register

    app = typer.Typer()
    register(app)
    return app


def test_cli_refuses_unknown_queue_missing_broker_and_unknown_schema(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCPIPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("DOCPIPE_BROKER_URL", raising=False)
    runner = CliRunner()
    result = runner.invoke(_cli(), ["status"])
    assert result.exit_code == 2 and "no broker configured" in result.output
    result = runner.invoke(_cli(), ["worker", "--queues", "cpu"])
    assert result.exit_code == 2 and "--queues takes ingest or gpu" in result.output

    monkeypatch.setenv("DOCPIPE_BROKER_URL", redis_url)
    doc = tmp_path / "a.png"
    doc.write_bytes(png(seed=3))
    result = runner.invoke(_cli(), ["submit", str(doc), "--schema", "no_such_schema"])
    assert result.exit_code == 2 and "unknown extraction schema 'no_such_schema'" in result.output
    assert not (tmp_path / "data" / "incoming").exists() or not any((tmp_path / "data" / "incoming").iterdir())
    result = runner.invoke(_cli(), ["submit", str(tmp_path / "missing.png")])
    assert result.exit_code == 2 and "neither a file nor a folder" in result.output


# --- retention -------------------------------------------------------------------------------------------------
def test_retention_purges_old_finished_documents_and_only_blobs_no_one_else_uses(tmp_path):
    import io

    from PIL import Image, PngImagePlugin
    from sqlalchemy import func, select

    from pipeline.context import Pipeline
    from pipeline.ingest import ingest_file
    from pipeline.models import Document, Job, Page, Result, utcnow
    from pipeline.retention import purge_older_than

    p = Pipeline(Settings(data_dir=tmp_path / "data"))
    image = Image.open(io.BytesIO(png(seed=11)))
    tagged = io.BytesIO()
    info = PngImagePlugin.PngInfo()
    info.add_text("scanner", "another file, the same pixels")
    image.save(tagged, "PNG", pnginfo=info)
    old = ingest_file(p, png(seed=11), name="old.png")  # purged
    twin = ingest_file(p, tagged.getvalue(), name="twin.png")  # recent, renders to the same page blob as old.png
    busy = ingest_file(p, png(seed=12), name="busy.png")  # old, but its job is still queued: kept
    with p.db.session() as s:
        for doc_id in (old.document_id, busy.document_id):
            s.get(Document, doc_id).created_at = utcnow() - timedelta(days=40)
        s.get(Job, old.job_id).state = "succeeded"
        s.add(Result(job_id=old.job_id, document_id=old.document_id, unit="document", ok=True, data={},
                     schema_name="generic", schema_version=1))
        old_sha = s.get(Document, old.document_id).sha256
        [page_blob] = s.scalars(select(Page.image_blob).where(Page.document_id == old.document_id))
        [twin_blob] = s.scalars(select(Page.image_blob).where(Page.document_id == twin.document_id))
    assert page_blob == twin_blob  # the shared-blob case is really exercised

    report = purge_older_than(p, 30)
    assert report.documents == 1 and report.blobs == 1  # the original file only; the page blob is shared
    assert not p.blobs.exists(old_sha) and p.blobs.exists(page_blob)
    with p.db.read_session() as s:
        names = sorted(s.scalars(select(Document.original_name)))
        assert names == ["busy.png", "twin.png"]
        assert s.scalar(select(func.count()).select_from(Result)) == 0  # cascaded with its job
    assert purge_older_than(p, 30).documents == 0  # idempotent
    with pytest.raises(ValueError, match="at least 1 day"):
        purge_older_than(p, 0)
    p.close()


def test_a_gpu_worker_whose_engine_cannot_be_built_exits_before_taking_jobs(redis_url, tmp_path):
    import os
    import subprocess
    import sys

    from workers_harness import REPO

    from workers.runtime import EXIT_CANNOT_START

    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCPIPE_")}
    env.update(PYTHONPATH=str(REPO), DOCPIPE_DATA_DIR=str(tmp_path / "data"), DOCPIPE_BROKER_URL=redis_url,
               DOCPIPE_MODEL_DIR=str(tmp_path / "no-such-model"))
    done = subprocess.run([sys.executable, "-m", "workers", "worker", "--queues", "gpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_CANNOT_START, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cannot start" in done.stderr and "no-such-model" in done.stderr


# --- heartbeats: jobs of a worker on a dead machine are taken over before their lease ends ------------------------
def test_heartbeat_registers_refreshes_and_leaves_on_a_clean_stop(client):
    from workers.liveness import WORKERS_KEY, Heartbeat, alive_key, dead_owners

    beat = Heartbeat(client, interval_s=0.1, owner="hostA:1").start()
    time.sleep(0.15)
    assert client.exists(alive_key("hostA:1")) and client.sismember(WORKERS_KEY, "hostA:1")
    assert 0 < client.pttl(alive_key("hostA:1")) <= 300
    assert dead_owners(client, {"hostA:1"}) == set()
    beat.stop()
    assert not client.exists(alive_key("hostA:1")) and not client.sismember(WORKERS_KEY, "hostA:1")


def test_reconciler_takes_over_jobs_of_dead_workers_only_and_the_task_honours_it(redis_url, client, tmp_path):
    from pipeline.ingest import ingest_file
    from pipeline.models import Job, utcnow
    from workers import tasks
    from workers.liveness import WORKERS_KEY, alive_key, beat_once
    from workers.reconciler import reconcile
    from workers.runtime import configure_process

    p = _pipeline(tmp_path, redis_url)
    ws = WorkerSettings()
    configure_process(pipeline=p, worker_settings=ws)
    dead_machine, live_machine, cli_run = (ingest_file(p, png(seed=20 + i), name=f"{i}.png", schema="flag").job_id
                                           for i in range(3))
    owners = {dead_machine: "gone-host:77", live_machine: "busy-host:78", cli_run: "laptop:79"}
    with p.db.session() as s:
        for job_id, owner in owners.items():
            job = s.get(Job, job_id)
            job.state, job.owner, job.attempts = "running", owner, 1
            job.lease_until = utcnow() + timedelta(minutes=10)  # leases far from over
    beat_once(client, "gone-host:77", ttl_s=0.05)  # a registered worker whose heartbeat then expired
    beat_once(client, "busy-host:78", ttl_s=60)  # alive
    beat_once(client, "old-host:1", ttl_s=0.05)  # dead and holding nothing: forgotten
    time.sleep(0.1)  # laptop:79 never registered (an in-process run): left to its lease

    report = reconcile(p, ws, client)
    assert report.jobs_sent == [dead_machine] and report.takeovers == {dead_machine: "gone-host:77"}
    assert client.smembers(WORKERS_KEY) == {b"gone-host:77", b"busy-host:78"}

    # The message's task runs the job, taking it over (the owner is still dead); it succeeds on this machine.
    assert tasks.extract(dead_machine, takeover_from="gone-host:77")["state"] == "succeeded"
    # A takeover message naming a live owner does not steal the job.
    out = tasks.extract(live_machine, takeover_from="busy-host:78")
    assert out["ran"] is False and out["state"] == "running"
    assert not client.exists(alive_key("laptop:79"))
    with p.db.read_session() as s:
        # The dead machine's run is refunded (what else ran there is unknown) and its job ran alone here.
        taken = s.get(Job, dead_machine)
        assert (taken.attempts, taken.runs, taken.isolated) == (1, 1, True)
        assert s.get(Job, live_machine).attempts == 1
    p.close()
