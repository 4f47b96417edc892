"""bench/pipeline_throughput.py on the CPU: the tiny model on the reference runner, 6 pages (3 PDFs of 2), small
pages (pdf_dpi 40) so the runs take seconds. The JSON's numbers must be real measurements that add up: every page
answered in every run, pages/s = pages / wall, the ratio = pipeline pages/s / engine pages/s, the engine's busy
and idle time = the wall, timers that the run must have used nonzero (the database and rendering in the embedded
run, the ingest worker's tasks in the Celery run), and the database's record of every job."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pipeline_throughput
import pytest

from tests.bench import _paths  # noqa: F401  (bench/ on sys.path)


def run_bench(tmp_path: Path, parts: str, *extra: str) -> dict:
    out = tmp_path / "result.json"
    rc = pipeline_throughput.main([
        "--runner", "reference", "--shape", "tiny", "--docs", "3", "--pages-per-doc", "2", "--parts", parts,
        "--render-processes", "1", "--part-timeout", "300", "--setting", "pdf_dpi", "40",
        "--setting", "anchor_text_chars", "300", "--workdir", str(tmp_path / "work"), "--json", str(out), *extra])
    result = json.loads(out.read_text())
    assert rc == 0, result["runs"]
    return result


def check_row(row: dict, pages: int) -> None:
    assert row["pages"] == row["pages_done"] == row["pages_ok"] == pages and row["complete"] is True
    assert math.isclose(row["pages_per_s"], pages / row["wall_s"])
    split = row["time_split"]
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for k, v in split.items()
               if k != "engine_idle_s"), split
    assert math.isclose(split["engine_step_s"] + split["engine_idle_s"], row["wall_s"])
    assert 0 < split["engine_step_s"] <= row["wall_s"] and row["engine_steps"] > 0 and row["mean_batch"] >= 1
    assert math.isclose(row["engine_busy_fraction"], split["engine_step_s"] / row["wall_s"])
    for name, share in row["share_of_wall"].items():
        assert math.isclose(share, split[name] / row["wall_s"])
    assert row["completion_tokens"] > 0 and math.isclose(row["tokens_per_page"], row["completion_tokens"] / pages)


def test_engine_and_embedded_runs_add_up(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "engine,embedded")
    engine, embedded = result["runs"]["engine"], result["runs"]["embedded"]
    for row in (engine, embedded):
        check_row(row, 6)
    assert engine["engine_config"]["max_num_seqs"] == 16  # the pipeline's reference default, as the pipeline builds it
    assert math.isclose(result["pipeline_to_engine_ratio"]["embedded"],
                        embedded["pages_per_s"] / engine["pages_per_s"])
    split = embedded["time_split"]
    # the embedded run renders, writes every unit result and waits on the engine; the engine-only run does none
    assert split["render_s"] > 0 and split["db_txn_s"] > 0 and split["db_sql_s"] > 0 and split["interpret_s"] > 0
    assert split["model_wait_s"] > 0 and embedded["job_states"] == {"succeeded": 3}
    assert engine["time_split"]["db_txn_s"] == engine["time_split"]["render_s"] == 0.0
    assert engine["completion_tokens"] == embedded["completion_tokens"]  # same pages, same greedy answers
    for row in (engine, embedded):  # inside the engine's steps: the profile attached when the engine was built
        assert row["engine_config"]["max_num_seqs"] == 16
        assert row["time_split"]["step_prefill_forward_s"] > 0 and row["time_split"]["step_vision_encode_s"] > 0
        assert row["time_split"]["image_preprocessing_s"] > 0


def test_a_run_cut_short_reports_what_finished(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "engine", "--run-limit-s", "0.01")
    row = result["runs"]["engine"]
    assert row["complete"] is False and row["pages_done"] < 6
    assert math.isclose(row["pages_per_s"], row["pages_done"] / row["wall_s"])


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH (the Celery run)")
def test_celery_run_adds_up(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "celery")
    row = result["runs"]["celery"]
    check_row(row, 6)
    split = row["time_split"]
    assert split["ingest-worker:docpipe.ingest_s"] > 0 and split["gpu-worker:docpipe.extract_s"] > 0
    assert split["db_txn_s"] > 0 and split["page_images_s"] > 0  # the GPU worker decodes the stored pages
    assert row["job_states"] == {"succeeded": 3}


def test_a_workdir_with_an_earlier_runs_data_is_refused(tmp_path: Path, capsys) -> None:
    """Its databases would count the earlier run's pages as this run's."""
    (tmp_path / "data-celery").mkdir()
    out = tmp_path / "out.json"
    assert pipeline_throughput.main(["--runner", "reference", "--shape", "tiny", "--docs", "1", "--pages-per-doc", "1",
                                     "--workdir", str(tmp_path), "--json", str(out)]) == 2
    assert "earlier run" in capsys.readouterr().err and not out.exists()
