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


def test_moe_shapes_stay_off_the_transformers_side() -> None:
    with pytest.raises(SystemExit):
        cuda_bench.main(["--hf-shapes", "35b-a3b"])  # the transformers child is dense only
    with pytest.raises(SystemExit):
        cuda_bench.main(["--shapes", "9b,35b"])  # unknown shape
    assert "35b-a3b" not in cuda_bench.SHAPES  # the benches that index SHAPES keep building dense models


def test_moe_shape_counts_active_parameters_and_touched_experts() -> None:
    from limit_model import ModelCost, expected_distinct_experts

    config, text_cfg = cuda_bench.model_config("35b-a3b")
    moe = config.text.moe
    assert config.model_type == "qwen3_5_moe" and text_cfg["num_experts"] == 256 and moe is not None
    cost = ModelCost.from_config(config, kv_bytes_per_token=0, state_bytes_per_seq=0)
    expert = 2 * 3 * moe.moe_intermediate_size * config.text.hidden_size  # bf16 bytes of one routed expert
    routed = config.text.num_hidden_layers * moe.num_experts * expert
    held = cost.weight_bytes - config.text.vocab_size * config.text.hidden_size * 2  # the untied embedding is a gather
    assert cuda_bench.decode_weights_read(cost, held, 1) == pytest.approx(held - routed + 40 * 8 * expert)
    assert cuda_bench.decode_weights_read(cost, held, 32) == pytest.approx(
        held - routed + 40 * expected_distinct_experts(32, 8, 256) * expert)
    dense_config, _ = cuda_bench.model_config("9b")
    dense_cost = ModelCost.from_config(dense_config, kv_bytes_per_token=0, state_bytes_per_seq=0)
    assert cuda_bench.decode_weights_read(dense_cost, 12345, 32) == 12345.0  # dense: every weight, any batch


def test_active_linear_params_of_random_moe_weights() -> None:
    from limit_model import ModelCost

    from gpu_engine.tiny_moe import TINY_MOE_TEXT

    config = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": TINY_MOE_TEXT, "vision_config": {},
                                    "tie_word_embeddings": False})
    weights = cuda_bench.random_bf16_weights(config, np.random.default_rng(0))
    cost = ModelCost.from_config(config, kv_bytes_per_token=0, state_bytes_per_seq=0)
    assert weights.text["layers.0.mlp.experts.gate_up_proj"].shape == (6, 42, 64)  # fused, as moe_weights stacks
    active = cost.body_params + config.text.num_hidden_layers * 2 * 3 * 21 * 64  # top-2 experts of width 21
    assert cuda_bench.active_linear_params(weights.text, cost) == active
