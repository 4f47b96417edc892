"""api/README promises over real HTTP (a live server on SQLite, the bundled tiny model): a busy document cannot be
deleted, a PDF password is used in the request and stored nowhere, the chat endpoint honours `stop` and
`max_completion_tokens`, constrains `json_object` and refuses `tools` and `n` > 1."""
from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pymupdf as fitz
import pytest
from apitest_support import LiveServer, live_server, test_settings, wait_finished
from test_api_http import assert_problem, random_png, upload

from gpu_engine.params import SamplingParams
from pipeline import models
from pipeline.leases import this_owner
from pipeline.models import utcnow

PASSWORD = "pw-" + "7f3a9c1e5b"  # distinctive, so a stored copy would be found by a byte search


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(test_settings(tmp_path_factory.mktemp("api-promises"))) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[httpx.Client]:
    with live.client() as c:
        yield c


def _set_job(live: LiveServer, job_id: int, **values: object) -> None:
    with live.app.state.ctx.pipeline.db.session() as s:
        job = s.get(models.Job, job_id)
        for name, value in values.items():
            setattr(job, name, value)


def test_delete_answers_409_document_busy_while_a_job_runs(live: LiveServer, client: httpx.Client) -> None:
    answer = upload(client, random_png()).json()
    doc_id, job_id = answer["document"]["id"], answer["job"]["id"]
    wait_finished(client, doc_id)
    # A worker holds the job (running, live owner, lease far off): nothing here takes it over meanwhile.
    _set_job(live, job_id, state="running", owner=this_owner(), lease_until=utcnow() + timedelta(hours=1))
    busy = assert_problem(client.delete(f"/v1/documents/{doc_id}"), 409, "document_busy")
    assert str(doc_id) in busy["detail"]
    assert client.get(f"/v1/documents/{doc_id}").status_code == 200  # nothing was deleted
    _set_job(live, job_id, state="succeeded", owner=None, lease_until=None)
    assert client.delete(f"/v1/documents/{doc_id}").status_code in (200, 204)
    assert client.get(f"/v1/documents/{doc_id}").status_code == 404


def _encrypted_pdf() -> bytes:
    doc = fitz.open()
    doc.new_page(width=200, height=200).insert_text((20, 40), "locked page")
    try:
        return doc.tobytes(encryption=fitz.PDF_ENCRYPT_AES_256, user_pw=PASSWORD, owner_pw=PASSWORD + "-owner")
    finally:
        doc.close()


def test_a_pdf_password_upload_is_rendered_in_the_request_and_never_stored(live: LiveServer,
                                                                            client: httpx.Client) -> None:
    locked = _encrypted_pdf()
    r = upload(client, locked, "locked.pdf", password=PASSWORD)
    assert r.status_code == 202, r.text
    doc = r.json()["document"]
    # rendered during the request: its page is there in the answer, before any job ran
    assert doc["page_count"] == 1 and doc["status"] != "received"
    wait_finished(client, doc["id"])
    # the password is in no file the server wrote: database (and its WAL), blobs, spool
    data_dir = Path(live.settings.data_dir)
    files = [f for f in data_dir.rglob("*") if f.is_file()]
    assert any(f.suffix in (".sqlite", ".db") or "sqlite" in f.name for f in files)
    holding = [str(f) for f in files if PASSWORD.encode() in f.read_bytes()]
    assert holding == [], f"the password was stored in {holding}"


def _chat(client: httpx.Client, live: LiveServer, **body: object) -> httpx.Response:
    model = client.get("/v1/models").json()["data"][0]["id"]
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "invoice total date name page"}], **body})


def test_chat_honours_stop_and_max_completion_tokens(live: LiveServer, client: httpx.Client) -> None:
    engine = live.app.state.ctx.engine.async_engine()
    messages = [{"role": "user", "content": "invoice total date name page"}]
    free = engine.generate(messages, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), timeout=120)
    assert len(free.text) >= 6, free.text
    stop = free.text[3:5]  # a string the greedy answer reaches after a few characters
    r = _chat(client, live, max_completion_tokens=16, temperature=0, stop=stop)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == free.text[: free.text.index(stop)]  # cut before the stop string
    short = _chat(client, live, max_completion_tokens=3, temperature=0).json()
    assert short["usage"]["completion_tokens"] <= 3
    assert short["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_json_object_is_constrained_to_an_object(live: LiveServer, client: httpx.Client) -> None:
    for seed in (1, 2, 3):
        r = _chat(client, live, max_completion_tokens=24, temperature=1.0, seed=seed,
                  response_format={"type": "json_object"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_chat_refuses_tools_and_n_over_http(live: LiveServer, client: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert_problem(_chat(client, live, max_completion_tokens=4, tools=tools), 400, "unsupported_parameter")
    body = assert_problem(_chat(client, live, max_completion_tokens=4, n=2), 422, "invalid_request")
    assert "n" in body["detail"]
