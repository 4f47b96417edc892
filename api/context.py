"""What every route works with, built once per app by `api.app.create_app` and stored on `app.state.ctx`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from anyio import CapacityLimiter
from fastapi import Request

from pipeline.context import Pipeline

from .auth import Principal
from .engine_access import EngineAccess
from .limits import ApiLimits, EngineSlots, JobQuota
from .metrics import Metrics
from .runners import JobRunner
from .uploads import MemoryBudget


@dataclass
class ApiContext:
    pipeline: Pipeline
    limits: ApiLimits
    runner: JobRunner
    jobs: JobQuota
    engine_slots: EngineSlots
    metrics: Metrics
    spool_dir: Path  # partial uploads, inside the data dir
    upload_memory: MemoryBudget  # small uploads held in memory until stored (see api.uploads.MemoryBudget)
    engine: EngineAccess
    intake: CapacityLimiter  # worker threads that take uploads in (see api.app.intake_threads)


# Both dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker thread, and two
# thread hops per request to read an attribute cost more CPU than many a route itself (GIL hand-offs).
async def get_ctx(request: Request) -> ApiContext:
    return request.app.state.ctx


async def get_principal(request: Request) -> Principal:
    return request.state.principal
