"""The pipeline's engine batch settings (DOCPIPE_ENGINE_MAX_NUM_SEQS / _MAX_BATCHED_TOKENS, 0 = the runner's
default): small fixed values on the reference runner, AUTO for the cuda engine to size, explicit values kept."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.settings import REFERENCE_MAX_BATCHED_TOKENS, REFERENCE_MAX_NUM_SEQS, Settings


def test_reference_runner_keeps_the_small_defaults(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.engine_batch() == (REFERENCE_MAX_NUM_SEQS, REFERENCE_MAX_BATCHED_TOKENS) == (16, 2048)
    assert s.engine_job_slots() == 16


def test_cuda_leaves_the_sizes_to_the_engine_and_assumes_its_cap_for_job_slots(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path, runner="cuda")
    assert s.engine_batch() == (0, 0)
    assert s.engine_job_slots() == 256
    assert Settings(data_dir=tmp_path, runner="cuda", engine_max_num_seqs=64).engine_batch() == (64, 0)
    assert Settings(data_dir=tmp_path, runner="cuda", engine_max_num_seqs=64).engine_job_slots() == 64


def test_explicit_values_win_and_the_step_holds_every_sequence(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path, engine_max_num_seqs=40, engine_max_batched_tokens=24)
    assert s.engine_batch() == (40, 40)  # a step carries one token of every running sequence
    assert Settings(data_dir=tmp_path, engine_max_num_seqs=300).engine_batch() == (300, 2048)
    assert Settings(data_dir=tmp_path, runner="cuda", engine_max_num_seqs=64,
                    engine_max_batched_tokens=32).engine_batch() == (64, 64)


def test_the_engine_client_reports_the_batch_it_was_built_with(tmp_path: Path) -> None:
    from pipeline.engine_client import EngineClient

    client = EngineClient.from_settings(Settings(data_dir=tmp_path, engine_max_num_seqs=6))
    try:
        assert client.max_num_seqs == 6
    finally:
        client.close()


def test_embedded_jobs_fill_the_engine_on_cuda_and_stay_four_on_reference(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path).embedded_job_threads() == 4
    assert Settings(data_dir=tmp_path, runner="cuda").embedded_job_threads() == 256
    assert Settings(data_dir=tmp_path, runner="cuda", engine_max_num_seqs=32).embedded_job_threads() == 32
    assert Settings(data_dir=tmp_path, runner="cuda", embedded_jobs=3).embedded_job_threads() == 3


def test_page_windows_bound_the_pages_in_flight_when_the_engine_sizes_its_batch(tmp_path: Path) -> None:
    cuda = Settings(data_dir=tmp_path, runner="cuda")
    assert cuda.job_page_window(256) == 2 and cuda.job_page_window(128) == 1 and cuda.job_page_window(1) == 1
    assert cuda.engine_job_slots() * cuda.job_page_window(256) == 2 * 256  # two batches in flight, not 256 x 256
    # explicit batch sizes and the reference runner: a job's window is the engine's batch, as before
    assert Settings(data_dir=tmp_path, runner="cuda", engine_max_num_seqs=64).job_page_window(64) == 64
    assert Settings(data_dir=tmp_path).job_page_window(16) == 16


class Batches:
    """An engine client built with a 256-sequence batch that answers at once and records each submission's size."""

    model_key, model_fingerprint, engine_version = "scripted" * 8, "fp-window-1", "engine-window-1"
    max_num_seqs = 256

    def __init__(self) -> None:
        self.batches: list[int] = []

    def run(self, requests: Any) -> Iterator[Any]:
        from pipeline.engine_client import EngineReply

        self.batches.append(len(requests))
        for _ in requests:
            yield EngineReply(text='{"colour":"red"}', finish_reason="stop", token_texts=list('{"colour":"red"}'),
                              token_logprobs=[-0.1] * 16, prompt_tokens=5, completion_tokens=16)


def test_a_job_on_an_auto_sized_cuda_engine_sends_its_pages_two_at_a_time(tmp_path: Path) -> None:
    import pymupdf

    from pipeline.context import Pipeline
    from pipeline.ingest import ingest_file
    from pipeline.jobs import run_job
    from pipeline.schemas import register_schema

    doc = pymupdf.open()
    for n in range(5):
        doc.new_page(width=200, height=200).insert_text((20, 40), f"page {n}")
    doc.save(tmp_path / "five.pdf")
    client = Batches()
    p = Pipeline(Settings(data_dir=tmp_path / "data", runner="cuda", stable_seconds=0), client=client)
    try:
        with p.db.session() as s:
            register_schema(s, "colour", {"type": "object", "properties": {"colour": {"type": "string"}}})
        job = ingest_file(p, tmp_path / "five.pdf", schema="colour").job_id
        assert run_job(p, job).state == "succeeded"
    finally:
        p.close()
    assert client.batches == [2, 2, 1]
