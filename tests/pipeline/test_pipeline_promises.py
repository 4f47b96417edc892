"""README promises of the job state machine, confidence and merge, provenance and settings, each checked so that
the test fails when the promise breaks (issue #22: the fencing token, min-of-pages, spill sizes...). The model is
a scripted client: the behaviour under test is the pipeline's bookkeeping, not the model."""
from __future__ import annotations

import math
import re
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
from pipeline.ingest import ingest_file
from pipeline.jobs import JobRun, _claim, run_job
from pipeline.models import utcnow
from pipeline.schemas import register_schema
from pipeline.settings import Settings

COLOUR = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}


class Scripted:
    """Answers every page with a valid `{"colour": ...}` whose tokens carry `logprobs[page]` each; `before_reply`
    runs before each reply is handed over (to play another worker taking the job meanwhile)."""

    model_key, model_fingerprint, engine_version = "scripted" * 8, "fp-scripted-1", "engine-test-7"

    def __init__(self, logprobs: dict[int, float] | None = None,
                 before_reply: Callable[[int], None] | None = None) -> None:
        self.logprobs = logprobs or {}
        self.before_reply = before_reply
        self.replies = 0

    def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
        for request in requests:
            if self.before_reply is not None:
                self.before_reply(self.replies)
            self.replies += 1
            page = _page_of(request)
            tokens = ['{"colour":', f'"c{page}"', "}"]
            lp = self.logprobs.get(page, -0.25)
            yield EngineReply(text="".join(tokens), finish_reason="stop", token_texts=tokens,
                              token_logprobs=[lp] * len(tokens), prompt_tokens=10, completion_tokens=3)


def _page_of(request: EngineRequest) -> int:
    prompt = request.messages[0]["content"][-1]["text"]
    for n in range(1, 50):
        if f"This is page {n}." in prompt:
            return n - 1
    return 0


def _pdf(folder: Path, pages: int) -> Path:
    doc = fitz.open()
    for n in range(pages):
        doc.new_page(width=200, height=200).insert_text((20, 40), f"page {n}")
    path = folder / f"doc{pages}.pdf"
    doc.save(path)
    return path


def _job(p: Any, job_id: int) -> models.Job:
    with p.db.read_session() as s:
        job = s.get(models.Job, job_id)
        s.expunge(job)
        return job


def _results(p: Any, job_id: int) -> dict[str, models.Result]:
    with p.db.read_session() as s:
        rows = list(s.scalars(select(models.Result).where(models.Result.job_id == job_id)))
        for r in rows:
            s.expunge(r)
    return {r.unit: r for r in rows}


def _colour_job(p: Any, source: Any, **kw: Any) -> int:
    with p.db.session() as s:
        register_schema(s, "colour", COLOUR)
    return ingest_file(p, source, schema="colour", **kw).job_id


# --- fencing: a run that lost its job to a takeover cannot write ------------------------------------------------
def _take_over(p: Any, job_id: int) -> None:
    """Another worker claims the job as a broker redelivery would (takeover, alone in its process)."""
    assert not isinstance(_claim(p, job_id, takeover=True, alone=True), JobRun)


def test_a_run_taken_over_before_its_first_write_stores_nothing(make_pipeline: Any) -> None:
    holder: dict[str, Any] = {}

    def takeover(n: int) -> None:
        if n == 0:  # another worker takes the job over while this run waits for the model
            _take_over(holder["p"], holder["job"])

    p = make_pipeline(client=Scripted(before_reply=takeover))
    holder.update(p=p, job=_colour_job(p, png_bytes(), name="a.png"))
    run = run_job(p, holder["job"])
    assert not run.ran and run.note == "taken over by another attempt"
    assert _results(p, holder["job"]) == {}  # the old run's page result was refused (fenced on attempts)
    job = _job(p, holder["job"])
    assert (job.state, job.runs, job.prompt_tokens) == ("running", 2, 0)  # nor did it count its tokens


def test_a_run_taken_over_before_it_finishes_leaves_the_end_to_the_new_owner(make_pipeline: Any,
                                                                              tmp_path: Path) -> None:
    p = make_pipeline(client=Scripted())
    job_id = _colour_job(p, _pdf(tmp_path, 2))
    stored: list[str] = []

    def on_unit(unit: str, ok: bool, pages: int) -> None:
        stored.append(unit)
        if len(stored) == 2:  # both pages stored; another worker takes over before the merge
            _take_over(p, job_id)

    run = run_job(p, job_id, on_unit=on_unit)
    assert not run.ran and run.note == "taken over by another attempt"
    assert set(_results(p, job_id)) == {"page:0", "page:1"}  # no merged result from the superseded run
    job = _job(p, job_id)
    assert (job.state, job.runs, job.finished_at) == ("running", 2, None)
    # The new owner (run 2) finishes it: nothing is redone, the document result is written once.
    again = run_job(p, job_id, takeover=True)
    assert again.ran and again.state == "succeeded" and again.units_done_now == 0
    assert set(_results(p, job_id)) == {"page:0", "page:1", "document"}


def test_a_failing_run_that_was_taken_over_does_not_requeue_the_job(make_pipeline: Any) -> None:
    holder: dict[str, Any] = {}

    def takeover_then_fail(n: int) -> None:
        _take_over(holder["p"], holder["job"])
        raise RuntimeError("the engine died after losing the job")

    p = make_pipeline(client=Scripted(before_reply=takeover_then_fail))
    holder.update(p=p, job=_colour_job(p, png_bytes(), name="b.png"))
    with pytest.raises(RuntimeError, match="losing the job"):
        run_job(p, holder["job"])
    job = _job(p, holder["job"])
    # the new owner's run is untouched: still running under its token, and the old run's error is not recorded
    assert (job.state, job.runs) == ("running", 2) and "losing the job" not in (job.error or "")


# --- confidence and merge -------------------------------------------------------------------------------------
def test_a_merged_documents_overall_is_its_lowest_page_overall(make_pipeline: Any, tmp_path: Path) -> None:
    logprobs = {0: -0.2, 1: -1.3, 2: -0.6}  # the middle page is the least sure: neither first nor last
    p = make_pipeline(client=Scripted(logprobs=logprobs))
    job_id = _colour_job(p, _pdf(tmp_path, 3))
    assert run_job(p, job_id).state == "succeeded"
    rows = _results(p, job_id)
    for page, lp in logprobs.items():
        assert rows[f"page:{page}"].confidence["overall"] == pytest.approx(math.exp(lp), rel=1e-12)
    assert rows["document"].confidence["overall"] == pytest.approx(math.exp(-1.3), rel=1e-12)


# --- provenance -----------------------------------------------------------------------------------------------
def test_every_result_records_model_engine_schema_and_sampling(make_pipeline: Any, tmp_path: Path) -> None:
    p = make_pipeline(client=Scripted(), temperature=0.3, max_tokens=123)
    job_id = _colour_job(p, _pdf(tmp_path, 2))
    assert run_job(p, job_id).state == "succeeded"
    rows = _results(p, job_id)
    assert set(rows) == {"page:0", "page:1", "document"}
    for row in rows.values():
        assert row.model_fingerprint == "fp-scripted-1"
        assert row.engine_version == "engine-test-7"
        assert (row.schema_name, row.schema_version) == ("colour", 1)
        assert row.sampling["temperature"] == 0.3 and row.sampling["max_tokens"] == 123
        assert {"top_p", "top_k", "seed"} <= set(row.sampling)


# --- settings ---------------------------------------------------------------------------------------------------
def test_settings_precedence_keywords_then_environment_then_dotenv_then_defaults(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # .env is read from the working directory
    for name in ("MAX_PAGES", "PDF_DPI", "VIDEO_FPS", "MAX_TOKENS"):
        monkeypatch.delenv(f"DOCPIPE_{name}", raising=False)
    (tmp_path / ".env").write_text("DOCPIPE_MAX_PAGES=11\nDOCPIPE_PDF_DPI=99\nDOCPIPE_VIDEO_FPS=1.5\n")
    monkeypatch.setenv("DOCPIPE_PDF_DPI", "120")
    monkeypatch.setenv("DOCPIPE_VIDEO_FPS", "1.0")
    s = Settings(video_fps=0.5)
    assert s.video_fps == 0.5  # keyword over environment (and .env)
    assert s.pdf_dpi == 120  # environment over .env
    assert s.max_pages == 11  # .env over the default
    assert s.max_tokens == 2048  # the default where nothing is set


def test_media_limit_and_render_defaults_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from vision.limits import MediaLimits, RenderOptions

    monkeypatch.chdir(tmp_path)  # no .env here
    for name in ("MAX_FILE_BYTES", "MAX_PAGES", "MAX_PAGE_PIXELS", "MAX_PHOTO_PIXELS", "MAX_VIDEO_SECONDS", "PDF_DPI",
                 "VIDEO_FPS", "VIDEO_MAX_FRAMES"):
        monkeypatch.delenv(f"DOCPIPE_{name}", raising=False)
    mib = 1024 * 1024
    s = Settings()
    assert (s.max_file_bytes, s.max_pages, s.max_page_pixels, s.max_video_seconds) == (512 * mib, 2000,
                                                                                         16_000_000, 600)
    assert (s.pdf_dpi, s.video_fps, s.video_max_frames) == (150, 2.0, 64)
    limits = MediaLimits()  # README "Limits": 512 MiB, 2,000 pages, 16 MP, 89 MP, 600 s, 120 s and 3 GiB
    assert (limits.max_file_bytes, limits.max_pages, limits.max_page_pixels, limits.max_image_pixels,
            limits.max_video_seconds, limits.decode_timeout_s, limits.decode_memory_bytes) == (
        512 * mib, 2000, 16_000_000, 89_000_000, 600, 120, 3 * 1024 * mib)
    assert RenderOptions().pdf_dpi == 150
    # what the pipeline hands to vision is what the settings say
    assert s.media_limits().max_pages == 2000 and s.render_options().pdf_dpi == 150
    assert Settings(max_pages=7).media_limits().max_pages == 7 and Settings(pdf_dpi=72).render_options().pdf_dpi == 72
    # README "Photo size": raster images are capped at 2048 x 1536 unless DOCPIPE_MAX_PHOTO_PIXELS says otherwise
    assert s.max_photo_pixels == MediaLimits().max_photo_pixels == s.media_limits().max_photo_pixels == 2048 * 1536
    assert Settings(max_photo_pixels=12_192_768).media_limits().max_photo_pixels == 12_192_768


def test_a_pdf_renders_at_150_dpi_by_default(tmp_path: Path) -> None:
    from vision import open_media

    doc = fitz.open()
    doc.new_page(width=144, height=72)  # 2 x 1 inches
    doc.save(tmp_path / "inch.pdf")
    with open_media(tmp_path / "inch.pdf") as media:
        [page] = list(media.pages())
    assert page.image.size == (300, 150)



# --- merge rules, exactly (pipeline/merge.py; cases the mutation pass found unpinned) ----------------------------
def _u(data: dict[str, Any], fields: dict[str, float] | None = None) -> Any:
    from pipeline.merge import UnitData

    return UnitData(data, fields or {})


def test_merge_first_last_skip_every_kind_of_empty_and_keep_the_first_page_when_all_are_empty() -> None:
    from pipeline.merge import is_empty, merge_units

    assert all(is_empty(v) for v in (None, "", [], {}, {"a": None, "b": {"c": ""}}))
    assert not any(is_empty(v) for v in (0, False, "x", [None], {"a": 0}))
    schema = {"properties": {"a": {"type": "string"}, "b": {"type": "string"}, "c": {}, "d": {}}}
    units = [_u({"a": "", "b": None, "c": [], "d": ""}, {"/a": 0.1}),
             _u({"a": "A1", "b": "B1", "c": {"k": None}, "d": None}, {"/a": 0.2, "/b": 0.3}),
             _u({"a": "A2", "b": "B2", "c": "C2", "d": ""}, {"/a": 0.4, "/b": 0.5, "/c": 0.6})]
    merged = merge_units(units, schema, {"a": "first", "b": "last", "c": "first", "d": "last"})
    assert merged.data == {"a": "A1", "b": "B2", "c": "C2", "d": ""}  # d: all empty -> the first page's value
    assert merged.fields == {"/a": 0.2, "/b": 0.5, "/c": 0.6}


def test_merge_default_rules_best_ties_and_pages_without_confidences() -> None:
    from pipeline.merge import merge_units, rule_for

    assert rule_for("x", {"type": "array"}, {}) == "concat" and rule_for("x", {"type": "string"}, {}) == "best"
    assert rule_for("x", {"type": "array"}, {"x": "union"}) == "union"
    schema = {"properties": {"name": {"type": "string"}, "tags": {"type": "array"}, "tie": {"type": "string"},
                             "bare": {"type": "string"}}}
    units = [_u({"name": "low", "tags": ["a"], "tie": "t0", "bare": "no-confidence"},
                {"/name": 0.2, "/tags/0": 0.9, "/tie": 0.5}),
             _u({"name": "high", "tags": ["b"], "tie": "t1", "bare": "some"},
                {"/name": 0.8, "/tags/0": 0.7, "/tie": 0.5, "/bare": 0.01})]
    merged = merge_units(units, schema, {})
    assert merged.data == {"name": "high", "tags": ["a", "b"], "tie": "t0", "bare": "some"}
    assert merged.fields == {"/name": 0.8, "/tags/0": 0.9, "/tags/1": 0.7, "/tie": 0.5, "/bare": 0.01}
    # best over nested leaves: the mean of the field's leaf confidences decides
    nested = merge_units([_u({"p": {"x": 1, "y": 2}}, {"/p/x": 0.9, "/p/y": 0.1}),
                          _u({"p": {"x": 3, "y": 4}}, {"/p/x": 0.45, "/p/y": 0.6, "/pq": 1.0})], {}, {})
    assert nested.data == {"p": {"x": 3, "y": 4}} and nested.fields == {"/p/x": 0.45, "/p/y": 0.6}


def test_merge_concat_union_join_limits_and_their_confidences() -> None:
    from pipeline.merge import merge_units

    schema = {"properties": {
        "items": {"anyOf": [{"type": "array", "maxItems": 3}, {"type": "null"}]},
        "codes": {"type": "array", "maxItems": 5},
        "note": {"anyOf": [{"type": "string", "maxLength": 9}, {"type": "string", "maxLength": 7}, {"type": "null"}]},
        "empty_note": {"type": "string"},
    }}
    units = [_u({"items": [{"q": 1}, {"q": 2}], "codes": ["x", "y"], "note": "abc", "empty_note": ""},
                {"/items/0/q": 0.1, "/items/1/q": 0.2, "/codes/0": 0.3, "/codes/1": 0.4, "/note": 0.9,
                 "/empty_note": 0.7}),
             _u({"items": [{"q": 3}, {"q": 4}], "codes": ["y", "z"], "note": "abc", "empty_note": None},
                {"/items/0/q": 0.3, "/items/1/q": 0.4, "/codes/0": 0.5, "/codes/1": 0.6, "/note": 0.2}),
             _u({"items": None, "codes": "not a list", "note": "defgh"}, {"/note": 0.5})]
    rules = {"items": "concat", "codes": "union", "note": "join", "empty_note": "join"}  # anyOf has no "type"
    merged = merge_units(units, schema, rules)
    assert merged.data["items"] == [{"q": 1}, {"q": 2}, {"q": 3}]  # concat, cut at maxItems (from anyOf)
    assert merged.data["codes"] == ["x", "y", "z"]  # union: the repeated "y" dropped
    assert merged.data["note"] == "abc\ndef"  # "abc" once, joined, cut at the smallest maxLength (7)
    assert merged.data["empty_note"] == ""  # nothing to join: the first page's value
    assert merged.fields == {"/items/0/q": 0.1, "/items/1/q": 0.2, "/items/2/q": 0.3,
                             "/codes/0": 0.3, "/codes/1": 0.4, "/codes/2": 0.6,
                             "/note": 0.5,  # the weakest joined part ("abc" counts its first page only)
                             "/empty_note": 0.7}


def test_merge_of_one_unit_no_units_absent_fields_and_unknown_rules() -> None:
    from pipeline.merge import merge_units

    one = _u({"a": 1}, {"/a": 0.5})
    merged = merge_units([one], {"properties": {"a": {}}}, {})
    assert (merged.data, merged.fields) == ({"a": 1}, {"/a": 0.5})
    assert merged.data is not one.data and merged.fields is not one.fields  # copies
    with pytest.raises(ValueError, match="nothing to merge"):
        merge_units([], {}, {})
    # a field no page has is left out, and the fields after it are still merged; names the schema does not list
    # come from the first page (in its order)
    schema = {"properties": {"gone": {}, "kept": {}}}
    merged = merge_units([_u({"kept": "k0", "extra": "e0"}), _u({"kept": "k1", "late": "l1"})], schema,
                         {"kept": "last"})
    assert merged.data == {"kept": "k1", "extra": "e0"}
    assert merge_units([_u({"a": 1}), _u({"a": 2})], {}, {}).data == {"a": 1}  # no properties at all: best
    with pytest.raises(ValueError, match="unknown merge rule 'average' for field 'a'"):
        merge_units([_u({"a": 1}), _u({"a": 2})], {}, {"a": "average"})


# --- confidence, exactly (pipeline/confidence.py) ------------------------------------------------------------------
def test_leaf_spans_with_whitespace_empty_containers_and_escaped_keys() -> None:
    from pipeline.confidence import escape_pointer_token, leaf_spans

    text = ' {\n "a" : [ ] ,\t"b":{ },"c" :[1 , {"d~e/f": "x"}],"g":null } '
    assert [(p, text[a:b]) for p, a, b in leaf_spans(text)] == [("/c/0", "1"), ("/c/1/d~0e~1f", '"x"'),
                                                                  ("/g", "null")]
    assert escape_pointer_token("a~/b") == "a~0~1b"
    assert leaf_spans('"just a string"') == [("", 0, 15)] and leaf_spans("[]") == [] and leaf_spans("{}") == []
    for bad, message in (("", "unexpected end of JSON text"), ('{"a" 1}', "expected ':' at character 5"),
                         ('{"a":1 "b":2}', "expected '}' at character 7"), ("[1 2]", "expected ']' at character 3"),
                         ("{1:2}", "expected '\"' at character 1"), ("[1] x", "extra data after the JSON value at "
                                                                              "character 4")):
        with pytest.raises(ValueError, match=re.escape(message)):
            leaf_spans(bad)


def test_align_tokens_exact_spans_mismatches_and_partial_characters() -> None:
    from pipeline.confidence import align_tokens

    assert align_tokens("abcd", ["ab", "", "cd"]) == [(0, 2), (2, 2), (2, 4)]
    assert align_tokens("abcd", ["ab", "cx"]) is None  # a token that is not the text
    assert align_tokens("abcd", ["ab", "c"]) is None  # tokens stop short of the text
    assert align_tokens("abc", ["ab", "cd"]) is None  # tokens run past it
    # an "é" (2 bytes) split over two tokens shown as U+FFFD, then more text
    assert align_tokens("xéy", ["x", "\ufffd", "\ufffd", "y"]) == [(0, 1), (1, 2), (1, 2), (2, 3)]
    # the partial tokens end the text
    assert align_tokens("xé", ["x", "\ufffd", "\ufffd"]) == [(0, 1), (1, 2), (1, 2)]
    # a token holding the end of one character and the next plain one
    assert align_tokens("éz", ["\ufffd", "\ufffdz"]) == [(0, 1), (0, 2)]
    # a real U+FFFD in the text is an ordinary character
    assert align_tokens("a\ufffdb", ["a", "\ufffd", "b"]) == [(0, 1), (1, 2), (2, 3)]
    # partial bytes cannot stand for more than 4 characters before the next plain one
    assert align_tokens("x" + "é" * 5 + "y", ["x", "\ufffd", "y"]) is None


def test_field_confidence_skips_empty_tokens_and_reports_nothing_without_tokens() -> None:
    from pipeline.confidence import field_confidence

    conf = field_confidence('{"a":1}', ['{"a":', "", "1", "}"], [-0.1, -5.0, -0.4, -0.2])
    assert conf.fields == {"/a": pytest.approx(math.exp(-0.4), rel=1e-12)}  # the empty token overlaps nothing
    assert conf.overall == pytest.approx(math.exp((-0.1 - 5.0 - 0.4 - 0.2) / 4), rel=1e-12)
    empty = field_confidence("", [], [])
    assert (empty.overall, empty.fields) == (None, {})
    assert empty.as_json() == {"overall": None, "fields": {}}


def test_fail_job_fails_only_that_queued_job_for_good(make_pipeline: Any) -> None:
    from pipeline.jobs import fail_job

    p = make_pipeline(client=Scripted())
    first, second = _colour_job(p, png_bytes(), name="f1.png"), _colour_job(p, png_bytes(), name="f2.png")
    _set(p, second, owner="host:1", lease_until=None)
    assert fail_job(p, first, "bad input: " + "x" * 3000) is True
    job, untouched = _job(p, first), _job(p, second)
    assert job.state == "failed" and job.error == ("bad input: " + "x" * 3000)[:2000]
    assert job.finished_at is not None and job.updated_at == job.finished_at  # one moment, both stamped
    assert job.owner is None and job.lease_until is None
    assert untouched.state == "queued" and untouched.finished_at is None and untouched.owner == "host:1"
    assert fail_job(p, first, "again") is False and _job(p, first).error.startswith("bad input")  # not queued
    _take_over(p, second)  # claimed meanwhile: left to its run
    assert fail_job(p, second, "too late") is False and _job(p, second).state == "running"


def _set(p: Any, job_id: int, **values: Any) -> None:
    with p.db.session() as s:
        job = s.get(models.Job, job_id)
        for name, value in values.items():
            setattr(job, name, value)


# --- owners, releases and staleness (pipeline/jobs.py) -------------------------------------------------------------
def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_owner_is_dead_only_when_this_host_can_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import socket
    import subprocess
    import sys

    from pipeline import leases

    host = socket.gethostname()
    dead = _dead_pid()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert leases.owner_is_dead(f"{host}:{dead}") is True
        for owner in (None, "", "no-colon", f"{host}:{alive.pid}", f"{host}:{os.getpid()}", f"elsewhere:{dead}",
                      f"{host}:x{dead}", f"{host}:"):
            assert leases.owner_is_dead(owner) is False, owner
        monkeypatch.setattr(socket, "gethostname", lambda: "rack:7")  # a host name with a colon in it
        assert leases.owner_is_dead(f"rack:7:{dead}") is True and leases.owner_is_dead(f"rack:7:{alive.pid}") is False
    finally:
        alive.kill()
        alive.wait()


def test_a_run_lapses_without_a_lease_past_its_lease_or_with_a_dead_owner() -> None:
    import random
    import socket
    from datetime import timezone

    from pipeline import leases

    now = utcnow()
    live = leases.this_owner()
    ahead = timedelta(seconds=random.randint(1, 10**6))
    assert leases.run_lapsed(None, live, now) is True
    assert leases.run_lapsed(now - ahead, live, now) is True
    assert leases.run_lapsed(now, live, now) is True  # a lease ends at its time, not after it
    assert leases.run_lapsed(now + ahead, live, now) is False
    assert leases.run_lapsed(now + ahead, f"{socket.gethostname()}:{_dead_pid()}", now) is True
    # SQLite returns naive datetimes: they are UTC, and compare as such
    naive = (now + ahead).replace(tzinfo=None)
    assert leases.aware(naive) == now + ahead and leases.aware(naive).tzinfo is timezone.utc
    assert leases.run_lapsed(naive, live, now) is False
    assert leases.aware(None) is None


def test_a_failed_run_requeues_until_its_attempts_are_spent_and_an_interrupt_costs_none(make_pipeline: Any) -> None:
    def boom(n: int) -> None:
        raise RuntimeError("boom")

    p = make_pipeline(client=Scripted(before_reply=boom), job_max_attempts=2)
    job_id = _colour_job(p, png_bytes(), name="boom.png")
    with pytest.raises(RuntimeError, match="boom"):
        run_job(p, job_id)
    job = _job(p, job_id)
    assert (job.state, job.attempts, job.error, job.finished_at, job.owner) == ("queued", 1, "RuntimeError: boom",
                                                                                 None, None)
    with pytest.raises(RuntimeError, match="boom"):
        run_job(p, job_id)
    job = _job(p, job_id)
    assert (job.state, job.attempts) == ("failed", 2) and job.finished_at is not None
    assert job.error == "gave up after 2 attempts; last error: RuntimeError: boom"

    def interrupt(n: int) -> None:
        raise KeyboardInterrupt

    q = make_pipeline(client=Scripted(before_reply=interrupt), job_max_attempts=2)
    other = _colour_job(q, png_bytes(), name="stop.png")
    for _ in range(3):  # an interrupted run is not the job's fault: it never counts
        with pytest.raises(KeyboardInterrupt):
            run_job(q, other)
    job = _job(q, other)
    assert (job.state, job.attempts, job.error) == ("queued", 0, "interrupted")


def test_stale_jobs_are_lapsed_leases_dead_owners_and_long_queued_ones(make_pipeline: Any) -> None:
    import socket

    from pipeline.jobs import stale_jobs

    p = make_pipeline(client=Scripted())
    ids = [_colour_job(p, png_bytes(), name=f"s{i}.png") for i in range(6)]
    now = utcnow()
    host = socket.gethostname()
    _set(p, ids[0], state="running", owner="w:1", lease_until=now - timedelta(seconds=5))  # lease passed
    _set(p, ids[1], state="running", owner="w:1", lease_until=None)  # never had one
    _set(p, ids[2], state="running", owner=f"{host}:{_dead_pid()}", lease_until=now + timedelta(hours=1))  # dead
    _set(p, ids[3], state="running", owner="w:1", lease_until=now + timedelta(hours=1))  # healthy
    _set(p, ids[4], state="queued", updated_at=now - timedelta(seconds=600))  # queued for 10 minutes
    _set(p, ids[5], state="queued", updated_at=now + timedelta(hours=1))  # just touched
    assert sorted(stale_jobs(p, queued_for_s=300)) == sorted(ids[:3] + [ids[4]])
    assert sorted(stale_jobs(p, queued_for_s=3600)) == sorted(ids[:3])


def test_merge_best_compares_means_not_sums_over_different_leaf_counts() -> None:
    from pipeline.merge import merge_units

    # page 0: one leaf at 0.6 (mean 0.6); page 1: three leaves at 0.5 (mean 0.5, but sum and sum*count larger)
    units = [_u({"p": {"a": 1}}, {"/p/a": 0.6}),
             _u({"p": {"a": 2, "b": 3, "c": 4}}, {"/p/a": 0.5, "/p/b": 0.5, "/p/c": 0.5})]
    assert merge_units(units, {}, {}).data == {"p": {"a": 1}}
