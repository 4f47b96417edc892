"""A password upload (issue 21 item 2), in broker mode and in embedded mode, which take the same path: the PDF is
rendered during the request (the password is used once and never stored or queued), so the request's render must
neither stall the server nor run unbounded. It renders on a worker thread, in vision's isolated render process
under the render budgets of issue 19 (pipeline/rendering.py -> vision.open_isolated): the probes answer within a
second throughout, a page that would draw for minutes is stopped at the page budget, a document of such pages at
the document budget, a page whose nested forms count too many drawing operations is refused before it is drawn
(the count reads the decrypted streams), and each ends the upload with its budget's reason.

Why the slow upload once passed on a quiet machine: its 3 pages were each stopped at the 1.5 s page budget, which
left the 6 s document budget unspent, and a document whose every page failed was `ingested` with 3 failed pages
(202). A document without any rendered page now fails with its first page's reason (pipeline.rendering), so the
answer is a 422 naming a render budget whichever budget stops it on the machine at hand."""
from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hostile_media as hostile
import pymupdf
import pytest
from apitest_support import KEY, LiveServer, live_server, test_settings, wait_finished
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db
from test_api_hostile import BUDGET, MARGIN_S, SLOW_DEPTH, Probes
from test_api_http import upload

# Depth 6 (7.4e6 operations a page) passes this count and is drawn until the time budget stops it; depth 7
# (7.4e7) is refused by it before any drawing.
DRAW_OPS = {**BUDGET, "max_page_draw_ops": 10**7}
REFUSED_DEPTH = 7


def encrypted(pdf: bytes, password: str) -> bytes:
    doc = pymupdf.open(stream=pdf, filetype="pdf")
    try:
        return doc.tobytes(encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw=password, owner_pw=password + "-owner")
    finally:
        doc.close()


@pytest.fixture(scope="module", params=["broker", "embedded"])
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[LiveServer, Any]]:
    """A server in broker mode (the issue's setting) with the Redis client of its database, or embedded (None)."""
    if request.param == "embedded":
        with live_server(test_settings(tmp_path_factory.mktemp("api-password-embedded"), **DRAW_OPS)) as live:
            yield live, None
        return
    db, client = _claim_redis_db()
    settings = test_settings(tmp_path_factory.mktemp("api-password"),
                             broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}", **DRAW_OPS)
    try:
        with live_server(settings) as live:
            yield live, client
    finally:
        client.flushdb()


def _refused(r: Any, budget: str) -> str:
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "unreadable_file" and budget in body["detail"], body
    return str(body["error_type"])


def test_a_password_upload_renders_bounded_and_off_the_event_loop(broker: tuple[LiveServer, Any]) -> None:
    live, _ = broker
    password = secrets.token_urlsafe(12)
    limit = BUDGET["document_render_timeout_s"] + MARGIN_S
    with Probes(live.base) as probes, live.client(KEY, timeout=limit) as c:
        # Three pages the page budget stops (or, on a loaded machine, the document budget first)
        started = time.monotonic()
        three = upload(c, encrypted(hostile.nested_xobject_pdf(3, SLOW_DEPTH, 10), password), "locked.pdf",
                       password=password)
        assert time.monotonic() - started < limit
        assert _refused(three, "render_timeout_s") == "RenderTimeoutError"
        # Twenty such pages cannot all be tried within the document budget: it is what ends this one
        started = time.monotonic()
        twenty = upload(c, encrypted(hostile.nested_xobject_pdf(20, SLOW_DEPTH, 10), password), "long.pdf",
                        password=password)
        assert time.monotonic() - started < limit
        assert _refused(twenty, "document_render_timeout_s") == "RenderTimeoutError"
        fine = upload(c, encrypted(hostile.nested_xobject_pdf(1, 1, 2), password), "fine.pdf", password=password)
        # rendered in the request (a received document counts 0 pages until its job renders it)
        assert fine.status_code == 202 and fine.json()["document"]["page_count"] == 1, fine.text
    probes.assert_answered_in_time()


def test_the_drawing_count_refuses_an_encrypted_page_before_drawing_it(broker: tuple[LiveServer, Any]) -> None:
    live, _ = broker
    password = secrets.token_urlsafe(12)
    with live.client(KEY, timeout=BUDGET["document_render_timeout_s"] + MARGIN_S) as c:
        r = upload(c, encrypted(hostile.nested_xobject_pdf(2, REFUSED_DEPTH, 10), password), "forms.pdf",
                   password=password)
    # Counted from the decrypted streams (74,444,441 operations, as for the plain copy); a count of the
    # still-encrypted bytes would find none and the page would be drawn until the time budget stopped it.
    assert _refused(r, "max_page_draw_ops") == "LimitExceededError"
    assert "74,444,441 operations" in r.json()["detail"]


def _redis_texts(client: Any) -> Iterator[bytes]:
    """Every value in the claimed Redis database, Celery message bodies base64-decoded."""
    for key in client.scan_iter():
        kind = client.type(key)
        if kind == b"string":
            values = [client.get(key)]
        elif kind == b"list":
            values = client.lrange(key, 0, -1)
        elif kind == b"hash":
            values = [k + b"=" + v for k, v in client.hgetall(key).items()]
        elif kind == b"set":
            values = list(client.smembers(key))
        elif kind == b"zset":
            values = client.zrange(key, 0, -1)
        else:
            values = []
        for value in values:
            yield key + b" " + value
            try:
                body = json.loads(value).get("body")
            except (ValueError, AttributeError):
                continue
            if isinstance(body, str):
                yield base64.b64decode(body + "==")


def test_the_password_is_neither_stored_nor_queued(broker: tuple[LiveServer, Any]) -> None:
    live, client = broker
    password = secrets.token_urlsafe(12)
    with live.client(KEY) as c:
        pages = [f"page {i} {secrets.token_hex(4)}" for i in range(2)]
        doc = pymupdf.open()
        for text in pages:
            doc.new_page().insert_text((72, 72), text)
        r = upload(c, doc.tobytes(encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw=password, owner_pw=password),
                   "secret.pdf", password=password)
        assert r.status_code == 202 and r.json()["document"]["page_count"] == 2, r.text
        if client is None:  # embedded: the job runs here; wait for it, so its rows are written too
            assert wait_finished(c, r.json()["document"]["id"])["state"] in ("succeeded", "partial")
        else:
            deadline = time.monotonic() + 30  # published by a thread after the answer
            while client.llen("gpu") + client.llen("ingest") == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.llen("gpu") + client.llen("ingest") >= 1, client.keys()
    secret = password.encode()
    if client is not None:
        queued = list(_redis_texts(client))
        job_id = r.json()["job"]["id"]
        assert any(t.startswith(b"[[%d]" % job_id) for t in queued), queued  # the scan reads the messages' bodies
        assert not [t[:200] for t in queued if secret in t]
    data_dir = Path(live.settings.data_dir)
    files = [f for f in data_dir.rglob("*") if f.is_file()]
    assert any(f.suffix in (".db", ".sqlite", ".sqlite3") or "wal" in f.name for f in files), files
    assert not [str(f) for f in files if secret in f.read_bytes()]
