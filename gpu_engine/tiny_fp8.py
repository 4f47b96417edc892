"""Tiny checkpoints in the official block-FP8 layout (Qwen's *-FP8 releases), for tests and GPU checks.

`make_tiny_fp8_checkpoint` writes the BF16 tiny checkpoint of the same arguments (gpu_engine/tiny.py), then
rewrites its weights: every Linear that QUANTIZE_SKIP does not exclude is stored as F8_E4M3 with a
`weight_scale_inv` (BF16 by default, as published; F32 on request), everything else stays BF16, and config.json
gains `quantization_config` whose `modules_to_not_convert` names each kept Linear module (and the embedding), the
way the official files spell them out. The FP8 values are quantised from the BF16 weights with gpu_engine/fp8.py;
with BF16 scales the stored scale is the float32 one rounded to bf16 (what a converter that quantises in float32 and
saves the scales in the model dtype writes).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import fp8
from .fp8_checkpoint import QUANTIZE_SKIP, SCALE_SUFFIX, is_linear_weight, module_name, skipped
from .loader import SINGLE_FILE
from .tensors import read_safetensors
from .tiny import _to_bf16_bits as f32_to_bf16_bits
from .tiny import make_tiny_checkpoint, safetensors_header, write_json, write_sums

SCALE_DTYPES = ("BF16", "F32")


def make_tiny_fp8_checkpoint(folder: str | Path, *, seed: int = 0, scale_dtype: str = "BF16",
                             base: Callable[..., Path] = make_tiny_checkpoint, **tiny_args: Any) -> Path:
    """Write a tiny FP8 checkpoint into `folder`; `tiny_args` go to `base`, the BF16 writer (make_tiny_checkpoint,
    or tiny_moe.make_tiny_moe_checkpoint with layout="per_expert" for the MoE releases), not dtype / shards."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    folder = Path(folder)
    base(folder, seed=seed, dtype="bfloat16", **tiny_args)
    path = folder / SINGLE_FILE
    stored = {name: np.array(t.to_float32()) for name, t in read_safetensors(path).items()}
    out: dict[str, tuple[str, np.ndarray]] = {}
    kept: set[str] = {"model.language_model.embed_tokens"}
    for name, value in stored.items():
        if not is_linear_weight(name, value.shape):
            out[name] = ("BF16", f32_to_bf16_bits(value))
        elif skipped(module_name(name), QUANTIZE_SKIP):
            out[name] = ("BF16", f32_to_bf16_bits(value))
            kept.add(module_name(name))
        else:
            bits, scale_inv = fp8.quantize(value)
            out[name] = ("F8_E4M3", bits)
            out[name + SCALE_SUFFIX] = ("BF16", f32_to_bf16_bits(scale_inv)) if scale_dtype == "BF16" else (
                "F32", scale_inv)
    write_tagged_safetensors(path, out)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": sorted(kept),
    }
    write_json(folder / "config.json", config)
    write_sums(folder)
    return folder


def write_tagged_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file from (dtype tag, array holding that dtype's bytes) per name, names sorted."""
    names = sorted(tensors)
    blobs = [np.ascontiguousarray(tensors[n][1]).tobytes() for n in names]
    with open(path, "wb") as f:
        f.write(safetensors_header((n, tensors[n][0], tensors[n][1].shape, len(b)) for n, b in zip(names, blobs)))
        for blob in blobs:
            f.write(blob)
