"""The GPU task's watchdog (workers.gpu_watch) step by step, with explicit clock readings: limits from the
request budget, progress, the soft limit (requests aborted, the run's engine calls raise), the hard limit, and
the waits that do not count. The real worker processes are in test_workers_time_limits.py."""
from __future__ import annotations

import random
import threading
import time

import pytest
from pydantic import ValidationError

from pipeline.attempts import RunGate
from workers.config import WorkerSettings
from workers.gpu_watch import GpuTimeLimits, GpuWatchdog, TaskTimeLimitExceeded, WatchedEngine, gpu_time_limits


class Handle:
    """An engine request as the watchdog sees it: done or not, cancellable (cancel finishes it, as an abort)."""

    def __init__(self) -> None:
        self.finished = False
        self.cancelled = False

    def done(self) -> bool:
        return self.finished

    def cancel(self) -> None:
        self.cancelled = self.finished = True

    def result(self, timeout: float | None = None) -> str:
        return "abort" if self.cancelled else "ok"


class Engine:
    def __init__(self) -> None:
        self.handles: list[Handle] = []

    def submit(self, *_args: object, **_kwargs: object) -> Handle:
        self.handles.append(Handle())
        return self.handles[-1]

    def stats(self) -> dict[str, int]:
        return {"requests": len(self.handles)}


def _watchdog(soft: float, hard: float, idle=lambda _tid: False):
    hard_calls: list[tuple[int, str]] = []
    dog = GpuWatchdog(GpuTimeLimits(soft, hard), on_hard=lambda w, reason: hard_calls.append((w.job_id, reason)),
                      idle=idle, poll_s=3600)  # the loop never ticks by itself here: the test does
    return dog, hard_calls


def test_limits_come_from_the_request_timeout_and_the_margin() -> None:
    timeout, margin = random.uniform(1, 900), random.uniform(0.5, 14)
    limits = gpu_time_limits(timeout, margin)
    assert limits.soft_s == pytest.approx(timeout + margin)
    assert limits.hard_s == pytest.approx(timeout + 2 * margin)


@pytest.mark.parametrize("soft, hard", [(0.0, 1.0), (5.0, 5.0), (6.0, 5.0), (-1.0, 2.0)])
def test_limits_that_cannot_work_are_refused(soft: float, hard: float) -> None:
    with pytest.raises(ValueError, match="soft_s < hard_s"):
        GpuTimeLimits(soft, hard)


@pytest.mark.parametrize("margin", ["0", "-1", "15", "30"])
def test_the_margin_must_keep_the_limits_before_the_engine_clients_own_wait(margin: str) -> None:
    with pytest.raises(ValidationError):
        WorkerSettings(gpu_time_limit_margin_s=margin)


def test_a_run_without_progress_has_its_requests_aborted_and_its_engine_calls_raise() -> None:
    dog, hard_calls = _watchdog(soft=10.0, hard=20.0)
    engine = Engine()
    front = WatchedEngine(engine, dog)
    job_id = random.randrange(1, 10**6)
    with dog.watch(job_id) as w:
        answered, pending = front.submit([]), front.submit([])
        engine.handles[0].finished = True
        dog.tick(w.last_progress + 1.0)  # a reply: progress
        start = w.last_progress
        dog.tick(start + 9.9)
        assert w.reason is None and not engine.handles[1].cancelled  # within the soft limit
        dog.tick(start + 10.1)
        assert w.reason is not None and "soft time limit" in w.reason
        assert engine.handles[1].cancelled and not engine.handles[0].cancelled  # only what was still running
        with pytest.raises(TaskTimeLimitExceeded, match="soft time limit of the GPU task"):
            pending.result(5)  # the wait the run is blocked in ends with the reason, not with "abort"
        with pytest.raises(TaskTimeLimitExceeded):
            answered.result(5)
        with pytest.raises(TaskTimeLimitExceeded):
            front.submit([])  # nor may it start another request
        assert len(engine.handles) == 2
        assert hard_calls == []
        dog.tick(start + 20.1)
        assert hard_calls == [(job_id, hard_calls[0][1])] and "hard time limit" in hard_calls[0][1]


def test_each_reply_and_each_submit_restarts_the_clock() -> None:
    dog, hard_calls = _watchdog(soft=10.0, hard=20.0)
    engine = Engine()
    front = WatchedEngine(engine, dog)
    with dog.watch(1) as w:
        now = w.last_progress
        for _ in range(5):  # a long run that keeps answering never reaches its limit
            front.submit([])
            now = w.last_progress + 8.0
            engine.handles[-1].finished = True
            dog.tick(now)
            assert w.last_progress == now
        dog.tick(now + 9.0)
    assert w.reason is None and hard_calls == []


def test_a_render_the_run_must_do_first_counts_once_on_top() -> None:
    dog, _ = _watchdog(soft=10.0, hard=20.0)
    with dog.watch(1, allowance_s=100.0) as w:
        start = w.last_progress
        dog.tick(start + 105.0)
        assert w.reason is None
        dog.tick(start + 110.5)
        assert w.reason is not None


def test_a_run_waiting_in_the_run_gate_is_not_on_the_clock() -> None:
    waiting: set[int] = set()
    dog, hard_calls = _watchdog(soft=10.0, hard=20.0, idle=lambda tid: tid in waiting)
    with dog.watch(1) as w:
        waiting.add(w.thread_id)
        dog.tick(w.last_progress + 500.0)
        assert w.reason is None
        waiting.clear()
        start = w.last_progress
        dog.tick(start + 10.5)
        assert w.reason is not None
    assert hard_calls == []


def test_a_run_that_ended_is_not_stopped_afterwards() -> None:
    dog, hard_calls = _watchdog(soft=10.0, hard=20.0)
    with dog.watch(1) as w:
        dog.tick(w.last_progress + 10.5)
    dog.tick(w.last_progress + 60.0)
    assert hard_calls == []


def test_requests_of_unwatched_threads_pass_through() -> None:
    dog, _ = _watchdog(soft=10.0, hard=20.0)
    engine = Engine()
    front = WatchedEngine(engine, dog)
    handle = front.submit([])
    assert handle is engine.handles[0]  # no watch: the engine's own handle
    assert front.stats() == {"requests": 1}  # the rest of the engine is reachable as before


def test_the_run_gate_says_which_threads_wait() -> None:
    gate = RunGate()
    entered = threading.Event()
    release = threading.Event()

    def shared() -> None:
        with gate.shared():
            entered.set()
            release.wait(10)

    def alone() -> None:
        with gate.alone():
            pass

    runner = threading.Thread(target=shared)
    runner.start()
    entered.wait(10)
    waiter = threading.Thread(target=alone)
    waiter.start()
    deadline = time.monotonic() + 10
    while not gate.is_waiting(waiter.ident or 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.is_waiting(waiter.ident or 0)
    assert not gate.is_waiting(runner.ident or 0)
    release.set()
    runner.join(10)
    waiter.join(10)
    assert not gate.is_waiting(waiter.ident or 0)
