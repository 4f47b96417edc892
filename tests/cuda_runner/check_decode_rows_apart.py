"""GPU check of CudaOptions.decode_rows_apart: a step that carries a prompt chunk of 32+ tokens beside decode rows
gives the same logits when its decode rows go to the decode attention kernel as when every row goes to
flash_prefill (the runner's default, which check_runner compares with the reference runner).

    python3 -m tests.cuda_runner.check_decode_rows_apart [--json out.json] [--seed N]

Two bf16 CudaRunners on the same small random checkpoint (head_dim 256: flash_prefill's and paged_attention_mma's
size), eager steps, one with the option and one without; SEQS sequences prefilled with random prompts of 20-150
tokens, then SCHEDULE's steps: decode rows of the running sequences beside a new sequence's prompt chunk (33-70
tokens, first chunks and a continuation), then decode-only steps. Both runners get the first one's greedy tokens.
Pass: every step's logits within TOL of the other runner's (both bf16; the two attention kernels round P
differently) and the same argmax on at least TOP1 of the rows. Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch
from tests.cuda_runner.harness import check_main, fresh_seed, rel_err

SMALL = {
    "hidden_size": 256, "intermediate_size": 512, "head_dim": 256, "num_attention_heads": 8,
    "num_key_value_heads": 2, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
}
SEQS, BLOCK, BLOCKS_PER_SEQ = 8, 16, 24  # up to 384 tokens a sequence
# per step: (running sequences that decode a token, new prompt chunk: (sequence, tokens) or None)
SCHEDULE = [(5, (5, 64)), (5, (5, 40)), (6, (6, 33)), (7, (7, 70)), (8, None), (8, None)]
TOL, TOP1 = 2e-2, 0.97


@dataclass
class ApartResult:
    config: str
    dtype: str
    max_rel_err: float
    top1_agreement: float
    mixed_steps: int
    ok: bool


def _drive(runner, config, rng_seed: int, forced: list[list[int]] | None = None
           ) -> tuple[list[np.ndarray], list[list[int]]]:
    """Prefill the first 5 sequences, then SCHEDULE. Returns every step's logits and each step's decode tokens
    (`forced` replaces them: the other runner's)."""
    rng = np.random.default_rng(rng_seed)
    vocab = config.text.vocab_size
    runner.allocate_cache(CacheSpec(num_kv_blocks=SEQS * BLOCKS_PER_SEQ, block_size=BLOCK, num_state_slots=SEQS))
    tables = [np.arange(s * BLOCKS_PER_SEQ, (s + 1) * BLOCKS_PER_SEQ, dtype=np.int32)[::-1].copy()
              for s in range(SEQS)]
    prompts = {s: rng.integers(0, vocab, int(n)) for s, n in zip(range(SEQS), rng.integers(20, 150, SEQS))}
    lens = {s: 0 for s in range(SEQS)}

    def prompt_chunk(s: int, n: int) -> SeqChunk:
        ids = np.resize(prompts[s], lens[s] + n)[lens[s]:]  # a prompt longer than drawn repeats itself
        return SeqChunk(s, ids, np.tile(np.arange(lens[s], lens[s] + n), (3, 1)), lens[s], tables[s], s)

    first = [prompt_chunk(s, len(prompts[s])) for s in range(5)]
    out = runner.forward(StepBatch(first))
    for s in range(5):
        lens[s] = len(prompts[s])
    nxt = {s: int(np.argmax(out.logits[s])) for s in range(5)}
    steps, inputs = [out.logits], []
    for i, (running, new) in enumerate(SCHEDULE):
        ids = forced[i] if forced is not None else [nxt[s] for s in range(running)]
        inputs.append(ids)
        chunks = [SeqChunk(s, np.array([ids[s]]), np.full((3, 1), lens[s]), lens[s], tables[s], s)
                  for s in range(running)]
        if new is not None:
            chunks.append(prompt_chunk(*new))
        out = runner.forward(StepBatch(chunks))
        for k, c in enumerate(chunks):
            lens[c.seq_id] += c.token_ids.shape[0]
            nxt[c.seq_id] = int(np.argmax(out.logits[k]))
        steps.append(out.logits)
    return steps, inputs


def run_all(seed: int | None = None) -> tuple[list[ApartResult], dict]:
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.device import require_gpu
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.loader import load_weights
    from gpu_engine.tiny import make_tiny_checkpoint

    require_gpu()
    seed = fresh_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        make_tiny_checkpoint(folder, seed=seed % 1000, text_config=SMALL)
        config = ModelConfig.from_pretrained(folder)
        weights, _ = load_weights(folder, config)
    base = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=1 << 30, use_graphs=False))
    apart = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=1 << 30, use_graphs=False,
                                                    decode_rows_apart=True))
    try:
        ref_steps, ref_inputs = _drive(base, config, seed)
        steps, _ = _drive(apart, config, seed, forced=ref_inputs)
    finally:
        base.close()
        apart.close()
    errs = [rel_err(a, b) for a, b in zip(steps, ref_steps)]
    print("per-step logits rel. err " + " ".join(f"{e:.1e}" for e in errs))
    agree = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(steps, ref_steps)])))
    worst = float(max(errs))
    mixed = sum(1 for _, new in SCHEDULE if new is not None)
    ok = worst <= TOL and agree >= TOP1
    return [ApartResult("small (hd 256, dk 128)", "bf16", worst, agree, mixed, bool(ok))], {"seed": seed}


def format_table(results: list[ApartResult]) -> str:
    lines = [f"{'config':<24} {'dtype':<6} {'max rel.err':>11} {'top-1':>6} {'mixed steps':>11}  ok", "-" * 70]
    for r in results:
        lines.append(f"{r.config:<24} {r.dtype:<6} {r.max_rel_err:>11.2e} {r.top1_agreement:>6.3f} "
                     f"{r.mixed_steps:>11}  {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())
