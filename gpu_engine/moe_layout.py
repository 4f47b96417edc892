"""Where a qwen3_5_moe layer's MLP sits in a checkpoint: the two published expert layouts, their names and shapes.

Both layouts (names relative to a layer's `mlp.`; E experts, I = moe_intermediate_size, S = shared width, H hidden):
- router `gate.weight` [E, H]; shared expert `shared_expert.{gate,up}_proj.weight` [S, H],
  `shared_expert.down_proj.weight` [H, S] and its gate `shared_expert_gate.weight` [1, H].
Routed experts, either
- fused (the BF16 releases; transformers' parameters, written by save_pretrained(save_original_format=False)):
  `experts.gate_up_proj` [E, 2I, H] (rows [:I] the gate projection, [I:] the up projection) and
  `experts.down_proj` [E, H, I], both without a `.weight` suffix; or
- one tensor per expert (the MTP layer, the official FP8 releases, where each carries its weight_scale_inv, and
  transformers 5.17's default save_pretrained, which writes the qwen2_moe names back):
  `experts.{e}.gate_proj.weight` [I, H], `experts.{e}.up_proj.weight` [I, H], `experts.{e}.down_proj.weight` [H, I].
The loader decides per layer which one the checkpoint holds (`per_expert_layers`) and checks every name and shape of
that one; a runner reads either through `routed_experts`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .config import MoeConfig

_PER_EXPERT_NAME = re.compile(r"^text/layers\.(\d+)\.mlp\.experts\.\d+\.")


def moe_shapes(prefix: str, moe: MoeConfig, hidden: int, *, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of one MoE MLP whose names start with `prefix` (e.g. "text/layers.3.mlp.")."""
    e, inter, shared = moe.num_experts, moe.moe_intermediate_size, moe.shared_expert_intermediate_size
    out: dict[str, tuple[int, ...]] = {
        prefix + "gate.weight": (e, hidden),
        prefix + "shared_expert.gate_proj.weight": (shared, hidden),
        prefix + "shared_expert.up_proj.weight": (shared, hidden),
        prefix + "shared_expert.down_proj.weight": (hidden, shared),
        prefix + "shared_expert_gate.weight": (1, hidden),
    }
    if per_expert:
        for i in range(e):
            out[prefix + f"experts.{i}.gate_proj.weight"] = (inter, hidden)
            out[prefix + f"experts.{i}.up_proj.weight"] = (inter, hidden)
            out[prefix + f"experts.{i}.down_proj.weight"] = (hidden, inter)
    else:
        out[prefix + "experts.gate_up_proj"] = (e, 2 * inter, hidden)
        out[prefix + "experts.down_proj"] = (e, hidden, inter)
    return out


def per_expert_layers(names: Iterable[str]) -> set[int]:
    """Text layers (of our `text/...` names) that store their experts one tensor per expert and no fused
    `experts.gate_up_proj`. A layer holding both keeps the fused layout, so the shape check names the per-expert
    tensors as unexpected."""
    names = list(names)
    fused = {n for n in names if n.endswith(".mlp.experts.gate_up_proj")}
    layers = {int(m.group(1)) for n in names if (m := _PER_EXPERT_NAME.match(n))}
    return {i for i in layers if f"text/layers.{i}.mlp.experts.gate_up_proj" not in fused}


@dataclass(frozen=True)
class Expert:
    """One routed expert's SwiGLU matrices, in the nn.Linear convention ([out, in])."""

    gate: np.ndarray  # [I, H]
    up: np.ndarray  # [I, H]
    down: np.ndarray  # [H, I]


def routed_experts(mlp: Mapping[str, np.ndarray], moe: MoeConfig) -> list[Expert]:
    """Every routed expert of one MLP (`mlp` keyed relative to the layer's `mlp.`), from either layout; the fused
    tensors are sliced, not copied."""
    inter = moe.moe_intermediate_size
    if "experts.gate_up_proj" in mlp:
        gate_up, down = mlp["experts.gate_up_proj"], mlp["experts.down_proj"]
        return [Expert(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(moe.num_experts)]
    return [Expert(mlp[f"experts.{e}.gate_proj.weight"], mlp[f"experts.{e}.up_proj.weight"],
                   mlp[f"experts.{e}.down_proj.weight"]) for e in range(moe.num_experts)]
