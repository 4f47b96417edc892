"""Operator-side numbers for the CUDA runner, next to transformers 5.17 on the same card and config.

    python3 bench/cuda_operator_bench.py [--json out.json] [--shape 2b] [--long 32768[,65536,131072]] [--no-hf]
        [--stream | --only-stream] [--stream-requests 64 --stream-reps 3 ...]

Ours (random bf16 weights, the 2B-class shape of bench/cuda_bench.py unless --shape):
- time to first token of a 1024-token prompt (wall clock: prefill of one chunk + the logits on the host), median
  of 5 after a warm-up;
- batch-1 decode tok/s at 1k context and at each long context (--long tokens, prefilled in 8192-token chunks into a
  cache sized for that length; the prefill must finish with finite logits), through forward() as the engine calls
  it (decode graphs on), median over 32 steps after warm-up;
- peak arena use (every byte the runner touched) per context length (weights + that cache + activations), overall,
  and the arena budget;
- vision encode of one 1024x1024 image (grid 64 x 64 patches of 16) on a Qwen3.5-shaped tower (27 blocks of 1152,
  16 heads, MLP 4304), images/s, median of 3 after a warm-up, with the GEMM attention path (what "auto" picks at
  this size) and with the attention kernel.
transformers (--no-hf to skip), in a child process so the two never share the card's memory: the same text config
as Qwen3_5ForCausalLM in bf16 (its default init; its torch fallbacks for the DeltaNet and conv kernels are what a
user without extra packages gets), time to first token of the same prompt length and decode tok/s at batch 1
(generate() with a fixed number of new tokens, timed for 1 and for 1 + N tokens), peak torch memory.
--stream (last, after everything else has released the card): a mixed image/text request stream through the real
Engine + AsyncEngine, TTFT / latency p50 / p95, tok/s, images/s, after a token check against the reference runner
(bench/cuda_stream_bench.py); exit code 1 if that check or the stream's own output checks fail.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_bench import SHAPES, random_bf16_weights

PROMPT = 1024
DECODE_STEPS = 32
CHUNK = 8192
VISION_2B = {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "patch_size": 16,
             "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 2048,
             "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh", "rope_theta": 10000.0}


def _median_ms(samples: list[float]) -> float:
    return 1e3 * float(np.median(samples))


def bench_ours(shape: str, long_ctxs: list[int], rng: np.random.Generator) -> dict:
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    text_cfg, tied = SHAPES[shape]
    config = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text_cfg, "vision_config": {},
                                    "tie_word_embeddings": tied})
    weights = random_bf16_weights(config, rng)
    weight_bytes = sum(a.nbytes for a in weights.text.values()) + (0 if tied else weights.lm_head.nbytes)
    budget = weight_bytes + (24 << 30)
    runner = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=budget))
    del weights
    cfg, bs = config.text, 16
    out: dict = {"shape": shape, "budget_bytes": budget, "weight_bytes": runner.model.w.nbytes}
    table = np.zeros(0, np.int32)

    def allocate(tokens: int) -> None:
        """A one-sequence cache for `tokens` (+ the decode steps); the arena's high-water mark restarts here,
        so each context length reports its own peak (weights + its cache + activations)."""
        nonlocal table
        blocks = (tokens + 4 * DECODE_STEPS) // bs + 2
        runner.allocate_cache(CacheSpec(num_kv_blocks=blocks, block_size=bs, num_state_slots=2))
        table = np.arange(blocks, dtype=np.int32)
        runner.ctx.arena.peak = runner.ctx.arena.used

    def step(ids: np.ndarray, start: int, logits: str = "last") -> np.ndarray:
        pos = np.tile(np.arange(start, start + len(ids)), (3, 1))
        return runner.forward(StepBatch([SeqChunk(0, ids, pos, start, table, 0, logits=logits)])).logits

    def decode(start: int, token: int) -> list[float]:
        times = []
        for i in range(DECODE_STEPS + 4):
            t0 = time.perf_counter()
            token = int(np.argmax(step(np.array([token]), start + i)[-1]))
            times.append(time.perf_counter() - t0)
        return times[4:]  # the first steps run eagerly, then the decode graph is captured

    peaks = []
    try:
        allocate(PROMPT)
        prompt = rng.integers(0, cfg.vocab_size, PROMPT)
        step(prompt, 0)  # warm-up: modules, GEMM plans
        ttft = []
        for _ in range(5):
            runner.ctx.device.sync()
            t0 = time.perf_counter()
            token = int(np.argmax(step(prompt, 0)[-1]))
            ttft.append(time.perf_counter() - t0)
        out["ttft_1k_ms"] = _median_ms(ttft)
        out["decode_1k_ms"] = _median_ms(decode(PROMPT, token))
        peaks.append(runner.ctx.arena.peak)
        for long_ctx in long_ctxs:  # a fresh sequence prefilled in chunks, then decoded
            allocate(long_ctx)
            out[f"kv_cache_{long_ctx}_bytes"] = runner.kv_bytes_per_block(bs) * len(table)
            ids = rng.integers(0, cfg.vocab_size, long_ctx)
            runner.ctx.device.sync()
            t0 = time.perf_counter()
            for start in range(0, long_ctx, CHUNK):
                logits = step(ids[start:start + CHUNK], start)
            out[f"prefill_{long_ctx}_s"] = time.perf_counter() - t0
            if not np.all(np.isfinite(logits)):
                raise RuntimeError(f"non-finite logits after prefilling {long_ctx} tokens")
            out[f"decode_{long_ctx}_ms"] = _median_ms(decode(long_ctx, int(np.argmax(logits[-1]))))
            out[f"arena_peak_{long_ctx}_bytes"] = runner.ctx.arena.peak
            peaks.append(runner.ctx.arena.peak)
            print(f"ours {shape} at {long_ctx} tokens: prefill {out[f'prefill_{long_ctx}_s']:.2f} s, decode "
                  f"{out[f'decode_{long_ctx}_ms']:.2f} ms, arena peak {runner.ctx.arena.peak / 2**30:.2f} GiB",
                  flush=True)
        out["arena_peak_bytes"] = max(peaks)
    finally:
        runner.close()
    return out


def bench_vision(rng: np.random.Generator, side_px: int = 1024, attention: str = "auto") -> dict:
    from types import SimpleNamespace

    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.cuda.context import GpuContext
    from gpu_engine.cuda.vision import GpuVisionTower
    from gpu_engine.reference.vision_tower import vision_weight_shapes

    cfg = SimpleNamespace(**VISION_2B)
    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.02)
    weights = {k: np.resize(block, s) for k, s in vision_weight_shapes(cfg).items()}
    ctx = GpuContext(8 << 30)
    try:
        tower = GpuVisionTower(ctx, cfg, weights, "bf16", attention=attention)
        side = side_px // cfg.patch_size
        grid = (1, side, side)
        pixels = rng.standard_normal((side * side, tower.dims.patch_dim)).astype(np.float32)
        out = ctx.empty((tower.num_tokens(grid), cfg.out_hidden_size), "bf16", "bench-vision-out")
        tower.encode(pixels, grid, out)  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            tower.encode(pixels, grid, out)  # returns after a device sync
            times.append(time.perf_counter() - t0)
        sec = float(np.median(times))
        return {"attention": attention, "image_px": side_px, "grid": grid, "encode_ms": 1e3 * sec,
                "images_per_s": 1 / sec, "tflops": tower.flops(grid) / sec / 1e12, "weight_bytes": tower.nbytes}
    finally:
        ctx.close()


def bench_vision_ops(rng: np.random.Generator, side: int = 64) -> dict:
    """Device time (CUDA events, median) of each op of one vision block at side x side patches, Qwen3.5 shapes;
    microseconds. Includes the GEMM attention's pieces for one block of query rows, and the same two GEMMs on
    packed, 256-byte-aligned copies of Q, K, V (does the column-slice layout cost cuBLASLt speed?)."""
    from types import SimpleNamespace

    from cuda_bench import time_ms

    from gpu_engine.cuda import ops, vision, vision_ops
    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.cuda.context import GpuContext
    from gpu_engine.cuda.vision import GpuVisionTower
    from gpu_engine.reference.vision_tower import vision_weight_shapes

    cfg = SimpleNamespace(**{**VISION_2B, "depth": 1})
    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.05)
    weights = {k: np.resize(block, s) for k, s in vision_weight_shapes(cfg).items()}
    ctx = GpuContext(8 << 30)
    out: dict = {}
    try:
        tw = GpuVisionTower(ctx, cfg, weights, "bf16")
        b, d = tw.blocks[0], tw.dims
        n, H, hd, heads, inter = side * side, d.hidden_size, d.head_dim, d.num_heads, d.intermediate_size
        rnd = lambda shape, name: ctx.to_device(rng.standard_normal(shape).astype(np.float32), "bf16", name)  # noqa: E731 - one-line local helper
        x, normed, qkv = rnd((n, H), "x"), rnd((n, H), "normed"), rnd((n, 3 * H), "qkv")
        attn, tmp, mlp = rnd((n, H), "attn"), rnd((n, H), "tmp"), rnd((n, inter), "mlp")
        rowcol = ctx.to_device(np.stack([np.arange(n) // side, np.arange(n) % side]).astype(np.int32), "i32", "rc")
        rows = max(1, min(n, vision.SCORES_BYTES // (4 * n * heads)))
        scores = ctx.empty((heads * rows, n), "f32", "scores")
        probs = rnd((heads * rows, n), "probs")
        packed = {name: rnd((heads, n, hd), name) for name in ("q", "k", "v", "o")}
        t = "bf16"
        bl = ctx.blas.linear
        cases = {
            "layernorm": lambda: vision_ops.layernorm(ctx, normed, x, b.norm1_w, b.norm1_b, 1e-6),
            "qkv GEMM": lambda: bl(qkv.ptr, normed.ptr, b.qkv_w.ptr, n, 3 * H, H, dtype=t),
            "qkv bias": lambda: vision_ops.bias_act(ctx, qkv, qkv, b.qkv_b),
            "rope q": lambda: ops.rope(ctx, qkv, n, heads, hd, 3 * H, hd, rowcol, tw.rope_inv, tw.rope_axis),
            "attention kernel path": lambda: vision_ops.vision_attention(ctx, attn, qkv, heads, hd, n, hd ** -0.5),
            "attention GEMM path (all blocks)": lambda: tw._attend(attn, qkv, n, n),
            f"  S=QK^T, {rows} rows x {heads} heads, slices": lambda: bl(
                scores.ptr, qkv.ptr, qkv.ptr + H * 2, rows, n, hd, dtype=t, y_dtype="f32", x_ld=3 * H, w_ld=3 * H,
                batch=heads, strides=(hd, hd, rows * n)),
            f"  S=QK^T, {rows} rows x {heads} heads, packed": lambda: bl(
                scores.ptr, packed["q"].ptr, packed["k"].ptr, rows, n, hd, dtype=t, y_dtype="f32",
                batch=heads, strides=(n * hd, n * hd, rows * n)),
            "  softmax rows (three passes)": lambda: vision_ops.softmax_rows(ctx, probs, scores, hd ** -0.5, "loop"),
            "  softmax rows (register-cached)": lambda: vision_ops.softmax_rows(ctx, probs, scores, hd ** -0.5,
                                                                                "cached"),
            f"  O=PV, {rows} rows x {heads} heads, slices": lambda: bl(
                attn.ptr, probs.ptr, qkv.ptr + 2 * H * 2, rows, hd, n, dtype=t, y_ld=H, w_ld=3 * H, w_layout="kn",
                batch=heads, strides=(rows * n, hd, hd)),
            f"  O=PV, {rows} rows x {heads} heads, packed": lambda: bl(
                packed["o"].ptr, probs.ptr, packed["v"].ptr, rows, hd, n, dtype=t, w_layout="kn",
                batch=heads, strides=(rows * n, n * hd, n * hd)),
            "proj GEMM": lambda: bl(tmp.ptr, attn.ptr, b.proj_w.ptr, n, H, H, dtype=t),
            "bias + residual": lambda: vision_ops.bias_residual(ctx, x, tmp, b.proj_b),
            "fc1 GEMM": lambda: bl(mlp.ptr, normed.ptr, b.fc1_w.ptr, n, inter, H, dtype=t),
            "fc1 bias + GELU": lambda: vision_ops.bias_act(ctx, mlp, mlp, b.fc1_b, "gelu_tanh"),
            "fc2 GEMM": lambda: bl(tmp.ptr, mlp.ptr, b.fc2_w.ptr, n, H, inter, dtype=t),
        }
        for name, fn in cases.items():
            out[name] = 1e3 * time_ms(ctx, fn, warmup=2, reps=10)
            print(f"vision op {name:<45} {out[name]:9.1f} us", flush=True)
    finally:
        ctx.close()
    return out


HF_CHILD = r"""
import json, sys, time, torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
cfg = Qwen3_5TextConfig(**json.loads(sys.argv[1]))
prompt, steps = int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
ids = torch.randint(0, cfg.vocab_size, (1, prompt), device="cuda")
def run(n):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize(); return time.perf_counter() - t0
run(2)  # warm-up
first = sorted(run(1) for _ in range(3))[1]
full = sorted(run(1 + steps) for _ in range(2))[0]
print(json.dumps({"ttft_1k_ms": 1e3 * first, "decode_ms": 1e3 * (full - first) / steps,
                  "peak_bytes": torch.cuda.max_memory_allocated(), "torch": torch.__version__,
                  "transformers": __import__("transformers").__version__}))
"""


def bench_hf(shape: str, steps: int = 16) -> dict:
    text_cfg, tied = SHAPES[shape]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-c", HF_CHILD, json.dumps({**text_cfg, "tie_word_embeddings": tied}), str(PROMPT),
            str(steps)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--shape", default="2b", choices=sorted(SHAPES))
    parser.add_argument("--long", default="32768", help="long-context lengths, comma-separated (tokens), e.g. "
                                                          "32768,65536,131072")
    parser.add_argument("--stream", action="store_true", help="also the mixed image/text stream through Engine + "
                                                              "AsyncEngine (bench/cuda_stream_bench.py), last")
    parser.add_argument("--only-stream", action="store_true", help="the stream alone (no text model, vision, "
                                                                   "transformers)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-vision", action="store_true")
    parser.add_argument("--only-vision", action="store_true", help="skip the text model and transformers")
    parser.add_argument("--vision-ops", action="store_true", help="time each op of one vision block")
    parser.add_argument("--vision-modes", default="auto,kernel", help="attention paths to time (auto, kernel, gemm)")
    from cuda_stream_bench import add_arguments, stream_args

    add_arguments(parser, "stream-")
    args = parser.parse_args(argv)
    try:
        longs = [int(x) for x in args.long.split(",") if x]
    except ValueError:
        parser.error(f"--long takes comma-separated token counts, got {args.long!r}")
    if not longs or min(longs) < 1:
        parser.error("--long needs at least one positive length")
    if args.only_stream:
        args.stream = args.no_vision = args.no_hf = True
    stream = stream_args(args, "stream-") if args.stream else None
    from gpu_engine.cuda.device import CudaDevice
    from gpu_engine.cuda.errors import CudaUnavailable

    try:
        info_dev = CudaDevice().info
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    rng = np.random.default_rng()
    results: dict = {"info": {"device": info_dev.name, "arch": info_dev.arch,
                              "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
                              "command": " ".join([os.path.basename(sys.executable), *sys.argv])}}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    if args.only_vision or args.only_stream:
        args.no_hf = True
    else:
        results["ours"] = bench_ours(args.shape, longs, rng)
        save()
        print("ours:", json.dumps(results["ours"]), flush=True)
    ours = results.get("ours")
    if not args.no_vision:
        for mode in args.vision_modes.split(","):
            results[f"vision_{mode}"] = bench_vision(rng, attention=mode)
            save()
            print(f"vision ({mode}):", json.dumps(results[f"vision_{mode}"]), flush=True)
    if args.vision_ops:
        results["vision_ops_us"] = bench_vision_ops(rng)
        save()
    if not args.no_hf:
        results["transformers"] = bench_hf(args.shape)
        save()
        print("transformers:", json.dumps(results["transformers"])[:2000], flush=True)
    stream_error = None
    if stream is not None:  # last: its engine takes most of the card's free memory while it runs
        from cuda_stream_bench import StreamCheckFailed
        from cuda_stream_bench import run as run_stream

        stream.shape = args.shape
        results["stream_bench"] = {}
        try:
            run_stream(stream, results["stream_bench"])
        except StreamCheckFailed as exc:
            stream_error = exc
            results["stream_bench"]["error"] = str(exc)
        finally:  # whatever was measured before a failure is kept
            save()
    hf = results.get("transformers", {})
    rows = [] if ours is None else [(f"{args.shape}: time to first token, 1k prompt", f"{ours['ttft_1k_ms']:.1f} ms"),
            (f"{args.shape}: decode b=1 at 1k",
             f"{ours['decode_1k_ms']:.2f} ms = {1e3 / ours['decode_1k_ms']:.0f} tok/s")]
    for n in ([] if ours is None else longs):
        rows += [(f"{args.shape}: prefill {n} tokens (chunks of {CHUNK})", f"{ours[f'prefill_{n}_s']:.2f} s"),
                 (f"{args.shape}: decode b=1 at {n}", f"{ours[f'decode_{n}_ms']:.2f} ms = "
                                                       f"{1e3 / ours[f'decode_{n}_ms']:.0f} tok/s"),
                 (f"{args.shape}: arena peak at {n} (weights + cache + activations)",
                  f"{ours[f'arena_peak_{n}_bytes'] / 2**30:.2f} GiB")]
    if ours is not None:
        rows.append((f"{args.shape}: arena peak / budget", f"{ours['arena_peak_bytes'] / 2**30:.2f} / "
                                                           f"{ours['budget_bytes'] / 2**30:.2f} GiB"))
    for mode in args.vision_modes.split(","):
        if f"vision_{mode}" in results:
            v = results[f"vision_{mode}"]
            rows.append((f"vision 1024x1024 (27x1152 tower), {mode} attention",
                         f"{v['encode_ms']:.1f} ms = {v['images_per_s']:.2f} images/s, {v['tflops']:.0f} TFLOP/s"))
    if "decode_ms" in hf:
        rows += [("transformers: time to first token, 1k", f"{hf['ttft_1k_ms']:.1f} ms"),
                 ("transformers: decode b=1 at 1k", f"{hf['decode_ms']:.2f} ms = {1e3 / hf['decode_ms']:.1f} tok/s"),
                 ("transformers: peak torch memory", f"{hf['peak_bytes'] / 2**30:.2f} GiB"),
                 ("decode speed-up over transformers", f"{hf['decode_ms'] / ours['decode_1k_ms']:.1f}x")]
    elif "error" in hf:
        rows.append(("transformers", "failed: " + hf["error"].strip().splitlines()[-1][:200]))
    if "stream_bench" in results:
        from cuda_stream_bench import table_rows

        sb = results["stream_bench"]
        rows += table_rows({**sb.get("stream", {}), "reference_check": sb.get("reference_check")})
        if stream_error is not None:
            rows.append(("stream", f"FAILED: {stream_error}"[:300]))
    save()
    width = max((len(r[0]) for r in rows), default=0)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 1 if stream_error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
