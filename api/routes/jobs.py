"""GET /v1/jobs/{id} and POST /v1/jobs/{id}/retry."""
from __future__ import annotations

from fastapi import APIRouter, Depends, status
from starlette.concurrency import run_in_threadpool

from ..auth import Principal
from ..context import ApiContext, get_ctx, get_principal
from ..intake import retry_job
from ..queries import load_job
from ..views import JobOut, job_out
from . import RowId

router = APIRouter(tags=["jobs"])


@router.get("/v1/jobs/{job_id}", response_model=JobOut)
def jobs_get(job_id: RowId, ctx: ApiContext = Depends(get_ctx), who: Principal = Depends(get_principal)) -> JobOut:
    with ctx.pipeline.db.read_session() as s:
        return job_out(load_job(s, job_id, who.access))


@router.post("/v1/jobs/{job_id}/retry", response_model=JobOut, status_code=status.HTTP_202_ACCEPTED,
             responses={409: {"description": "The job is still queued or running"}})
async def jobs_retry(job_id: RowId, ctx: ApiContext = Depends(get_ctx),
                     who: Principal = Depends(get_principal)) -> JobOut:
    """Queue a finished (failed or partial) job again; its old results are replaced when it succeeds."""
    await run_in_threadpool(ctx.jobs.check, who.tenant)
    job = await run_in_threadpool(retry_job, ctx, job_id, who)
    ctx.jobs.record(who.tenant, [job.id])
    await run_in_threadpool(ctx.runner.submit, [job.id])  # may publish to the broker: off the event loop
    return job
