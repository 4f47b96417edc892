"""Embedded processing: ingest files and folders, then run their jobs in this process (CLI `process`, `demo`).

The same library functions a queue worker calls (`ingest_file`, `run_job`) run here, so the embedded path and the
distributed path cannot drift apart. Files are read and rendered by a few intake threads (each render runs in a
process of its own: DOCPIPE_EMBEDDED_RENDERS); each file's job starts, in file order, as soon as the file is in,
on a pool of job threads, so reading, rendering and the model overlap and the engine batches pages of several
documents together.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from .context import Pipeline
from .ingest import IngestOutcome, create_batch, ingest_file
from .jobs import run_job
from .queries import document_repaired, get_job
from .schemas import get_schema
from .walk import folder_intakes

FAILED_STATES = frozenset({"failed", "partial"})


@dataclass
class FileReport:
    name: str
    outcome: str  # new | duplicate | failed | unstable (intake)
    state: str  # final job state, or "failed" (unreadable) / "skipped" (unstable)
    document_id: int | None = None
    job_id: int | None = None
    pages: int = 0
    error: str | None = None
    seconds: float = 0.0
    repaired: bool = False  # the file was damaged and rebuilt to be read: pages may be missing


@dataclass
class ProcessReport:
    batch_id: int
    files: list[FileReport] = field(default_factory=list)
    seconds: float = 0.0
    pages_processed: int = 0  # pages/frames run through the model by this call (dedupes excluded)

    @property
    def failed(self) -> list[FileReport]:
        return [f for f in self.files if f.state in FAILED_STATES]

    @property
    def ok(self) -> bool:
        return not self.failed

    def as_json(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "seconds": self.seconds, "pages_processed": self.pages_processed,
                "ok": self.ok, "files": [asdict(f) for f in self.files]}


class ProgressCallbacks(Protocol):
    """What process_paths reports to a progress display (the CLI's rich bar; Progress, the default, is silent)."""

    def file_ingested(self, outcome: IngestOutcome) -> None: ...

    def unit_done(self, name: str, unit: str, ok: bool, pages: int) -> None: ...

    def file_done(self, report: FileReport) -> None: ...


class Progress:
    """Callbacks for a progress display; the default does nothing."""

    def file_ingested(self, outcome: IngestOutcome) -> None: ...

    def unit_done(self, name: str, unit: str, ok: bool, pages: int) -> None: ...

    def file_done(self, report: FileReport) -> None: ...


def input_intakes(p: Pipeline, paths: Sequence[str | os.PathLike[str]], *, schema: str | None,
                  batch_id: int, password: str | None,
                  include: Callable[[Path], bool] | None = None) -> list[Callable[[], IngestOutcome]]:
    """One intake call per file of `paths` (folders walked now), in order, not yet run. `password` applies to the
    files named directly."""
    intakes: list[Callable[[], IngestOutcome]] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            intakes += folder_intakes(p, path, schema=schema, batch_id=batch_id, include=include)
        else:
            intakes.append(partial(ingest_file, p, path, name=str(path), schema=schema, password=password,
                                   batch_id=batch_id))
    return intakes


def process_paths(
    p: Pipeline,
    paths: Sequence[str | os.PathLike[str]],
    *,
    schema: str | None = None,
    password: str | None = None,
    source: str = "cli",
    progress: ProgressCallbacks | None = None,
    include: Callable[[Path], bool] | None = None,
) -> ProcessReport:
    """Ingest every file (folders recursively; `include` filters files found in folders) as one batch and run
    the jobs here. Never raises for a bad file."""
    progress = progress or Progress()
    started = time.perf_counter()
    for raw in paths:  # a missing path is a usage error, not a bad document
        if not Path(raw).exists():
            raise FileNotFoundError(f"{raw}: no such file or folder")
    if schema is not None:
        with p.db.read_session() as session:
            get_schema(session, schema)  # a bad name is refused before any file is read
    report = ProcessReport(batch_id=create_batch(p, source))
    lock = threading.Lock()  # progress callbacks and the page counter are shared by the job threads

    def on_unit(name: str, unit: str, ok: bool, pages: int) -> None:
        with lock:
            report.pages_processed += pages
            progress.unit_done(name, unit, ok, pages)

    def one(outcome: IngestOutcome) -> FileReport:
        t0 = time.perf_counter()
        item = FileReport(name=outcome.name, outcome=outcome.outcome, state="failed", document_id=outcome.document_id,
                          job_id=outcome.job_id, pages=outcome.pages, error=outcome.error)
        if outcome.outcome == "unstable":
            item.state, item.error = "skipped", "still being written; run again later"
        elif outcome.job_id is not None:
            try:
                run = run_job(p, outcome.job_id,
                              on_unit=lambda unit, ok, pages: on_unit(outcome.name, unit, ok, pages))
                job = get_job(p, outcome.job_id)
                item.state, item.error = job["state"], job["error"]
                item.repaired = document_repaired(p, job["document_id"])
                if run.note and job["state"] in ("queued", "running"):
                    item.error = run.note  # e.g. running in another process right now
            except Exception as exc:  # recorded on the job by run_job; keep going with the other files
                item.state, item.error = "failed", f"{type(exc).__name__}: {exc}"
        item.seconds = outcome.seconds + time.perf_counter() - t0
        with lock:
            progress.file_done(item)
        return item

    # Several jobs at once, so the engine batches pages of different documents together (one document's pages
    # alone rarely fill a batch); several files taken in (rendered) at once, so intake keeps ahead of the engine.
    intakes = input_intakes(p, paths, schema=schema, batch_id=report.batch_id, password=password, include=include)
    with ThreadPoolExecutor(max_workers=p.settings.embedded_job_threads(), thread_name_prefix="docpipe-job") as pool, \
            ThreadPoolExecutor(max_workers=p.settings.embedded_render_threads(),
                               thread_name_prefix="docpipe-intake") as intake:
        futures = []
        for outcome in intake.map(lambda run: run(), intakes):  # file order, each once it and those before are in
            with lock:
                progress.file_ingested(outcome)
            futures.append(pool.submit(one, outcome))
        report.files = [f.result() for f in futures]
    report.seconds = time.perf_counter() - started
    return report

