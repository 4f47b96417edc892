"""harness.run_guarded, the guard the kernel-level checks run each case in (CPU: a recording stand-in context)."""
from __future__ import annotations

import math
import random

import pytest

from tests.cuda_runner.harness import Result, run_guarded


class _Arena:
    def __init__(self, log: list[str]) -> None:
        self.log, self.next = log, random.randint(1, 10**6)

    def mark(self) -> int:
        self.log.append(f"mark {self.next}")
        return self.next

    def release(self, mark: int) -> None:
        self.log.append(f"release {mark}")


class _Device:
    def __init__(self, log: list[str], fails: bool) -> None:
        self.log, self.fails = log, fails

    def sync(self) -> None:
        self.log.append("sync")
        if self.fails:
            raise RuntimeError("illegal address")


class _Ctx:
    def __init__(self, sync_fails: bool = False) -> None:
        self.log: list[str] = []
        self.arena, self.device = _Arena(self.log), _Device(self.log, sync_fails)


def test_a_case_that_passes_adds_only_its_own_rows_and_releases_its_buffers() -> None:
    ctx, results = _Ctx(), [Result("earlier", "f32", 0.0, 1e-4, True)]
    row = Result("mine", "bf16", 1e-3, 1e-2, True)
    run_guarded(ctx, results, "mine", "bf16", 1e-2, lambda: (ctx.log.append("case"), results.append(row)))
    mark = ctx.arena.next
    assert results[1:] == [row] and ctx.log == [f"mark {mark}", "case", "sync", f"release {mark}"]


def test_a_case_that_raises_becomes_one_failed_row_and_the_next_case_still_runs() -> None:
    ctx, results = _Ctx(), []
    tol = random.choice([1e-4, 1e-2])
    message = "x" * 300

    def broken() -> None:
        raise ValueError(message)

    run_guarded(ctx, results, "broken kernel", "f32", tol, broken)
    run_guarded(ctx, results, "next", "f32", tol, lambda: results.append(Result("next", "f32", 0.0, tol, True)))
    failed, after = results
    assert (failed.name, failed.dtype, failed.tol, failed.ok) == ("broken kernel", "f32", tol, False)
    assert math.isnan(failed.rel_err) and failed.note == f"ValueError: {message}"[:200]
    assert after.ok and ctx.log.count(f"release {ctx.arena.next}") == 2


def test_the_buffers_are_released_even_when_the_sync_raises() -> None:
    ctx, results = _Ctx(sync_fails=True), []
    with pytest.raises(RuntimeError, match="illegal address"):
        run_guarded(ctx, results, "c", "bf16", 1e-2, lambda: None)
    assert ctx.log[-2:] == ["sync", f"release {ctx.arena.next}"] and results == []
