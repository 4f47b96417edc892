"""/v1/documents: upload, list, detail, result, page images, delete."""
from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from anyio import to_thread
from fastapi import APIRouter, Depends, Query, Request, status
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from ..auth import Principal
from ..context import ApiContext, get_ctx, get_principal
from ..errors import ApiError
from ..intake import accept_upload, upload_form_openapi
from ..queries import DocumentFilter, delete_document, list_documents, load_document, page_blob, result_job
from ..uploads import receive_form
from ..views import (
    DeletedOut,
    DocumentDetail,
    DocumentPage,
    ResultOut,
    UploadOut,
    document_detail,
    document_out,
    result_out,
)
from . import PageIndex, RowId

router = APIRouter(tags=["documents"])

@router.post("/v1/documents", response_model=UploadOut, status_code=status.HTTP_202_ACCEPTED,
             responses={200: {"model": UploadOut, "description": "Nothing new: these bytes were already read with "
                                                                 "this schema (the existing document and job)"},
                        413: {"description": "File larger than the limit"}},
             openapi_extra=upload_form_openapi(multiple=False))
async def documents_upload(request: Request) -> Response:
    """Upload one file (form field `file`) with an optional `schema` and PDF `password`.

    The body is counted as it arrives and stored by its sha256 (held in memory while small); the type is sniffed
    from its magic bytes (422 `unreadable_file` for an unsupported type). 202 when a job was queued (new bytes, or
    known bytes with another schema): pages are rendered by the job, so `page_count` is 0 until then. 200 with the
    existing document and job when nothing new was needed.
    """
    # The context and caller are read here rather than through Depends: the busiest route skips FastAPI's
    # dependency solving (measurable CPU per upload on a small machine; same values as get_ctx/get_principal).
    ctx: ApiContext = request.app.state.ctx
    who: Principal = request.state.principal
    # Refuse before reading a body we would not take. A key well under its quota needs no database lookup, so
    # the usual upload skips a hop to a worker thread (each hop costs GIL hand-offs on a small machine).
    if not ctx.jobs.fits_without_lookup(who.tenant):
        await run_in_threadpool(ctx.jobs.check, who.tenant)
    form = await receive_form(request, ctx.spool_dir, ctx.upload_memory, max_file_bytes=ctx.limits.max_upload_bytes,
                              max_files=1, idle_timeout_s=ctx.limits.upload_idle_timeout_s)
    try:
        out, new_job_ids = await to_thread.run_sync(accept_upload, ctx, form, who, limiter=ctx.intake)
    finally:
        form.discard()  # accept_upload has done so; this covers a request cancelled before its thread started
    # Serialised by pydantic in one pass (no dict of JSON-ready values re-encoded by json.dumps).
    return Response(out.model_dump_json(by_alias=True), media_type="application/json",
                    status_code=status.HTTP_202_ACCEPTED if new_job_ids else status.HTTP_200_OK)


@router.get("/v1/documents", response_model=DocumentPage)
def documents_list(
    ctx: ApiContext = Depends(get_ctx),
    status_: Annotated[Literal["queued", "running", "succeeded", "partial", "failed"] | None,
                       Query(alias="status")] = None,
    schema: Annotated[str | None, Query(max_length=64)] = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=64)] = None,
    who: Principal = Depends(get_principal),
) -> DocumentPage:
    """The caller's tenant's documents, newest first, filtered; follow `next_cursor` for the next page."""
    flt = DocumentFilter(status=status_, schema=schema, created_after=created_after, created_before=created_before)
    with ctx.pipeline.db.read_session() as s:
        rows, next_cursor = list_documents(s, flt, limit, cursor, who.access)
        return DocumentPage(items=[document_out(d) for d in rows], next_cursor=next_cursor)


@router.get("/v1/documents/{doc_id}", response_model=DocumentDetail)
def documents_get(doc_id: RowId, ctx: ApiContext = Depends(get_ctx),
                  who: Principal = Depends(get_principal)) -> DocumentDetail:
    with ctx.pipeline.db.read_session() as s:
        return document_detail(load_document(s, doc_id, who.access, pages=True))


@router.get("/v1/documents/{doc_id}/result", response_model=ResultOut)
def documents_result(doc_id: RowId, ctx: ApiContext = Depends(get_ctx),
                     schema: Annotated[str | None, Query(max_length=64)] = None,
                     who: Principal = Depends(get_principal)) -> ResultOut:
    """The merged result, per-page results and confidences of the latest job (of `schema` if given).

    While the job is queued or running, `state` says so and `document` is null.
    """
    with ctx.pipeline.db.read_session() as s:
        return result_out(result_job(s, doc_id, schema, who.access))


@router.get("/v1/documents/{doc_id}/pages/{index}.png", response_class=FileResponse,
            responses={200: {"content": {"image/png": {}}}})
def documents_page_image(doc_id: RowId, index: PageIndex, ctx: ApiContext = Depends(get_ctx),
                         who: Principal = Depends(get_principal)) -> FileResponse:
    """The rendered page (or sampled video frame) as PNG; `index` counts from 0."""
    with ctx.pipeline.db.read_session() as s:
        key = page_blob(s, doc_id, index, who.access)
    path = ctx.pipeline.blobs.path(key)
    if not path.is_file():
        raise ApiError(404, "blob_missing", f"The image of page {index} is no longer in the blob store.")
    return FileResponse(path, media_type="image/png", headers={"Cache-Control": "private, max-age=3600"})


@router.delete("/v1/documents/{doc_id}", response_model=DeletedOut)
def documents_delete(doc_id: RowId, ctx: ApiContext = Depends(get_ctx),
                     who: Principal = Depends(get_principal)) -> DeletedOut:
    """Delete the document, its pages, jobs and results, and blobs nothing else uses."""
    with ctx.pipeline.db.session() as s:
        orphaned = delete_document(s, doc_id, who.access)
    for key in orphaned:
        ctx.pipeline.blobs.delete(key)
    return DeletedOut(id=doc_id, deleted=True)
