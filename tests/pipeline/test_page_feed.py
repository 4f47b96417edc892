"""Jobs keep the engine full (pipeline.page_feed): every page of every running job goes to the engine as soon as
a page slot is free, bounded per process by DOCPIPE_ENGINE_PAGES_IN_FLIGHT; a failing page stops no other;
closing early cancels what is still at the engine."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

import pymupdf
import pytest

from pipeline.context import Pipeline
from pipeline.engine_client import EngineClient, EngineReply, EngineRequest
from pipeline.ingest import ingest_file
from pipeline.jobs import run_job
from pipeline.models import Result
from pipeline.page_feed import PageSlots, stream_replies
from pipeline.schemas import register_schema
from pipeline.settings import Settings

COLOUR = {"type": "object", "properties": {"colour": {"type": "string"}}}
RED = '{"colour":"red"}'


class HeldEngine:
    """An engine client built with a 256-sequence batch that submits at once and answers a request only once
    `hold_until` requests are at it at the same time (or after `patience_s`), so the most it saw at once is the
    most the product kept there. Requests whose prompt names a page in `refuse` get an engine error."""

    model_key, model_fingerprint, engine_version = "scripted" * 8, "fp-feed-1", "engine-feed-1"
    max_num_seqs = 256

    def __init__(self, hold_until: int, refuse: Sequence[int] = (), patience_s: float = 3.0) -> None:
        self.hold_until, self.refuse, self.patience_s = hold_until, set(refuse), patience_s
        self.at_engine = self.peak = self.submitted = 0
        self._cond = threading.Condition()

    def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
        with self._cond:
            self.at_engine += len(requests)
            self.submitted += len(requests)
            self.peak = max(self.peak, self.at_engine)
            self._cond.notify_all()
        return self._answer([r.messages[0]["content"][-1]["text"] for r in requests])

    def _answer(self, prompts: list[str]) -> Iterator[EngineReply]:
        for prompt in prompts:
            with self._cond:
                self._cond.wait_for(lambda: self.peak >= self.hold_until, timeout=self.patience_s)
                self.at_engine -= 1
            if any(f"This is page {n + 1}." in prompt for n in self.refuse):
                yield EngineReply(text="", finish_reason="error", error="the engine refused the request: bad media")
            else:
                yield EngineReply(text=RED, finish_reason="stop", token_texts=list(RED), token_logprobs=[-0.1] * 16,
                                  prompt_tokens=5, completion_tokens=16)


def _pdf(path: Path, pages: int) -> Path:
    doc = pymupdf.open()
    for n in range(pages):
        doc.new_page(width=200, height=200).insert_text((20, 40), f"page {n}")
    doc.save(path)
    return path


def _pipeline(tmp_path: Path, client: Any, **settings: Any) -> Pipeline:
    p = Pipeline(Settings(data_dir=tmp_path / "data", stable_seconds=0, **settings), client=client)
    with p.db.session() as s:
        register_schema(s, "colour", COLOUR)
    return p


def test_all_pages_of_all_running_jobs_are_at_an_auto_sized_cuda_engine_at_once(tmp_path: Path) -> None:
    # 256 sequences, batch left to the engine (the H200 case): jobs used to send 2 pages at a time each
    client = HeldEngine(hold_until=10)
    p = _pipeline(tmp_path, client, runner="cuda")
    try:
        jobs = [ingest_file(p, _pdf(tmp_path / f"d{n}.pdf", 5), schema="colour").job_id for n in range(2)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=2) as pool:
            states = [r.state for r in pool.map(lambda j: run_job(p, j), jobs)]
        assert states == ["succeeded", "succeeded"]
        assert client.peak == 10 and p.page_slots.size == 512
        assert time.perf_counter() - t0 < client.patience_s  # nobody waited for a page still unsent
    finally:
        p.close()


def test_the_pages_in_flight_setting_bounds_all_jobs_of_the_process_together(tmp_path: Path) -> None:
    client = HeldEngine(hold_until=99, patience_s=0.05)  # never reached: each reply waits a little
    p = _pipeline(tmp_path, client, runner="cuda", engine_pages_in_flight=3)
    try:
        jobs = [ingest_file(p, _pdf(tmp_path / f"d{n}.pdf", 4), schema="colour").job_id for n in range(3)]
        with ThreadPoolExecutor(max_workers=3) as pool:
            assert [r.state for r in pool.map(lambda j: run_job(p, j), jobs)] == ["succeeded"] * 3
        assert client.peak == 3 and client.submitted == 12
        assert all(p.page_slots.acquire(blocking=False) for _ in range(3))  # every slot was given back
    finally:
        p.close()


def test_a_failing_page_stops_no_other_and_is_recorded_with_its_reason(tmp_path: Path) -> None:
    client = HeldEngine(hold_until=6, refuse=[1, 4])
    p = _pipeline(tmp_path, client, runner="cuda")
    try:
        job = ingest_file(p, _pdf(tmp_path / "six.pdf", 6), schema="colour").job_id
        assert job is not None and run_job(p, job).state == "partial"
        assert client.peak == 6  # the refused pages were at the engine with the others
        with p.db.read_session() as s:
            rows = {r.unit: (r.ok, r.error) for r in s.query(Result).filter(Result.job_id == job)}
        assert rows.pop("page:1") == rows.pop("page:4") == (False, "engine error: the engine refused the request: "
                                                                   "bad media")
        assert rows == {**{f"page:{n}": (True, None) for n in (0, 2, 3, 5)}, "document": (True, None)}
    finally:
        p.close()


class _Open:
    """One submission's replies (one reply, text str(n)); records in `closed` that it was closed."""

    def __init__(self, n: int, closed: list[int]) -> None:
        self.n, self.closed, self.done = n, closed, False

    def __iter__(self) -> "_Open":
        return self

    def __next__(self) -> EngineReply:
        if self.done:
            raise StopIteration
        self.done = True
        return EngineReply(text=str(self.n), finish_reason="stop")

    def close(self) -> None:
        self.closed.append(self.n)


class Recorded:
    """A client whose reply iterators record that they were closed; submission n answers with text str(n)."""

    def __init__(self) -> None:
        self.closed: list[int] = []
        self.started = 0

    def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
        self.started += 1
        return _Open(self.started - 1, self.closed)


def test_closing_the_stream_early_closes_every_open_request_and_frees_its_slot() -> None:
    client, slots = Recorded(), PageSlots(3)
    units = [{"unit": f"page:{n}"} for n in range(5)]
    stream = stream_replies(client, units, lambda u: EngineRequest(messages=[], params=None), slots)  # type: ignore
    first = next(stream)
    assert (first.unit["unit"], first.reply.text, client.started) == ("page:0", "0", 3)  # 3 slots, 3 submitted
    stream.close()  # e.g. the run was taken over
    assert sorted(client.closed) == [0, 1, 2] and client.started == 3
    assert [slots.acquire(blocking=False) for _ in range(4)] == [True, True, True, False]


def test_a_request_that_cannot_be_built_frees_its_slot_and_fails_the_stream() -> None:
    client, slots = Recorded(), PageSlots(2)

    def build(unit: dict[str, Any]) -> EngineRequest:
        if unit["unit"] == "page:1":
            raise OSError("the page's blob is gone")
        return EngineRequest(messages=[], params=None)  # type: ignore[arg-type]

    stream = stream_replies(client, [{"unit": "page:0"}, {"unit": "page:1"}], build, slots)
    with pytest.raises(OSError):
        next(stream)
    assert client.closed == [0] and [slots.acquire(blocking=False) for _ in range(3)] == [True, True, False]


class _Handle:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def result(self, timeout: float | None = None) -> Any:
        from gpu_engine.params import RequestOutput

        return RequestOutput(request_id=self.name, text=RED, finish_reason="stop", token_ids=[], finished=True)

    def cancel(self) -> None:
        self.log.append(f"cancel {self.name}")


class _Front:
    def __init__(self) -> None:
        self.log: list[str] = []

    def submit(self, messages: Any, params: Any) -> _Handle:
        self.log.append(f"submit {len(self.log)}")
        return _Handle(self.log, str(len(self.log) - 1))


def test_the_engine_client_submits_before_returning_and_cancels_what_a_closed_run_left(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    front = _Front()
    client = EngineClient(front, model_dir=tmp_path, fingerprint="fp", timeout_s=5)
    request = EngineRequest(messages=[], params=None)  # type: ignore[arg-type]
    replies = client.run([request, request, request])
    assert front.log == ["submit 0", "submit 1", "submit 2"]  # at the engine before the first reply is asked for
    assert next(replies).text == RED
    replies.close()
    assert front.log[3:] == ["cancel 1", "cancel 2"]
