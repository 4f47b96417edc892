"""The lookahead step (lookahead.py): what the step after the in-flight one holds, built before that step's tokens
are known.

First the in-flight chunks are *settled*: the part of the engine's take-in that does not depend on the sampled
tokens (computed-token counters, num_computed, prefix-cache commits, linear-attention snapshots at block
boundaries) runs now, in the plain path's order, before anything of the next step is decided or launched. A
snapshot copy is thereby ordered after the in-flight forward and before the next one (the runner's stream order),
so it holds the state at the chunk's end, and admissions of the next step see the blocks the plain path would let
them hit. Should the in-flight step then fail, `withdraw` takes the commits and snapshots back.

Then the scheduler's own schedule() decides the next step (chunk sizes, snapshot-boundary cuts, encoder budget,
admissions with their prefix-cache lookups), told which sequences have their sampled token in flight: those get
the decode row that token is fed to. The next step is not looked ahead (None) where the plain path would decide
otherwise or the launch path cannot run it: a waiting request would take a slot freed by a max_tokens ending, the
speculator would draft, a row would need penalties, or the cache might have to preempt (no preemption here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from .metrics import count_computed
from .runner_api import SeqChunk
from .scheduler import ScheduledChunk
from .sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from .engine import Engine
    from .lookahead import InFlight
    from .params import RequestOutput


@dataclass
class Settled:
    """What settling an in-flight step offered to the prefix cache (withdrawn if that step fails)."""

    hashes: list[bytes] = field(default_factory=list)
    snapshots: list[bytes] = field(default_factory=list)


@dataclass
class NextStep:
    chunks: list[SeqChunk]
    scheduled: list[ScheduledChunk]
    fed: list[int]  # the in-flight chunk whose sampled token chunk i takes, or -1 (its tokens are known)
    outputs: list[RequestOutput]  # requests ended while the step was built (their vision encoding failed)
    prefill: bool  # it holds prompt chunks (admissions included)
    admitted: int


def settle(eng: Engine, infl: InFlight) -> Settled:
    """The in-flight chunks' cache bookkeeping (BlockManager.chunk_computed, as Engine._after_forward does it)."""
    out = Settled()
    if infl.settled:
        return out
    infl.settled = True
    for sc in infl.scheduled:
        seq = sc.seq
        if seq.status is not SeqStatus.RUNNING:
            continue  # ended while in flight
        count_computed(eng._counters, sc)
        seq.num_computed = sc.end
        hashes, snapshot = eng.blocks.chunk_computed(seq, sc.num_tokens)
        out.hashes += hashes
        if snapshot is not None:
            out.snapshots.append(snapshot)
    return out


def _penalised(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0


def next_step(eng: Engine, infl: InFlight) -> NextStep | None:
    """The lookahead step after the settled in-flight step `infl`, or None when the plain path must run next."""
    sched = eng.scheduler
    running = sched.running
    if not running:
        return None
    fed_from: dict[int, int] = {}  # seq id -> its sampled in-flight chunk
    ending = False
    for i, sc in enumerate(infl.scheduled):
        if sc.wants_logits and not infl.discard[i] and sc.seq.status is SeqStatus.RUNNING:
            fed_from[sc.seq.seq_id] = i
            ending = ending or sc.seq.remaining_tokens <= 1
    if sched.waiting and ending:
        return None  # the ending request's slot goes to a waiting one: the plain step admits it at once
    if eng.spec.may_draft(running):
        return None
    free_slots = eng.config.max_num_seqs - len(running)
    if any(_penalised(s) for s in running) or any(_penalised(s) for s in islice(sched.waiting, max(free_slots, 0))):
        return None  # penalty rows are sampled on the host
    bs, budget = eng.config.block_size, eng.config.max_batched_tokens
    if eng.blocks.num_free_blocks < -(-budget // bs) + len(running):
        return None  # the running sequences' chunks might not fit: the plain step preempts
    waiting_before = len(sched.waiting)
    out = sched.schedule(in_flight=fed_from)
    if out.preempted:  # cannot happen with the free blocks checked above
        raise RuntimeError("the scheduler preempted in a lookahead step (free-block bound broken)")
    if not out.chunks:
        return None
    return _build(eng, out.chunks, fed_from, waiting_before - len(sched.waiting))


def _build(eng: Engine, chunks_in: list[ScheduledChunk], fed_from: dict[int, int], admitted: int) -> NextStep:
    """The runner's chunks of the scheduled step, as Engine.step() builds them (vision slices encoded now, while
    the in-flight step computes)."""
    enc = eng.encoder
    outputs: list[RequestOutput] = []
    chunks: list[SeqChunk] = []
    scheduled: list[ScheduledChunk] = []
    fed: list[int] = []
    enc.prefetch([item for sc in chunks_in for item in sc.vision_items])
    # One-token rows (fed or decode) take views of two arrays built for the whole step, as Engine.step() does:
    # their positions (start + rope_delta on all three axes) and the fed rows' placeholder tokens.
    one_pos = np.array([sc.start + sc.seq.prompt.rope_delta for sc in chunks_in], np.int64)
    one_pos = np.broadcast_to(one_pos, (3, len(chunks_in))).copy()
    placeholders = np.zeros(len(chunks_in), np.int64)
    for k, sc in enumerate(chunks_in):
        seq = sc.seq
        src = fed_from.get(seq.seq_id, -1)
        try:
            vision = enc.slices(sc.vision_items, sc.start, sc.end) if sc.vision_items else []
        except Exception as exc:  # one bad image must not stop the batch
            outputs.append(eng._finish(seq, "error", f"vision encoding failed: {exc}"))
            continue
        if src >= 0:  # the runner puts the in-flight row's token in
            token_ids, pos = placeholders[k : k + 1], one_pos[:, k : k + 1]
        elif sc.is_decode:
            token_ids, pos = seq.token_slice(sc.start, sc.end), one_pos[:, k : k + 1]
        else:
            token_ids, pos = seq.token_slice(sc.start, sc.end), seq.positions(sc.start, sc.num_tokens)
        chunks.append(SeqChunk(seq_id=seq.seq_id, token_ids=token_ids, positions=pos, start=sc.start,
                               block_table=seq.block_table_array(), state_slot=seq.slot_in_use(), vision=vision,
                               logits="last" if sc.wants_logits else "none"))
        scheduled.append(sc)
        fed.append(src)
    enc.release()
    m = eng._metrics
    if scheduled:
        m.peak_tokens = max(m.peak_tokens, sum(sc.num_tokens for sc in scheduled))
    vision_rows = sum(int(v.embeddings.shape[0]) for c in chunks for v in c.vision)
    m.peak_vision_rows = max(m.peak_vision_rows, vision_rows)
    prefill = admitted > 0 or any(sc.start < sc.seq.prompt_len for sc in scheduled)
    return NextStep(chunks, scheduled, fed, outputs, prefill, admitted)
