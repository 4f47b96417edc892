"""ModelConfig reads every value where transformers 5.17 reads it; bad configs fail with one clear error."""
from __future__ import annotations

import json
from typing import Any

import pytest
from ci_rule import require_module
from config_variants import text_variant

from gpu_engine.config import ConfigError, ModelConfig, UnsupportedModelError

BASE = {
    "model_type": "qwen3_5",
    "text_config": {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    },
    "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64},
}


def variant(**text_changes: Any) -> dict[str, Any]:
    return text_variant(BASE, **text_changes)


# Each case exercises one reading rule (priority between two places, or a default).
CASES = {
    "defaults": variant(),
    "rope_parameters": variant(rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5,
                                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    "legacy_rope_scaling_wins": variant(
        rope_scaling={"type": "default", "rope_theta": 1234.0, "mrope_section": [1, 2, 1]},
        rope_parameters={"rope_type": "default", "rope_theta": 99.0, "mrope_section": [2, 1, 1]},
    ),
    "theta_and_factor_at_text_level": variant(rope_theta=777.0, partial_rotary_factor=0.5,
                                              rope_parameters={"mrope_section": [2, 1, 1]}),
    "factor_inside_wins_over_text_level": variant(partial_rotary_factor=0.5,
                                                   rope_parameters={"partial_rotary_factor": 1.0,
                                                                    "mrope_section": [4, 2, 2]}),
    "interval_3": variant(full_attention_interval=3),
    "legacy_layer_names": variant(layer_types=["mamba", "attention", "mamba", "mamba", "attention",
                                               "linear_attention"]),
    "tie_top_level": {**variant(), "tie_word_embeddings": True},
    "tie_only_in_text_config_is_ignored": variant(tie_word_embeddings=True),
    "vision_num_attention_heads_alias": {**variant(),
                                         "vision_config": {"depth": 1, "hidden_size": 48, "num_attention_heads": 3}},
    "no_sub_configs": {"model_type": "qwen3_5"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_match_transformers(case, tmp_path):
    require_module("transformers")
    from transformers import Qwen3_5Config

    raw = CASES[case]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = ModelConfig.from_pretrained(tmp_path)
    hf = Qwen3_5Config.from_pretrained(tmp_path)
    t, ht = ours.text, hf.text_config
    for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "attention_bias", "linear_conv_kernel_dim",
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    ):
        assert getattr(t, name) == getattr(ht, name), name
    assert list(t.layer_types) == list(ht.layer_types)
    rope = ht.rope_parameters
    assert t.rope_theta == rope["rope_theta"]
    assert t.partial_rotary_factor == rope.get("partial_rotary_factor", 1.0)
    assert list(t.mrope_section) == list(rope.get("mrope_section", [11, 11, 10]))
    v, hv = ours.vision, hf.vision_config
    for name in ("depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings"):
        assert getattr(v, name) == getattr(hv, name), name
    assert v.rope_theta == hv.rope_parameters["rope_theta"]
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(hf, name), name


def test_eos_ids_prefer_generation_config(tmp_path):
    raw = {**variant(eos_token_id=5), "eos_token_id": 7}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 10]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (9, 10)
    assert ModelConfig.from_dict(variant(eos_token_id=5)).eos_token_ids == (5,)


def test_derived_sizes():
    cfg = ModelConfig.from_dict(CASES["rope_parameters"]).text
    assert cfg.rotary_dim == 8
    assert cfg.linear_conv_dim == 2 * 2 * 8 + 4 * 12
    assert cfg.full_attention_layers == (3,) and cfg.linear_attention_layers == (0, 1, 2, 4, 5)


@pytest.mark.parametrize(
    "raw,error,words",
    [
        ({**variant(), "model_type": "llama"}, UnsupportedModelError, "model_type='llama'"),
        ({**variant(), "model_type": None}, UnsupportedModelError, "model_type=None"),
        (variant(hidden_act="gelu"), UnsupportedModelError, "hidden_act='gelu'"),
        (variant(rope_parameters={"rope_type": "yarn", "factor": 4.0}), UnsupportedModelError, "rope_type='yarn'"),
        (variant(rope_parameters={"mrope_interleaved": False}), UnsupportedModelError, "mrope_interleaved=False"),
        (variant(layer_types=["linear_attention"] * 5 + ["sliding_attention"]), UnsupportedModelError,
         "layer_types[5]"),
        (variant(layer_types=["linear_attention"] * 3), ConfigError, "3 entries but num_hidden_layers=6"),
        (variant(hidden_size="64"), ConfigError, "hidden_size must be an integer"),
        (variant(num_key_value_heads=3), ConfigError, "not a multiple"),
        (variant(rope_parameters={"mrope_section": [1, 2]}), ConfigError, "mrope_section"),
        ({**variant(), "text_config": [1, 2]}, ConfigError, "text_config must be an object"),
        ({**variant(), "vision_config": {"hidden_act": "relu"}}, UnsupportedModelError, "hidden_act='relu'"),
        ({**variant(), "vision_config": {"patch_size": [14, 14]}}, UnsupportedModelError, "patch_size"),
    ],
)
def test_bad_values_raise_one_clear_error(raw, error, words):
    with pytest.raises(error) as info:
        ModelConfig.from_dict(raw)
    assert words in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        ModelConfig.from_pretrained(tmp_path)
