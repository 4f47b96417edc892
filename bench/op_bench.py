"""The command-line driver shared by the single-op CUDA benches (cuda_attention_bench, cuda_deltanet_bench):
shapes x lengths, one GPU context, a JSON line per result, the JSON file rewritten after each result (a later
failure keeps what is done), a table last. Prints SKIP and returns 0 without a GPU. Also their "agree" metric."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpu_engine.cuda.context import GpuContext
from gpu_engine.cuda.errors import CudaUnavailable


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64 (the benches' "agree" of a new kernel's output against the old one's); NaN when
    either holds a non-finite value."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("nan")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def open_context() -> GpuContext | None:
    """A 4 GiB arena on the GPU, or None (after printing SKIP and why) where there is none."""
    try:
        return GpuContext(budget_bytes=4 << 30)
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return None


def run_info(ctx: GpuContext) -> dict[str, Any]:
    """Device, arch, SM count, UTC date and the command line of this run (the head of every JSON it writes)."""
    return {"device": ctx.device.info.name, "arch": ctx.device.info.arch, "sm_count": ctx.device.info.sm_count,
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])}


def run_op_bench(
    argv: list[str] | None,
    description: str,
    shapes: dict[str, Any],
    bench_shape: Callable[[GpuContext, np.random.Generator, str, int, int, argparse.Namespace], dict],
    format_table: Callable[[list[dict]], str],
    info: dict[str, Any],
    *,
    lengths_help: str,
    reps_help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--shapes", default=",".join(shapes), help="comma-separated subset of " + ",".join(shapes))
    parser.add_argument("--lengths", default="1024,8192", help=lengths_help)
    parser.add_argument("--reps", type=int, default=10, help=reps_help)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if any(s not in shapes for s in names) or not lengths or min(lengths) < 1 or args.reps < 1:
        parser.error(f"shapes from {', '.join(shapes)}, positive lengths and reps")
    rng = np.random.default_rng()
    ctx = open_context()
    if ctx is None:
        return 0
    info = {**run_info(ctx), **info}
    rows: list[dict] = []
    try:
        for name in names:
            for n in lengths:
                rows.append(bench_shape(ctx, rng, name, n, args.reps, args))
                print(json.dumps(rows[-1]), flush=True)
                if args.json:  # keep what is done if a later shape fails
                    Path(args.json).write_text(json.dumps({"info": info, "results": rows}, indent=1))
    finally:
        ctx.close()
    print(format_table(rows))
    return 0
