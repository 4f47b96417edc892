"""ModelConfig of a qwen3_5_moe checkpoint: every value where transformers 5.17's Qwen3_5MoeConfig reads it, and
keys that would change the model's meaning refused by name."""
from __future__ import annotations

import json
from typing import Any

import pytest
from ci_rule import require_module
from config_variants import text_variant

from gpu_engine.config import ConfigError, ModelConfig, MoeConfig, UnsupportedModelError

BASE = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 8,
        "linear_value_head_dim": 12, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 21, "shared_expert_intermediate_size": 37,
    },
    "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64},
}


def variant(**text_changes: Any) -> dict[str, Any]:
    return text_variant(BASE, **text_changes)


CASES = {
    "given": variant(),
    "expert_defaults": variant(num_experts=None, num_experts_per_tok=None, moe_intermediate_size=None,
                               shared_expert_intermediate_size=None),
    # Qwen3_5MoeTextConfig's own defaults (the 35B-A3B) differ from the dense ones in these three
    "trunk_defaults": variant(hidden_size=None, num_hidden_layers=None, num_key_value_heads=None),
    "no_sub_configs": {"model_type": "qwen3_5_moe"},
    "consistent_qwen3_next_keys": variant(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "a_stray_dense_width_is_ignored": variant(intermediate_size=96),
    "interval_and_tying": {**variant(full_attention_interval=3), "tie_word_embeddings": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_match_transformers(case, tmp_path):
    require_module("transformers")
    from transformers import Qwen3_5MoeConfig

    (tmp_path / "config.json").write_text(json.dumps(CASES[case]))
    ours = ModelConfig.from_pretrained(tmp_path)
    hf = Qwen3_5MoeConfig.from_pretrained(tmp_path)
    t, ht = ours.text, hf.text_config
    assert ours.model_type == "qwen3_5_moe" and t.moe is not None
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_act", "rms_norm_eps", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_conv_kernel_dim"):
        assert getattr(t, name) == getattr(ht, name), name
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(t.moe, name) == getattr(ht, name), name
    assert list(t.layer_types) == list(ht.layer_types)
    assert t.rope_theta == ht.rope_parameters["rope_theta"]
    assert t.partial_rotary_factor == ht.rope_parameters["partial_rotary_factor"]
    assert t.intermediate_size == 0  # no dense MLP, whatever a stray key says
    for name in ("depth", "hidden_size", "num_heads", "out_hidden_size", "num_position_embeddings"):
        assert getattr(ours.vision, name) == getattr(hf.vision_config, name), name
    for name in ("image_token_id", "video_token_id", "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(hf, name), name


def test_35b_a3b_defaults():
    text = ModelConfig.from_dict({"model_type": "qwen3_5_moe"}).text
    assert text.moe == MoeConfig(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                 shared_expert_intermediate_size=512)
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        2048, 40, 16, 2)
    assert text.layer_types.count("full_attention") == 10
    dense = ModelConfig.from_dict({"model_type": "qwen3_5"}).text
    assert dense.moe is None and dense.intermediate_size == 12288 and dense.hidden_size == 4096


@pytest.mark.parametrize(
    ("raw", "error", "match"),
    [
        (variant(num_experts=0), ConfigError, "num_experts must be >= 1"),
        (variant(num_experts_per_tok=7), ConfigError, "num_experts_per_tok=7 is more than num_experts=6"),
        (variant(num_experts_per_tok=2.0), ConfigError, "num_experts_per_tok must be an integer"),
        (variant(moe_intermediate_size=True), ConfigError, "moe_intermediate_size must be an integer"),
        (variant(shared_expert_intermediate_size=0), ConfigError, "shared_expert_intermediate_size must be >= 1"),
        (variant(norm_topk_prob=False), UnsupportedModelError, "norm_topk_prob=False is not supported"),
        (variant(decoder_sparse_step=2), UnsupportedModelError, "decoder_sparse_step=2 is not supported"),
        (variant(mlp_only_layers=[0, 3]), UnsupportedModelError, r"mlp_only_layers=\[0, 3\] is not supported"),
        (variant(model_type="qwen3_5_text"), ConfigError, "text_config.model_type='qwen3_5_text' does not belong"),
        ({**variant(), "model_type": "qwen3_5"}, ConfigError, "'qwen3_5_moe_text' does not belong to model_type"),
        ({**variant(), "model_type": "qwen3_moe"}, UnsupportedModelError, "supported: qwen3_5, qwen3_5_moe"),
    ],
)
def test_bad_configs_fail_by_name(raw, error, match):
    with pytest.raises(error, match=match):
        ModelConfig.from_dict(raw)


def test_dense_config_ignores_an_unknown_text_model_type():
    """Only the other family's text type is refused; transformers ignores text_config.model_type otherwise."""
    raw = {"model_type": "qwen3_5", "text_config": {"model_type": "something_else"}}
    assert ModelConfig.from_dict(raw).text.moe is None
