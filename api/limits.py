"""Per-client limits: a request-rate token bucket and caps on work in flight (jobs, engine requests).

One runaway client must not take the whole queue or the engine's cache, so every key gets its own budget.
With several server processes (`docpipe serve --workers N`) the request rate of each configured API key is one
budget in shared memory (SharedBuckets); the other limits (refused logins per client address, jobs and engine
requests in flight) are kept by each process for itself.
"""
from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from .errors import RateLimited


@dataclass(frozen=True)
class ApiLimits:
    """Limits the API enforces. Built from `pipeline.settings.Settings` by `api.app.limits_from_settings`."""

    rate_per_minute: int = 120  # requests per key per minute (sustained)
    burst: int = 60  # requests a key may send at once before the rate applies
    max_inflight_jobs: int = 32  # queued + running jobs one key may hold
    max_inflight_engine: int = 4  # concurrent /v1/chat/completions requests per key
    max_upload_bytes: int = 512 * 1024 * 1024  # one uploaded file
    max_batch_files: int = 100  # files in one POST /v1/batches
    max_batch_bytes: int = 2 * 1024**3  # one POST /v1/batches body
    max_json_bytes: int = 32 * 1024 * 1024  # JSON request bodies (chat requests carry data: URL images)
    max_image_bytes: int = 20 * 1024 * 1024  # one decoded data: URL image or video
    max_images_per_request: int = 16  # images + sampled video frames in one chat request
    max_request_pixels: int = 64_000_000  # decoded pixels of one chat request's images and frames (~200 MB RGB)
    max_prompt_bytes: int = 1024 * 1024  # UTF-8 text of one chat request; a token is >= 1 byte, so >= the tokens
    max_completion_tokens: int = 4096  # largest max_tokens a chat request may ask for (bounds engine time)
    upload_idle_timeout_s: int = 60  # an upload that sends nothing for this long is cut off (408)
    image_decode_timeout_s: float = 20.0  # one chat image's decode, in a render process (a page's render budget)

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:  # the counts are ints, so this is >= 1 for them
                raise ValueError(f"ApiLimits.{name} must be > 0, got {getattr(self, name)}")


def _take_token(tokens: float, last: float, now: float, rate: float, burst: float) -> tuple[float, float | None]:
    """One token bucket step: the tokens left after refilling since `last` and taking one, and None, or the
    tokens left untouched and the seconds to wait for the next token."""
    tokens = min(burst, tokens + (now - last) * rate)
    if tokens < 1.0:
        return tokens, (1.0 - tokens) / rate
    return tokens - 1.0, None


class SharedBuckets:
    """Token buckets of a fixed set of names (the configured API keys' ids) in shared memory, so that several
    server processes draw on one budget per key. Made before the processes start; passed to each of them."""

    def __init__(self, names: Iterable[str]) -> None:
        context = multiprocessing.get_context("spawn")
        self._index = {name: i for i, name in enumerate(dict.fromkeys(names))}
        self._state = context.RawArray("d", 2 * max(1, len(self._index)))  # per name: tokens, last refill (0 = new)
        self._lock = context.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def take(self, name: str, now: float, rate: float, burst: float) -> float | None:
        """Take a token from `name`'s bucket: None, or the seconds until one is available."""
        i = 2 * self._index[name]
        with self._lock:
            tokens, last = self._state[i], self._state[i + 1]
            if last == 0.0:
                tokens, last = burst, now
            tokens, wait = _take_token(tokens, last, now, rate, burst)
            self._state[i], self._state[i + 1] = tokens, now
        return wait


class RateLimiter:
    """Token bucket per client key: `burst` tokens, refilled at `rate_per_minute / 60` per second.

    Buckets are kept per key and per client address (refused logins), so the table is pruned of full buckets
    (clients that have been quiet long enough) once it grows past `max_tracked` entries. Names in `shared` (the
    API keys, with several server processes) use the shared buckets instead, on a clock all processes share.
    """

    max_tracked = 10_000

    def __init__(self, rate_per_minute: int, burst: int, clock: Callable[[], float] = time.monotonic,
                 shared: SharedBuckets | None = None) -> None:
        self._rate = rate_per_minute / 60.0
        self._burst = float(burst)
        self._clock = clock
        self._shared = shared
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._lock = threading.Lock()

    def check(self, key: str) -> None:
        """Take one token for `key` or raise RateLimited with the wait until the next token."""
        now = self._clock()
        if self._shared is not None and key in self._shared:
            wait = self._shared.take(key, now, self._rate, self._burst)
        else:
            with self._lock:
                tokens, last = self._buckets.get(key, (self._burst, now))
                tokens, wait = _take_token(tokens, last, now, self._rate, self._burst)
                self._buckets[key] = (tokens, now)
                if len(self._buckets) > self.max_tracked:
                    self._prune(now)
        if wait is not None:
            raise RateLimited(
                "rate_limited",
                f"Too many requests for this API key (limit {self._rate * 60:.0f}/minute); retry later.",
                wait,
            )

    def _prune(self, now: float) -> None:
        full_after = self._burst / self._rate  # seconds for an empty bucket to refill completely
        self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < full_after}

    def tracked(self) -> int:
        with self._lock:
            return len(self._buckets)


class EngineSlots:
    """Caps concurrent engine requests per key; a request holds a slot until its response (or stream) ends."""

    def __init__(self, per_key: int) -> None:
        self._per_key = per_key
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        self.acquire(key)
        try:
            yield
        finally:
            self.release(key)

    def acquire(self, key: str) -> None:
        with self._lock:
            held = self._held.get(key, 0)
            if held >= self._per_key:
                raise RateLimited(
                    "too_many_engine_requests",
                    f"This API key already has {held} model requests running (limit {self._per_key}); "
                    "wait for one to finish.",
                    1.0,
                )
            self._held[key] = held + 1

    def release(self, key: str) -> None:
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    def held(self, key: str) -> int:
        with self._lock:
            return self._held.get(key, 0)


class JobQuota:
    """An early refusal of work past the in-flight job cap of a tenant (the routes pass the tenant as `key`),
    before an upload's body is read. The cap itself is enforced by `pipeline.quotas` in the transaction that
    queues each job; this is only the cheap pre-check, so it may let a request through that intake then refuses.

    The server remembers which tenant submitted which job; `still_active` (a DB lookup supplied by the app) says
    which of those are not finished yet, so jobs finished by any process (embedded thread or Celery worker) free
    their slot. The lookup is only made when the remembered jobs could reach the cap, so a tenant well under it
    costs an upload no query.
    """

    def __init__(self, per_key: int, still_active: Callable[[Iterable[int]], set[int]]) -> None:
        self._per_key = per_key
        self._still_active = still_active
        self._jobs: dict[str, set[int]] = {}  # key -> the job ids it submitted
        self._lock = threading.Lock()

    def fits_without_lookup(self, key: str, adding: int = 1) -> bool:
        """True when `key` can add `adding` jobs even if every remembered job were still active: the answer of
        `check` without a database query, cheap enough for the event loop (only `check` may block)."""
        with self._lock:
            return len(self._jobs.get(key, ())) + adding <= self._per_key

    def check(self, key: str, adding: int = 1) -> None:
        """Raise RateLimited when `key` cannot add `adding` more jobs now."""
        with self._lock:
            mine = set(self._jobs.get(key, set()))
        if len(mine) + adding <= self._per_key:
            return  # even if every remembered job were still active, this fits: no need to ask the database
        active = self._still_active(mine) if mine else set()
        with self._lock:
            # Jobs recorded since the lookup stay counted; finished ones are forgotten.
            current = self._jobs.get(key, set())
            current = {j for j in current if j in active or j not in mine}
            self._jobs[key] = current
            if len(current) + adding > self._per_key:
                raise RateLimited(
                    "too_many_jobs",
                    f"This API key has {len(current)} jobs queued or running (limit {self._per_key}); "
                    "wait for some to finish.",
                    5.0,
                )

    def record(self, key: str, job_ids: Iterable[int]) -> None:
        with self._lock:
            self._jobs.setdefault(key, set()).update(job_ids)
