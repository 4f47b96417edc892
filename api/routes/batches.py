"""POST /v1/batches (several files in one request) and GET /v1/batches/{id} (progress counts)."""
from __future__ import annotations

from anyio import to_thread
from fastapi import APIRouter, Depends, Request, status
from starlette.concurrency import run_in_threadpool

from pipeline.tenancy import Access

from ..auth import Principal
from ..context import ApiContext, get_ctx, get_principal
from ..intake import accept_batch, upload_form_openapi
from ..queries import batch_job_states, load_batch
from ..uploads import receive_form
from ..views import BatchItemOut, BatchOut, utc
from . import RowId

router = APIRouter(tags=["batches"])


@router.post("/v1/batches", response_model=BatchOut, status_code=status.HTTP_202_ACCEPTED,
             openapi_extra=upload_form_openapi(multiple=True))
async def batches_create(request: Request, ctx: ApiContext = Depends(get_ctx),
                         who: Principal = Depends(get_principal)) -> BatchOut:
    """Upload several files (form field `files`, repeated) read with one schema; they form one batch."""
    await run_in_threadpool(ctx.jobs.check, who.tenant)
    form = await receive_form(request, ctx.spool_dir, ctx.upload_memory,
                              max_file_bytes=ctx.limits.max_upload_bytes, max_files=ctx.limits.max_batch_files,
                              idle_timeout_s=ctx.limits.upload_idle_timeout_s)
    try:
        batch_id, job_ids = await to_thread.run_sync(accept_batch, ctx, form, who, limiter=ctx.intake)
    finally:
        form.discard()  # accept_batch has done so; this covers a request cancelled before its thread started
    await run_in_threadpool(ctx.runner.submit, job_ids)  # may publish to the broker: off the event loop
    return await run_in_threadpool(batch_view, ctx, batch_id, who.access)


def batch_view(ctx: ApiContext, batch_id: int, access: Access) -> BatchOut:
    with ctx.pipeline.db.read_session() as s:
        batch = load_batch(s, batch_id, access)
        states = batch_job_states(s, batch)
        counts: dict[str, int] = {"queued": 0, "running": 0, "succeeded": 0, "partial": 0, "failed": 0,
                                  "intake_failed": 0, "deleted": 0}
        for item in batch.items:
            if item.outcome == "failed":
                counts["intake_failed"] += 1
            elif item.job_id is None or item.job_id not in states:
                counts["deleted"] += 1
            else:
                counts[states[item.job_id]] += 1
        done = counts["queued"] == 0 and counts["running"] == 0
        return BatchOut(
            id=batch.id, source=batch.source, created_at=utc(batch.created_at), counts=counts,
            total=len(batch.items), done=done,
            items=[BatchItemOut(name=i.name, outcome=i.outcome, document_id=i.document_id, job_id=i.job_id,
                                error=i.error) for i in batch.items],
        )


@router.get("/v1/batches/{batch_id}", response_model=BatchOut)
def batches_get(batch_id: RowId, ctx: ApiContext = Depends(get_ctx),
                who: Principal = Depends(get_principal)) -> BatchOut:
    return batch_view(ctx, batch_id, who.access)
