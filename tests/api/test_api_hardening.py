"""Smaller hardening of issue 21 item 10, over real HTTP: JSON answers are `nosniff` / `no-store`, and with the
broker down an upload answers without waiting on it (the database row is the record; the reconciler sends it)."""
from __future__ import annotations

import threading

import pytest
from apitest_support import free_port, live_server, test_settings
from test_api_http import random_png, upload


def test_json_answers_carry_nosniff_and_no_store(tmp_path) -> None:
    with live_server(test_settings(tmp_path)) as live, live.client() as c:
        for response in (c.get("/v1/schemas"), c.get("/v1/documents/999999"), c.get("/healthz"),
                         live.client(key=None).get("/v1/schemas")):  # an answer, a 404, health, a refused key
            assert response.headers["x-content-type-options"] == "nosniff", response.url
            assert response.headers["cache-control"] == "no-store", response.url
        page = c.get("/")  # the web UI's HTML keeps nosniff, and is not JSON
        assert page.headers["x-content-type-options"] == "nosniff"


def test_an_upload_does_not_wait_for_an_unreachable_broker(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publish blocks (as one does for ~2 s per upload while Redis is down) until the upload has answered:
    before, the upload's own thread published, so it could not answer until the publish gave up."""
    import workers.dispatch

    answered = threading.Event()
    published_after_answer: list[bool] = []

    def stuck_publish(job_id: int, **_: object) -> bool:
        published_after_answer.append(answered.wait(30))
        return False  # the broker stayed down

    monkeypatch.setattr(workers.dispatch, "enqueue_prepare", stuck_publish)
    settings = test_settings(tmp_path, broker_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with live_server(settings, ready_timeout=0) as live, live.client(timeout=20) as c:
        up = upload(c, random_png())
        answered.set()
        assert up.status_code == 202, up.text
        job = c.get(f"/v1/jobs/{up.json()['job']['id']}").json()
        assert job["state"] == "queued"  # the row waits for the reconciler
    assert published_after_answer == [True]
