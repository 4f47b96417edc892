"""Crash test: the GPU worker is SIGKILLed three times while jobs run and restarted each time; every document
ends `succeeded` exactly once (no lost job, no duplicate result rows). On SQLite and on PostgreSQL.

What recovers the killed jobs: their messages stay unacknowledged in Redis (acks_late), the jobs stay `running`
with a dead owner in the database, and beat's reconciler sends them again; `run_job` resumes them.
"""
from __future__ import annotations

import signal

from workers_harness import note_schema, png

DOCS = 16


def test_sigkill_the_worker_three_times_every_document_succeeds_exactly_once(redis_url, make_cluster, database_url):
    # Each kill can interrupt the same job again; the cap must exceed the number of kills for this test
    # (the cap itself is checked by the poison test).
    db = {"DOCPIPE_DATABASE_URL": database_url} if database_url else {}
    cluster = make_cluster(redis_url, DOCPIPE_JOB_MAX_ATTEMPTS="6", DOCPIPE_MAX_TOKENS="160",
                           DOCPIPE_ENGINE_MAX_NUM_SEQS="2", **db)
    cluster.register_schema("note", note_schema(240))  # ~100 tokens per job: long enough to be killed mid-run
    job_ids = [cluster.ingest(png(size=20), f"crash{i}.png", "note") for i in range(DOCS)]

    cluster.start_beat()
    cluster.start_worker("ingest", "--concurrency", "1")  # runs beat's reconciler task
    worker = cluster.start_worker("gpu")
    for kill in range(3):
        done_before = cluster.job_states().get("succeeded", 0)
        cluster.wait_for(f"a job running after {done_before} succeeded (kill {kill + 1})",
                         lambda: cluster.job_states().get("running", 0) > 0
                         and cluster.job_states().get("succeeded", 0) > done_before,  # noqa: B023 - waited on here
                         timeout=60, poll=0.05)
        cluster.kill(worker, signal.SIGKILL)
        assert worker.popen.returncode == -signal.SIGKILL
        worker = cluster.start_worker("gpu")

    cluster.wait_for(f"all {DOCS} jobs succeeded", lambda: cluster.job_states() == {"succeeded": DOCS}, timeout=120)
    units = cluster.result_units()
    assert sorted(units) == sorted(job_ids)
    for job_id in job_ids:
        assert sorted(units[job_id]) == ["document", "page:0"], (job_id, units[job_id])  # exactly one result set
    runs = [j.runs for j in cluster.jobs()]
    assert sum(runs) > DOCS, runs  # some runs were really interrupted and taken over
