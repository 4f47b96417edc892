"""Render slots per API key across ingest workers (broker mode; workers.render_slots.RenderCaps): one key's slow
documents wait for its own slots while other keys' uploads render, whether those keys belong to the same tenant
or another; a tenant cap, when set, counts all its keys; a holder gets every slot it needs or none."""
from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

import hostile_media as hostile
import redis
from sqlalchemy import select
from workers_harness import png

from pipeline.render_owner import RenderOwner
from workers.config import WorkerSettings
from workers.render_slots import RenderCaps, RenderSlots


def _key() -> str:
    return "key-" + uuid.uuid4().hex[:12]


def test_each_key_has_its_own_slots_and_keyless_documents_count_per_tenant(redis_url: str) -> None:
    caps = RenderCaps(redis.Redis.from_url(redis_url), per_key=1, per_tenant=None, ttl_s=30)
    a1, a2 = RenderOwner("alice", _key()), RenderOwner("alice", _key())
    assert caps.acquire(a1, "job-1") is None
    assert caps.acquire(a1, "job-2") == a1.lane  # a1's one slot is taken
    assert caps.acquire(a2, "job-3") is None  # another key of the same tenant is not affected
    cli, watch = RenderOwner("alice", None), RenderOwner("alice", None)
    assert caps.acquire(cli, "job-4") is None
    assert caps.acquire(watch, "job-5") == "tenant:alice"  # no key: the tenant's documents share one lane
    caps.release(a1, "job-1")
    assert caps.acquire(a1, "job-2") is None


def test_a_tenant_cap_counts_all_its_keys_and_a_refused_holder_keeps_no_slot(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    caps = RenderCaps(client, per_key=1, per_tenant=2, ttl_s=30)
    a1, a2, a3, b = (RenderOwner("alice", _key()), RenderOwner("alice", _key()), RenderOwner("alice", _key()),
                     RenderOwner("bob", _key()))
    assert caps.acquire(a1, "job-1") is None and caps.acquire(a2, "job-2") is None
    assert caps.acquire(a3, "job-3") == "tenant-all:alice"  # its key has room, its tenant has not
    assert RenderSlots(client, limit=1, ttl_s=30).holders(a3.lane) == []  # both or neither
    assert caps.acquire(b, "job-4") is None  # another tenant is not affected
    caps.release(a1, "job-1")
    assert caps.acquire(a3, "job-3") is None


def test_a_normal_deployment_caps_each_keys_renders_by_default() -> None:
    ws = WorkerSettings()
    assert ws.ingest_renders_per_key == 4 and ws.ingest_renders_per_tenant is None
    assert RenderCaps(redis.Redis(), per_key=ws.ingest_renders_per_key, per_tenant=ws.ingest_renders_per_tenant,
                      ttl_s=1).enabled


def test_one_keys_slow_documents_wait_while_other_keys_uploads_render(redis_url: str,
                                                                     make_cluster: Callable[..., Any]) -> None:
    from pipeline.ingest import receive_file
    from pipeline.models import Document, DocumentStatus
    from workers.enqueue import enqueue_prepare

    cluster = make_cluster(redis_url, DOCPIPE_INGEST_RENDERS_PER_KEY="1", DOCPIPE_PAGE_RENDER_TIMEOUT_S="1",
                           DOCPIPE_DOCUMENT_RENDER_TIMEOUT_S="4", DOCPIPE_MAX_PAGE_DRAW_OPS="1000000000")
    hog, same_tenant, other_tenant = _key(), _key(), _key()

    def send(data: bytes, name: str, tenant: str, key: str) -> int:
        out = receive_file(cluster.pipeline, data, name=name, schema="generic", tenant=tenant, key_id=key)
        assert out.job_id is not None
        assert enqueue_prepare(out.job_id, settings=cluster.settings(), worker_settings=cluster.worker_settings())
        return out.document_id

    first = random.randrange(10, 20)
    slow = [send(hostile.nested_xobject_pdf(first + i, 6, 10), f"slow-{i}.pdf", "alice", hog) for i in range(3)]
    others = [send(png(seed=random.randrange(10**6)), "mine.png", "alice", same_tenant),
              send(png(seed=random.randrange(10**6)), "theirs.png", "bob", other_tenant)]
    cluster.start_worker("ingest", "--concurrency", "2")

    def status(doc_id: int) -> str:
        with cluster.pipeline.db.read_session() as s:
            return str(s.scalar(select(Document.status).where(Document.id == doc_id)))

    cluster.wait_for("the other keys' documents rendered",
                     lambda: all(status(d) == DocumentStatus.ingested.value for d in others), timeout=60)
    # Two ingest processes, but the hog has one slot: at most one of its documents has been rendered meanwhile
    # (the first may have spent its 4 s budget), so at least two still wait.
    states = [status(d) for d in slow]
    assert states.count(DocumentStatus.received.value) >= 2, states
    cluster.wait_for("the hog's documents failed", lambda: all(status(d) == DocumentStatus.failed.value
                                                               for d in slow), timeout=120)
    with cluster.pipeline.db.read_session() as s:
        errors = list(s.scalars(select(Document.error).where(Document.id.in_(slow))))
    assert all("document_render_timeout_s" in (e or "") for e in errors), errors
