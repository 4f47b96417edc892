"""Deleted or refused content does not stay on disk, in embedded mode (issue #21 item 5; the broker-mode delete
during rendering is tests/workers/test_workers_blobs.py)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from apitest_support import KEY, LiveServer, database_url, live_server, test_settings
from test_api_http import random_png, upload


def _blob_files(live: LiveServer) -> list[Path]:
    root = live.settings.data_dir / "blobs"
    return sorted(f for f in root.rglob("*") if f.is_file() and not f.name.startswith(".")) if root.exists() else []


def _slow_pdf(pages: int) -> bytes:
    import pymupdf

    doc = pymupdf.open()
    for i in range(pages):
        doc.new_page().insert_text((72, 72), f"page {i} " + "lorem ipsum " * 40)
    return doc.tobytes()


def _until(predicate, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def slow_render_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp(f"api-blobs-{request.param}")
    with database_url(request.param, data_dir) as url, \
            live_server(test_settings(data_dir, url, pdf_dpi=100.0)) as live:
        yield live


def test_delete_while_the_document_renders_leaves_no_blob(slow_render_server: LiveServer) -> None:
    live = slow_render_server
    before = _blob_files(live)
    with live.client(KEY) as c:
        up = upload(c, _slow_pdf(300), "deleted.pdf")
        assert up.status_code == 202, up.text
        doc_id = up.json()["document"]["id"]
        _until(lambda: len(_blob_files(live)) > len(before) + 3, "the render to store pages")
        gone = c.delete(f"/v1/documents/{doc_id}")
        assert gone.status_code == 200, gone.text
        _until(lambda: _blob_files(live) == before, "every blob of the deleted document removed")
        assert c.get(f"/v1/documents/{doc_id}").status_code == 404


def test_an_upload_that_fails_after_storing_its_bytes_leaves_no_blob(slow_render_server: LiveServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.ingest

    def broken(*args, **kwargs):
        raise RuntimeError("the database went away mid-upload")

    live = slow_render_server
    before = _blob_files(live)
    monkeypatch.setattr(pipeline.ingest, "_receive_usable_or_new", broken)
    with live.client(KEY) as c:
        r = upload(c, random_png(31, 17), "fails.png")
        assert r.status_code == 500 and r.json()["code"] == "internal_error", r.text
    assert _blob_files(live) == before
