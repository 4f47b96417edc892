"""Soft and hard time limits of the GPU tasks, which Celery cannot enforce in the GPU worker's thread pool.

Celery's limits need a prefork child and signals; the GPU worker runs its tasks on threads (they all feed one
engine's continuous batcher), so a watchdog thread in the worker enforces them instead, from the same budgets:

* The engine ends every request by itself at its arrival + `DOCPIPE_REQUEST_TIMEOUT_S`. So a healthy run never
  goes longer than that without progress (an engine request submitted or answered), plus a short gap for its own
  work between two requests (one page's image prepared, one result written): `DOCPIPE_GPU_TIME_LIMIT_MARGIN_S`.
  A run whose document must still be rendered first gets the document's render budget on top, once; time spent
  waiting in the run gate (for a job that must run alone, pipeline.attempts) does not count.
* **Soft limit** (request timeout + margin without progress): the run's engine requests are aborted, and its
  next engine call (the wait it is blocked in, or its next submit) raises `TaskTimeLimitExceeded`. `run_job` puts
  the job back to `queued` with that reason, charged one attempt, and the task retries it with backoff; at the
  attempt cap the job ends `failed` with the reason. The worker and the other runs go on.
* **Hard limit** (one more margin, the run still did not end: it is stuck where no engine call comes, e.g. in
  C code or an engine whose step loop hangs): the watchdog releases the job itself (charged, `queued` with the
  reason and marked to run alone next, or `failed` at the cap), publishes its retry, and exits the process
  (`EXIT_TIME_LIMIT`). The supervisor (`--gpus`) or the service manager starts it again with a fresh engine; the
  runs that shared the process are taken over and refunded as after any crash (pipeline.attempts).

Both limits stay below the engine client's own last-resort wait (request timeout + 30 s), so they act first.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

EXIT_TIME_LIMIT = 75  # the GPU worker stopped itself: a run passed its hard time limit (EX_TEMPFAIL: restart it)


class TaskTimeLimitExceeded(Exception):
    """A GPU run passed its soft time limit; raised from its engine calls (the message is the job's reason)."""


@dataclass(frozen=True)
class GpuTimeLimits:
    soft_s: float  # without progress: abort the run's requests, its engine calls raise
    hard_s: float  # without progress: the run is stuck past reach; release the job and exit the process

    def __post_init__(self) -> None:
        if not 0 < self.soft_s < self.hard_s:
            raise ValueError(f"need 0 < soft_s < hard_s, got {self.soft_s}, {self.hard_s}")


def gpu_time_limits(request_timeout_s: float, margin_s: float) -> GpuTimeLimits:
    """The GPU task's limits from the engine's request budget (see the module docstring)."""
    soft = request_timeout_s + margin_s
    return GpuTimeLimits(soft_s=soft, hard_s=soft + margin_s)


@dataclass
class Watch:
    """One watched run: the thread that runs it and what the watchdog knows of its progress."""

    job_id: int
    thread_id: int
    allowance_s: float  # added to the first interval only (a render the run must do first)
    last_progress: float = field(default_factory=time.monotonic)
    handles: list[Any] = field(default_factory=list)  # its engine requests not answered yet
    reason: str | None = None  # set when the soft limit fired

    def check(self) -> None:
        """Called in the run's own thread at each engine call: raise once the soft limit fired."""
        if self.reason is not None:
            raise TaskTimeLimitExceeded(self.reason)


class GpuWatchdog:
    """Watches runs (`watch(job_id)` around `run_job`) from one daemon thread.

    `idle(thread_id)` says whether a thread is waiting legitimately (the run gate): its clock does not run.
    `on_hard(watch, reason)` is what the hard limit does (the worker's: release the job and exit the process)."""

    def __init__(self, limits: GpuTimeLimits, *, on_hard: Callable[[Watch, str], None],
                 idle: Callable[[int], bool] = lambda _tid: False, poll_s: float | None = None) -> None:
        self.limits = limits
        self._on_hard = on_hard
        self._idle = idle
        self._poll_s = poll_s if poll_s is not None else min(1.0, (limits.hard_s - limits.soft_s) / 4)
        self._watches: dict[int, Watch] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, job_id: int, *, allowance_s: float = 0.0) -> Iterator[Watch]:
        w = Watch(job_id, threading.get_ident(), allowance_s)
        with self._lock:
            self._watches[w.thread_id] = w
            self._start()
        try:
            yield w
        finally:
            with self._lock:
                self._watches.pop(w.thread_id, None)

    def current(self) -> Watch | None:
        with self._lock:
            return self._watches.get(threading.get_ident())

    def submitted(self, handle: Any) -> None:
        """The calling thread's run submitted an engine request (progress)."""
        with self._lock:
            w = self._watches.get(threading.get_ident())
            if w is not None:
                w.handles.append(handle)
                w.last_progress = time.monotonic()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="docpipe-gpu-watchdog", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self._poll_s)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """One look at every watched run (the loop calls it; tests may too)."""
        with self._lock:
            watches = list(self._watches.values())
        for w in watches:
            if w.reason is None:  # past the soft limit nothing counts as progress (its aborts end requests too)
                with self._lock:  # answered requests are dropped: a 2,000-page run keeps no replies alive here
                    running = [h for h in w.handles if not h.done()]
                    answered, w.handles = len(w.handles) > len(running), running
                if answered or self._idle(w.thread_id):
                    w.last_progress, w.allowance_s = now, 0.0
                    continue
            silent = now - w.last_progress - w.allowance_s
            if w.reason is None and silent > self.limits.soft_s:
                self._soft(w)
            elif w.reason is not None and silent > self.limits.hard_s:
                with self._lock:
                    still_running = self._watches.get(w.thread_id) is w
                if still_running:
                    self._on_hard(w, self._hard_reason(w))

    def _soft(self, w: Watch) -> None:
        w.reason = (f"soft time limit of the GPU task: no progress for {self.limits.soft_s:.0f} s "
                    "(DOCPIPE_REQUEST_TIMEOUT_S + DOCPIPE_GPU_TIME_LIMIT_MARGIN_S); its engine requests were "
                    "aborted")
        log.warning("job %s: %s", w.job_id, w.reason)
        for handle in w.handles:
            if not handle.done():
                handle.cancel()

    def _hard_reason(self, w: Watch) -> str:
        return (f"hard time limit of the GPU task: no progress for {self.limits.hard_s:.0f} s, and the run did not "
                "stop at its soft limit; the worker process was restarted")


class WatchedEngine:
    """An AsyncEngine as the engine client sees it, with each request counted on its run's watch: a submit is
    progress, and a run past its soft limit gets `TaskTimeLimitExceeded` from its next submit or wait."""

    def __init__(self, engine: Any, watchdog: GpuWatchdog) -> None:
        self._engine = engine
        self._watchdog = watchdog

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        w = self._watchdog.current()
        if w is not None:
            w.check()
        handle = self._engine.submit(*args, **kwargs)
        if w is None:
            return handle
        self._watchdog.submitted(handle)
        return _WatchedHandle(handle, w)

    def __getattr__(self, name: str) -> Any:  # stats, shutdown, model_fingerprint, ... of the real engine
        return getattr(self._engine, name)


class _WatchedHandle:
    def __init__(self, handle: Any, watch: Watch) -> None:
        self._handle = handle
        self._watch = watch

    def result(self, timeout: float | None = None) -> Any:
        try:
            out = self._handle.result(timeout)
        except Exception:
            self._watch.check()  # aborted by the soft limit: that is the reason, not the abort
            raise
        self._watch.check()
        return out

    def __getattr__(self, name: str) -> Any:  # done, cancel, request_id, stream
        return getattr(self._handle, name)


def exit_process(reason: str) -> None:
    """The hard limit's last step: stop this worker process (its supervisor starts a fresh one)."""
    log.critical("GPU worker pid %d exits: %s", os.getpid(), reason)
    logging.shutdown()
    os._exit(EXIT_TIME_LIMIT)
