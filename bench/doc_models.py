"""The model a bench/doc_throughput.py shape names: its random folder, the engine built on it, its limit-model cost.

Shapes: "tiny" (gpu_engine.tiny's config) and "tiny-moe" (gpu_engine.tiny_moe's: 6 experts, top-2), both with a
3,000-id vocabulary for the CPU; the dense classes of bench/qwen35_shapes.py (SHAPE_NAMES) and its MoE classes
(MOE_SHAPE_NAMES: 35b-a3b). An MoE folder stores its routed experts in --expert-layout (fused, as the BF16 release,
or one tensor per expert, as the FP8 releases; bench/random_model_dir.py).

MoE on runner='cuda' (BF16; gpu_engine.load takes it since tests/cuda_runner/check_moe.py passed on the GPU, session
7): the runner is built from random bf16 weights in memory, as for the dense shapes, its routed experts as the fused
[E, 2I, H] / [E, H, I] stacks cuda/moe_weights.py uploads. Refused for MoE on cuda: --quantize fp8 (the CUDA runner
has no FP8 routed experts) and --load-weights (writing and reading ~70 GB of 35B-A3B weights costs minutes of lease
time and measures the loader, not the serving).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from limit_model import ModelCost
from qwen35_shapes import MOE_SHAPE_NAMES, SHAPE_NAMES

QWEN_IMAGE_MAX_PIXELS = 16_777_216  # Qwen3-VL preprocessor_config.json "size" longest_edge / shortest_edge
QWEN_IMAGE_MIN_PIXELS = 65_536
QWEN_VIDEO_MAX_PIXELS = 25_165_824
QWEN_VIDEO_MIN_PIXELS = 4_096
TINY_SHAPES = ("tiny", "tiny-moe")
SHAPES = (*TINY_SHAPES, *SHAPE_NAMES, *MOE_SHAPE_NAMES)


def is_moe(shape: str) -> bool:
    return shape == "tiny-moe" or shape in MOE_SHAPE_NAMES


def check_shapes(args: argparse.Namespace) -> None:
    """Refuse, before any device time, a shape this run cannot build (module docstring)."""
    for shape in args.shapes:
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        if not is_moe(shape) or args.runner != "cuda":
            continue
        if args.load_weights:
            raise SystemExit(f"--load-weights with MoE shape {shape!r} on cuda: the bench builds MoE weights in "
                             "memory (writing and loading ~70 GB would time the loader); drop it")
        if args.quantize != "none":
            raise SystemExit(f"--quantize {args.quantize} with MoE shape {shape!r} on cuda: the CUDA runner has no "
                             "FP8 routed experts")


def row_labels(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a row of this shape must say about how it was built."""
    if not is_moe(shape):
        return {}
    labels: dict[str, Any] = {"limit_basis": "bf16 active parameters (k routed experts + shared + dense) per token; "
                                             "decode bytes: dense + E(1-(1-k/E)^B) experts per layer, uniform routing"}
    if args.runner == "cuda":
        labels["expert_layout"] = "fused, in memory"
    else:
        labels["expert_layout"] = args.expert_layout
    return labels


def write_model(shape: str, folder: Path, seed: int, image_max_pixels: int, *, weights: bool = True,
                expert_layout: str = "fused") -> Path:
    """The model folder; `weights=False` writes only its small files (config, tokenizer, processor)."""
    from random_model_dir import write_random_model_dir

    if shape in TINY_SHAPES:
        from gpu_engine.tiny import TINY_TEXT, TINY_VISION
        from gpu_engine.tiny_moe import TINY_MOE_TEXT

        text = TINY_MOE_TEXT if shape == "tiny-moe" else TINY_TEXT
        return write_random_model_dir(folder, {**text, "vocab_size": 3000}, TINY_VISION, tied=shape == "tiny",
                                      seed=seed, image_min_pixels=4 * 32 * 32, image_max_pixels=image_max_pixels,
                                      video_max_pixels=image_max_pixels, weights=weights, expert_layout=expert_layout)
    from qwen35_shapes import model_shape, moe_model_shape

    text, vision, tied = (moe_model_shape if is_moe(shape) else model_shape)(shape)
    return write_random_model_dir(folder, text, vision, tied=tied, seed=seed,
                                  image_min_pixels=QWEN_IMAGE_MIN_PIXELS, image_max_pixels=image_max_pixels,
                                  video_min_pixels=QWEN_VIDEO_MIN_PIXELS, video_max_pixels=QWEN_VIDEO_MAX_PIXELS,
                                  weights=weights, expert_layout=expert_layout)


def build_engine(folder: Path, runner: str, args: argparse.Namespace) -> Any:
    """The engine behind pipeline.engine_client.EngineClient, with this run's sizes. The cuda runner gets its
    random bf16 weights from memory (see in_memory_engine) unless --load-weights asks for the folder's."""
    from gpu_engine import Engine, EngineConfig

    # 0 GiB leaves a budget to the engine's defaults (cache_sizing.cache_budget, encoder_cache.default_encoder_budget)
    kv = int(args.kv_cache_gib * (1 << 30)) or None
    enc = int(args.encoder_cache_gib * (1 << 30)) or None
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                          kv_cache_bytes=kv, encoder_cache_bytes=enc, min_prefill_tokens=args.min_prefill_tokens,
                          max_prefill_hold_steps=args.max_prefill_hold_steps,
                          enable_jump_forward=not args.no_jump_forward,
                          lookahead=not getattr(args, "no_lookahead", False))
    quantize = None if args.quantize == "none" else args.quantize
    if runner != "cuda":
        return Engine.from_pretrained(folder, runner=runner, config=config, quantize=quantize)
    from gpu_engine.cuda.options import CudaOptions

    options = CudaOptions.from_env(**({"encoder_memory": enc} if enc else {}))
    if args.load_weights:
        return Engine.from_pretrained(folder, runner=runner, config=config, cuda_options=options, quantize=quantize)
    return in_memory_engine(folder, config, options, args.seed, quantize)


def in_memory_engine(folder: Path, config: Any, options: Any, seed: int, quantize: str | None = None) -> Any:
    """Engine.from_pretrained's engine, with the runner built from random bf16 weights made in memory on all
    cores (bench/cuda_bench.random_bf16_weights, plus the tower's) instead of read from the folder: the loader
    turns every tensor into float32 on the host (9B: 36 GB, 27B: 108 GB, more than the GPU machine's 128 GB
    with the checkpoint beside it) and hashes the files, which costs minutes of lease time and measures the
    loader, not the serving. The folder still supplies config.json, the tokenizer and the processor.
    quantize="fp8": the Linears quantize="fp8" converts are random FP8 instead (bench/fp8_model_bench.py).
    An MoE model's experts come fused, the stacks cuda/moe_weights.py uploads."""
    from cuda_bench import random_bf16_weights
    from fp8_model_bench import random_fp8_weights

    from gpu_engine import Engine
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda import runner as cuda_runner
    from gpu_engine.model import LoadedModel
    from gpu_engine.tokenizer import Tokenizer

    model = ModelConfig.from_pretrained(folder)
    rng = np.random.default_rng(seed)
    weights = (random_fp8_weights if quantize == "fp8" else random_bf16_weights)(model, rng)
    weights.vision.update(random_vision_weights(model, rng))
    runner = cuda_runner.CudaRunner(model, weights, options)
    del weights
    loaded = LoadedModel(config=model, fingerprint=f"random-{quantize or 'bf16'}-in-memory", path=folder,
                         runner=runner)
    tokenizer = Tokenizer.from_pretrained(folder)
    loaded.use_tokenizer(tokenizer)
    return Engine(runner, tokenizer, vocab_size=model.text.vocab_size, config=config, prepare=loaded.prepare,
                  model_fingerprint=loaded.fingerprint, eos_token_ids=list(model.eos_token_ids) or None,
                  model_max_len=model.text.max_position_embeddings)


def random_vision_weights(model: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The tower's random bf16 bit patterns (LayerNorm scales 1), keyed as ModelWeights.vision."""
    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.loader import expected_shapes

    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.02)
    out: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(model).items():
        if name.startswith("vision/"):
            key = name[len("vision/"):]
            plain_norm = key.endswith(("norm1.weight", "norm2.weight", "norm.weight"))  # LayerNorm scale 1
            out[key] = np.full(shape, 0x3F80, np.uint16) if plain_norm else np.resize(block, shape)
    return out


def model_cost(engine: Any) -> ModelCost:
    runner = engine.runner
    block = engine.config.block_size
    itemsize = 2 if getattr(runner, "dtype", "f32") == "bf16" else 4
    return ModelCost.from_config(runner.config, kv_bytes_per_token=runner.kv_bytes_per_block(block) // block,
                                 state_bytes_per_seq=runner.state_bytes_per_slot(), weight_itemsize=itemsize)
