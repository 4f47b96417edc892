"""GPU check of the decode graphs' buckets (gpu_engine/cuda/decode_graphs.py): padded graph replays equal eager
steps, and the padding rows leave every real sequence's cache alone.

    python3 -m tests.cuda_runner.check_decode_graphs [--json out.json] [--seed N]

Two CudaRunners on the same tiny random checkpoint, one with decode graphs and one without; 7 sequences prefilled
with random prompts, then decode steps whose batch moves between 1 and 7 sequences, some with 3-token
jump-forward runs (buckets 1, 2, 4, 8 and 0 or 16 tokens past one each: most steps are padded, several graphs
of different shapes take turns on the same memory), both runners fed the eager runner's tokens. The last steps
sample on the device (a greedy SamplingRequest), and a final eager step of all 7 sequences on both runners reads
every cache after the padded replays. Pass: fp32 logits rel. err <= 1e-4 on every step and identical tokens;
bf16 <= BF16_SANITY (the padded GEMMs may pick other algorithms) with its top-1 agreement reported; and padded
graph replays, with and without runs, did happen. Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from gpu_engine.runner_api import CacheSpec, SamplingRequest, SeqChunk, StepBatch
from tests.cuda_runner.harness import check_main, fresh_seed, rel_err

SMALL = {
    "hidden_size": 256, "intermediate_size": 512, "head_dim": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
}
SEQS, BLOCK, BLOCKS_PER_SEQ = 7, 16, 8
RUN = 3  # tokens of a jump-forward run
# (active sequences, how many of them feed a RUN-token jump-forward run) per step: every bucket up to 8 is met
# several times (eager warm-up + capture, then replays), with steps that need padding rows and padding tokens,
# and graphs of other shapes replayed in between.
SCHEDULE = [(7, 0), (7, 0), (7, 0), (3, 0), (3, 0), (3, 0), (7, 0), (3, 0), (5, 2), (5, 2), (6, 1), (5, 2),
            (2, 0), (2, 0), (2, 0), (1, 0), (1, 0), (1, 0), (6, 1), (3, 0), (5, 2), (7, 2), (7, 2), (7, 2)]
SAMPLED_STEPS = 7  # the last steps of SCHEDULE sample on the device
BF16_SANITY = 1e-1


@dataclass
class GraphResult:
    config: str
    dtype: str
    max_rel_err: float
    top1_agreement: float
    tokens_identical: bool
    padded_replays: int
    graphs: int
    ok: bool


def _greedy(rows: int) -> SamplingRequest:
    return SamplingRequest(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int64),
                           top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                           uniform=np.full(rows, 0.5), num_logprobs=np.full(rows, -1, np.int64))


def _drive(runner, config, rng_seed: int, forced: list[list[list[int]]] | None = None
           ) -> tuple[list[np.ndarray], list[list[list[int]]], list[list[int]]]:
    """Prefill, the decode schedule (the last SAMPLED_STEPS sampled on the device), a final eager step of all.
    Returns the logits of every step, each step's input tokens (`forced` replaces them: the other runner's) and
    the tokens sampled on the device."""
    rng = np.random.default_rng(rng_seed)
    cfg = config.text
    runner.allocate_cache(CacheSpec(num_kv_blocks=SEQS * BLOCKS_PER_SEQ, block_size=BLOCK, num_state_slots=SEQS))
    tables = [np.arange(s * BLOCKS_PER_SEQ, (s + 1) * BLOCKS_PER_SEQ, dtype=np.int32)[::-1].copy()
              for s in range(SEQS)]
    lens = [int(n) for n in rng.integers(5, 20, SEQS)]
    chunks = [SeqChunk(s, rng.integers(0, cfg.vocab_size, lens[s]), np.tile(np.arange(lens[s]), (3, 1)), 0,
                       tables[s], s) for s in range(SEQS)]
    out = runner.forward(StepBatch(chunks))
    nxt = {s: int(np.argmax(out.logits[s])) for s in range(SEQS)}
    steps: list[np.ndarray] = [out.logits]
    inputs: list[list[list[int]]] = []
    sampled_tokens: list[list[int]] = []
    for i, (active, runs) in enumerate([*SCHEDULE, (SEQS, 0)]):
        final = i == len(SCHEDULE)
        members = list(range(SEQS)) if final else [int(s) for s in sorted(rng.choice(SEQS, active, replace=False))]
        extra = [rng.integers(0, cfg.vocab_size, RUN - 1).tolist() if k < runs else [] for k in range(active)]
        ids = forced[i] if forced is not None else [[nxt[s], *extra[k]] for k, s in enumerate(members)]
        inputs.append(ids)
        if final:  # every cache read once more, eagerly, with a two-token chunk each
            runner.use_graphs = False
            chunks = [SeqChunk(s, np.array([ids[k][0], 1]), np.tile(np.arange(lens[s], lens[s] + 2), (3, 1)),
                               lens[s], tables[s], s, logits="all") for k, s in enumerate(members)]
            steps.append(runner.forward(StepBatch(chunks)).logits)
            break
        chunks = [SeqChunk(s, np.array(ids[k]), np.tile(np.arange(lens[s], lens[s] + len(ids[k])), (3, 1)), lens[s],
                           tables[s], s) for k, s in enumerate(members)]
        sampled = i >= len(SCHEDULE) - SAMPLED_STEPS
        out = runner.forward(StepBatch(chunks, sampling=_greedy(active) if sampled else None))
        for k, s in enumerate(members):
            lens[s] += len(ids[k])
            nxt[s] = int(out.sampled.token_ids[k]) if sampled else int(np.argmax(out.logits[k]))
        if sampled:
            sampled_tokens.append([int(t) for t in out.sampled.token_ids])
        else:
            steps.append(out.logits)
    return steps, inputs, sampled_tokens


def run_all(seed: int | None = None) -> tuple[list[GraphResult], dict]:
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.device import require_gpu
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.loader import load_weights
    from gpu_engine.tiny import make_tiny_checkpoint

    require_gpu()
    seed = fresh_seed(seed)
    results = []
    for name, text_cfg in (("tiny", {}), ("small (hd 256, dk 128)", SMALL)):
        with tempfile.TemporaryDirectory() as folder:
            make_tiny_checkpoint(folder, seed=seed % 1000, text_config=text_cfg)
            config = ModelConfig.from_pretrained(folder)
            weights, _ = load_weights(folder, config)
        for dtype in ("f32", "bf16"):
            eager = CudaRunner(config, weights, CudaOptions(dtype=dtype, memory_budget=1 << 30, use_graphs=False))
            graphed = CudaRunner(config, weights, CudaOptions(dtype=dtype, memory_budget=1 << 30))
            try:
                ref_steps, ref_inputs, ref_tokens = _drive(eager, config, seed)
                steps, _, tokens = _drive(graphed, config, seed, forced=ref_inputs)
                graphs, counts = len(graphed._graphs), graphed.decode_counts
            finally:
                eager.close()
                graphed.close()
            errs = [rel_err(a, b) for a, b in zip(steps, ref_steps)]
            print(f"{name} {dtype}: per-step logits rel. err " + " ".join(f"{e:.1e}" for e in errs))
            agree = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(steps, ref_steps)])))
            same = tokens == ref_tokens
            worst = float(max(errs))
            print(f"{name} {dtype}: decode steps {counts}")
            replayed = counts.padded > 0 and counts.with_runs > 0
            ok = replayed and (worst <= 1e-4 and same if dtype == "f32" else worst <= BF16_SANITY)
            results.append(GraphResult(name, dtype, worst, agree, same, counts.padded, graphs, bool(ok)))
    return results, {"seed": seed}


def format_table(results: list[GraphResult]) -> str:
    lines = [f"{'config':<24} {'dtype':<6} {'max rel.err':>11} {'top-1':>6} {'tokens':>7} {'padded':>7} "
             f"{'graphs':>6}  ok", "-" * 80]
    for r in results:
        lines.append(f"{r.config:<24} {r.dtype:<6} {r.max_rel_err:>11.2e} {r.top1_agreement:>6.3f} "
                     f"{'same' if r.tokens_identical else 'DIFF':>7} {r.padded_replays:>7} {r.graphs:>6}  "
                     f"{'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())
