"""End to end through the queue: `submit` -> ingest worker -> gpu worker (reference runner, bundled tiny model).

Acceptance: 50 documents all succeed with exactly one result set each; a poison document (its stored page is
damaged, so extraction raises on every attempt) ends `failed` after the attempt cap and does not block others;
an unreadable file submitted alongside is recorded as failed at intake with its reason. Uploads taken in as the
API takes them (received, not rendered) are rendered by the ingest queue's `prepare` task and then extracted; an
unreadable one fails there, its job with the document's reason, without a run.
"""
from __future__ import annotations

import json
import subprocess
import sys

from workers_harness import FLAG_SCHEMA, REPO, png


def test_fifty_submitted_documents_succeed_once_and_a_poison_document_fails_after_the_cap(redis_url, make_cluster):
    cluster = make_cluster(redis_url, DOCPIPE_JOB_MAX_ATTEMPTS="3")
    cluster.register_schema("flag", FLAG_SCHEMA)  # also creates the database before any worker starts
    inbox = cluster.root / "inbox"
    inbox.mkdir()
    for i in range(50):
        (inbox / f"doc{i:02d}.png").write_bytes(png(size=20))
    # Unreadable: as for an upload, its document and its job (which never runs) fail with the reason.
    (inbox / "broken.pdf").write_bytes(b"%PDF-1.7\n1 0 obj\n<< truncated")

    gpu = cluster.start_worker("gpu")
    ingest = cluster.start_worker("ingest", "--concurrency", "1")
    beat = cluster.start_beat()  # the reconciler would resend anything lost; nothing should need it here

    submitted = subprocess.run([sys.executable, "-m", "workers", "submit", str(inbox), "--schema", "flag", "--json"],
                               cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    report = json.loads(submitted.stdout)
    assert len(report["files"]) == 51 and all(f["published"] for f in report["files"])

    # The poison document goes in alongside: its rendered page is overwritten with junk after ingestion.
    from pipeline.models import Page

    poison_job = cluster.ingest(png(size=20), "poison.png", "flag", enqueue=False)
    with cluster.pipeline.db.read_session() as s:
        blob = s.query(Page).join(Page.document).filter(Page.document.has(original_name="poison.png")).one().image_blob
    cluster.pipeline.blobs.path(blob).write_bytes(b"this is not a PNG any more")
    cluster.enqueue(poison_job)
    uploads = [cluster.receive(png(size=20), f"upload{i}.png", "flag") for i in range(2)]
    broken_upload = cluster.receive(b"%PDF-1.7\n% an upload cut short", "broken-upload.pdf", "flag")

    cluster.wait_for("55 finished jobs",
                     lambda: sum(n for st, n in cluster.job_states().items() if st != "queued" and st != "running")
                     == 55, timeout=150)
    assert gpu.alive() and ingest.alive() and beat.alive(), cluster.logs_text()

    jobs = {j.id: j for j in cluster.jobs()}
    assert len(jobs) == 55
    broken = jobs.pop(broken_upload)
    assert broken.state == "failed" and broken.attempts == 0, (broken.state, broken.attempts)  # never ran
    from sqlalchemy import select

    from pipeline.models import Document, Job

    with cluster.pipeline.db.read_session() as s:
        staged_id = s.scalar(select(Job.id).join(Document, Job.document_id == Document.id)
                             .where(Document.original_name == "inbox/broken.pdf"))
    broken_staged = jobs.pop(staged_id)
    assert broken_staged.state == "failed" and broken_staged.attempts == 0 and broken_staged.error
    from pipeline.models import Document

    with cluster.pipeline.db.read_session() as s:
        broken_doc = s.get(Document, broken.document_id)
        assert broken_doc.status == "failed" and "broken-upload.pdf" in broken_doc.error
        assert broken.error == broken_doc.error
        assert all(s.get(Document, jobs[j].document_id).page_count == 1 for j in uploads)  # rendered by `prepare`
    poison = jobs.pop(poison_job)
    assert poison.state == "failed", (poison.state, poison.error)
    assert poison.attempts == 3 and poison.error.startswith("gave up after 3 attempts"), poison.error
    assert "UnidentifiedImageError" in poison.error  # the reason a person can act on is kept

    assert {j.state for j in jobs.values()} == {"succeeded"}, cluster.logs_text()
    units = cluster.result_units()
    for job_id in jobs:
        assert sorted(units[job_id]) == ["document", "page:0"], (job_id, units.get(job_id))
    assert all(j.attempts == 1 for j in jobs.values())  # nothing crashed: every job ran exactly once
    assert not any((cluster.data_dir / "incoming").iterdir())  # every staged file was ingested and removed
    from pipeline.models import BatchItem

    with cluster.pipeline.db.read_session() as s:
        items = {i.name: i for i in s.query(BatchItem).filter(BatchItem.batch_id == report["batch_id"])}
    assert len(items) == 51 and items["inbox/broken.pdf"].outcome == "failed" and items["inbox/broken.pdf"].error

    status = subprocess.run([sys.executable, "-m", "workers", "status", "--json"], cwd=REPO, env=cluster.env,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["jobs_by_state"] == {"queued": 0, "running": 0, "succeeded": 52, "partial": 0, "failed": 3}
    assert st["queues"]["depths"] == {"ingest": 0, "gpu": 0}
    assert st["queues"]["beat_holder"] is not None
    assert st["documents_unreadable"] == 2
    assert len(st["queues"]["workers"]) >= 2 and all(st["queues"]["workers"].values())  # gpu + ingest child(ren)
