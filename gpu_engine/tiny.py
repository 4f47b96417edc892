"""Tiny Qwen3.5 checkpoints without torch: a complete HF-format folder with deterministic random weights.

The folder has config.json, generation_config.json, model.safetensors (or shards + index), tokenizer.json,
tokenizer_config.json, chat_template.jinja, preprocessor_config.json, video_preprocessor_config.json and a
SHA256SUMS over all of them. transformers' Qwen3_5ForConditionalGeneration loads it as is, so the same folder
serves our tests, the demo and benchmarks. Same arguments -> byte-identical files.
"""
from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .loader import INDEX_FILE, SINGLE_FILE, SUMS_FILE, checkpoint_name, expected_shapes, sha256_file
from .mtp_layout import mtp_shapes
from .tiny_assets import write_processor_configs, write_tokenizer_files

# Qwen3.5-like proportions at toy size: 3 DeltaNet layers then 1 gated full-attention layer, GQA 4:2,
# partial rotary 0.25 of head_dim 32 -> 8 rotary dims = 4 frequencies split (t, h, w) = (2, 1, 1).
TINY_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "max_position_embeddings": 32768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": False,
}
# Real patch geometry (16 px patches, 2 frames, 2x2 merge) so the real processor rules apply; tiny widths.
TINY_VISION: dict[str, Any] = {
    "model_type": "qwen3_5_vision",
    "depth": 2,
    "hidden_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
}


def make_tiny_checkpoint(
    folder: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
    text_config: dict[str, Any] | None = None,
    vision_config: dict[str, Any] | None = None,
    mtp: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny checkpoint into `folder` (created if needed) and return it.

    dtype: "float32" or "bfloat16" for the stored weights. shards > 1 writes an index + that many files.
    text_config / vision_config: keys merged over TINY_TEXT / TINY_VISION; other keyword arguments override
    top-level config.json keys (e.g. tie_word_embeddings=True). mtp: add a random MTP head (`mtp.*`, the 15 tensors
    of the published dense checkpoints; transformers ignores them).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    vocab = write_tokenizer_files(folder)
    text = {**copy.deepcopy(TINY_TEXT), "vocab_size": vocab.vocab_size, "eos_token_id": vocab.eos_token_id,
            "pad_token_id": vocab.pad_token_id, **(text_config or {})}
    vision = {**copy.deepcopy(TINY_VISION), **(vision_config or {})}
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": dtype,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": vocab.image_token_id,
        "video_token_id": vocab.video_token_id,
        "vision_start_token_id": vocab.vision_start_token_id,
        "vision_end_token_id": vocab.vision_end_token_id,
        "tie_word_embeddings": False,
        **overrides,
    }
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", {
        "eos_token_id": [vocab.eos_token_id, vocab.endoftext_token_id],
        "pad_token_id": vocab.pad_token_id,
    })
    write_processor_configs(
        folder,
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
    )

    model_config = ModelConfig.from_pretrained(folder)
    tensors = random_weights(model_config, seed=seed)
    if mtp and model_config.text.moe is None:  # gpu_engine/tiny_moe.py writes a MoE head itself
        rng = np.random.default_rng([seed, 1])  # its own stream: the trunk's weights do not change with mtp=True
        tensors.update({"mtp." + n: _init(n, shape, rng) for n, shape in sorted(mtp_shapes(model_config.text).items())})
    _write_weights(folder, tensors, dtype=dtype, shards=shards)
    write_sums(folder)
    return folder


def random_weights(config: ModelConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights under their checkpoint names, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for ours, shape in sorted(expected_shapes(config).items()):
        out[checkpoint_name(ours)] = _init(ours.split("/", 1)[1], shape, rng)
    return out


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.05, 2.0, size=shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain scale around 1
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "norm" in name and leaf == "weight":
        if name.startswith(("blocks.", "merger.")):  # vision LayerNorm: scale around 1
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)  # zero-centred RMSNorm: offset from 1
    if leaf == "bias":
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if name == "embed_tokens.weight" or name == "pos_embed.weight":
        return rng.standard_normal(shape).astype(np.float32)
    fan_in = int(np.prod(shape[1:]))
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def safetensors_header(tensors: Iterable[tuple[str, str, Sequence[int], int]]) -> bytes:
    """The 8-byte length and the JSON header (padded to 8 bytes) of a safetensors file whose tensors, given as
    (name, dtype tag such as "F32" or "BF16", shape, byte size), follow it in this order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tag, shape, nbytes in tensors:
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], *, dtype: str = "float32") -> None:
    """Write a safetensors file (sorted names, 8-byte-aligned header) in float32 or bfloat16."""
    names = sorted(tensors)
    blobs = [(_to_bf16_bits(tensors[n]) if dtype == "bfloat16" else np.ascontiguousarray(tensors[n], dtype="<f4"))
             .tobytes() for n in names]
    tag = "BF16" if dtype == "bfloat16" else "F32"
    with open(path, "wb") as f:
        f.write(safetensors_header((n, tag, tensors[n].shape, len(b)) for n, b in zip(names, blobs)))
        for blob in blobs:
            f.write(blob)


def _write_weights(folder: Path, tensors: dict[str, np.ndarray], *, dtype: str, shards: int) -> None:
    if shards == 1:
        write_safetensors(folder / SINGLE_FILE, tensors, dtype=dtype)
        return
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        write_safetensors(folder / file, part, dtype=dtype)
        weight_map.update({n: file for n in part})
    total = sum(int(a.size) * (2 if dtype == "bfloat16" else 4) for a in tensors.values())
    write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_sums(folder: Path) -> None:
    """SHA256SUMS (`<hex>  <name>`, sha256sum format) over every other file of the folder."""
    lines = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != SUMS_FILE):
        lines.append(f"{sha256_file(path)}  {path.name}\n")
    (folder / SUMS_FILE).write_text("".join(lines))


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
