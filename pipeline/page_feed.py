"""How a job hands its pages to the engine: as many at once as the process's page slots allow, replies in order.

The engine batches what is at it when a step begins, so it is only full when the jobs keep enough page requests
submitted. A job used to send its pages in lock-step windows (a window of 2 with the engine sizing its own batch:
the next two only after both replies were stored), and 12 jobs of 10 pages kept 24 pages at an H200 that batches
256 (issue 14 item 2). Now every job submits each page as soon as a slot is free and keeps submitting while it
waits and stores its replies; the process-wide `PageSlots` (DOCPIPE_ENGINE_PAGES_IN_FLIGHT, default 2 x the
engine's max_num_seqs) is what bounds the pixels held in memory, whatever the number of jobs.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Sequence

from .engine_client import EngineReply, EngineRequest, ExtractionClient


class PageSlots:
    """Page requests one process may have at the engine at once (each holds a decoded page and, until its vision
    encode, its processed pixels). One per Pipeline, shared by all its job threads."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"page slots must be at least 1, got {size}")
        self.size = size
        self._free = threading.BoundedSemaphore(size)

    def acquire(self, blocking: bool) -> bool:
        return self._free.acquire(blocking=blocking)

    def release(self) -> None:
        self._free.release()


@dataclass
class PageReply:
    """One unit's reply; `waited` is the time the job's thread spent waiting for it (its model time)."""

    unit: dict[str, Any]
    reply: EngineReply
    waited: float


def _close(replies: Iterator[EngineReply]) -> None:
    close = getattr(replies, "close", None)  # a generator's close() runs its cleanup (EngineClient cancels)
    if close is not None:
        close()


def stream_replies(client: ExtractionClient, units: Sequence[dict[str, Any]],
                   make_request: Callable[[dict[str, Any]], EngineRequest],
                   slots: PageSlots) -> Generator[PageReply, None, None]:
    """Submit the units' requests, each as soon as a slot is free (a job with nothing at the engine waits for one;
    a job with pages at the engine only takes free ones, so it never waits for a slot while its replies wait for
    it), and yield their replies in unit order. `make_request` (page decoding, prompt) runs just before each
    submission, so at most `slots.size` decoded pages exist at once. Closing the iterator early (the run was
    taken over, a write or the engine failed) cancels this job's requests still at the engine and frees their
    slots."""
    inflight: deque[tuple[dict[str, Any], Iterator[EngineReply]]] = deque()
    pending = iter(units)
    upcoming = next(pending, None)
    try:
        while upcoming is not None or inflight:
            while upcoming is not None and slots.acquire(blocking=not inflight):
                try:
                    replies = iter(client.run([make_request(upcoming)]))
                except BaseException:
                    slots.release()
                    raise
                inflight.append((upcoming, replies))
                upcoming = next(pending, None)
            unit, replies = inflight.popleft()
            t0 = time.perf_counter()
            try:
                reply = next(replies, None)
            finally:
                slots.release()
                _close(replies)
            waited = time.perf_counter() - t0
            if reply is None:
                raise RuntimeError(f"the engine client gave no reply for {unit['unit']}")
            yield PageReply(unit, reply, waited)
    finally:
        for _, replies in inflight:
            try:
                _close(replies)
            finally:
                slots.release()
