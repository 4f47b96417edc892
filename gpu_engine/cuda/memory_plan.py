"""How much of the CUDA runner's arena the engine's cache may take when the engine is given no kv_cache_bytes.

The arena (one allocation of CudaOptions.memory_budget bytes) holds, in order: the weights, the vision tower and its
encoder-cache region, then the cache (KV blocks + state slots), then per-step scratch (released every step) and
the captured decode graphs (kept until the cache changes). The default cache is what is left after the weights,
less a reserve for the rest, each term counted on the large side:

- graphs: CudaOptions.graph_memory, the most the captured graphs may own;
- one step's activations at max_batched_tokens tokens: STEP_BYTES_PER_TOKEN_FACTOR values of the larger of hidden
  and intermediate size per token (the residual stream and norm buffers, the fused projections' outputs, the
  DeltaNet conv / chunk workspaces, the MLP's gate|up), for a qwen3_5_moe model (intermediate_size 0) plus one MoE
  layer's routing and expert scratch (moe_plan.scratch_bytes_per_token: k rows of I and H per token), and
  max_num_seqs rows of f32 logits with the sampler's copies; or, where larger, a Gated DeltaNet layer's own peak
  (deltanet_step_bytes: its buffers and the chunked delta rule's workspace, one chunk slot per sequence on top of
  the tokens' chunks, or the MLP after it), which the factor misses where the DeltaNet widths exceed the MLP's
  (the qwen3_5_moe model: conv_dim is four times its hidden size);
- one vision encode of the largest image the processors make (MAX_IMAGE_PATCHES patches: its f32 and rounded pixels
  and the tower's activations);
- MARGIN_BYTES for what is not counted (the step tables, cuBLASLt workspaces, alignment).
The reserve never takes more than half of what is left, so a small budget (a test's, a small GPU's) still gets a
cache; a step that then needs more scratch stops with the arena's own error. Pure arithmetic, tested on the CPU
(tests/engine/test_engine_default_budgets.py; the DeltaNet term against a measured layer:
tests/cuda_runner/test_deltanet_step_reserve.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import deltanet_chunked
from .moe_plan import scratch_bytes_per_token

# Qwen3-VL / Qwen3.5 image processors cap an image at 16,777,216 pixels: 65,536 patches of 16 x 16.
MAX_IMAGE_PATCHES = 65536
STEP_BYTES_PER_TOKEN_FACTOR = 12  # values of max(hidden, intermediate) per token a step may hold at its peak
LOGIT_ROW_COPIES = 3  # logits, the sampler's processed copy, its sort / top-k scratch
MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheBudget:
    """The default cache budget and how it was reached (the engine quotes `explain` when it is too small)."""

    nbytes: int
    arena_bytes: int
    after_weights_bytes: int  # arena left once the weights, the tower and the encoder region are in
    reserve_bytes: int

    @property
    def explain(self) -> str:
        gib = 1 << 30
        return (f"the CUDA runner's default cache budget: arena {self.arena_bytes / gib:.2f} GiB, "
                f"{self.after_weights_bytes / gib:.2f} GiB left after the weights, less "
                f"{self.reserve_bytes / gib:.2f} GiB kept for step activations, graphs and vision encodes")


def step_reserve_bytes(text: Any, tokens: int, rows: int, itemsize: int) -> int:
    """Upper estimate of one step's scratch at `tokens` tokens and `rows` logits rows (at most `rows` sequences)."""
    width = max(int(text.hidden_size), int(text.intermediate_size))
    layer = tokens * (STEP_BYTES_PER_TOKEN_FACTOR * width * itemsize + scratch_bytes_per_token(text, itemsize))
    return max(layer, deltanet_step_bytes(text, tokens, rows, itemsize)) + rows * int(text.vocab_size) * 4 * \
        LOGIT_ROW_COPIES


def deltanet_step_bytes(text: Any, tokens: int, seqs: int, itemsize: int) -> int:
    """Peak scratch of a Gated DeltaNet layer (text_model._deltanet) at `tokens` tokens of `seqs` sequences: the
    residual stream's x, h and d, in_proj's output, conv_out and core, then the larger of the chunked delta rule's
    workspace (its largest variant; it takes a chunk slot per sequence on top of tokens / CHUNK) and the gated
    norm's output with the MLP's scratch (the MoE layer's, or SwiGLU's gate|up). 0 without DeltaNet layers."""
    if not text.linear_attention_layers:
        return 0
    vh, dk, dv = int(text.linear_num_value_heads), int(text.linear_key_head_dim), int(text.linear_value_head_dim)
    conv, vdim = int(text.linear_conv_dim), int(text.linear_value_dim)
    held = tokens * (3 * int(text.hidden_size) + (conv + vdim + 2 * vh) + conv + vdim) * itemsize
    mlp = scratch_bytes_per_token(text, itemsize) or 2 * int(text.intermediate_size) * itemsize  # MoE, else dense
    rule = max(deltanet_chunked.workspace_bytes(tokens, seqs, vh, dk, dv, variant)
               for variant in deltanet_chunked.VARIANTS) if deltanet_chunked.supports(dk, dv) else 0
    return held + max(rule, tokens * (vdim * itemsize + mlp))


def vision_reserve_bytes(dims: Any | None, itemsize: int, patches: int = MAX_IMAGE_PATCHES) -> int:
    """Scratch of one vision encode of `patches` patches (0 without a tower): f32 pixels + their rounded copy, and
    the tower's activations (x, normed, attention out, the proj temp and qkv: 7 x hidden, plus the MLP)."""
    if dims is None:
        return 0
    pixels = patches * int(dims.patch_dim) * (4 + itemsize)
    acts = patches * (7 * int(dims.hidden_size) + int(dims.intermediate_size)) * itemsize
    return pixels + acts


def default_cache_budget(arena_bytes: int, after_weights_bytes: int, graph_bytes: int, step_bytes: int,
                         vision_bytes: int) -> CacheBudget:
    reserve = min(graph_bytes + step_bytes + vision_bytes + MARGIN_BYTES, max(0, after_weights_bytes) // 2)
    return CacheBudget(nbytes=max(0, after_weights_bytes - reserve), arena_bytes=arena_bytes,
                       after_weights_bytes=after_weights_bytes, reserve_bytes=reserve)


def default_memory_budget(device_id: int, fraction: float) -> int:
    """`fraction` (CudaOptions.memory_fraction) of the device's free memory, taken once."""
    from .device import CudaDevice

    free, _ = CudaDevice(device_id).mem_info()
    return int(free * fraction) // (1 << 20) * (1 << 20)
