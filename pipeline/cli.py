"""The `docpipe` command line (typer + rich).

Built-in commands: process, results, demo, schemas, schema-add, db upgrade. Other packages add commands without
`pipeline` importing them (import arrows point down): every entry point in the group `docpipe.commands` is a
callable `register(app: typer.Typer) -> None`, called at start-up. A plugin that fails to load is reported on
stderr and skipped; the built-in commands keep working.
"""
from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, NoReturn, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import PipelineError
from .walk import TextFileFilter

PLUGIN_GROUP = "docpipe.commands"

app = typer.Typer(help="docpipe: scans, photos and videos in; schema-valid JSON out.", no_args_is_help=True,
                  add_completion=False)
db_app = typer.Typer(help="Database maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")

# Piped or redirected output has no terminal width: print whole values and rows instead of cutting them at
# rich's 80-column default (a script reading `docpipe config | grep data_dir` must see the whole path).
PIPED_WIDTH = 10_000


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPED_WIDTH)


out = console()
err = console(stderr=True)


def _pipeline() -> Any:
    from .context import Pipeline

    return Pipeline(_settings())


def _settings() -> Any:
    """The Settings, or exit 2 naming each refused variable with what it accepts (values are not echoed)."""
    from pydantic import ValidationError

    from .settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        problems = [f"DOCPIPE_{'_'.join(str(part) for part in e['loc']).upper()}: {e['msg']}" for e in exc.errors()]
        _fail("bad setting: " + "; ".join(problems))


def _fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)  # soft: never break a message
    raise typer.Exit(code)


class _RichProgress:
    """Progress bar over pages with a pages/s rate; one line per finished file."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]} pages/s"), TimeElapsedColumn(), console=console,
                            transient=True)
        self.task: Any = None
        self._done = 0
        self._files = 0
        self._started = 0.0

    def __enter__(self) -> "_RichProgress":
        import time

        self._started = time.perf_counter()
        self.bar.start()
        self.task = self.bar.add_task("pages", total=None, rate="-")
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def file_ingested(self, outcome: Any) -> None:
        self._files += 1
        self.bar.update(self.task, description=f"{self._files} file(s) read")
        if outcome.outcome == "new":
            total = (self.bar.tasks[0].total or 0) + max(outcome.pages, 1)
            self.bar.update(self.task, total=total)

    def unit_done(self, name: str, unit: str, ok: bool, pages: int) -> None:
        import time

        self._done += pages
        rate = self._done / max(time.perf_counter() - self._started, 1e-9)
        self.bar.update(self.task, advance=pages, rate=f"{rate:.2f}")

    def file_done(self, report: Any) -> None:
        colour = {"succeeded": "green", "partial": "yellow"}.get(report.state, "red")
        self.console.print(f"[{colour}]{report.state:>9}[/] {report.name}")


def _summary_table(report: Any) -> Table:
    table = Table(title=f"batch {report.batch_id}: {len(report.files)} file(s) in {report.seconds:.1f}s, "
                        f"{report.pages_processed} page(s)/frame(s) read by the model")
    for column in ("file", "doc", "job", "intake", "state", "repaired", "pages", "seconds", "error"):
        table.add_column(column, overflow="fold")
    for f in report.files:
        colour = {"succeeded": "green", "partial": "yellow"}.get(f.state, "red")
        table.add_row(f.name, str(f.document_id or "-"), str(f.job_id or "-"), f.outcome,
                      f"[{colour}]{f.state}[/]", "[yellow]yes[/]" if f.repaired else "", str(f.pages),
                      f"{f.seconds:.2f}", f.error or "")
    return table


BUNDLED_CAPTION = ("These answers are made up: the bundled demo model has random weights and does not read the pages, "
                   "so different documents get the same kind of text. It shows the shape of the output (valid JSON "
                   "for the schema, confidences, states). For real answers, set DOCPIPE_MODEL_DIR to a Qwen3.5 "
                   "checkpoint.")


def _results_table(p: Any, report: Any) -> Table:
    """The merged result of each document, one line each (what `docpipe results ID` shows in full)."""
    from .queries import get_results

    bundled = p.settings.model_dir is None
    table = Table(title="results", caption=BUNDLED_CAPTION if bundled else None, caption_justify="left")
    for column in ("doc", "schema", "state", "repaired", "confidence", "result"):
        table.add_column(column, overflow="fold")
    for f in report.files:
        if f.document_id is None or f.job_id is None:
            continue
        found = get_results(p, f.document_id)
        jobs = found["results"]
        job = next((j for j in jobs if j["job_id"] == f.job_id), None)
        if job is None:
            continue
        merged = job["document"]
        overall = (merged or {}).get("confidence") or {}
        text = json.dumps(merged["data"], ensure_ascii=False) if merged else (job["error"] or "")
        table.add_row(str(f.document_id), job["schema"], job["state"],
                      "[yellow]yes[/]" if found["repaired"] else "",  # the file was damaged: pages may be missing
                      f"{overall['overall']:.3f}" if overall.get("overall") is not None else "-",
                      text[:160] + ("…" if len(text) > 160 else ""))
    return table


def _process(paths: list[Path], schema: Optional[str], as_json: bool, password: Optional[str], source: str,
             show_results: bool = False) -> None:
    from .processing import process_paths

    text_files = TextFileFilter()
    try:
        p = _pipeline()
        if as_json:
            report = process_paths(p, paths, schema=schema, password=password, source=source, include=text_files)
        else:
            with _RichProgress(err) as progress:
                report = process_paths(p, paths, schema=schema, password=password, source=source,
                                       progress=progress, include=text_files)
    except (PipelineError, FileNotFoundError, NotADirectoryError) as exc:
        _fail(str(exc))
        return
    if text_files.skipped:
        err.print(f"left out {len(text_files.skipped)} plain-text file(s) found in folders (not documents): "
                  + ", ".join(str(f) for f in text_files.skipped), soft_wrap=True, highlight=False)
    if as_json:
        typer.echo(json.dumps(report.as_json(), indent=2, ensure_ascii=False))
    else:
        out.print(_summary_table(report))
        if show_results:
            out.print(_results_table(p, report))
    if not report.ok:
        err.print(f"[bold red]{len(report.failed)} of {len(report.files)} file(s) failed or were only partly read[/]",
                  soft_wrap=True)
        raise typer.Exit(1)


@app.command()
def process(
    paths: list[Path] = typer.Argument(..., help="Files and folders (folders are walked recursively)."),
    schema: Optional[str] = typer.Option(None, "--schema", "-s", help="Extraction schema (default: generic, "
                                         "or video for videos)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    password: Optional[str] = typer.Option(None, "--password", help="Password for encrypted PDFs."),
) -> None:
    """Read files into the database and extract them in this process. Exit code 1 if any file failed."""
    _process(paths, schema, as_json, password, source="cli")


@app.command()
def results(
    document_id: int = typer.Argument(..., help="Document id (shown by `process`)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    schema: Optional[str] = typer.Option(None, "--schema", "-s", help="Only results for this schema."),
) -> None:
    """Show a document's merged result, per-page results and confidences."""
    from .queries import get_results

    try:
        data = get_results(_pipeline(), document_id, schema=schema)
    except PipelineError as exc:
        _fail(str(exc))
        return
    if as_json:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
        return
    out.print(f"[bold]document {data['id']}[/] {data['name']} ({data['media_type']}, {data['page_count']} "
              f"page(s)) status: {data['status']}" + (f" — {data['error']}" if data["error"] else ""))
    if data["repaired"]:
        out.print("[yellow]repaired:[/] the file was damaged and had to be rebuilt to be read; pages may be missing "
                  "or incomplete")
    for job in data["results"]:
        out.print(f"\n[bold]job {job['job_id']}[/] schema {job['schema']}: {job['state']}"
                  + (f" — {job['error']}" if job["error"] else ""))
        merged = job["document"]
        if merged:
            table = Table("field", "value", "confidence")
            fields = (merged["confidence"] or {}).get("fields", {})
            for key, value in (merged["data"] or {}).items():
                leaf = [c for ptr, c in fields.items() if ptr == f"/{key}" or ptr.startswith(f"/{key}/")]
                conf = f"{min(leaf):.3f}" if leaf else "-"
                table.add_row(key, json.dumps(value, ensure_ascii=False)[:200], conf)
            out.print(table)
        for unit in job["units"]:
            if not unit["ok"]:
                out.print(f"  [red]{unit['unit']}[/]: {unit['error']}")


@app.command()
def demo(
    samples: Optional[Path] = typer.Option(None, help="Folder of sample files (default: the repository's samples/)."),
) -> None:
    """Process the sample files with the bundled tiny model and print the results table.

    The bundled model has random weights: its answers are schema-valid noise. Point DOCPIPE_MODEL_DIR at a real
    Qwen3.5 checkpoint for real answers."""
    folder = samples or Path(__file__).resolve().parent.parent / "samples"
    if not folder.is_dir() or not sample_files(folder):
        _fail(f"no sample files in {folder}; pass --samples FOLDER")
    _process([folder], None, False, None, source="demo", show_results=True)


def sample_files(folder: Path) -> list[Path]:
    """The media files of a samples folder (it also holds its generator script and README)."""
    keep = TextFileFilter()
    return [f for f in sorted(folder.iterdir()) if f.is_file() and not f.name.startswith(".") and keep(f)]


@app.command("schemas")
def schemas_list(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the extraction schemas (latest version of each)."""
    from .schemas import list_schemas

    p = _pipeline()
    with p.db.read_session() as s:
        rows: list[dict[str, Any]] = [{"name": r.name, "version": r.version, "builtin": r.builtin,
                                       "fields": list(r.json_schema.get("properties", {}))} for r in list_schemas(s)]
    if as_json:
        typer.echo(json.dumps(rows, indent=2, ensure_ascii=False))
        return
    table = Table("name", "version", "built-in", "fields")
    for r in rows:
        table.add_row(r["name"], str(r["version"]), "yes" if r["builtin"] else "", ", ".join(r["fields"]))
    out.print(table)


@app.command("schema-add")
def schema_add(
    name: str = typer.Argument(..., help="Name for the schema (lowercase letters, digits, _ or -)."),
    schema_file: Path = typer.Argument(..., help="JSON Schema file (an object schema)."),
    prompt: Optional[str] = typer.Option(None, help="Instruction for the model (a default is used if absent)."),
    merge: Optional[str] = typer.Option(None, help='Merge rules as JSON, e.g. \'{"items": "concat"}\'.'),
) -> None:
    """Register a user schema (validated before it is stored)."""
    from .schemas import register_schema

    try:
        definition = json.loads(schema_file.read_text())
        rules = json.loads(merge) if merge else None
    except (OSError, json.JSONDecodeError) as exc:
        _fail(f"cannot read the schema: {exc}")
        return
    p = _pipeline()
    try:
        with p.db.session() as s:
            row = register_schema(s, name, definition, prompt=prompt, merge_rules=rules)
            out.print(f"schema {row.name} version {row.version} registered")
    except PipelineError as exc:
        _fail(str(exc))


@app.command("config")
def config_show(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show every setting: environment variable, effective value (secrets masked) and default."""
    from .settings import settings_rows

    rows = settings_rows(_settings())
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table("setting", "env var", "value", "default")
    for row in rows:
        table.add_row(row["name"], row["env"], row["value"], row["default"])
    out.print(table)


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Apply the database migrations (safe to run repeatedly)."""
    from .db import Database

    settings = _settings()
    db = Database(settings.resolved_database_url)
    db.upgrade(revision)
    out.print(f"database at {revision}: {db.engine.url.render_as_string(hide_password=True)}")


def load_plugins(target: typer.Typer, entry_points: Iterable[Any] | None = None) -> list[str]:
    """Call `register(app)` of every `docpipe.commands` entry point; returns the names that loaded."""
    loaded = []
    for ep in entry_points if entry_points is not None else metadata.entry_points(group=PLUGIN_GROUP):
        try:
            register = ep.load()
            register(target)
            loaded.append(ep.name)
        except Exception as exc:  # one broken plugin must not take the CLI down
            err.print(f"[yellow]warning:[/] could not load docpipe command plugin {ep.name!r}: "
                      f"{type(exc).__name__}: {exc}")
    return loaded


_plugins_loaded = False


def main(argv: list[str] | None = None) -> None:
    global _plugins_loaded
    from .threads import cap_blas_threads

    cap_blas_threads()  # before any command imports numpy: see pipeline.threads (the user's OMP_NUM_THREADS wins)
    if not _plugins_loaded:
        load_plugins(app)
        _plugins_loaded = True
    app(args=argv if argv is not None else sys.argv[1:], prog_name="docpipe")
