"""CUDA backend benchmark: the two ceilings (HBM copy bandwidth, bf16 cuBLASLt GEMM rate) and what runs on them.

    python3 bench/cuda_bench.py [--json out.json] [--quick] [--shapes 2b,9b,27b,35b-a3b]

Timing: CUDA events around the region, warm-up first, median of repeats; inputs are random (never zeros).
Prints a table last; writes JSON with the device, versions, date and every number.
MoE shapes (qwen35_shapes.MOE_SHAPE_NAMES: 35b-a3b; BF16 MoE runs on cuda since tests/cuda_runner/check_moe.py
passed on the GPU) run a CudaRunner on random in-memory weights like the dense shapes. Their prefill TFLOP/s count
active parameters and their decode rooflines the experts a step touches (bench/limit_model.py: k per layer at batch 1,
E(1-(1-k/E)^B) at batch B under uniform routing).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling bench modules (hf_reference_bench)
BENCH_KERNELS = Path(__file__).resolve().parent / "kernels"  # bench-only kernels (copy.cu)

from qwen35_shapes import MOE_SHAPE_NAMES, moe_model_shape

from gpu_engine.cuda.context import GpuContext
from gpu_engine.cuda.errors import CudaUnavailable


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


def copy_u4(ctx: GpuContext, dst: int, src: int, nbytes: int, blocks: int | None = None) -> None:
    """16-byte-vector device copy (bench/kernels/copy.cu), the bandwidth ceiling; nbytes a multiple of 16."""
    if nbytes % 16:
        raise ValueError(f"copy_u4 needs a multiple of 16 bytes, got {nbytes}")
    ctx.device.add_kernel_dir(BENCH_KERNELS)
    ctx.device.launch("copy", "copy_u4", blocks or ctx.device.info.sm_count * 8, 512, dst, src,
                      np.int64(nbytes // 16))


def bench_copy(ctx: GpuContext, rng: np.random.Generator, nbytes: int) -> dict:
    src = ctx.empty((nbytes // 4,), "f32", "copy-src")
    dst = ctx.empty((nbytes // 4,), "f32", "copy-dst")
    # random contents, generated in 64 MiB pieces to bound host memory
    piece = 16 << 20
    for off in range(0, nbytes // 4, piece):
        n = min(piece, nbytes // 4 - off)
        ctx.to_device(rng.standard_normal(n, dtype=np.float32), "f32", "", out=src.view((n,), off))
    kernel_ms = time_ms(ctx, lambda: copy_u4(ctx, dst.ptr, src.ptr, nbytes))
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


# Qwen3.5 text shapes (random weights; every dimension is a config value). 9B-class = transformers' Qwen3_5TextConfig
# defaults. 27B-class per NInfer's notes: 64 layers = 48 DeltaNet + 16 attention, hidden 5120, 24 q / 4 KV heads
# of 256, MLP 17408; its DeltaNet head counts (16 key / 48 value heads of 128) are our assumption. 2B-class is our
# own small shape (tied embeddings, as small Qwen models do).
SHAPES = {
    "2b": ({"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 248320,
            "full_attention_interval": 4}, True),
    "9b": ({}, False),
    "27b": ({"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
             "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 248320,
             "full_attention_interval": 4}, False),
}
TEXT_2B = SHAPES["2b"][0]
MOE_SHAPES = MOE_SHAPE_NAMES  # apart from SHAPES: the benches that index SHAPES build dense models only


def model_config(name: str):
    """(ModelConfig, text_config dict) of a shape in SHAPES or MOE_SHAPES (text only; every dimension a config
    value)."""
    from gpu_engine.config import ModelConfig

    if name in MOE_SHAPES:
        text_cfg, _, tied = moe_model_shape(name)
        model_type = "qwen3_5_moe"
    else:
        (text_cfg, tied), model_type = SHAPES[name], "qwen3_5"
    return ModelConfig.from_dict({"model_type": model_type, "text_config": text_cfg, "vision_config": {},
                                  "tie_word_embeddings": tied}), text_cfg


def random_bf16_weights(config, rng: np.random.Generator):
    """Random weights as bf16 bit patterns, built by tiling one random block on all host cores (fast, and no
    float32 copy of a multi-GB model). Values ~N(0, 0.02); the DeltaNet decay parameters get their usual ranges."""
    from concurrent.futures import ThreadPoolExecutor

    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.loader import ModelWeights, expected_shapes

    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.02)
    shapes = {k.split("/", 1)[1]: v for k, v in expected_shapes(config).items() if k.startswith(("text/", "lm_head/"))}

    def make(item: tuple[str, tuple[int, ...]]) -> np.ndarray:
        name, shape = item
        if name.endswith("A_log"):
            return np.log(np.random.default_rng().uniform(1.0, 16.0, shape)).astype(np.float32)
        if name.endswith("dt_bias"):
            return np.ones(shape, np.float32)
        return np.resize(block, shape)  # numpy copies release the GIL: the threads run in parallel

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        made = dict(zip(shapes, pool.map(make, shapes.items())))
    lm_head = made.pop("weight", None)  # "lm_head/weight" when untied
    return ModelWeights(text=made, vision={}, lm_head=made["embed_tokens.weight"] if lm_head is None else lm_head)


def active_linear_params(text: dict[str, np.ndarray], cost) -> int:
    """Parameters a token multiplies: every 2-D text weight but the embedding, and of an MoE model's routed experts
    the k it picks per layer (bench/limit_model.ModelCost of the same config)."""
    dense = sum(a.size for k, a in text.items() if a.ndim == 2 and "embed_tokens" not in k and ".mlp.experts." not in k)
    return int(dense + cost.moe_layers * cost.experts_per_token * cost.expert_params)


def decode_weights_read(cost, weights: int, rows: int) -> float:
    """Weight bytes a decode step of `rows` tokens reads, of the `weights` bytes the runner holds for decoding: all
    of them for a dense model, less the routed experts the rows leave untouched for MoE (limit_model.weights_read:
    E(1-(1-k/E)^rows) touched per layer under uniform routing)."""
    return float(weights - (cost.weight_bytes - cost.weights_read(rows)))


def prefill_flops(text_cfg, linear_params: int, n: int) -> float:
    """Matrix FLOPs of a fresh n-token prefill: every projection (2 x params x tokens; the embedding is a gather
    and the LM head runs on the last row only, so neither counts) plus causal attention (QK^T and PV over the
    lower triangle). The DeltaNet layers' own chunk products are left out, so this undercounts our work."""
    full_layers = sum(t == "full_attention" for t in text_cfg.layer_types)
    attention = full_layers * 2 * 2 * (n * n / 2) * text_cfg.head_dim * text_cfg.num_attention_heads
    return 2.0 * linear_params * n + attention


def bench_model(name: str, rng: np.random.Generator, prompt_lens: tuple[int, ...], decode_steps: int,
                copy_GBps: float, batches: tuple[int, ...] = (1, 8, 32)) -> dict:
    """Prefill (one chunk per prompt length), batch-1 decode (eager, graphs, replay) and decode at each batch
    size of `batches` (forward() with graphs, every sequence at ~prompt_lens[0] tokens of context) of one shape
    with random bf16 weights."""
    from limit_model import ModelCost

    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    config, text_cfg = model_config(name)
    tied = config.tie_word_embeddings
    cost = ModelCost.from_config(config, kv_bytes_per_token=0, state_bytes_per_seq=0)  # MoE: active parameters
    t0 = time.perf_counter()
    weights = random_bf16_weights(config, rng)
    weight_bytes = sum(a.nbytes for a in weights.text.values()) + (0 if tied else weights.lm_head.nbytes)
    linear_params = active_linear_params(weights.text, cost)
    runner = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=weight_bytes + (24 << 30)))
    del weights
    out: dict = {"shape": name, "text_config": text_cfg,
                 "tied": tied, "weight_bytes": runner.model.w.nbytes, "setup_s": time.perf_counter() - t0,
                 **({"active_linear_params": linear_params} if cost.moe_layers else {})}
    bs, short = 16, prompt_lens[0]
    blocks_per_seq = (max(prompt_lens) + 4 * decode_steps + 64) // bs + 1
    # the batched-decode sequences (2 .. 1 + max batch) hold a short prompt and every batch's decode steps
    blocks_short = (short + len(batches) * (decode_steps + 1) + 64) // bs + 1
    pool = max(batches, default=0)
    runner.allocate_cache(CacheSpec(num_kv_blocks=blocks_per_seq * 2 + blocks_short * pool, block_size=bs,
                                    num_state_slots=2 + pool))
    tables = [np.arange(blocks_per_seq, dtype=np.int32), np.arange(blocks_per_seq, 2 * blocks_per_seq, dtype=np.int32)]
    tables += [np.arange(2 * blocks_per_seq + i * blocks_short, 2 * blocks_per_seq + (i + 1) * blocks_short,
                         dtype=np.int32) for i in range(pool)]
    cfg = config.text
    try:
        last = None
        for length in prompt_lens:  # prefill; slot/blocks 0 keep the short prompt for the decode test
            ids = rng.integers(0, cfg.vocab_size, length)
            pos = np.tile(np.arange(length), (3, 1))
            seq = 0 if length == short else 1
            times = []
            for _ in range(2 if length == short else 1):
                if length == short and last is None:  # warm-up: loads modules, builds GEMM plans
                    runner.forward(StepBatch([SeqChunk(seq, ids, pos, 0, tables[seq], seq)]))
                runner.ctx.device.sync()
                t0 = time.perf_counter()
                logits = runner.forward(StepBatch([SeqChunk(seq, ids, pos, 0, tables[seq], seq)])).logits
                times.append(time.perf_counter() - t0)
                if length == short:
                    last = logits[-1]
            out[f"prefill_{length}_tok_s"] = length / min(times)
            out[f"prefill_{length}_TFLOPs"] = prefill_flops(cfg, linear_params, length) / min(times) / 1e12

        def decode_batch(step: int, token: int) -> StepBatch:
            p = short + step
            return StepBatch([SeqChunk(0, np.array([token]), np.full((3, 1), p), p, tables[0], 0)])

        token, step = int(np.argmax(last)), 0
        for graphs in (False, True):  # forward() as the engine calls it: eager launches, then decode graphs
            runner.use_graphs, times = graphs, []
            for _ in range(decode_steps):
                t0 = time.perf_counter()
                logits = runner.forward(decode_batch(step, token)).logits
                times.append(time.perf_counter() - t0)
                token, step = int(np.argmax(logits[-1])), step + 1
            out["decode_graphs_forward_ms" if graphs else "decode_eager_ms"] = 1e3 * float(np.median(times[3:]))
        ctx = runner.ctx
        for pdl in (False, True):  # the same step replayed (device time only); PDL between our kernels or not
            ctx.device.pdl = pdl
            captured = runner.capture_step(decode_batch(step, token), table_width=blocks_per_seq)
            captured.replay()
            key = "decode_graph_replay_pdl_ms" if pdl else "decode_graph_replay_ms"
            out[key] = time_ms(ctx, captured.replay, warmup=3, reps=30)
            captured.close()
        ctx.device.pdl = False
        out.update(_batched_decode(runner, rng, tables, short, batches, decode_steps))
        # bytes one decode token must move: every weight once (the embedding table only when it is also the LM
        # head), DeltaNet states read + written, this sequence's KV read
        state = 2 * runner.state_bytes_per_slot()
        kv = runner.kv_bytes_per_block(bs) * (short // bs)
        weights = runner.model.w.nbytes - (0 if tied else runner.model.w.embed.nbytes)

        def weights_read(b: int) -> float:
            return decode_weights_read(cost, weights, b)

        out["decode_bytes"] = weights_read(1) + state + kv
        out["roofline_ms"] = out["decode_bytes"] / copy_GBps / 1e6
        for b in batches:  # one step of b sequences: weights once, every sequence's state and KV
            out[f"decode_b{b}_bytes"] = weights_read(b) + b * (state + kv)
            out[f"decode_b{b}_roofline_ms"] = out[f"decode_b{b}_bytes"] / copy_GBps / 1e6
    finally:
        runner.close()
    return out


def _batched_decode(runner, rng: np.random.Generator, tables: list[np.ndarray], context: int,
                    batches: tuple[int, ...], steps: int, fed: dict[int, list[int]] | None = None) -> dict:
    """Decode steps of b sequences at once (forward() with graphs, as the engine calls it), for each b.
    Sequences 2 .. 1 + max(batches) (slots and tables of the same index) are first prefilled with `context`
    random tokens each, in steps of at most 8192 tokens; each batch size then continues the first b of them.
    Median step time over the steps after the first 3 (the eager runs before the decode graph is captured).
    `fed` (optional) receives each sequence's greedy tokens in order (for checking the bookkeeping)."""
    from gpu_engine.runner_api import SeqChunk, StepBatch

    out: dict = {}
    pool = max(batches, default=0)
    if pool == 0:
        return out
    seqs = list(range(2, 2 + pool))
    t0 = time.perf_counter()
    tokens = prefill_sequences(runner, rng, seqs, tables, context)
    fed = {} if fed is None else fed
    fed.update({s: [tokens[s]] for s in seqs})
    _sync(runner)
    out["decode_batch_prefill_s"] = time.perf_counter() - t0
    length = {s: context for s in seqs}
    for b in batches:
        times = []
        for _ in range(steps):
            chunks = [SeqChunk(s, np.array([tokens[s]]), np.full((3, 1), length[s]), length[s], tables[s], s)
                      for s in seqs[:b]]
            t0 = time.perf_counter()
            logits = runner.forward(StepBatch(chunks)).logits  # returns with the logits on the host
            times.append(time.perf_counter() - t0)
            for i, s in enumerate(seqs[:b]):
                tokens[s] = int(np.argmax(logits[i]))
                fed[s].append(tokens[s])
                length[s] += 1
        ms = 1e3 * float(np.median(times[3:]))
        out[f"decode_b{b}_forward_ms"] = ms
        out[f"decode_b{b}_tok_s"] = 1e3 * b / ms
    return out


def prefill_sequences(runner, rng: np.random.Generator, seqs: list[int], tables: list[np.ndarray],
                      context: int) -> dict[int, int]:
    """Prefill each sequence of `seqs` (its slot and table of the same index) with `context` random tokens, as
    many sequences per forward() as fit in 8192 tokens; returns each sequence's greedy next token."""
    from gpu_engine.runner_api import SeqChunk, StepBatch

    vocab = runner.config.text.vocab_size
    per_step = max(1, 8192 // context)
    tokens: dict[int, int] = {}
    for first in range(0, len(seqs), per_step):
        group = seqs[first:first + per_step]
        chunks = [SeqChunk(s, rng.integers(0, vocab, context), np.tile(np.arange(context), (3, 1)), 0, tables[s], s)
                  for s in group]
        logits = runner.forward(StepBatch(chunks)).logits
        tokens.update({s: int(np.argmax(logits[i])) for i, s in enumerate(group)})
    return tokens


def _sync(runner) -> None:
    ctx = getattr(runner, "ctx", None)  # the CPU reference runner (tests) has no device to wait for
    if ctx is not None:
        ctx.device.sync()


def _hf_rows(name: str, hf: dict, ours: dict | None) -> list[tuple[str, str]]:
    """Table rows for one transformers shape, with our speed-up where we measured the same thing."""
    if "error" in hf:
        return [(f"transformers {name}", "failed: " + (hf["error"].strip().splitlines() or ["?"])[-1][:200])]
    rows = []
    for key in sorted(k for k in hf if k.startswith("prefill_") and k.endswith("_tok_s")):
        length = key.split("_")[1]
        ratio = f", ours {ours[key] / hf[key]:.1f}x" if ours and key in ours else ""
        rows.append((f"transformers {name}: prefill 1 x {length} tokens", f"{hf[key]:.0f} tok/s{ratio}"))
    for key in sorted((k for k in hf if k.startswith("decode_b") and k.endswith("_tok_s")),
                      key=lambda k: int(k[len("decode_b"):-len("_tok_s")])):
        b = key[len("decode_b"):-len("_tok_s")]
        ratio = f", ours {ours[key] / hf[key]:.1f}x" if ours and key in ours else ""
        rows.append((f"transformers {name}: decode b={b} (generate)", f"{hf[f'decode_b{b}_ms']:.1f} ms/step = "
                                                                        f"{hf[key]:.1f} tok/s{ratio}"))
    if "peak_bytes" in hf:
        rows.append((f"transformers {name}: peak torch memory", f"{hf['peak_bytes'] / 2**30:.1f} GiB"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--no-model", action="store_true", help="ceilings only, no model shapes")
    parser.add_argument("--shapes", default="2b,9b,27b",
                        help="our runner: comma-separated subset of " + ",".join([*SHAPES, *MOE_SHAPES]))
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes (ours and transformers)")
    parser.add_argument("--hf-shapes", default="9b,27b",
                        help="transformers on the same card and configs, one child process per shape ('' = none)")
    parser.add_argument("--hf-prefill", default="1024,8192", help="transformers batch-1 prefill lengths")
    parser.add_argument("--hf-steps", type=int, default=6, help="transformers decode steps timed per batch size")
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    hf_shapes = [s for s in args.hf_shapes.split(",") if s]
    for name in args.shapes.split(","):
        if name not in SHAPES and name not in MOE_SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join([*SHAPES, *MOE_SHAPES])}")
    for name in hf_shapes:  # the transformers child builds dense models
        if name not in SHAPES:
            parser.error(f"unknown transformers shape {name!r}; choose from {', '.join(SHAPES)}")
    if not batches or min(batches) < 1 or args.hf_steps < 2:
        parser.error("--batches needs positive sizes and --hf-steps must be >= 2")
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
        if not args.no_model:
            from cuda_op_timings import bench_decode_ops, bench_prefill_ops

            results["decode_ops_2b"] = bench_decode_ops(ctx, rng, 1024)
            results["prefill_ops_2b"] = bench_prefill_ops(ctx, rng, 8192 if not args.quick else 512)
    finally:
        ctx.close()
    model_batches = batches if not args.quick else (1, 4)  # our runner's decode batches (transformers': batches)
    for name in [] if args.no_model else args.shapes.split(","):
        lens = (1024, 8192) if not args.quick else (128,)
        dec = bench_model(name, rng, lens, 20, copy["memcpy_GBps"], model_batches)
        results[f"model_{name}"] = dec
        if args.json:  # keep what is done if a later shape runs out of time
            Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"{name}: " + json.dumps({k: v for k, v in dec.items() if k != "text_config"}), flush=True)
        for length in lens:
            tflops = dec[f"prefill_{length}_TFLOPs"]
            rows.append((f"{name}: prefill 1 x {length} tokens", f"{dec[f'prefill_{length}_tok_s']:.0f} tok/s, "
                         f"{tflops:.0f} TFLOP/s = {100 * tflops / gemm['TFLOPs']:.0f}% of the bf16 GEMM rate"))
        for key, label in (("decode_eager_ms", "eager forward()"), ("decode_graphs_forward_ms", "forward(), graphs"),
                           ("decode_graph_replay_ms", "graph replay"), ("decode_graph_replay_pdl_ms",
                                                                         "graph replay, PDL")):
            ms = dec[key]
            rows.append((f"{name}: decode b=1, {label}",
                         f"{ms:.3f} ms = {1e3 / ms:.0f} tok/s, {100 * dec['roofline_ms'] / ms:.0f}% of HBM roofline"))
        rows.append((f"{name}: decode roofline",
                     f"{dec['decode_bytes'] / 1e9:.2f} GB/token -> {dec['roofline_ms']:.3f} ms"))
        for b in model_batches:
            ms = dec[f"decode_b{b}_forward_ms"]
            rows.append((f"{name}: decode b={b}, forward(), graphs",
                         f"{ms:.3f} ms/step = {dec[f'decode_b{b}_tok_s']:.0f} tok/s, "
                         f"{100 * dec[f'decode_b{b}_roofline_ms'] / ms:.0f}% of HBM roofline"))
    for name in hf_shapes:
        from hf_reference_bench import run_child

        text_cfg, tied = SHAPES[name]
        hf = run_child(text_cfg, tied, prefill=[int(x) for x in args.hf_prefill.split(",") if x], batches=list(batches),
                       context=1024, steps=args.hf_steps)
        results[f"transformers_{name}"] = hf
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"transformers {name}: " + json.dumps(hf)[:3000], flush=True)
        rows += _hf_rows(name, hf, results.get(f"model_{name}"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(info))
    for name, us in results.get("decode_ops_2b", {}).items():
        rows.append((f"  decode op: {name}", f"{us:.1f} us"))
    for name, ms in results.get("prefill_ops_2b", {}).items():
        rows.append((f"  prefill op: {name}", f"{ms:.2f} ms"))
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
