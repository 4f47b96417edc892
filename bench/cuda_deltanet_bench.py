"""Gated DeltaNet prefill benchmark: the sequential kernel (ops.gated_delta_rule, two-pass: what bf16 prefill ran
before) against the chunked WY-form tensor-core kernel (deltanet_chunked), one sequence continuing from a state,
at the DeltaNet head shapes of our model classes (dk = dv = 128).

    python3 bench/cuda_deltanet_bench.py [--json out.json] [--shapes 2b,9b,27b] [--lengths 1024,8192] [--reps 10]

Timing: CUDA events around one call (both launches of a method, intermediates from the arena), warm-up first,
median of repeats; inputs are random bf16 laid out as the runner's conv output (q | k | v in one row) and in_proj
(b | a). "per 48 layers" multiplies by the 27B-class count of DeltaNet layers. "agree" is ||chunked - sequential||
/ ||sequential|| for the output and for the final state, both runs from the same initial state (bf16 tensor-core
rounding: ~1e-3 .. 5e-3 is expected, > 1e-2 means something is wrong). Target (27B heads, 8192 tokens): chunked
<= 3 ms. Prints a table last; writes JSON with the device, date and every number.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_bench import time_ms  # (CUDA events, warm-up, median)
from op_bench import agreement, run_op_bench

from gpu_engine.cuda import deltanet_chunked, ops
from gpu_engine.cuda.context import GpuContext

# name -> (key heads, value heads, dk, dv): bench/cuda_bench.py SHAPES and the ModelConfig defaults (9B)
SHAPES = {"2b": (16, 16, 128, 128), "9b": (16, 32, 128, 128), "27b": (16, 48, 128, 128)}
LAYERS_27B = 48
TARGET_MS = 3.0  # 27B heads, 8192 tokens


def bench_shape(ctx: GpuContext, rng: np.random.Generator, name: str, n: int, warmup: int, reps: int) -> dict:
    kh, vh, dk, dv = SHAPES[name]
    conv_dim = 2 * kh * dk + vh * dv
    mark = ctx.arena.mark()
    try:
        qkv = ctx.to_device(rng.standard_normal((n, conv_dim), dtype=np.float32), "bf16", "qkv")
        ab_host = rng.standard_normal((n, 2 * vh), dtype=np.float32)
        ab_host[:, vh:] -= 6.0  # a: decays of ~1-10 % per token, so the state matters across chunks
        ab = ctx.to_device(ab_host, "bf16", "ab")
        A_log = ctx.to_device(np.log(rng.uniform(1.0, 16.0, vh)).astype(np.float32), "f32", "A_log")
        dt_bias = ctx.to_device(np.ones(vh, np.float32), "f32", "dt_bias")
        state0 = (rng.standard_normal((1, vh, dv, dk)) * 0.3).astype(np.float32)
        state = ctx.to_device(state0, "f32", "state")
        meta = {what: ctx.to_device(np.asarray(x, np.int32), "i32", what)
                for what, x in (("cu", [0, n]), ("slots", [0]), ("fresh", [0]))}
        outs = {m: ctx.empty((n, vh * dv), "bf16", f"out-{m}") for m in ("sequential", "chunked")}

        def call(method: str, dv_slice: int | None = None) -> None:  # dv_slice None: the launcher's own choice
            args = (ctx, outs[method], qkv, qkv.at(kh * dk), qkv.at(2 * kh * dk), conv_dim, ab.at(vh), ab, 2 * vh,
                    A_log, dt_bias, state, meta["cu"], meta["slots"], meta["fresh"], kh, vh, dk, dv)
            if method == "chunked":
                deltanet_chunked.chunked_gated_delta_rule(*args, dv_slice=dv_slice)
            else:
                ops.gated_delta_rule(*args, method="two_pass")

        row: dict = {"shape": name, "tokens": n, "k_heads": kh, "v_heads": vh, "dk": dk, "dv": dv,
                     "chunked_workspace_MB": deltanet_chunked.workspace_bytes(n, 1, vh, dk, dv) / 2**20}
        results = {}
        for method in ("sequential", "chunked"):
            ctx.to_device(state0, "f32", "state", out=state)  # same start for the agreement numbers
            call(method)
            ctx.device.sync()
            results[method] = (ctx.to_host(outs[method]), ctx.to_host(state))
            row[f"{method}_ms"] = time_ms(ctx, lambda: call(method), warmup, reps)
        for width in (deltanet_chunked.DV_SLICE, deltanet_chunked.NARROW_DV_SLICE):  # the scan's two slice widths
            row[f"chunked_slice{width}_ms"] = time_ms(ctx, lambda: call("chunked", width), warmup, reps)
        row["speedup"] = row["sequential_ms"] / row["chunked_ms"]
        row["chunked_ms_per_48_layers"] = row["chunked_ms"] * LAYERS_27B
        row["agree_out"] = agreement(results["chunked"][0], results["sequential"][0])
        row["agree_state"] = agreement(results["chunked"][1], results["sequential"][1])
        return row
    finally:
        ctx.device.sync()
        ctx.arena.release(mark)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'shape':<6} {'tokens':>6} {'heads':>6} {'seq ms':>9} {'chunk ms':>9} {'speedup':>8} "
             f"{'x48 ms':>8} {'agree out':>10} {'agree S':>9} {'slice32':>8} {'slice16':>8}", "-" * 98]
    for r in rows:
        lines.append(f"{r['shape']:<6} {r['tokens']:>6} {r['k_heads']:>2}/{r['v_heads']:<3} {r['sequential_ms']:>9.3f} "
                     f"{r['chunked_ms']:>9.3f} {r['speedup']:>7.1f}x {r['chunked_ms_per_48_layers']:>8.1f} "
                     f"{r['agree_out']:>10.1e} {r['agree_state']:>9.1e} {r['chunked_slice32_ms']:>8.3f} "
                     f"{r['chunked_slice16_ms']:>8.3f}")
    lines.append(f"(target: 27b, 8192 tokens, chunked <= {TARGET_MS} ms per layer)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_op_bench(
        argv, __doc__.splitlines()[0], SHAPES,
        lambda ctx, rng, name, n, reps, args: bench_shape(ctx, rng, name, n, warmup=2, reps=reps),
        format_table, {"sequential": "ops.gated_delta_rule method=two_pass",
                       "chunked": "deltanet_chunked (C=64, dv slice 32)"},
        lengths_help="tokens of the one sequence", reps_help="timed calls per method and shape (median)",
    )


if __name__ == "__main__":
    sys.exit(main())
