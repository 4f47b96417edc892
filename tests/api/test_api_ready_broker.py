"""/readyz in broker mode (issue 19 item 3): it reports a saturated job queue while the queued jobs wait for
ingest workers, and is ready again once they are gone (the probes' latency under load: test_api_hostile_broker).
No worker runs here, so the jobs stay `queued` for as long as the test needs."""
from __future__ import annotations

import random
from pathlib import Path

from apitest_support import live_server, test_settings
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db
from test_api_http import random_png, upload


def test_readyz_reports_a_saturated_queue_in_broker_mode(tmp_path: Path) -> None:
    db, redis_client = _claim_redis_db()
    limit = random.randint(1, 3)
    try:
        settings = test_settings(tmp_path, broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}",
                                 ready_max_queued_jobs=limit)
        with live_server(settings) as live, live.client() as client:
            assert client.get("/readyz").status_code == 200
            jobs = []
            for _ in range(limit + 1):
                up = upload(client, random_png(), "scan.png")
                assert up.status_code == 202, up.text
                jobs.append(up.json()["job"]["id"])
            ready = client.get("/readyz")
            assert ready.status_code == 503, ready.text
            queue = ready.json()["checks"]["queue"]
            assert queue.startswith("saturated: ") and f"DOCPIPE_READY_MAX_QUEUED_JOBS ({limit})" in queue, queue
            assert client.get("/healthz").status_code == 200  # alive, only not taking more work
            for job_id in jobs:  # the queue drains (here: the jobs are deleted with their documents)
                doc_id = client.get(f"/v1/jobs/{job_id}").json()["document_id"]
                assert client.delete(f"/v1/documents/{doc_id}").status_code in (200, 204)
            assert client.get("/readyz").status_code == 200
    finally:
        redis_client.flushdb()
