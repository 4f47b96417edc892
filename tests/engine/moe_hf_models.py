"""Tiny random Qwen3.5-MoE checkpoints built WITH transformers (the external truth) for the MoE parity tests.

The trunks are engine_hf_models' three dense shapes (head counts, layer patterns, rotary fractions, tying, attention
bias, conv kernels, legacy rope_scaling); each gets its own mixture of experts with odd widths: top-2 of 6, top-3 of
5 with a shared expert narrower than the routed ones, top-1 of 7 (the one weight is exactly 1 after renormalising).
transformers runs its experts with the "eager" implementation: the plain per-expert loop of modeling_qwen3_5_moe
(its grouped_mm path needs 16-byte-aligned strides, which these odd widths do not have, and is a kernel choice, not
the model's definition).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from engine_hf_models import HF_CONFIGS, randomize

_MOE: dict[str, tuple[str, dict[str, int]]] = {
    "e6-top2-gqa2": ("gqa2-half-rotary", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 21,
                                          "shared_expert_intermediate_size": 37}),
    "e5-top3-mqa-tied": ("mqa-full-rotary-tied", {"num_experts": 5, "num_experts_per_tok": 3,
                                                  "moe_intermediate_size": 19, "shared_expert_intermediate_size": 7}),
    "e7-top1-interval2": ("interval2-quarter-rotary", {"num_experts": 7, "num_experts_per_tok": 1,
                                                       "moe_intermediate_size": 13,
                                                       "shared_expert_intermediate_size": 29}),
}
MOE_HF_CONFIGS: dict[str, dict[str, Any]] = {}
for _name, (_trunk, _experts) in _MOE.items():
    _spec = copy.deepcopy(HF_CONFIGS[_trunk])
    del _spec["text_config"]["intermediate_size"]
    _spec["text_config"].update(_experts)
    MOE_HF_CONFIGS[_name] = _spec
SPECIAL_IDS = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}


def randomize_moe(model: Any, seed: int) -> None:
    """engine_hf_models.randomize, then the fused 3-D expert tensors scaled by each expert's own fan-in (the last
    axis; randomize would divide by the whole [2I, H] slab and leave the experts' contribution negligible)."""
    import torch

    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _build(spec: dict[str, Any], ids: dict[str, int], folder: Path, seed: int, fused: Path | None) -> Any:
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5MoeConfig(**spec, **ids, experts_implementation="eager")
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    randomize_moe(model, seed)
    model.save_pretrained(folder)  # transformers 5.17 writes the experts one tensor per expert (qwen2_moe names)
    if fused is not None:
        model.save_pretrained(fused, save_original_format=False)  # its own fused 3-D parameters
    return model


def build_hf_moe_checkpoint(name: str, folder: Path, seed: int = 0, *, fused: Path | None = None) -> Any:
    """Build config `name` with transformers, randomize, save_pretrained into `folder` (experts one tensor per
    expert) and, when given, into `fused` with the fused expert tensors; returns the float32 model."""
    return _build(copy.deepcopy(MOE_HF_CONFIGS[name]), SPECIAL_IDS, folder, seed, fused)


def build_hf_moe_vlm_checkpoint(name: str, folder: Path, seed: int) -> tuple[Any, Any]:
    """A complete tiny MoE VLM checkpoint (tokenizer, processor configs, config `name` sized to the tiny BPE
    vocabulary) in `folder`; returns transformers' float32 model and its PIL image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from gpu_engine.tiny_assets import write_processor_configs, write_tokenizer_files

    vocab = write_tokenizer_files(folder)
    spec = copy.deepcopy(MOE_HF_CONFIGS[name])
    spec["text_config"]["vocab_size"] = vocab.vocab_size
    vision = spec["vision_config"]
    write_processor_configs(folder, patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
                            merge_size=vision["spatial_merge_size"])
    ids = {"image_token_id": vocab.image_token_id, "video_token_id": vocab.video_token_id,
           "vision_start_token_id": vocab.vision_start_token_id, "vision_end_token_id": vocab.vision_end_token_id}
    model = _build(spec, ids, folder, seed, None)
    return model, Qwen2VLImageProcessorPil.from_pretrained(folder)
