"""One read model (issue #18 item 1): the status of every document state, pinned once, is what the pipeline's
rule, its SQL filter, the API's view and the CLI's dict all say; job counts are one count (workers, metrics) and
listings are filtered by tenant in one place."""
from __future__ import annotations

from typing import Any

from pipeline.models import Document, DocumentStatus, Job
from pipeline.queries import (
    DocumentFilter,
    count_jobs_by_state,
    document_dict,
    jobs_by_state,
    select_documents,
    status_word,
)
from pipeline.schemas import latest_schema_ref
from pipeline.tenancy import EVERYONE, Access

# (document status, states of its jobs oldest first) -> the status every surface shows
PINNED = {
    ("received", ()): "queued",  # readable, no job (yet): its job is written with it
    ("ingested", ()): "queued",
    ("received", ("queued",)): "queued",
    ("ingested", ("running",)): "running",
    ("ingested", ("succeeded",)): "succeeded",
    ("ingested", ("partial",)): "partial",
    ("ingested", ("failed",)): "failed",
    ("ingested", ("succeeded", "queued")): "queued",  # the latest job decides
    ("failed", ()): "failed",  # unreadable
    ("failed", ("failed",)): "failed",
}


def _make(p: Any) -> dict[int, str]:
    """One document per pinned state; returns document id -> expected status."""
    expected = {}
    with p.db.session() as s:
        schemas = [latest_schema_ref(s, "generic").id, latest_schema_ref(s, "invoice").id]
        for n, ((doc_status, job_states), word) in enumerate(PINNED.items()):
            doc = Document(sha256=f"{n:064x}", original_name=f"d{n}", size_bytes=1, status=doc_status,
                           tenant="alpha" if n % 2 else "beta")
            s.add(doc)
            s.flush()
            for state, schema_id in zip(job_states, schemas):
                s.add(Job(document_id=doc.id, schema_id=schema_id, model_key="m", state=state))
            s.flush()
            expected[doc.id] = word
    return expected


def test_every_document_state_has_one_status_on_every_surface(database_url: str, make_pipeline: Any) -> None:
    from api.views import document_out

    p = make_pipeline(database_url, model_id="read-model")
    expected = _make(p)
    with p.db.read_session() as s:
        docs = select_documents(s, DocumentFilter(), EVERYONE, limit=100, newest_first=False)
        assert [d.id for d in docs] == sorted(expected)
        for doc in docs:
            jobs = list(doc.jobs)
            word = expected[doc.id]
            assert status_word(doc.status, jobs[-1].state if jobs else None) == word, (doc.status, jobs)
            assert document_out(doc).status == word  # the API
            assert document_dict(doc, with_pages=False)["status"] == word  # the CLI
        for word in set(expected.values()):  # the SQL filter agrees with the rule, row for row
            found = select_documents(s, DocumentFilter(status=word), EVERYONE, limit=100, newest_first=True)
            assert sorted(d.id for d in found) == sorted(i for i, w in expected.items() if w == word), word


def test_listing_and_counts_are_filtered_by_tenant(database_url: str, make_pipeline: Any) -> None:
    p = make_pipeline(database_url, model_id="read-model")
    expected = _make(p)
    with p.db.read_session() as s:
        alpha = select_documents(s, DocumentFilter(), Access("alpha"), limit=100, newest_first=True)
        beta = select_documents(s, DocumentFilter(), Access("beta"), limit=100, newest_first=True)
        assert {d.tenant for d in alpha} == {"alpha"} and {d.tenant for d in beta} == {"beta"}
        assert sorted(d.id for d in alpha + beta) == sorted(expected)
        every = count_jobs_by_state(s)
        split = [count_jobs_by_state(s, Access(t)) for t in ("alpha", "beta")]
    assert set(every) == {"queued", "running", "succeeded", "partial", "failed"}  # every state, zeros included
    assert every == {k: split[0][k] + split[1][k] for k in every}
    assert every == jobs_by_state(p) and sum(every.values()) == sum(len(k[1]) for k in PINNED)
    assert every["failed"] == 2 and DocumentStatus.failed.value == "failed"
