"""The pipeline's engine batch settings (DOCPIPE_ENGINE_MAX_NUM_SEQS / _MAX_BATCHED_TOKENS, 0 = the runner's
default): small fixed values on the reference runner, AUTO for the cuda engine to size, explicit values kept."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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


def test_pages_in_flight_are_two_engine_batches_per_process_unless_set(tmp_path: Path) -> None:
    cuda = Settings(data_dir=tmp_path, runner="cuda")
    assert cuda.pages_in_flight(256) == 512 and cuda.pages_in_flight(1) == 2  # for all jobs, not per job
    assert Settings(data_dir=tmp_path).pages_in_flight(16) == 32
    assert Settings(data_dir=tmp_path, runner="cuda", engine_pages_in_flight=40).pages_in_flight(256) == 40


def test_the_lookahead_setting_reaches_the_engine_config(tmp_path, monkeypatch) -> None:
    import gpu_engine
    from pipeline.engine_client import EngineClient

    built = []

    def from_pretrained(folder, runner, config, quantize):
        built.append(config)
        raise RuntimeError("stop after the config")

    monkeypatch.setattr(gpu_engine.Engine, "from_pretrained", staticmethod(from_pretrained))
    for env, want in ((None, True), ("false", False)):
        if env is None:
            monkeypatch.delenv("DOCPIPE_ENGINE_LOOKAHEAD", raising=False)
        else:
            monkeypatch.setenv("DOCPIPE_ENGINE_LOOKAHEAD", env)
        with pytest.raises(RuntimeError, match="stop after the config"):
            EngineClient.from_settings(Settings(data_dir=tmp_path))
        assert built[-1].lookahead is want
