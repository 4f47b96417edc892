"""Where a document-workload prefill step's device time goes: every op of one CudaRunner step, by CUDA events.

    python3 bench/cuda_prefill_profile.py [--shape 9b] [--steps 3] [--json out.json]

Why: in bench/doc_throughput.py's 9B run (29caaac, results/doc_throughput.md) the steps with prefill chunks ran at
~35 % of the bf16 GEMM rate, while one fresh 8k-token prefill reaches ~62 % (results/cuda_notes.md, session 2).
This times both kinds of step with the same op tracer as bench/cuda_decode_profile.py (the GPU is given a lead of
queued copies before each timed step, so the times are device time, not launch gaps):

  fresh8k  one sequence, 8192 fresh tokens;
  doc      the shape of the document steps (doc_step): DECODE_ROWS decode rows at ~4.3k context plus prefill
           chunks that continue prompts from ~2k tokens, filling 8192 tokens, the last logits row of each.

Per op: calls, ms per step, and for GEMMs and flash_prefill the TFLOP/s their FLOPs imply (2 m n k; causal
attention 4 x head_dim x q_heads x the keys every row of the step sees, decode rows included); the step's model
FLOPs (limit_model.ModelCost.chunk_flops) over its device span against the GEMM rate measured in the same process.
Random bf16 weights (bench/cuda_bench.py); the contexts are prefilled with random tokens first, so attention reads
real keys. Written in session 5 and not yet run on a GPU (its host parts: tests/bench/test_cuda_prefill_profile.py).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STEP_TOKENS = 8192
DECODE_ROWS = 56  # the 29caaac run's mean decode batch (56.1)
DECODE_CONTEXT = 4300  # ~4.2k prompt tokens + a part of the 256 outputs
PREFILL_START = 2048  # chunks continue prompts of ~4.2k tokens split over two 8k steps with other work
PREFILL_CHUNK = 2048


def doc_step(step_tokens: int = STEP_TOKENS, decode_rows: int = DECODE_ROWS, decode_context: int = DECODE_CONTEXT,
             prefill_start: int = PREFILL_START, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """(start, tokens) of each sequence of a document-like step: decode rows first, then prefill chunks of `chunk`
    tokens (the last one shorter) until the step holds `step_tokens` tokens."""
    if decode_rows >= step_tokens or min(step_tokens, chunk, decode_context) < 1 or prefill_start < 0:
        raise ValueError("doc_step: need 0 <= decode_rows < step_tokens and positive sizes")
    shape = [(decode_context, 1)] * decode_rows
    left = step_tokens - decode_rows
    while left > 0:
        n = min(chunk, left)
        shape.append((prefill_start, n))
        left -= n
    return shape


def gemm_flops(name: str) -> float | None:
    """FLOPs of a traced GEMM named "gemm MxNxK" (2 m n k), None for other ops."""
    if not name.startswith("gemm "):
        return None
    m, n, k = (int(v) for v in name.split()[1].split("x"))
    return 2.0 * m * n * k


def attention_flops(shape: list[tuple[int, int]], head_dim: int, q_heads: int) -> float:
    """QK^T and PV of one full-attention layer over the step: each query sees its sequence's earlier keys and
    itself (causal inside the chunk)."""
    keys = sum(n * start + n * (n + 1) / 2 for start, n in shape)
    return 4.0 * head_dim * q_heads * keys


def profile(shape_name: str, steps: int, rng: np.random.Generator) -> dict:
    from cuda_bench import SHAPES, bench_gemm, prefill_sequences, random_bf16_weights
    from cuda_decode_profile import TRACED_OPS, OpTimer
    from limit_model import ModelCost

    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda import deltanet_chunked, ops
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    text_cfg, tied = SHAPES[shape_name]
    config = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text_cfg, "vision_config": {},
                                    "tie_word_embeddings": tied})
    weights = random_bf16_weights(config, rng)
    weight_bytes = sum(a.nbytes for a in weights.text.values()) + (0 if tied else weights.lm_head.nbytes)
    # DOCPIPE_CUDA_* options apply (e.g. DOCPIPE_CUDA_DECODE_ROWS_APART=1 to profile that split)
    runner = CudaRunner(config, weights, CudaOptions.from_env(dtype="bf16", memory_budget=weight_bytes + (40 << 30)))
    del weights
    cfg = config.text
    cost = ModelCost.from_config(config, kv_bytes_per_token=runner.kv_bytes_per_block(16) // 16,
                                 state_bytes_per_seq=runner.state_bytes_per_slot())
    kinds = {"fresh8k": [(0, STEP_TOKENS)], "doc": doc_step()}
    seqs = max(len(s) for s in kinds.values())
    bs, longest = 16, max(start + n for s in kinds.values() for start, n in s)
    per_seq = longest // bs + 2
    runner.allocate_cache(CacheSpec(num_kv_blocks=per_seq * seqs, block_size=bs, num_state_slots=seqs))
    tables = [np.arange(s * per_seq, (s + 1) * per_seq, dtype=np.int32) for s in range(seqs)]
    lead = runner.ctx.empty((2, 256 << 20), "f32", "queue-lead")

    def queue_ahead(copies: int = 120) -> None:
        for _ in range(copies):
            runner.ctx.device.copy(lead.ptr + lead.nbytes // 2, lead.ptr, lead.nbytes // 2)

    timer = OpTimer(runner.ctx)
    for op in TRACED_OPS:
        setattr(ops, op, timer.wrap(lambda *a, _op=op, **k: _op, getattr(ops, op)))
    deltanet_chunked.chunked_gated_delta_rule = timer.wrap(lambda *a, **k: "chunked_gated_delta_rule",
                                                           deltanet_chunked.chunked_gated_delta_rule)
    blas = runner.ctx.blas
    blas.linear = timer.wrap(lambda y, x, w, m, n, k, **kw: f"gemm {m}x{n}x{k}", blas.linear)
    gemm = bench_gemm(runner.ctx, rng, 8192, 8192, 8192)
    out: dict = {"shape": shape_name, "steps": steps, "gemm_flops_per_s": gemm["TFLOPs"] * 1e12, "kinds": {}}
    vocab = cfg.vocab_size
    try:
        runner.use_graphs = False
        for kind, shape in kinds.items():
            contexts = {s: start for s, (start, _) in enumerate(shape) if start > 0}
            if contexts:  # the keys these sequences continue from, prefilled per context length
                for length in sorted(set(contexts.values())):
                    prefill_sequences(runner, rng, [s for s, c in contexts.items() if c == length], tables, length)

            def step(shape: list[tuple[int, int]] = shape) -> None:
                chunks = [SeqChunk(s, rng.integers(0, vocab, n), np.tile(np.arange(start, start + n), (3, 1)), start,
                                   tables[s], s) for s, (start, n) in enumerate(shape)]
                runner.forward(StepBatch(chunks))

            for _ in range(2):
                step()
            timer.ms.clear()
            timer.calls.clear()
            span = 0.0
            for _ in range(steps):
                timer.before_first = queue_ahead
                timer.active = True
                step()
                timer.active = False
                span += timer.collect()
            span /= steps
            model_flops = sum(cost.chunk_flops(start, n, 1) for start, n in shape)
            attn = attention_flops(shape, cfg.head_dim, cfg.num_attention_heads)
            rows: dict[str, dict] = {}
            per_kind: dict[str, float] = defaultdict(float)
            for name, ms in sorted(timer.ms.items(), key=lambda kv: -kv[1]):
                per = ms / steps
                calls = timer.calls[name] // steps
                flops = gemm_flops(name)
                if name == "flash_prefill":
                    flops = attn
                rows[name] = {"ms": per, "calls": calls,
                              "tflops": flops * calls / per / 1e9 if flops and per > 0 else None}
                per_kind["gemm" if name.startswith("gemm ") else name] += per
            out["kinds"][kind] = {
                "shape": shape, "tokens": sum(n for _, n in shape), "span_ms": span, "model_flops": model_flops,
                "fraction_of_gemm_rate": model_flops / (span / 1e3) / out["gemm_flops_per_s"] if span else None,
                "ops": rows, "by_kind_ms": dict(per_kind)}
    finally:
        runner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="9b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    result = {"command": "python3 " + " ".join(sys.argv), "date_utc": dt.datetime.now(dt.timezone.utc).isoformat()}
    result.update(profile(args.shape, args.steps, np.random.default_rng()))
    for kind, res in result["kinds"].items():
        frac = res["fraction_of_gemm_rate"]
        print(f"\n{args.shape} {kind}: {res['tokens']} tokens in {len(res['shape'])} sequences, device span "
              f"{res['span_ms']:.1f} ms, {frac:.0%} of the GEMM rate by model FLOPs")
        print(f"{'op':34} {'calls':>5} {'ms/step':>8} {'share':>6} {'TFLOP/s':>8}")
        for name, row in res["ops"].items():
            rate = f"{row['tflops']:8.0f}" if row["tflops"] else "       -"
            print(f"{name:34} {row['calls']:5d} {row['ms']:8.3f} {row['ms'] / res['span_ms']:6.1%} {rate}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
