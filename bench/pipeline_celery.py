"""The Celery path of bench/pipeline_throughput.py: a throw-away redis-server, the ingest worker (prefork: the
prepare/render tasks) and the GPU worker (threads, one engine, probed) as real processes, the batch submitted as
`docpipe submit` does (workers.enqueue.enqueue_ingest per file), timed until every job is final in the database.

Measured: wall from the first submission to the last job final (the database polled every 20 ms), the GPU
worker's probe delta over that window (bench/pipeline_probe.py), the run time of every Celery task in it (each
worker's log: "Task docpipe.X[id] succeeded in Ns"), and what the database says of every job.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import pipeline_probe
from pipeline_part import db_summary

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cuda_runner.pipeline_services import Service, start_redis  # noqa: E402 - after the path insert

READY_GPU = "engine ready in pid"
TASK_DONE = re.compile(r"Task (docpipe\.\w+)\[[^\]]+\] (succeeded|raised|retry)[^\n]*?in ([0-9.]+)s")


def task_seconds(log: str) -> dict[str, dict[str, float]]:
    """{task name: {"count", "seconds"}} of the tasks a worker log reports done."""
    out: dict[str, dict[str, float]] = {}
    for name, _, seconds in TASK_DONE.findall(log):
        row = out.setdefault(name, {"count": 0, "seconds": 0.0})
        row["count"] += 1
        row["seconds"] += float(seconds)
    return out


def finished_jobs(p: Any) -> int:
    from sqlalchemy import func, select

    from pipeline.models import Job

    with p.db.read_session() as s:
        return int(s.scalar(select(func.count()).select_from(Job)
                            .where(Job.state.in_(["succeeded", "partial", "failed"]))) or 0)


def wait_for(check: Any, what: str, timeout: float, services: list[Service]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        dead = [s.name for s in services if not s.alive()]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.02)


def run_celery(env: dict[str, str], files: list[Path], warmup: Path, work: Path, *, schema: str, timeout: float,
               redis_archive: Path | None, ingest_concurrency: int | None, run_limit: float | None
               ) -> dict[str, Any]:
    from pipeline.context import Pipeline
    from pipeline.settings import Settings
    from workers.config import WorkerSettings
    from workers.enqueue import enqueue_ingest

    work.mkdir(parents=True, exist_ok=True)
    redis, port = start_redis(work, archive=redis_archive)
    services: list[Service] = [redis]
    env = {**env, "DOCPIPE_BROKER_URL": f"redis://127.0.0.1:{port}/0"}
    probe = work / "gpu.probe"
    settings = Settings(**{k[len("DOCPIPE_"):].lower(): v for k, v in env.items() if k.startswith("DOCPIPE_")})
    ws = WorkerSettings()
    p: Any = None
    try:
        part = [sys.executable, str(Path(__file__).with_name("pipeline_part.py"))]
        gpu = Service("gpu-worker", [*part, "worker", "--probe", str(probe), "--", "worker", "--queues", "gpu"],
                      env, work / "gpu.log", cwd=REPO)
        services.append(gpu)
        ingest_args = ["--concurrency", str(ingest_concurrency)] if ingest_concurrency else []
        ingest = Service("ingest-worker", [sys.executable, "-m", "workers", "worker", "--queues", "ingest",
                                           *ingest_args], env, work / "ingest.log", cwd=REPO)
        services.append(ingest)
        t0 = time.perf_counter()
        wait_for(lambda: READY_GPU in gpu.log_text(), "the GPU worker's engine", timeout, services)
        ready_s = time.perf_counter() - t0
        p = Pipeline(settings)
        enqueue_ingest(warmup, schema=schema, settings=settings, worker_settings=ws)
        wait_for(lambda: finished_jobs(p) >= 1, "the warm-up job", timeout, services)
        marks = {s.name: len(s.log_text()) for s in (gpu, ingest)}
        before = pipeline_probe.request_snapshot(probe, "t0")
        t0 = time.perf_counter()
        for f in files:
            enqueue_ingest(f, schema=schema, settings=settings, worker_settings=ws)
        submit_s = time.perf_counter() - t0
        try:
            wait_for(lambda: finished_jobs(p) >= len(files) + 1, "every job final", run_limit or timeout, services)
            complete = True
        except TimeoutError:
            complete = False  # report what finished in the window
        wall = time.perf_counter() - t0
        after = pipeline_probe.request_snapshot(probe, "t1")
        tasks = {s.name: task_seconds(s.log_text()[marks[s.name]:]) for s in (gpu, ingest)}
    finally:
        if p is not None:
            p.close()
        for s in reversed(services):
            s.stop(grace=5)
    db = db_summary(settings)
    return {"pages_done": db["unit_results"], "complete": complete, "files": len(files), "wall_s": wall,
            "submit_s": submit_s,
            "gpu_worker_ready_s": ready_s, "probe": pipeline_probe.delta(before, after), "db": db,
            "tasks": tasks, "logs": {s.name: str(s.log) for s in services}}
