"""Stuck tasks are stopped by their time limits, retried up to the attempt cap, then failed with the reason, and
nothing else is lost (issue #19 item 2) — with real worker processes, real Redis, and a task that really hangs
(test-only faults loaded into the workers from tests/workers/hooks, see its sitecustomize.py).

* GPU task, soft limit (workers.gpu_watch): the engine loses one job's requests (never scheduled, never timed
  out); the watchdog aborts them, the run raises, the job is retried and ends `failed` with the reason; the
  worker and the other jobs go on.
* GPU task, hard limit: the run blocks in C code where no exception reaches it; the watchdog releases the job and
  the process exits; the supervisor (`--gpus 0`) starts a fresh one; the job ends `failed` with the reason and
  the other jobs succeed with no attempt charged.
* Ingest task, Celery's soft limit on a prefork worker: the render hangs outside the render budget's reach (the
  budget is larger than the hang's start); each render is counted, and the document ends `failed` with the
  soft limit named, while another upload renders.
* Ingest task, Celery's hard limit: the hang ignores the soft limit's signal; the child is killed each time, the
  reconciler sends the job again, and the render cap ends it with the hard limit named.
"""
from __future__ import annotations

import random
from pathlib import Path

from sqlalchemy import select
from workers_harness import REPO, note_schema, png

HOOKS = Path(__file__).parent / "hooks"
STUCK_PROMPT = "STUCK-REQUEST. Extract the note from the image."


def _faulty(fault: str) -> dict[str, str]:
    return {"WORKERS_TEST_STUCK": fault, "PYTHONPATH": f"{HOOKS}:{REPO}"}


def _job(cluster, job_id: int):
    from pipeline.models import Job

    with cluster.pipeline.db.read_session() as s:
        return s.execute(select(Job.state, Job.attempts, Job.error).where(Job.id == job_id)).one()


def _document(cluster, job_id: int):
    from pipeline.models import Document, Job

    with cluster.pipeline.db.read_session() as s:
        return s.execute(select(Document.status, Document.render_attempts, Document.error, Job.state, Job.error)
                         .join(Job, Job.document_id == Document.id).where(Job.id == job_id)).one()


def _gpu_jobs(cluster, healthy_count: int) -> tuple[list[int], int]:
    from pipeline.schemas import register_schema

    cluster.register_schema("note", note_schema(60))
    with cluster.pipeline.db.session() as s:
        register_schema(s, "stuck", note_schema(20), prompt=STUCK_PROMPT)
    seeds = random.sample(range(10**6), healthy_count + 1)
    healthy = [cluster.ingest(png(size=20, seed=seeds[i]), f"ok{i}.png", "note", enqueue=False)
               for i in range(healthy_count)]
    stuck = cluster.ingest(png(size=21, seed=seeds[-1]), "stuck.png", "stuck", enqueue=False)
    for job_id in [healthy[0], stuck, *healthy[1:]]:
        cluster.enqueue(job_id)
    return healthy, stuck


def test_a_gpu_run_the_engine_never_answers_is_stopped_by_its_soft_limit(redis_url, make_cluster):
    cluster = make_cluster(redis_url, DOCPIPE_REQUEST_TIMEOUT_S="3", DOCPIPE_GPU_TIME_LIMIT_MARGIN_S="1",
                           DOCPIPE_JOB_MAX_ATTEMPTS="2", **_faulty("engine"))
    healthy, stuck = _gpu_jobs(cluster, 4)
    worker = cluster.start_worker("gpu", "--concurrency", "4")
    cluster.wait_for("the stuck job failed", lambda: _job(cluster, stuck).state == "failed", timeout=150)
    cluster.wait_for("the other jobs succeeded", lambda: all(_job(cluster, j).state == "succeeded" for j in healthy),
                     timeout=90)
    row = _job(cluster, stuck)
    assert row.attempts == 2, row  # retried once, then failed at the cap
    assert row.error.startswith("gave up after 2 attempts; last error: TaskTimeLimitExceeded: soft time limit of "
                                "the GPU task: no progress for 4 s"), row.error
    assert [_job(cluster, j).attempts for j in healthy] == [1] * len(healthy)
    assert worker.alive(), cluster.logs_text()  # the soft limit stops the run, not the worker
    assert "exits:" not in worker.log.read_text()


def test_a_gpu_run_stuck_past_its_soft_limit_restarts_the_worker_at_the_hard_limit(redis_url, make_cluster):
    cluster = make_cluster(redis_url, DOCPIPE_REQUEST_TIMEOUT_S="3", DOCPIPE_GPU_TIME_LIMIT_MARGIN_S="1",
                           DOCPIPE_JOB_MAX_ATTEMPTS="2", DOCPIPE_MAX_TOKENS="160", **_faulty("thread"))
    healthy, stuck = _gpu_jobs(cluster, 5)
    cluster.start_beat()
    cluster.start_worker("ingest", "--concurrency", "1")  # beat's reconciler takes over the runs of a dead worker
    supervisor = cluster.start_worker("gpu", "--gpus", "0", "--concurrency", "4")
    cluster.wait_for("the stuck job failed", lambda: _job(cluster, stuck).state == "failed", timeout=180)
    cluster.wait_for("the other jobs succeeded", lambda: all(_job(cluster, j).state == "succeeded" for j in healthy),
                     timeout=120)
    row = _job(cluster, stuck)
    assert row.attempts == 2, row
    assert row.error.startswith("gave up after 2 attempts; last error: hard time limit of the GPU task: no "
                                "progress for 5 s"), row.error
    assert [_job(cluster, j).attempts for j in healthy] == [1] * len(healthy)  # none paid for the restarts
    # the worker exited once per run of the stuck job (the second exit follows the job's last write)
    cluster.wait_for("the supervisor saw two exits", lambda: supervisor.log.read_text().count("exited with 75") == 2,
                     timeout=30)
    assert supervisor.alive()
    units = cluster.result_units()
    for job_id in healthy:
        assert sorted(units[job_id]) == ["document", "page:0"], (job_id, units[job_id])


def _ingest_cluster(redis_url, make_cluster, fault: str, **extra: str):
    cluster = make_cluster(redis_url, DOCPIPE_DOCUMENT_RENDER_TIMEOUT_S="8", DOCPIPE_PAGE_RENDER_TIMEOUT_S="4",
                           DOCPIPE_INGEST_TIME_LIMIT_MARGIN_S="2",
                           DOCPIPE_JOB_MAX_ATTEMPTS="2", **_faulty(fault), **extra)
    cluster.register_schema("note", note_schema(20))
    stuck = cluster.receive(png(seed=random.randrange(10**6)), "hang.png", "note")
    return cluster, stuck


def test_an_ingest_task_that_hangs_is_stopped_by_celerys_soft_limit(redis_url, make_cluster):
    cluster, stuck = _ingest_cluster(redis_url, make_cluster, "render-soft")
    worker = cluster.start_worker("ingest", "--concurrency", "2")
    other = cluster.receive(png(seed=random.randrange(10**6)), "fine.png", "note")
    cluster.wait_for("the hanging document failed", lambda: _document(cluster, stuck).state == "failed", timeout=90)
    row = _document(cluster, stuck)
    assert (row.status, row.render_attempts) == ("failed", 2), row
    assert row.error.startswith("gave up after 2 attempts to read the file"), row.error
    assert row.error.endswith("last: its render task passed the soft time limit (10 s: the document render budget "
                              "+ DOCPIPE_INGEST_TIME_LIMIT_MARGIN_S)"), row.error
    assert row[4] == row.error  # the job carries the document's reason
    fine = _document(cluster, other)
    assert (fine.status, fine.state) == ("ingested", "queued"), fine  # rendered meanwhile, sent on to gpu
    assert worker.alive()


def test_an_ingest_task_that_ignores_its_soft_limit_is_killed_at_the_hard_limit(redis_url, make_cluster):
    cluster, stuck = _ingest_cluster(redis_url, make_cluster, "render-hard")
    cluster.start_beat()  # the reconciler sends the job again after each kill
    worker = cluster.start_worker("ingest", "--concurrency", "2")
    other = cluster.receive(png(seed=random.randrange(10**6)), "fine.png", "note")
    cluster.wait_for("the hanging document failed", lambda: _document(cluster, stuck).state == "failed",
                     timeout=120)
    row = _document(cluster, stuck)
    assert (row.status, row.render_attempts) == ("failed", 2), row
    assert row.error.endswith("last: its render task was killed at the hard time limit (11 s: the document render "
                              "budget + 1.5 x DOCPIPE_INGEST_TIME_LIMIT_MARGIN_S), or its process died"), row.error
    assert "TimeLimitExceeded" in worker.log.read_text()  # Celery's hard limit, not a crash, killed it
    fine = _document(cluster, other)
    assert (fine.status, fine.state) == ("ingested", "queued"), fine
    assert worker.alive()
