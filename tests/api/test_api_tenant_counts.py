"""/metrics and /readyz count per tenant (issue 21, the tenants item): a tenant's key sees its tenant's job
counts only, an admin key sees the deployment's, a probe without a key sees no count at all. Broker mode, so the
jobs stay `queued` (nothing runs them here) and the counts are exact."""
from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from apitest_support import LiveServer, live_server, test_settings
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db
from test_api_http import random_png, upload

ALPHA = "alpha-key-" + uuid.uuid4().hex
BETA = "beta-key-" + uuid.uuid4().hex
ADMIN = "admin-key-" + uuid.uuid4().hex
DEPLOYMENT_ONLY = ("docpipe_http_requests_total", "docpipe_embedded_queue_depth")


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, int]]:
    db, client = _claim_redis_db()
    limit = random.randint(4, 7)  # readiness turns 503 above this many queued jobs, whoever queued them
    settings = test_settings(tmp_path_factory.mktemp("api-tenant-counts"), ready_max_queued_jobs=limit,
                             broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}",
                             api_keys=[f"alpha:{ALPHA}", f"beta:{BETA}", f"*:{ADMIN}"])
    try:
        with live_server(settings) as live:
            yield live, limit
    finally:
        client.flushdb()


def _queued_metric(client: httpx.Client) -> tuple[float, float, str]:
    text = client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    return values['docpipe_jobs{state="queued"}'], values["docpipe_queue_depth"], text


def _queue_check(client: httpx.Client) -> tuple[int, str]:
    r = client.get("/readyz")
    return r.status_code, r.json()["checks"]["queue"]


def _upload(client: httpx.Client, n: int) -> None:
    for _ in range(n):
        r = upload(client, random_png(), "scan.png")
        assert r.status_code == 202, r.text


def test_each_key_counts_only_what_it_may_see(broker: tuple[LiveServer, Any]) -> None:
    live, limit = broker
    alpha_n, beta_n = random.sample(range(1, limit // 2 + 1), 2)  # different, together at most `limit`: ready
    with live.client(ALPHA) as alpha, live.client(BETA) as beta, live.client(ADMIN) as admin, \
            live.client(None) as anonymous:
        _upload(alpha, alpha_n)
        _upload(beta, beta_n)
        total = alpha_n + beta_n
        for client, n in ((alpha, alpha_n), (beta, beta_n), (admin, total)):
            queued, depth, text = _queued_metric(client)
            assert (queued, depth) == (n, n), text
        # the deployment's own figures (HTTP traffic, this server's queue) are the admin's only
        assert all(name in _queued_metric(admin)[2] for name in DEPLOYMENT_ONLY)
        assert not [name for name in DEPLOYMENT_ONLY if name in _queued_metric(alpha)[2]]

        assert _queue_check(alpha) == (200, f"ok ({alpha_n} queued for this tenant)")
        assert _queue_check(beta) == (200, f"ok ({beta_n} queued for this tenant)")
        assert _queue_check(admin) == (200, f"ok ({total} queued)")
        assert _queue_check(anonymous) == (200, "ok")

        # Past the limit the deployment is not ready, for everyone; only the admin is told the total.
        more = limit + 1 - total
        _upload(beta, more)
        total, beta_n = total + more, beta_n + more
        deadline = time.monotonic() + 10
        while _queue_check(admin)[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, line = _queue_check(admin)
        assert status == 503 and line.startswith(f"saturated: {total} jobs queued, more than "
                                                 f"DOCPIPE_READY_MAX_QUEUED_JOBS ({limit})"), line
        for client, n in ((alpha, alpha_n), (beta, beta_n)):
            status, line = _queue_check(client)
            assert status == 503 and f", {n} of them this tenant's;" in line, line
            assert f"{total} jobs" not in line, line
        status, line = _queue_check(anonymous)
        assert status == 503 and line.startswith("saturated: more jobs queued than") and "tenant" not in line
