"""CUDA backend benchmark: the two ceilings (HBM copy bandwidth, bf16 cuBLASLt GEMM rate) and what runs on them.

    python3 bench/cuda_bench.py [--json out.json] [--quick]

Timing: CUDA events around the region, warm-up first, median of repeats; inputs are random (never zeros).
Prints a table last; writes JSON with the device, versions, date and every number.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_engine.cuda import ops  # noqa: E402
from gpu_engine.cuda.context import GpuContext  # noqa: E402
from gpu_engine.cuda.errors import CudaUnavailable  # noqa: E402


def time_ms(ctx: GpuContext, fn: Callable[[], None], warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of fn() on the context's stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    ctx.device.sync()
    samples = []
    for _ in range(reps):
        start, stop = ctx.device.event(), ctx.device.event()
        ctx.device.stream.record(start)
        fn()
        ctx.device.stream.record(stop)
        stop.sync()
        samples.append(stop - start)
    return float(np.median(samples))


def random_bf16(ctx: GpuContext, shape: tuple[int, ...], name: str, rng: np.random.Generator, scale: float = 1.0):
    return ctx.to_device((rng.standard_normal(shape, dtype=np.float32) * scale), "bf16", name)


def bench_copy(ctx: GpuContext, rng: np.random.Generator, nbytes: int) -> dict:
    src = ctx.empty((nbytes // 4,), "f32", "copy-src")
    dst = ctx.empty((nbytes // 4,), "f32", "copy-dst")
    # random contents, generated in 64 MiB pieces to bound host memory
    piece = 16 << 20
    for off in range(0, nbytes // 4, piece):
        n = min(piece, nbytes // 4 - off)
        ctx.to_device(rng.standard_normal(n, dtype=np.float32), "f32", "", out=src.view((n,), off))
    kernel_ms = time_ms(ctx, lambda: ops.copy_u4(ctx, dst.ptr, src.ptr, nbytes))
    memcpy_ms = time_ms(ctx, lambda: ctx.device.copy(dst.ptr, src.ptr, nbytes))
    moved = 2 * nbytes  # read + write
    return {"bytes_each_way": nbytes, "copy_kernel_ms": kernel_ms, "copy_kernel_GBps": moved / kernel_ms / 1e6,
            "memcpy_ms": memcpy_ms, "memcpy_GBps": moved / memcpy_ms / 1e6}


def bench_gemm(ctx: GpuContext, rng: np.random.Generator, m: int, n: int, k: int) -> dict:
    x = random_bf16(ctx, (m, k), "gemm-x", rng)
    w = random_bf16(ctx, (n, k), "gemm-w", rng, k ** -0.5)
    y = ctx.empty((m, n), "bf16", "gemm-y")
    ms = time_ms(ctx, lambda: ctx.blas.linear(y.ptr, x.ptr, w.ptr, m, n, k), reps=20)
    return {"m": m, "n": n, "k": k, "ms": ms, "TFLOPs": 2 * m * n * k / ms / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng()
    try:
        ctx = GpuContext(budget_bytes=(8 << 30) if not args.quick else (1 << 30))
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    info = {"device": ctx.device.info.name, "arch": ctx.device.info.arch, "sm_count": ctx.device.info.sm_count,
            "cublaslt_version": ctx.blas.version, "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    results: dict = {"info": info}
    rows: list[tuple[str, str]] = []
    try:
        mark = ctx.arena.mark()
        copy = bench_copy(ctx, rng, (2 << 30) if not args.quick else (64 << 20))
        ctx.arena.release(mark)
        results["copy"] = copy
        rows.append(("HBM copy, 16B-vector kernel", f"{copy['copy_kernel_GBps']:.0f} GB/s (read+write)"))
        rows.append(("HBM copy, cuMemcpyDtoD", f"{copy['memcpy_GBps']:.0f} GB/s (read+write)"))
        size = 8192 if not args.quick else 2048
        gemm = bench_gemm(ctx, rng, size, size, size)
        ctx.arena.release(mark)
        results["gemm_bf16"] = gemm
        rows.append((f"bf16 GEMM {size}^3 (cuBLASLt)", f"{gemm['TFLOPs']:.0f} TFLOP/s"))
        for m in (1, 8, 32):  # decode-shaped GEMMs: weight-streaming, so compare with the copy ceiling
            g = bench_gemm(ctx, rng, m, 17408 if not args.quick else 4096, 5120 if not args.quick else 1024)
            ctx.arena.release(mark)
            gbps = g["n"] * g["k"] * 2 / g["ms"] / 1e6
            results[f"gemm_decode_m{m}"] = {**g, "weight_GBps": gbps}
            rows.append((f"GEMM m={m} n={g['n']} k={g['k']}", f"{g['ms'] * 1e3:.1f} us, weights {gbps:.0f} GB/s"))
    finally:
        ctx.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(info))
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
