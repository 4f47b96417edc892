"""Lookahead decoding: the next decode step goes to the runner before the engine has taken in the tokens of the one
in flight, so the host's work on those tokens (appending them, advancing the grammars, jump-forward, outputs, the
next step's bitmasks) runs while the GPU computes, instead of between forwards (issue 14: in the 9B document run's
decode tail 23 ms of host a step sat between 33 ms forwards).

A runner with `supports_lookahead` (runner_api.py) splits a step in two: `launch(batch, previous, feed)` enqueues a
forward whose logits stay on the runner, after sampling the step launched before it with `previous` (its
SamplingRequest) and returning those tokens; `feed[i] >= 0` makes chunk i's one token the token of that row, so a
sequence's next row needs no host round trip. `finish(request)` samples the last launched step.

The engine keeps at most one step in flight (InFlight). A step is launched (not run to completion) when the runner
samples all its rows and it has no verify window, MTP rows or keep-hidden rows; its SamplingRequest is built after
the launch, while the layers run. The next step is a lookahead step — built from the in-flight step alone, before
its tokens are known — only when nothing else could run: every running sequence is in the in-flight step, no
request waits for a free slot, the speculator would not draft. Each of its rows is, per sequence, one of
- the sequence's next token: a decode row fed from the in-flight row's token (skipped when that token is the
  request's last by max_tokens);
- its known tokens after the in-flight row, when the grammar forced a run there (jump-forward): one chunk, as a
  plain step would run them.
When the in-flight tokens are taken in, a lookahead row whose sequence has ended (stop, error, abort) is dropped,
and a fed row whose sequence received forced tokens is discarded — its KV stays (it is the token's own), its
logits row is not sampled, and the forced run follows in the next step. So the outputs are what the plain path
gives, token for token, up to float rounding of a different chunking; seeded requests draw one uniform per sampled
token as before. Any runner failure while a step is in flight preempts the sequences involved (recomputed; no
token is lost) and turns lookahead off for the engine, so the plain path's failure isolation takes over.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .forced_runs import decode_chunk
from .metrics import count_computed
from .runner_api import SamplingRequest, SeqChunk, StepBatch
from .runner_rules import row_offsets
from .runner_sampling import RunnerSampling, plan_runner_sampling
from .sampling import SampleResult, SamplingRows
from .scheduler import ScheduledChunk
from .sequence import SeqStatus

if TYPE_CHECKING:
    from .engine import Engine
    from .params import RequestOutput

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step whose tokens the engine has not taken in yet."""

    scheduled: list[ScheduledChunk]
    offsets: list[int]  # logits row of each chunk (runner_api.row_offsets)
    discard: list[bool] = field(default_factory=list)  # chunk i's row is not sampled (see the module docstring)
    plan: RunnerSampling | None = None  # the sampled rows' request (filled once the step is launched)
    request: SamplingRequest | None = None  # every row of the step: `plan`'s rows, neutral ones for discarded rows


class Lookahead:
    """The engine's in-flight step (see the module docstring); Engine.step() drives it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.runner: Any = engine.runner  # launch() / finish(): optional in the runner contract
        self.enabled = engine.config.lookahead and bool(getattr(self.runner, "supports_lookahead", False))
        self.off_reason: str | None = None  # why lookahead was turned off after a failure
        self.in_flight: InFlight | None = None

    # ---- a plain step, launched ----
    def can_launch(self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk]) -> bool:
        """A plain step goes through launch() when the runner samples every row of it and it needs nothing the
        launch path lacks (verify windows, MTP, kept hidden rows, all-row logits)."""
        eng = self.engine
        if (not self.enabled or self.off_reason is not None or eng.spec.has_mtp
                or not getattr(eng.runner, "samples_on_device", False)):
            return False
        if any(c.verify or c.keep_hidden or c.logits == "all" for c in chunks):
            return False
        rows = [sc.seq.sampling_row for sc in scheduled if sc.wants_logits]
        return bool(rows) and not SamplingRows.from_rows(rows).has_penalties

    def launch(self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk]) -> None:
        """Launch a plain step (nothing in flight): its forward now, its tokens with the next step() call. An
        error here is the plain forward's (the runner launched nothing: the engine's failure isolation runs)."""
        assert self.in_flight is None
        self.runner.launch(StepBatch(chunks), None, None)
        n = len(scheduled)
        self.in_flight = InFlight(scheduled, row_offsets(chunks), [False] * n)

    def plan_launched(self) -> None:
        """The launched plain step's sampling request, built while its layers run (uniforms, bitmasks)."""
        infl = self.in_flight
        assert infl is not None and infl.plan is None
        try:
            plan = self.engine._runner_sampling(infl.scheduled)
            if plan is None:
                raise RuntimeError("a launched step has no rows the runner can sample")
        except Exception:
            self._abandon(infl)
            raise
        infl.plan, infl.request = plan, plan.request

    # ---- the step after it ----
    def advance(self) -> tuple[list[RequestOutput], bool]:
        """Take in the in-flight step's tokens; when a lookahead step can run, launch it first (so the GPU computes
        it meanwhile). Returns the outputs and whether a step was launched."""
        nxt = self._next_step()
        infl = self.in_flight
        assert infl is not None and infl.request is not None
        eng = self.engine
        t0 = time.perf_counter()
        try:
            if nxt is None:
                sampled = self.runner.finish(infl.request)
            else:
                chunks, scheduled, fed = nxt
                feed = np.array([infl.offsets[i] if i >= 0 else -1 for i in fed], np.int64)
                sampled = self.runner.launch(StepBatch(chunks), infl.request, feed)
        except Exception as exc:  # noqa: BLE001 - contained: the sequences are recomputed on the plain path
            self._fail(exc, infl.scheduled + (nxt[1] if nxt is not None else []))
            return [], False
        finally:
            eng._metrics.forward_s += time.perf_counter() - t0
        if sampled is None:
            raise RuntimeError(f"runner {eng.runner.name!r} returned no tokens for the launched step")
        self.in_flight = None
        outputs = self._take_in(infl, sampled)
        if nxt is None:
            return outputs, False
        chunks, scheduled, fed = nxt
        try:
            self.in_flight = self._planned(chunks, scheduled, [i >= 0 for i in fed])
        except Exception as exc:  # noqa: BLE001 - the delivered outputs must still go out
            self.off_reason = f"building the sampling request failed: {type(exc).__name__}: {exc}"
            log.exception("lookahead decoding is off for this engine: %s", self.off_reason)
            eng._counters["lookahead_failures"] += 1
            self._abandon(InFlight(scheduled, row_offsets(chunks)))
            return outputs, False
        eng._counters["lookahead_steps"] += 1
        return outputs, True

    def _next_step(self) -> tuple[list[SeqChunk], list[ScheduledChunk], list[int]] | None:
        """The lookahead step after the in-flight one (fed[i]: the in-flight chunk feeding chunk i, or -1), or
        None when the plain path must run next."""
        eng, infl = self.engine, self.in_flight
        if not self.enabled or self.off_reason is not None or infl is None or infl.plan is None:
            return None
        sched = eng.scheduler
        running = sched.running
        # the in-flight rows that are their requests' last tokens (max_tokens) free their slots when taken in
        ending = sum(sc.seq.status is SeqStatus.RUNNING and sc.wants_logits and not infl.discard[i]
                     and sc.seq.remaining_tokens <= 1 for i, sc in enumerate(infl.scheduled))
        if not running or (sched.waiting and len(running) - ending < eng.config.max_num_seqs):
            return None  # a waiting request can be admitted now: the plain step admits it
        in_step = {sc.seq.seq_id for sc in infl.scheduled}
        if any(s.seq_id not in in_step or s.num_computed < s.prompt_len for s in running):
            return None
        if eng.spec.may_draft(running):
            return None
        budget = eng.config.max_batched_tokens
        chunks: list[SeqChunk] = []
        scheduled: list[ScheduledChunk] = []
        fed: list[int] = []
        for i, sc in enumerate(infl.scheduled):
            seq = sc.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            start = sc.end
            if infl.discard[i] or not sc.wants_logits:  # known tokens follow (a forced run, or its cut rest)
                n = decode_chunk(seq, min(seq.num_tokens - start, budget), sched.decode_chunk_limit)
                src = -1
            elif seq.remaining_tokens <= 1:
                continue  # the in-flight token is the request's last
            else:
                n, src = 1, i
            if n <= 0:
                return None
            need = start + n - seq.num_computed
            if not eng.blocks.can_allocate(seq, need):
                return None  # no preemption on this path: the plain step decides
            eng.blocks.allocate(seq, need)
            chunk = ScheduledChunk(seq, start, n, [])
            if src >= 0:
                chunk.wants_logits = True  # its token arrives with the in-flight step
                token_ids = np.zeros(1, np.int64)  # the runner feeds the in-flight row's token
                pos = np.full((3, 1), start + seq.prompt.rope_delta, np.int64)
            else:
                token_ids, pos = seq.token_slice(start, start + n).astype(np.int64), seq.positions(start, n)
            chunks.append(SeqChunk(seq_id=seq.seq_id, token_ids=token_ids, positions=pos, start=start,
                                   block_table=seq.block_table_array(), state_slot=seq.slot_in_use(),
                                   logits="last" if chunk.wants_logits else "none"))
            scheduled.append(chunk)
            fed.append(src)
            budget -= n
            if budget <= 0:
                break
        if not scheduled:
            return None
        return chunks, scheduled, fed

    def _planned(self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk], fed: list[bool]) -> InFlight:
        """The launched lookahead step, with the sampling request of its rows (the grammars have taken in the
        tokens its rows were fed, so the bitmasks are the right ones)."""
        eng = self.engine
        n = len(scheduled)
        discard = [False] * n
        for i, sc in enumerate(scheduled):
            seq = sc.seq
            if seq.status is not SeqStatus.RUNNING:
                discard[i] = True  # ended when its fed token came in: the row is dropped
            elif fed[i] and seq.num_tokens != sc.end:
                discard[i] = True  # forced tokens followed the fed one: they run next step
        keep = [i for i in range(n) if not discard[i] and scheduled[i].wants_logits]
        plan = plan_runner_sampling([scheduled[i] for i in keep], eng._rng, lambda: eng.structured, eng.vocab_size)
        if plan is not None:
            eng._metrics.mask_s += plan.mask_s
        offsets = row_offsets(chunks)
        rows = offsets[-1]
        request = expand_request(plan.request if plan is not None else None, rows, [offsets[i] for i in keep])
        eng._counters["lookahead_discarded_rows"] += sum(discard[i] and scheduled[i].wants_logits for i in range(n))
        return InFlight(scheduled, offsets, discard, plan, request)

    def _take_in(self, infl: InFlight, sampled: SampleResult) -> list[RequestOutput]:
        """The in-flight step's tokens into the engine: sampled rows through the plain path, discarded rows only
        advance their sequence (their KV was computed), ended sequences are skipped."""
        eng = self.engine
        sampled_rows: list[ScheduledChunk] = []
        offsets: list[int] = []
        for i, sc in enumerate(infl.scheduled):
            seq = sc.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            if infl.discard[i]:
                count_computed(eng._counters, sc)
                seq.num_computed = sc.end
                if seq.num_computed % eng.config.block_size == 0 or sc.num_tokens > 1:
                    eng.blocks.commit(seq)
                continue
            sampled_rows.append(sc)
            offsets.append(infl.offsets[i])
        if not sampled_rows:
            return []
        return eng._after_forward(sampled_rows, sampled, offsets, infl.plan)

    def _fail(self, exc: Exception, scheduled: list[ScheduledChunk]) -> None:
        """The runner raised with a step in flight: lookahead goes off, the in-flight rows' drawn uniforms stay
        with their sequences (a seeded request still draws one per token), the sequences are recomputed."""
        eng = self.engine
        self.off_reason = f"{type(exc).__name__}: {exc}"
        log.warning("lookahead decoding is off for this engine after a runner failure: %s", self.off_reason)
        eng._counters["forward_failures"] += 1
        eng._counters["lookahead_failures"] += 1
        infl = self.in_flight
        if infl is not None and infl.request is not None:
            req = infl.request
            for i, sc in enumerate(infl.scheduled):
                row = infl.offsets[i]
                if sc.wants_logits and not infl.discard[i] and sc.seq.status is SeqStatus.RUNNING \
                        and req.temperature[row] > 0.0:
                    eng._unused_uniform[sc.seq.seq_id] = float(req.uniform[row])
        self.in_flight = None
        eng._counters["preempted_after_failure"] += self._preempt(scheduled)

    def _abandon(self, infl: InFlight) -> None:
        """Drop a launched step whose sampling request could not be built: the runner's launched step is cleared,
        its sequences are recomputed (their cache went past what the engine records)."""
        self.in_flight = None
        try:
            self.runner.finish(expand_request(None, infl.offsets[-1], []))
        except Exception:  # noqa: BLE001 - the step's results are dropped either way
            log.warning("clearing an abandoned launched step failed", exc_info=True)
        self._preempt(infl.scheduled)

    def _preempt(self, scheduled: list[ScheduledChunk]) -> int:
        seen: set[int] = set()
        for sc in reversed(scheduled):  # reversed: the oldest ends up first in the waiting queue
            if sc.seq.seq_id not in seen and sc.seq.status is SeqStatus.RUNNING:
                seen.add(sc.seq.seq_id)
                self.engine.scheduler.preempt(sc.seq)
        return len(seen)


def expand_request(request: SamplingRequest | None, rows: int, at: list[int]) -> SamplingRequest:
    """`request` (rows in order) placed at rows `at` of a `rows`-row request; the other rows greedy, unmasked,
    without logprobs (their tokens are thrown away)."""
    out = SamplingRequest(
        temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int64), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), uniform=np.zeros(rows, np.float64), num_logprobs=np.full(rows, -1, np.int64),
    )
    if request is None or not at:
        return out
    idx = np.asarray(at, np.int64)
    for name in ("temperature", "top_k", "top_p", "min_p", "uniform", "num_logprobs"):
        getattr(out, name)[idx] = getattr(request, name)
    if request.bitmask is not None and request.mask_index is not None:
        out.bitmask = request.bitmask
        out.mask_index = np.full(rows, -1, np.int64)
        out.mask_index[idx] = request.mask_index
    return out
