"""docpipe's HTTP face: REST API, web UI and an OpenAI-compatible chat endpoint (FastAPI).

    from api.app import create_app      # app = create_app(settings)   (uvicorn, tests)
    docpipe serve                       # the CLI command (registered through the "docpipe.commands" entry point)

Imports `pipeline` for everything document-shaped; only `api.openai_compat` touches `gpu_engine` directly.
"""
from pipeline.threads import cap_blas_threads

# Before anything here imports numpy (uvicorn / celery import this package first): see pipeline.threads.
cap_blas_threads()
