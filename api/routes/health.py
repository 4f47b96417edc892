"""Liveness (/healthz), readiness (/readyz: database, job queue, broker, engine) and Prometheus metrics (/metrics).

Both probes must answer within a second whatever the server is doing, so neither waits in line with the work:
/healthz is answered on the event loop itself, and /readyz's database queries run on threads of their own
(`_PROBE_THREADS`), not the pool uploads and page reads share, with a deadline after which the check reports the
database as too slow instead of hanging the probe. (Rendering, the other thing that could stall a process, runs in
isolated render processes: see vision.isolated.)

Tenants: readiness is the deployment's (a load balancer asks whether this server takes work), but the counts shown
are the caller's. /readyz's queue line names the queued jobs of the key's tenant; an admin key (or a server without
keys) sees the deployment's number; a probe without a key sees none. /metrics for a tenant's key counts its
tenant's documents only (api.metrics.tenant_metrics).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from anyio import CapacityLimiter
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select

from pipeline.models import Document, Job, JobState
from pipeline.tenancy import Access

from ..auth import Principal
from ..context import ApiContext, get_ctx, get_principal
from ..metrics import tenant_metrics

router = APIRouter(tags=["health"])
T = TypeVar("T")
_PROBE_THREADS = CapacityLimiter(2)  # probes' database reads, apart from the request threads
PROBE_DEADLINE_S = 0.8  # a database slower than this is reported, so the probe still answers within a second


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


def _queued_jobs(ctx: ApiContext, access: Access | None) -> tuple[int, int | None]:
    """Jobs waiting to run, in the database (the one count both modes share: an embedded server's own queue and
    the broker's queues only hold ids of these): (all of them, those of `access`'s tenant; None for no tenant)."""
    queued = select(func.count()).select_from(Job).where(Job.state == JobState.queued.value)
    with ctx.pipeline.db.read_session() as s:
        total = int(s.scalar(queued) or 0)
        if access is None or access.admin:
            return total, None
        mine = queued.join(Document, Document.id == Job.document_id).where(access.owns(Document.tenant))
        return total, int(s.scalar(mine) or 0)


async def _probe(fn: Callable[[ApiContext], T], ctx: ApiContext) -> T:
    """`fn(ctx)` on a probe thread; TimeoutError after PROBE_DEADLINE_S (the thread is left to finish)."""
    with anyio.fail_after(PROBE_DEADLINE_S):
        return await anyio.to_thread.run_sync(fn, ctx, limiter=_PROBE_THREADS, abandon_on_cancel=True)


def _viewer(request: Request) -> Access | None:
    """Whose counts this caller sees: every tenant's (admin, or no keys configured), one tenant's, or None for a
    probe without a key on a server with keys."""
    principal: Principal | None = getattr(request.state, "principal", None)
    return principal.access if principal is not None else None


async def _jobs(ctx: ApiContext) -> str:
    """Whether jobs can be handed on (in broker mode a round trip to Redis, so off the event loop)."""
    try:
        problem = await _probe(lambda c: c.runner.problem(), ctx)
    except TimeoutError:
        return f"the {ctx.runner.mode} runner did not answer within {PROBE_DEADLINE_S:g} s"
    return problem or f"ok ({ctx.runner.mode})"


def _queue_line(total: int, mine: int | None, access: Access | None, limit: int) -> str:
    """The queue check as the caller may see it: the deployment's number only for an admin, the tenant's own
    number for a tenant's key, no number for a probe without a key."""
    admin = access is not None and access.admin
    if total > limit:
        counted = f"{total} jobs queued, more" if admin else "more jobs queued"
        own = f", {mine} of them this tenant's" if mine is not None else ""
        return (f"saturated: {counted} than DOCPIPE_READY_MAX_QUEUED_JOBS ({limit}){own}; send new work "
                f"elsewhere or add workers")
    if admin:
        return f"ok ({total} queued)"
    return f"ok ({mine} queued for this tenant)" if mine is not None else "ok"


async def _database_and_queue(ctx: ApiContext, access: Access | None) -> tuple[str, str]:
    limit = ctx.pipeline.settings.ready_max_queued_jobs
    try:
        total, mine = await _probe(lambda c: _queued_jobs(c, access), ctx)
    except TimeoutError:
        problem = f"database did not answer within {PROBE_DEADLINE_S:g} s"
        return problem, f"unknown ({problem})"
    except Exception as exc:  # noqa: BLE001 — whatever the database raised, the probe answers with it
        problem = f"database unreachable: {type(exc).__name__}: {exc}".splitlines()[0]
        return problem, f"unknown ({problem})"
    return "ok", _queue_line(total, mine, access, limit)


@router.get("/readyz", responses={503: {"description": "A dependency is not ready, or the job queue is saturated"}})
async def readyz(request: Request, ctx: ApiContext = Depends(get_ctx)) -> JSONResponse:
    """Ready to accept work: the database answers, the job queue is not saturated, jobs can be handed on, the
    engine (if in-process) loads. Queue counts are the caller's tenant's (the deployment's for an admin)."""
    database, queue = await _database_and_queue(ctx, _viewer(request))
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
def metrics(ctx: ApiContext = Depends(get_ctx), who: Principal = Depends(get_principal)) -> Response:
    """Prometheus text: the whole deployment for an admin key, the key's tenant's figures otherwise."""
    if who.access.admin:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
    return Response(tenant_metrics(ctx.pipeline.db, who.access), media_type=CONTENT_TYPE_LATEST)
