"""Decode-phase paged attention at large batch and long contexts: ops.paged_attention's kernel choices and key
splits against the HBM copy ceiling measured in the same run.

    python3 bench/cuda_paged_decode_bench.py [--shape 9b] [--batches 64,192] [--contexts 4096,8192]
        [--variants grouped,mma,mma:s4] [--json out.json]

One full-attention layer's decode step: b sequences, one query token each at position `context` (it attends to
context + 1 cached keys), K/V cache [blocks, 16, kv_heads, head_dim] bf16 with random rows (a 64 MiB random piece
tiled by device copies: never zeros), each sequence's blocks drawn from a shuffled pool. A variant is a method
("grouped" / "per_head" or any later one ops.paged_attention takes), optionally ":s<N>" for N key splits (the
default is the op's own choice); "flash" is flash_prefill over the same rows, one query tile each, as a step that
also carries a prompt chunk of 32+ tokens runs its decode rows today (text_model picks flash for every row).
Bytes: every K and V row once (b x (context + 1) x kv_heads x head_dim x 2 x 2);
GB/s against a device-to-device copy of 1 GiB (read + write). Timing: CUDA events, warm-up, median of repeats,
the caches ~6 GB per layer at 192 x 8k so L2 holds none of it. "agree" is each variant's output against the first
variant's (all bf16: ~1e-3 is rounding). Prints a table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_bench import bench_copy, time_ms
from op_bench import agreement

from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.context import GpuContext

SHAPES = {"27b": (24, 4, 256), "9b": (16, 4, 256), "2b": (8, 2, 256)}  # q heads, kv heads, head dim
BLOCK_SIZE = 16


def parse_variant(text: str) -> tuple[str, int | None]:
    """"grouped:s8" -> ("grouped", 8); "per_head" -> ("per_head", None)."""
    method, _, splits = text.partition(":")
    if splits and not (splits.startswith("s") and splits[1:].isdigit() and int(splits[1:]) > 0):
        raise ValueError(f"variant {text!r}: the splits part is s<N>, N > 0")
    return method, int(splits[1:]) if splits else None


def kv_bytes(batch: int, context: int, kv_heads: int, head_dim: int) -> int:
    """K and V rows a decode step of `batch` queries at position `context` reads (bf16)."""
    return batch * (context + 1) * kv_heads * head_dim * 2 * 2


def fill_random(ctx: GpuContext, rng: np.random.Generator, arrays: list) -> None:
    piece = 64 << 20
    mark = ctx.arena.mark()
    src = ctx.to_device(rng.standard_normal(piece // 2).astype(np.float32), "bf16", "fill")
    for arr in arrays:
        for off in range(0, arr.nbytes, piece):
            ctx.device.copy(arr.ptr + off, src.ptr, min(piece, arr.nbytes - off))
    ctx.device.sync()
    ctx.arena.release(mark)


def bench_case(ctx: GpuContext, rng: np.random.Generator, shape: str, batch: int, context: int,
               variants: list[str], reps: int, copy_GBps: float) -> list[dict]:
    heads, kvh, hd = SHAPES[shape]
    per_seq = (context + 1) // BLOCK_SIZE + 1
    mark = ctx.arena.mark()
    try:
        kc = ctx.empty((batch * per_seq, BLOCK_SIZE, kvh, hd), "bf16", "k")
        vc = ctx.empty((batch * per_seq, BLOCK_SIZE, kvh, hd), "bf16", "v")
        fill_random(ctx, rng, [kc, vc])
        table = ctx.to_device(rng.permutation(batch * per_seq).astype(np.int32).reshape(batch, per_seq), "i32",
                              "table")
        seq = ctx.to_device(np.arange(batch, dtype=np.int32), "i32", "seq")
        pos = ctx.to_device(np.full(batch, context, np.int32), "i32", "pos")
        q = ctx.to_device(rng.standard_normal((batch, heads * hd)).astype(np.float32), "bf16", "q")
        proj = ctx.to_device(rng.standard_normal((batch, 2 * heads * hd)).astype(np.float32), "bf16", "q|gate")
        gate = proj.at(hd)  # as the runner passes it: the fused q|gate rows, gate_h at (2h+1)*hd
        nbytes = kv_bytes(batch, context, kvh, hd)
        tiles = ctx.to_device(flash_plan.flash_tiles([1] * batch), "i32", "tiles")
        rows, first = [], None
        for text in variants:
            method, splits = parse_variant(text)
            out = ctx.empty((batch, heads * hd), "bf16", f"out-{text}")
            ctx.poison(out)

            def call(out=out, method=method, splits=splits) -> None:
                if method == "flash":
                    ops.flash_prefill(ctx, out, q, heads * hd, gate, 2 * heads * hd, 2 * hd, kc, vc, table, seq, pos,
                                      tiles, heads, kvh, hd, BLOCK_SIZE, hd ** -0.5)
                    return
                ops.paged_attention(ctx, out, q, heads * hd, gate, 2 * heads * hd, 2 * hd, kc, vc, table, seq, pos,
                                    heads, kvh, hd, BLOCK_SIZE, hd ** -0.5, splits=splits, method=method)

            ms = time_ms(ctx, call, warmup=3, reps=reps)
            host = ctx.to_host(out)
            first = host if first is None else first
            rows.append({"shape": shape, "batch": batch, "context": context, "variant": text, "ms": ms,
                         "bytes": nbytes, "GBps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / copy_GBps,
                         "agree": agreement(host, first), "finite": bool(np.all(np.isfinite(host)))})
        return rows
    finally:
        ctx.device.sync()
        ctx.arena.release(mark)


def format_table(rows: list[dict], copy_GBps: float) -> str:
    lines = [f"{'shape':<5} {'batch':>5} {'context':>7} {'variant':<16} {'ms':>8} {'GB/s':>7} {'of copy':>8} "
             f"{'agree':>8}", "-" * 72]
    for r in rows:
        lines.append(f"{r['shape']:<5} {r['batch']:>5} {r['context']:>7} {r['variant']:<16} {r['ms']:>8.3f} "
                     f"{r['GBps']:>7.0f} {r['of_copy']:>8.1%} {r['agree']:>8.1e}")
    lines.append(f"(copy ceiling {copy_GBps:.0f} GB/s, read + write, measured in this run)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="64,192")
    parser.add_argument("--contexts", default="4096,8192")
    parser.add_argument("--variants", default="grouped,mma,mma:s1,mma:s4,grouped:s8")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        parse_variant(v)
    from gpu_engine.cuda.errors import CudaUnavailable

    rng = np.random.default_rng()
    try:
        ctx = GpuContext(budget_bytes=20 << 30)
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    rows: list[dict] = []
    try:
        copy_GBps = bench_copy(ctx, rng, 1 << 30)["memcpy_GBps"]
        info = {"device": ctx.device.info.name, "sm_count": ctx.device.info.sm_count, "copy_GBps": copy_GBps,
                "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(), "command": " ".join(["python3", *sys.argv])}
        for b in (int(x) for x in args.batches.split(",")):
            for c in (int(x) for x in args.contexts.split(",")):
                rows += bench_case(ctx, rng, args.shape, b, c, variants, args.reps, copy_GBps)
                print(json.dumps(rows[-len(variants):]), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps({"info": info, "results": rows}, indent=1))
    finally:
        ctx.close()
    print(format_table(rows, copy_GBps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
