"""`docpipe worker | beat | submit | status`, added to the pipeline's typer app through the entry-point group
`docpipe.commands` (pyproject: `workers = "workers.cli:register"`); `python -m workers ...` runs them alone.

    docpipe worker --queues gpu [--gpu 0]     one process per GPU; pool: threads, concurrency = engine batch size
    docpipe worker --queues gpu --gpus all    the same, one supervised child process per GPU
    docpipe worker --queues ingest            CPU work (prefork, one process per core)
    docpipe beat                              the schedule (several may run: one sends, see workers.beat)
    docpipe submit PATH... [--schema S]       stage files and enqueue them (instead of running in-process)
    docpipe status [--json]                   queue depths, jobs by state, beat holder, watch folders
"""
from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from .config import QUEUE_GPU, QUEUES, WorkerConfigError

_LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _parse_queues(text: str) -> list[str]:
    queues = [q.strip() for q in text.split(",") if q.strip()]
    unknown = [q for q in queues if q not in QUEUES]
    if not queues or unknown:
        _fail(f"--queues takes {' or '.join(QUEUES)} (comma-separated for both), got {text!r}")
    return queues


def _configure(build_engine: bool = False) -> Any:
    from pydantic import ValidationError

    from .config import check_consistency
    from .runtime import configure_process

    try:
        cfg = configure_process(build_engine=build_engine)
        check_consistency(cfg.settings, cfg.worker_settings)
    except (WorkerConfigError, ValidationError) as exc:
        _fail(str(exc))
    return cfg


def worker(
    queues: str = typer.Option(",".join(QUEUES), "--queues", "-Q", help="ingest, gpu, or ingest,gpu."),
    concurrency: Optional[int] = typer.Option(
        None, "--concurrency", "-c", min=1,
        help="Tasks at once. Default: gpu -> the engine batch size (DOCPIPE_ENGINE_MAX_NUM_SEQS); ingest -> CPUs."),
    gpu: Optional[str] = typer.Option(
        None, "--gpu", help="GPU index for this process (sets CUDA_VISIBLE_DEVICES). Run one worker per GPU."),
    gpus: Optional[str] = typer.Option(
        None, "--gpus", help="0,1,... or all: start and watch one gpu worker process per GPU (restarted if it dies)."),
    hostname: Optional[str] = typer.Option(None, "--hostname", "-n", help="Celery node name (unique per process)."),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
) -> None:
    """Run a queue worker (Redis broker from DOCPIPE_BROKER_URL)."""
    names = _parse_queues(queues)
    if gpus is not None:
        _supervise(names, gpus, gpu, hostname, concurrency, loglevel)
        return
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before anything can initialise CUDA in this process
    uses_engine = QUEUE_GPU in names
    cfg = _configure(build_engine=uses_engine)
    logging.basicConfig(level=loglevel.upper(), format=_LOG_FORMAT)

    from pipeline.context import Pipeline

    from .app import get_app
    from .pool import EngineThreadPool

    # Migrate once here, then let go of the database before any fork (children open their own connections).
    Pipeline(cfg.settings).close()
    if uses_engine:
        # Threads, not processes: every task hands its requests to the one engine of this process, whose
        # continuous batcher runs them together; as many tasks as the engine batches keep it full.
        pool: Any = EngineThreadPool
        slots = concurrency or cfg.settings.engine_job_slots()
    else:
        pool = "prefork"  # rendering is CPU-bound Python: one process per core
        slots = concurrency or cfg.worker_settings.ingest_concurrency or os.cpu_count() or 1
    role = "+".join(names) if gpu is None else "+".join(n if n != QUEUE_GPU else f"gpu{gpu}" for n in names)
    node = hostname or f"{role}-{os.getpid()}@{socket.gethostname()}"
    app = get_app()
    w = app.Worker(
        hostname=node, pool_cls=pool, concurrency=slots, queues=names, loglevel=loglevel.upper(),
        # No mingle/gossip/event heartbeats: workers share nothing but the broker and the database.
        without_mingle=True, without_gossip=True, without_heartbeat=True,
    )
    w.start()
    raise typer.Exit(w.exitcode or 0)


def _supervise(names: list[str], gpus: str, gpu: str | None, hostname: str | None, concurrency: int | None,
               loglevel: str) -> None:
    from .supervise import GpuListError, GpuSupervisor, parse_gpus

    if names != [QUEUE_GPU] or gpu is not None or hostname is not None:
        _fail("--gpus runs gpu-queue workers only: use it with --queues gpu, without --gpu or --hostname")
    _configure()  # refuse a configuration that cannot work before starting any child
    try:
        devices = parse_gpus(gpus)
    except GpuListError as exc:
        _fail(str(exc))
    logging.basicConfig(level=loglevel.upper(), format=_LOG_FORMAT)
    args = ["--loglevel", loglevel] + (["--concurrency", str(concurrency)] if concurrency else [])
    raise typer.Exit(GpuSupervisor(devices, args).run())


def beat(loglevel: str = typer.Option("INFO", "--loglevel", "-l")) -> None:
    """Run celery beat: watch folders, requeue of stuck jobs, retention purge (one instance sends at a time)."""
    cfg = _configure()
    logging.basicConfig(level=loglevel.upper(), format=_LOG_FORMAT)
    from .app import get_app
    from .beat import LockedScheduler, beat_schedule

    app = get_app()
    app.conf.beat_schedule = beat_schedule(cfg.worker_settings, watch=bool(cfg.settings.watch_folders),
                                           retention=cfg.settings.retention_days is not None)
    app.Beat(scheduler=LockedScheduler, loglevel=loglevel.upper(), quiet=True).run()


def _expand(paths: list[Path], keep: Callable[[Path], bool]) -> list[tuple[Path, str]]:
    """(file, name as shown) for every file given or found under a given folder (hidden files skipped; `keep`
    filters the files found in folders)."""
    out = []
    for path in paths:
        if path.is_dir():
            for found in sorted(p for p in path.rglob("*") if p.is_file()):
                rel = found.relative_to(path)
                if not any(part.startswith(".") for part in rel.parts) and keep(found):
                    out.append((found, str(Path(path.name) / rel)))
        elif path.is_file():
            out.append((path, path.name))
        else:
            _fail(f"{path} is neither a file nor a folder")
    return out


def submit(
    paths: list[Path] = typer.Argument(..., help="Files and folders to process."),
    schema: Optional[str] = typer.Option(None, "--schema", "-s", help="Extraction schema (default: per media type)."),
    as_json: bool = typer.Option(False, "--json", help="Print the staged intakes as JSON."),
) -> None:
    """Enqueue files for the workers instead of processing them in this process."""
    cfg = _configure()
    from pipeline.context import Pipeline
    from pipeline.errors import UnknownSchemaError
    from pipeline.ingest import create_batch
    from pipeline.schemas import get_schema
    from pipeline.walk import TextFileFilter

    from .enqueue import enqueue_ingest

    text_files = TextFileFilter()
    files = _expand(paths, text_files)
    if text_files.skipped:
        typer.echo(f"left out {len(text_files.skipped)} plain-text file(s) found in folders (not documents): "
                   + ", ".join(str(f) for f in text_files.skipped), err=True)
    if not files:
        _fail("no files found")
    p = Pipeline(cfg.settings)
    try:
        if schema is not None:
            with p.db.read_session() as s:
                get_schema(s, schema)  # refuse a bad name now, not on the worker
        batch_id = create_batch(p, "submit")
    except UnknownSchemaError as exc:
        _fail(str(exc))
    finally:
        p.close()
    staged = [(name, enqueue_ingest(path, name=name, schema=schema, batch_id=batch_id, settings=cfg.settings,
                                    worker_settings=cfg.worker_settings)) for path, name in files]
    waiting = sum(not s.published for _, s in staged)
    if as_json:
        typer.echo(json.dumps({"batch_id": batch_id, "files": [{"name": n, **asdict(s)} for n, s in staged]}))
    else:
        typer.echo(f"batch {batch_id}: {len(staged)} file(s) staged and queued for ingestion")
    if waiting:
        typer.echo(f"warning: the broker did not answer for {waiting} file(s); they stay staged in "
                   f"{cfg.settings.data_dir / 'incoming'} and are sent once it does (beat's reconciler)", err=True)


def status(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Queue depths, jobs by state, the beat lock holder and watch-folder activity."""
    cfg = _configure()
    from pipeline.context import Pipeline

    from .markers import redis_client
    from .status import collect

    p = Pipeline(cfg.settings)
    try:
        st = collect(p, redis_client(cfg.settings.broker_url))
    finally:
        p.close()
    if as_json:
        typer.echo(json.dumps(asdict(st), indent=2))
        return
    from rich.table import Table

    from pipeline.cli import console as make_console

    console = make_console()
    q = st.queues
    if not q.broker_ok:
        console.print(f"[red]broker unreachable[/red]: {q.broker_error}")
    else:
        table = Table(title="queues")
        table.add_column("queue")
        table.add_column("waiting", justify="right")
        for name, depth in q.depths.items():
            table.add_row(name, str(depth))
        table.add_row("(delivered, not acked)", str(q.unacked))
        console.print(table)
        console.print(f"beat lock holder: {q.beat_holder or 'none (no beat running)'}")
        alive = [owner for owner, ok in q.workers.items() if ok]
        dead = [owner for owner, ok in q.workers.items() if not ok]
        console.print(f"worker processes alive: {len(alive)}" + (f" {', '.join(alive)}" if alive else "")
                      + (f"; silent (jobs being taken over): {', '.join(dead)}" if dead else ""))
        for folder, stats in q.watch.items():
            console.print(f"watch {folder}: {stats or 'not scanned yet'}")
    jobs = Table(title="jobs")
    jobs.add_column("state")
    jobs.add_column("count", justify="right")
    for state in ("queued", "running", "succeeded", "partial", "failed"):
        jobs.add_row(state, str(st.jobs_by_state.get(state, 0)))
    console.print(jobs)
    if st.documents_unreadable:
        console.print(f"{st.documents_unreadable} file(s) could not be read at intake (see their document rows)")


def register(app: typer.Typer) -> None:
    """Entry point of the `docpipe.commands` group: add the queue commands to docpipe's CLI."""
    app.command("worker")(worker)
    app.command("beat")(beat)
    app.command("submit")(submit)
    app.command("status")(status)
