"""The hostile corpus and the slow PDF through the API in broker mode: real Redis, real `ingest` and `gpu` Celery
workers (subprocesses), the same budgets as the embedded test. The probes answer within a second throughout,
every file ends with a reason, and the ingest worker renders within the budget (it is free again for a normal
upload afterwards)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import hostile_media as hostile
import pytest
from apitest_support import (
    FAST,
    KEY,
    REPO,
    LiveServer,
    live_server,
    test_settings,
    wait_finished,
)
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db
from test_api_hostile import (
    BUDGET,
    MARGIN_S,
    SLOW_DEPTH,
    Probes,
    assert_corpus_outcomes,
    upload_corpus,
)
from test_api_http import random_png, upload

# Queue timings of the workers' own tests: short leases and quick retries, so nothing waits for long.
QUEUE_ENV = {"DOCPIPE_JOB_LEASE_S": "20", "DOCPIPE_REQUEST_TIMEOUT_S": "15", "DOCPIPE_VISIBILITY_TIMEOUT_S": "120",
             "DOCPIPE_RETRY_BACKOFF_S": "0.2", "DOCPIPE_RETRY_BACKOFF_MAX_S": "1"}


def _worker_env(data_dir: Path, broker_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCPIPE_")}
    env.update({f"DOCPIPE_{k.upper()}": str(v) for k, v in {**FAST, **BUDGET}.items()})
    env.update(QUEUE_ENV, DOCPIPE_DATA_DIR=str(data_dir), DOCPIPE_BROKER_URL=broker_url, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p))
    return env


@pytest.fixture(scope="module")
def broker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    db, client = _claim_redis_db()
    broker_url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"
    root = tmp_path_factory.mktemp("api-hostile-broker")
    data_dir = root / "data"
    env = _worker_env(data_dir, broker_url)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        settings = test_settings(data_dir, broker_url=broker_url, **BUDGET)
        with live_server(settings) as live:  # migrates the database before the workers open it
            for queue in ("ingest", "gpu"):
                with open(root / f"worker-{queue}.log", "wb") as log:  # the worker keeps its own copy
                    workers.append(subprocess.Popen(
                        [sys.executable, "-m", "workers", "worker", "--queues", queue, "--concurrency", "2"],
                        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            yield live
    finally:
        for proc in workers:  # the worker and its pool children: each was started in a session of its own
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in workers:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        client.flushdb()


def test_broker_mode_slow_pdf_and_hostile_corpus_end_with_reasons(broker_server: LiveServer) -> None:
    with Probes(broker_server.base) as probes, broker_server.client(KEY) as client:
        slow = upload(client, hostile.nested_xobject_pdf(20, SLOW_DEPTH, 10), "laughs.pdf")
        assert slow.status_code == 202, slow.text
        # The workers start while this waits (engine load on the gpu worker): the margin covers it.
        slow_result = wait_finished(client, slow.json()["document"]["id"],
                                    timeout=BUDGET["document_render_timeout_s"] + 3 * MARGIN_S)
        outcomes = upload_corpus(broker_server, timeout=BUDGET["document_render_timeout_s"] + 4 * MARGIN_S)
        normal = upload(client, random_png(), "after.png")  # the ingest worker is free again
        assert normal.status_code == 202, normal.text
        normal_result = wait_finished(client, normal.json()["document"]["id"], timeout=MARGIN_S)
    probes.assert_answered_in_time()
    assert slow_result["state"] == "failed" and "document_render_timeout_s" in slow_result["error"], slow_result
    assert_corpus_outcomes(outcomes)
    assert normal_result["state"] == "succeeded", normal_result
