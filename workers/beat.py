"""celery beat for docpipe: the schedule, and a scheduler that only sends while it holds the single-beat lock.

One beat instance is enforced with a Redis lease lock (`docpipe:beat:lock`, see workers.locks): before every
tick the scheduler takes or extends the lock; a beat that does not hold it sends nothing and checks again a
few seconds later. So any number of `docpipe beat` processes may run (on several machines, for availability):
exactly one sends, and when it dies its lock expires after `beat_lock_ttl_s` and a standby takes over.
The lock is extended at least every third of its TTL (beat's max sleep is capped to that).

If the lock holder stalls past its TTL (a frozen VM) two beats can briefly both send. That costs at most a
duplicate tick: every scheduled task is safe to run twice (watch folders have their own per-folder lock and the
pipeline dedupes by content; the reconciler only re-sends what is lost; the purge is idempotent).
"""
from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.beat import Scheduler
from redis.exceptions import RedisError

from .config import TASK_PURGE, TASK_REQUEUE, TASK_SWEEP, TASK_WATCH, WorkerSettings
from .locks import RedisLock
from .markers import PREFIX, redis_client
from .runtime import process_config

log = logging.getLogger(__name__)

BEAT_LOCK_KEY = f"{PREFIX}beat:lock"


def beat_schedule(ws: WorkerSettings, *, watch: bool, retention: bool) -> dict[str, dict[str, Any]]:
    schedule: dict[str, dict[str, Any]] = {
        "requeue-stuck-jobs": {"task": TASK_REQUEUE, "schedule": ws.requeue_interval_s},
        # Blobs no row names (a crash between a blob write and its row, or a delete and its blob removal).
        "blob-sweep": {"task": TASK_SWEEP, "schedule": ws.retention_interval_s},
    }
    if watch:
        schedule["watch-folders"] = {"task": TASK_WATCH, "schedule": ws.watch_interval_s}
    if retention:
        schedule["retention-purge"] = {"task": TASK_PURGE, "schedule": ws.retention_interval_s}
    # Scheduled work must not pile up while no ingest worker runs: a tick older than its interval is dropped.
    for entry in schedule.values():
        entry["options"] = {"expires": float(entry["schedule"])}
    return schedule


class LockedScheduler(Scheduler):
    """In-memory scheduler (our entries are plain intervals, so there is nothing worth persisting) that sends
    only while this process holds the beat lock."""

    max_interval: float  # celery's Scheduler sets it (seconds between ticks at most); capped below

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        ws = process_config().worker_settings
        self.lock = RedisLock(redis_client(app.conf.broker_url), BEAT_LOCK_KEY, ws.beat_lock_ttl_s)
        self.lock_check_s = ws.beat_lock_ttl_s / 3
        self.holding = False
        super().__init__(app, *args, **kwargs)
        self.max_interval = min(self.max_interval, self.lock_check_s)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        try:
            held = self.lock.acquire_or_extend()
        except RedisError as exc:
            log.warning("beat: Redis unreachable (%s); not sending until it answers", exc)
            held = False
        if held != self.holding:
            self.holding = held
            if held:
                log.info("beat: this instance (%s) holds the beat lock and sends the schedule", self.lock.token)
            else:
                log.warning("beat: lock not held (holder: %s); standing by", self._holder())
        if not held:
            return self.lock_check_s
        return min(super().tick(*args, **kwargs), self.lock_check_s)

    def _holder(self) -> str:
        try:
            return self.lock.holder() or "none"
        except RedisError:
            return "unknown"

    def close(self) -> None:
        if self.holding:
            try:
                self.lock.release()  # a clean stop hands over at once instead of after the TTL
            except RedisError:
                pass
        super().close()
