"""The job state machine and `run_job`, the one function that turns a queued job into results.

States: queued -> running -> succeeded | partial | failed. Every transition is one database transaction that
checks the state it expects (compare-and-set), so concurrent or repeated deliveries cannot both act. A job's
document may still be `received` (stored, not rendered: see pipeline.rendering); `run_job` renders it before
claiming the job, and a document that turns out unreadable fails its queued jobs with its reason
(queued -> failed, without a run).

Idempotence. A job's results are unique per (job, unit) in the database. `run_job` writes each page result in its
own transaction as soon as it arrives, skips units that already have a result (a re-run after a crash resumes
where the crash happened), and writes the merged document result in the same transaction as the final state. So a
job run twice (crash, broker redelivery, two workers) ends with exactly one result set.

Ownership. Claiming a job increments `runs`; that number is the run's fencing token. Every later write of the
run checks `runs == token AND state == 'running'`: a run that was taken over stops writing. A running job may
be taken over when its lease passed, when its owner process (host:pid) is gone from this host (pipeline.leases),
or when the caller says `takeover=True` (e.g. a broker redelivery after the worker died). Each claim is charged an
attempt; after `job_max_attempts` the job is failed with the last error (a poison document never loops). A run that
died among other runs is refunded and its job runs alone next (see pipeline.attempts): a crash costs only its cause.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, cast

import jsonschema
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from .attempts import RUN_GATE, render_for_job_capped
from .context import Pipeline
from .db import rows_matched
from .errors import JobStateError, NotFoundError
from .extraction import (
    PngImage,
    UnitInput,
    UnitOutcome,
    build_request,
    interpret_reply,
    load_png,
    sampling_params,
    sampling_record,
)
from .leases import aware, run_lapsed, this_owner
from .merge import UnitData, merge_units
from .models import DocumentStatus, Job, JobState, Page, Result, utcnow
from .page_feed import stream_replies
from .quotas import JobCap, take_job_slots

DOCUMENT_UNIT = "document"


@dataclass
class JobRun:
    """What one `run_job` call did. `ran` is False when the job was finished, busy elsewhere or taken over."""

    job_id: int
    state: str
    ran: bool
    note: str = ""
    units_total: int = 0
    units_done_now: int = 0
    model_seconds: float = 0.0
    overhead_seconds: float = 0.0  # wall time of this call not spent waiting on the engine


@dataclass
class _Claim:
    token: int
    document_id: int
    schema_name: str
    schema_version: int
    json_schema: dict[str, Any]
    prompt: str
    merge_rules: dict[str, str]
    kind: str | None
    pages: list[dict[str, Any]] = field(default_factory=list)
    done_units: set[str] = field(default_factory=set)


def _fenced(job_id: int, token: int) -> Any:
    return (Job.id == job_id) & (Job.runs == token) & (Job.state == JobState.running.value)


class _NeedsIsolation(Exception):
    """The claim found a run that died: this run must be alone in its process, and the caller is not."""


def _taken_over(takeover: bool, lease: datetime | None, owner: str | None, now: datetime) -> bool:
    """Whether a `running` job's run may be taken over: asked for, or its run lapsed (pipeline.leases)."""
    return takeover or run_lapsed(lease, owner, now)


def _needs_isolation(p: Pipeline, job_id: int, takeover: bool) -> bool:
    """Whether this run of the job must be alone in its process: the job is marked so, or its last run died (a
    claim will take it over and mark it). A job running healthily elsewhere needs no gate: the claim declines."""
    with p.db.read_session() as s:
        row = s.execute(select(Job.isolated, Job.state, Job.lease_until, Job.owner).where(Job.id == job_id)).first()
    if row is None or row.state not in (JobState.queued.value, JobState.running.value):
        return False
    if row.state == JobState.running.value:
        return _taken_over(takeover, row.lease_until, row.owner, utcnow())
    return bool(row.isolated)


def _charge_died_run(job: Job, alone: bool) -> None:
    """The job's last run never released it (died or hung). Died alone: it caused it, the attempt it was charged
    stays. Died among others: refund it, and run it alone now. Either way this run must be alone (raises
    _NeedsIsolation when it is not)."""
    if not alone:
        raise _NeedsIsolation()
    if job.isolated:
        job.error = "the worker process stopped while running this job alone"
        return
    job.attempts = max(0, job.attempts - 1)
    job.isolated = True


def _claim(p: Pipeline, job_id: int, takeover: bool, alone: bool = False) -> _Claim | JobRun:
    now = utcnow()
    with p.db.session() as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None:
            raise NotFoundError("job", job_id)
        state = JobState(job.state)
        if state.finished:
            return JobRun(job_id, job.state, ran=False, note="already finished")
        document_status = job.document.status
        if document_status == DocumentStatus.failed.value:  # unreadable: this job can never run
            job.state, job.error = JobState.failed.value, job.document.error
            job.finished_at = job.updated_at = now
            job.owner, job.lease_until = None, None
            return JobRun(job_id, job.state, ran=False, note="the document could not be read")
        if document_status == DocumentStatus.received.value:  # read again since our render (a retry)
            return JobRun(job_id, job.state, ran=False, note="the document is not rendered yet")
        if state is JobState.running:
            lease = aware(job.lease_until)
            if not _taken_over(takeover, lease, job.owner, now):
                return JobRun(job_id, job.state, ran=False,
                              note=f"running in {job.owner} (lease until {lease:%H:%M:%S} UTC)")
            _charge_died_run(job, alone)
        elif job.isolated and not alone:
            raise _NeedsIsolation()
        if job.attempts >= p.settings.job_max_attempts:
            job.state = JobState.failed.value
            job.error = f"gave up after {job.attempts} attempts; last error: {job.error or 'the worker died'}"
            job.finished_at = job.updated_at = now
            job.owner, job.lease_until = None, None
            return JobRun(job_id, job.state, ran=False, note="attempt cap reached")
        job.state = JobState.running.value
        job.attempts += 1
        job.runs += 1
        job.owner = this_owner()
        job.lease_until = now + timedelta(seconds=p.settings.job_lease_s)
        job.started_at = job.started_at or now
        job.updated_at = now
        schema = job.schema
        pages = s.scalars(select(Page).where(Page.document_id == job.document_id).order_by(Page.index)).all()
        done = set(s.scalars(select(Result.unit).where(Result.job_id == job_id)))
        return _Claim(
            token=job.runs,
            document_id=job.document_id,
            schema_name=schema.name,
            schema_version=schema.version,
            json_schema=schema.json_schema,
            prompt=schema.prompt,
            merge_rules=dict(schema.merge_rules or {}),
            kind=job.document.kind,
            pages=[
                {"index": pg.index, "kind": pg.kind, "blob": pg.image_blob, "timestamp": pg.timestamp,
                 "text": pg.text_layer, "error": pg.error}
                for pg in pages
            ],
            done_units=done,
        )


def _units(claim: _Claim) -> tuple[list[str], list[tuple[str, int | None, str]], list[dict[str, Any]]]:
    """(all unit names, units failed before the model (name, page, reason), pages grouped per runnable unit)."""
    if claim.kind == "video":
        good = [pg for pg in claim.pages if pg["blob"] and not pg["error"]]
        if good:
            return ["video"], [], [{"unit": "video", "page_index": None, "pages": good}]
        reasons = "; ".join(pg["error"] for pg in claim.pages if pg["error"]) or "no frames were decoded"
        return ["video"], [("video", None, reasons)], []
    names, failed, runnable = [], [], []
    for pg in claim.pages:
        name = f"page:{pg['index']}"
        names.append(name)
        if pg["error"] or not pg["blob"]:
            failed.append((name, pg["index"], pg["error"] or "the page was not rendered"))
        else:
            runnable.append({"unit": name, "page_index": pg["index"], "pages": [pg]})
    return names, failed, runnable


def _write_unit(
    p: Pipeline, job_id: int, claim: _Claim, unit: str, page_index: int | None, outcome: UnitOutcome,
    *, provenance: dict[str, Any], prompt_tokens: int = 0, completion_tokens: int = 0, model_seconds: float = 0.0,
) -> bool:
    """Store one unit result and renew the lease; False when this run no longer owns the job."""
    now = utcnow()
    with p.db.session() as s:
        renewed = rows_matched(s.execute(
            update(Job)
            .where(_fenced(job_id, claim.token))
            .values(
                lease_until=now + timedelta(seconds=p.settings.job_lease_s),
                updated_at=now,
                prompt_tokens=Job.prompt_tokens + prompt_tokens,
                completion_tokens=Job.completion_tokens + completion_tokens,
                model_seconds=Job.model_seconds + model_seconds,
            )
        ))
        if not renewed:
            return False
        try:
            with s.begin_nested():
                s.add(_result_row(job_id, unit, page_index, outcome, claim, provenance,
                                  prompt_tokens, completion_tokens))
        except IntegrityError:
            pass  # this unit was stored by an earlier attempt: keep that one
    return True


def _result_row(job_id: int, unit: str, page_index: int | None, outcome: UnitOutcome, claim: _Claim,
                provenance: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> Result:
    return Result(
        job_id=job_id,
        document_id=provenance["document_id"],
        unit=unit,
        page_index=page_index,
        ok=outcome.ok,
        data=outcome.data,
        confidence=outcome.confidence.as_json() if outcome.confidence else None,
        raw_text=outcome.raw_text,
        error=outcome.error,
        model_fingerprint=provenance.get("model_fingerprint"),
        engine_version=provenance.get("engine_version"),
        schema_name=claim.schema_name,
        schema_version=claim.schema_version,
        sampling=provenance.get("sampling"),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


def _finish(p: Pipeline, job_id: int, claim: _Claim, unit_names: list[str], provenance: dict[str, Any]) -> str | None:
    """Merge, store the document result and set the final state, in one transaction. None if taken over."""
    now = utcnow()
    with p.db.session() as s:
        job = s.scalars(select(Job).where(_fenced(job_id, claim.token)).with_for_update()).first()
        if job is None:
            return None
        rows = {r.unit: r for r in s.scalars(select(Result).where(Result.job_id == job_id))}
        ok_rows = sorted((rows[u] for u in unit_names if u in rows and rows[u].ok),
                         key=lambda r: (r.page_index is None, r.page_index or 0))
        failed = [(u, rows[u].error if u in rows else "no result was stored") for u in unit_names
                  if u not in rows or not rows[u].ok]
        if ok_rows and DOCUMENT_UNIT not in rows:
            merged = merge_units(
                [UnitData(cast(dict[str, Any], r.data), (r.confidence or {}).get("fields", {}))  # ok: the object
                 for r in ok_rows],
                claim.json_schema, claim.merge_rules,
            )
            problems = list(jsonschema.Draft202012Validator(claim.json_schema).iter_errors(merged.data))
            overall = [c["overall"] for c in (r.confidence for r in ok_rows) if c and c.get("overall") is not None]
            s.add(Result(
                job_id=job_id, document_id=job.document_id, unit=DOCUMENT_UNIT, page_index=None,
                ok=not problems, data=merged.data,
                confidence={"overall": min(overall) if overall else None, "fields": merged.fields},
                raw_text=None,
                error=f"merged result does not match the schema: {problems[0].message}" if problems else None,
                model_fingerprint=provenance.get("model_fingerprint"), engine_version=provenance.get("engine_version"),
                schema_name=claim.schema_name, schema_version=claim.schema_version,
                sampling=provenance.get("sampling"),
                prompt_tokens=sum(r.prompt_tokens for r in ok_rows),
                completion_tokens=sum(r.completion_tokens for r in ok_rows),
            ))
        if not unit_names:
            state, error = JobState.failed, "the document has no pages"
        elif not ok_rows:
            state, error = JobState.failed, _summarise(failed)
        elif failed:
            state, error = JobState.partial, _summarise(failed)
        else:
            state, error = JobState.succeeded, None
        job.state, job.error = state.value, error
        job.finished_at = job.updated_at = now
        job.owner, job.lease_until = None, None
        return job.state


def _summarise(failed: list[tuple[str, str | None]], limit: int = 2000) -> str:
    text = "; ".join(f"{unit.replace(':', ' ')}: {reason}" for unit, reason in failed)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _release(p: Pipeline, job_id: int, token: int, *, error: str | None, count_attempt: bool) -> str:
    """After an exception: back to queued (or failed once attempts are spent)."""
    now = utcnow()
    with p.db.session() as s:
        job = s.scalars(select(Job).where(_fenced(job_id, token)).with_for_update()).first()
        if job is None:
            return "superseded"
        if not count_attempt:
            job.attempts -= 1
        spent = job.attempts >= p.settings.job_max_attempts
        job.state = (JobState.failed if spent else JobState.queued).value
        job.error = error if not spent else f"gave up after {job.attempts} attempts; last error: {error}"
        job.owner, job.lease_until, job.updated_at = None, None, now
        if spent:
            job.finished_at = now
        return job.state


def run_job(
    p: Pipeline, job_id: int, *, takeover: bool = False, on_unit: Callable[[str, bool, int], None] | None = None
) -> JobRun:
    """Run one job to a final state (or resume it). Safe to call any number of times, from any process.

    Returns without work when the job is finished or running elsewhere. An exception from the engine puts the job
    back to `queued` (or `failed` when attempts are spent), records it, and is raised again so a queue can retry.
    `on_unit(unit, ok, pages)` is called after each unit result is stored (progress display).
    """
    started = time.perf_counter()
    render_for_job_capped(p, job_id)  # a `received` document is rendered first; unreadable -> its jobs fail
    alone = _needs_isolation(p, job_id, takeover)
    while True:
        try:
            with RUN_GATE.alone() if alone else RUN_GATE.shared():
                return _run_claimed(p, job_id, takeover, alone, started, on_unit)
        except _NeedsIsolation:  # the job's state changed since we looked: run it again, alone
            if alone:
                raise RuntimeError(f"job {job_id}: a claim made alone asked to be alone") from None
            alone = True


def _run_claimed(p: Pipeline, job_id: int, takeover: bool, alone: bool, started: float,
                 on_unit: Callable[[str, bool, int], None] | None) -> JobRun:
    claim = _claim(p, job_id, takeover, alone)
    if isinstance(claim, JobRun):
        return claim
    model_seconds = 0.0
    try:
        client = p.client
        params = sampling_params(claim.json_schema, p.settings)
        provenance = {"document_id": claim.document_id, "model_fingerprint": client.model_fingerprint,
                      "engine_version": client.engine_version, "sampling": sampling_record(params)}
        unit_names, failed_early, runnable = _units(claim)
        for name, page_index, reason in failed_early:
            if name not in claim.done_units and not _write_unit(
                p, job_id, claim, name, page_index, UnitOutcome(False, None, None, None, reason), provenance=provenance
            ):
                return JobRun(job_id, "running", ran=False, note="taken over by another attempt")
        todo = [u for u in runnable if u["unit"] not in claim.done_units]
        done_now = 0
        # Each page goes to the engine as soon as the process has a page slot free, while earlier replies are
        # stored: the engine batches pages of all running jobs (pipeline.page_feed).
        replies = stream_replies(client, todo, lambda u: build_request(_unit_input(p, u), claim.prompt, params,
                                                                       p.settings), p.page_slots)
        try:
            for got in replies:
                unit, reply = got.unit, got.reply
                model_seconds += got.waited
                outcome = interpret_reply(reply, claim.json_schema, params.max_tokens)
                if not _write_unit(p, job_id, claim, unit["unit"], unit["page_index"], outcome,
                                   provenance=provenance, prompt_tokens=reply.prompt_tokens,
                                   completion_tokens=reply.completion_tokens, model_seconds=got.waited):
                    return JobRun(job_id, "running", ran=False, note="taken over by another attempt")
                done_now += 1
                if on_unit is not None:
                    on_unit(unit["unit"], outcome.ok, len(unit["pages"]))
        finally:  # taken over or failed: this run's pages still at the engine are cancelled, their slots freed
            replies.close()
        state = _finish(p, job_id, claim, unit_names, provenance)
        if state is None:
            return JobRun(job_id, "running", ran=False, note="taken over by another attempt")
        total = time.perf_counter() - started
        return JobRun(job_id, state, ran=True, units_total=len(unit_names), units_done_now=done_now,
                      model_seconds=model_seconds, overhead_seconds=total - model_seconds)
    except KeyboardInterrupt:
        _release(p, job_id, claim.token, error="interrupted", count_attempt=False)
        raise
    except Exception as exc:
        _release(p, job_id, claim.token, error=f"{type(exc).__name__}: {exc}", count_attempt=True)
        raise


def _unit_input(p: Pipeline, unit: dict[str, Any]) -> UnitInput:
    pages = unit["pages"]
    # A client that prepares prompts in preparation processes takes the PNG bytes: they are decoded there.
    encoded = bool(getattr(p.client, "prepares_pages", False))
    return UnitInput(
        unit=unit["unit"],
        page_index=unit["page_index"],
        images=[PngImage(p.blobs.get_bytes(pg["blob"])) if encoded else _page_image(p, pg["blob"]) for pg in pages],
        timestamps=[pg["timestamp"] for pg in pages],
        anchor_text=pages[0]["text"] if unit["unit"] != "video" else None,
    )


def _page_image(p: Pipeline, key: str) -> Any:
    image = p.images.get(key)
    if image is None:
        image = load_png(p.blobs.get_bytes(key))
        p.images.put(key, image)
    return image


def retry_job(p: Pipeline, job_id: int, *, cap_limit: int | None = None) -> None:
    """Put a failed or partial job back in the queue with its results cleared (the API's retry). With
    `cap_limit`, only while its document's tenant has fewer active jobs (QuotaExceededError otherwise)."""
    with p.db.session() as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None:
            raise NotFoundError("job", job_id)
        if job.state not in (JobState.failed.value, JobState.partial.value):
            raise JobStateError(f"job {job_id} is {job.state}; only failed or partial jobs can be retried")
        if cap_limit is not None:
            take_job_slots(s, JobCap(job.document.tenant, cap_limit))
        for row in list(job.results):
            s.delete(row)
        if job.document.status == DocumentStatus.failed.value:  # read the file again (e.g. a decoder timeout)
            job.document.status, job.document.error, job.document.error_type = DocumentStatus.received.value, None, None
            job.document.render_attempts = 0
        job.state, job.error, job.attempts, job.isolated = JobState.queued.value, None, 0, False
        job.owner = job.lease_until = job.finished_at = None
        job.prompt_tokens = job.completion_tokens = 0
        job.model_seconds = 0.0
        job.updated_at = utcnow()


def fail_job(p: Pipeline, job_id: int, reason: str) -> bool:
    """Fail a `queued` job for good with `reason`: a permanent error that would fail every run the same way (a
    queue worker's verdict on bad input), or a document that turned out unreadable. Compare-and-set on `queued`:
    a job another process claimed meanwhile is left to it. True when this call failed the job."""
    now = utcnow()
    with p.db.session() as s:
        changed = rows_matched(s.execute(
            update(Job)
            .where(Job.id == job_id, Job.state == JobState.queued.value)
            .values(state=JobState.failed.value, error=reason[:2000], finished_at=now, updated_at=now,
                    owner=None, lease_until=None)
        ))
    return bool(changed)


def stale_jobs(p: Pipeline, *, queued_for_s: float) -> list[int]:
    """Jobs a reconciler should enqueue again: running past their lease (or with a dead local owner), or queued
    without progress for `queued_for_s` seconds (their broker message may be lost)."""
    now = utcnow()
    with p.db.read_session() as s:
        rows = s.execute(
            select(Job.id, Job.state, Job.lease_until, Job.owner, Job.updated_at).where(
                Job.state.in_([JobState.queued.value, JobState.running.value])
            )
        ).all()
    out = []
    for job_id, state, lease, owner, updated in rows:
        if state == JobState.running.value:
            if run_lapsed(lease, owner, now):
                out.append(job_id)
        elif aware(updated) <= now - timedelta(seconds=queued_for_s):
            out.append(job_id)
    return out
