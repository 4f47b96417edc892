"""The embedded runner's queue: one lane per owner, served in turn, and a cap on each owner's renders at once.

Why: with one FIFO queue, a key that uploads ten expensive documents takes every job thread for as long as their
renders last, and everyone else's upload waits behind them. Here the threads take from the owners' lanes in
rotation (an owner with one waiting job is served as soon as a thread frees, however long another owner's lane
is), and an owner with `per_owner` documents rendering gets no further job until one of them finished rendering,
so at least `threads - per_owner` threads stay free for the others.

The owner is an opaque label (`EmbeddedRunner` asks `owner_of(job_id)`; the app gives the key that uploaded the
document, or its tenant for a document without a key: pipeline.render_owner). Jobs without a known owner share
the lane "".
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque


class FairQueue:
    """Job ids per owner. `get` blocks until some owner below the render cap has one; `rendered` frees the slot
    `get` took. `close` wakes every waiting `get` with None."""

    def __init__(self, per_owner: int) -> None:
        if per_owner < 1:
            raise ValueError(f"per_owner must be >= 1, got {per_owner}")
        self._per_owner = per_owner
        self._lanes: OrderedDict[str, deque[int]] = OrderedDict()  # rotation order: next owner to serve first
        self._rendering: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False

    def put(self, job_id: int, owner: str) -> None:
        with self._cond:
            self._lanes.setdefault(owner, deque()).append(job_id)
            self._cond.notify_all()

    def get(self) -> tuple[int, str] | None:
        """(job id, owner) of the next job by rotation, counted as rendering for its owner; None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                owner = next((o for o, lane in self._lanes.items()
                              if lane and self._rendering.get(o, 0) < self._per_owner), None)
                if owner is not None:
                    break
                self._cond.wait()
            lane = self._lanes.pop(owner)
            job_id = lane.popleft()
            if lane:
                self._lanes[owner] = lane  # back of the rotation
            self._rendering[owner] = self._rendering.get(owner, 0) + 1
            return job_id, owner

    def rendered(self, owner: str) -> None:
        """The job `get` gave for `owner` has finished rendering (or failed to): the slot is free."""
        with self._cond:
            left = self._rendering.get(owner, 0) - 1
            if left > 0:
                self._rendering[owner] = left
            else:
                self._rendering.pop(owner, None)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return sum(len(lane) for lane in self._lanes.values())
