"""Where one batched decode step's device time goes: every op of CudaRunner.forward timed by CUDA events.

    python3 bench/cuda_decode_profile.py [--shape 27b] [--batches 1,32] [--context 1024[,8192]] [--fill prefill|random]
        [--json out.json]

The runner (random bf16 weights, one of bench/cuda_bench.py's shapes) prefills `max(batches)` sequences of
`context` tokens, then runs eager decode steps of b sequences. `--fill random` skips the prefill: the KV cache
and the DeltaNet states are filled with random values (a decode step's cost depends on the lengths, not on
what the cache holds), so long contexts at large batch (192 x 8k = 1.5M tokens) cost seconds instead of a
minute; several contexts then share one runner, each step reading `context` cached tokens per sequence.
During the timed steps each op the runner calls
(the `ops` kernels, cuBLASLt products, the chunked delta rule) is bracketed by two events on the runner's stream.
Right before each timed step's first op (after the step's metadata upload, which waits for the stream) the
stream is given ~60 ms of copies to work through, so the host has queued the whole step before the GPU reaches
it: the times are the ops' device time, not the Python launch gaps between them (an eager step is host-bound at
small batch). Each op
gets its bytes (weights, KV cache and DeltaNet state it must read and write) and the rate that implies, against
the HBM copy ceiling measured in the same run: the table says which ops sit far from it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_bench import SHAPES, bench_copy, prefill_sequences, random_bf16_weights

from gpu_engine.cuda import deltanet_chunked, ops

TRACED_OPS = ("embed_gather", "rmsnorm", "add_rmsnorm", "silu_mul", "qk_norm_rope_store", "paged_attention",
              "flash_prefill", "conv1d_silu", "gated_delta_rule", "rmsnorm_gated")


class OpTimer:
    """Brackets calls with CUDA events while `active`; per op name: calls, device ms (summed at `collect`)."""

    def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]  # ctx: GpuContext, needs cuda at import
        self.ctx = ctx
        self.active = False
        self.before_first = None  # called once, before the first op of an active step
        self.pending: list[tuple[str, object, object]] = []
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name_of, fn):  # type: ignore[no-untyped-def]  # wraps any op signature
        def traced(*args, **kwargs):  # type: ignore[no-untyped-def]  # same signature as the op it wraps
            if not self.active:
                return fn(*args, **kwargs)
            if self.before_first is not None:
                self.before_first()
                self.before_first = None
            start, stop = self.ctx.device.event(), self.ctx.device.event()
            self.ctx.device.stream.record(start)
            result = fn(*args, **kwargs)
            self.ctx.device.stream.record(stop)
            self.pending.append((name_of(*args, **kwargs), start, stop))
            return result
        return traced

    def collect(self) -> float:
        """Add the pending ops' times to the totals; returns ms from the first op's start to the last op's end."""
        self.ctx.device.sync()
        for name, start, stop in self.pending:
            self.ms[name] += stop - start
            self.calls[name] += 1
        span = self.pending[-1][2] - self.pending[0][1] if self.pending else 0.0
        self.pending.clear()
        return span


# Kernel choices to compare in one run: op -> keyword arguments that replace the runner's. "before" is what the
# runner ran before session 3 (2026-11-30): per-head attention, the token-parallel conv for any step of 16+ tokens,
# one state row per warp in the delta-rule recurrence.
# An entry is the keyword arguments, or a function of the call's positional arguments that gives them.
Overrides = dict[str, object] | Callable[[tuple], dict[str, object]]
VARIANTS: dict[str, dict[str, Overrides]] = {
    "current": {},
    # decode attention on the CUDA cores (the runner's choice through session 6) and on the tensor cores (session 7)
    "grouped": {"paged_attention": {"method": "grouped"}},
    "mma": {"paged_attention": {"method": "mma"}},
    # the decode kernels of session 6 (for 16+ rows: two-pass delta rule) and of session 7 (tensor-core
    # attention, one block per DeltaNet head and sequence)
    "s6": {"paged_attention": {"method": "grouped"}, "gated_delta_rule": {"method": "two_pass"}},
    "s7": {"paged_attention": {"method": "mma"}, "gated_delta_rule": {"method": "decode"}},
    "before": {"paged_attention": {"method": "per_head"},
               # then: the token-parallel conv for any step of 16+ tokens (args[1] is `out`, one row per token)
               "conv1d_silu": lambda args: {"method": "tokens" if args[1].shape[0] >= ops.GDN_TWO_PASS_MIN_TOKENS
                                            else "sequential"},
               "gated_delta_rule": {"method": "auto", "rows": 1}},
}


def _overrides(variant: str, op: str, args: tuple) -> dict[str, object]:
    entry = VARIANTS[variant].get(op, {})
    return entry(args) if callable(entry) else entry


def install(timer: OpTimer, variant: dict[str, str]) -> None:
    """Trace every op; calls get VARIANTS[variant["name"]]'s keyword arguments for their op."""
    for op in TRACED_OPS:
        traced = timer.wrap(lambda *a, _op=op, **k: _op, getattr(ops, op))
        setattr(ops, op, lambda *a, _op=op, _traced=traced, **k: _traced(
            *a, **{**k, **_overrides(variant["name"], _op, a)}))
    deltanet_chunked.chunked_gated_delta_rule = timer.wrap(lambda *a, **k: "chunked_gated_delta_rule",
                                                           deltanet_chunked.chunked_gated_delta_rule)
    blas = timer.ctx.blas
    blas.linear = timer.wrap(lambda y, x, w, m, n, k, **kw: f"gemm {n}x{k}", blas.linear)


def fill_random(runner, rng: np.random.Generator) -> None:
    """Random KV rows (bf16 ~N(0, 1)) and DeltaNet conv windows / states (~N(0, 0.02)), never zeros: one 64 MiB
    random piece per dtype, uploaded once and tiled over every cache array by device copies."""
    ctx, piece = runner.ctx, 64 << 20
    mark = ctx.arena.mark()
    sources = {"bf16": ctx.to_device(rng.standard_normal(piece // 2).astype(np.float32), "bf16", "fill-bf16"),
               "f32": ctx.to_device(rng.standard_normal(piece // 4).astype(np.float32) * 0.02, "f32", "fill-f32")}
    small_bf16 = ctx.to_device(rng.standard_normal(piece // 2).astype(np.float32) * 0.02, "bf16", "fill-bf16-small")
    cache = runner.cache
    arrays = [(arr, sources[arr.dtype]) for a in cache.attention.values() for arr in (a.k, a.v)]
    arrays += [(d.conv, small_bf16 if d.conv.dtype == "bf16" else sources["f32"]) for d in cache.deltanet.values()]
    arrays += [(d.state, sources["f32"]) for d in cache.deltanet.values()]
    for arr, src in arrays:
        for off in range(0, arr.nbytes, piece):
            ctx.device.copy(arr.ptr + off, src.ptr, min(piece, arr.nbytes - off))
    ctx.device.sync()
    ctx.arena.release(mark)


def profile(shape: str, batches: list[int], contexts: list[int], steps: int, copy_GBps: float,
            rng: np.random.Generator, variants: list[str], fill: str = "prefill") -> dict:
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch
    from gpu_engine.runner_rules import kv_bytes_per_block, state_bytes_per_slot

    text_cfg, tied = SHAPES[shape]
    config = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text_cfg, "vision_config": {},
                                    "tie_word_embeddings": tied})
    weights = random_bf16_weights(config, rng)
    weight_bytes = sum(a.nbytes for a in weights.text.values()) + (0 if tied else weights.lm_head.nbytes)
    cfg = config.text
    pool, bs = max(batches), 16
    per_seq = (max(contexts) + (steps + 2) * len(batches) * len(variants) + 64) // bs + 1
    cache_bytes = (per_seq * pool * kv_bytes_per_block(cfg, bs, 2) + pool * state_bytes_per_slot(cfg, 2, 4))
    budget = weight_bytes + max(24 << 30, cache_bytes + (8 << 30))  # the cache, the 2 GiB lead, step scratch
    runner = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=budget))
    del weights
    runner.allocate_cache(CacheSpec(num_kv_blocks=per_seq * pool, block_size=bs, num_state_slots=pool))
    tables = [np.arange(s * per_seq, (s + 1) * per_seq, dtype=np.int32) for s in range(pool)]
    lead = runner.ctx.empty((2, 256 << 20), "f32", "queue-lead")  # 2 x 1 GiB

    def queue_ahead(copies: int = 120) -> None:  # ~0.5 ms each at HBM speed: the GPU stays busy while we launch
        for _ in range(copies):
            runner.ctx.device.copy(lead.ptr + lead.nbytes // 2, lead.ptr, lead.nbytes // 2)

    timer = OpTimer(runner.ctx)
    variant = {"name": "current"}
    install(timer, variant)
    out: dict = {"shape": shape, "context": contexts[0] if len(contexts) == 1 else contexts, "fill": fill,
                 "steps": steps, "per_batch": {}}
    try:
        if fill == "random":
            fill_random(runner, rng)
            vocab = cfg.vocab_size
            tokens = {s: int(rng.integers(0, vocab)) for s in range(pool)}
        else:
            assert len(contexts) == 1, "--fill prefill takes one context"
            tokens = prefill_sequences(runner, rng, list(range(pool)), tables, contexts[0])
        runner.use_graphs = False  # eager: every op is a separate launch we can bracket
        state_bytes = 2 * runner.state_bytes_per_slot()  # read + written per sequence and step
        kv_per_token = runner.kv_bytes_per_block(bs) / bs
        length = {s: contexts[0] for s in range(pool)}
        for context, b, name in ((c, b, v) for c in contexts for b in batches for v in variants):
            variant["name"] = name
            if fill == "random":  # every sequence reads `context` cached tokens (random rows) at this pass
                length = {s: context for s in range(pool)}

            def step() -> None:
                chunks = [SeqChunk(s, np.array([tokens[s]]), np.full((3, 1), length[s]), length[s], tables[s], s)
                          for s in range(b)]
                logits = runner.forward(StepBatch(chunks)).logits
                for i in range(b):
                    tokens[i] = int(np.argmax(logits[i]))
                    length[i] += 1

            for _ in range(2):  # warm-up: GEMM plans for this m
                step()
            timer.ms.clear()
            timer.calls.clear()
            total = 0.0
            for _ in range(steps):
                timer.before_first = queue_ahead
                timer.active = True
                step()
                timer.active = False
                total += timer.collect()
            rows = {}
            for op, ms in sorted(timer.ms.items(), key=lambda kv: -kv[1]):
                per_step_ms = ms / steps
                nbytes = _op_bytes(op, b, cfg, state_bytes, kv_per_token, sum(length[s] for s in range(b)) / b)
                calls = timer.calls[op] // steps
                rows[op] = {"ms": per_step_ms, "calls": calls,
                              "bytes": nbytes * calls if nbytes else None,
                              "GBps": nbytes * calls / per_step_ms / 1e6 if nbytes else None}
            weights_read = runner.model.w.nbytes - (0 if tied else runner.model.w.embed.nbytes)
            mean_len = sum(length[s] for s in range(b)) / b
            roof_bytes = weights_read + b * (state_bytes + kv_per_token * mean_len)
            key = f"{b} {name}" if len(contexts) == 1 else f"{b} {name} ctx{context}"
            out["per_batch"][key] = {"batch": b, "variant": name, "context": context, "step_ms": total / steps,
                                     "ops": rows, "roofline_ms": roof_bytes / copy_GBps / 1e6,
                                     "roofline_split_ms": {
                                         "weights": weights_read / copy_GBps / 1e6,
                                         "kv": b * kv_per_token * mean_len / copy_GBps / 1e6,
                                         "deltanet_state": b * state_bytes / copy_GBps / 1e6}}
    finally:
        runner.close()
    return out


def _op_bytes(name: str, b: int, cfg, state_bytes: float, kv_per_token: float, ctx_len: float) -> float | None:
    """Bytes one call must move at batch b (bf16 weights read once; activations are small and left out)."""
    if name.startswith("gemm "):
        n, k = (int(v) for v in name.split()[1].split("x"))
        return 2.0 * n * k
    layers_attn = len(cfg.full_attention_layers)
    layers_gdn = cfg.num_hidden_layers - layers_attn
    if name == "paged_attention":
        return b * kv_per_token * ctx_len / max(layers_attn, 1)  # this layer's K and V of every sequence
    if name == "gated_delta_rule":
        return b * state_bytes / max(layers_gdn, 1)  # this layer's fp32 state, read and written
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", default="1024", help="cached tokens per sequence; a list needs --fill random")
    parser.add_argument("--fill", default="prefill", choices=("prefill", "random"),
                        help="how the cache gets its contents: a real prefill, or random rows (fast)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default="before,current",
                        help="kernel choices to profile, each a separate pass: " + ", ".join(VARIANTS))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from gpu_engine.cuda.context import GpuContext

    rng = np.random.default_rng()
    ctx = GpuContext(budget_bytes=5 << 30)
    try:
        copy = bench_copy(ctx, rng, 1 << 30)
    finally:
        ctx.close()
    result = {"command": "python3 " + " ".join(sys.argv), "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
              "copy_GBps": copy["memcpy_GBps"]}
    contexts = [int(c) for c in args.context.split(",")]
    if len(contexts) > 1 and args.fill != "random":
        parser.error("several contexts need --fill random (one runner, one cache)")
    result.update(profile(args.shape, [int(b) for b in args.batches.split(",")], contexts, args.steps,
                          copy["memcpy_GBps"], rng, args.variants.split(","), args.fill))
    for res in result["per_batch"].values():
        print(f"\n{args.shape} decode b={res['batch']}, {res['variant']} kernels, context {res['context']}: "
              f"device time {res['step_ms']:.2f} ms from the first op to the last (the logits download after it "
              f"not included), roofline {res['roofline_ms']:.2f} ms at {copy['memcpy_GBps']:.0f} GB/s")
        print(f"{'op':34} {'calls':>5} {'ms/step':>8} {'share':>6} {'GB/s':>7}")
        for name, row in res["ops"].items():
            rate = f"{row['GBps']:7.0f}" if row["GBps"] else "      -"
            print(f"{name:34} {row['calls']:5d} {row['ms']:8.3f} {row['ms'] / res['step_ms']:6.1%} {rate}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
