"""Where submitted jobs go: an in-process worker thread pool (embedded mode) or a broker (Celery workers).

Embedded mode is for one machine and no Redis: the same job function the Celery tasks call runs in daemon threads
of the API process. Jobs are durable rows, so a restart loses nothing: queued jobs found at start-up are resumed.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from pipeline.errors import NotFoundError

from .fair_queue import FairQueue

log = logging.getLogger("docpipe.api.jobs")


class JobRunner(Protocol):
    mode: str

    def start(self) -> None: ...

    def submit(self, job_ids: Iterable[int]) -> None: ...

    def queue_depth(self) -> int: ...

    def problem(self) -> str | None:
        """None when jobs can be handed on, else why not (for /readyz)."""
        ...

    def stop(self) -> None: ...


class EmbeddedRunner:
    """Runs `run_job(job_id)` in `threads` daemon threads. `run_job` must be idempotent (the pipeline's is).

    Jobs wait in a `FairQueue`: one lane per owner (`owner_of(job_id)`, e.g. the document's tenant), served in
    turn, and each thread first calls `render(job_id)` (the document's pages, if not rendered yet) holding one of
    the owner's `render_per_owner` render slots, then `run_job` without it. So one owner's expensive documents
    cannot hold every thread, and another owner's job starts as soon as a thread frees.

    When `run_job` raises (engine failure, database hiccup) the pipeline has put the job back to `queued`, or
    failed it once its attempts are spent; `still_queued` tells which, and a queued job is tried again after a
    growing delay. The pipeline's attempt cap ends the loop for a job that keeps failing.
    """

    mode = "embedded"

    def __init__(self, run_job: Callable[[int], object], threads: int = 2,
                 pending: Callable[[], list[int]] | None = None,
                 still_queued: Callable[[int], bool] | None = None, retry_delay_s: float = 2.0,
                 render: Callable[[int], object] | None = None, owner_of: Callable[[int], str] | None = None,
                 render_per_owner: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._run_job = run_job
        self._render = render
        self._owner_of = owner_of
        self._pending = pending
        self._still_queued = still_queued
        self._retry_delay_s = retry_delay_s
        self._failures: dict[int, int] = {}
        self._queue = FairQueue(render_per_owner)
        self._threads = [threading.Thread(target=self._loop, name=f"docpipe-job-{i}", daemon=True)
                         for i in range(threads)]
        self._queued: set[int] = set()  # ids in the queue, so a retry of a waiting job is not run twice
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for t in self._threads:
            t.start()
        if self._pending is not None:
            self.submit(self._pending())  # resume what a previous run left queued

    def submit(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            with self._lock:
                if job_id in self._queued:
                    continue
                self._queued.add(job_id)
            self._queue.put(job_id, self._owner(job_id))

    def _owner(self, job_id: int) -> str:
        if self._owner_of is None:
            return ""
        try:
            return self._owner_of(job_id)
        except Exception:  # noqa: BLE001 — an unknown owner only costs fairness; the job still runs
            log.warning("job %s: its owner could not be read; queued in the shared lane", job_id, exc_info=True)
            return ""

    def queue_depth(self) -> int:
        return len(self._queue)

    def problem(self) -> str | None:
        if self._started and not all(t.is_alive() for t in self._threads):
            return "an embedded worker thread has stopped"
        return None

    def stop(self) -> None:
        if not self._started:
            return
        self._queue.close()
        for t in self._threads:
            t.join(timeout=5)

    def _loop(self) -> None:
        while True:
            taken = self._queue.get()
            if taken is None:
                return
            job_id, owner = taken
            with self._lock:
                self._queued.discard(job_id)
            try:
                try:
                    if self._render is not None:
                        self._render(job_id)
                finally:
                    self._queue.rendered(owner)
                self._run_job(job_id)
                self._failures.pop(job_id, None)
            except NotFoundError:
                log.info("job %s was deleted before it ran", job_id)
            except Exception:  # the job row holds the reason; the thread must survive for the next job
                log.exception("job %s failed; the pipeline recorded the error", job_id)
                self._retry_later(job_id)

    def _retry_later(self, job_id: int) -> None:
        if self._still_queued is None or not self._still_queued(job_id):
            self._failures.pop(job_id, None)
            return
        failures = self._failures[job_id] = self._failures.get(job_id, 0) + 1
        delay = min(60.0, self._retry_delay_s * 2 ** (failures - 1))
        timer = threading.Timer(delay, self.submit, args=([job_id],))
        timer.daemon = True
        timer.start()


class BrokerRunner:
    """Hands job ids to the Celery broker; this process runs nothing itself.

    `enqueue` may fail to publish (broker down): the job stays `queued` in the database and the workers'
    reconciler publishes it later, so an upload never fails because of the broker.
    """

    mode = "broker"

    def __init__(self, enqueue: Callable[[int], object], ping: Callable[[], object]) -> None:
        self._enqueue = enqueue
        self._ping = ping

    def start(self) -> None:
        pass

    def submit(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            self._enqueue(job_id)

    def queue_depth(self) -> int:
        return 0  # the broker's queue is measured from the database (docpipe_queue_depth)

    def problem(self) -> str | None:
        try:
            self._ping()
        except Exception as exc:
            return f"broker unreachable: {exc}"
        return None

    def stop(self) -> None:
        pass
