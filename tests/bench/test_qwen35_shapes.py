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


def test_35b_a3b_has_35b_parameters_3b_active_and_refuses_a_dense_wrapper() -> None:
    """The MoE class of issue 17: its table gives the published sizes (35B total, ~3B active per token without the
    embedding table), and it parses only as qwen3_5_moe."""
    import numpy as np
    from qwen35_shapes import MOE_SHAPE_NAMES, moe_model_shape

    from gpu_engine.config import ConfigError
    from gpu_engine.loader import expected_shapes

    assert MOE_SHAPE_NAMES == ("35b-a3b",)
    text, vision, tied = moe_model_shape("35b-a3b")
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": vision,
                                 "tie_word_embeddings": tied})
    moe = cfg.text.moe
    assert moe is not None and (moe.num_experts, moe.num_experts_per_tok) == (256, 8)
    assert cfg.vision.out_hidden_size == cfg.text.hidden_size == 2048 and not tied
    sizes = {name: int(np.prod(shape)) for name, shape in expected_shapes(cfg).items()}
    experts = sum(n for name, n in sizes.items() if ".mlp.experts." in name)
    total = sum(sizes.values())
    active = total - experts * (1 - moe.num_experts_per_tok / moe.num_experts) - sizes["text/embed_tokens.weight"]
    assert 34.5e9 < total < 35.5e9 and 3.0e9 < active < 3.6e9
    with pytest.raises(ConfigError, match="qwen3_5_moe_text"):
        ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text, "vision_config": vision})
    with pytest.raises(KeyError):
        moe_model_shape("27b")
