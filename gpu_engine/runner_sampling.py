"""Sampling on the runner, engine side: the SamplingRequest of a step whose every row the runner can sample (no
repetition / presence penalty), with each sampled row's uniform drawn here and the grammar bitmask filled here,
so the runner's tokens equal the host sampler's (runner_api.py says what the runner does with it)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .runner_api import SamplingRequest, StepOutput
from .sampling import SampleResult, SamplingRows, bitmask_allows_any
from .scheduler import ScheduledChunk
from .sequence import Sequence
from .structured import StructuredOutput

Rows = np.ndarray | SampleResult  # one step's logits rows, or the rows the runner sampled


@dataclass
class RunnerSampling:
    """What the engine prepared for sampling on the runner in one step."""

    request: SamplingRequest
    row_of_chunk: dict[int, int]  # chunk index -> its row of the request
    dead: list[Sequence]  # grammar allows no token: sent unconstrained, token discarded, the request ends
    mask_s: float = 0.0  # time spent filling the grammar bitmask


def plan_runner_sampling(scheduled: list[ScheduledChunk], rng_of: Callable[[Sequence], Any],
                         structured: Callable[[], StructuredOutput], vocab_size: int) -> RunnerSampling | None:
    """The SamplingRequest for this step when the runner can sample every row of it, else None (host path).

    Draws each sampled row's uniform now (one per sampled token, as the host sampler does, from `rng_of(seq)`) and
    fills the grammar bitmask of constrained rows; a row whose grammar allows nothing is sent unconstrained and
    marked dead (its token is discarded, exactly like the host path's all-zero row)."""
    picked = [(i, sc.seq) for i, sc in enumerate(scheduled) if sc.wants_logits]
    if not picked:
        return None
    seqs = [s for _, s in picked]
    rows = SamplingRows.from_rows([s.sampling_row for s in seqs])
    if rows.has_penalties:
        return None
    uniform = np.zeros(len(seqs), np.float64)
    for i in np.nonzero(rows.temperature > 0.0)[0]:
        uniform[i] = float(rng_of(seqs[i]).random())
    bitmask = mask_index = None
    dead: list[Sequence] = []
    mask_s = 0.0
    at = [r for r, s in enumerate(seqs) if s.matcher is not None]  # the constrained rows; mask j is row at[j]'s
    if at:
        tm = time.perf_counter()
        bitmask = structured().bitmask([(seqs[r].matcher, j) for j, r in enumerate(at)], len(at))
        allows_any = bitmask_allows_any(bitmask, vocab_size)
        rows_at = np.asarray(at, np.int64)
        mask_index = np.full(len(seqs), -1, np.int64)
        mask_index[rows_at[allows_any]] = np.nonzero(allows_any)[0]
        if not allows_any.all():
            dead = [seqs[r] for r in rows_at[~allows_any].tolist()]
        mask_s = time.perf_counter() - tm
    request = SamplingRequest(
        temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p, min_p=rows.min_p, uniform=uniform,
        num_logprobs=rows.num_logprobs, bitmask=bitmask, mask_index=mask_index,
    )
    return RunnerSampling(request, {i: r for r, (i, _) in enumerate(picked)}, dead, mask_s)


def sampled_rows(runner_name: str, result: StepOutput) -> SampleResult:
    if result.sampled is None:
        raise RuntimeError(f"runner {runner_name!r} was asked to sample but returned no sampled rows")
    return result.sampled


def num_rows(rows: Rows) -> int:
    return len(rows.token_ids) if isinstance(rows, SampleResult) else int(rows.shape[0])


def concat_sampled(parts: list[Rows]) -> SampleResult:
    """Sampled rows of several chunks, in order."""
    done = [p for p in parts if isinstance(p, SampleResult)]
    if not done:
        return SampleResult(np.zeros(0, np.int64), np.zeros(0, np.float32), [])
    return SampleResult(np.concatenate([p.token_ids for p in done]), np.concatenate([p.logprobs for p in done]),
                        [t for p in done for t in p.top])
