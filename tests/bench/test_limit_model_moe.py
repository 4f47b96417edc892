"""The limit model's mixture-of-experts terms (bench/limit_model.py): active-parameter FLOPs and the expected distinct
experts a decode step reads, each against a brute-force count."""
from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from limit_model import ModelCost, expected_distinct_experts

from gpu_engine.config import ModelConfig
from gpu_engine.loader import expected_shapes
from gpu_engine.tiny import TINY_VISION
from gpu_engine.tiny_moe import TINY_MOE_TEXT


def _moe_config(**text: object) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": {**TINY_MOE_TEXT, **text},
                                  "vision_config": TINY_VISION, "tie_word_embeddings": False})


@pytest.mark.parametrize(("experts", "k", "rows"), [(5, 2, 3), (6, 2, 1), (4, 4, 2), (7, 1, 4), (6, 3, 3)])
def test_distinct_experts_equal_the_enumerated_mean(experts: int, k: int, rows: int) -> None:
    subsets = list(itertools.combinations(range(experts), k))
    total = sum(len(set().union(*pick)) for pick in itertools.product(subsets, repeat=rows))
    exact = Fraction(total, len(subsets) ** rows)
    assert expected_distinct_experts(rows, k, experts) == pytest.approx(float(exact), rel=1e-12)


def test_distinct_experts_edges_and_bad_arguments() -> None:
    assert expected_distinct_experts(0, 8, 256) == 0.0
    assert expected_distinct_experts(1, 8, 256) == pytest.approx(8.0)
    assert expected_distinct_experts(32, 8, 256) == pytest.approx(256 * (1 - (31 / 32) ** 32))  # ~163.6 of 256
    for bad in ((1, 0, 4), (1, 5, 4), (-1, 2, 4)):
        with pytest.raises(ValueError):
            expected_distinct_experts(*bad)


@pytest.mark.parametrize("per_expert", [False, True])
def test_moe_cost_counts_active_parameters(per_expert: bool) -> None:
    cfg = _moe_config()
    t, moe = cfg.text, cfg.text.moe
    assert moe is not None
    shapes = expected_shapes(cfg, per_expert=range(t.num_hidden_layers) if per_expert else ())
    cost = ModelCost.from_config(cfg, kv_bytes_per_token=7, state_bytes_per_seq=9)
    # brute force: every 2-D text weight but the embedding and the routed experts, plus k experts' matrices a layer
    dense = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("text/") and len(s) == 2
                and ".mlp.experts." not in n and n != "text/embed_tokens.weight")
    one_expert = sum(int(np.prod(s)) for n, s in expected_shapes(cfg, per_expert=[0]).items()
                     if n.startswith("text/layers.0.mlp.experts.0."))
    assert cost.body_params == dense and cost.expert_params == one_expert
    assert cost.moe_layers == t.num_hidden_layers and cost.experts_per_token == moe.num_experts_per_tok
    active = dense + t.num_hidden_layers * moe.num_experts_per_tok * one_expert
    assert cost.chunk_flops(0, 1, 0) == pytest.approx(2 * active + cost.full_layers * 4 * t.num_attention_heads
                                                       * t.head_dim + cost.linear_layers * cost.linear_state_flops)
    everything = 2 * sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith(("text/", "lm_head/")))
    assert cost.weight_bytes == everything
    experts_all = t.num_hidden_layers * moe.num_experts * 2 * one_expert
    # one row reads exactly its k experts per layer; many rows approach every expert
    assert cost.weights_read(1) == pytest.approx(everything - experts_all + t.num_hidden_layers
                                                 * moe.num_experts_per_tok * 2 * one_expert)
    assert cost.weights_read(10_000) == pytest.approx(everything)
    assert cost.decode_bytes([5, 3]) == pytest.approx(cost.weights_read(2) + 7 * 8 + 2 * 9 * 2)


def test_35b_a3b_active_parameters_and_decode_bytes() -> None:
    from qwen35_shapes import moe_model_shape

    text, vision, tied = moe_model_shape("35b-a3b")
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": vision,
                                 "tie_word_embeddings": tied})
    cost = ModelCost.from_config(cfg, kv_bytes_per_token=0, state_bytes_per_seq=0)
    active = cost.body_params + cost.moe_layers * cost.experts_per_token * cost.expert_params
    assert 2.9e9 < active + cost.head_params < 3.1e9  # "A3B": ~3B active per token, the LM head included
    assert 60e9 < cost.weight_bytes < 75e9  # ~35B parameters in bf16
    b1, b32 = cost.weights_read(1), cost.weights_read(32)
    assert b1 < 0.15 * cost.weight_bytes < b32 < cost.weight_bytes
