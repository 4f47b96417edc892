"""Tiny random Qwen3.5 checkpoints built WITH transformers (the external truth) for the engine parity tests.

Weights: transformers' own init is too small (std 0.02, norms at their neutral value) to tell a right forward pass
from a subtly wrong one, so every parameter is replaced with O(1)-activation random values before saving.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Three deliberately different shapes: head counts / GQA ratios, layer patterns, mrope sections, rotary fractions,
# DeltaNet head ratios, tying, attention bias, conv kernels, legacy rope_scaling.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "gqa2-half-rotary": {
        "text_config": {
            "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        },
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
                          "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
                          "num_position_embeddings": 64},
        "tie_word_embeddings": False,
    },
    "mqa-full-rotary-tied": {
        "text_config": {
            "vocab_size": 300, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 4,
            "layer_types": ["full_attention", "linear_attention", "full_attention", "linear_attention"],
            "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 8, "attention_bias": True,
            "linear_conv_kernel_dim": 3, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "linear_num_key_heads": 3, "linear_num_value_heads": 3,
            # legacy key: transformers takes rope_scaling over rope_parameters
            "rope_scaling": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 1.0,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        },
        "vision_config": {"depth": 1, "hidden_size": 24, "intermediate_size": 40, "num_heads": 3, "patch_size": 4,
                          "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 48,
                          "num_position_embeddings": 36},
        "tie_word_embeddings": True,
    },
    "interval2-quarter-rotary": {
        "text_config": {
            "vocab_size": 280, "hidden_size": 96, "intermediate_size": 64, "num_hidden_layers": 5,
            "full_attention_interval": 2,  # no layer_types: transformers derives them
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 24,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
            "linear_num_key_heads": 1, "linear_num_value_heads": 3,
            "partial_rotary_factor": 0.25,  # top of text_config: used because rope_parameters lacks it
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 1],
                                "mrope_interleaved": True},
        },
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4, "patch_size": 8,
                          "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 96,
                          "num_position_embeddings": 49},
        "tie_word_embeddings": False,
    },
}
SPECIAL_IDS = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}


def randomize(model: Any, seed: int) -> None:
    """Give every parameter a random value on its natural scale (deterministic in `seed`)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("A_log"):
                p.copy_(torch.empty(shape).uniform_(0.05, 2.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.3 * torch.randn(shape, generator=gen))
            elif name.endswith("linear_attn.norm.weight") or (".visual." in name and "norm" in name
                                                              and name.endswith("weight")):
                p.copy_(1.0 + 0.2 * torch.randn(shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(0.2 * torch.randn(shape, generator=gen))  # zero-centred RMSNorm offset
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(shape, generator=gen))
            elif "embed_tokens" in name or "pos_embed" in name:
                p.copy_(torch.randn(shape, generator=gen))
            else:
                fan_in = int(np.prod(shape[1:]))
                p.copy_(torch.randn(shape, generator=gen) / fan_in**0.5)


def build_hf_checkpoint(name: str, folder: Path, seed: int = 0) -> Any:
    """Build config `name` with transformers, randomize, save_pretrained into `folder`; returns the float32 model."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5Config(**HF_CONFIGS[name], **SPECIAL_IDS)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model


def build_hf_vlm_checkpoint(name: str, folder: Path, seed: int) -> tuple[Any, Any]:
    """A complete tiny VLM checkpoint in `folder`: config `name` sized to the tiny BPE tokenizer (its special ids),
    tokenizer and processor configs, randomized weights. Returns transformers' float32 model and its PIL image
    processor (the torchvision one is not installed here)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from gpu_engine.tiny_assets import write_processor_configs, write_tokenizer_files

    vocab = write_tokenizer_files(folder)
    spec = copy.deepcopy(HF_CONFIGS[name])
    spec["text_config"]["vocab_size"] = vocab.vocab_size
    vision = spec["vision_config"]
    write_processor_configs(folder, patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
                            merge_size=vision["spatial_merge_size"])
    config = Qwen3_5Config(**spec, image_token_id=vocab.image_token_id, video_token_id=vocab.video_token_id,
                           vision_start_token_id=vocab.vision_start_token_id,
                           vision_end_token_id=vocab.vision_end_token_id)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model, Qwen2VLImageProcessorPil.from_pretrained(folder)


def hf_vlm_inputs(image_processor: Any, prompt: Any, config: Any, images: Any = ()) -> dict[str, Any]:
    """transformers' model inputs (CPU tensors) for `prompt`, a prompt our processor prepared (`config`: ours).

    Token ids are ours (chat template + placeholder expansion: the processor's own tests compare those). Images:
    pixel values of transformers' own image processor, whose grids must equal ours. Videos: our frame patches,
    because transformers' video processor needs torchvision (they equal its output within 1e-6:
    test_engine_processor); the callers pass one video per conversation, so its frame groups in order are it."""
    import torch

    ids = torch.from_numpy(prompt.token_ids)[None]
    kinds = torch.zeros_like(ids)
    kinds[ids == config.image_token_id] = 1
    kinds[ids == config.video_token_id] = 2
    inputs = {"input_ids": ids, "mm_token_type_ids": kinds}
    if images:
        processed = image_processor(images=list(images), return_tensors="pt")
        ours_grids = [item.grid_thw for item in prompt.vision_items if item.kind == "image"]
        assert processed["image_grid_thw"].tolist() == [list(g) for g in ours_grids]
        inputs.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    video_items = [item for item in prompt.vision_items if item.kind == "video"]
    if video_items:
        _, h, w = video_items[0].grid_thw
        pixels = np.concatenate([item.pixel_values for item in video_items])
        inputs.update(pixel_values_videos=torch.from_numpy(pixels),
                      video_grid_thw=torch.tensor([[len(video_items), h, w]]))
    return inputs


def random_frames(rng: np.random.Generator, count: int, height: int, width: int) -> list[np.ndarray]:
    """A drifting random picture: consecutive frames differ but are related, like video frames."""
    base = rng.integers(0, 256, (height, width, 3)).astype(np.int16)
    return [np.clip(base + 8 * i + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8) for i in range(count)]


def random_image(rng: np.random.Generator, height: int, width: int) -> Any:
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def check_vlm_parity(pair: tuple[Any, Any, Any], hf64: Any, messages: list[dict[str, Any]], images: Any = (),
                     chunk_sizes: tuple[int, ...] = (7,)) -> Any:
    """Our logits for `messages` vs transformers' (float32, with its float64 run for the per-position rule), and
    chunked prefill at each of `chunk_sizes` within 1e-5 of the whole prefill; returns our ProcessedPrompt.
    `pair`: (transformers model, its image processor, our loaded model)."""
    import torch

    hf, image_processor, ours = pair
    prompt = ours.prepare(messages)
    kwargs = hf_vlm_inputs(image_processor, prompt, ours.config, images)
    with torch.no_grad():
        expected = hf(**kwargs).logits[0].numpy()
    got = ours.logits_for_messages(messages)
    assert got.shape == expected.shape
    assert_logit_parity(got, expected, float64_logits(hf64, **kwargs))
    for size in chunk_sizes:
        assert rel_err(ours.logits_for_messages(messages, chunk_size=size), got) <= 1e-5
    return prompt


def check_vlm_greedy_tokens(pair: tuple[Any, Any, Any], messages: list[dict[str, Any]], images: Any = (),
                            chunk_size: int = 9) -> None:
    """24 greedy tokens of ours for `messages`, whole and with prefill chunks of `chunk_size`, equal transformers'
    greedy generation from the same prompt. `pair`: (transformers model, its image processor, our loaded model)."""
    import torch

    hf, image_processor, ours = pair
    prompt = ours.prepare(messages)
    kwargs = hf_vlm_inputs(image_processor, prompt, ours.config, images)
    with torch.no_grad():
        out = hf.generate(**kwargs, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    assert len(expected) == 24
    assert ours.generate(messages, max_tokens=24, stop_token_ids=[]) == expected
    assert ours.generate(messages, max_tokens=24, stop_token_ids=[], chunk_size=chunk_size) == expected


# ------------------------------------------------------------------------------ a float64 transformers run


@contextlib.contextmanager
def float64_stays_float64() -> Iterator[None]:
    """While active, every cast to float32 (Tensor.to / Tensor.float / softmax's dtype) gives float64 instead.

    Qwen3.5's modeling code casts to float32 on purpose in its norms, DeltaNet kernels, rotary tables and softmax
    (it is written for bf16/fp16 weights). After `model.double()` those casts would silently run parts of the
    "float64" reference in float32 (or fail on mixed dtypes); only for that run, float32 means float64.
    """
    import torch

    tensor_to, tensor_float, softmax = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax

    def to(self, *args, **kwargs):
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return tensor_to(self, *args, **kwargs)

    def to_float(self, memory_format=torch.preserve_format):
        return tensor_to(self, torch.float64, memory_format=memory_format)

    def softmax64(input, *args, **kwargs):
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return softmax(input, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = to, to_float, softmax64
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = tensor_to, tensor_float, softmax


def float64_copy(model: Any) -> Any:
    """A float64 copy of a (tiny) transformers model, for float64_logits."""
    return copy.deepcopy(model).double().eval()


def float64_logits(model64: Any, **inputs: Any) -> np.ndarray:
    """Logits [T, vocab] (float64) of a float64_copy on float64 inputs (integer inputs as they are)."""
    import torch

    cast = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad(), float64_stays_float64():
        logits = model64(**cast).logits[0]
    assert logits.dtype == torch.float64
    return logits.numpy()


# ------------------------------------------------------------------------------- the logit parity criterion

LOGIT_TOL = 1e-4  # relative L2 error vs transformers float32: over all positions, and per position (below)
F32_NOISE_FACTOR = 2.0  # per position, second branch: ours' distance from float64 vs transformers-float32's ...
F64_SLACK = 1e-5  # ... plus this


@dataclass(frozen=True)
class LogitParity:
    """Per-position relative L2 errors (each [T]) between ours, transformers float32 and transformers float64."""

    whole: float  # rel-L2(ours, hf_f32) over all positions together
    ours_vs_f32: np.ndarray
    ours_vs_f64: np.ndarray
    f32_vs_f64: np.ndarray

    @property
    def accepted(self) -> np.ndarray:
        """Per position: within LOGIT_TOL of transformers-float32, or — where float32 itself is that inexact —
        no farther from the float64 run than transformers-float32's own float32 error allows.

        Why a factor and not "at least as close": at the rare ill-conditioned positions (a tiny-model DeltaNet
        head whose output nearly cancels before its RMSNorm) every float32 evaluation is one random draw of
        rounding noise of the same size. Measured at such a position: transformers-float32 is 4.5e-5..5.7e-5
        from float64 over its DeltaNet chunk sizes 8..128, ours 5.6e-6..7.1e-5 over our prefill chunkings (1
        ... whole), i.e. the same noise; a real error is orders of magnitude larger than both.
        """
        noise_bound = F32_NOISE_FACTOR * self.f32_vs_f64 + F64_SLACK
        return (self.ours_vs_f32 <= LOGIT_TOL) | (self.ours_vs_f64 <= noise_bound)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Relative L2 error of `a` against `b` over all elements, in float64."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a64 - b64) / np.linalg.norm(b64))


def _rows_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a64 - b64, axis=-1) / np.linalg.norm(b64, axis=-1)


def logit_parity(ours: np.ndarray, hf_f32: np.ndarray, hf_f64: np.ndarray) -> LogitParity:
    assert ours.shape == hf_f32.shape == hf_f64.shape, (ours.shape, hf_f32.shape, hf_f64.shape)
    return LogitParity(rel_err(ours, hf_f32), _rows_rel(ours, hf_f32), _rows_rel(ours, hf_f64),
                       _rows_rel(hf_f32, hf_f64))


def assert_logit_parity(ours: np.ndarray, hf_f32: np.ndarray, hf_f64: np.ndarray) -> LogitParity:
    """The issue's acceptance: whole-sequence rel-L2 <= 1e-4, and at EVERY position rel-L2 <= 1e-4 unless the
    residual is float32 rounding of the size transformers-float32 itself shows against its float64 run there."""
    parity = logit_parity(ours, hf_f32, hf_f64)
    assert parity.whole <= LOGIT_TOL, f"whole-sequence rel-L2 {parity.whole:.3g} > {LOGIT_TOL}"
    bad = np.flatnonzero(~parity.accepted)
    assert bad.size == 0, "positions failing parity (pos: ours-f32, ours-f64, f32-f64): " + ", ".join(
        f"{p}: {parity.ours_vs_f32[p]:.3g}, {parity.ours_vs_f64[p]:.3g}, {parity.f32_vs_f64[p]:.3g}" for p in bad[:8]
    )
    return parity
