"""Attempt caps and crash charging in the pipeline itself, the embedded path (issue #21 items 3 and 4; the same
rules with killed Celery workers are in tests/workers/test_workers_attempt_caps.py)."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Any

from pipeline_test_support import png_bytes

from pipeline.attempts import RunGate
from pipeline.ingest import ingest_file, receive_file
from pipeline.jobs import run_job
from pipeline.models import Document, Job


def _dead_owner() -> str:
    """host:pid of a process of this host that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return f"{socket.gethostname()}:{child.pid}"


def _died(p: Any, job_id: int, *, attempts: int, isolated: bool) -> None:
    """Leave the job as a run that died would: `running` under a process that is gone."""
    with p.db.session() as s:
        job = s.get(Job, job_id)
        job.state, job.owner, job.attempts, job.runs, job.isolated = "running", _dead_owner(), attempts, attempts, \
            isolated


def _job(p: Any, job_id: int) -> Job:
    with p.db.read_session() as s:
        return s.get(Job, job_id)


def _until(predicate: Any, what: str) -> None:
    for _ in range(2000):
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def test_a_run_that_died_among_others_is_refunded_and_runs_alone(make_pipeline: Any, engine_client: Any) -> None:
    p = make_pipeline(client=engine_client, job_max_attempts=2)
    job_id = ingest_file(p, png_bytes(), name="neighbour.png").job_id
    _died(p, job_id, attempts=1, isolated=False)
    assert run_job(p, job_id).state == "succeeded"
    job = _job(p, job_id)
    assert (job.attempts, job.runs, job.isolated) == (1, 2, True)  # the dead run's attempt was given back


def test_a_run_that_died_alone_is_charged_until_the_cap(make_pipeline: Any, engine_client: Any) -> None:
    p = make_pipeline(client=engine_client, job_max_attempts=2)
    job_id = ingest_file(p, png_bytes(), name="poison.png").job_id
    _died(p, job_id, attempts=2, isolated=True)
    run = run_job(p, job_id)
    job = _job(p, job_id)
    assert run.state == job.state == "failed" and not run.ran
    assert job.error == ("gave up after 2 attempts; last error: the worker process stopped while running this job "
                         "alone"), job.error


def test_renders_are_capped_per_document(make_pipeline: Any, engine_client: Any) -> None:
    p = make_pipeline(client=engine_client, job_max_attempts=3)
    out = receive_file(p, png_bytes(), name="crashes-the-reader.png")
    with p.db.session() as s:  # three renders started and never finished (their process died each time)
        s.get(Document, out.document_id).render_attempts = 3
    assert run_job(p, out.job_id).state == "failed"
    job = _job(p, out.job_id)
    assert job.error.startswith("gave up after 3 attempts to read the file"), job.error
    with p.db.read_session() as s:
        doc = s.get(Document, out.document_id)
        assert (doc.status, doc.error_type) == ("failed", "RenderAttemptsExceeded")


def test_the_run_gate_lets_one_run_alone_after_the_running_ones_and_before_later_ones() -> None:
    gate = RunGate()
    order: list[str] = []
    release_first = threading.Event()

    def shared(name: str, hold: threading.Event | None = None) -> None:
        with gate.shared():
            order.append(name)
            if hold is not None:
                hold.wait(10)

    def alone() -> None:
        with gate.alone():
            order.append("alone")

    first = threading.Thread(target=shared, args=("first", release_first))
    first.start()
    _until(lambda: order == ["first"], "the first shared run started")
    lone = threading.Thread(target=alone)
    lone.start()
    _until(lambda: gate._waiting_alone == 1, "the lone run waits")
    later = threading.Thread(target=shared, args=("later",))
    later.start()
    release_first.set()
    for t in (first, lone, later):
        t.join(10)
    assert order == ["first", "alone", "later"]


def test_a_duplicate_delivery_of_a_job_running_here_does_not_wait_to_be_alone(make_pipeline: Any,
                                                                             engine_client: Any) -> None:
    """A job running healthily (live owner, lease ahead) needs no gate: a second delivery declines at once instead
    of waiting until every run of the process has finished (and holding up the runs behind it)."""
    from datetime import timedelta

    from pipeline.attempts import RUN_GATE
    from pipeline.leases import this_owner
    from pipeline.models import utcnow

    p = make_pipeline(client=engine_client)
    job_id = ingest_file(p, png_bytes(), name="busy.png").job_id
    with p.db.session() as s:
        job = s.get(Job, job_id)
        job.state, job.owner, job.runs, job.attempts = "running", this_owner(), 1, 1
        job.lease_until = utcnow() + timedelta(minutes=10)
    answers: list[Any] = []
    with RUN_GATE.shared():  # another job of this process is running
        second = threading.Thread(target=lambda: answers.append(run_job(p, job_id)))
        second.start()
        second.join(20)
        assert not second.is_alive(), "the duplicate delivery waited for the running jobs to finish"
    assert not answers[0].ran and answers[0].note.startswith("running in ")
