"""docpipe's queue: Celery + Redis workers, beat schedule, reconciler (see workers.cli for the commands).

For callers that only send work (the API): `workers.enqueue.enqueue_job(job_id)` and
`workers.enqueue.enqueue_ingest(path_or_bytes, name=..., schema=...)`.
"""
from pipeline.threads import cap_blas_threads

# Before anything here imports numpy (uvicorn / celery import this package first): see pipeline.threads.
cap_blas_threads()
