"""What the GPU check scripts share: the error metric, the seed, and the command line around `run_all`.

check_kernels, check_runner and check_vision each define `run_all(seed) -> (results, info)` (raising
CudaUnavailable where there is no GPU) and `format_table(results)`; `check_main` turns that into the script:
skip with exit 0 without a GPU, print the info and the table, write JSON on request, exit 1 if any result failed.
check_hf_parity has its own command line (--cpu-harness) and uses the metric and `write_json`.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np


def rel_err(out: Any, expect: Any) -> float:
    """||out - expect|| / ||expect|| in float64 (an all-zero reference divides by 1: absolute error).

    NaN as soon as `out` holds a non-finite value, so a poisoned element the kernel never wrote fails every
    tolerance; a shape mismatch is an AssertionError, never a broadcast."""
    out = np.asarray(out, np.float64)
    expect = np.asarray(expect, np.float64)
    if out.shape != expect.shape:
        raise AssertionError(f"shape {out.shape} != reference {expect.shape}")
    if not np.all(np.isfinite(out)):
        return float("nan")
    denom = np.linalg.norm(expect)
    return float(np.linalg.norm(out - expect) / (denom if denom > 0 else 1.0))


def fresh_seed(seed: int | None = None, bits: int = 32) -> int:
    """`seed`, or a fresh one (printed by the scripts, so a failing run can be replayed with --seed)."""
    return int(np.random.SeedSequence().entropy % 2**bits) if seed is None else seed


def write_json(path: str, info: dict, results: Sequence[Any]) -> None:
    """Results (dataclasses) and run info as one JSON document."""
    with open(path, "w") as fh:
        json.dump({"info": info, "results": [asdict(r) for r in results]}, fh, indent=1)


def check_main(description: str, run_all: Callable[[int | None], tuple[Sequence[Any], dict]],
               format_table: Callable[[Sequence[Any]], str], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--seed", type=int, help="replay a run with the seed it printed")
    args = parser.parse_args(argv)
    from gpu_engine.cuda.errors import CudaUnavailable

    try:
        results, info = run_all(args.seed)
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    print(json.dumps(info))
    print(format_table(results))
    if args.json:
        write_json(args.json, info, results)
    return 0 if all(r.ok for r in results) else 1
