"""pipeline/jobs.py rule by rule (the mutation pass of issue #22, tests/MUTATION.md): claims, units, the final
state, retries and staleness, on a SQLite file with a scripted model (the bookkeeping is under test, not the model).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pymupdf as fitz
import pytest
from pipeline_test_support import png_bytes
from sqlalchemy import select

from pipeline import models
from pipeline.engine_client import EngineReply, EngineRequest
from pipeline.errors import JobStateError, NotFoundError
from pipeline.ingest import ingest_file
from pipeline.jobs import JobRun, _Claim, _claim, _summarise, _units, retry_job, run_job, stale_jobs
from pipeline.models import utcnow
from pipeline.schemas import register_schema

COLOUR = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}


class Replies:
    """Answers request n with `texts[n]` (a JSON text; token per character, logprob `logprobs[n]` each, -0.5 by
    default); the request numbered `silent` (0-based, over the client's life) gets no reply (a broken client).
    Records each submission's size."""

    model_key, model_fingerprint, engine_version = "scripted" * 8, "fp-rules-1", "engine-rules-1"

    def __init__(self, *texts: str, logprobs: Sequence[float] = (), silent: int | None = None,
                 bare: frozenset[int] = frozenset(), finish: str = "stop") -> None:
        self.bare = bare  # replies (by number) that come without tokens, so without confidences
        self.finish = finish  # every reply's finish_reason
        self.texts = list(texts)
        self.logprobs = list(logprobs)
        self.silent = silent
        self.seen = 0
        self.batches: list[int] = []
        self.requests: list[EngineRequest] = []

    def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
        self.batches.append(len(requests))
        first = len(self.requests)
        self.requests.extend(requests)
        for n, _ in enumerate(requests):
            if self.silent == first + n:
                return
            text = self.texts[min(self.seen, len(self.texts) - 1)]
            lp = self.logprobs[self.seen] if self.seen < len(self.logprobs) else -0.5
            tokens = [] if self.seen in self.bare else list(text)
            self.seen += 1
            yield EngineReply(text=text, finish_reason=self.finish, token_texts=tokens,
                              token_logprobs=[lp] * len(tokens), prompt_tokens=7, completion_tokens=len(text))


def _pdf(folder: Path, pages: int) -> Path:
    doc = fitz.open()
    for n in range(pages):
        doc.new_page(width=200, height=200).insert_text((20, 40), f"page {n}")
    path = folder / f"doc{pages}.pdf"
    doc.save(path)
    return path


def _job_of(p: Any, source: Any, **kw: Any) -> int:
    with p.db.session() as s:
        register_schema(s, "colour", COLOUR)
    return ingest_file(p, source, schema="colour", **kw).job_id


def _job(p: Any, job_id: int) -> models.Job:
    with p.db.read_session() as s:
        job = s.get(models.Job, job_id)
        s.expunge(job)
        return job


def _set(p: Any, job_id: int, **values: Any) -> None:
    with p.db.session() as s:
        job = s.get(models.Job, job_id)
        for name, value in values.items():
            setattr(job, name, value)


def _units_stored(p: Any, job_id: int) -> set[str]:
    with p.db.read_session() as s:
        return set(s.scalars(select(models.Result.unit).where(models.Result.job_id == job_id)))


# --- summaries and units ----------------------------------------------------------------------------------------
def test_summary_of_failed_units_and_its_limit() -> None:
    assert _summarise([("page:0", "bad"), ("video", "none")]) == "page 0: bad; video: none"
    assert _summarise([]) == ""
    exact = [("u", "x" * 7)]  # "u: xxxxxxx" is 10 characters
    assert _summarise(exact, limit=10) == "u: xxxxxxx"
    assert _summarise(exact, limit=9) == "u: xxxxx…" and len(_summarise(exact, limit=9)) == 9
    long = _summarise([("page:1", "y" * 3000)])
    assert len(long) == 2000 and long.endswith("y…") and long.startswith("page 1: yyy")


def _claim_with(kind: str | None, pages: list[dict[str, Any]]) -> _Claim:
    return _Claim(token=1, document_id=1, schema_name="s", schema_version=1, json_schema={}, prompt="",
                  merge_rules={}, kind=kind, pages=pages)


def _page(index: int, blob: str | None = "b", error: str | None = None) -> dict[str, Any]:
    return {"index": index, "kind": "image", "blob": blob, "timestamp": None, "text": None, "error": error}


def test_units_of_pages_failed_and_runnable() -> None:
    pages = [_page(0), _page(1, error="too big"), _page(2, blob=None), _page(3)]
    names, failed, runnable = _units(_claim_with("pdf", pages))
    assert names == ["page:0", "page:1", "page:2", "page:3"]
    assert failed == [("page:1", 1, "too big"), ("page:2", 2, "the page was not rendered")]
    assert runnable == [{"unit": "page:0", "page_index": 0, "pages": [pages[0]]},
                        {"unit": "page:3", "page_index": 3, "pages": [pages[3]]}]
    assert _units(_claim_with("pdf", [])) == ([], [], [])


def test_a_video_is_one_unit_of_its_good_frames() -> None:
    frames = [_page(0), _page(1, error="bad frame"), _page(2, blob=None), _page(3)]
    names, failed, runnable = _units(_claim_with("video", frames))
    assert (names, failed) == (["video"], [])
    assert runnable == [{"unit": "video", "page_index": None, "pages": [frames[0], frames[3]]}]
    bad = [_page(0, error="e1"), _page(1, blob=None), _page(2, error="e2")]
    assert _units(_claim_with("video", bad)) == (["video"], [("video", None, "e1; e2")], [])
    assert _units(_claim_with("video", [_page(0, blob=None)])) == (
        ["video"], [("video", None, "no frames were decoded")], [])


# --- claims -----------------------------------------------------------------------------------------------------
def test_a_claim_stamps_owner_lease_attempt_and_run(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'), job_lease_s=120)
    job_id = _job_of(p, png_bytes(), name="c.png")
    before = utcnow()
    claim = _claim(p, job_id, takeover=False)
    assert isinstance(claim, _Claim) and claim.token == 1
    job = _job(p, job_id)
    assert (job.state, job.attempts, job.runs) == ("running", 1, 1)
    from pipeline.leases import aware, this_owner

    assert job.owner == this_owner()
    lease = aware(job.lease_until)
    assert before + timedelta(seconds=119) <= lease <= utcnow() + timedelta(seconds=120)
    assert aware(job.started_at) >= before - timedelta(seconds=1)
    assert claim.schema_name == "colour" and claim.json_schema == COLOUR and claim.done_units == set()
    assert [pg["index"] for pg in claim.pages] == [0]
    # a second claim while this one is healthy declines and says whose it is
    again = _claim(p, job_id, takeover=False)
    assert again == JobRun(job_id, "running", ran=False,
                           note=f"running in {this_owner()} (lease until {lease:%H:%M:%S} UTC)")
    assert _job(p, job_id).runs == 1


def test_a_claim_of_a_finished_job_or_an_unknown_one(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="d.png")
    assert run_job(p, job_id).state == "succeeded"
    done = _claim(p, job_id, takeover=True)
    assert done == JobRun(job_id, "succeeded", ran=False, note="already finished")
    with pytest.raises(NotFoundError) as missing:
        _claim(p, 10**6, takeover=False)
    assert (str(missing.value), missing.value.kind, missing.value.ident) == ("no job with id 1000000", "job", 10**6)


def test_the_attempt_cap_fails_the_job_at_the_claim(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'), job_max_attempts=3)
    job_id = _job_of(p, png_bytes(), name="e.png")
    _set(p, job_id, attempts=2, error="RuntimeError: x")
    assert isinstance(_claim(p, job_id, takeover=False), _Claim)  # the third attempt may run
    _set(p, job_id, state="queued")
    capped = _claim(p, job_id, takeover=False)
    assert capped == JobRun(job_id, "failed", ran=False, note="attempt cap reached")
    job = _job(p, job_id)
    assert job.error == "gave up after 3 attempts; last error: RuntimeError: x"
    assert job.owner is None and job.lease_until is None and job.finished_at is not None
    assert job.updated_at == job.finished_at
    other = _job_of(p, png_bytes(colour=(1, 2, 3)), name="f.png")
    _set(p, other, attempts=3, error=None)
    assert isinstance(_claim(p, other, takeover=False), JobRun)
    assert _job(p, other).error == "gave up after 3 attempts; last error: the worker died"


# --- the final state --------------------------------------------------------------------------------------------
def test_pages_all_good_some_bad_or_all_bad(make_pipeline: Any, tmp_path: Path) -> None:
    good = make_pipeline(client=Replies('{"colour":"red"}', '{"colour":"blue"}'))
    job_id = _job_of(good, _pdf(tmp_path, 2))
    run = run_job(good, job_id)
    assert (run.state, run.ran, run.units_total, run.units_done_now) == ("succeeded", True, 2, 2)
    assert _job(good, job_id).error is None and _units_stored(good, job_id) == {"page:0", "page:1", "document"}

    half = make_pipeline(client=Replies('{"colour":"red"}', "not json"))
    job_id = _job_of(half, _pdf(tmp_path, 2))
    run = run_job(half, job_id)
    assert run.state == "partial"
    assert _job(half, job_id).error.startswith("page 1: ")

    bad = make_pipeline(client=Replies("not json"))
    job_id = _job_of(bad, _pdf(tmp_path, 2))
    assert run_job(bad, job_id).state == "failed"
    job = _job(bad, job_id)
    assert job.error.startswith("page 0: ") and "; page 1: " in job.error
    assert _units_stored(bad, job_id) == {"page:0", "page:1"}  # no document result without a good page
    assert job.owner is None and job.lease_until is None and job.finished_at is not None


# --- retries ----------------------------------------------------------------------------------------------------
def test_retry_puts_a_failed_job_back_with_everything_cleared(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies("not json"))
    job_id = _job_of(p, png_bytes(), name="r.png")
    assert run_job(p, job_id).state == "failed"
    _set(p, job_id, isolated=True)
    retry_job(p, job_id)
    job = _job(p, job_id)
    assert (job.state, job.error, job.attempts, job.isolated) == ("queued", None, 0, False)
    assert (job.owner, job.lease_until, job.finished_at) == (None, None, None)
    assert (job.prompt_tokens, job.completion_tokens, job.model_seconds) == (0, 0, 0.0)
    assert _units_stored(p, job_id) == set()
    p.client.texts = ['{"colour":"green"}']
    assert run_job(p, job_id).state == "succeeded"


def test_retry_refuses_jobs_that_are_not_failed_or_partial(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="q.png")
    with pytest.raises(JobStateError) as caught:
        retry_job(p, job_id)
    assert str(caught.value) == f"job {job_id} is queued; only failed or partial jobs can be retried"
    run_job(p, job_id)
    with pytest.raises(JobStateError, match="is succeeded;"):
        retry_job(p, job_id)
    with pytest.raises(NotFoundError) as missing:
        retry_job(p, 10**6)
    assert str(missing.value) == "no job with id 1000000"
    assert (missing.value.kind, missing.value.ident) == ("job", 10**6)


def test_retry_of_a_job_whose_document_failed_reads_the_file_again(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="g.png")
    with p.db.session() as s:
        job = s.get(models.Job, job_id)
        job.state, job.error = "failed", "decoder timed out"
        doc = job.document
        doc.status, doc.error, doc.error_type, doc.render_attempts = "failed", "decoder timed out", "Timeout", 3
    retry_job(p, job_id)
    with p.db.read_session() as s:
        doc = s.get(models.Job, job_id).document
        assert (doc.status, doc.error, doc.error_type, doc.render_attempts) == ("received", None, None, 0)
    assert run_job(p, job_id).state == "succeeded"


def test_retry_within_a_tenant_cap(make_pipeline: Any) -> None:
    from pipeline.quotas import QuotaExceededError

    p = make_pipeline(client=Replies("not json"))
    first = _job_of(p, png_bytes(), name="t1.png")
    run_job(p, first)
    second = _job_of(p, png_bytes(colour=(9, 9, 9)), name="t2.png")  # queued: one active job
    with pytest.raises(QuotaExceededError):
        retry_job(p, first, cap_limit=1)
    assert _job(p, first).state == "failed"
    retry_job(p, first, cap_limit=2)
    assert _job(p, first).state == "queued" and _job(p, second).state == "queued"


# --- staleness --------------------------------------------------------------------------------------------------
def test_a_queued_job_is_stale_from_exactly_queued_for_s(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="h.png")
    _set(p, job_id, updated_at=utcnow() - timedelta(seconds=100))
    assert stale_jobs(p, queued_for_s=99) == [job_id]
    assert stale_jobs(p, queued_for_s=101) == []
    _set(p, job_id, state="succeeded")
    assert stale_jobs(p, queued_for_s=0) == []


def test_a_queued_job_untouched_for_exactly_queued_for_s_is_stale(make_pipeline: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import jobs

    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="edge.png")
    now = utcnow().replace(microsecond=0)
    _set(p, job_id, updated_at=now - timedelta(seconds=100))
    monkeypatch.setattr(jobs, "utcnow", lambda: now)
    assert stale_jobs(p, queued_for_s=100) == [job_id]


# --- what is stored -------------------------------------------------------------------------------------------
def _rows(p: Any, job_id: int) -> dict[str, models.Result]:
    with p.db.read_session() as s:
        rows = list(s.scalars(select(models.Result).where(models.Result.job_id == job_id)))
        for r in rows:
            s.expunge(r)
    return {r.unit: r for r in rows}


TAGS = {"type": "object", "properties": {"colour": {"type": "string"}, "tags": {"type": "array",
        "items": {"type": "string"}}}, "required": ["colour"]}


def test_every_column_of_the_page_and_document_results(make_pipeline: Any, tmp_path: Path) -> None:
    import math

    from pipeline.extraction import sampling_params, sampling_record

    texts = ['{"colour":"red","tags":["a"]}', '{"colour":"blue","tags":["b","c"]}']
    p = make_pipeline(client=Replies(*texts, logprobs=[-0.2, -0.7]))
    with p.db.session() as s:
        schema = register_schema(s, "tags", TAGS)
        version = schema.version
    job_id = ingest_file(p, _pdf(tmp_path, 2), schema="tags").job_id
    units: list[tuple[str, bool, int]] = []
    run = run_job(p, job_id, on_unit=lambda unit, ok, pages: units.append((unit, ok, pages)))
    assert units == [("page:0", True, 1), ("page:1", True, 1)]
    assert (run.state, run.ran, run.units_total, run.units_done_now) == ("succeeded", True, 2, 2)
    assert run.model_seconds >= 0 and run.overhead_seconds > 0
    rows = _rows(p, job_id)
    sampling = sampling_record(sampling_params(TAGS, p.settings))
    for page, (text, lp) in enumerate(zip(texts, (-0.2, -0.7))):
        row = rows[f"page:{page}"]
        assert (row.page_index, row.ok, row.raw_text, row.error) == (page, True, text, None)
        assert row.data == __import__("json").loads(text)
        assert row.confidence["overall"] == pytest.approx(math.exp(lp), rel=1e-12)
        assert row.confidence["fields"]["/colour"] == pytest.approx(math.exp(lp), rel=1e-12)
        assert (row.model_fingerprint, row.engine_version) == ("fp-rules-1", "engine-rules-1")
        assert (row.schema_name, row.schema_version, row.sampling) == ("tags", version, sampling)
        assert (row.prompt_tokens, row.completion_tokens) == (7, len(text))
        assert row.document_id == _job(p, job_id).document_id
    doc = rows["document"]
    assert (doc.page_index, doc.ok, doc.raw_text, doc.error) == (None, True, None, None)
    assert doc.data == {"colour": "red", "tags": ["a", "b", "c"]}  # best colour (page 0 is likelier), tags concat
    assert doc.confidence["overall"] == pytest.approx(math.exp(-0.7), rel=1e-12)  # the lowest page overall
    assert doc.confidence["fields"]["/colour"] == pytest.approx(math.exp(-0.2), rel=1e-12)
    assert (doc.prompt_tokens, doc.completion_tokens) == (14, len(texts[0]) + len(texts[1]))
    assert (doc.model_fingerprint, doc.engine_version, doc.schema_name, doc.schema_version, doc.sampling) == (
        "fp-rules-1", "engine-rules-1", "tags", version, sampling)
    assert doc.document_id == rows["page:0"].document_id
    job = _job(p, job_id)
    assert (job.prompt_tokens, job.completion_tokens) == (14, len(texts[0]) + len(texts[1]))
    assert job.model_seconds == pytest.approx(run.model_seconds, abs=1e-6)
    assert job.model_seconds >= 0


def test_a_merged_result_that_breaks_the_schema_is_stored_as_not_ok(make_pipeline: Any, tmp_path: Path) -> None:
    one = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+$"}}, "required": ["s"]}
    p = make_pipeline(client=Replies('{"s":"x"}', '{"s":"y"}'))
    with p.db.session() as s:
        register_schema(s, "one", one, merge_rules={"s": "join"})
    job_id = ingest_file(p, _pdf(tmp_path, 2), schema="one").job_id
    assert run_job(p, job_id).state == "succeeded"  # every page answered; the merge is the document's problem
    doc = _rows(p, job_id)["document"]
    assert doc.ok is False and doc.data["s"].startswith("x") and doc.data["s"].endswith("y")  # joined
    assert doc.error.startswith("merged result does not match the schema: ") and "does not match" in doc.error


def test_each_page_is_submitted_on_its_own_in_page_order(make_pipeline: Any, tmp_path: Path) -> None:
    # one submission a page, so a page goes to the engine as soon as a page slot is free (pipeline.page_feed)
    p = make_pipeline(client=Replies('{"colour":"red"}'), engine_max_num_seqs=2)
    job_id = _job_of(p, _pdf(tmp_path, 5))
    assert run_job(p, job_id).state == "succeeded"
    assert p.client.batches == [1, 1, 1, 1, 1]
    texts = [r.messages[0]["content"][-1]["text"] for r in p.client.requests]
    assert all(f"This is page {n + 1}." in text for n, text in enumerate(texts))


def test_a_client_that_gives_fewer_replies_than_requests_fails_the_run(make_pipeline: Any, tmp_path: Path) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}', silent=2), engine_max_num_seqs=3)
    job_id = _job_of(p, _pdf(tmp_path, 3))
    with pytest.raises(RuntimeError) as caught:
        run_job(p, job_id)
    assert str(caught.value) == "the engine client gave no reply for page:2"
    job = _job(p, job_id)
    assert (job.state, job.error) == ("queued", "RuntimeError: the engine client gave no reply for page:2")
    assert (job.attempts, job.owner, job.lease_until) == (1, None, None)  # the failed run's attempt counts
    assert _units_stored(p, job_id) == {"page:0", "page:1"}  # what came back is kept


def test_a_rerun_resumes_after_the_stored_units_and_an_unrendered_page_fails_alone(make_pipeline: Any,
                                                                                  tmp_path: Path) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}', silent=2), engine_max_num_seqs=3)
    job_id = _job_of(p, _pdf(tmp_path, 3))
    with pytest.raises(RuntimeError):
        run_job(p, job_id)
    with p.db.session() as s:
        page = s.scalars(select(models.Page).where(models.Page.document_id == _job(p, job_id).document_id,
                                                   models.Page.index == 2)).one()
        page.error = "the page was too large to render"
    p.client.silent = None
    before = p.client.seen
    run = run_job(p, job_id)
    assert p.client.seen == before  # pages 0 and 1 are stored, page 2 never reaches the model
    assert (run.state, run.units_total, run.units_done_now) == ("partial", 3, 0)
    row = _rows(p, job_id)["page:2"]
    assert (row.ok, row.error, row.data, row.raw_text, row.confidence) == (
        False, "the page was too large to render", None, None, None)
    assert _job(p, job_id).error == "page 2: the page was too large to render"


# --- runs that died ----------------------------------------------------------------------------------------------
def _dead_owner() -> str:
    import socket
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return f"{socket.gethostname()}:{child.pid}"


def test_a_run_that_died_among_others_is_refunded_and_runs_alone(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'), job_max_attempts=2)
    job_id = _job_of(p, png_bytes(), name="dead.png")
    _set(p, job_id, state="running", owner=_dead_owner(), attempts=2, runs=2,
         lease_until=utcnow() + timedelta(hours=1))
    run = run_job(p, job_id)  # its last attempt died with others: refunded, so it may run (alone)
    assert run.state == "succeeded"
    job = _job(p, job_id)
    assert (job.attempts, job.runs, job.isolated) == (2, 3, True)


def test_a_run_that_died_alone_keeps_its_attempt_and_says_so(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'), job_max_attempts=2)
    job_id = _job_of(p, png_bytes(), name="alone.png")
    _set(p, job_id, state="running", owner=_dead_owner(), attempts=2, runs=2, isolated=True,
         lease_until=utcnow() + timedelta(hours=1))
    run = run_job(p, job_id)
    assert (run.state, run.ran, run.note) == ("failed", False, "attempt cap reached")
    job = _job(p, job_id)
    assert job.error == ("gave up after 2 attempts; last error: the worker process stopped while running this "
                         "job alone")
    assert (job.attempts, job.runs) == (2, 2)


def test_fail_job_leaves_no_owner_or_lease_behind(make_pipeline: Any) -> None:
    from pipeline.jobs import fail_job

    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="left.png")
    _set(p, job_id, owner="old-host:5", lease_until=utcnow())  # left over by hand: fail_job clears both anyway
    assert fail_job(p, job_id, "bad input") is True
    job = _job(p, job_id)
    assert (job.state, job.owner, job.lease_until, job.error) == ("failed", None, None, "bad input")


# --- leases (pipeline/leases.py) --------------------------------------------------------------------------------
def test_asking_whether_a_live_owner_is_dead_does_not_disturb_it() -> None:
    import socket
    import subprocess
    import sys

    from pipeline.leases import owner_is_dead

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert owner_is_dead(f"{socket.gethostname()}:{child.pid}") is False
        time.sleep(0.2)  # a signal other than 0 would have ended it by now
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_an_owner_we_may_not_signal_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from pipeline import leases

    def not_ours(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")  # another user's process: it exists

    monkeypatch.setattr(leases.os, "kill", not_ours)
    assert leases.owner_is_dead(f"{socket.gethostname()}:{os.getpid() + 1}") is False


def test_each_page_request_carries_its_image_number_and_text_layer(make_pipeline: Any, tmp_path: Path) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, _pdf(tmp_path, 2))
    assert run_job(p, job_id).state == "succeeded"
    with p.db.read_session() as s:
        pages = list(s.scalars(select(models.Page).where(models.Page.document_id == _job(p, job_id).document_id)
                               .order_by(models.Page.index)))
        for pg in pages:
            s.expunge(pg)
    assert len(p.client.requests) == 2
    for request, page in zip(p.client.requests, pages):
        content = request.messages[0]["content"]
        images = [c["image"] for c in content if c["type"] == "image"]
        assert len(images) == 1 and images[0].size == (page.width, page.height)
        prompt = content[-1]["text"]
        assert f"This is page {page.index + 1}." in prompt
        assert f"Text layer of this page (may be incomplete or out of reading order):\npage {page.index}" in prompt
        assert p.images.get(page.image_blob) is not None  # decoded once, kept for a rerun


def test_a_retry_waits_for_a_concurrent_claim_and_then_sees_it(make_pipeline: Any, pg_url: str) -> None:
    """On PostgreSQL the retry reads the job under a row lock: a claim committed meanwhile is seen, not undone."""
    import threading

    p = make_pipeline(database_url=pg_url, client=Replies("not json"))
    job_id = _job_of(p, png_bytes(), name="race.png")
    assert run_job(p, job_id).state == "failed"
    locked, started = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def claimer() -> None:  # holds the row, as a claim does, and moves the job on before committing
        with p.db.session() as s:
            job = s.get(models.Job, job_id, with_for_update=True)
            locked.set()
            started.wait(10)
            time.sleep(0.3)  # let the retry reach its read of the row
            job.state = "running"

    def retry() -> None:
        started.set()
        try:
            retry_job(p, job_id)
            outcome["result"] = "retried"
        except JobStateError as exc:
            outcome["result"] = str(exc)

    holder = threading.Thread(target=claimer)
    holder.start()
    assert locked.wait(10)
    worker = threading.Thread(target=retry)
    worker.start()
    holder.join(20)
    worker.join(20)
    assert outcome["result"] == f"job {job_id} is running; only failed or partial jobs can be retried"
    assert _job(p, job_id).state == "running"


def test_a_documents_overall_is_the_lowest_known_page_overall_or_none(make_pipeline: Any, tmp_path: Path) -> None:
    import math

    mixed = make_pipeline(client=Replies('{"colour":"red"}', logprobs=[-0.4], bare=frozenset({1})))
    job_id = _job_of(mixed, _pdf(tmp_path, 2))
    assert run_job(mixed, job_id).state == "succeeded"
    rows = _rows(mixed, job_id)
    assert rows["page:1"].confidence == {"overall": None, "fields": {}}  # no tokens: nothing known
    assert rows["document"].confidence["overall"] == pytest.approx(math.exp(-0.4), rel=1e-12)

    bare = make_pipeline(client=Replies('{"colour":"red"}', bare=frozenset({0, 1})))
    job_id = _job_of(bare, _pdf(tmp_path, 2))
    assert run_job(bare, job_id).state == "succeeded"
    assert _rows(bare, job_id)["document"].confidence == {"overall": None, "fields": {}}


def test_every_stored_unit_renews_the_lease_from_that_moment(make_pipeline: Any, tmp_path: Path) -> None:
    from pipeline.leases import aware

    p = make_pipeline(client=Replies('{"colour":"red"}'), job_lease_s=300)
    job_id = _job_of(p, _pdf(tmp_path, 2))
    seen: list[tuple[Any, Any]] = []

    def on_unit(unit: str, ok: bool, pages: int) -> None:
        job = _job(p, job_id)
        seen.append((aware(job.lease_until), aware(job.updated_at)))

    assert run_job(p, job_id, on_unit=on_unit).state == "succeeded"
    assert len(seen) == 2
    for lease, updated in seen:
        assert lease - updated == timedelta(seconds=300)  # renewed by the write, from the write's moment
    assert seen[1][1] > seen[0][1]


def test_units_that_fail_before_the_model_count_no_tokens(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="never.png")
    with p.db.session() as s:
        for page in s.scalars(select(models.Page).where(models.Page.document_id == _job(p, job_id).document_id)):
            page.error, page.image_blob = "could not be rendered", None
    run = run_job(p, job_id)
    assert (run.state, run.units_done_now) == ("failed", 0) and p.client.seen == 0
    row = _rows(p, job_id)["page:0"]
    assert (row.prompt_tokens, row.completion_tokens, row.page_index, row.ok) == (0, 0, 0, False)
    job = _job(p, job_id)
    assert (job.prompt_tokens, job.completion_tokens, job.model_seconds) == (0, 0, 0.0)
    assert job.error == "page 0: could not be rendered"


def test_a_document_without_pages_fails_its_job_saying_so(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="empty.png")
    with p.db.session() as s:
        for page in s.scalars(select(models.Page).where(models.Page.document_id == _job(p, job_id).document_id)):
            s.delete(page)
    run = run_job(p, job_id)
    assert (run.state, run.units_total) == ("failed", 0)
    assert _job(p, job_id).error == "the document has no pages"


def test_a_run_stops_at_its_first_refused_write(make_pipeline: Any, tmp_path: Path) -> None:
    class TakenOver(Replies):
        def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
            for n, reply in enumerate(super().run(requests)):
                if n == 0:  # another worker takes the job while this run waits for its first reply
                    assert not isinstance(_claim(p, job_id, takeover=True, alone=True), JobRun)
                yield reply

    p = make_pipeline(client=TakenOver('{"colour":"red"}'))
    job_id = _job_of(p, _pdf(tmp_path, 3))
    units: list[str] = []
    run = run_job(p, job_id, on_unit=lambda unit, ok, pages: units.append(unit))
    assert run == JobRun(job_id, "running", ran=False, note="taken over by another attempt")
    assert units == [] and p.client.seen == 1  # no unit counted, no further reply waited for
    assert _units_stored(p, job_id) == set()


def test_a_page_is_decoded_once_and_kept_for_later_runs(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="twice.png")
    reads: list[str] = []
    get_bytes = p.blobs.get_bytes

    def counted(key: str) -> bytes:
        reads.append(key)
        return get_bytes(key)

    p.blobs.get_bytes = counted  # type: ignore[method-assign]  # count the blob reads of the runs below
    assert run_job(p, job_id).state == "succeeded"
    assert reads == []  # the page decoded when it was rendered is served from the image cache
    p.client.texts = ["not json"]
    with p.db.session() as s:
        job = s.get(models.Job, job_id)
        job.state = "failed"
    retry_job(p, job_id)
    assert run_job(p, job_id).state == "failed"
    assert reads == []
    from pipeline.image_cache import ImageCache

    p.images = ImageCache(p.images.max_bytes)  # as in another process: read from the blob store once, then kept
    retry_job(p, job_id)
    assert run_job(p, job_id).state == "failed" and len(reads) == 1
    retry_job(p, job_id)
    assert run_job(p, job_id).state == "failed" and len(reads) == 1


def test_a_job_running_healthily_elsewhere_is_left_to_it_unless_a_takeover_is_asked(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="busy.png")
    _set(p, job_id, state="running", owner="other-host:1", attempts=1, runs=1,
         lease_until=utcnow() + timedelta(hours=1))
    run = run_job(p, job_id)
    assert (run.ran, run.state) == (False, "running") and run.note.startswith("running in other-host:1")
    assert _job(p, job_id).runs == 1 and p.client.seen == 0
    assert run_job(p, job_id, takeover=True).state == "succeeded"


def test_a_lease_that_lapses_between_the_look_and_the_claim_is_run_alone(make_pipeline: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import jobs

    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="lapsing.png")
    _set(p, job_id, state="running", owner="other-host:1", attempts=1, runs=1,
         lease_until=utcnow() + timedelta(minutes=30))
    calls = []

    def clock() -> Any:  # the first look sees the lease running; from the claim on, it has passed
        calls.append(1)
        return utcnow() + (timedelta(0) if len(calls) == 1 else timedelta(hours=1))

    monkeypatch.setattr(jobs, "utcnow", clock)
    run = run_job(p, job_id)
    assert run.state == "succeeded"
    job = _job(p, job_id)
    assert (job.isolated, job.attempts, job.runs) == (True, 1, 2)  # taken over, refunded, run alone


def test_a_run_taken_over_before_it_stores_a_failed_page_stops_there(make_pipeline: Any) -> None:
    class TakenAtStart(Replies):
        @property
        def model_fingerprint(self) -> str:  # read once the claim is made, before any unit is stored
            assert not isinstance(_claim(p, job_id, takeover=True, alone=True), JobRun)
            return "fp-rules-1"

    p = make_pipeline(client=TakenAtStart('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="gone.png")
    with p.db.session() as s:
        for page in s.scalars(select(models.Page).where(models.Page.document_id == _job(p, job_id).document_id)):
            page.error, page.image_blob = "could not be rendered", None
    run = run_job(p, job_id)
    assert run == JobRun(job_id, "running", ran=False, note="taken over by another attempt")
    assert _units_stored(p, job_id) == set() and _job(p, job_id).runs == 2


def test_a_run_taken_over_after_its_last_unit_stores_no_document_result(make_pipeline: Any, tmp_path: Path) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, _pdf(tmp_path, 2))

    def on_unit(unit: str, ok: bool, pages: int) -> None:
        if unit == "page:1":  # another worker takes the job once this run stored its last page, before it merges
            assert not isinstance(_claim(p, job_id, takeover=True, alone=True), JobRun)

    run = run_job(p, job_id, on_unit=on_unit)
    assert run == JobRun(job_id, "running", ran=False, note="taken over by another attempt")
    assert _units_stored(p, job_id) == {"page:0", "page:1"}  # the pages stay for the new run; no document result
    job = _job(p, job_id)
    assert (job.state, job.runs, job.finished_at) == ("running", 2, None)


def test_an_answer_cut_at_max_tokens_says_so_with_the_limit(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"re', finish="length"), max_tokens=77)
    job_id = _job_of(p, png_bytes(), name="cut.png")
    assert run_job(p, job_id).state == "failed"
    error = _rows(p, job_id)["page:0"].error
    assert error is not None
    assert error.startswith("the answer was cut at max_tokens=77 before the JSON ended; raise DOCPIPE_MAX_TOKENS")


def test_a_video_job_sends_its_good_frames_with_their_timestamps(make_pipeline: Any) -> None:
    """A video is one unit: one request with every decoded frame at its time, no page number, no text layer."""
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="clip.png")
    with p.db.session() as s:  # the rendered image stands in for a video's decoded frames (no decoder needed)
        first = s.scalars(select(models.Page).where(models.Page.document_id == _job(p, job_id).document_id)).one()
        first.document.kind, first.kind, first.timestamp = "video", "frame", 0.0
        for index, (timestamp, error) in enumerate([(0.5, "could not decode"), (1.5, None)], start=1):
            s.add(models.Page(document_id=first.document_id, index=index, kind="frame", timestamp=timestamp,
                              width=first.width, height=first.height,
                              image_blob=None if error else first.image_blob, error=error))
    assert run_job(p, job_id).state == "succeeded"
    [request] = p.client.requests
    content = request.messages[0]["content"]
    assert [c["type"] for c in content] == ["video", "text"]
    assert content[0]["timestamps"] == [0.0, 1.5] and len(content[0]["video"]) == 2
    assert "This is page" not in content[1]["text"] and "Text layer" not in content[1]["text"]
    rows = _rows(p, job_id)
    assert set(rows) == {"video", "document"} and rows["video"].page_index is None and rows["video"].ok


# --- the process's run gate: two runs in one process ------------------------------------------------------------
def _waits_to_run_alone(run: Callable[[], JobRun]) -> tuple[bool, JobRun]:
    """Call `run` in a thread while this thread holds the process's run gate shared (another job of this process
    is running): whether it waited at the gate to be alone, and its answer once this thread let go."""
    from pipeline.attempts import RUN_GATE

    answers: list[JobRun] = []
    thread = threading.Thread(target=lambda: answers.append(run()))
    with RUN_GATE.shared():
        thread.start()
        deadline = time.monotonic() + 30
        while thread.is_alive() and not RUN_GATE.is_waiting(thread.ident or 0):
            assert time.monotonic() < deadline, "the run neither finished nor waited at the gate"
            time.sleep(0.002)
        waited = thread.is_alive()  # still there: it is waiting for this thread's run to end
    thread.join(30)
    assert not thread.is_alive() and len(answers) == 1
    return waited, answers[0]


def test_only_a_run_that_must_be_alone_waits_for_the_other_runs_of_its_process(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    plain = _job_of(p, png_bytes(), name="plain.png")
    waited, run = _waits_to_run_alone(lambda: run_job(p, plain))
    assert (waited, run.state) == (False, "succeeded")  # runs beside the other one

    marked = _job_of(p, png_bytes(colour=(1, 2, 3)), name="marked.png")
    _set(p, marked, isolated=True)  # an earlier run of it died among others
    waited, run = _waits_to_run_alone(lambda: run_job(p, marked))
    assert (waited, run.state) == (True, "succeeded")

    _set(p, plain, isolated=True)  # finished: nothing will run, so nothing waits, whatever the mark says
    waited, run = _waits_to_run_alone(lambda: run_job(p, plain))
    assert (waited, run.ran, run.note) == (False, False, "already finished")

    busy = _job_of(p, png_bytes(colour=(4, 5, 6)), name="busy.png")
    _set(p, busy, state="running", owner="other-host:1", attempts=1, runs=1,
         lease_until=utcnow() + timedelta(hours=1))
    waited, run = _waits_to_run_alone(lambda: run_job(p, busy))  # healthy elsewhere: declined at once
    assert (waited, run.ran) == (False, False) and run.note.startswith("running in other-host:1")

    _set(p, busy, lease_until=utcnow() - timedelta(seconds=1))  # its run lapsed: taken over, alone
    waited, run = _waits_to_run_alone(lambda: run_job(p, busy))
    assert (waited, run.state) == (True, "succeeded")
    assert (_job(p, busy).isolated, _job(p, busy).runs) == (True, 2)


def test_a_job_whose_document_failed_fails_at_the_claim_with_the_documents_reason(make_pipeline: Any) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="broken.png")
    _set(p, job_id, owner="old-host:1", lease_until=utcnow())  # left over: cleared with the verdict
    with p.db.session() as s:
        document = s.get(models.Job, job_id).document
        document.status, document.error = "failed", "the file is truncated"
    before = utcnow()
    assert run_job(p, job_id) == JobRun(job_id, "failed", ran=False, note="the document could not be read")
    job = _job(p, job_id)
    assert (job.state, job.error, job.owner, job.lease_until, job.runs) == (
        "failed", "the file is truncated", None, None, 0)
    from pipeline.leases import aware

    assert job.finished_at == job.updated_at and aware(job.finished_at) >= before - timedelta(seconds=1)
    assert p.client.seen == 0


def test_a_claim_of_a_job_whose_document_is_not_rendered_yet_leaves_it_queued(make_pipeline: Any) -> None:
    from pipeline.ingest import receive_file

    p = make_pipeline(client=Replies('{"colour":"red"}'))
    with p.db.session() as s:
        register_schema(s, "colour", COLOUR)
    job_id = receive_file(p, png_bytes(), name="later.png", schema="colour").job_id
    assert job_id is not None
    assert _claim(p, job_id, takeover=False, alone=True) == JobRun(
        job_id, "queued", ran=False, note="the document is not rendered yet")
    job = _job(p, job_id)
    assert (job.state, job.attempts, job.runs, job.owner) == ("queued", 0, 0, None)


def test_the_schemas_merge_rules_decide_the_document_result(make_pipeline: Any, tmp_path: Path) -> None:
    p = make_pipeline(client=Replies('{"colour":"red"}', '{"colour":"blue"}', logprobs=[-0.1, -2.0]))
    with p.db.session() as s:
        register_schema(s, "lastcolour", COLOUR, merge_rules={"colour": "last"})
    job_id = ingest_file(p, _pdf(tmp_path, 2), schema="lastcolour").job_id
    assert job_id is not None and run_job(p, job_id).state == "succeeded"
    assert _rows(p, job_id)["document"].data == {"colour": "blue"}  # "best" would take page 0's likelier red


def test_model_seconds_are_the_waits_for_replies_and_overhead_the_rest_of_the_call(make_pipeline: Any,
                                                                                  tmp_path: Path) -> None:
    class Slow(Replies):
        def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
            for reply in super().run(requests):
                time.sleep(0.15)  # the engine thinks
                yield reply

    p = make_pipeline(client=Slow('{"colour":"red"}'))
    job_id = _job_of(p, _pdf(tmp_path, 2))
    t0 = time.perf_counter()
    run = run_job(p, job_id)
    elapsed = time.perf_counter() - t0
    assert (run.job_id, run.state, run.ran) == (job_id, "succeeded", True) and run.model_seconds >= 0.3
    assert 0 < run.overhead_seconds and run.model_seconds + run.overhead_seconds <= elapsed
    assert _job(p, job_id).model_seconds == pytest.approx(run.model_seconds, abs=1e-6)


def test_two_claims_at_once_on_postgresql_give_the_job_to_one_run(make_pipeline: Any, pg_url: str) -> None:
    """The claim reads the job under a row lock: a claim committed meanwhile is seen and declined, not
    overwritten with a second run of the same fencing token."""
    import psycopg
    from sqlalchemy import text

    p = make_pipeline(database_url=pg_url, client=Replies('{"colour":"red"}'))
    job_id = _job_of(p, png_bytes(), name="twice.png")
    holding, release = threading.Event(), threading.Event()
    holder_pid: list[int] = []
    answers: list[Any] = []

    def first_claim() -> None:  # another worker's claim: holds the row, then commits its run
        with p.db.session() as s:
            job = s.get(models.Job, job_id, with_for_update=True)
            holder_pid.append(s.execute(text("select pg_backend_pid()")).scalar_one())
            holding.set()
            release.wait(20)
            job.state, job.attempts, job.runs, job.owner = "running", 1, 1, "other-host:5"
            job.lease_until = utcnow() + timedelta(hours=1)

    first = threading.Thread(target=first_claim)
    first.start()
    assert holding.wait(20)
    second = threading.Thread(target=lambda: answers.append(_claim(p, job_id, takeover=False, alone=True)))
    second.start()
    deadline = time.monotonic() + 20
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=test", autocommit=True) as watch:
        while not watch.execute("select count(*) from pg_stat_activity where %s = any(pg_blocking_pids(pid))",
                                (holder_pid[0],)).fetchone()[0]:  # type: ignore[index]  # one row
            assert time.monotonic() < deadline and second.is_alive(), "the second claim never waited for the row"
            time.sleep(0.01)
    release.set()
    first.join(20)
    second.join(20)
    [answer] = answers
    assert isinstance(answer, JobRun) and not answer.ran and answer.note.startswith("running in other-host:5")
    job = _job(p, job_id)
    assert (job.owner, job.runs, job.attempts) == ("other-host:5", 1, 1)
