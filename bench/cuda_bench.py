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
import time
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


# A 2B-class Qwen3.5 text shape (our choice; every dimension is a config value): 24 layers = 18 Gated DeltaNet +
# 6 gated full attention, hidden 2048, 8 query / 2 KV heads of 256 (64 rotary dims), MLP 6144, DeltaNet 16 key /
# 16 value heads of 128, tied 248320-token embeddings. About 1.9 B parameters.
TEXT_2B = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 248320, "full_attention_interval": 4,
}


def random_bf16_weights(config, rng: np.random.Generator):
    """Random weights as bf16 bit patterns, built by tiling one random block (fast, no float32 model copy).
    Values ~N(0, 0.02); norms and the DeltaNet decay parameters get their usual ranges."""
    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.loader import ModelWeights, expected_shapes

    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.02)
    text = {}
    for key, shape in expected_shapes(config).items():
        group, name = key.split("/", 1)
        if group != "text":
            continue
        if name.endswith("A_log"):
            text[name] = np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        elif name.endswith("dt_bias"):
            text[name] = np.ones(shape, np.float32)
        else:
            text[name] = np.resize(block, shape)
    return ModelWeights(text=text, vision={}, lm_head=text["embed_tokens.weight"])


def bench_decode(rng: np.random.Generator, prompt_len: int, decode_steps: int, copy_GBps: float) -> dict:
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    config = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": TEXT_2B, "vision_config": {},
                                    "tie_word_embeddings": True})
    weights = random_bf16_weights(config, rng)
    runner = CudaRunner(config, weights, dtype="bf16", memory_budget=16 << 30)
    del weights
    bs = 16
    blocks = (prompt_len + decode_steps + 64) // bs + 1
    runner.allocate_cache(CacheSpec(num_kv_blocks=blocks, block_size=bs, num_state_slots=2))
    table = np.arange(blocks, dtype=np.int32)
    cfg = config.text
    ids = rng.integers(0, cfg.vocab_size, prompt_len)
    pos = np.tile(np.arange(prompt_len), (3, 1))
    out: dict = {"config": TEXT_2B, "weight_bytes": runner.w.nbytes, "prompt_len": prompt_len}
    try:
        prefill = []
        for _ in range(3):  # the first one also loads modules and builds GEMM plans
            t0 = time.perf_counter()
            last = runner.forward(StepBatch([SeqChunk(0, ids, pos, 0, table, 0)])).logits[-1]
            prefill.append(time.perf_counter() - t0)
        out["prefill_s"] = prefill
        out["prefill_tok_s"] = prompt_len / float(np.median(prefill[1:]))

        def decode_batch(step: int, token: int) -> StepBatch:
            p = prompt_len + step
            return StepBatch([SeqChunk(0, np.array([token]), np.full((3, 1), p), p, table, 0)])

        token, eager = int(np.argmax(last)), []
        for step in range(decode_steps):
            t0 = time.perf_counter()
            logits = runner.forward(decode_batch(step, token)).logits
            eager.append(time.perf_counter() - t0)
            token = int(np.argmax(logits[-1]))
        out["decode_eager_ms"] = 1e3 * float(np.median(eager[2:]))
        captured = runner.capture_step(decode_batch(decode_steps, token), table_width=blocks)
        ctx = runner.ctx
        replay_ms = time_ms(ctx, captured.replay, warmup=3, reps=50)  # same step replayed: device time only
        loop = []
        for step in range(decode_steps):  # the real loop: new metadata, replay, logits back, argmax on host
            t0 = time.perf_counter()
            captured.update(decode_batch(decode_steps + 1 + step, token))
            captured.replay()
            token = int(np.argmax(captured.logits()[-1]))
            loop.append(time.perf_counter() - t0)
        captured.close()
        out["decode_graph_replay_ms"] = replay_ms
        out["decode_graph_loop_ms"] = 1e3 * float(np.median(loop[2:]))
        # bytes one decode token must move: every weight once (tied embeddings = the LM head read), DeltaNet
        # states read + written, this sequence's KV read
        state = 2 * runner.state_bytes_per_slot()
        kv = runner.kv_bytes_per_block(bs) * (prompt_len // bs)
        out["decode_bytes"] = runner.w.nbytes + state + kv
        out["roofline_ms"] = out["decode_bytes"] / copy_GBps / 1e6
    finally:
        runner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--no-model", action="store_true", help="ceilings only, skip the 2B-class model")
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
    if not args.no_model:
        dec = bench_decode(rng, 1024 if not args.quick else 128, 20, copy["memcpy_GBps"])
        results["decode_2b"] = dec
        rows.append(("2B-class prefill 1 x %d tokens (eager)" % dec["prompt_len"], f"{dec['prefill_tok_s']:.0f} tok/s"))
        for key, label in (("decode_eager_ms", "eager forward()"), ("decode_graph_loop_ms", "CUDA graph + host loop"),
                           ("decode_graph_replay_ms", "CUDA graph replay only")):
            ms = dec[key]
            rows.append((f"2B-class decode b=1, {label}",
                         f"{ms:.3f} ms = {1e3 / ms:.0f} tok/s, {100 * dec['roofline_ms'] / ms:.0f}% of HBM roofline"))
        rows.append(("2B-class decode roofline", f"{dec['decode_bytes'] / 1e9:.2f} GB/token -> {dec['roofline_ms']:.3f} ms"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(info))
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
