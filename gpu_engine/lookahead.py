"""Lookahead decoding: the next step goes to the runner before the engine has taken in the tokens of the one
in flight, so the host's work on those tokens (appending them, advancing the grammars, jump-forward, outputs, the
next step's bitmasks) runs while the GPU computes, instead of between forwards (issue 14: in the 9B document run's
decode tail 23 ms of host a step sat between 33 ms forwards).

A runner with `supports_lookahead` (runner_api.py) splits a step in two: `launch(batch, previous, feed)` enqueues a
forward whose logits stay on the runner, after sampling the step launched before it with `previous` (its
SamplingRequest) and returning those tokens; `feed[i] >= 0` makes chunk i's one token the token of that row, so a
sequence's next row needs no host round trip. `finish(request)` samples the last launched step.

The engine keeps at most one step in flight (InFlight). A step is launched (not run to completion) when the runner
samples all its rows (or it has none: prompt chunks only) and it has no verify window or keep-hidden rows (a
request using the MTP head keeps them; the head alone stops nothing); its SamplingRequest is built after the
launch, while the layers run. The next step is a lookahead step, built before the in-flight tokens are known
(lookahead_step.py): first the in-flight chunks are settled — counters, num_computed, prefix-cache commits and
linear-attention snapshots, as the plain take-in does them, so a snapshot copy is ordered after the in-flight
forward and before the next one and holds the state at its chunk's end — then the scheduler's own schedule()
decides the step, told which sequences' sampled tokens are in flight. A lookahead step may hold, per sequence,
- its next token: a decode row fed from the in-flight row's token (none when that token is the request's last by
  max_tokens) — also after a last prompt chunk in flight;
- its next prompt chunk (the in-flight one was a prompt chunk, or it was not in the in-flight step), sized and cut
  by the scheduler (token budget, snapshot boundaries, encoder budget), its vision items encoded now;
- its known tokens after the in-flight row, when the grammar forced a run there (jump-forward);
- a newly admitted request's first chunk (slot, prefix-cache hit with its snapshot restored, vision items).
The plain path runs instead when a waiting request would take the slot of a max_tokens ending, the speculator would
draft, a running or admissible request uses the MTP head (it needs kept hidden rows and the head's run every step),
a row needs penalties, or the cache might have to preempt.
When the in-flight tokens are taken in, a lookahead row whose sequence has ended (stop, error, abort) is dropped,
and a fed row whose sequence received forced tokens is discarded — its KV stays (it is the token's own), its
logits row is not sampled, and the forced run follows in the next step. The grammar bitmasks of the lookahead step
are built after that take-in. So the outputs are what the plain path gives, token for token, up to float rounding
of a different chunking; seeded requests draw one uniform per sampled token as before. Any runner failure while a
step is in flight withdraws what settling it offered to the prefix cache (blocks, snapshots), preempts the
sequences involved (recomputed; no token is lost) and turns lookahead off for the engine, so the plain path's
failure isolation takes over.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import TYPE_CHECKING, Any

import numpy as np

from .lookahead_step import NextStep, next_step, settle
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
    settled: bool = False  # its cache bookkeeping is done (lookahead_step.settle)


class Lookahead:
    """The engine's in-flight step (see the module docstring); Engine.step() drives it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.runner: Any = engine.runner  # launch() / finish(): optional in the runner contract
        self.enabled = engine.config.lookahead and bool(getattr(self.runner, "supports_lookahead", False))
        self.off_reason: str | None = None  # why lookahead was turned off after a failure
        self.in_flight: InFlight | None = None

    def mtp_ahead(self) -> bool:
        """A running request, or a waiting one the next step could admit, uses the MTP head (Speculator.head_in_use:
        it needs keep_hidden rows and run_mtp every step, which launched and lookahead steps lack). A checkpoint's
        head alone does not count: requests with speculation off, or `auto` where the runner keeps the head for
        "mtp" requests (CudaOptions.mtp_in_auto off, the default), run lookahead steps at any batch."""
        eng = self.engine
        if not eng.spec.has_mtp:
            return False
        sched = eng.scheduler
        free = max(eng.config.max_num_seqs - len(sched.running), 0)
        return eng.spec.head_in_use(chain(sched.running, islice(sched.waiting, free)))

    # ---- a plain step, launched ----
    def can_launch(self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk]) -> bool:
        """A plain step goes through launch() when the runner samples every row of it and it needs nothing the
        launch path lacks (verify windows, kept hidden rows, all-row logits). A checkpoint's MTP head alone does
        not refuse it: the chunks of a request using the head keep their hidden rows, and the step after a launched
        one is a lookahead step only when no request it could run uses the head (_next_step, mtp_ahead)."""
        eng = self.engine
        if not self.enabled or self.off_reason is not None or not getattr(eng.runner, "samples_on_device", False):
            return False
        if any(c.verify or c.keep_hidden or c.logits == "all" for c in chunks):
            return False
        rows = [sc.seq.sampling_row for sc in scheduled if sc.wants_logits]
        # a step without logits rows (prompt chunks only) is launched too: the next one's chunks follow it
        return not rows or not SamplingRows.from_rows(rows).has_penalties

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
            if plan is None and any(sc.wants_logits for sc in infl.scheduled):
                raise RuntimeError("a launched step has no rows the runner can sample")
        except Exception:
            self._abandon(infl)
            raise
        infl.plan = plan
        infl.request = plan.request if plan is not None else expand_request(None, infl.offsets[-1], [])

    # ---- the step after it ----
    def advance(self) -> tuple[list[RequestOutput], bool]:
        """Take in the in-flight step's tokens; when a lookahead step can run, launch it first (so the GPU computes
        it meanwhile). Returns the outputs and whether a step was launched."""
        infl = self.in_flight
        assert infl is not None and infl.request is not None
        eng = self.engine
        settled = settle(eng, infl)  # before the next step is decided or launched (lookahead_step.py)
        nxt = self._next_step(infl)
        outputs: list[RequestOutput] = nxt.outputs if nxt is not None else []
        if nxt is not None and not nxt.scheduled:
            nxt = None  # every chunk of it ended (vision encoding failed)
        t0 = time.perf_counter()
        try:
            if nxt is None:
                sampled = self.runner.finish(infl.request)
            else:
                feed = np.array([infl.offsets[i] if i >= 0 else -1 for i in nxt.fed], np.int64)
                sampled = self.runner.launch(StepBatch(nxt.chunks), infl.request, feed)
        except Exception as exc:  # noqa: BLE001 - contained: the sequences are recomputed on the plain path
            eng.blocks.withdraw(settled.hashes, settled.snapshots)  # the KV and states behind them are suspect
            self._fail(exc, infl.scheduled + (nxt.scheduled if nxt is not None else []))
            return outputs, False
        finally:
            eng._metrics.forward_s += time.perf_counter() - t0
        if sampled is None:
            raise RuntimeError(f"runner {eng.runner.name!r} returned no tokens for the launched step")
        self.in_flight = None
        outputs += self._take_in(infl, sampled)
        if nxt is None:
            return outputs, False
        try:
            self.in_flight = self._planned(nxt.chunks, nxt.scheduled, [i >= 0 for i in nxt.fed])
        except Exception as exc:  # noqa: BLE001 - the delivered outputs must still go out
            self.off_reason = f"building the sampling request failed: {type(exc).__name__}: {exc}"
            log.exception("lookahead decoding is off for this engine: %s", self.off_reason)
            eng._counters["lookahead_failures"] += 1
            self._abandon(InFlight(nxt.scheduled, row_offsets(nxt.chunks)))
            return outputs, False
        eng._counters["lookahead_steps"] += 1
        eng._counters["lookahead_prefill_steps"] += nxt.prefill
        eng._counters["lookahead_admissions"] += nxt.admitted
        return outputs, True

    def _next_step(self, infl: InFlight) -> NextStep | None:
        """The lookahead step after the (settled) in-flight one, or None when the plain path must run next."""
        if not self.enabled or self.off_reason is not None or infl.request is None or self.mtp_ahead():
            return None  # mtp_ahead: a request using the MTP head arrived while the steps ran ahead
        return next_step(self.engine, infl)

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
        """The in-flight step's sampled tokens into the engine (its cache bookkeeping is settled already): the
        sampled rows through the plain path; discarded rows and ended sequences have nothing to take in."""
        eng = self.engine
        rows = [(sc.seq, infl.offsets[i]) for i, sc in enumerate(infl.scheduled)
                if sc.seq.status is SeqStatus.RUNNING and sc.wants_logits and not infl.discard[i]]
        return eng._sample_rows(rows, sampled, infl.plan) if rows else []

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
