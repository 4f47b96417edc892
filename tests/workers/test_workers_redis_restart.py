"""The broker restarts mid-run and loses every message (our own redis-server without persistence on a free port;
the machine's 6379 instance is never touched): the running worker reconnects by itself and all jobs finish,
the lost ones sent again by the reconciler from the database.
"""
from __future__ import annotations

import signal

from workers_harness import free_port, note_schema, png, require_redis, start_redis_server

DOCS = 24


def test_broker_restart_mid_run_worker_reconnects_and_every_job_finishes(tmp_path, make_cluster):
    require_redis()  # the same prerequisites as the other queue tests (redis-server installed)
    port = free_port()
    server = start_redis_server(tmp_path / "redis", port)
    try:
        cluster = make_cluster(f"redis://127.0.0.1:{port}/0", DOCPIPE_MAX_TOKENS="300",
                               DOCPIPE_ENGINE_MAX_NUM_SEQS="2")
        cluster.register_schema("note", note_schema(480))  # ~0.2 s per job: the restart lands mid-run
        job_ids = [cluster.ingest(png(size=20), f"r{i}.png", "note") for i in range(DOCS)]
        gpu = cluster.start_worker("gpu")
        ingest = cluster.start_worker("ingest", "--concurrency", "1")
        beat = cluster.start_beat()

        cluster.wait_for("a few jobs done", lambda: cluster.job_states().get("succeeded", 0) >= 3, timeout=60,
                         poll=0.05)
        server.send_signal(signal.SIGKILL)  # a crash: queued and unacked messages and the beat lock: gone
        server.wait(timeout=10)
        assert cluster.job_states().get("succeeded", 0) < DOCS, "the broker went down too late to test anything"
        server = start_redis_server(tmp_path / "redis", port)

        cluster.wait_for(f"all {DOCS} jobs succeeded", lambda: cluster.job_states() == {"succeeded": DOCS},
                         timeout=120)
        assert gpu.alive() and ingest.alive() and beat.alive(), cluster.logs_text()  # reconnected, not restarted
        units = cluster.result_units()
        for job_id in job_ids:
            assert sorted(units[job_id]) == ["document", "page:0"], (job_id, units[job_id])
        # The messages waiting at the crash were lost with the broker: the reconciler sent those jobs again.
        assert "reconciler sent again" in ingest.log.read_text(errors="replace"), cluster.logs_text()
    finally:
        server.kill()
        server.wait(timeout=10)
