"""Speculative decoding's cost model on the CUDA runner (issue 16, "Measuring with random weights" (b)).

    python3 bench/spec_cost_bench.py [--shape 27b] [--json out.json] [--deadline-s 120] [--wait-for FILE]

Random bf16 weights at a Qwen3.5 class's shapes (bench/qwen35_shapes.py), one CudaRunner for everything:
(b) step costs: one decode step vs one verify step of k + 1 = 2..5 tokens per sequence at batch 1 / 8 / 32
    (forward() wall time as the engine sees it: host tables, graph replay, logits of every window row to the
    host), per rollback strategy (CudaOptions.rollback: recompute snapshots the window's start state, window
    writes every token's state); plus k = 3 windows whose drafts are all rejected, each rolled back (the worst
    case: recompute re-feeds a token in front of the next window, window copies a state back).
Random weights make real drafters' acceptance meaningless; end-to-end speed at a chosen acceptance, part (c), is
bench/spec_e2e_bench.py (a target whose greedy choice survives the verify step's numerics).
Rows stop being measured once --deadline-s is near; the JSON is rewritten after every row.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCHES = (1, 8, 32)
WINDOWS = (2, 3, 4, 5)  # verify-window tokens (k + 1)
K = 3
CONTEXT = 512  # prompt tokens of every sequence in the step-cost part
REPS = 12


class Clock:
    """The run's deadline: a row starts only with `need` seconds left."""

    def __init__(self, deadline_s: float) -> None:
        self.t0, self.deadline = time.perf_counter(), deadline_s

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.t0)


def median_ms(times: list[float], skip: int = 3) -> float:
    """Median of the calls after the first `skip` (a key's eager first step and its capture)."""
    return 1e3 * float(np.median(times[skip:] if len(times) > skip else times))


def step_costs(runner: Any, vocab: int, batches: tuple[int, ...], rng: np.random.Generator, clock: Clock,
               reps: int = REPS) -> dict[str, float]:
    """Decode vs verify forward() times; sequence s uses slot s and blocks table[s] (allocated by the caller)."""
    from cuda_bench import prefill_sequences

    from gpu_engine.runner_api import SeqChunk, StepBatch

    pool = max(batches)
    bs = runner.spec.block_size
    per = (CONTEXT + reps * (max(WINDOWS) + 2) + 64) // bs + 1
    tables = [np.arange(s * per, (s + 1) * per, dtype=np.int32) for s in range(pool)]
    first = prefill_sequences(runner, rng, list(range(pool)), tables, CONTEXT)
    length = dict.fromkeys(range(pool), CONTEXT)
    out: dict[str, float] = {}

    def chunk(s: int, n: int, verify: bool) -> SeqChunk:
        p = length[s]
        ids = np.concatenate([[first[s]], rng.integers(0, vocab, n - 1)]).astype(np.int64)
        return SeqChunk(s, ids, np.tile(np.arange(p, p + n), (3, 1)), p, tables[s], s,
                        logits="all" if verify else "last", verify=verify)

    def timed(make: Any, after: Any = None) -> float:
        times = []
        for _ in range(reps):
            batch = make()
            t = time.perf_counter()
            runner.forward(batch)
            times.append(time.perf_counter() - t)
            if after is not None:
                after()
        return median_ms(times)

    for b in batches:
        if clock.left() < 10:
            break
        seqs = range(b)
        out[f"b{b}_decode_ms"] = timed(lambda: StepBatch([chunk(s, 1, False) for s in seqs]))  # noqa: B023
        for n in WINDOWS:
            out[f"b{b}_verify{n}_ms"] = timed(lambda: StepBatch([chunk(s, n, True) for s in seqs]))  # noqa: B023

        def reject_all() -> None:
            for s in seqs:  # noqa: B023
                runner.rollback_state(s, 1)
                length[s] += 1

        out[f"b{b}_verify{K + 1}_reject_all_ms"] = timed(
            lambda: StepBatch([chunk(s, K + 1, True) for s in seqs]), reject_all)  # noqa: B023
        runner.forward(StepBatch([chunk(s, 1, False) for s in seqs]))  # takes the last refeed
        for s in seqs:
            length[s] += 1
        for n in WINDOWS:
            out[f"b{b}_verify{n}_over_decode"] = out[f"b{b}_verify{n}_ms"] / out[f"b{b}_decode_ms"]
        out[f"b{b}_logits_to_host{K + 1}_ms"] = logits_download_ms(runner, b * (K + 1), vocab)
    return out


def logits_download_ms(runner: Any, rows: int, vocab: int) -> float:
    """The part of a verify step that copies its window rows' f32 logits to the host (what the engine's host-side
    verification needs), timed alone; nan for runners without a device."""
    ctx = getattr(runner, "ctx", None)
    if ctx is None:
        return float("nan")
    mark = ctx.arena.mark()
    try:
        buf = ctx.empty((rows, vocab), "f32", "bench-logits")
        times = []
        for _ in range(5):
            t = time.perf_counter()
            ctx.to_host(buf)
            times.append(time.perf_counter() - t)
        return median_ms(times, skip=1)
    finally:
        ctx.arena.release(mark)


FALLBACK = ("27b", "9b", "2b")  # smaller classes, tried in order when a shape's weights do not fit
SCRATCH_BYTES = 6 << 30  # step activations, logits rows, the graphs' shared buffers


def sizes(shape: str) -> tuple[int, int]:
    """(bf16 weight bytes, arena bytes past them): the step-cost cache, state slots and the verify rows of the
    window strategy (3 windows a sequence) for the largest batch, and step scratch (spec_e2e_bench's engine, 1000
    blocks, fits in it too)."""
    from cuda_bench import model_config

    from gpu_engine.loader import expected_shapes
    from gpu_engine.runner_rules import kv_bytes_per_block, state_bytes_per_slot

    config, _ = model_config(shape)
    weights = sum(2 * int(np.prod(v)) for k, v in expected_shapes(config).items()
                  if k.startswith(("text/", "lm_head/")))
    rows = max(BATCHES) + 1
    cache = rows * ((CONTEXT + REPS * 8 + 64) // 16 + 1) * kv_bytes_per_block(config.text, 16, 2)
    return weights, cache + 4 * rows * state_bytes_per_slot(config.text, 2, 4) + SCRATCH_BYTES


def fitting_shape(shape: str, free_bytes: int) -> str:
    """`shape`, or the first smaller class of FALLBACK whose weights and extra arena fit in `free_bytes` (a shared
    card may have far less free than its size); `shape` itself when none does (the runner then says why)."""
    order = [shape, *FALLBACK[FALLBACK.index(shape) + 1:]] if shape in FALLBACK else [shape]
    return next((name for name in order if sum(sizes(name)) <= free_bytes), shape)


def build_runner(shape: str) -> tuple[Any, Any]:
    from cuda_bench import model_config, random_bf16_weights

    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner

    config, _ = model_config(shape)
    weights = random_bf16_weights(config, np.random.default_rng(0))
    runner = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=sum(sizes(shape))))
    return runner, config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--json")
    parser.add_argument("--deadline-s", type=float, default=150.0)
    parser.add_argument("--wait-for", help="after the set-up, wait (up to 60 s) for this file before timing")
    parser.add_argument("--strategies", default="recompute,window")
    args = parser.parse_args(argv)
    clock = Clock(args.deadline_s)
    from gpu_engine.cache_sizing import size_cache  # noqa: F401  (import check before the long set-up)
    from gpu_engine.runner_api import CacheSpec

    t0 = time.perf_counter()
    asked = args.shape
    if args.shape in FALLBACK:
        from gpu_engine.cuda.device import CudaDevice

        args.shape = fitting_shape(args.shape, CudaDevice(0).mem_info()[0])
    runner, config = build_runner(args.shape)
    ctx = getattr(runner, "ctx", None)  # the CPU test runs the reference runner
    info = {"device": ctx.device.info.name if ctx is not None else runner.name, "shape": args.shape, "k": K,
            "context": CONTEXT, "shape_asked": asked,
            "setup_s": round(time.perf_counter() - t0, 1), "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
            "command": " ".join(sys.argv)}
    result: dict[str, Any] = {"info": info}

    def write() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    if args.wait_for:
        for _ in range(120):
            if os.path.exists(args.wait_for):
                break
            time.sleep(0.5)
    vocab, pool = config.text.vocab_size, max(BATCHES)
    use_graphs = getattr(runner, "use_graphs", None)
    info["graphs"] = use_graphs
    rng = np.random.default_rng(1)
    for strategy in args.strategies.split(","):
        # every sequence of the largest batch verifies at once (window: 3 windows of 151 MB each at 27B)
        runner.rollback, runner.verify_rows, runner.verify_memory_fraction = strategy, pool + 1, 0.8
        bs = 16
        per = (CONTEXT + REPS * 8 + 64) // bs + 1
        runner.allocate_cache(CacheSpec(num_kv_blocks=per * pool, block_size=bs, num_state_slots=pool + 1))
        result[f"steps_{strategy}"] = guarded(lambda: step_costs(runner, vocab, BATCHES, rng, clock))
        write()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    write()
    print(table(result))
    if ctx is not None:
        runner.close()
    return 0


def guarded(part: Any) -> dict[str, Any]:
    """One part's rows, or its error (the other parts still run)."""
    try:
        rows: dict[str, Any] = part()
    except Exception as exc:  # noqa: BLE001 - a failing part must not cost the others their rows
        import traceback

        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}
    print(table({"part": rows}), flush=True)
    return rows


def table(result: dict[str, Any]) -> str:
    lines = [f"spec_cost_bench {result.get('info', {}).get('shape')} (step costs, k = {K} for the rejected windows)"]
    for name, rows in result.items():
        if name == "info" or not isinstance(rows, dict):
            continue
        lines.append(f"[{name}]")
        lines.extend(f"  {key:<34} {val:.3f}" if isinstance(val, float) else f"  {key:<34} {val}"
                     for key, val in rows.items())
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
