"""The two ceilings a bench/doc_throughput.py run is measured against, taken on this machine at the start of the run.

fraction_of_limit divides by these rates rather than by a datasheet's, so a slower card or a throttled one does not
read as an engine that leaves time on the table.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np


def measure_ceilings(runner: str) -> dict[str, Any]:
    """HBM copy rate (bytes read + written per second) and GEMM rate of this machine, measured now."""
    if runner == "cuda":
        from cuda_bench import bench_copy, bench_gemm

        from gpu_engine.cuda.context import GpuContext

        ctx = GpuContext(6 << 30)
        try:
            rng = np.random.default_rng(0)
            copy = bench_copy(ctx, rng, 2 << 30)
            gemm = bench_gemm(ctx, rng, 8192, 8192, 8192)
            name = ctx.device.info.name
        finally:
            ctx.close()
        return {"device": name, "hbm_bytes_per_s": copy["memcpy_GBps"] * 1e9, "gemm_flops_per_s": gemm["TFLOPs"] * 1e12,
                "copy": copy, "gemm": gemm}
    import platform

    src = np.random.default_rng(0).standard_normal(32 << 20).astype(np.float32)  # 128 MiB
    dst = np.empty_like(src)
    t = min(_seconds(lambda: np.copyto(dst, src)) for _ in range(3))
    a = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)
    g = min(_seconds(lambda: a @ a) for _ in range(3))
    return {"device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "hbm_bytes_per_s": 2 * src.nbytes / t, "gemm_flops_per_s": 2 * 1024 ** 3 / g}


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
