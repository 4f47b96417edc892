"""Beat + watch folder: a file dropped into a watch folder is processed once, even though beat keeps ticking
(every 0.2 s) while its job runs and the file stays in the folder (watch_action=leave)."""
from __future__ import annotations

import os
import time

import redis
from sqlalchemy import func, select
from workers_harness import note_schema, png


def test_a_dropped_file_is_processed_once_while_beat_ticks_during_its_job(redis_url, make_cluster):
    from pipeline.models import BatchItem, Document
    from workers.watch import seen_key, stats_key

    cluster = make_cluster(redis_url, DOCPIPE_MAX_TOKENS="3600", DOCPIPE_WATCH_ACTION="leave",
                           DOCPIPE_DEFAULT_SCHEMA="note", DOCPIPE_ENGINE_MAX_NUM_SEQS="2",
                           DOCPIPE_WATCH_INTERVAL_S="0.2")
    folder = cluster.root / "watched"
    folder.mkdir()
    cluster.overrides["DOCPIPE_WATCH_FOLDERS"] = str(folder)
    cluster.register_schema("note", note_schema(8000))  # ~3000 tokens: the job outlasts several beat ticks
    client = redis.Redis.from_url(redis_url)
    stats = stats_key(folder.resolve())

    cluster.start_worker("ingest", "--concurrency", "1")
    cluster.start_worker("gpu")
    cluster.start_beat()
    cluster.wait_for("a first scan of the empty folder", lambda: int(client.hget(stats, "scans") or 0) >= 1,
                     timeout=60)

    tmp = folder / ".incoming.png"  # hidden while being written, as a scanner or mailer would do
    tmp.write_bytes(png(size=20))
    os.replace(tmp, folder / "scan.png")

    cluster.wait_for("the job to start", lambda: cluster.job_states().get("running", 0) == 1, timeout=60,
                     poll=0.01)
    ticks_at_start = int(client.hget(stats, "ticks") or 0)
    client.delete(seen_key(folder.resolve()))  # Redis forgets what it saw: the database's dedupe must still hold
    cluster.wait_for("the job to finish", lambda: cluster.job_states() == {"succeeded": 1}, timeout=60, poll=0.01)
    ticks_during = int(client.hget(stats, "ticks") or 0) - ticks_at_start
    assert ticks_during >= 3, f"beat ticked only {ticks_during} times while the job ran"
    time.sleep(0.5)  # and a few more ticks after it finished

    [job] = cluster.jobs()
    assert job.attempts == 1 and job.state == "succeeded"
    assert sorted(cluster.result_units()[job.id]) == ["document", "page:0"]
    with cluster.pipeline.db.read_session() as s:
        assert s.scalar(select(func.count()).select_from(Document)) == 1
        outcomes = sorted(s.scalars(select(BatchItem.outcome)))
    # The first scan ingested it; the scan after the forgotten cache found the same content: a duplicate, no job.
    assert outcomes[0] == "duplicate" and outcomes[-1] == "new" and outcomes.count("new") == 1, outcomes
    assert (folder / "scan.png").exists()  # watch_action=leave
