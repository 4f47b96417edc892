"""Tiny Qwen3.5-MoE checkpoints without torch, in either expert layout (gpu_engine/moe_layout.py).

`make_tiny_moe_checkpoint` writes the folder of gpu_engine/tiny.py (tokenizer, chat template, processor configs,
SHA256SUMS) with a `qwen3_5_moe` config.json — 6 experts, top-2, deliberately odd expert and shared widths — and
deterministic random weights: fused 3-D experts as the BF16 releases store them (layout="fused"), or one tensor per
expert as the MTP layer, the official FP8 releases and transformers' default save_pretrained store them
(layout="per_expert", written by `to_per_expert_layout`, which converts any fused folder). Both layouts of the same
arguments hold the same numbers, so they give the same logits; transformers' Qwen3_5MoeForConditionalGeneration
loads either folder as is. `mtp=True` adds an MTP head whose layer's experts are stored one tensor per expert
(`mtp.layers.0.mlp.experts.{e}.*`), as in the published checkpoints; transformers ignores `mtp.*`.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .loader import INDEX_FILE, SUMS_FILE, checkpoint_name, expected_shapes, weight_files
from .mtp_layout import mtp_shapes
from .tensors import read_safetensors
from .tiny import TINY_TEXT, _init, _write_weights, make_tiny_checkpoint, write_json, write_sums
from .tiny_fp8 import write_tagged_safetensors

LAYOUTS = ("fused", "per_expert")
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
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
    mtp: bool = False,
    text_config: dict[str, Any] | None = None,
    vision_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny MoE checkpoint into `folder` and return it. text_config: keys merged over TINY_MOE_TEXT; dtype,
    shards, vision_config and top-level overrides as make_tiny_checkpoint. mtp: add an MTP head (`mtp.*`, random, its
    experts one tensor per expert as the published checkpoints store them, whatever `layout`)."""
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
    weights = moe_random_weights(config, seed=seed)
    if mtp:
        weights.update({"mtp." + n: w for n, w in mtp_random_weights(config, seed=seed).items()})
    _write_weights(folder, weights, dtype=dtype, shards=shards)
    if layout == "per_expert":
        to_per_expert_layout(folder)
    write_sums(folder)
    return folder


def moe_random_weights(config: ModelConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights under their checkpoint names, experts fused, activations O(1)."""
    if config.text.moe is None:
        raise ValueError(f"model_type={config.model_type!r} has no experts: use gpu_engine.tiny.random_weights")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for ours, shape in sorted(expected_shapes(config).items()):
        name = ours.split("/", 1)[1]
        if name.endswith(_FUSED):
            # an nn.Linear per expert: scaled by its own fan-in (the last axis), not by the whole tensor's
            value = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        else:
            value = _init(name, shape, rng)
        out[checkpoint_name(ours)] = value
    return out


def mtp_random_weights(config: ModelConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights of a MoE MTP head (names relative to `mtp.`, experts one tensor per expert,
    gpu_engine/mtp_layout.py), scaled as the trunk's."""
    rng = np.random.default_rng([seed, 1])  # its own stream: the trunk's weights do not change with mtp=True
    return {name: _init(name, shape, rng) for name, shape in sorted(mtp_shapes(config.text).items())}


def to_per_expert_layout(folder: str | Path) -> None:
    """Rewrite a checkpoint folder's fused expert tensors as one tensor per expert (gate rows first, then up), in
    place: each stays in its shard with its dtype, the index follows; SHA256SUMS, when present, is rewritten."""
    folder = Path(folder)
    moe = ModelConfig.from_pretrained(folder).text.moe
    if moe is None:
        raise ValueError(f"{folder} is not a mixture-of-experts checkpoint")
    inter = moe.moe_intermediate_size
    moved: dict[str, list[str]] = {}  # fused name -> its per-expert names
    for file in weight_files(folder):
        out: dict[str, tuple[str, np.ndarray]] = {}
        for name, tensor in read_safetensors(folder / file).items():
            raw = np.array(tensor.raw)  # a copy: the file is rewritten below
            if not name.endswith(_FUSED) or name.startswith("mtp."):
                out[name] = (tensor.dtype, raw)
                continue
            parts = _per_expert(name, raw, inter)
            out.update({n: (tensor.dtype, value) for n, value in parts.items()})
            moved[name] = list(parts)
        tmp = folder / (file + ".tmp")
        write_tagged_safetensors(tmp, out)
        os.replace(tmp, folder / file)
    index = folder / INDEX_FILE
    if index.is_file():
        raw_index = json.loads(index.read_text())
        weight_map = raw_index["weight_map"]
        for fused, names in moved.items():
            weight_map.update({n: weight_map[fused] for n in names})
            del weight_map[fused]
        write_json(index, raw_index)
    if (folder / SUMS_FILE).is_file():
        write_sums(folder)


def _per_expert(fused_name: str, value: np.ndarray, inter: int) -> dict[str, np.ndarray]:
    """`...experts.gate_up_proj` [E, 2I, H] -> `...experts.{e}.gate_proj.weight` (rows [:I]) and `.up_proj.weight`
    (rows [I:]); `...experts.down_proj` [E, H, I] -> `...experts.{e}.down_proj.weight`."""
    prefix, kind = fused_name.rsplit(".", 1)
    out: dict[str, np.ndarray] = {}
    for e in range(value.shape[0]):
        if kind == "gate_up_proj":
            out[f"{prefix}.{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :inter])
            out[f"{prefix}.{e}.up_proj.weight"] = np.ascontiguousarray(value[e, inter:])
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
    return out
