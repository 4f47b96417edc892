"""The Qwen3.5 model classes as config.json keys: text and vision tower per class (issue 14's table).

    text, vision, tied = model_shape("9b")

Shared by every class: head_dim 256, vocab 248,320, rope_theta 1e7, partial_rotary_factor 0.25, interleaved
mrope_section [11, 11, 10], full_attention_interval 4, DeltaNet key/value head dim 128, vision patch 16 /
temporal patch 2 / merge 2 / 2304 position embeddings. The vision tower's out_hidden_size is the text hidden size
(a tower paired with another class's decoder cannot feed it). The 27B class's DeltaNet head counts follow the
table too (16 key / 48 value heads).

The mixture-of-experts classes (issue 17) are apart, `moe_model_shape("35b-a3b")`: their config.json says
model_type "qwen3_5_moe" (its text_config "qwen3_5_moe_text", so a dense wrapper that sets model_type "qwen3_5"
is refused by name instead of building a dense model), every layer's MLP is routed + shared experts, untied head.
"""
from __future__ import annotations

from typing import Any

# class -> (layers, hidden, intermediate, attention q / kv heads, linear k / v heads, tied, vision depth / hidden /
# heads / intermediate)
_TABLE: dict[str, tuple[int, int, int, int, int, int, int, bool, int, int, int, int]] = {
    "0.8b": (24, 1024, 3584, 8, 2, 16, 16, True, 12, 768, 12, 3072),
    "2b": (24, 2048, 6144, 8, 2, 16, 16, True, 24, 1024, 16, 4096),
    "4b": (32, 2560, 9216, 16, 4, 16, 32, True, 24, 1024, 16, 4096),
    "9b": (32, 4096, 12288, 16, 4, 16, 32, False, 27, 1152, 16, 4304),
    "27b": (64, 5120, 17408, 24, 4, 16, 48, False, 27, 1152, 16, 4304),
}
SHAPE_NAMES = tuple(_TABLE)
# MoE class -> (layers, hidden, attention q / kv heads, linear k / v heads, experts, experts per token, expert /
# shared-expert intermediate, vision depth / hidden / heads / intermediate); all untied
_MOE_TABLE: dict[str, tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int]] = {
    "35b-a3b": (40, 2048, 16, 2, 16, 32, 256, 8, 512, 512, 27, 1152, 16, 4304),
}


MOE_SHAPE_NAMES = tuple(_MOE_TABLE)


def model_shape(name: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(text_config, vision_config, tie_word_embeddings) of a class in SHAPE_NAMES."""
    if name not in _TABLE:
        raise KeyError(f"unknown model class {name!r}; known: {', '.join(SHAPE_NAMES)}")
    layers, hidden, inter, q, kv, lk, lv, tied, vdepth, vhidden, vheads, vinter = _TABLE[name]
    text = {"intermediate_size": inter, **_text(layers, hidden, q, kv, lk, lv)}
    return text, _vision(hidden, vdepth, vhidden, vheads, vinter), tied


def moe_model_shape(name: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(text_config, vision_config, tie_word_embeddings) of a qwen3_5_moe class in MOE_SHAPE_NAMES."""
    if name not in _MOE_TABLE:
        raise KeyError(f"unknown MoE model class {name!r}; known: {', '.join(MOE_SHAPE_NAMES)}")
    layers, hidden, q, kv, lk, lv, experts, top_k, inter, shared, vdepth, vhidden, vheads, vinter = _MOE_TABLE[name]
    text = {"model_type": "qwen3_5_moe_text", **_text(layers, hidden, q, kv, lk, lv), "num_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": inter, "shared_expert_intermediate_size": shared}
    return text, _vision(hidden, vdepth, vhidden, vheads, vinter), False


def _text(layers: int, hidden: int, q: int, kv: int, lk: int, lv: int) -> dict[str, Any]:
    return {
        "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": q, "num_key_value_heads": kv, "head_dim": 256,
        "linear_num_key_heads": lk, "linear_num_value_heads": lv, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "vocab_size": 248320, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "max_position_embeddings": 262144,
    }


def _vision(out_hidden: int, depth: int, hidden: int, heads: int, inter: int) -> dict[str, Any]:
    return {
        "depth": depth, "hidden_size": hidden, "num_heads": heads, "intermediate_size": inter,
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
        "out_hidden_size": out_hidden, "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
    }
