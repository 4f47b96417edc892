"""End-to-end acceptance: real files, the real engine (bundled tiny model, reference runner), SQLite and
PostgreSQL. The tiny model's weights are random, so answers are schema-valid noise: the tests check shape,
validity, bookkeeping and idempotence, never the content."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pymupdf as fitz
import pytest
from pipeline_test_support import REPO, png_bytes, run_at_once
from sqlalchemy import func, select

from pipeline import models
from pipeline.errors import UnknownSchemaError
from pipeline.ingest import ingest_file
from pipeline.jobs import run_job
from pipeline.processing import process_paths
from pipeline.queries import batch_items, batch_progress, get_results
from pipeline.schemas import register_schema
from pipeline.walk import iter_folder

TABLES = (models.Document, models.Page, models.Job, models.Result, models.Schema, models.Batch, models.BatchItem)


def row_counts(p: Any) -> dict[str, int]:
    with p.db.read_session() as s:
        return {t.__tablename__: s.scalar(select(func.count()).select_from(t)) for t in TABLES}


def results_of(p: Any, job_id: int) -> list[models.Result]:
    with p.db.read_session() as s:
        return list(s.scalars(select(models.Result).where(models.Result.job_id == job_id)))


def check_document(p: Any, document_id: int, name: str) -> None:
    """One succeeded job whose unit and merged results validate against the schema; pages recorded."""
    res = get_results(p, document_id)
    assert res["status"] == "succeeded", (name, res["results"][0]["error"] if res["results"] else res["error"])
    assert res["page_count"] == len(res["pages"]) >= 1
    kind = res["kind"]
    for page in res["pages"]:
        assert page["has_image"] and page["width"] > 0 and page["height"] > 0 and page["error"] is None
        assert (page["timestamp"] is not None) == (kind == "video"), name
    if kind == "video":
        stamps = [pg["timestamp"] for pg in res["pages"]]
        assert stamps == sorted(stamps) and stamps[0] >= 0.0
    [job] = res["results"]
    with p.db.read_session() as s:
        schema = s.get(models.Job, job["job_id"]).schema.json_schema
    units = job["units"]
    expected_units = ["video"] if kind == "video" else [f"page:{pg['index']}" for pg in res["pages"]]
    assert [u["unit"] for u in units] == expected_units
    for unit in units + [job["document"]]:
        assert unit["ok"], unit["error"]
        jsonschema.validate(unit["data"], schema)
        assert unit["provenance"]["model_fingerprint"] and unit["provenance"]["schema_version"] == 1
        conf = unit["confidence"]
        assert 0.0 < conf["overall"] <= 1.0
        assert all(0.0 < c <= 1.0 for c in conf["fields"].values())


def test_every_sample_end_to_end(database_url: str, make_pipeline: Any, engine_client: Any,
                                 inputs: list[Path]) -> None:
    p = make_pipeline(database_url, client=engine_client)
    report = process_paths(p, inputs)
    assert [f.state for f in report.files] == ["succeeded"] * len(inputs), [(f.name, f.error) for f in report.files]
    assert len({f.document_id for f in report.files}) == len(inputs)
    for f in report.files:
        check_document(p, f.document_id, f.name)
    counts = row_counts(p)
    assert counts["documents"] == len(inputs) and counts["jobs"] == len(inputs)

    again = process_paths(p, inputs)  # same files, schema and model: nothing new, same results
    assert [f.outcome for f in again.files] == ["duplicate"] * len(inputs)
    assert [f.document_id for f in again.files] == [f.document_id for f in report.files]
    assert again.pages_processed == 0
    grown = row_counts(p)
    assert grown["batch_items"] == 2 * len(inputs) and grown["batches"] == 2  # intake is recorded ...
    for table in ("documents", "pages", "jobs", "results", "schemas"):
        assert grown[table] == counts[table], table  # ... nothing else is added
    for f in report.files:
        assert run_job(p, f.job_id).ran is False  # a finished job is never run again


def test_bad_files_fail_with_reasons_good_ones_succeed(make_pipeline: Any, engine_client: Any, tmp_path: Path,
                                                       inputs: list[Path]) -> None:
    folder = tmp_path / "batch"
    folder.mkdir()
    (folder / "good.png").write_bytes(png_bytes(96, 64))
    (folder / "empty.pdf").write_bytes(b"")
    (folder / "notes.pdf").write_text("this is text, not a PDF")
    for suffix in (".jpg", ".mp4"):
        whole = next(f for f in inputs if f.suffix == suffix).read_bytes()
        (folder / f"truncated{suffix}").write_bytes(whole[: len(whole) // 3])
    doc = fitz.open()
    doc.new_page().insert_text((72, 72), "secret")
    doc.save(folder / "locked.pdf", encryption=fitz.PDF_ENCRYPT_AES_256, user_pw="pw", owner_pw="pw")

    p = make_pipeline(client=engine_client)
    report = process_paths(p, [folder])
    states = {Path(f.name).name: f for f in report.files}
    assert states["good.png"].state == "succeeded"
    for bad, words in (("empty.pdf", "empty"), ("notes.pdf", "not an accepted media type"),
                       ("locked.pdf", "password"), ("truncated.jpg", "cannot be decoded"),
                       ("truncated.mp4", "cannot be decoded")):
        assert states[bad].state == "failed", bad
        assert states[bad].error and words in states[bad].error.lower(), (bad, states[bad].error)
    assert not report.ok
    progress = batch_progress(p, report.batch_id)
    assert progress["finished"] and progress["counts"]["succeeded"] == 1 and progress["counts"]["failed"] == 5
    assert {i["name"]: i["state"] for i in batch_items(p, report.batch_id)}["locked.pdf"] == "failed"

    # the password makes the locked file readable: the same bytes are taken again, not refused as a duplicate
    again = ingest_file(p, folder / "locked.pdf", password="pw")
    assert again.outcome == "new" and again.pages == 1


CRASHING_RUN = textwrap.dedent("""
    import os, sys
    from pipeline.context import Pipeline
    from pipeline.engine_client import EngineClient
    from pipeline.jobs import run_job
    from pipeline.settings import Settings

    class CrashAfterFirstPage:
        def __init__(self, inner):
            self.inner = inner
            self.model_key, self.model_fingerprint = inner.model_key, inner.model_fingerprint
            self.engine_version = inner.engine_version
            self.replies = 0  # over all submissions (a job submits one a page)

        def run(self, requests):
            for reply in self.inner.run(requests):
                self.replies += 1
                if self.replies == 2:
                    os._exit(17)  # the process dies after page 0 is stored, before page 1 is
                yield reply

    settings = Settings(**{**__import__("json").loads(sys.argv[1])})
    client = CrashAfterFirstPage(EngineClient.from_settings(settings))
    run_job(Pipeline(settings, client=client), int(sys.argv[2]))
    sys.exit(0)
""")


def test_crash_between_pages_then_rerun_leaves_one_result_set(make_pipeline: Any, engine_client: Any,
                                                               inputs: list[Path], tmp_path: Path) -> None:
    p = make_pipeline(client=engine_client)
    multi = max(inputs, key=lambda f: (f.suffix in (".pdf", ".tif", ".tiff"), f.stat().st_size))
    intake = ingest_file(p, multi)
    assert intake.pages >= 2, "needs a multi-page input"
    settings = json.dumps({**json.loads(p.settings.model_dump_json(include={
        "data_dir", "database_url", "stable_seconds", "max_tokens", "video_max_frames", "engine_max_num_seqs"}))})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    crashed = subprocess.run([sys.executable, "-c", CRASHING_RUN, settings, str(intake.job_id)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert crashed.returncode == 17, crashed.stderr[-2000:]
    with p.db.read_session() as s:
        job = s.get(models.Job, intake.job_id)
        assert (job.state, job.attempts) == ("running", 1)  # the dead process left it running
    [survivor] = results_of(p, intake.job_id)
    assert survivor.unit == "page:0"

    run = run_job(p, intake.job_id)  # owner process is gone from this host: taken over at once
    assert run.ran and run.state == "succeeded" and run.units_done_now == intake.pages - 1  # resumed, not redone
    rows = results_of(p, intake.job_id)
    assert sorted(r.unit for r in rows) == sorted([f"page:{i}" for i in range(intake.pages)] + ["document"])
    assert next(r for r in rows if r.unit == "page:0").id == survivor.id
    assert run_job(p, intake.job_id).ran is False
    assert len(results_of(p, intake.job_id)) == intake.pages + 1


def test_concurrent_runs_of_one_job_write_once(database_url: str, make_pipeline: Any, engine_client: Any) -> None:
    p = make_pipeline(database_url, client=engine_client)
    intake = ingest_file(p, png_bytes(), name="twice.png")
    runs: list[Any] = []
    threads = [threading.Thread(target=lambda: runs.append(run_job(p, intake.job_id, takeover=True)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = results_of(p, intake.job_id)
    assert sorted(r.unit for r in rows) == ["document", "page:0"]
    assert sum(r.ran for r in runs) >= 1
    with p.db.read_session() as s:
        assert s.get(models.Job, intake.job_id).state == "succeeded"


def test_running_job_is_not_taken_from_a_live_owner(make_pipeline: Any, engine_client: Any) -> None:
    from pipeline.jobs import JobRun, _claim

    p = make_pipeline(client=engine_client)
    intake = ingest_file(p, png_bytes(), name="busy.png")
    claim = _claim(p, intake.job_id, takeover=False)  # this process now owns it (lease valid, pid alive)
    assert not isinstance(claim, JobRun)
    busy = run_job(p, intake.job_id)
    assert not busy.ran and "running in" in busy.note
    taken = run_job(p, intake.job_id, takeover=True)
    assert taken.ran and taken.state == "succeeded"


def test_poison_job_fails_after_the_attempt_cap(make_pipeline: Any) -> None:
    class Exploding:  # the behaviour under test is the retry cap, not the model
        model_key, model_fingerprint, engine_version = "poison" * 8, "none", "0"

        def run(self, requests: Any) -> Any:
            raise RuntimeError("extraction blew up")
            yield  # pragma: no cover

    p = make_pipeline(client=Exploding(), job_max_attempts=2)
    intake = ingest_file(p, png_bytes(), name="poison.png")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="blew up"):
            run_job(p, intake.job_id)
    final = run_job(p, intake.job_id)
    assert final.state == "failed" and not final.ran
    with p.db.read_session() as s:
        job = s.get(models.Job, intake.job_id)
        assert job.state == "failed" and "gave up after 2 attempts" in job.error and "blew up" in job.error


def test_unknown_schema_is_refused_before_any_work(make_pipeline: Any, engine_client: Any, tmp_path: Path) -> None:
    p = make_pipeline(client=engine_client)
    before = row_counts(p)
    with pytest.raises(UnknownSchemaError, match="unknown extraction schema 'nope'"):
        ingest_file(p, png_bytes(), schema="nope")
    (tmp_path / "in").mkdir()
    with pytest.raises(UnknownSchemaError):
        iter_folder(p, tmp_path / "in", schema="nope")  # raised by the call, before any outcome
    assert row_counts(p) == before


def test_user_schema_end_to_end(make_pipeline: Any, engine_client: Any) -> None:
    p = make_pipeline(client=engine_client)
    definition = {"type": "object", "additionalProperties": False, "required": ["colour", "count"],
                  "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                 "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
    with p.db.session() as s:
        register_schema(s, "swatch", definition, prompt="Which colour is this swatch?")
    image = png_bytes()
    intake = ingest_file(p, image, name="swatch.png", schema="swatch")
    assert run_job(p, intake.job_id).state == "succeeded"
    merged = get_results(p, intake.document_id)["results"][0]["document"]
    jsonschema.validate(merged["data"], definition)
    assert set(merged["confidence"]["fields"]) == {"/colour", "/count"}
    # the same file with another schema: the same document, a new job
    generic = ingest_file(p, image, name="swatch.png", schema="generic")
    assert generic.outcome == "new" and generic.document_id == intake.document_id
    assert generic.job_id != intake.job_id


def test_folder_ingestion_skips_files_being_written(make_pipeline: Any, engine_client: Any, tmp_path: Path) -> None:
    folder = tmp_path / "watch"
    (folder / "done").mkdir(parents=True)
    (folder / "a.png").write_bytes(png_bytes())
    (folder / "done" / "old.png").write_bytes(png_bytes())  # already processed by a watch run
    (folder / ".partial.png").write_bytes(png_bytes())
    p = make_pipeline(client=engine_client)
    growing = folder / "growing.png"
    data = png_bytes(128, 128)
    growing.write_bytes(data[:100])

    def finish_writing() -> None:
        import time

        time.sleep(0.2)
        growing.write_bytes(data)

    writer = threading.Thread(target=finish_writing)
    writer.start()
    outcomes = list(iter_folder(p, folder, stable_seconds=0.6))
    writer.join()
    by_name = {o.name: o.outcome for o in outcomes}
    assert by_name == {"a.png": "new", "growing.png": "unstable"}
    later = {o.name: o.outcome for o in iter_folder(p, folder, stable_seconds=0.0)}
    assert later == {"a.png": "duplicate", "growing.png": "new"}


def test_many_processes_starting_at_once_migrate_once(database_url: str, tmp_path: Path) -> None:
    """Workers and API servers all build a Pipeline (which migrates) at start-up, often at the same moment."""
    from pipeline.context import Pipeline
    from pipeline.settings import Settings

    code = ("import sys; from pipeline.context import Pipeline; from pipeline.settings import Settings; "
            "Pipeline(Settings(data_dir=sys.argv[1], database_url=sys.argv[2])).close()")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "data"), database_url], env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
    p = Pipeline(Settings(data_dir=tmp_path / "data", database_url=database_url))
    with p.db.read_session() as s:
        assert s.scalar(select(func.count()).select_from(models.Schema)) == 6
    p.close()


class HalfBroken:
    """Answers page 0 with a valid JSON object and every other page with text that is not JSON. The behaviour
    under test is the job state machine, not the model."""

    model_key, model_fingerprint, engine_version = "halfbroken" * 6 + "abcd", "fp-test", "0"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, requests: Any) -> Any:
        from pipeline.engine_client import EngineReply

        for request in requests:
            self.calls += 1
            prompt = request.messages[0]["content"][-1]["text"]
            if "This is page 1." in prompt:
                text = json.dumps({"colour": "red"})
                yield EngineReply(text=text, finish_reason="stop", token_texts=[text], token_logprobs=[-0.5])
            else:
                yield EngineReply(text="I cannot read this", finish_reason="stop")


def test_partial_job_keeps_failed_page_reasons(make_pipeline: Any, tmp_path: Path) -> None:
    doc = fitz.open()
    for n in range(3):
        doc.new_page(width=200, height=200).insert_text((20, 40), f"page {n}")
    doc.save(tmp_path / "three.pdf")
    client = HalfBroken()
    p = make_pipeline(client=client)
    with p.db.session() as s:
        register_schema(s, "colour", {"type": "object", "properties": {"colour": {"type": "string"}},
                                      "required": ["colour"]})
    intake = ingest_file(p, tmp_path / "three.pdf", schema="colour")
    # page 2 could not be rendered (as a damaged page would be): it must fail without a model request
    with p.db.session() as s:
        page = s.scalars(select(models.Page).where(models.Page.document_id == intake.document_id,
                                                   models.Page.index == 2)).one()
        page.image_blob, page.error = None, "page 3 of three.pdf is damaged"
    run = run_job(p, intake.job_id)
    assert run.state == "partial" and client.calls == 2
    res = get_results(p, intake.document_id)["results"][0]
    assert "page 1: the answer is not JSON" in res["error"] and "page 2: page 3 of three.pdf is damaged" in res["error"]
    units = {u["unit"]: u for u in res["units"]}
    assert units["page:0"]["ok"] and not units["page:1"]["ok"] and not units["page:2"]["ok"]
    assert units["page:1"]["raw_text"] == "I cannot read this"  # kept for diagnosis
    assert res["document"]["data"] == {"colour": "red"}  # merged from the pages that worked
    assert res["document"]["provenance"]["model_fingerprint"] == "fp-test"
    with p.db.read_session() as s:
        text = s.scalars(select(models.Page.text_layer).where(models.Page.document_id == intake.document_id,
                                                               models.Page.index == 0)).one()
    assert "page 0" in text  # the PDF text layer is kept as anchor text


def test_anchor_text_reaches_the_prompt() -> None:
    from PIL import Image

    from pipeline.extraction import UnitInput, build_request, sampling_params
    from pipeline.settings import Settings

    settings = Settings(anchor_text_chars=12)
    unit = UnitInput(unit="page:4", page_index=4, images=[Image.new("RGB", (8, 8))], timestamps=[None],
                     anchor_text="Invoice 123 total 45.00 EUR")
    params = sampling_params({"type": "object", "properties": {}}, settings)
    request = build_request(unit, "Read it.", params, settings)
    [message] = request.messages
    kinds = [part["type"] for part in message["content"]]
    assert kinds == ["image", "text"]
    prompt = message["content"][-1]["text"]
    assert prompt.startswith("Read it.") and "This is page 5." in prompt
    assert "Invoice 123 " in prompt and "total" not in prompt  # cut at anchor_text_chars
    assert request.params.logprobs and request.params.json_schema is not None
    video = UnitInput(unit="video", page_index=None, images=[Image.new("RGB", (8, 8))] * 4,
                      timestamps=[0.0, 0.5, 1.0, 1.5])
    part = build_request(video, "Watch.", params, settings).messages[0]["content"][0]
    # Sampled once, at render time: the engine gets the frames' own times and does not sample again.
    assert part["type"] == "video" and len(part["video"]) == 4 and part["timestamps"] == [0.0, 0.5, 1.0, 1.5]
    assert "fps" not in part


def test_same_bytes_ingested_at_once_make_one_document(database_url: str, make_pipeline: Any,
                                                       engine_client: Any) -> None:
    p = make_pipeline(database_url, client=engine_client)
    data = png_bytes(300, 200)
    outcomes, errors = run_at_once([lambda: ingest_file(p, data, name="same.png")] * 4)
    assert errors == []
    assert len({o.document_id for o in outcomes}) == 1 and len({o.job_id for o in outcomes}) == 1
    assert sorted(o.outcome for o in outcomes) == ["duplicate"] * 3 + ["new"]
    counts = row_counts(p)
    assert (counts["documents"], counts["pages"], counts["jobs"]) == (1, 1, 1)


def test_schemas_registered_at_once_get_distinct_versions(database_url: str, make_pipeline: Any) -> None:
    p = make_pipeline(database_url)

    def register(n: int) -> int:
        definition = {"type": "object", "properties": {f"field{n}": {"type": "string", "maxLength": 8}}}
        with p.db.session() as s:
            return register_schema(s, "race", definition).version

    versions, errors = run_at_once([lambda n=n: register(n) for n in range(4)])
    assert errors == [] and sorted(versions) == [1, 2, 3, 4]


def test_queries_filter_and_paginate(database_url: str, make_pipeline: Any, engine_client: Any) -> None:
    from datetime import datetime, timedelta, timezone

    from pipeline.queries import get_document, jobs_by_state, list_documents

    p = make_pipeline(database_url, client=engine_client)
    done = [ingest_file(p, png_bytes(), name=f"d{i}.png") for i in range(3)]
    for o in done[:2]:
        run_job(p, o.job_id)
    broken = ingest_file(p, b"%PDF-1.7 nothing else", name="broken.pdf")
    invoice = ingest_file(p, png_bytes(), name="inv.png", schema="invoice")

    by_status = {s: [d["name"] for d in list_documents(p, status=s)] for s in ("succeeded", "queued", "failed")}
    assert by_status == {"succeeded": ["d0.png", "d1.png"], "queued": ["d2.png", "inv.png"],
                         "failed": ["broken.pdf"]}
    assert [d["name"] for d in list_documents(p, schema="invoice")] == ["inv.png"]
    first = list_documents(p, limit=2)
    rest = list_documents(p, after_id=first[-1]["id"])
    assert [d["id"] for d in first + rest] == sorted({o.document_id for o in done + [broken, invoice]})
    soon = datetime.now(timezone.utc) + timedelta(minutes=1)
    assert list_documents(p, created_after=soon) == [] and len(list_documents(p, created_before=soon)) == 5
    assert jobs_by_state(p) == {"queued": 2, "running": 0, "succeeded": 2, "partial": 0, "failed": 0}
    doc = get_document(p, broken.document_id)
    assert doc["status"] == "failed" and doc["error_type"] and doc["jobs"] == [] and doc["pages"] == []


def test_retry_and_stale_jobs(make_pipeline: Any, engine_client: Any) -> None:
    from datetime import timedelta

    from pipeline.errors import JobStateError, NotFoundError
    from pipeline.jobs import retry_job, stale_jobs
    from pipeline.models import utcnow

    p = make_pipeline(client=engine_client)
    ok = ingest_file(p, png_bytes(), name="ok.png")
    assert run_job(p, ok.job_id).state == "succeeded"
    with pytest.raises(JobStateError, match="only failed or partial"):
        retry_job(p, ok.job_id)
    with pytest.raises(NotFoundError):
        retry_job(p, 987654)

    with p.db.session() as s:  # make it look failed, as a poison job would end
        s.get(models.Job, ok.job_id).state = "failed"
    retry_job(p, ok.job_id)
    with p.db.read_session() as s:
        job = s.get(models.Job, ok.job_id)
        assert (job.state, job.attempts, job.error) == ("queued", 0, None)
    assert results_of(p, ok.job_id) == []
    assert run_job(p, ok.job_id).state == "succeeded" and len(results_of(p, ok.job_id)) == 2

    queued = ingest_file(p, png_bytes(), name="queued.png")
    lost = ingest_file(p, png_bytes(), name="lost.png")
    assert stale_jobs(p, queued_for_s=3600) == []  # fresh queued jobs are not stale yet
    assert sorted(stale_jobs(p, queued_for_s=0)) == sorted([queued.job_id, lost.job_id])
    with p.db.session() as s:  # a worker on another machine took it, then vanished: its lease ran out
        job = s.get(models.Job, lost.job_id)
        job.state, job.owner, job.attempts = "running", "other-host:1234", 1
        job.lease_until = utcnow() - timedelta(seconds=1)
    assert stale_jobs(p, queued_for_s=3600) == [lost.job_id]
    assert run_job(p, lost.job_id).state == "succeeded"  # the lease passed: taken over without asking


def test_files_over_the_size_limit_fail_with_the_setting_named(make_pipeline: Any, tmp_path: Path) -> None:
    import io

    p = make_pipeline(max_file_bytes=2000)
    big = png_bytes(400, 400) + os.urandom(4000)  # trailing bytes keep it over the limit whatever PNG compresses to
    (tmp_path / "big.png").write_bytes(big)
    for source in (tmp_path / "big.png", big, io.BytesIO(big)):
        out = ingest_file(p, source, name="big.png")
        assert out.outcome == "failed" and out.error_type == "LimitExceededError"
        assert "DOCPIPE_MAX_FILE_BYTES" in out.error and out.document_id is None
    assert row_counts(p)["documents"] == 0
    assert not any(f.is_file() for f in p.blobs.root.rglob("*"))  # nothing of the refused files was kept
