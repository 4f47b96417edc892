"""Gated DeltaNet prefill benchmark: where the chunked WY-form kernel (deltanet_chunked) spends its time, launch by
launch, at the DeltaNet head shapes of our model classes (dk = dv = 128), for the two workloads a document run feeds
it, with the sequential kernel (ops.gated_delta_rule two_pass) as the speed and accuracy yardstick.

    python3 bench/cuda_deltanet_bench.py [--json out.json] [--shapes 9b,27b] [--workloads fresh8k,doc]
        [--variants current,states] [--reps 20]

Workloads (8192 tokens each, one step's worth):
- fresh8k: one fresh 8192-token sequence (a long prompt's first step);
- doc: the document step of the 9B profile, 56 one-token decode rows then 4 prompt chunks of 2034 tokens, every
  sequence continuing from a cached state. The runner hands the chunked kernel all of a step's sequences
  (text_model._deltanet passes the step's cu/slots/fresh), so the decode rows are 1-token sequences here too.
Variants (deltanet_chunked.VARIANTS): "current" launches prep + scan; "states" prep + a state-only scan ("chain"
column) + the parallel output. Timing: CUDA events before the call and after each of its launches (the launcher's
on_launch hook); the median over repeats of each launch's span and of the whole call ("call"); "plain" is
bench/cuda_bench.time_ms of the call without the hook (the events' own cost shows as call - plain), "other" the
same at the scan slice width the launcher did not pick. "same" counts output and state elements that differ from
the current variant's on the same inputs (the states variant is meant to be bit-identical: 0). Warm-up first
(compiles the modules). Inputs are random bf16 laid out as the runner's conv output (q | k | v in one row) and
in_proj (b | a), decays of ~1-10 % per token so the state matters across chunks. "agree" is ||chunked - sequential||
/ ||sequential|| of the output and of the final state, both from the same initial state (bf16 tensor-core rounding:
~1e-3 .. 5e-3 is expected, > 1e-2 means something is wrong). "xL" is the call times the shape's DeltaNet layers
(24 at 9B, 48 at 27B). Prints a table last; writes JSON (device, date, commit, every number), rewritten after each
row. Default run: 8 rows, estimated 15-25 s on an H200 with the module cache warm, plus ~10 s of NVRTC on a bare
machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import git_commit
from cuda_bench import time_ms  # (CUDA events, warm-up, median)
from op_bench import agreement, open_context, run_info

from gpu_engine.cuda import deltanet_chunked, ops
from gpu_engine.cuda.context import GpuContext

# name -> (key heads, value heads, dk, dv, DeltaNet layers): bench/cuda_bench.py SHAPES and the ModelConfig defaults
SHAPES = {"2b": (16, 16, 128, 128, 18), "9b": (16, 32, 128, 128, 24), "27b": (16, 48, 128, 128, 48)}


@dataclass(frozen=True)
class Workload:
    lens: tuple[int, ...]  # tokens per sequence, in step order
    fresh: bool  # every sequence starts here (state zeroed) / every one continues from its slot's state


WORKLOADS = {"fresh8k": Workload((8192,), True), "doc": Workload((1,) * 56 + (2034,) * 4, False)}


def phase_times(ctx: GpuContext, call: Callable[[Callable[[str], None]], None], warmup: int,
                reps: int) -> dict[str, float]:
    """Median ms of each launch of call(on_launch) (the span from the previous event) and of the whole call."""
    for _ in range(warmup):
        call(lambda phase: None)
    ctx.device.sync()
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        start = ctx.device.event()
        marks: list[tuple[str, object]] = []

        def mark(phase: str) -> None:
            ev = ctx.device.event()
            ctx.device.stream.record(ev)
            marks.append((phase, ev))

        ctx.device.stream.record(start)
        call(mark)
        marks[-1][1].sync()
        prev = start
        for phase, ev in marks:
            samples.setdefault(phase, []).append(ev - prev)
            prev = ev
        samples.setdefault("call", []).append(marks[-1][1] - start)
    return {phase: float(np.median(x)) for phase, x in samples.items()}


def bench_case(ctx: GpuContext, rng: np.random.Generator, shape: str, workload: str, variants: list[str],
               warmup: int, reps: int) -> list[dict]:
    kh, vh, dk, dv, layers = SHAPES[shape]
    wl = WORKLOADS[workload]
    seqs, n = len(wl.lens), sum(wl.lens)
    conv_dim = 2 * kh * dk + vh * dv
    mark = ctx.arena.mark()
    try:
        qkv = ctx.to_device(rng.standard_normal((n, conv_dim), dtype=np.float32), "bf16", "qkv")
        ab_host = rng.standard_normal((n, 2 * vh), dtype=np.float32)
        ab_host[:, vh:] -= 6.0  # a: decays of ~1-10 % per token, so the state matters across chunks
        ab = ctx.to_device(ab_host, "bf16", "ab")
        A_log = ctx.to_device(np.log(rng.uniform(1.0, 16.0, vh)).astype(np.float32), "f32", "A_log")
        dt_bias = ctx.to_device(np.ones(vh, np.float32), "f32", "dt_bias")
        state0 = (rng.standard_normal((seqs, vh, dv, dk)) * 0.3).astype(np.float32)
        state = ctx.to_device(state0, "f32", "state")
        cu = np.concatenate([[0], np.cumsum(wl.lens)])
        meta = {what: ctx.to_device(np.asarray(x, np.int32), "i32", what)
                for what, x in (("cu", cu), ("slots", np.arange(seqs)), ("fresh", [int(wl.fresh)] * seqs))}
        out = ctx.empty((n, vh * dv), "bf16", "out")
        args = (qkv, qkv.at(kh * dk), qkv.at(2 * kh * dk), conv_dim, ab.at(vh), ab, 2 * vh, A_log, dt_bias, state,
                meta["cu"], meta["slots"], meta["fresh"], kh, vh, dk, dv)
        auto = deltanet_chunked.scan_slice(dv, vh, seqs, ctx.device.info.sm_count)
        other = deltanet_chunked.DV_SLICE + deltanet_chunked.NARROW_DV_SLICE - auto

        def sequential() -> None:
            ops.gated_delta_rule(ctx, out, *args, method="two_pass")

        def chunked(variant: str, dv_slice: int | None = None) -> Callable[[Callable[[str], None] | None], None]:
            return lambda on_launch=None: deltanet_chunked.chunked_gated_delta_rule(
                ctx, out, *args, dv_slice=dv_slice, on_launch=on_launch, variant=variant)

        def once(fn: Callable[[], None]) -> tuple[np.ndarray, np.ndarray]:
            ctx.to_device(state0, "f32", "state", out=state)  # same start for the agreement numbers
            ctx.poison(out)
            fn()
            ctx.device.sync()
            return ctx.to_host(out), ctx.to_host(state)

        seq_out, seq_state = once(sequential)
        seq_ms = time_ms(ctx, sequential, 1, max(3, reps // 4))
        firsts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        rows = []
        for variant in variants:
            got = firsts[variant] = once(chunked(variant))
            row: dict = {"shape": shape, "workload": workload, "variant": variant, "tokens": n, "seqs": seqs,
                         "fresh": wl.fresh, "k_heads": kh, "v_heads": vh, "dk": dk, "dv": dv, "layers": layers,
                         "scan_slice": auto, "sequential_ms": seq_ms,
                         "workspace_MB": deltanet_chunked.workspace_bytes(n, seqs, vh, dk, dv, variant) / 2**20,
                         "agree_out": agreement(got[0], seq_out), "agree_state": agreement(got[1], seq_state)}
            if variant != "current" and "current" in firsts:
                row["differ_from_current"] = int(np.sum(got[0] != firsts["current"][0])
                                                 + np.sum(got[1] != firsts["current"][1]))
            for phase, ms in phase_times(ctx, chunked(variant), warmup, reps).items():
                row[f"{phase}_ms"] = ms
            row["plain_ms"] = time_ms(ctx, chunked(variant), warmup, reps)
            row[f"slice{other}_ms"] = time_ms(ctx, chunked(variant, other), warmup, reps)
            row["speedup"] = seq_ms / row["plain_ms"]
            row["ms_per_model"] = row["plain_ms"] * layers
            rows.append(row)
        return rows
    finally:
        ctx.device.sync()
        ctx.arena.release(mark)


def format_table(rows: list[dict]) -> str:
    head = (f"{'shape':<5} {'workload':<8} {'variant':<8} {'heads':>6} {'slice':>5} {'prep':>7} {'chain':>7} "
            f"{'output':>7} {'call':>7} {'plain':>7} {'other':>7} {'seq':>7} {'speedup':>7} {'xL':>6} "
            f"{'agree out':>9} {'agree S':>8} {'same':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        chain = r.get("scan_ms", r.get("states_ms", float("nan")))
        other = next(v for k, v in r.items() if k.startswith("slice") and k.endswith("_ms"))
        same = r.get("differ_from_current")
        lines.append(f"{r['shape']:<5} {r['workload']:<8} {r['variant']:<8} {r['k_heads']:>2}/{r['v_heads']:<3} "
                     f"{r['scan_slice']:>5} {r['prep_ms']:>7.3f} {chain:>7.3f} {r.get('output_ms', 0.0):>7.3f} "
                     f"{r['call_ms']:>7.3f} {r['plain_ms']:>7.3f} {other:>7.3f} {r['sequential_ms']:>7.2f} "
                     f"{r['speedup']:>6.1f}x {r['ms_per_model']:>6.1f} {r['agree_out']:>9.1e} "
                     f"{r['agree_state']:>8.1e} {'-' if same is None else same:>5}")
    lines.append("(ms; chain: the sequential launch; other: plain at the other slice width; xL: plain x layers;")
    lines.append(" same: output + state elements that differ from the current variant's)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--shapes", default="9b,27b", help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="subset of " + ",".join(WORKLOADS))
    parser.add_argument("--variants", default=",".join(deltanet_chunked.VARIANTS),
                        help="subset of " + ",".join(deltanet_chunked.VARIANTS))
    parser.add_argument("--reps", type=int, default=20, help="timed calls per case (median)")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    if not shapes or not workloads or not variants or args.reps < 1 or any(s not in SHAPES for s in shapes) \
            or any(w not in WORKLOADS for w in workloads) or any(v not in deltanet_chunked.VARIANTS for v in variants):
        parser.error(f"shapes from {', '.join(SHAPES)}, workloads from {', '.join(WORKLOADS)}, variants from "
                     f"{', '.join(deltanet_chunked.VARIANTS)}, reps >= 1")
    rng = np.random.default_rng()
    ctx = open_context()
    if ctx is None:
        return 0
    info = {**run_info(ctx), "commit": git_commit(),
            "workloads": {name: {"lens": list(w.lens), "fresh": w.fresh} for name, w in WORKLOADS.items()}}
    rows: list[dict] = []
    try:
        for shape in shapes:
            for workload in workloads:
                for row in bench_case(ctx, rng, shape, workload, variants, warmup=2, reps=args.reps):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if args.json:  # keep what is done if a later case fails
                    Path(args.json).write_text(json.dumps({"info": info, "results": rows}, indent=1))
    finally:
        ctx.close()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
