"""The engine's measurements beyond plain counters: step times and sizes, time in forwards / masks / sampling, and
time to first token / end-to-end latency percentiles over the most recent finished requests."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .scheduler import ScheduledChunk

LATENCY_WINDOW = 1000  # finished requests the percentiles are taken over


@dataclass
class StepMetrics:
    """Engine.step() measurements: its wall time, the largest step (tokens and vision rows: the runner's
    activations scale with these), and the time spent in forwards, grammar masks and the host sampler."""

    count: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    max_s: float = 0.0
    peak_tokens: int = 0
    peak_vision_rows: int = 0
    forward_s: float = 0.0
    mask_s: float = 0.0
    sample_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.last_s = seconds
        self.max_s = max(self.max_s, seconds)

    def step_times(self) -> dict[str, float]:
        return {"step_time_last_s": self.last_s, "step_time_mean_s": self.total_s / self.count if self.count else 0.0,
                "step_time_max_s": self.max_s}

    def work(self) -> dict[str, float]:
        return {"peak_step_tokens": self.peak_tokens, "peak_step_vision_rows": self.peak_vision_rows,
                "forward_time_s": self.forward_s, "mask_time_s": self.mask_s, "sample_time_s": self.sample_s}


class LatencyWindow:
    """(time to first token, end-to-end latency) of the last LATENCY_WINDOW requests that finished normally."""

    def __init__(self) -> None:
        self._items: deque[tuple[float, float]] = deque(maxlen=LATENCY_WINDOW)

    def add(self, ttft_s: float, latency_s: float) -> None:
        self._items.append((ttft_s, latency_s))

    def percentiles(self) -> dict[str, float | None]:
        """p50 / p95 of both (None before the first request finished)."""
        if not self._items:
            return {"ttft_p50_s": None, "ttft_p95_s": None, "latency_p50_s": None, "latency_p95_s": None}
        arr = np.array(self._items)
        p = np.percentile(arr, [50, 95], axis=0)
        return {"ttft_p50_s": float(p[0, 0]), "ttft_p95_s": float(p[1, 0]),
                "latency_p50_s": float(p[0, 1]), "latency_p95_s": float(p[1, 1])}


def engine_counters() -> dict[str, int]:
    """The engine's counters (Engine.stats), all zero."""
    return {
        "requests_added": 0,
        "requests_finished": 0,
        "finished_stop": 0,
        "finished_length": 0,
        "finished_abort": 0,
        "finished_error": 0,
        "steps": 0,
        "prompt_tokens_computed": 0,  # prompt tokens run through the model (prefix-cache hits excluded)
        "chunked_output_tokens": 0,  # generated tokens run in chunks: jump-forward runs, recompute after preemption
        "decode_tokens": 0,  # tokens run as single decode steps
        "forced_tokens": 0,  # jump-forward tokens appended without sampling
        "sampled_tokens": 0,
        # Lookahead decoding (lookahead.py): steps launched before the previous one's tokens were taken in, their
        # rows whose logits were thrown away (the sequence ended, or forced tokens came first), runner failures
        # while a step was in flight (lookahead is then off for the engine); of those steps, the ones holding prompt
        # chunks, and the requests admitted in them (lookahead_step.py).
        "lookahead_steps": 0,
        "lookahead_prefill_steps": 0,
        "lookahead_admissions": 0,
        "lookahead_discarded_rows": 0,
        "lookahead_failures": 0,
        # Request isolation: forwards that raised, the re-runs that located the failing requests, requests
        # ended by the runner's error, and survivors preempted to rebuild linear-attention state.
        "forward_failures": 0,
        "isolation_forwards": 0,
        "requests_failed_by_runner": 0,
        "preempted_after_failure": 0,
    }


def count_computed(counters: dict[str, int], sc: ScheduledChunk) -> None:
    """A chunk ran: count its tokens as decode, prompt, or output recomputed in a chunk."""
    if sc.is_decode:
        counters["decode_tokens"] += 1
        return
    in_prompt = max(0, min(sc.end, sc.seq.prompt_len) - sc.start)
    counters["prompt_tokens_computed"] += in_prompt
    counters["chunked_output_tokens"] += sc.num_tokens - in_prompt
