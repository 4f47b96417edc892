"""A model folder the engine loads like a real checkpoint, at real size, with random bf16 weights, written fast.

    write_random_model_dir(folder, text_config, vision_config, tied=True)

What goes in: config.json, generation_config.json, the bundled byte-level tokenizer + chat template
(gpu_engine.tiny_assets: ~2.1k ids), the image/video processor configs with the given pixel budgets, and one
model.safetensors in BF16. The embedding keeps the config's vocab_size (e.g. 248320) even though the tokenizer
uses only its first ids: the engine sizes everything by config.json and decodes ids the tokenizer does not know
to nothing, so decode cost (LM head, sampling) is that of the real vocabulary.
Weights: every tensor is written straight from one tiled block of random bf16 bit patterns (values ~N(0, 0.02),
as bench/cuda_bench.random_bf16_weights), with no float32 copy of the model; plain-scale norms (the DeltaNet gated
norm, the vision LayerNorms) are 1, DeltaNet A_log = log U(1, 16) and dt_bias = 1 as in real checkpoints.
No SHA256SUMS unless asked (the loader then hashes the files once, for the fingerprint).
A text_config whose model_type is "qwen3_5_moe_text" (bench/qwen35_shapes.moe_model_shape) makes a qwen3_5_moe
folder (Qwen3_5MoeForConditionalGeneration): router, shared expert and its gate as in the checkpoints, the routed
experts in `expert_layout` "fused" (3-D gate_up_proj / down_proj, the BF16 release) or "per_expert" (one tensor per
expert, as the FP8 releases store them); every count and width from the config (gpu_engine/moe_layout.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.config import ModelConfig
from gpu_engine.cuda.bf16 import f32_to_bf16_bits
from gpu_engine.loader import SINGLE_FILE, checkpoint_name, expected_shapes
from gpu_engine.tiny import safetensors_header, write_json, write_sums
from gpu_engine.tiny_assets import write_processor_configs, write_tokenizer_files

BF16_ONE = 0x3F80
EXPERT_LAYOUTS = ("fused", "per_expert")
_BLOCK_ELEMS = 1_000_003  # odd length: tiled rows of a matrix do not repeat column-aligned


def write_random_model_dir(folder: str | Path, text_config: dict[str, Any], vision_config: dict[str, Any], *,
                           tied: bool, seed: int = 0, image_min_pixels: int = 64 * 32 * 32,
                           image_max_pixels: int = 1024 * 1024, video_min_pixels: int | None = None,
                           video_max_pixels: int | None = None, sums: bool = False, weights: bool = True,
                           expert_layout: str = "fused") -> Path:
    """Write the folder (created if needed) and return it. text_config / vision_config: Qwen3.5 config keys.
    `weights=False`: everything but model.safetensors (for runners given their weights in memory). `expert_layout`:
    how an MoE model's routed experts are stored (EXPERT_LAYOUTS); ignored for a dense model."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer_files(folder)
    text = {"model_type": "qwen3_5_text", "eos_token_id": vocab.eos_token_id, "pad_token_id": vocab.pad_token_id,
            **text_config}
    text.setdefault("vocab_size", vocab.vocab_size)
    if text["vocab_size"] < vocab.vocab_size:
        raise ValueError(f"vocab_size {text['vocab_size']} is smaller than the bundled tokenizer's "
                         f"{vocab.vocab_size} ids")
    vision = {"model_type": "qwen3_5_vision", **vision_config}
    moe = text["model_type"] == "qwen3_5_moe_text"
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5", "dtype": "bfloat16",
        "text_config": text, "vision_config": vision, "tie_word_embeddings": tied,
        "image_token_id": vocab.image_token_id, "video_token_id": vocab.video_token_id,
        "vision_start_token_id": vocab.vision_start_token_id, "vision_end_token_id": vocab.vision_end_token_id,
    }
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", {"eos_token_id": [vocab.eos_token_id, vocab.endoftext_token_id],
                                                    "pad_token_id": vocab.pad_token_id})
    write_processor_configs(folder, patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
                            merge_size=vision["spatial_merge_size"], image_min_pixels=image_min_pixels,
                            image_max_pixels=image_max_pixels, video_min_pixels=video_min_pixels,
                            video_max_pixels=video_max_pixels)
    if not weights:
        return folder
    model_config = ModelConfig.from_pretrained(folder)
    per_expert = range(model_config.text.num_hidden_layers) if expert_layout == "per_expert" else ()
    shapes = {checkpoint_name(ours): shape for ours, shape in expected_shapes(model_config, per_expert).items()}
    write_bf16_safetensors(folder / SINGLE_FILE, shapes, random_bf16_tensors(shapes, seed))
    if sums:
        write_sums(folder)
    return folder


def random_bf16_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """(name, uint16 bf16 bit patterns) in sorted name order, one tensor at a time."""
    rng = np.random.default_rng(seed)
    block = f32_to_bf16_bits(rng.standard_normal(_BLOCK_ELEMS).astype(np.float32) * 0.02)
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("A_log"):
            yield name, f32_to_bf16_bits(np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32))
        elif name.endswith("dt_bias") or _is_plain_scale_norm(name):
            yield name, np.full(shape, BF16_ONE, np.uint16)
        else:
            offset = int(rng.integers(_BLOCK_ELEMS))  # tensors of the same shape differ
            yield name, np.resize(np.roll(block, offset), shape)


def _is_plain_scale_norm(name: str) -> bool:
    """Norm weights used as a plain scale (1 = identity). The decoder's RMSNorms are zero-centred (weight + 1),
    so their random ~0.02 values are already near identity."""
    if name.endswith("linear_attn.norm.weight"):
        return True
    return name.startswith("model.visual.") and name.endswith(("norm1.weight", "norm2.weight", "norm.weight"))


def write_bf16_safetensors(path: Path, shapes: dict[str, tuple[int, ...]],
                           tensors: Iterator[tuple[str, np.ndarray]]) -> None:
    """A safetensors file of BF16 tensors (sorted names), the header written first from the shapes, the data
    streamed after it: at most one tensor is in memory at a time."""
    names = sorted(shapes)
    with open(path, "wb") as f:
        f.write(safetensors_header((n, "BF16", shapes[n], 2 * int(np.prod(shapes[n], dtype=np.int64))) for n in names))
        for expected, (name, data) in zip(names, tensors, strict=True):
            if name != expected or data.dtype != np.uint16 or data.shape != tuple(shapes[name]):
                raise ValueError(f"tensor {name} {data.dtype} {data.shape} does not match {expected} "
                                 f"{shapes[expected]}")
            np.ascontiguousarray(data).tofile(f)
