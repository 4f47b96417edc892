"""`docpipe process` takes files in on several intake threads (DOCPIPE_EMBEDDED_RENDERS): intake renders, so one
thread alone put rendering on the critical path of every file. Two files must be in intake at the same time, and
their jobs still start and report in file order."""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pymupdf as fitz
import pytest

import pipeline.walk
from pipeline.engine_client import EngineReply, EngineRequest
from pipeline.processing import process_paths
from pipeline.schemas import register_schema
from pipeline.settings import Settings

COLOUR = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}


class Red:
    model_key, model_fingerprint, engine_version = "scripted" * 8, "fp-intake-1", "engine-intake-1"

    def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
        for _ in requests:
            yield EngineReply(text='{"colour":"red"}', finish_reason="stop", token_texts=list('{"colour":"red"}'),
                              token_logprobs=[-0.1] * 16, prompt_tokens=5, completion_tokens=16)


def write_pdfs(folder: Path, n: int) -> None:
    folder.mkdir()
    for i in range(n):
        doc = fitz.open()
        doc.new_page(width=200, height=200).insert_text((20, 40), f"document {i}")
        doc.save(folder / f"doc{i}.pdf")


def test_files_are_taken_in_two_at_a_time(make_pipeline: Any, tmp_path: Path, monkeypatch: Any) -> None:
    p = make_pipeline(client=Red(), embedded_renders=2)
    with p.db.session() as s:
        register_schema(s, "colour", COLOUR)
    write_pdfs(tmp_path / "in", 4)
    together = threading.Barrier(2, timeout=20)  # a serial intake never gets two threads here: it breaks
    real = pipeline.walk.ingest_file

    def paired(*args: Any, **kwargs: Any) -> Any:
        together.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline.walk, "ingest_file", paired)
    report = process_paths(p, [tmp_path / "in"], schema="colour")
    assert [f.name for f in report.files] == [f"doc{i}.pdf" for i in range(4)]
    assert [f.state for f in report.files] == ["succeeded"] * 4


def test_one_intake_thread_is_serial(make_pipeline: Any, tmp_path: Path, monkeypatch: Any) -> None:
    p = make_pipeline(client=Red(), embedded_renders=1)
    with p.db.session() as s:
        register_schema(s, "colour", COLOUR)
    write_pdfs(tmp_path / "in", 2)
    together = threading.Barrier(2, timeout=2)
    monkeypatch.setattr(pipeline.walk, "ingest_file", lambda *a, **k: together.wait())
    with pytest.raises(threading.BrokenBarrierError):
        process_paths(p, [tmp_path / "in"], schema="colour")


def test_default_is_half_the_cpus_between_one_and_eight(tmp_path: Path, monkeypatch: Any) -> None:
    for cpus, want in ((1, 1), (2, 1), (16, 8), (64, 8)):
        monkeypatch.setattr("os.cpu_count", lambda cpus=cpus: cpus)
        assert Settings(data_dir=tmp_path).embedded_render_threads() == want
    assert Settings(data_dir=tmp_path, embedded_renders=3).embedded_render_threads() == 3
