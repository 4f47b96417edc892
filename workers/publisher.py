"""Publishing off the request path: an upload hands its job id over and returns; one thread talks to the broker.

The database row is the record of a queued job and the workers' reconciler re-sends every queued job that has no
message waiting, so a publish is only a head start. With the broker down, one publish waits for its connection
retries (about 2 s): the upload must not wait with it. Here `send` never blocks: it appends to a bounded queue
that one daemon thread drains. When a publish fails, the thread drops what is waiting and every id sent during
the next `pause_s` (those jobs stay `queued`; the reconciler sends them once the broker answers) instead of paying
the wait again for each.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundPublisher:
    def __init__(self, publish: Callable[[int], bool], *, pause_s: float = 5.0, max_waiting: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`publish(job_id)` returns False (or raises) when the broker is unreachable."""
        self._publish = publish
        self._pause_s = pause_s
        self._clock = clock
        self._waiting: deque[int] = deque(maxlen=max_waiting)  # full: the oldest id goes (the reconciler has it)
        self._wake = threading.Condition()
        self._down_until = 0.0
        self.dropped = 0  # ids left to the reconciler (broker down, or the queue full)
        self._thread = threading.Thread(target=self._run, name="docpipe-publish", daemon=True)
        self._thread.start()

    def send(self, job_id: int) -> None:
        """Queue `job_id` for publishing; returns at once whatever the broker's state."""
        with self._wake:
            if self._clock() < self._down_until:
                self.dropped += 1
                return
            if len(self._waiting) == self._waiting.maxlen:
                self.dropped += 1
            self._waiting.append(int(job_id))
            self._wake.notify()

    def pending(self) -> int:
        with self._wake:
            return len(self._waiting)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting:
                    self._wake.wait()
                job_id = self._waiting.popleft()
            try:
                ok = self._publish(job_id)
            except Exception:  # a publish error must not end the thread: the reconciler covers the job
                log.exception("publishing job %s failed", job_id)
                ok = False
            if not ok:
                with self._wake:
                    self._down_until = self._clock() + self._pause_s
                    left = len(self._waiting)
                    self.dropped += left + 1
                    self._waiting.clear()
                log.warning("the broker is unreachable: %d queued job(s) wait for the reconciler, which sends them "
                            "once it answers; publishing resumes in %g s", left + 1, self._pause_s)
