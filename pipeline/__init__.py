"""docpipe's pipeline: documents in, schema-valid results in a database out.

Public surface (what the CLI, the workers and the API call; names resolve lazily so `import pipeline.settings`
stays cheap):

    from pipeline import Pipeline, Settings
    p = Pipeline(Settings())                          # database (migrated), blob store, engine client on first use

    ingest_file(p, path_or_bytes_or_stream, name=, schema=, password=, batch_id=) -> IngestOutcome  # + render
    receive_file(p, source, name=, schema=, batch_id=) -> IngestOutcome  # store + sniff only; job renders later
    render_document(p, document_id) -> status           # render a `received` document (ingest queue)
    iter_folder(p, folder, schema=, batch_id=, stable_seconds=) -> Iterator[IngestOutcome]  # a folder's files
    create_batch(p, source) -> batch id
    run_job(p, job_id, takeover=False) -> JobRun        # idempotent; resumes after a crash
    retry_job(p, job_id); stale_jobs(p, queued_for_s=)  # API retry; reconciler
    fail_job(p, job_id, reason)                         # a queued job failed for good (permanent error)
    purge_older_than(p, days) -> PurgeReport            # retention: old documents and their unshared blobs
    process_paths(p, paths, schema=) -> ProcessReport   # embedded: ingest + run here (CLI process / demo)
    get_document / get_results / get_job / list_documents / batch_progress / batch_items / jobs_by_state
    register_schema / get_schema / list_schemas         # with a Session: `with p.db.session() as s: ...`
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Pipeline": "context",
    "Settings": "settings",
    "get_settings": "settings",
    "ingest_file": "ingest",
    "iter_folder": "walk",
    "create_batch": "ingest",
    "IngestOutcome": "ingest",
    "receive_file": "ingest",
    "render_document": "rendering",
    "fail_job": "jobs",
    "purge_older_than": "retention",
    "run_job": "jobs",
    "retry_job": "jobs",
    "stale_jobs": "jobs",
    "JobRun": "jobs",
    "process_paths": "processing",
    "ProcessReport": "processing",
    "get_document": "queries",
    "get_results": "queries",
    "get_job": "queries",
    "list_documents": "queries",
    "batch_progress": "queries",
    "batch_items": "queries",
    "jobs_by_state": "queries",
    "register_schema": "schemas",
    "get_schema": "schemas",
    "list_schemas": "schemas",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
