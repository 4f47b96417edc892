"""Host-side parts of bench/cuda_bench.py and bench/cuda_operator_bench.py: batched decode bookkeeping (run on
the reference runner) and argument checks that must fail before any GPU is touched."""
from __future__ import annotations

import cuda_bench
import cuda_operator_bench
import numpy as np
import pytest

from gpu_engine.config import ModelConfig
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch
from gpu_engine.tiny import TINY_TEXT, random_weights


def _tiny_runner() -> ReferenceRunner:
    config = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": {**TINY_TEXT, "vocab_size": 300},
                                    "vision_config": {}})
    from gpu_engine.loader import ModelWeights

    raw = random_weights(config, seed=3)
    text = {k.removeprefix("model.language_model."): v for k, v in raw.items() if k.startswith("model.language_model.")}
    return ReferenceRunner(config, ModelWeights(text=text, vision={}, lm_head=raw["lm_head.weight"]))


def test_batched_decode_continues_each_sequence_correctly() -> None:
    runner = _tiny_runner()
    context, steps, pool, bs = 10, 4, 3, 16
    blocks = (context + 2 * (steps + 1)) // bs + 2
    runner.allocate_cache(CacheSpec(num_kv_blocks=blocks * (2 + pool), block_size=bs, num_state_slots=2 + pool))
    tables = [np.arange(i * blocks, (i + 1) * blocks, dtype=np.int32) for i in range(2 + pool)]
    rng = np.random.default_rng(7)
    fed: dict[int, list[int]] = {}
    out = cuda_bench._batched_decode(runner, rng, tables, context, (1, 3), steps, fed)
    assert set(out) == {"decode_batch_prefill_s", "decode_b1_forward_ms", "decode_b1_tok_s", "decode_b3_forward_ms",
                        "decode_b3_tok_s"}
    assert out["decode_b3_tok_s"] == pytest.approx(3e3 / out["decode_b3_forward_ms"])
    # Independent replay of sequence 2 (in both batches: 1 + steps + steps tokens after its prompt) on a fresh
    # cache, one token at a time: its greedy tokens must be what the batched run fed back.
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 300, context)
    runner.allocate_cache(CacheSpec(num_kv_blocks=blocks, block_size=bs, num_state_slots=1))
    table = np.arange(blocks, dtype=np.int32)

    def step(ids: np.ndarray, start: int) -> int:
        pos = np.tile(np.arange(start, start + len(ids)), (3, 1))
        return int(np.argmax(runner.forward(StepBatch([SeqChunk(0, ids, pos, start, table, 0)])).logits[-1]))

    tokens = [step(prompt, 0)]
    for i in range(2 * steps):
        tokens.append(step(np.array([tokens[-1]]), context + i))
    assert fed[2] == tokens
    assert len(fed[4]) == 1 + steps  # only in the batch of 3


def test_cuda_bench_rejects_bad_arguments_before_the_gpu() -> None:
    for argv in (["--hf-shapes", "70b"], ["--shapes", "2b,x"], ["--batches", "0"], ["--hf-steps", "1"]):
        with pytest.raises(SystemExit):
            cuda_bench.main(argv)


def test_operator_bench_rejects_bad_arguments_before_the_gpu() -> None:
    for argv in (["--long", "32k"], ["--long", "0"], ["--stream", "--stream-reps", "0"]):
        with pytest.raises(SystemExit):
            cuda_operator_bench.main(argv)
