"""DOCPIPE_ENGINE_QUANTIZE end to end: `docpipe process` with the bundled tiny model on the reference runner, first as
stored, then quantised to FP8 at load in the same data dir. The FP8 run is another model (a new job, not the BF16
job's answers) and its result rows carry the at-load fingerprint; a bad value stops the CLI naming what it accepts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pipeline_test_support import FAST, cli_env, invoke_cli, png_bytes
from typer.testing import CliRunner

import gpu_engine
from gpu_engine.bundled import bundled_model_dir
from gpu_engine.fp8_checkpoint import QUANTIZE_VARIANT
from pipeline.cli import app
from pipeline.settings import Settings


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(tmp_path / "data")



def processed(env: dict[str, str], path: Path) -> dict[str, Any]:
    run = invoke_cli(env, "process", str(path), "--json")
    assert run.exit_code == 0, run.output
    [item] = json.loads(run.stdout)["files"]
    assert item["state"] == "succeeded"
    return item


def fingerprints(job: dict[str, Any]) -> set[str]:
    return {job["document"]["provenance"]["model_fingerprint"]} | {
        u["provenance"]["model_fingerprint"] for u in job["units"]}


def test_fp8_at_load_reaches_the_engine_and_every_result_row_says_so(env: dict[str, str], tmp_path: Path) -> None:
    page = tmp_path / "page.png"
    page.write_bytes(png_bytes())
    first = processed(env, page)
    second = processed({**env, "DOCPIPE_ENGINE_QUANTIZE": "fp8"}, page)
    assert second["document_id"] == first["document_id"]  # the same document ...

    shown = invoke_cli(env, "results", str(first["document_id"]), "--json")
    assert shown.exit_code == 0, shown.output
    fp8_job, bf16_job = json.loads(shown.stdout)["results"]  # ... extracted again by the FP8 model (newest first)
    assert fp8_job["job_id"] != bf16_job["job_id"] and fp8_job["state"] == bf16_job["state"] == "succeeded"

    stored = gpu_engine.load(bundled_model_dir())
    at_load = gpu_engine.load(bundled_model_dir(), quantize="fp8")
    assert fingerprints(bf16_job) == {stored.fingerprint}
    assert fingerprints(fp8_job) == {at_load.fingerprint}
    assert at_load.fingerprint.endswith("+" + QUANTIZE_VARIANT) and not at_load.fingerprint.startswith(
        stored.fingerprint)


def test_bad_quantize_value_is_refused_naming_the_choices(env: dict[str, str], tmp_path: Path) -> None:
    page = tmp_path / "page.png"
    page.write_bytes(png_bytes())
    run = CliRunner().invoke(app, ["process", str(page)], env={**env, "DOCPIPE_ENGINE_QUANTIZE": "int8"})
    assert run.exit_code == 2
    assert "DOCPIPE_ENGINE_QUANTIZE" in run.stderr and "'none' or 'fp8'" in run.stderr
    with pytest.raises(ValueError, match="'none' or 'fp8'"):
        Settings(engine_quantize="FP8")
    assert Settings().engine_quantize_option() is None
    assert Settings(engine_quantize="fp8").engine_quantize_option() == "fp8"


def test_quantize_is_part_of_the_model_key_and_none_keeps_the_old_keys(tmp_path: Path) -> None:
    import hashlib

    from pipeline.context import Pipeline
    from pipeline.engine_client import model_key, model_key_for_id

    folder = Path(bundled_model_dir())
    assert model_key(folder, "fp8") != model_key(folder) == model_key(folder, None)
    assert model_key_for_id("qwen3.5-9b") == hashlib.sha256(b"model-id:qwen3.5-9b").hexdigest()  # jobs stored so far
    assert model_key_for_id("qwen3.5-9b", "fp8") != model_key_for_id("qwen3.5-9b")
    named = {"data_dir": tmp_path / "d", "model_id": "qwen3.5-9b"}
    assert Pipeline(Settings(**named, engine_quantize="fp8")).model_key == model_key_for_id("qwen3.5-9b", "fp8")
    assert Pipeline(Settings(**named)).model_key == model_key_for_id("qwen3.5-9b")
