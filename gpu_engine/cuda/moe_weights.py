"""Upload one qwen3_5_moe layer's MLP for the CUDA runner (weights.py calls `upload_moe_mlp` for every layer of an
MoE model): the routed experts stacked as [E, 2I, H] (gate rows, then up rows) and [E, H, I] from either checkpoint
layout (gpu_engine/moe_layout.py: the fused tensors as they are, one tensor per expert stacked on the host), the
router and shared_expert_gate as one [E + 1, H] matrix (one GEMM gives both logits). The shared expert joins the
stacks as expert E when its width equals the experts' (35B-A3B; moe.py runs it in the grouped GEMMs), else it is
a pair of linear layers (BF16 or block-FP8, like any projection: an FP8 shared expert beside BF16 experts, as
quantize='fp8' makes of a fused checkpoint, stays apart). Routed experts in FP8 are refused by name: the grouped GEMM
reads bf16 / f32 stacks only (an FP8 expert stack is the next format behind the same call).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import MoeConfig
from .errors import CudaBackendError
from .linear import SwigluMlp
from .moe import MoeLayer

if TYPE_CHECKING:
    from .weights import _Uploader


def refuse_fp8_experts(fp8_names: list[str]) -> None:
    """Routed experts stored (or quantised at load) in FP8 cannot run on the CUDA runner yet."""
    found = [n for n in fp8_names if ".mlp.experts." in n]
    if found:
        raise CudaBackendError(f"the CUDA runner has no FP8 path for routed experts yet: {', '.join(found[:3])} "
                               f"({len(found)} tensors). Load the BF16 release, or use runner='reference'")


def _shared_names(prefix: str) -> tuple[str, str, str]:
    return (prefix + "shared_expert.gate_proj.weight", prefix + "shared_expert.up_proj.weight",
            prefix + "shared_expert.down_proj.weight")


def stacks_shared(moe: MoeConfig, w: Mapping[str, np.ndarray], prefix: str) -> bool:
    """Whether the shared expert is stacked as expert E: its width equals the routed experts' and its weights are
    in the stacks' format (`w` holds the non-FP8 tensors the uploader reads)."""
    return (moe.shared_expert_intermediate_size == moe.moe_intermediate_size
            and all(n in w for n in _shared_names(prefix)))


def stacked_experts(w: Mapping[str, np.ndarray], prefix: str, moe: MoeConfig) -> tuple[np.ndarray, np.ndarray]:
    """([stacks, 2I, H], [stacks, H, I]) of the layer at `prefix` (".. .mlp."), in the arrays' own dtype (uint16
    bf16 bits or float32); the shared expert last when stacks_shared. The fused layout alone is returned as stored
    (no copy)."""
    shared = stacks_shared(moe, w, prefix)
    names = [(f"{prefix}experts.{i}.gate_proj.weight", f"{prefix}experts.{i}.up_proj.weight",
              f"{prefix}experts.{i}.down_proj.weight") for i in range(moe.num_experts)]
    tail = [_shared_names(prefix)] if shared else []
    if prefix + "experts.gate_up_proj" in w:
        gate_up, down = w[prefix + "experts.gate_up_proj"], w[prefix + "experts.down_proj"]
        if not shared:
            return gate_up, down
        g, u, d = tail[0]
        return (np.concatenate([gate_up, np.concatenate([w[g], w[u]])[None]]), np.concatenate([down, w[d][None]]))
    gate_up = np.stack([np.concatenate([w[g], w[u]], axis=0) for g, u, _ in names + tail])
    down = np.stack([w[d] for _, _, d in names + tail])
    return gate_up, down


def upload_moe_mlp(up: _Uploader, moe: MoeConfig, w: Mapping[str, np.ndarray], prefix: str) -> MoeLayer:
    """The MoeLayer of the layer whose MLP tensors are named `prefix` + ... (e.g. "layers.3.mlp.")."""
    gate_up, down = stacked_experts(w, prefix, moe)
    return MoeLayer(
        num_experts=moe.num_experts,
        top_k=moe.num_experts_per_tok,
        router=up.put(prefix + "router", w[prefix + "gate.weight"], w[prefix + "shared_expert_gate.weight"]),
        gate_up=up.put(prefix + "experts.gate_up", gate_up),
        down=up.put(prefix + "experts.down", down),
        shared=None if stacks_shared(moe, w, prefix) else SwigluMlp(
            up.linear(prefix + "shared_expert.gate_up", prefix + "shared_expert.gate_proj.weight",
                      prefix + "shared_expert.up_proj.weight"),
            up.linear(prefix + "shared_expert.down", prefix + "shared_expert.down_proj.weight")),
    )


def set_moe_decode(layers: list[Any], decode: str) -> None:
    """Give every MoE layer of `layers` (TextWeights.layers, replaced in place) the decode path `decode`
    (CudaOptions.moe_decode); MoeLayer refuses "fused" for a layer its kernels cannot take, naming why."""
    for i, layer in enumerate(layers):
        if isinstance(layer.mlp, MoeLayer) and layer.mlp.decode != decode:
            layers[i] = replace(layer, mlp=replace(layer.mlp, decode=decode))
