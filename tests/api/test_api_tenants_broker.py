"""Tenants over every route in broker mode (issue #21 item 6, the broker half of test_api_tenants.py): the API server
publishes to Redis and no worker runs, so alpha's document and job stay queued while beta's key is refused on
every route with the 404 an unknown id gets, and an admin key sees both tenants."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from apitest_support import LiveServer, live_server, test_settings
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db
from test_api_http import random_png, upload
from test_api_tenants import assert_hidden_from

ALPHA = "alpha-key-" + uuid.uuid4().hex
BETA = "beta-key-" + uuid.uuid4().hex
ADMIN = "admin-key-" + uuid.uuid4().hex
MEMO = {"type": "object", "properties": {"subject": {"type": ["string", "null"]}}, "required": ["subject"]}


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    db, client = _claim_redis_db()
    settings = test_settings(tmp_path_factory.mktemp("api-tenants-broker"),
                             broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}",
                             api_keys=[f"alpha:{ALPHA}", f"beta:{BETA}", f"*:{ADMIN}"])
    try:
        with live_server(settings) as live:
            yield live
    finally:
        client.flushdb()


def test_another_tenants_queued_rows_are_not_found_on_every_route(broker: LiveServer) -> None:
    with broker.client(key=ALPHA) as a, broker.client(key=BETA) as b, broker.client(key=ADMIN) as admin:
        png = random_png()
        up = upload(a, png, "alpha.png")
        assert up.status_code == 202, up.text
        doc_id, job_id = up.json()["document"]["id"], up.json()["job"]["id"]
        assert up.json()["job"]["state"] == "queued"
        batch = a.post("/v1/batches", files=[("files", ("b1.png", random_png()))])
        assert batch.status_code == 202, batch.text
        batch_id = batch.json()["id"]
        assert a.post("/v1/schemas", json={"name": "memo", "json_schema": MEMO}).status_code == 201

        assert_hidden_from(b, doc_id, job_id, batch_id, schema="memo")

        # The owner and the admin see the queued rows; the same bytes are beta's own document.
        assert a.get(f"/v1/documents/{doc_id}").status_code == 200
        assert a.get(f"/v1/jobs/{job_id}").json()["state"] == "queued"
        assert a.get(f"/v1/batches/{batch_id}").status_code == 200
        mine = upload(b, png, "beta.png")
        assert mine.status_code == 202 and mine.json()["duplicate"] is False, mine.text
        seen = {d["id"] for d in admin.get("/v1/documents", params={"limit": 200}).json()["items"]}
        assert {doc_id, mine.json()["document"]["id"]} <= seen
        assert admin.get(f"/v1/jobs/{job_id}").status_code == 200
        assert admin.get(f"/v1/batches/{batch_id}").status_code == 200
