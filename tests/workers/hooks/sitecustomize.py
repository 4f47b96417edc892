"""Test-only faults for worker processes, loaded by Python at start-up when this folder is on PYTHONPATH (the
time-limit tests put it there) and WORKERS_TEST_STUCK names a fault. Nothing here is product code.

    engine         the engine loses each request whose prompt holds STUCK-REQUEST: never scheduled, never timed
                   out (a scheduler bug); aborting it still works, as on the real engine
    thread         a run submitting such a request blocks in C code for good (time.sleep in a task thread: no
                   engine call ever returns, nothing in Python can interrupt it)
    render-soft    rendering a document whose name holds "hang" loops for good in Python (Celery's soft limit
                   can interrupt it)
    render-hard    the same, with the soft limit's signal (SIGUSR1) ignored: only the hard limit ends it
"""
from __future__ import annotations

import os

MARK = "STUCK-REQUEST"
FAULT = os.environ.get("WORKERS_TEST_STUCK", "")


def _engine_faults(thread_stuck: bool) -> None:
    import time
    import uuid

    from gpu_engine import async_engine, engine
    from gpu_engine.params import RequestOutput

    submit, add_request, abort = async_engine.AsyncEngine.submit, engine.Engine.add_request, engine.Engine.abort

    def patched_submit(self, prompt, params=None, request_id=None, **kwargs):
        if MARK in repr(prompt):
            if thread_stuck:
                time.sleep(10 ** 6)
            request_id = "stuck-" + uuid.uuid4().hex
        return submit(self, prompt, params, request_id, **kwargs)

    def patched_add(self, prompt, params=None, request_id=None):
        if request_id is not None and request_id.startswith("stuck-"):
            self.__dict__.setdefault("_test_stuck", set()).add(request_id)
            return request_id
        return add_request(self, prompt, params, request_id)

    def patched_abort(self, request_id):
        stuck = self.__dict__.get("_test_stuck", set())
        if request_id in stuck:
            stuck.discard(request_id)
            self._pending.append(RequestOutput(request_id=request_id, text="", token_ids=[], finished=True,
                                               finish_reason="abort"))
            return True
        return abort(self, request_id)

    async_engine.AsyncEngine.submit = patched_submit
    engine.Engine.add_request = patched_add
    engine.Engine.abort = patched_abort


def _render_fault(block_soft_signal: bool) -> None:
    import signal
    import time

    from sqlalchemy import select

    import pipeline.attempts as attempts
    from pipeline.models import Document

    render_document = attempts.render_document

    def patched(p, document_id, *args, **kwargs):
        with p.db.read_session() as s:
            name = s.scalar(select(Document.original_name).where(Document.id == document_id)) or ""
        if "hang" in name:
            if block_soft_signal:  # billiard's soft-limit signal (any thread may take it: ignore it outright)
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            while True:
                time.sleep(0.05)
        return render_document(p, document_id, *args, **kwargs)

    attempts.render_document = patched


if FAULT in ("engine", "thread"):
    _engine_faults(thread_stuck=FAULT == "thread")
elif FAULT in ("render-soft", "render-hard"):
    _render_fault(block_soft_signal=FAULT == "render-hard")

