"""The off switch of `auto` speculation that measures: a sequence whose drafts do not pay rests from drafting.

Why: a draft costs host work every step (prompt lookup over the prompt and the page text, a grammar check of the
drafts, a mask at every verified position) and device work (k more rows, rollback copies, KV blocks taken until the
window is verified). When nothing is accepted all of it is lost: on the H200, 192 document pages through a 9B model
ran at 2.04 pages/s with `auto` drafting every step against 3.36 without it (bench/results/doc_throughput.md,
session 7). So each `auto` sequence keeps a miss streak: an attempt that gains nothing (no lookup match, or every
draft rejected) rests it for 1, 2, 4, ... up to MAX_REST_STEPS decode steps; an accepted draft ends the streak.
A sequence that copies a span from its page (what prompt lookup is for) keeps drafting every step while it copies;
one whose drafts never land tries about log2(steps) times per answer instead of every step. Requests that name
their drafter ("ngram", "mtp") draft as asked.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_REST_STEPS = 32


@dataclass
class _Streak:
    misses: int = 0
    rest_until: int = 0  # the first step this sequence may draft again


class AutoBackoff:
    def __init__(self, max_rest: int = MAX_REST_STEPS) -> None:
        if max_rest < 1:
            raise ValueError(f"max_rest must be >= 1, got {max_rest!r}")
        self.max_rest = max_rest
        self.step = 0
        self._streaks: dict[int, _Streak] = {}

    @property
    def tracking(self) -> bool:
        """Some sequence has a miss streak (else forgetting has nothing to do)."""
        return bool(self._streaks)

    def new_step(self) -> None:
        self.step += 1

    def resting(self, seq_id: int) -> bool:
        streak = self._streaks.get(seq_id)
        return streak is not None and self.step < streak.rest_until

    def record(self, seq_id: int, gained: bool) -> None:
        """One attempt's outcome: `gained` = at least one draft was accepted."""
        if gained:
            self._streaks.pop(seq_id, None)
            return
        streak = self._streaks.setdefault(seq_id, _Streak())
        streak.misses += 1
        streak.rest_until = self.step + 1 + min(1 << (streak.misses - 1), self.max_rest)

    def forget_all_but(self, seq_ids: set[int]) -> None:
        """Drop the streaks of sequences that are no longer running (finished, aborted, preempted)."""
        for seq_id in [s for s in self._streaks if s not in seq_ids]:
            del self._streaks[seq_id]
