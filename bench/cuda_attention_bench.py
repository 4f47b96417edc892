"""Prefill attention benchmark: flash_prefill (the FlashAttention-2-style kernel) against the first tensor-core
kernel (flash_prefill_v1.cu), one causal chunk at the GQA shapes of our model classes.

    python3 bench/cuda_attention_bench.py [--json out.json] [--lengths 1024,8192] [--reps 10]

Timing: CUDA events around one launch, warm-up first, median of repeats; inputs are random bf16 (never zeros),
the K/V cache paged (block size 16) through a shuffled block table. TFLOP/s counts the causal FLOPs,
4 * n^2 / 2 * head_dim * q_heads. "agree" is ||new - old|| / ||old|| over the whole output (both bf16; the two
kernels round P differently, so ~1e-3 is expected and > 1e-2 means one of them is wrong). Prints a table last;
writes JSON with the device, date and every number.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
BENCH_KERNELS = Path(__file__).resolve().parent / "kernels"

from cuda_bench import time_ms  # (CUDA events, warm-up, median)
from op_bench import agreement, run_op_bench

from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.context import GpuContext

# name -> (q heads, kv heads, head dim)
SHAPES = {"27b": (24, 4, 256), "9b": (16, 4, 256), "2b": (8, 2, 256), "hd128": (16, 4, 128)}
V1_TILE = 32  # query rows per tile of the old kernel
BLOCK_SIZE = 16
NOTES_V1_TFLOPS = 20.0  # bench/results/cuda_notes.md, before this kernel


def v1_tiles(n: int) -> np.ndarray:
    return np.array([(s, min(V1_TILE, n - s)) for s in range(0, n, V1_TILE)], np.int32)


def bench_shape(ctx: GpuContext, rng: np.random.Generator, name: str, n: int, warmup: int, reps: int,
                old: bool) -> dict:
    heads, kvh, hd = SHAPES[name]
    mark = ctx.arena.mark()
    try:
        blocks = -(-n // BLOCK_SIZE)
        rand = lambda shape, what: ctx.to_device(rng.standard_normal(shape, dtype=np.float32), "bf16", what)  # noqa: E731 - one-line local helper
        i32 = lambda a, what: ctx.to_device(np.asarray(a, np.int32), "i32", what)  # noqa: E731 - one-line local helper
        kc, vc = rand((blocks, BLOCK_SIZE, kvh, hd), "k"), rand((blocks, BLOCK_SIZE, kvh, hd), "v")
        q, gate = rand((n, heads * hd), "q"), rand((n, heads * hd), "gate")
        table = i32(rng.permutation(blocks)[None, :], "table")
        seq, pos = i32(np.zeros(n), "seq"), i32(np.arange(n), "pos")
        args = (q.ptr, np.int64(heads * hd), gate.ptr, np.int64(heads * hd), np.int32(hd), kc.ptr, vc.ptr, table.ptr,
                np.int32(blocks), seq.ptr, pos.ptr)
        tail = (np.int32(heads), np.int32(kvh), np.int32(BLOCK_SIZE), np.float32(hd ** -0.5))
        flops = 4 * n * n / 2 * hd * heads
        out_new = ctx.empty((n, heads * hd), "bf16", "out-new")
        tiles = ctx.to_device(flash_plan.flash_tiles([n]), "i32", "tiles")
        new_ms = time_ms(ctx, lambda: ops.flash_prefill(ctx, out_new, q, heads * hd, gate, heads * hd, hd, kc, vc,
                                                        table, seq, pos, tiles, heads, kvh, hd, BLOCK_SIZE,
                                                        hd ** -0.5), warmup, reps)
        row = {"shape": name, "tokens": n, "q_heads": heads, "kv_heads": kvh, "head_dim": hd, "gflop": flops / 1e9,
               "new_ms": new_ms, "new_TFLOPs": flops / new_ms / 1e9}
        if old:
            out_old = ctx.empty((n, heads * hd), "bf16", "out-old")
            t1 = ctx.to_device(v1_tiles(n), "i32", "tiles-v1")
            ctx.device.add_kernel_dir(BENCH_KERNELS)  # the old kernel is bench-only (bench/kernels/)
            launch_old = lambda: ctx.device.launch(  # noqa: E731 - the timed call, passed to time_ms
                "flash_prefill_v1", f"flash_prefill_v1_bf16_hd{hd}", (t1.shape[0], heads), 128, out_old.ptr, *args,
                t1.ptr, *tail)
            old_ms = time_ms(ctx, launch_old, warmup, reps)
            row.update(old_ms=old_ms, old_TFLOPs=flops / old_ms / 1e9, speedup=old_ms / new_ms,
                       agree=agreement(ctx.to_host(out_new), ctx.to_host(out_old)))
        return row
    finally:
        ctx.device.sync()
        ctx.arena.release(mark)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'shape':<7} {'tokens':>6} {'heads':>6} {'hd':>4} {'old ms':>9} {'old TF/s':>9} {'new ms':>9} "
             f"{'new TF/s':>9} {'speedup':>8} {'agree':>9}", "-" * 88]
    for r in rows:
        old = (f"{r['old_ms']:>9.3f} {r['old_TFLOPs']:>9.1f}" if "old_ms" in r else f"{'-':>9} {'-':>9}")
        tail = f"{r['speedup']:>7.1f}x {r['agree']:>9.1e}" if "old_ms" in r else f"{'-':>8} {'-':>9}"
        lines.append(f"{r['shape']:<7} {r['tokens']:>6} {r['q_heads']:>2}/{r['kv_heads']:<3} {r['head_dim']:>4} "
                     f"{old} {r['new_ms']:>9.3f} {r['new_TFLOPs']:>9.1f} {tail}")
    lines.append(f"(old kernel per cuda_notes.md: ~{NOTES_V1_TFLOPS:.0f} TFLOP/s at 8k tokens)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_op_bench(
        argv, __doc__.splitlines()[0], SHAPES,
        lambda ctx, rng, name, n, reps, args: bench_shape(ctx, rng, name, n, warmup=2, reps=reps, old=not args.no_old),
        format_table, {"block_size": BLOCK_SIZE, "flop_count": "4 * n^2 / 2 * head_dim * q_heads (causal)"},
        lengths_help="chunk lengths (tokens)", reps_help="timed launches per kernel and shape (median)",
        add_arguments=lambda p: p.add_argument("--no-old", action="store_true", help="time the new kernel only"),
    )


if __name__ == "__main__":
    sys.exit(main())
