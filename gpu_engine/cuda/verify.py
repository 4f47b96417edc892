"""Verify windows on the CUDA runner: which scratch rows hold which sequence's linear-attention state, the copies a
step needs first, and (recompute) the tokens re-fed in front of a rolled-back slot's next chunk. Host only: the
runner turns a StepPlan's copies into one copy_segments launch (verify_ops.py) and the plan's batch into tables.

Rollback of the Gated DeltaNet conv + recurrent state to the last accepted token of a window, two strategies:
- "recompute": before the window runs, its slot's state is copied into a snapshot row; rollback_state restores
  that row and the accepted tokens are re-fed in front of the slot's next chunk (their KV is rewritten with the
  same values; no logits rows). A re-fed window keeps its snapshot: no copy at all on that step.
- "window": the decode kernels' window form writes the state after every token of the window but the last into
  window rows (kernels/spec_verify.cu); rollback_state copies row keep-1 back. Costs k state writes per window
  whatever is accepted; a window longer than window_tokens + 1 tokens is refused (the engine retries the request
  without drafts).
KV of rejected tokens needs no rollback (rewritten before it is ever read); the engine frees their blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..errors import RunnerInputError
from ..runner_api import SeqChunk, StepBatch

Strategy = Literal["recompute", "window"]
STRATEGIES: tuple[str, ...] = ("recompute", "window")
CopyKind = Literal["slot_to_snap", "snap_to_slot", "window_to_slot"]


@dataclass(frozen=True)
class Copy:
    """One state copy for every linear-attention layer (conv window and recurrent state)."""

    kind: CopyKind
    slot: int  # the engine's state slot
    row: int  # snapshot row (recompute) or window row (window)


@dataclass(frozen=True)
class Window:
    """A verify window that ran: its tokens from `start` (re-fed ones first), where its rollback state lives."""

    start: int
    token_ids: np.ndarray
    positions: np.ndarray
    prefix: int  # re-fed tokens in front of the engine's chunk (recompute)
    row: int  # snapshot row (recompute) or first window row (window)


@dataclass(frozen=True)
class Refeed:
    """Recompute: the slot holds the state at `start`; these tokens come back in front of its next chunk."""

    start: int
    token_ids: np.ndarray
    positions: np.ndarray
    row: int  # the snapshot row that holds the state at `start`


@dataclass
class StepPlan:
    batch: StepBatch  # what the kernels run: the engine's chunks, re-fed tokens in front where a slot has them
    logit_skip: list[int]  # leading rows of each chunk that get no logits (the re-fed ones)
    copies: list[Copy]  # before the step's kernels, in one launch (no two copies of a plan touch one row)
    win: np.ndarray | None  # window strategy: int32 [seqs] first window row of each sequence, -1 = none
    windows: dict[int, Window] = field(default_factory=dict)  # slot -> the window this step opens
    refed: list[int] = field(default_factory=list)  # slots whose Refeed this step consumes
    evicted: list[int] = field(default_factory=list)  # slots whose old window gave its row to this step



class VerifyBook:
    """`rows`: snapshot rows (recompute) or windows (window strategy) the runner allocated; `window_tokens`: window
    rows per window (window strategy: the longest window is window_tokens + 1 tokens)."""

    def __init__(self, strategy: Strategy, rows: int, window_tokens: int = 0) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"rollback strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.strategy, self.capacity, self.window_tokens = strategy, rows, window_tokens
        # slot -> its last verify window (until the slot's next forward), oldest first: a window no rollback came for
        # (all accepted, or its sequence finished) holds its row until the slot runs again, or until a step short
        # of rows takes it (the oldest first: rollbacks come right after their own step)
        self.windows: dict[int, Window] = {}
        self.refeeds: dict[int, Refeed] = {}  # slot -> tokens to re-feed (recompute, after a rollback)
        self.pending: list[Copy] = []  # rollbacks of the window strategy, copied before the next step's kernels

    # ---- before a step ----
    def plan(self, batch: StepBatch) -> StepPlan:
        """The step as the kernels run it. Pure: nothing changes until commit(), so a forward that raises before
        its kernels leaves the book as it was and its copies are safe to repeat."""
        step_slots = {c.state_slot for c in batch.chunks}
        # Rows this plan may not take: other slots' windows and every refeed's snapshot (read by this plan's
        # restore copy, in the same launch as its snapshot copies, or kept for a later step). A step slot's old
        # window is over; the rows pending rollback copies read may be taken: the copies run before the kernels.
        stale = [s for s in self.windows if s not in step_slots]  # oldest first
        busy = {self.windows[s].row for s in stale} | {r.row for r in self.refeeds.values()}
        free = sorted(set(range(self.capacity)) - busy, reverse=True)  # pop() takes the lowest
        evicted: list[int] = []

        def take(slot: int, what: str) -> int:
            if not free and len(evicted) < len(stale):
                evicted.append(stale[len(evicted)])
                free.append(self.windows[evicted[-1]].row)
            return _take(free, slot, what)

        copies = list(self.pending)
        chunks: list[SeqChunk] = []
        skip: list[int] = []
        win = np.full(len(batch.chunks), -1, np.int32) if self.strategy == "window" else None
        opened: dict[int, Window] = {}
        refed: list[int] = []
        for i, chunk in enumerate(batch.chunks):
            slot = chunk.state_slot
            refeed = self.refeeds.get(slot)
            prefix = 0
            if refeed is not None:
                if chunk.start == refeed.start + len(refeed.token_ids):
                    chunk = _prepend(chunk, refeed)
                    prefix = len(refeed.token_ids)
                    copies.append(Copy("snap_to_slot", slot, refeed.row))
                elif chunk.start != 0:  # start 0: a fresh sequence took the slot, the refeed is moot
                    raise RunnerInputError(
                        f"state slot {slot} was rolled back to position {refeed.start + len(refeed.token_ids)}, "
                        f"but its next chunk starts at {chunk.start}")
                refed.append(slot)
            chunks.append(chunk)
            skip.append(prefix)
            if not chunk.verify:
                continue
            if self.strategy == "recompute":
                if prefix:  # the snapshot row already holds the state at the re-fed start: no copy
                    assert refeed is not None
                    row = refeed.row
                else:
                    row = take(slot, "snapshot rows")
                    copies.append(Copy("slot_to_snap", slot, row))
            else:
                if chunk.num_tokens - 1 > self.window_tokens:
                    raise RunnerInputError(
                        f"sequence {chunk.seq_id}: a verify window of {chunk.num_tokens} tokens needs "
                        f"{chunk.num_tokens - 1} window rows, this runner keeps {self.window_tokens} "
                        "(CudaRunner.verify_window_tokens)")
                row = take(slot, "verify windows")
                assert win is not None
                win[i] = row * self.window_tokens
            opened[slot] = Window(chunk.start, chunk.token_ids, chunk.positions, prefix, row)
        return StepPlan(StepBatch(chunks, batch.sampling), skip, copies, win, opened, refed, evicted)

    def commit(self, plan: StepPlan) -> None:
        """The step's forward succeeded: its copies are done, its windows are the slots' last ones, its refeeds
        are consumed."""
        self.pending = []
        for slot in [c.state_slot for c in plan.batch.chunks] + plan.evicted:
            self.windows.pop(slot, None)
        for slot in plan.refed:
            self.refeeds.pop(slot, None)
        self.windows.update(plan.windows)

    # ---- after a step ----
    def rollback(self, slot: int, keep: int) -> None:
        """The slot keeps the first `keep` tokens of its last window (counted from the engine's chunk start)."""
        window = self.windows.get(slot)
        have = 0 if window is None else len(window.token_ids) - window.prefix
        if window is None or not 1 <= keep <= have:
            raise RunnerInputError(f"state slot {slot}: cannot keep {keep} tokens of a verify window of {have} "
                                   "(rollback_state comes right after the verify forward)")
        if keep == have:
            return
        del self.windows[slot]
        total = window.prefix + keep
        if self.strategy == "recompute":
            self.refeeds[slot] = Refeed(window.start, window.token_ids[:total], window.positions[:, :total],
                                        window.row)
        else:  # the state after token `total - 1` of the window (the last one's is the slot's own)
            self.pending.append(Copy("window_to_slot", slot, window.row * self.window_tokens + total - 1))

    def forget(self, slot: int) -> None:
        """The slot's state is overwritten from elsewhere (copy_state_slot into it): nothing of it is kept."""
        self.windows.pop(slot, None)
        self.refeeds.pop(slot, None)
        self.pending = [c for c in self.pending if c.slot != slot]

    def room(self) -> int:
        """Windows the next step can open for sure: rows not held by a refeed (stale windows give theirs up)."""
        return max(0, self.capacity - len(self.refeeds))

    def owes(self, slot: int) -> bool:
        """The slot's device state is not its sequence's yet (a refeed or a rollback copy is due)."""
        return slot in self.refeeds or any(c.slot == slot for c in self.pending)


def _take(free: list[int], slot: int, what: str) -> int:
    if not free:
        raise RunnerInputError(f"state slot {slot}: no free {what} for a verify window (all in use); the runner "
                               "allocates them with the cache (CudaRunner.verify_rows)")
    free.sort(reverse=True)
    return free.pop()


def _prepend(chunk: SeqChunk, refeed: Refeed) -> SeqChunk:
    """The chunk with the re-fed tokens in front (they recompute the rolled-back state; no logits of theirs)."""
    return SeqChunk(
        seq_id=chunk.seq_id, token_ids=np.concatenate([refeed.token_ids, chunk.token_ids]),
        positions=np.concatenate([refeed.positions, chunk.positions], axis=1), start=refeed.start,
        block_table=chunk.block_table, state_slot=chunk.state_slot, vision=_shift(chunk, len(refeed.token_ids)),
        logits=chunk.logits, verify=chunk.verify, keep_hidden=chunk.keep_hidden)


def _shift(chunk: SeqChunk, rows: int) -> list:
    from ..runner_api import VisionSlice

    return [VisionSlice(v.chunk_offset + rows, v.embeddings) for v in chunk.vision]
