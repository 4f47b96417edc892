"""GPU check of a mixed step's decode rows apart from its prompt chunks: CudaOptions.decode_rows_apart (the
attention's decode rows on the decode kernel instead of flash_prefill) and CudaOptions.deltanet_rows_apart (the
DeltaNet's leading or trailing run of decode rows on the token kernel instead of the chunked one, step.DeltaNetSplit)
give the same logits as the runner with neither, and the runner with both stays as close to the numpy
reference runner as bf16 allows.

    python3 -m tests.cuda_runner.check_decode_rows_apart [--json out.json] [--seed N]

bf16 CudaRunners on the same small random checkpoint (head_dim 256: flash_prefill's and paged_attention_mma's size;
dk = dv = 128: the chunked delta rule's), eager steps: neither option, each option alone, both; and
the ReferenceRunner on the bf16-rounded weights. SEQS sequences prefilled with random prompts of 20-150 tokens, then
SCHEDULE's steps: decode rows of the running sequences beside a new sequence's prompt chunk (33-96 tokens, first
chunks and continuations; the chunk after the decode rows, or before them in CHUNK_FIRST's steps), then
decode-only steps. Every runner gets the reference's greedy tokens. Pass: each option's logits within TOL of the
runner without it (both bf16; the kernels round differently) with the same argmax on at least TOP1 of the rows;
both within BF16_SANITY of the reference (check_runner's bound). Skips (exit 0) without a GPU.
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
# The chunks of 64+ tokens (deltanet_chunked.MIN_PREFILL_TOKENS) split the DeltaNet: 64 and 70 with leading decode
# rows, 96 with trailing ones.
SCHEDULE = [(5, (5, 64)), (5, (5, 40)), (6, (6, 33)), (7, (7, 70)), (7, (7, 96)), (8, None), (8, None)]
CHUNK_FIRST = {4}  # steps whose prompt chunk goes before the decode rows
TOL, TOP1 = 2e-2, 0.97
BF16_SANITY = 1e-1


@dataclass(frozen=True)
class Apart:
    """A runner's two options."""

    attention: bool  # CudaOptions.decode_rows_apart
    deltanet: bool  # CudaOptions.deltanet_rows_apart


NEITHER, BOTH = Apart(False, False), Apart(True, True)
# (case, the runner compared, the runner it is compared with)
CASES = [("attention rows apart", Apart(True, False), NEITHER), ("deltanet rows apart", Apart(False, True), NEITHER),
         ("both", BOTH, NEITHER)]


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
            chunks.insert(0 if i in CHUNK_FIRST else len(chunks), prompt_chunk(*new))
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
    from gpu_engine.reference.runner import ReferenceRunner
    from gpu_engine.tiny import make_tiny_checkpoint
    from tests.cuda_runner.check_runner import _rounded

    require_gpu()
    seed = fresh_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        make_tiny_checkpoint(folder, seed=seed % 1000, text_config=SMALL)
        config = ModelConfig.from_pretrained(folder)
        weights, _ = load_weights(folder, config)
    ref_steps, ref_inputs = _drive(ReferenceRunner(config, _rounded(weights)), config, seed)
    runs: dict[Apart, list[np.ndarray]] = {}
    for options in {o for _, a, b in CASES for o in (a, b)}:
        runner = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=1 << 30, use_graphs=False,
                                                         decode_rows_apart=options.attention,
                                                         deltanet_rows_apart=options.deltanet))
        try:
            runs[options], _ = _drive(runner, config, seed, forced=ref_inputs)
        finally:
            runner.close()
    mixed = sum(1 for _, new in SCHEDULE if new is not None)
    results = []
    cases: list[tuple[str, Apart, Apart | None]] = [*CASES, ("both vs reference", BOTH, None)]
    for name, options, against in cases:
        other = ref_steps if against is None else runs[against]
        steps = runs[options]
        errs = [rel_err(a, b) for a, b in zip(steps, other)]
        print(f"{name}: per-step logits rel. err " + " ".join(f"{e:.1e}" for e in errs))
        agree = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(steps, other)])))
        worst = float(max(errs))
        ok = worst <= BF16_SANITY if against is None else (worst <= TOL and agree >= TOP1)
        results.append(ApartResult(name, "bf16", worst, agree, mixed, bool(ok)))
    return results, {"seed": seed}


def format_table(results: list[ApartResult]) -> str:
    lines = [f"{'case':<24} {'dtype':<6} {'max rel.err':>11} {'top-1':>6} {'mixed steps':>11}  ok", "-" * 70]
    for r in results:
        lines.append(f"{r.config:<24} {r.dtype:<6} {r.max_rel_err:>11.2e} {r.top1_agreement:>6.3f} "
                     f"{r.mixed_steps:>11}  {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())
