"""Block-FP8 vs BF16 GEMMs at Qwen3.5-27B shapes: decode batches against the HBM roofline, prefill against BF16.

    python3 bench/fp8_gemm_bench.py [--json out.json] [--shape 27b]

Per projection (the MLP's gate|up and down, DeltaNet's in_proj qkv|z, attention's q|gate|k|v, o_proj = DeltaNet's
out_proj) and tokens M in 1, 4, 8, 16, 32, 8192:
- every FP8 streaming variant (fp8_ops.GEMV_VARIANTS through fp8_ops.fp8_gemv: the tile grid "stream" and
  "splitk", at M <= 32), FP8 cuBLASLt block-scaled matmul, BF16 cuBLASLt;
- decode (M <= 32): microseconds, bytes moved (weight + scales + activations + output) over the copy bandwidth
  measured in the same run (the faster of a 1 GiB copy kernel and memcpy, read + write) = fraction of the roofline;
- per decode M, the FP8 Linears of one decode step of the whole model (each shape's time x the layers that have
  it) per variant, against the same bytes at the copy rate (`step`: where the GEMM part of the step goes);
- prefill (M = 8192): TFLOP/s of FP8 (GEMM alone, and with the activation quantisation kernel) and BF16;
- the norm before an FP8 linear at the hidden size: add_rmsnorm then the quantisation kernel vs the two in one
  (fp8_ops.norm_quant), per M.
Timing: each variant is captured in a CUDA graph of REPS launches cycling over ROTATE weight copies (no L2 reuse,
no host launch gaps), replayed after a warm-up; median of 5 replays / REPS. Inputs are random, never zeros.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_bench import bench_copy  # noqa: E402
from qwen35_shapes import model_shape  # noqa: E402

from gpu_engine.cuda import ops  # noqa: E402
from gpu_engine.cuda.bf16 import f32_to_bf16_bits  # noqa: E402
from gpu_engine.cuda.context import GpuContext  # noqa: E402
from gpu_engine.cuda.errors import CudaUnavailable  # noqa: E402
from gpu_engine.cuda.fp8_ops import (  # noqa: E402
    GEMV_VARIANT,
    GEMV_VARIANTS,
    Fp8Weight,
    act_buffers,
    fp8_gemv,
    norm_quant,
    quantize_activations,
    weight_scale_grid,
)

ROTATE = 3
DECODE_M = (1, 4, 8, 16, 32)
PREFILL_M = 8192


def graph_us(ctx: GpuContext, calls: list[Callable[[], object]], reps: int) -> float:
    """Median microseconds a call: a graph of `reps` calls cycling over `calls`, 5 timed replays."""
    for call in calls:  # warm: modules, cuBLASLt plans (never created during capture)
        call()
    ctx.device.sync()
    graph = ctx.device.capture(lambda: [calls[i % len(calls)]() for i in range(reps)])
    ctx.device.launch_graph(graph)
    ctx.device.sync()
    samples = []
    for _ in range(5):
        start, stop = ctx.device.event(), ctx.device.event()
        ctx.device.stream.record(start)
        ctx.device.launch_graph(graph)
        ctx.device.stream.record(stop)
        stop.sync()
        samples.append((stop - start) * 1e3 / reps)
    del graph
    return float(np.median(samples))


def fp8_weights(ctx: GpuContext, rng: np.random.Generator, n: int, k: int) -> list[Fp8Weight]:
    bits = rng.integers(0, 256, (n, k), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] ^= 1  # no e4m3 NaN patterns
    grid = weight_scale_grid(rng.uniform(0.5, 1.5, (-(-n // 128), -(-k // 128))).astype(np.float32) * 1e-3)
    out = []
    for i in range(ROTATE):
        b = ctx.empty((n, k), "u8", f"w8.{i}")
        ctx.device.upload(b.ptr, bits)
        s = ctx.to_device(grid, "f32", f"w8s.{i}")
        out.append(Fp8Weight(b, s, grid.shape[1], 1))
    return out


def bf16_weights(ctx: GpuContext, rng: np.random.Generator, n: int, k: int) -> list:
    bits = f32_to_bf16_bits(rng.standard_normal((n, k), dtype=np.float32) * k ** -0.5)
    out = []
    for i in range(ROTATE):
        w = ctx.empty((n, k), "bf16", f"w16.{i}")
        ctx.device.upload(w.ptr, bits)
        out.append(w)
    return out


def bench_shape(ctx: GpuContext, rng: np.random.Generator, label: str, n: int, k: int, copy_gbps: float,
                sizes: tuple[int, ...]) -> list[dict]:
    rows = []
    w8 = fp8_weights(ctx, rng, n, k)
    w16 = bf16_weights(ctx, rng, n, k)
    for m in sizes:
        mark = ctx.arena.mark()
        x = ctx.to_device(rng.standard_normal((m, k), dtype=np.float32), "bf16", "x")
        xa = quantize_activations(ctx, x, m, k)
        y = ctx.empty((m, n), "bf16", "y")
        reps = 5 if m == PREFILL_M else 30
        row: dict = {"proj": label, "m": m, "n": n, "k": k}
        row["bf16_us"] = graph_us(ctx, [partial(ctx.blas.linear, y.ptr, x.ptr, w.ptr, m, n, k) for w in w16], reps)
        try:
            row["fp8_cublaslt_us"] = graph_us(
                ctx, [partial(ctx.blas.linear_fp8, y.ptr, xa.q.ptr, xa.scales.ptr, w.bits.ptr, w.scales.ptr, m, n, k)
                      for w in w8], reps)
        except Exception as exc:  # noqa: BLE001 - reported, the other variants still run
            row["fp8_cublaslt_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if m <= 32:
            fp8_bytes = n * k + w8[0].scales.nbytes + m * k + xa.scales.nbytes + m * n * 2
            bf16_bytes = 2 * n * k + 2 * m * k + 2 * m * n
            row["fp8_roofline_us"] = fp8_bytes / copy_gbps / 1e3
            for variant in GEMV_VARIANTS:
                us = graph_us(ctx, [partial(fp8_gemv, ctx, y, xa, w, variant=variant) for w in w8], reps)
                row[f"fp8_{variant}_us"] = us
                row[f"fp8_{variant}_fraction_of_roofline"] = row["fp8_roofline_us"] / us
            times = {v: row[f"fp8_{v}_us"] for v in GEMV_VARIANTS} | (
                {"cublaslt": row["fp8_cublaslt_us"]} if "fp8_cublaslt_us" in row else {})
            row["fp8_best"] = min(times, key=times.__getitem__)
            best = times[row["fp8_best"]]
            row["fp8_best_fraction_of_roofline"] = row["fp8_roofline_us"] / best
            row["bf16_fraction_of_roofline"] = bf16_bytes / copy_gbps / 1e3 / row["bf16_us"]
            row["speedup_fp8_vs_bf16"] = row["bf16_us"] / best
        else:
            xq = act_buffers(ctx, m, k)
            row["quant_us"] = graph_us(ctx, [partial(quantize_activations, ctx, x, m, k, out=xq)], reps)
            if label == "down":  # the MLP's activation: silu_mul (bf16 path) vs silu_mul fused into the quantisation
                gu = ctx.to_device(rng.standard_normal((m, 2 * k), dtype=np.float32), "bf16", "gu")
                act = ctx.empty((m, k), "bf16", "act")
                row["silu_mul_us"] = graph_us(ctx, [partial(ops.silu_mul, ctx, act, gu)], reps)
                row["swiglu_quant_us"] = graph_us(
                    ctx, [partial(quantize_activations, ctx, gu, m, k, out=xq, swiglu=True)], reps)
                if "fp8_cublaslt_us" in row:
                    row["mlp_down_speedup_fp8_vs_bf16"] = ((row["bf16_us"] + row["silu_mul_us"])
                                                           / (row["fp8_cublaslt_us"] + row["swiglu_quant_us"]))
            flop = 2 * m * n * k
            row["bf16_TFLOPs"] = flop / row["bf16_us"] / 1e6
            if "fp8_cublaslt_us" in row:
                row["fp8_TFLOPs"] = flop / row["fp8_cublaslt_us"] / 1e6
                row["fp8_with_quant_TFLOPs"] = flop / (row["fp8_cublaslt_us"] + row["quant_us"]) / 1e6
                row["speedup_fp8_vs_bf16"] = row["bf16_us"] / (row["fp8_cublaslt_us"] + row["quant_us"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        ctx.arena.release(mark)
    return rows


def step_sums(rows: list[dict], per_step: dict[str, int]) -> list[dict]:
    """Per decode M and variant: the FP8 Linears of one decode step (each shape's time x its count a step), in us,
    against the roofline sum of the same shapes (the step's FP8 GEMM part; lm_head is BF16, not in it)."""
    out = []
    for m in sorted({r["m"] for r in rows if "fp8_roofline_us" in r}):
        at_m = {r["proj"]: r for r in rows if r["m"] == m}
        if set(per_step) - set(at_m):
            continue
        roof = sum(at_m[p]["fp8_roofline_us"] * c for p, c in per_step.items())
        entry: dict = {"m": m, "linears_a_step": per_step, "roofline_us": roof}
        for variant in GEMV_VARIANTS:
            total = sum(at_m[p][f"fp8_{variant}_us"] * c for p, c in per_step.items())
            entry[f"{variant}_us"] = total
            entry[f"{variant}_fraction_of_roofline"] = roof / total
        best = sum(min(at_m[p][f"fp8_{v}_us"] for v in GEMV_VARIANTS) * c for p, c in per_step.items())
        entry["best_variant_per_shape_us"] = best
        entry["best_variant_per_shape_fraction_of_roofline"] = roof / best
        out.append(entry)
    return out


def bench_norm_quant(ctx: GpuContext, rng: np.random.Generator, dim: int, sizes: tuple[int, ...]) -> list[dict]:
    """add_rmsnorm then fp8_quant_act_bf16 vs fp8_add_rmsnorm_quant_bf16 on m rows of `dim`."""
    rows = []
    w = ctx.to_device(rng.standard_normal(dim, dtype=np.float32) * 0.1, "bf16", "norm.w")
    for m in sizes:
        mark = ctx.arena.mark()
        x, d = (ctx.to_device(rng.standard_normal((m, dim), dtype=np.float32), "bf16", n) for n in ("x", "d"))
        h = ctx.empty((m, dim), "bf16", "h")
        xq = act_buffers(ctx, m, dim)
        reps = 5 if m == PREFILL_M else 30

        def separate() -> None:
            ops.add_rmsnorm(ctx, h, x, d, w, 1e-6, True)
            quantize_activations(ctx, h, m, dim, out=xq)

        inner = ctx.arena.mark()

        def fused() -> None:  # norm_quant takes fresh scratch each call: release it (graph capture keeps the last)
            norm_quant(ctx, h, d, w, m, 1e-6, True, residual=x)
            ctx.arena.release(inner)

        row = {"op": "add_rmsnorm+quant", "m": m, "dim": dim, "separate_us": graph_us(ctx, [separate], reps),
               "fused_us": graph_us(ctx, [fused], reps)}
        row["saved_us"] = row["separate_us"] - row["fused_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        ctx.arena.release(mark)
    return rows


def table(rows: list[dict]) -> str:
    nan = float("nan")
    head = (f"{'proj':<10} {'m':>5} {'bf16 us':>8} " + " ".join(f"{v:>9}" for v in GEMV_VARIANTS)
            + f" {'cuBLASLt':>9} {'roof us':>8} {'best/roof':>9} {'x bf16':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['proj']:<10} {r['m']:>5} {r['bf16_us']:>8.1f} "
                     + " ".join(f"{r.get(f'fp8_{v}_us', nan):>9.1f}" for v in GEMV_VARIANTS)
                     + f" {r.get('fp8_cublaslt_us', nan):>9.1f} {r.get('fp8_roofline_us', nan):>8.1f} "
                     f"{r.get('fp8_best_fraction_of_roofline', nan):>9.2f} {r.get('speedup_fp8_vs_bf16', nan):>7.2f}")
        if r["m"] == PREFILL_M:
            lines.append(f"{'':<10} {'':>5} TFLOP/s bf16 {r['bf16_TFLOPs']:.0f}, fp8 {r.get('fp8_TFLOPs', 0):.0f}, "
                         f"fp8+quant {r.get('fp8_with_quant_TFLOPs', 0):.0f} (quant {r['quant_us']:.0f} us)")
            if "swiglu_quant_us" in r:
                lines.append(f"{'':<10} {'':>5} silu_mul {r['silu_mul_us']:.0f} us, silu_mul+quant "
                             f"{r['swiglu_quant_us']:.0f} us: (silu_mul + bf16) / (fused + fp8) = "
                             f"{r.get('mlp_down_speedup_fp8_vs_bf16', float('nan')):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--decode-only", action="store_true", help=f"only M in {DECODE_M}")
    args = parser.parse_args(argv)
    text, _, _ = model_shape(args.shape)
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    conv = 2 * text["linear_num_key_heads"] * 128 + text["linear_num_value_heads"] * 128
    zdim = text["linear_num_value_heads"] * 128
    heads, kv_heads, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    shapes = [("gate_up", 2 * inter, hidden), ("down", hidden, inter), ("in_proj", conv + zdim, hidden),
              ("qkv", (2 * heads + 2 * kv_heads) * hd, hidden), ("o_proj", hidden, heads * hd)]
    layers, every = text["num_hidden_layers"], text.get("full_attention_interval", 4)
    full = layers // every
    per_step = {"gate_up": layers, "down": layers, "in_proj": layers - full, "qkv": full, "o_proj": full}
    if zdim == heads * hd:  # DeltaNet's out_proj has o_proj's shape (27B): its row stands for both
        per_step["o_proj"] = layers
    else:
        shapes.append(("out_proj", hidden, zdim))
        per_step["out_proj"] = layers - full
    try:
        ctx = GpuContext(budget_bytes=12 << 30)
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    rng = np.random.default_rng(0)
    copy = bench_copy(ctx, rng, 1 << 30)
    copy_gbps = max(copy["copy_kernel_GBps"], copy["memcpy_GBps"])
    out: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "device": ctx.device.info.name, "cublaslt_version": ctx.blas.version, "shape": args.shape,
                 "copy": copy, "roofline_GBps": copy_gbps, "default_variant": GEMV_VARIANT, "rows": []}
    for label, n, k in shapes:
        mark = ctx.arena.mark()
        out["rows"] += bench_shape(ctx, rng, label, n, k, copy_gbps,
                                   DECODE_M if args.decode_only else (*DECODE_M, PREFILL_M))
        ctx.arena.release(mark)
        out["step"] = step_sums(out["rows"], per_step)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    out["norm_quant"] = bench_norm_quant(ctx, rng, hidden, DECODE_M if args.decode_only else (*DECODE_M, PREFILL_M))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ctx.close()
    print(f"copy {copy_gbps:.0f} GB/s (read + write), cuBLASLt {out['cublaslt_version']}")
    print(table(out["rows"]))
    for s in out["step"]:
        parts = (f"{v} {s[f'{v}_us']:.0f} ({s[f'{v}_fraction_of_roofline']:.2f})" for v in GEMV_VARIANTS)
        print(f"step m={s['m']}: FP8 Linears at the roofline {s['roofline_us']:.0f} us; " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
