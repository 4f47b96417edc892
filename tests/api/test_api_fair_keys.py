"""Render fairness per API key on the embedded server (issue 19 item 4): one key's expensive documents do not hold
another key's upload, whether the other key belongs to the same tenant or to another, and the uploading key is
recorded on the document (its id, never the key). pipeline.render_owner is the rule; api.fair_queue the lanes."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import datetime

import hostile_media as hostile
import httpx
import pytest
from apitest_support import LiveServer, live_server, test_settings, wait_finished
from sqlalchemy import select
from test_api_http import random_png, upload

from api.auth import key_id

BUDGET = {"page_render_timeout_s": 1.5, "document_render_timeout_s": 6.0, "max_page_draw_ops": 10**9}
SLOW_DEPTH = 6  # tens of seconds a page here: every slow document spends its whole budget
MARGIN_S = 45.0

KEY_A1 = "alice-one-" + uuid.uuid4().hex  # two keys of tenant alice
KEY_A2 = "alice-two-" + uuid.uuid4().hex
KEY_B = "bob-key-" + uuid.uuid4().hex  # and one of tenant bob


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = test_settings(tmp_path_factory.mktemp("api-fair-keys"),
                             api_keys=[f"alice:{KEY_A1}", f"alice:{KEY_A2}", f"bob:{KEY_B}"], **BUDGET)
    with live_server(settings) as live:
        yield live


def _finished_at(client: httpx.Client, job_id: int) -> datetime:
    return datetime.fromisoformat(client.get(f"/v1/jobs/{job_id}").json()["finished_at"])


def _slow_uploads(client: httpx.Client, first_pages: int) -> list[tuple[int, int]]:
    jobs = []
    for pages in range(first_pages, first_pages + 3):  # three different files, each spends its whole budget
        up = upload(client, hostile.nested_xobject_pdf(pages, SLOW_DEPTH, 10), f"slow-{pages}.pdf")
        assert up.status_code == 202, up.text
        jobs.append((up.json()["document"]["id"], up.json()["job"]["id"]))
    return jobs


@pytest.mark.parametrize("other_key", [KEY_A2, KEY_B], ids=["same-tenant", "other-tenant"])
def test_one_keys_slow_documents_do_not_hold_another_keys_upload(keyed_server: LiveServer, other_key: str) -> None:
    first_pages = 30 if other_key == KEY_A2 else 40  # new files each time (content decides a document)
    with keyed_server.client(KEY_A1) as hog, keyed_server.client(other_key) as other:
        slow = _slow_uploads(hog, first_pages)
        time.sleep(0.3)  # the hog's first document renders; its others wait at the key's render cap
        up = upload(other, random_png(), "scan.png")
        assert up.status_code == 202, up.text
        doc, job = up.json()["document"]["id"], up.json()["job"]["id"]
        assert wait_finished(other, doc)["state"] == "succeeded"
        for doc_id, _ in slow:
            assert wait_finished(hog, doc_id, timeout=4 * BUDGET["document_render_timeout_s"] + MARGIN_S)[
                "state"] == "failed"
        # One lane per tenant would put the same-tenant key behind the hog's documents (one render per lane at a
        # time, two job threads): it would finish after the hog's second. One lane per key: it does not wait.
        assert _finished_at(other, job) < _finished_at(hog, slow[1][1])


def test_the_document_records_which_key_uploaded_it(keyed_server: LiveServer) -> None:
    from pipeline.context import Pipeline
    from pipeline.models import Document

    with keyed_server.client(KEY_A2) as client:
        up = upload(client, random_png(), "mine.png")
        assert up.status_code == 202, up.text
        doc_id = up.json()["document"]["id"]
        wait_finished(client, doc_id)
    p = Pipeline(keyed_server.settings)
    try:
        with p.db.read_session() as s:
            recorded = s.scalar(select(Document.uploaded_by).where(Document.id == doc_id))
    finally:
        p.close()
    assert recorded == key_id(KEY_A2) and KEY_A2 not in recorded  # the key's id, never the key itself
