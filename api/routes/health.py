"""Liveness (/healthz), readiness (/readyz: database, broker, engine) and Prometheus metrics (/metrics)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from ..context import ApiContext, get_ctx

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


def _check_db(ctx: ApiContext) -> str | None:
    try:
        with ctx.pipeline.db.read_session() as s:
            s.execute(text("SELECT 1"))
    except Exception as exc:
        return f"database unreachable: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


@router.get("/readyz", responses={503: {"description": "A dependency is not ready"}})
def readyz(ctx: ApiContext = Depends(get_ctx)) -> JSONResponse:
    """Ready to accept work: the database answers, jobs can be handed on, the engine (if in-process) loads."""
    checks: dict[str, Any] = {
        "database": _check_db(ctx) or "ok",
        "jobs": ctx.runner.problem() or f"ok ({ctx.runner.mode})",
        "engine": ctx.engine.status() or "ok",
    }
    ready = all(str(v).startswith("ok") for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                        status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(ctx: ApiContext = Depends(get_ctx)) -> Response:
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
