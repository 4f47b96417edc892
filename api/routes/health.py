"""Liveness (/healthz), readiness (/readyz: database, job queue, broker, engine) and Prometheus metrics (/metrics).

Both probes must answer within a second whatever the server is doing, so neither waits in line with the work:
/healthz is answered on the event loop itself, and /readyz's database queries run on threads of their own
(`_PROBE_THREADS`), not the pool uploads and page reads share, with a deadline after which the check reports the
database as too slow instead of hanging the probe. (Rendering, the other thing that could stall a process, runs in
isolated render processes: see vision.isolated.)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from anyio import CapacityLimiter
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select

from pipeline.models import Job, JobState

from ..context import ApiContext, get_ctx

router = APIRouter(tags=["health"])
T = TypeVar("T")
_PROBE_THREADS = CapacityLimiter(2)  # probes' database reads, apart from the request threads
PROBE_DEADLINE_S = 0.8  # a database slower than this is reported, so the probe still answers within a second


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


def _queued_jobs(ctx: ApiContext) -> int:
    """Jobs waiting to run, in the database (the one count both modes share: an embedded server's own queue and
    the broker's queues only hold ids of these)."""
    with ctx.pipeline.db.read_session() as s:
        return int(s.scalar(select(func.count()).select_from(Job).where(Job.state == JobState.queued.value)) or 0)


async def _probe(fn: Callable[[ApiContext], T], ctx: ApiContext) -> T:
    """`fn(ctx)` on a probe thread; TimeoutError after PROBE_DEADLINE_S (the thread is left to finish)."""
    with anyio.fail_after(PROBE_DEADLINE_S):
        return await anyio.to_thread.run_sync(fn, ctx, limiter=_PROBE_THREADS, abandon_on_cancel=True)


async def _jobs(ctx: ApiContext) -> str:
    """Whether jobs can be handed on (in broker mode a round trip to Redis, so off the event loop)."""
    try:
        problem = await _probe(lambda c: c.runner.problem(), ctx)
    except TimeoutError:
        return f"the {ctx.runner.mode} runner did not answer within {PROBE_DEADLINE_S:g} s"
    return problem or f"ok ({ctx.runner.mode})"


async def _database_and_queue(ctx: ApiContext) -> tuple[str, str]:
    limit = ctx.pipeline.settings.ready_max_queued_jobs
    try:
        queued = await _probe(_queued_jobs, ctx)
    except TimeoutError:
        problem = f"database did not answer within {PROBE_DEADLINE_S:g} s"
        return problem, f"unknown ({problem})"
    except Exception as exc:  # noqa: BLE001 — whatever the database raised, the probe answers with it
        problem = f"database unreachable: {type(exc).__name__}: {exc}".splitlines()[0]
        return problem, f"unknown ({problem})"
    if queued > limit:
        return "ok", (f"saturated: {queued} jobs queued, more than DOCPIPE_READY_MAX_QUEUED_JOBS ({limit}); send "
                      f"new work elsewhere or add workers")
    return "ok", f"ok ({queued} queued)"


@router.get("/readyz", responses={503: {"description": "A dependency is not ready, or the job queue is saturated"}})
async def readyz(ctx: ApiContext = Depends(get_ctx)) -> JSONResponse:
    """Ready to accept work: the database answers, the job queue is not saturated, jobs can be handed on, the
    engine (if in-process) loads."""
    database, queue = await _database_and_queue(ctx)
    checks: dict[str, Any] = {
        "database": database,
        "queue": queue,
        "jobs": await _jobs(ctx),
        "engine": ctx.engine.status() or "ok",
    }
    ready = all(str(v).startswith("ok") for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                        status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(ctx: ApiContext = Depends(get_ctx)) -> Response:
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
