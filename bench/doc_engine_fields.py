"""What the engine itself says about one bench/doc_throughput.py mode: its counters over the timed run, the
configuration the rows were measured under, the CUDA runner's decode graphs and the peak device memory.
"""
from __future__ import annotations

import dataclasses
import resource
from typing import Any

from gpu_engine.speculative.speculator import spec_counters

COUNTERS = ("steps", "prompt_tokens_computed", "decode_tokens", "forced_tokens", "sampled_tokens", "preemptions",
            "chunked_output_tokens", "lookahead_steps", "lookahead_discarded_rows", "lookahead_failures",
            *spec_counters())  # the speculator's counters, named where they are kept


@dataclasses.dataclass(frozen=True)
class EngineMark:
    """The engine's counters as a timed run starts (after the warm-up), so the row counts that run alone."""
    stats: dict[str, Any]
    held_steps: int
    cut_runs: int

    @classmethod
    def take(cls, engine: Any) -> EngineMark:
        return cls(engine.stats(), engine.scheduler.num_held_steps, engine.scheduler.num_cut_runs)


def engine_fields(engine: Any, mark: EngineMark) -> dict[str, Any]:
    """Row fields read from the engine at the end of a timed run that began at `mark`."""
    row: dict[str, Any] = {}
    stats1 = engine.stats()
    row["engine_counters"] = {k: stats1[k] - mark.stats.get(k, 0) for k in COUNTERS
                              if isinstance(stats1.get(k), (int, float))}
    row["peak_step_tokens"] = stats1.get("peak_step_tokens")
    row["held_prompt_steps"] = engine.scheduler.num_held_steps - mark.held_steps
    # decode-phase chunks cut to the runner's max_decode_chunk_tokens (forced runs spread over several steps)
    row["cut_forced_runs"] = engine.scheduler.num_cut_runs - mark.cut_runs
    row["max_decode_chunk_tokens"] = engine.scheduler.decode_chunk_limit
    row["engine_state_slots"] = engine.config.state_slots
    row["min_prefill_tokens"] = engine.config.min_prefill_tokens
    row["max_prefill_hold_steps"] = engine.config.max_prefill_hold_steps
    row["enable_jump_forward"] = engine.config.enable_jump_forward
    runner = engine.runner
    if hasattr(runner, "graph_memory_cap"):  # the CUDA runner's decode graphs at the end of the run
        # bytes: the largest graph's buffers (graphs share memory since the bucketed decode graphs);
        # steps: what the runner's steps ran as since its cache was allocated (warm-up included)
        counts = getattr(runner, "decode_counts", None)
        row["cuda_graphs"] = {"captured": len(getattr(runner, "_graphs", {})),
                              "bytes": getattr(runner, "_graph_bytes", 0), "cap_bytes": runner.graph_memory_cap,
                              "steps": vars(counts) if counts is not None else None}
    for key in ("cache_bytes", "max_model_len", "encoder_cache_budget_bytes"):
        row[f"engine_{key}"] = stats1.get(key)
    arena = getattr(getattr(engine.runner, "ctx", None), "arena", None)
    if arena is not None:
        row["peak_device_memory_bytes"] = int(arena.peak)
        row["device_memory_budget_bytes"] = int(arena.capacity)
        row["peak_device_memory_source"] = "cuda arena high-water mark (one start-up allocation of the budget)"
    else:
        row["peak_device_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        row["peak_device_memory_source"] = "reference runner: process max RSS"
    return row
