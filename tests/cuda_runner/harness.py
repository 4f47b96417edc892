"""What the GPU check scripts share: the error metric, the seed, and the command line around `run_all`.

check_kernels, check_runner, check_vision and the other check_* scripts each define `run_all(seed) -> (results,
info)` (raising CudaUnavailable where there is no GPU) and `format_table(results)`; `check_main` turns that into
the script: skip with exit 0 without a GPU, print the info and the table, write JSON on request, exit 1 if any
result failed. check_hf_parity has its own command line (--cpu-harness) and uses the metric and `write_json`.
The kernel-level checks (check_kernels, check_flash, check_deltanet_chunked) share the `Result` row, its table
(`result_table`), the guard around one case (`run_guarded`), and check_flash / check_deltanet_chunked the loop
around their cases (`run_checks`).
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
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


@dataclass
class Result:
    """One compared output of a kernel-level check (a row of its table and of its JSON)."""

    name: str
    dtype: str
    rel_err: float
    tol: float
    ok: bool
    note: str = ""
    skipped: bool = False  # not run (e.g. no cuBLASLt algorithm for the case): never counted as passed

    def __post_init__(self) -> None:
        assert not (self.ok and self.skipped), f"{self.name}: a skipped check cannot also have passed"


def passed(results: Sequence[Any]) -> bool:
    """A check run passes when every row that ran passed and at least one row ran: skipped rows neither fail
    it nor count for it, so a run that skipped everything has not passed."""
    ran = [r for r in results if not getattr(r, "skipped", False)]
    return bool(ran) and all(r.ok for r in ran)


def result_table(results: Sequence[Result], *, width: int = 40, first: str = "check", dtype: bool = True) -> str:
    """The kernel-level checks' table: name (padded to `width`), dtype (unless `dtype=False`), error, tolerance,
    PASS/FAIL and note, then "passed/total passed". The rule under the header is as long as the scripts have
    always printed it (width + 32 with the dtype column, width + 26 without)."""
    dtype_head = f" {'dtype':<6}" if dtype else ""
    lines = [f"{first:<{width}}{dtype_head} {'rel.err':>10} {'tol':>8}  ok", "-" * (width + (32 if dtype else 26))]
    for r in results:
        dtype_cell = f" {r.dtype:<6}" if dtype else ""
        verdict = "SKIP" if r.skipped else "PASS" if r.ok else "FAIL"
        lines.append(f"{r.name:<{width}}{dtype_cell} {r.rel_err:>10.2e} {r.tol:>8.0e}  {verdict}"
                     + (f"  {r.note}" if r.note else ""))
    skipped = sum(r.skipped for r in results)
    lines.append(f"{sum(r.ok for r in results)}/{len(results) - skipped} passed"
                 + (f", {skipped} skipped" if skipped else ""))
    return "\n".join(lines)


def run_guarded(ctx: Any, results: list[Result], name: str, dtype: str, tol: float, fn: Callable[[], None]) -> None:
    """Run one case `fn` between an arena mark and its release. An exception becomes a failed row `name` (its
    traceback printed), so one broken kernel does not hide the others; the device is synced and the case's buffers
    released whatever happens (released even when the sync raises: the next case must not run out of arena)."""
    mark = ctx.arena.mark()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
        traceback.print_exc()
        results.append(Result(name, dtype, float("nan"), tol, False, f"{type(exc).__name__}: {exc}"[:200]))
    finally:
        try:
            ctx.device.sync()
        finally:
            ctx.arena.release(mark)


def run_checks(seed: int | None, budget_bytes: int, make_checker: Callable[[Any, np.random.Generator], Any],
               cases: Iterable[Any], run_case: Callable[[Any, Any], None]) -> tuple[list, dict]:
    """A GPU context of `budget_bytes`, a checker made on it with the seed's generator, `run_case(checker, case)`
    for every case (timed); returns (checker.results, info with seed, device, arch, seconds). Raises
    CudaUnavailable without a GPU."""
    from gpu_engine.cuda.context import GpuContext

    seed = fresh_seed(seed)
    ctx = GpuContext(budget_bytes=budget_bytes)
    info = {"seed": seed, "device": ctx.device.info.name, "arch": ctx.device.info.arch}
    try:
        checker = make_checker(ctx, np.random.default_rng(seed))
        t0 = time.perf_counter()
        for case in cases:
            run_case(checker, case)
        info["seconds"] = round(time.perf_counter() - t0, 2)
        return checker.results, info
    finally:
        ctx.close()


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
    return 0 if passed(results) else 1
