"""Receiving without rendering (`receive_file`), rendering in the job (`run_job`, `render_document`), and the
document/job states on the way: received -> ingested | failed, with the same reasons as a synchronous intake."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pymupdf as fitz
from pipeline_test_support import png_bytes, run_at_once
from sqlalchemy import func, select

from pipeline.context import Pipeline
from pipeline.ingest import ingest_file, receive_file
from pipeline.jobs import fail_job, retry_job, run_job
from pipeline.models import Document, Job, Page
from pipeline.rendering import jobs_awaiting_render, render_document
from pipeline.settings import Settings


def _doc(p: Pipeline, doc_id: int) -> Document:
    with p.db.read_session() as s:
        return s.get(Document, doc_id)  # type: ignore[return-value]  # the row exists


def _job(p: Pipeline, job_id: int) -> Job:
    with p.db.read_session() as s:
        return s.get(Job, job_id)  # type: ignore[return-value]  # the row exists


def _pages(p: Pipeline, doc_id: int) -> int:
    with p.db.read_session() as s:
        return s.scalar(select(func.count()).select_from(Page).where(Page.document_id == doc_id)) or 0


def test_a_received_file_is_rendered_by_its_job(database_url: str, make_pipeline: Any, engine_client: Any) -> None:
    p = make_pipeline(database_url, client=engine_client)
    data = png_bytes(80, 60)
    out = receive_file(p, data, name="scan.png")
    assert (out.outcome, out.rendered, out.known, out.pages) == ("new", False, False, 0)
    doc = _doc(p, out.document_id)
    # Sniffed from the bytes, stored, not rendered: no page rows yet.
    assert (doc.status, doc.kind, doc.media_type, doc.page_count) == ("received", "image", "image/png", 0)
    assert _pages(p, doc.id) == 0 and p.blobs.get_bytes(doc.sha256) == data
    assert _job(p, out.job_id).state == "queued"
    assert jobs_awaiting_render(p, [out.job_id]) == {out.job_id}

    again = receive_file(p, data, name="renamed.png")
    assert (again.outcome, again.known, again.document_id, again.job_id) == ("duplicate", True, doc.id, out.job_id)

    run = run_job(p, out.job_id)
    assert run.state == "succeeded" and run.ran
    doc = _doc(p, out.document_id)
    assert (doc.status, doc.page_count, _pages(p, doc.id)) == ("ingested", 1, 1)
    assert jobs_awaiting_render(p, [out.job_id]) == set()
    assert render_document(p, doc.id) == "ingested" and _pages(p, doc.id) == 1  # rendering again changes nothing


def _bad_files(folder: Path) -> dict[str, bytes]:
    jpg = fitz.open()
    jpg.new_page(width=200, height=200).insert_text((20, 40), "receipt", fontsize=12)
    whole_jpg = jpg[0].get_pixmap().tobytes("jpg")
    locked = fitz.open()
    locked.new_page().insert_text((72, 72), "secret")
    locked_bytes = locked.tobytes(encryption=fitz.PDF_ENCRYPT_AES_256, user_pw="pw", owner_pw="pw")
    return {
        "notes.pdf": b"this is text, not a PDF",
        "empty.pdf": b"",
        "broken.pdf": b"%PDF-1.7\n" + png_bytes(16, 16),
        "truncated.jpg": whole_jpg[: len(whole_jpg) // 3],
        "locked.pdf": locked_bytes,
    }


def _same_reason(p: Pipeline, text: str | None) -> str | None:
    """A decoder may name the stored file's path, which differs between the two data dirs."""
    return text.replace(str(p.settings.data_dir), "<data dir>") if text else text


def test_unreadable_files_fail_with_the_same_reason_as_a_synchronous_intake(make_pipeline: Any,
                                                                            tmp_path: Path) -> None:
    received = make_pipeline()
    synchronous = Pipeline(Settings(data_dir=tmp_path / "other", stable_seconds=0.0))
    try:
        for name, data in _bad_files(tmp_path).items():
            expected = ingest_file(synchronous, data, name=name)
            expected.error = _same_reason(synchronous, expected.error)
            assert expected.outcome == "failed" and expected.error, name
            out = receive_file(received, data, name=name)
            if out.outcome == "failed":  # refused by its magic bytes: at once, no job (as before)
                assert name in ("notes.pdf", "empty.pdf"), name
                assert out.job_id is None and out.error == expected.error
                assert _doc(received, out.document_id).error == expected.error
                continue
            assert name in ("broken.pdf", "truncated.jpg", "locked.pdf"), name
            run = run_job(received, out.job_id)  # renders first; the file turns out unreadable
            doc, job = _doc(received, out.document_id), _job(received, out.job_id)
            assert (run.state, run.ran, doc.status, job.state) == ("failed", False, "failed", "failed"), name
            assert doc.error == job.error, name
            assert _same_reason(received, doc.error) == expected.error, name  # the reason, word for word
            assert doc.error_type == expected.error_type and doc.page_count == 0

        # The locked PDF again, with its password: read now, its failed job queued again as new.
        locked = _bad_files(tmp_path)["locked.pdf"]
        again = ingest_file(received, locked, name="locked.pdf", password="pw")
        assert (again.outcome, again.pages, again.rendered) == ("new", 1, True)
        assert _job(received, again.job_id).state == "queued" and _job(received, again.job_id).error is None
    finally:
        synchronous.close()


def test_retry_of_a_job_failed_by_its_document_reads_the_file_again(make_pipeline: Any) -> None:
    p = make_pipeline()
    out = receive_file(p, b"%PDF-1.4\n" + png_bytes(8, 8), name="broken.pdf")
    render_document(p, out.document_id)
    assert _doc(p, out.document_id).status == "failed" and _job(p, out.job_id).state == "failed"
    retry_job(p, out.job_id)
    assert _doc(p, out.document_id).status == "received" and _job(p, out.job_id).state == "queued"
    assert run_job(p, out.job_id).state == "failed"  # still unreadable, and said so again
    assert "broken.pdf" in (_job(p, out.job_id).error or "")


def test_fail_job_only_fails_a_queued_job(make_pipeline: Any) -> None:
    p = make_pipeline()
    queued = receive_file(p, png_bytes(), name="a.png")
    running = receive_file(p, png_bytes(), name="b.png")
    with p.db.session() as s:
        s.get(Job, running.job_id).state = "running"
    assert fail_job(p, queued.job_id, "not retried: the grammar is unusable") is True
    assert fail_job(p, queued.job_id, "again") is False  # already failed: compare-and-set on `queued`
    assert fail_job(p, running.job_id, "no") is False
    job = _job(p, queued.job_id)
    assert (job.state, job.error) == ("failed", "not retried: the grammar is unusable") and job.finished_at
    assert _job(p, running.job_id).state == "running"


def test_blob_store_adopts_a_hashed_file_by_moving_it(tmp_path: Path) -> None:
    import hashlib
    import os

    from pipeline.blobs import BlobStore

    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(5000)
    key = hashlib.sha256(data).hexdigest()
    spooled = tmp_path / "upload-1.part"
    spooled.write_bytes(data)
    inode = spooled.stat().st_ino
    store.adopt(spooled, key)  # the prefix folder does not exist yet
    assert not spooled.exists() and store.get_bytes(key) == data
    assert store.path(key).stat().st_ino == inode  # moved, not copied
    again = tmp_path / "upload-2.part"
    again.write_bytes(data)
    store.adopt(again, key)  # the same bytes again: the stored blob stays, the spooled copy goes
    assert not again.exists() and store.path(key).stat().st_ino == inode


def test_same_bytes_received_at_once_make_one_document_and_one_job(database_url: str, make_pipeline: Any) -> None:
    p = make_pipeline(database_url)
    data = png_bytes(120, 90)
    outcomes, errors = run_at_once([lambda: receive_file(p, data, name="same.png")] * 4)
    assert errors == []
    assert len({o.document_id for o in outcomes}) == 1 and len({o.job_id for o in outcomes}) == 1
    assert sorted(o.outcome for o in outcomes) == ["duplicate"] * 3 + ["new"]
    with p.db.read_session() as s:
        assert s.scalar(select(func.count()).select_from(Document)) == 1
        assert s.scalar(select(func.count()).select_from(Job)) == 1
