"""The `docpipe` CLI: process (table / JSON, exit codes), results, db upgrade, demo, schemas, plugins."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer
from pipeline_test_support import FAST, cli_env, invoke_cli, png_bytes
from typer.testing import CliRunner

from pipeline.cli import app, load_plugins


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(tmp_path / "data")



def test_process_json_results_and_exit_codes(env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.png").write_bytes(png_bytes())
    good = invoke_cli(env, "process", str(folder), "--json")
    assert good.exit_code == 0, good.output
    report = json.loads(good.stdout)
    [item] = report["files"]
    assert report["ok"] and item["state"] == "succeeded" and item["pages"] == 1

    shown = invoke_cli(env, "results", str(item["document_id"]), "--json")
    assert shown.exit_code == 0
    data = json.loads(shown.stdout)
    assert data["status"] == "succeeded" and data["results"][0]["document"]["ok"]
    table = invoke_cli(env, "results", str(item["document_id"]))
    assert table.exit_code == 0 and "document_type" in table.stdout

    (folder / "broken.pdf").write_text("not a pdf")
    mixed = invoke_cli(env, "process", str(folder))
    assert mixed.exit_code == 1  # some file failed
    assert "failed" in mixed.stdout and "1 of 2 file(s) failed" in mixed.stderr
    as_json = invoke_cli(env, "process", str(folder), "--json")
    assert as_json.exit_code == 1
    states = {Path(f["name"]).name: f for f in json.loads(as_json.stdout)["files"]}
    assert states["a.png"]["state"] == "succeeded" and states["a.png"]["outcome"] == "duplicate"
    assert states["broken.pdf"]["state"] == "failed"
    assert "not an accepted media type" in states["broken.pdf"]["error"]


def test_folder_walks_leave_out_plain_text_files_and_say_so(env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "scans"
    folder.mkdir()
    (folder / "a.png").write_bytes(png_bytes())
    (folder / "README.md").write_text("# scans from the front desk\n")
    (folder / "make_samples.py").write_text("print('a generator script')\n")
    walked = invoke_cli(env, "process", str(folder), "--json")
    assert walked.exit_code == 0, walked.output
    assert [Path(f["name"]).name for f in json.loads(walked.stdout)["files"]] == ["a.png"]
    assert "left out 2 plain-text file(s)" in walked.stderr and "README.md" in walked.stderr
    # A text file whose name claims a document is a damaged document, and a named file is never left out.
    (folder / "invoice.pdf").write_text("not a pdf")
    damaged = invoke_cli(env, "process", str(folder), "--json")
    assert damaged.exit_code == 1
    assert {Path(f["name"]).name: f["state"] for f in json.loads(damaged.stdout)["files"]}["invoice.pdf"] == "failed"
    named = invoke_cli(env, "process", str(folder / "README.md"), "--json")
    assert named.exit_code == 1 and json.loads(named.stdout)["files"][0]["state"] == "failed"


def test_piped_output_is_not_cut_at_80_columns(env: dict[str, str], tmp_path: Path) -> None:
    deep = tmp_path / ("a-rather-long-folder-name-" * 4) / "data"
    shown = invoke_cli({**env, "DOCPIPE_DATA_DIR": str(deep)}, "config")
    assert shown.exit_code == 0 and str(deep) in shown.stdout  # whole, on one line


def test_bad_arguments_exit_2_with_a_message(env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png_bytes())
    unknown = invoke_cli(env, "process", str(tmp_path / "a.png"), "--schema", "nope")
    assert unknown.exit_code == 2 and "unknown extraction schema 'nope'" in unknown.stderr
    missing = invoke_cli(env, "process", str(tmp_path / "missing.pdf"))
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    nodoc = invoke_cli(env, "results", "424242")
    assert nodoc.exit_code == 2 and "no document with id 424242" in nodoc.stderr


def test_db_upgrade_and_schemas(env: dict[str, str], tmp_path: Path) -> None:
    up = invoke_cli(env, "db", "upgrade")
    assert up.exit_code == 0 and "database at head" in up.stdout
    assert invoke_cli(env, "db", "upgrade").exit_code == 0  # idempotent
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": 7}}}))
    refused = invoke_cli(env, "schema-add", "mine", str(bad))
    assert refused.exit_code == 2 and "not valid JSON Schema" in refused.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}},
                                "required": ["a"]}))
    assert invoke_cli(env, "schema-add", "mine", str(good)).exit_code == 0
    listed = json.loads(invoke_cli(env, "schemas", "--json").stdout)
    names = {row["name"] for row in listed}
    assert {"invoice", "receipt", "id_document", "form", "generic", "video", "mine"} <= names


def test_demo_processes_a_samples_folder(env: dict[str, str], tmp_path: Path, inputs: list[Path]) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    shutil.copy(next(f for f in inputs if f.suffix == ".jpg"), folder / "photo.jpg")
    (folder / "make_samples.py").write_text("print('a generator script, not a sample')\n")
    result = invoke_cli(env, "demo", "--samples", str(folder))
    assert result.exit_code == 0, result.output
    assert "photo.jpg" in result.stdout and "make_samples.py" not in result.stdout
    assert "random weights" in result.stdout and "document_type" in result.stdout  # the results table


class FakeEntryPoint:
    def __init__(self, name: str, target: Any) -> None:
        self.name, self._target = name, target

    def load(self) -> Any:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def test_plugins_add_commands_and_broken_ones_are_skipped() -> None:
    target = typer.Typer()

    @target.command()
    def builtin() -> None:
        typer.echo("builtin ran")

    def register(app_: typer.Typer) -> None:
        @app_.command("hello")
        def hello(name: str) -> None:
            typer.echo(f"hello {name}")

    loaded = load_plugins(target, [FakeEntryPoint("good", register),
                                   FakeEntryPoint("broken", ImportError("no module named workers"))])
    assert loaded == ["good"]
    runner = CliRunner()
    assert runner.invoke(target, ["hello", "docpipe"]).stdout.strip() == "hello docpipe"
    assert runner.invoke(target, ["builtin"]).stdout.strip() == "builtin ran"


def test_config_lists_every_setting_with_secrets_masked(env: dict[str, str]) -> None:
    from pipeline.settings import Settings

    secret_env = {**env, "DOCPIPE_DATABASE_URL": "postgresql://app:hunter2hunter2@db.internal/docs",
                  "DOCPIPE_API_KEYS": "k" * 32}
    shown = invoke_cli(secret_env, "config", "--json")
    assert shown.exit_code == 0
    rows = {row["name"]: row for row in json.loads(shown.stdout)}
    assert set(rows) == set(Settings.model_fields)
    assert rows["max_tokens"]["env"] == "DOCPIPE_MAX_TOKENS" and rows["max_tokens"]["value"] == "256"
    assert "hunter2" not in shown.stdout and "k" * 32 not in shown.stdout
    assert rows["api_keys"]["value"] == "1 key(s)"
    assert rows["database_url"]["value"] == "postgresql://app:***@db.internal/docs"
