"""The FastAPI application factory: `create_app(settings)` wires pipeline, limits, auth, routes and the web UI.

One middleware of ours (api.middleware), outside FastAPI's own: metrics -> auth + rate limit -> body size limit ->
unexpected-error catcher -> routes. Auth runs before any body byte is read; the body limit applies to whatever
reaches a route.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

from anyio import CapacityLimiter
from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import select

from pipeline.attempts import render_for_job_capped
from pipeline.context import Pipeline
from pipeline.dispatch import broker_dispatcher
from pipeline.jobs import run_job, stale_jobs
from pipeline.models import Job, JobState
from pipeline.render_owner import render_owner
from pipeline.settings import Settings

from .auth import Gate, KeyRing
from .context import ApiContext
from .engine_access import EngineAccess
from .errors import install_error_handlers
from .limits import ApiLimits, EngineSlots, JobQuota, RateLimiter
from .metrics import HttpMetrics, Metrics
from .middleware import ApiMiddleware
from .openai_compat import ChatBackend, chat_router
from .processes import shared_rate_buckets
from .queries import active_job_ids
from .routes import batches, documents, health, jobs, schemas
from .runners import BrokerRunner, EmbeddedRunner, JobRunner
from .uploads import MemoryBudget, sweep_spool

log = logging.getLogger("docpipe.api")

# The UI loads only its own files; page images are shown from blob: URLs (fetched with the key header).
UI_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob:; object-src 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

STATIC_DIR = Path(__file__).parent / "static"
UPLOAD_PATHS = ("/v1/documents", "/v1/batches")
MULTIPART_OVERHEAD = 64 * 1024  # form headers and text fields around the file bytes
UPLOAD_MEMORY_BYTES = 64 * 1024 * 1024  # small uploads held in memory at once, all requests together
EMBEDDED_THREADS = 2  # jobs run at once in embedded mode; each hands its pages to the engine's batcher together


def intake_threads(pipeline: Pipeline) -> int:
    """Worker threads that take uploads in at once. Few on purpose: intake is mostly Python (GIL-bound) and, on
    SQLite, one writer at a time; 32 threads contending for both made the latency tail 2-3x longer than 2 threads
    overlapping one's file I/O with the other's work (bench/api_upload_latency.py). PostgreSQL overlaps network
    round trips, so more threads pay off there."""
    return 2 if pipeline.db.is_sqlite else 8


def limits_from_settings(settings: Settings) -> ApiLimits:
    return ApiLimits(
        rate_per_minute=settings.api_rate_limit_per_minute,
        burst=max(1, settings.api_rate_limit_per_minute // 2),
        max_inflight_jobs=settings.api_max_inflight_per_key,
        max_inflight_engine=max(1, min(settings.api_max_inflight_per_key, settings.engine_job_slots() // 2 or 1)),
        max_upload_bytes=settings.max_file_bytes,
        max_batch_bytes=max(settings.max_file_bytes, ApiLimits.max_batch_bytes),
        image_decode_timeout_s=settings.page_render_timeout_s,
    )


def job_owner(pipeline: Pipeline, job_id: int) -> str:
    """Whose job this is, for the embedded runner's fair queue: the API key that uploaded its document, else
    its tenant (pipeline.render_owner decides; the runner only compares the labels)."""
    return render_owner(pipeline, job_id).lane


def _job_runner(pipeline: Pipeline) -> JobRunner:
    if pipeline.settings.embedded:
        def still_queued(job_id: int) -> bool:
            with pipeline.db.read_session() as s:
                return s.scalar(select(Job.state).where(Job.id == job_id)) == JobState.queued.value

        return EmbeddedRunner(lambda job_id: run_job(pipeline, job_id), threads=EMBEDDED_THREADS,
                              pending=lambda: stale_jobs(pipeline, queued_for_s=0.0), still_queued=still_queued,
                              render=lambda job_id: render_for_job_capped(pipeline, job_id),
                              owner_of=lambda job_id: job_owner(pipeline, job_id),
                              render_per_owner=pipeline.settings.render_max_per_key)
    # With a broker, jobs go to the Celery `ingest` queue, which renders an uploaded document's pages and then
    # hands the job to the `gpu` queue (the workers package provides the producer side through pipeline.dispatch).
    dispatcher = broker_dispatcher(pipeline.settings)
    return BrokerRunner(dispatcher.send, dispatcher.ping)


def create_app(settings: Settings | None = None, *, limits: ApiLimits | None = None) -> FastAPI:
    """Build the app. `settings` defaults to the environment (DOCPIPE_*); `limits` overrides the derived limits."""
    settings = settings or Settings()
    limits = limits or limits_from_settings(settings)
    pipeline = Pipeline(settings)  # migrates the database and registers the built-in schemas
    engine = EngineAccess(pipeline, preload=settings.embedded)
    runner = _job_runner(pipeline)
    metrics = Metrics()

    def still_active(job_ids: Iterable[int]) -> set[int]:
        with pipeline.db.read_session() as s:
            return active_job_ids(s, list(job_ids))

    ctx = ApiContext(
        pipeline=pipeline,
        limits=limits,
        runner=runner,
        jobs=JobQuota(limits.max_inflight_jobs, still_active),
        engine_slots=EngineSlots(limits.max_inflight_engine),
        metrics=metrics,
        spool_dir=settings.data_dir / "uploads",
        upload_memory=MemoryBudget(UPLOAD_MEMORY_BYTES),
        engine=engine,
        intake=CapacityLimiter(intake_threads(pipeline)),
    )
    metrics.watch(pipeline.db, runner.queue_depth, engine.stats)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sweep_spool(ctx.spool_dir, older_than_s=3600)
        engine.start()
        runner.start()
        log.info("docpipe API ready (%s mode, %d API key(s))", runner.mode, len(settings.api_keys))
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(
        title="docpipe",
        version="0.1.0",
        description="Documents in, schema-valid JSON out. Errors are RFC 9457 problem documents with a stable "
        "`code`. Send the API key as `Authorization: Bearer <key>` or `X-API-Key`.",
        lifespan=lifespan,
        docs_url=None,  # Swagger/ReDoc pages load their scripts from a CDN; a self-hosted server must not
        redoc_url=None,
    )
    app.state.ctx = ctx
    install_error_handlers(app)

    for module in (documents, batches, schemas, jobs, health):
        app.include_router(module.router)
    backend = ChatBackend(
        model_id=engine.model_id,
        get_engine=engine.async_engine,
        default_max_tokens=min(512, settings.max_tokens),
        request_timeout_s=settings.request_timeout_s,
        created=int(time.time()),
    )
    app.include_router(chat_router(backend, limits, ctx.engine_slots))

    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=UI_HEADERS)

    def body_limit(method: str, path: str) -> int:
        if method == "POST" and path in UPLOAD_PATHS:
            if path == "/v1/batches":
                return limits.max_batch_bytes + MULTIPART_OVERHEAD
            return limits.max_upload_bytes + MULTIPART_OVERHEAD
        return limits.max_json_bytes

    app.add_middleware(ApiMiddleware, metrics=HttpMetrics(metrics), limit_for=body_limit,
                       gate=Gate(KeyRing(settings.api_keys), RateLimiter(limits.rate_per_minute, limits.burst,
                                                                         shared=shared_rate_buckets())))
    return app
