"""Where the checkpoint's multi-token-prediction head (Qwen3.5 `mtp.*`) sits: its names and shapes, and the checks
the loader runs on the tensors a checkpoint holds under `mtp.` (names here are relative to `mtp.`).

The head is `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm` and one full-attention decoder layer
`layers.0.*` (gated q_proj, q/k norms) whose MLP is the trunk's kind: a dense SwiGLU
(`layers.0.mlp.{gate,up,down}_proj`) for qwen3_5, a mixture of experts for qwen3_5_moe (gpu_engine/moe_layout.py,
under `layers.0.mlp.`). The published MoE checkpoints store the MTP layer's experts one tensor per expert
(`layers.0.mlp.experts.{e}.gate_proj.weight`, as vLLM's Qwen3.5 MTP loader maps them); the fused layout is read
too, as vLLM does.

The head is optional (a checkpoint without `mtp.*` has no MTP drafter), but what a checkpoint holds there must be
right: a tensor of another name or shape, or a MoE MLP with some of its tensors (say, experts) but not all, is a
CheckpointError naming it.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from .config import TextConfig
from .moe_layout import moe_shapes

MLP = "layers.0.mlp."
_FUSED_MARK = MLP + "experts.gate_up_proj"


def mtp_shapes(cfg: TextConfig, *, per_expert: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of the head (names relative to `mtp.`) and its shape; a MoE head's experts in the per-expert
    layout unless `per_expert=False`. A dense head has 15 tensors."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, 2 * h), "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,),
        "norm.weight": (h,), "layers.0.input_layernorm.weight": (h,), "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (2 * q, h), "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.self_attn.q_norm.weight": (cfg.head_dim,), "layers.0.self_attn.k_norm.weight": (cfg.head_dim,),
    }
    if cfg.moe is not None:
        shapes.update(moe_shapes(MLP, cfg.moe, h, per_expert=per_expert))
    else:
        i = cfg.intermediate_size
        shapes.update({MLP + "gate_proj.weight": (i, h), MLP + "up_proj.weight": (i, h),
                       MLP + "down_proj.weight": (h, i)})
    return shapes


def held_layout_shapes(cfg: TextConfig, names: Collection[str]) -> dict[str, tuple[int, ...]]:
    """mtp_shapes for the expert layout `names` (a checkpoint's `mtp.` tensors) hold: fused when it has
    `layers.0.mlp.experts.gate_up_proj`, else one tensor per expert."""
    return mtp_shapes(cfg, per_expert=_FUSED_MARK not in names)


def mtp_problems(cfg: TextConfig, held: Mapping[str, tuple[int, ...]]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, misshaped) among the `mtp.` tensors a checkpoint holds (`held`: relative name ->
    shape), full `mtp.` names. Missing is reported only for a MoE layer's MLP that is partly there (router, shared
    expert, every routed expert); elsewhere an incomplete head loads, and the runner drafts only with a complete one."""
    want = held_layout_shapes(cfg, held)
    unexpected = [f"mtp.{n}" for n in held if n not in want]
    misshaped = [f"mtp.{n}: {held[n]} (expected {want[n]})" for n in want if n in held and held[n] != want[n]]
    moe_mlp = [n for n in want if n.startswith(MLP)] if cfg.moe is not None else []
    missing: list[str] = []
    if any(n in held for n in moe_mlp):
        missing = [f"mtp.{n}" for n in moe_mlp if n not in held]
    return missing, unexpected, misshaped
