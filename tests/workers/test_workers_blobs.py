"""Deleted content does not stay on disk (issue #21 item 5): a document deleted while the ingest worker renders it
leaves none of its page blobs behind, and beat's sweep removes blobs no row names."""
from __future__ import annotations

import os
import time

from sqlalchemy import select
from test_workers_attempt_caps import _slow_pdf
from workers_harness import note_schema


def _blob_files(data_dir) -> list:
    root = data_dir / "blobs"
    return sorted(f for f in root.rglob("*") if f.is_file() and not f.name.startswith(".")) if root.exists() else []


def test_delete_while_the_ingest_worker_renders_leaves_no_blob(redis_url, make_cluster, database_url):
    from api.queries import delete_document
    from pipeline.models import Document, Job
    from pipeline.tenancy import Access

    db = {"DOCPIPE_DATABASE_URL": database_url} if database_url else {}
    cluster = make_cluster(redis_url, DOCPIPE_PDF_DPI="100", **db)
    cluster.register_schema("note", note_schema(40))
    job_id = cluster.receive(_slow_pdf(300), "deleted.pdf", "note")
    p = cluster.pipeline
    with p.db.read_session() as s:
        doc_id = s.scalar(select(Job.document_id).where(Job.id == job_id))
    cluster.start_worker("ingest", "--concurrency", "1")
    cluster.wait_for("the render to start writing pages", lambda: len(_blob_files(cluster.data_dir)) > 3,
                     timeout=60, poll=0.02)
    with p.db.session() as s:  # what DELETE /v1/documents/{id} does, while the pages are being rendered
        orphaned = delete_document(s, doc_id, Access(admin=True))
    for key in orphaned:
        p.blobs.delete(key)
    cluster.wait_for("every blob of the deleted document gone", lambda: _blob_files(cluster.data_dir) == [],
                     timeout=90)
    with p.db.read_session() as s:
        assert s.get(Document, doc_id) is None


def test_the_sweep_removes_old_blobs_no_row_names(tmp_path):
    from workers_harness import png

    from pipeline.context import Pipeline
    from pipeline.ingest import ingest_file
    from pipeline.retention import sweep_unreferenced_blobs
    from pipeline.settings import Settings
    from workers.beat import beat_schedule
    from workers.config import TASK_SWEEP, WorkerSettings

    p = Pipeline(Settings(data_dir=tmp_path / "data", model_id="sweep-test"))
    try:
        kept = ingest_file(p, png(size=20), name="kept.png")
        assert kept.outcome == "new"
        orphan_old = p.blobs.put_bytes(b"left behind by a crash")
        orphan_young = p.blobs.put_bytes(b"an intake that has not written its row yet")
        hour_ago = time.time() - 7200
        for f in _blob_files(p.settings.data_dir):
            os.utime(f, (hour_ago, hour_ago))
        os.utime(p.blobs.path(orphan_young))  # written just now
        before = _blob_files(p.settings.data_dir)
        assert sweep_unreferenced_blobs(p, grace_s=3600) == 1
        after = _blob_files(p.settings.data_dir)
        assert set(before) - set(after) == {p.blobs.path(orphan_old)}
        assert p.blobs.exists(orphan_young) and p.blobs.exists(kept_sha(p, kept.document_id))
    finally:
        p.close()
    schedule = beat_schedule(WorkerSettings(), watch=False, retention=False)
    assert any(entry["task"] == TASK_SWEEP for entry in schedule.values())  # swept with or without retention


def kept_sha(p, document_id: int) -> str:
    from pipeline.models import Document

    with p.db.read_session() as s:
        return str(s.scalar(select(Document.sha256).where(Document.id == document_id)))
