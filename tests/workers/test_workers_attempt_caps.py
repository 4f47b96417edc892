"""Attempt caps for both stages, counted in the database, and a crash charged only to its cause (issue #21 items
3 and 4), with real Celery workers that are killed.

* A document whose render kills the ingest worker's pool process each time (simulated from outside: the child is
  SIGKILLed once it has spent half a second of CPU, i.e. while it renders) is redelivered after every death
  (`task_reject_on_worker_lost`); it must end `failed` with its reason after `job_max_attempts` renders, not stay
  `queued` for ever.
* A GPU worker killed whenever one poison job runs: the healthy jobs running beside it are retried without losing
  an attempt (each ends `succeeded` with attempts == 1) and the poison job ends `failed` after its cap.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from sqlalchemy import select
from workers_harness import note_schema, png


def _slow_pdf(pages: int) -> bytes:
    import pymupdf

    doc = pymupdf.open()
    for i in range(pages):
        page = doc.new_page()
        page.insert_text((72, 72), f"page {i} " + "lorem ipsum " * 40)
    return doc.tobytes()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used; 0 when it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _document_row(cluster, job_id: int):
    from pipeline.models import Document, Job

    with cluster.pipeline.db.read_session() as s:
        return s.execute(select(Document.status, Document.render_attempts, Document.error, Job.state, Job.error)
                         .join(Job, Job.document_id == Document.id).where(Job.id == job_id)).one()


def test_a_document_that_kills_the_ingest_worker_each_time_ends_failed(redis_url, make_cluster):
    cluster = make_cluster(redis_url, DOCPIPE_JOB_MAX_ATTEMPTS="3", DOCPIPE_PDF_DPI="150")
    cluster.register_schema("note", note_schema(40))
    job_id = cluster.receive(_slow_pdf(400), "poison.pdf", "note")
    worker = cluster.start_worker("ingest", "--concurrency", "1")
    killed: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _document_row(cluster, job_id).state == "queued":
        for child in _children(worker.popen.pid):  # the pool process; rendering 400 pages takes seconds of CPU
            if child not in killed and _cpu_seconds(child) > 0.5:
                os.kill(child, signal.SIGKILL)
                killed.add(child)
        time.sleep(0.02)
    kills = len(killed)
    row = _document_row(cluster, job_id)
    assert row.state == "failed", (row, kills, cluster.logs_text())
    assert row.status == "failed" and row.render_attempts == 3, row
    assert "gave up after 3 attempts to read the file" in row.error and row.error in row[4]
    assert kills == 3, kills  # every render was killed: the cap, not a finished render, ended it
    assert worker.alive()  # the worker itself carries on (its pool replaced the killed process)


def test_a_submitted_file_that_kills_the_ingest_worker_each_time_ends_failed(redis_url, make_cluster):
    """The same through `docpipe submit`'s path (a staged file and its `docpipe.ingest` message): the document
    row is written before the render, so the renders are counted there too; the batch holds the file once."""
    from pipeline.ingest import create_batch
    from pipeline.models import BatchItem, Document, Job
    from workers import staging
    from workers.enqueue import publish_ingest

    cluster = make_cluster(redis_url, DOCPIPE_JOB_MAX_ATTEMPTS="2", DOCPIPE_PDF_DPI="150")
    cluster.register_schema("note", note_schema(40))
    p = cluster.pipeline
    batch_id = create_batch(p, "submit")
    staged = staging.stage(p.settings.data_dir, _slow_pdf(400), name="poison.pdf", schema="note", batch_id=batch_id)
    assert publish_ingest(staged.stage_id, settings=cluster.settings(), worker_settings=cluster.worker_settings())
    worker = cluster.start_worker("ingest", "--concurrency", "1")

    def outcome():
        with p.db.read_session() as s:
            return s.execute(select(Document.status, Document.render_attempts, Job.state, Job.error)
                             .join(Job, Job.document_id == Document.id)).first()

    killed: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (outcome() is None or outcome().state == "queued"):
        for child in _children(worker.popen.pid):
            if child not in killed and _cpu_seconds(child) > 0.5:
                os.kill(child, signal.SIGKILL)
                killed.add(child)
        time.sleep(0.02)
    row = outcome()
    assert row is not None and row.state == "failed", (row, len(killed), cluster.logs_text())
    assert (row.status, row.render_attempts, len(killed)) == ("failed", 2, 2), row
    assert row.error.startswith("gave up after 2 attempts to read the file"), row.error
    cluster.wait_for("the staged copy removed", lambda: staging.pending(p.settings.data_dir, 0) == [], timeout=30)
    with p.db.read_session() as s:
        items = s.execute(select(BatchItem.name, BatchItem.outcome).where(BatchItem.batch_id == batch_id)).all()
    assert [tuple(i) for i in items] == [("poison.pdf", "failed")]


def test_a_gpu_crash_is_charged_only_to_the_job_that_caused_it(redis_url, make_cluster, database_url):
    db = {"DOCPIPE_DATABASE_URL": database_url} if database_url else {}
    cluster = make_cluster(redis_url, DOCPIPE_JOB_MAX_ATTEMPTS="3", DOCPIPE_MAX_TOKENS="160",
                           DOCPIPE_ENGINE_MAX_NUM_SEQS="4", **db)
    cluster.register_schema("note", note_schema(240))  # long answers: jobs overlap with the poison one
    healthy = [cluster.ingest(png(size=20), f"ok{i}.png", "note", enqueue=False) for i in range(6)]
    poison = cluster.ingest(png(size=21), "poison.png", "note", enqueue=False)
    for job_id in [healthy[0], healthy[1], poison, *healthy[2:]]:
        cluster.enqueue(job_id)

    from pipeline.models import Job

    def job(job_id: int):
        with cluster.pipeline.db.read_session() as s:
            return s.execute(select(Job.state, Job.runs, Job.attempts, Job.error).where(Job.id == job_id)).one()

    cluster.start_beat()
    cluster.start_worker("ingest", "--concurrency", "1")  # runs beat's reconciler task
    worker = cluster.start_worker("gpu", "--concurrency", "4")
    killed_runs: set[int] = set()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        row = job(poison)
        if row.state == "failed":
            break
        if row.state == "running" and row.runs not in killed_runs:
            if not killed_runs:  # the first crash must hit healthy runs too: their claims trail the poison's by ms
                cluster.wait_for("a healthy job running beside the poison one",
                                 lambda: any(job(j).state == "running" for j in healthy), timeout=30, poll=0.01)
            cluster.kill(worker, signal.SIGKILL)  # the poison job "crashes" the worker each time it runs
            killed_runs.add(row.runs)
            worker = cluster.start_worker("gpu", "--concurrency", "4")
        time.sleep(0.05)
    cluster.wait_for("every healthy job succeeded", lambda: all(job(j).state == "succeeded" for j in healthy),
                     timeout=120)
    row = job(poison)
    assert row.state == "failed" and row.attempts == 3, row
    assert row.error.startswith("gave up after 3 attempts") and "alone" in row.error, row.error
    assert [job(j).attempts for j in healthy] == [1] * len(healthy)  # none was charged for the poison's crashes
    assert any(job(j).runs > 1 for j in healthy), "no healthy job was running beside the poison one when killed"
    units = cluster.result_units()
    for job_id in healthy:
        assert sorted(units[job_id]) == ["document", "page:0"], (job_id, units[job_id])
