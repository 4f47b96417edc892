"""bench/qwen35_shapes.py: every class parses as a Qwen3.5 config whose tower can feed its decoder."""
from __future__ import annotations

import pytest
from qwen35_shapes import SHAPE_NAMES, model_shape

from gpu_engine.config import ModelConfig


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_each_class_pairs_its_own_tower(name: str) -> None:
    text, vision, tied = model_shape(name)
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text, "vision_config": vision,
                                 "tie_word_embeddings": tied})
    assert cfg.vision.out_hidden_size == cfg.text.hidden_size
    assert cfg.text.rope_theta == 1e7 and cfg.text.partial_rotary_factor == 0.25
    assert cfg.text.mrope_section == (11, 11, 10) and cfg.text.mrope_interleaved
    assert cfg.text.layer_types.count("full_attention") * 4 == cfg.text.num_hidden_layers


def test_9b_is_transformers_default_text_shape() -> None:
    text, _, tied = model_shape("9b")
    default = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": {}, "vision_config": {}})
    parsed = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text, "vision_config": {}})
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "linear_num_value_heads", "vocab_size"):
        assert getattr(parsed.text, key) == getattr(default.text, key)
    assert not tied
    with pytest.raises(KeyError):
        model_shape("70b")
