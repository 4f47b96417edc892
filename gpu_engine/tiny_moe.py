"""Tiny Qwen3.5-MoE checkpoints without torch, in either expert layout (gpu_engine/moe_layout.py).

`make_tiny_moe_checkpoint` writes the folder of gpu_engine/tiny.py (tokenizer, chat template, processor configs,
SHA256SUMS) with a `qwen3_5_moe` config.json — 6 experts, top-2, deliberately odd expert and shared widths — and
deterministic random weights: fused 3-D experts as transformers saves them (layout="fused"), or one tensor per
expert as the MTP layer and the official FP8 releases store them (layout="per_expert"). Both layouts of the same
arguments hold the same numbers, so they must give the same logits. transformers' Qwen3_5MoeForConditionalGeneration
loads the fused folder as is.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .loader import checkpoint_name, expected_shapes
from .tiny import TINY_TEXT, _init, _write_weights, make_tiny_checkpoint, write_json, write_sums

LAYOUTS = ("fused", "per_expert")
# TINY_TEXT's trunk (3 DeltaNet layers + 1 full attention) with a mixture of experts in every layer's MLP.
TINY_MOE_TEXT: dict[str, Any] = {
    **{k: v for k, v in copy.deepcopy(TINY_TEXT).items() if k != "intermediate_size"},
    "model_type": "qwen3_5_moe_text",
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 21,
    "shared_expert_intermediate_size": 37,
}


def make_tiny_moe_checkpoint(
    folder: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    layout: str = "fused",
    shards: int = 1,
    text_config: dict[str, Any] | None = None,
    vision_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny MoE checkpoint into `folder` and return it. text_config: keys merged over TINY_MOE_TEXT; dtype,
    shards, vision_config and top-level overrides as make_tiny_checkpoint."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    folder = Path(folder)
    text = {**copy.deepcopy(TINY_MOE_TEXT), **(text_config or {})}
    make_tiny_checkpoint(folder, seed=seed, dtype=dtype, shards=shards, text_config=text, vision_config=vision_config,
                         architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", **overrides)
    config_path = folder / "config.json"
    raw = json.loads(config_path.read_text())
    if "intermediate_size" not in text:  # TINY_TEXT's dense width: no qwen3_5_moe model has one
        del raw["text_config"]["intermediate_size"]
        write_json(config_path, raw)
    config = ModelConfig.from_pretrained(folder)
    per_expert = range(config.text.num_hidden_layers) if layout == "per_expert" else range(0)
    _write_weights(folder, moe_random_weights(config, seed=seed, per_expert=per_expert), dtype=dtype, shards=shards)
    write_sums(folder)
    return folder


def moe_random_weights(config: ModelConfig, *, seed: int = 0, per_expert: Iterable[int] = ()
                       ) -> dict[str, np.ndarray]:
    """Deterministic float32 weights under their checkpoint names; the text layers in `per_expert` store their
    experts one tensor per expert. The numbers do not depend on the layout: each fused tensor is drawn and the
    per-expert layers store its slices."""
    moe = config.text.moe
    if moe is None:
        raise ValueError(f"model_type={config.model_type!r} has no experts: use gpu_engine.tiny.random_weights")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for ours, shape in sorted(expected_shapes(config).items()):
        name = ours.split("/", 1)[1]
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # an nn.Linear per expert: scaled by its own fan-in (the last axis), not by the whole tensor's
            value = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        else:
            value = _init(name, shape, rng)
        out[checkpoint_name(ours)] = value
    for layer in per_expert:
        _split_experts(out, f"model.language_model.layers.{layer}.mlp.experts.", moe.moe_intermediate_size)
    return out


def _split_experts(tensors: dict[str, np.ndarray], prefix: str, inter: int) -> None:
    """Replace one layer's fused expert tensors by the per-expert ones (gate rows first, then up)."""
    gate_up, down = tensors.pop(prefix + "gate_up_proj"), tensors.pop(prefix + "down_proj")
    for e in range(gate_up.shape[0]):
        tensors[prefix + f"{e}.gate_proj.weight"] = np.ascontiguousarray(gate_up[e, :inter])
        tensors[prefix + f"{e}.up_proj.weight"] = np.ascontiguousarray(gate_up[e, inter:])
        tensors[prefix + f"{e}.down_proj.weight"] = np.ascontiguousarray(down[e])
