"""Tenants over every route: a key of one tenant cannot list, read, retry or delete another tenant's documents,
jobs, batches or schemas (404, as for ids that do not exist), an admin key sees all, and a tenant's in-flight job
cap holds under parallel uploads (issue #21 items 6 and 8)."""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from apitest_support import LiveServer, database_url, live_server, test_settings
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db
from test_api_http import assert_problem, random_png, upload, wait_finished

ALPHA = "alpha-key-" + uuid.uuid4().hex
BETA = "beta-key-" + uuid.uuid4().hex
ADMIN = "admin-key-" + uuid.uuid4().hex
PLAIN = "plain-key-" + uuid.uuid4().hex  # the pre-tenant form: the default tenant
KEYS = [f"alpha:{ALPHA}", f"beta:{BETA}", f"*:{ADMIN}", PLAIN]
MEMO = {"type": "object", "properties": {"subject": {"type": ["string", "null"]}}, "required": ["subject"]}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def tenants(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp(f"api-tenants-{request.param}")
    with database_url(request.param, data_dir) as url, \
            live_server(test_settings(data_dir, url, api_keys=KEYS)) as live:
        yield live


def _client(live: LiveServer, key: str) -> httpx.Client:
    return live.client(key=key)


def assert_hidden_from(other: httpx.Client, doc_id: int, job_id: int, batch_id: int, *, schema: str) -> None:
    """Every route, read or write, answers another tenant's ids with the 404 an unknown id gets (never 403), its
    lists leave them out, and its schema cannot be used for an upload."""
    assert_problem(other.get(f"/v1/documents/{doc_id}"), 404, "document_not_found")
    assert_problem(other.get(f"/v1/documents/{doc_id}/result"), 404, "document_not_found")
    assert_problem(other.get(f"/v1/documents/{doc_id}/pages/0.png"), 404, "document_not_found")
    assert_problem(other.get(f"/v1/jobs/{job_id}"), 404, "job_not_found")
    assert_problem(other.post(f"/v1/jobs/{job_id}/retry"), 404, "job_not_found")
    assert_problem(other.get(f"/v1/batches/{batch_id}"), 404, "batch_not_found")
    assert_problem(other.get(f"/v1/schemas/{schema}"), 404, "schema_not_found")
    assert_problem(other.delete(f"/v1/documents/{doc_id}"), 404, "document_not_found")
    assert doc_id not in [d["id"] for d in other.get("/v1/documents").json()["items"]]
    names = [s["name"] for s in other.get("/v1/schemas").json()["items"]]
    assert schema not in names and "generic" in names  # built-ins are shared
    assert_problem(upload(other, random_png(), schema=schema), 422, "unknown_schema")


def test_another_tenants_rows_are_not_found_on_every_route(tenants: LiveServer) -> None:
    png = random_png()
    with _client(tenants, ALPHA) as a, _client(tenants, BETA) as b, _client(tenants, ADMIN) as admin:
        up = upload(a, png, "alpha.png")
        assert up.status_code == 202, up.text
        doc_id, job_id = up.json()["document"]["id"], up.json()["job"]["id"]
        assert wait_finished(a, doc_id)["state"] in ("succeeded", "partial")
        batch = a.post("/v1/batches", files=[("files", ("b1.png", random_png()))])
        assert batch.status_code == 202, batch.text
        batch_id = batch.json()["id"]
        assert a.post("/v1/schemas", json={"name": "memo", "json_schema": MEMO}).status_code == 201

        assert_hidden_from(b, doc_id, job_id, batch_id, schema="memo")

        # The owner still has everything; its page image is served.
        assert a.get(f"/v1/documents/{doc_id}").status_code == 200
        assert a.get(f"/v1/documents/{doc_id}/pages/0.png").status_code == 200
        assert a.get(f"/v1/batches/{batch_id}").status_code == 200

        # The same bytes from the other tenant are its own document, not a duplicate of the first.
        mine = upload(b, png, "beta.png")
        assert mine.status_code == 202 and mine.json()["duplicate"] is False
        assert mine.json()["document"]["id"] != doc_id
        # Both tenants may register one name, each with its own versions.
        other_memo = {**MEMO, "properties": {"subject": {"type": ["string", "null"], "maxLength": 40}}}
        registered = b.post("/v1/schemas", json={"name": "memo", "json_schema": other_memo})
        assert registered.status_code == 201 and registered.json()["version"] == 1
        assert a.get("/v1/schemas/memo").json()["json_schema"] == MEMO

        # An admin key sees both tenants' documents and may delete them.
        seen = {d["id"] for d in admin.get("/v1/documents", params={"limit": 200}).json()["items"]}
        assert {doc_id, mine.json()["document"]["id"]} <= seen
        assert admin.get(f"/v1/jobs/{job_id}").status_code == 200
        assert admin.get(f"/v1/batches/{batch_id}").status_code == 200
        wait_finished(b, mine.json()["document"]["id"])
        assert admin.delete(f"/v1/documents/{mine.json()['document']['id']}").status_code == 200
        assert_problem(b.get(f"/v1/documents/{mine.json()['document']['id']}"), 404, "document_not_found")


def test_a_plain_key_is_the_default_tenant(tenants: LiveServer) -> None:
    with _client(tenants, PLAIN) as plain, _client(tenants, ALPHA) as a:
        up = upload(plain, random_png(), "plain.png")
        assert up.status_code == 202, up.text
        doc_id = up.json()["document"]["id"]
        assert doc_id in [d["id"] for d in plain.get("/v1/documents").json()["items"]]
        assert_problem(a.get(f"/v1/documents/{doc_id}"), 404, "document_not_found")
        wait_finished(plain, doc_id)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_parallel_uploads_cannot_pass_the_tenant_job_cap(backend: str, tmp_path_factory: pytest.TempPathFactory
                                                         ) -> None:
    """32 clients upload new files at once against a cap of 8. With a broker and no worker nothing finishes, so
    exactly 8 jobs may be queued; the others get 429 too_many_jobs and leave no document behind. Another
    tenant's cap is its own."""
    db, redis_db = _claim_redis_db()
    cap, clients = 8, 32
    from api.limits import ApiLimits

    limits = ApiLimits(rate_per_minute=1_000_000, burst=100_000, max_inflight_jobs=cap,
                       max_upload_bytes=2 * 1024 * 1024)
    data_dir = tmp_path_factory.mktemp(f"api-cap-{backend}")
    try:
        with database_url(backend, data_dir) as url, live_server(test_settings(
                data_dir, url, api_keys=KEYS, broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"),
                limits=limits) as live:
            files = [random_png(24 + i, 24) for i in range(clients)]

            def send(data: bytes) -> int:
                with _client(live, ALPHA) as c:
                    return upload(c, data, "cap.png").status_code

            with ThreadPoolExecutor(clients) as pool:
                codes = list(pool.map(send, files))
            assert codes.count(202) == cap and codes.count(429) == clients - cap, codes
            with _client(live, ALPHA) as a, _client(live, BETA) as b:
                docs = a.get("/v1/documents", params={"limit": 200}).json()["items"]
                assert len(docs) == cap and all(d["jobs"][0]["state"] == "queued" for d in docs)
                assert upload(b, random_png(5, 5), "beta.png").status_code == 202  # beta's cap is untouched
            blobs = [f for f in (data_dir / "blobs").rglob("*") if f.is_file()]
            assert len(blobs) == cap + 1, "a refused upload left its blob behind"
    finally:
        redis_db.flushdb()
