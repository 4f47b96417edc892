"""The vision flash attention's variants (gpu_engine/cuda/vision_flash.VARIANTS) on the GPU: checked against float64
attention, then timed at the document workload's segment lengths, then the whole 9B-class tower per variant.

    python3 bench/vision_flash_bench.py [--json out.json] [--variants m1,m2n32,m2n64] [--no-tower]

Check: fresh random bf16 q | k | v (q, k with std 1.5), output poisoned (NaN) first, rel-L2 against float64 segment
attention <= 1e-2, every row written. Timing: CUDA events around one launch, median of 10 after 3 warm-ups, at 16
heads x head_dim 72 (Qwen3.5's tower) and segments of 4096 (a 1024^2 image), 8580 (an A4 page at 150 dpi, 2145
tokens) and 47376 rows (a 12 MP phone photo, 11844 tokens); TFLOP/s count 4 * n^2 * head_dim per head (no padding).
Tower: GpuVisionTower.encode of the 9B class's tower (27 x 1152, bench/qwen35_shapes.py) on a page grid and a
photo grid, wall time of the (synchronous) call, median of 3 after a warm-up, with the tower's own FLOP count.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHECKS = [(72, 16, 17, 3), (72, 16, 100, 3), (72, 16, 1000, 2), (72, 4, 4096, 1), (72, 16, 1, 5), (64, 4, 130, 2),
          (80, 4, 100, 3), (128, 4, 100, 2)]  # (head_dim, heads, seg_len, segments)
TIMED_SEGMENTS = (4096, 8580, 47376)
TOWER_GRIDS = {"page": (1, 110, 78), "photo": (1, 188, 252)}  # 8580 and 47376 patches


def f64_attention(qkv: np.ndarray, heads: int, hd: int, seg: int) -> np.ndarray:
    n, width = qkv.shape[0], heads * hd
    x = qkv.astype(np.float64).reshape(n, 3, heads, hd)
    out = np.empty((n, heads, hd))
    for s0 in range(0, n, seg):
        q, k, v = (x[s0 : s0 + seg, i].transpose(1, 0, 2) for i in range(3))
        s = np.einsum("hqd,hkd->hqk", q, k) * hd ** -0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        out[s0 : s0 + seg] = (np.einsum("hqk,hkd->hqd", p, v) / p.sum(-1)[..., None]).transpose(1, 0, 2)
    return out.reshape(n, width)


def check(ctx, rng: np.random.Generator, variant: str) -> list[dict]:
    from gpu_engine.cuda.bf16 import round_to_bf16
    from gpu_engine.cuda.vision_flash import vision_flash_attention

    rows = []
    for hd, heads, seg, segments in CHECKS:
        n, width = seg * segments, heads * hd
        qkv = np.concatenate([1.5 * rng.standard_normal((n, 2 * width)), rng.standard_normal((n, width))], axis=1)
        qkv = round_to_bf16(qkv.astype(np.float32))
        mark = ctx.arena.mark()
        out = ctx.empty((n, width), "bf16", "out")
        ctx.poison(out)
        vision_flash_attention(ctx, out, ctx.to_device(qkv, "bf16", "qkv"), heads, hd, seg, hd ** -0.5, variant)
        got = ctx.to_host(out).astype(np.float64)
        ctx.arena.release(mark)
        ref = f64_attention(qkv, heads, hd, seg)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(got)) else float("nan")
        ok = bool(err <= 1e-2)
        rows.append({"variant": variant, "case": f"hd{hd} x{heads} seg {seg} x {segments}", "rel_err": err, "ok": ok})
        verdict = "PASS" if ok else "FAIL"
        print(f"check {variant:<6} hd{hd:<3} x{heads:<2} seg {seg:>5} x {segments}: {err:.2e} {verdict}", flush=True)
    return rows


def timing(ctx, rng: np.random.Generator, variants: list[str]) -> list[dict]:
    from cuda_bench import time_ms  # (CUDA events, warm-up, median)

    from gpu_engine.cuda.vision_flash import vision_flash_attention

    heads, hd, rows = 16, 72, []
    for seg in TIMED_SEGMENTS:
        mark = ctx.arena.mark()
        qkv = ctx.to_device(rng.standard_normal((seg, 3 * heads * hd), dtype=np.float32), "bf16", "t.qkv")
        out = ctx.empty((seg, heads * hd), "bf16", "t.out")
        for v in variants:
            ms = time_ms(ctx, lambda v=v: vision_flash_attention(ctx, out, qkv, heads, hd, seg, hd ** -0.5, v),
                         reps=10)
            tflops = 4.0 * seg * seg * hd * heads / ms / 1e9
            rows.append({"variant": v, "seg_len": seg, "ms": ms, "tflops": tflops})
            print(f"time  {v:<6} seg {seg:>5} x 16 heads hd72: {ms:8.3f} ms  {tflops:6.1f} TFLOP/s", flush=True)
        ctx.arena.release(mark)
    return rows


def tower(ctx, rng: np.random.Generator, variants: list[str]) -> list[dict]:
    from qwen35_shapes import model_shape

    from gpu_engine.cuda import vision_flash
    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.cuda.vision import GpuVisionTower
    from gpu_engine.reference.vision_tower import vision_weight_shapes

    _, vision_cfg, _ = model_shape("9b")
    cfg = SimpleNamespace(**vision_cfg)
    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.02)
    tw = GpuVisionTower(ctx, cfg, {k: np.resize(block, s) for k, s in vision_weight_shapes(cfg).items()}, "bf16")
    rows = []
    for label, grid in TOWER_GRIDS.items():
        n = grid[0] * grid[1] * grid[2]
        pixels = rng.standard_normal((n, tw.dims.patch_dim)).astype(np.float32)
        mark = ctx.arena.mark()
        out = ctx.empty((tw.num_tokens(grid), cfg.out_hidden_size), "bf16", "tower.out")
        for v in variants:
            vision_flash.DEFAULT_VARIANT = v  # the tower's attention reads the module default
            tw.encode(pixels, grid, out)
            ctx.device.sync()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                tw.encode(pixels, grid, out)
                ctx.device.sync()  # encode returns once enqueued
                times.append(time.perf_counter() - t0)
            sec = float(np.median(times))
            rows.append({"variant": v, "item": label, "grid": grid, "encode_ms": 1e3 * sec,
                         "tflops": tw.flops(grid) / sec / 1e12})
            print(f"tower {v:<6} {label:<5} {grid}: {1e3 * sec:8.1f} ms  {tw.flops(grid) / sec / 1e12:6.1f} TFLOP/s",
                  flush=True)
        ctx.arena.release(mark)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--variants", default="m2n32,wg64p,wg64pr,ws2n128,ws2n64,ws3n64")
    parser.add_argument("--no-tower", action="store_true")
    args = parser.parse_args(argv)
    from gpu_engine.cuda.context import GpuContext
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    variants = args.variants.split(",")
    seed = int(np.random.SeedSequence().entropy % (2**32))
    rng = np.random.default_rng(seed)
    ctx = GpuContext(16 << 30)
    result: dict = {"seed": seed, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        result["checks"] = [r for v in variants for r in check(ctx, rng, v)]
        passed = {v for v in variants if all(r["ok"] for r in result["checks"] if r["variant"] == v)}
        result["timing"] = timing(ctx, rng, [v for v in variants if v in passed])
        if not args.no_tower:
            result["tower"] = tower(ctx, rng, [v for v in variants if v in passed])
    finally:
        ctx.close()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(r["ok"] for r in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
