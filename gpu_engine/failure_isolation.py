"""FailureIsolation: a forward that raised is re-run in halves (bisection) to find the request(s) that make it
fail, so that only those end with the runner's error and the rest of the step keeps its rows.

What a failed forward may have half-written: KV of positions >= each chunk's start (never part of a committed or
shared block, and rewritten by the retry: harmless) and the linear-attention state slots of the batch, which are
updated in place — a retry would apply the chunk twice. So on hybrid models every surviving chunk that continues
a sequence (start > 0) is handed back to be preempted instead (its cache dropped and recomputed from its tokens,
exactly as after a cache-pressure preemption). A chunk with start == 0 restarts its state anyway (the runner
zeroes the slot), so its retried rows are kept. With runner sampling, each re-run carries its chunks' rows of the
step's SamplingRequest (the same uniforms); a preempted survivor keeps its unused uniform for its next token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .runner_api import Runner, SeqChunk, StepBatch
from .runner_sampling import (
    Rows,
    RunnerSampling,
    concat_sampled,
    num_rows,
    sampled_rows,
)
from .sampling import SampleResult
from .scheduler import ScheduledChunk
from .sequence import Sequence


@dataclass
class Isolated:
    """What the engine does after a failed forward: keep `kept` (with `rows` at `offsets`, for _after_forward),
    end `failed` with their error, preempt `tainted` (in order), remember `unused_uniform` (seq id -> draw)."""

    kept: list[ScheduledChunk]
    rows: Rows
    offsets: list[int]
    failed: list[tuple[ScheduledChunk, Exception]]
    tainted: list[Sequence]
    unused_uniform: dict[int, float] = field(default_factory=dict)
    forwards: int = 0  # re-runs it took


class FailureIsolation:
    def __init__(self, runner: Runner, vocab_size: int) -> None:
        self.runner, self.vocab_size = runner, vocab_size

    def isolate(self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk], error: Exception,
                plan: RunnerSampling | None, stateful: bool) -> Isolated:
        """The forward of the whole step (`chunks`, one per `scheduled`) raised `error`. `stateful`: the model
        has linear-attention state (see the module docstring)."""
        rows: dict[int, Rows] = {}
        failed: dict[int, Exception] = {}
        out = Isolated(kept=[], rows=np.zeros(0), offsets=[0], failed=[], tainted=[])
        self._bisect(chunks, list(range(len(chunks))), error, rows, failed, plan, out)
        kept_rows: list[Rows] = []
        for i, sc in enumerate(scheduled):
            if i in failed:
                out.failed.append((sc, failed[i]))
            elif stateful and sc.start > 0:
                out.tainted.append(sc.seq)
                row = plan.row_of_chunk.get(i) if plan is not None else None
                if plan is not None and row is not None and plan.request.temperature[row] > 0.0:
                    out.unused_uniform[sc.seq.seq_id] = float(plan.request.uniform[row])
            else:
                out.kept.append(sc)
                kept_rows.append(rows[i])
                out.offsets.append(out.offsets[-1] + num_rows(rows[i]))
        if plan is not None:
            out.rows = concat_sampled(kept_rows)
        else:
            logits = [r for r in kept_rows if isinstance(r, np.ndarray)]  # without a plan every row is logits
            out.rows = np.concatenate(logits) if logits else np.zeros((0, self.vocab_size), np.float32)
        return out

    def _bisect(
        self, chunks: list[SeqChunk], group: list[int], error: Exception, rows: dict[int, Rows],
        failed: dict[int, Exception], plan: RunnerSampling | None, out: Isolated,
    ) -> None:
        """`group` (indices into `chunks`) failed with `error`: a single chunk is a culprit; a larger group is split
        and each half re-run. Fills `rows` (chunk index -> its logit rows, or its sampled rows under `plan`) for
        chunks that ran, `failed` for culprits. A group that fails for one poisoned request costs about
        2 log2(batch) extra forwards."""
        if len(group) == 1:
            failed[group[0]] = error
            return
        mid = len(group) // 2
        for half in (group[:mid], group[mid:]):
            out.forwards += 1
            sampling = None
            if plan is not None:
                sampling = plan.request.select([plan.row_of_chunk[i] for i in half if i in plan.row_of_chunk])
            try:
                result = self.runner.forward(StepBatch([chunks[i] for i in half], sampling=sampling))
                sampled = sampled_rows(self.runner.name, result) if plan is not None else None
            except Exception as exc:
                self._bisect(chunks, half, exc, rows, failed, plan, out)
                continue
            for k, i in enumerate(half):
                a, b = result.row_offsets[k], result.row_offsets[k + 1]
                if sampled is not None:
                    rows[i] = SampleResult(sampled.token_ids[a:b].copy(), sampled.logprobs[a:b].copy(),
                                           sampled.top[a:b])
                else:  # copied: a runner may hand back the same host buffer from its next forward
                    rows[i] = np.array(result.logits[a:b], copy=True)
