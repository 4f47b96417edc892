"""The broker crashes three times, each at a different moment of the GPU worker's life, and the worker (never
restarted itself) goes on consuming every time:

1. idle: the worker waits in BRPOP with nothing to do;
2. every slot busy: both tasks finish while Redis is still down, so their acks fail. This one used to stall the
   worker for good: kombu released a prefetch slot only once Redis recorded the ack, so with no slot free it never
   polled again and never noticed the broker was gone or back (workers.broker frees the slot of a failed ack);
3. messages in flight: a burst is published and Redis dies while the worker takes it (the reconciler resends).

Our own redis-server without persistence on a free port, as in test_workers_redis_restart.
"""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from workers_harness import Cluster, Proc, free_port, note_schema, png, require_redis, start_redis_server

SLOTS = 2  # the gpu worker's concurrency = prefetch count (prefetch multiplier 1)


def _crash(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGKILL)
    server.wait(timeout=10)


def _count(proc: Proc, text: str) -> int:
    return proc.log.read_text(errors="replace").count(text)


def _enqueue(cluster: Cluster, prefix: str, n: int) -> list[int]:
    """Ingest first, then publish all at once (a burst)."""
    ids = [cluster.ingest(png(size=20), f"{prefix}{i}.png", "note", enqueue=False) for i in range(n)]
    for job_id in ids:
        cluster.enqueue(job_id)
    return ids


def test_broker_crashes_while_idle_while_every_slot_is_busy_and_with_messages_in_flight(tmp_path: Path,
                                                                                          make_cluster):
    require_redis()
    port = free_port()
    redis_dir = tmp_path / "redis"
    server = start_redis_server(redis_dir, port)
    try:
        cluster = make_cluster(f"redis://127.0.0.1:{port}/0", DOCPIPE_MAX_TOKENS="300",
                               DOCPIPE_ENGINE_MAX_NUM_SEQS=str(SLOTS))
        cluster.register_schema("note", note_schema(480))  # ~0.2 s or more per job
        gpu = cluster.start_worker("gpu")
        ingest = cluster.start_worker("ingest", "--concurrency", "1")
        beat = cluster.start_beat()
        jobs: list[int] = []

        def all_done(what: str) -> None:
            cluster.wait_for(what, lambda: cluster.job_states() == {"succeeded": len(jobs)}, timeout=120)

        # 1. idle
        cluster.wait_for("the gpu worker ready", lambda: _count(gpu, " ready.") > 0, timeout=60)
        _crash(server)
        server = start_redis_server(redis_dir, port)
        jobs += _enqueue(cluster, "idle", SLOTS)
        all_done("the jobs sent after a crash while idle")

        # 2. every slot busy, and both tasks end (acks fail) before Redis is back
        jobs += _enqueue(cluster, "busy", SLOTS)
        cluster.wait_for("every slot busy", lambda: cluster.job_states().get("running", 0) == SLOTS, timeout=60,
                         poll=0.02)
        failed_acks = _count(gpu, "Couldn't ack")
        _crash(server)
        # Without the fix both acks fail here and the worker never polls again. With it, the first failed ack
        # sends the consumer into its reconnect loop, which holds the second ack back until Redis is up.
        cluster.wait_for("both tasks ended, an ack failed",
                         lambda: cluster.job_states().get("running", 0) == 0
                         and _count(gpu, "Couldn't ack") > failed_acks, timeout=60)
        server = start_redis_server(redis_dir, port)
        jobs += _enqueue(cluster, "after", 2 * SLOTS)
        all_done("the jobs sent after the acks failed")

        # 3. messages in flight
        jobs += _enqueue(cluster, "burst", 3 * SLOTS)
        _crash(server)
        server = start_redis_server(redis_dir, port)
        all_done("the burst the crash interrupted")

        assert gpu.alive() and ingest.alive() and beat.alive(), cluster.logs_text()  # reconnected, not restarted
        units = cluster.result_units()
        for job_id in jobs:
            assert sorted(units[job_id]) == ["document", "page:0"], (job_id, units[job_id])
    finally:
        server.kill()
        server.wait(timeout=10)
