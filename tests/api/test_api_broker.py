"""With a broker configured the API only enqueues: jobs go to Redis (the `ingest` queue renders, then `gpu`
extracts), nothing runs here."""
from __future__ import annotations

import json
import random
import time
import uuid

import pytest
from apitest_support import database_url, live_server, test_settings
from ci_rule import missing
from test_api_http import listed_document_ids, random_png, upload

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


CLAIM_KEY = "docpipe:test:claim"  # the same claim the workers' tests use, so suites never share a database


def _claim_redis_db():
    """A Redis client on a database number nobody else uses now (skip, or fail on CI, without Redis)."""
    import redis

    try:
        redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        reason = f"Redis at {REDIS_HOST}:{REDIS_PORT} is not reachable: {exc}"
        missing(reason)
    token = uuid.uuid4().hex
    for db in random.sample(range(1, 16), 15):
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db, socket_timeout=5)
        if client.set(CLAIM_KEY, token, nx=True, ex=600):
            if client.dbsize() == 1:
                return db, client
            client.delete(CLAIM_KEY)
    pytest.fail("no free Redis database number (1-15) on 127.0.0.1:6379")


def test_with_a_broker_jobs_are_enqueued_not_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    db, client = _claim_redis_db()
    settings = test_settings(tmp_path_factory.mktemp("api-broker"), broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}")
    try:
        with live_server(settings) as live, live.client() as c:
            ready = c.get("/readyz").json()
            assert ready["checks"]["jobs"] == "ok (broker)"
            up = upload(c, random_png())
            assert up.status_code == 202, up.text
            job_id = up.json()["job"]["id"]
            # Received, not rendered: pages are the ingest queue's work, not the request's.
            assert up.json()["document"]["kind"] == "image" and up.json()["document"]["page_count"] == 0
            time.sleep(1.0)
            assert c.get(f"/v1/jobs/{job_id}").json()["state"] == "queued"  # nobody runs it in this process
            assert c.get(f"/v1/documents/{up.json()['document']['id']}").json()["pages"] == []
            messages = client.lrange("ingest", 0, -1)
            assert len(messages) == 1 and client.llen("gpu") == 0
            headers = json.loads(messages[0])["headers"]
            assert headers["task"] == "docpipe.prepare" and headers["argsrepr"] == f"[{job_id}]"
    finally:
        client.flushdb()  # our claimed database: the message, the markers and the claim itself


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_upload_answers_what_a_later_read_returns(tmp_path_factory: pytest.TempPathFactory, backend: str) -> None:
    """A new upload's answer is built from the rows intake wrote (not read back): it must equal what GET returns
    for the same document and job (with a broker nothing runs the job here, so nothing changes in between)."""
    db, client = _claim_redis_db()
    data_dir = tmp_path_factory.mktemp(f"api-answer-{backend}")
    try:
        with database_url(backend, data_dir) as url:
            settings = test_settings(data_dir, url, broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}")
            with live_server(settings) as live, live.client() as c:
                for schema in (None, "receipt", None):  # the default schema twice: the second from the cache
                    up = upload(c, random_png(), **({"schema": schema} if schema else {}))
                    assert up.status_code == 202, up.text
                    answered = up.json()
                    assert answered["duplicate"] is False
                    doc = c.get(f"/v1/documents/{answered['document']['id']}").json()
                    assert {k: doc[k] for k in answered["document"]} == answered["document"]
                    assert c.get(f"/v1/jobs/{answered['job']['id']}").json() == answered["job"]
                    if schema:
                        assert answered["job"]["schema"] == schema
                data = random_png()
                first = upload(c, data).json()
                second = upload(c, data).json()  # known bytes: the answer is read from the database, as before
                assert second["duplicate"] is True
                assert second["document"] == first["document"] and second["job"] == first["job"]
    finally:
        client.flushdb()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_200_concurrent_uploads_lose_nothing(tmp_path_factory: pytest.TempPathFactory, backend: str) -> None:
    """200 distinct files from 32 clients at once over loopback: 200 answers 202, 200 documents, 200 jobs queued on
    the broker (bench/api_upload_latency.py times the same thing)."""
    import asyncio

    import httpx
    from apitest_support import KEY

    db, client = _claim_redis_db()
    data_dir = tmp_path_factory.mktemp(f"api-200-{backend}")
    files = [random_png() for _ in range(200)]
    try:
        with database_url(backend, data_dir) as url:
            settings = test_settings(data_dir, url, broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}")
            with live_server(settings) as live:
                async def send_all() -> list[httpx.Response]:
                    gate = asyncio.Semaphore(32)
                    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
                    async with httpx.AsyncClient(base_url=live.base, headers={"X-API-Key": KEY}, limits=limits,
                                                 timeout=120) as c:
                        async def one(i: int, data: bytes) -> httpx.Response:
                            async with gate:
                                return await c.post("/v1/documents",
                                                    files={"file": (f"u{i}.png", data, "image/png")})
                        return await asyncio.gather(*(one(i, d) for i, d in enumerate(files)))

                answers = asyncio.run(send_all())
                refused = [r.text for r in answers if r.status_code != 202]
                assert not refused, refused[:2]
                doc_ids = {r.json()["document"]["id"] for r in answers}
                job_ids = {r.json()["job"]["id"] for r in answers}
                assert len(doc_ids) == 200 and len(job_ids) == 200
                with live.client() as c:
                    listed = set(listed_document_ids(c))
                assert listed == doc_ids
                queued = {json.loads(json.loads(m)["headers"]["argsrepr"])[0] for m in client.lrange("ingest", 0, -1)}
                assert queued == job_ids and client.llen("ingest") == 200  # every job reached the broker, once
    finally:
        client.flushdb()


def test_readyz_reports_an_unreachable_broker(tmp_path_factory: pytest.TempPathFactory) -> None:
    port = random.randrange(20000, 30000)
    settings = test_settings(tmp_path_factory.mktemp("api-nobroker"), broker_url=f"redis://127.0.0.1:{port}/0")
    with live_server(settings, ready_timeout=0) as live, live.client() as c:
        r = c.get("/readyz")
        assert r.status_code == 503
        assert r.json()["checks"]["jobs"].startswith("broker unreachable")
        assert r.json()["checks"]["database"] == "ok"
