"""Per-tenant render slots across ingest workers (workers.render_slots): the Redis counting rule, and a real
ingest worker that renders another tenant's upload while one tenant's slow documents wait for their one slot."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import hostile_media as hostile
import redis
from sqlalchemy import select
from workers_harness import png

from workers.render_slots import RenderSlots


def test_a_tenant_gets_at_most_its_slots_and_a_dead_holder_frees_them(redis_url: str) -> None:
    slots = RenderSlots(redis.Redis.from_url(redis_url), limit=1, ttl_s=0.5)
    assert slots.acquire("alice", "job-1")
    assert not slots.acquire("alice", "job-2")  # alice's one slot is taken
    assert slots.acquire("bob", "job-3")  # other tenants are not affected
    assert slots.acquire("alice", "job-1")  # the holder itself renews
    slots.release("alice", "job-1")
    assert slots.acquire("alice", "job-2")
    assert slots.holders("alice") == ["job-2"]
    time.sleep(0.7)  # job-2's worker died without releasing: the slot expires with the hard time limit
    assert slots.acquire("alice", "job-4")


def test_one_tenants_slow_documents_wait_while_anothers_upload_renders(redis_url: str,
                                                                      make_cluster: Callable[..., Any]) -> None:
    from pipeline.models import Document, DocumentStatus, Job

    cluster = make_cluster(redis_url, DOCPIPE_INGEST_RENDERS_PER_TENANT="1", DOCPIPE_PAGE_RENDER_TIMEOUT_S="1",
                           DOCPIPE_DOCUMENT_RENDER_TIMEOUT_S="4", DOCPIPE_MAX_PAGE_DRAW_OPS="1000000000")
    from pipeline.ingest import receive_file
    from workers.enqueue import enqueue_prepare

    def send(data: bytes, name: str, tenant: str) -> int:
        out = receive_file(cluster.pipeline, data, name=name, schema="generic", tenant=tenant)
        assert out.job_id is not None
        assert enqueue_prepare(out.job_id, settings=cluster.settings(), worker_settings=cluster.worker_settings())
        return out.document_id

    slow = [send(hostile.nested_xobject_pdf(pages, 6, 10), f"slow-{pages}.pdf", "alice") for pages in (10, 11)]
    bob = send(png(seed=7), "bob.png", "bob")
    cluster.start_worker("ingest", "--concurrency", "2")

    def status(doc_id: int) -> str:
        with cluster.pipeline.db.read_session() as s:
            return str(s.scalar(select(Document.status).where(Document.id == doc_id)))

    cluster.wait_for("bob's document rendered", lambda: status(bob) == DocumentStatus.ingested.value, timeout=60)
    # Two ingest processes, but alice has one slot: her second document has not started while bob's rendered.
    states = [status(d) for d in slow]
    assert states.count(DocumentStatus.received.value) >= 1, states
    cluster.wait_for("alice's documents failed", lambda: all(status(d) == DocumentStatus.failed.value
                                                             for d in slow), timeout=90)
    with cluster.pipeline.db.read_session() as s:
        errors = list(s.scalars(select(Document.error).where(Document.id.in_(slow))))
        assert all("document_render_timeout_s" in (e or "") for e in errors), errors
        assert s.scalar(select(Job.state).join(Document).where(Document.id == bob)) == "queued"  # for gpu
