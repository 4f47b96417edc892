"""CudaOptions: every setting of the CUDA runner, typed and validated at construction (like EngineConfig).

`CudaOptions.from_env()` is the one place the DOCPIPE_CUDA_* environment variables are read (gpu_engine.load
calls it when no options are given); code that builds a CudaRunner itself passes CudaOptions(...) instead.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from .errors import ShapeError

DTYPES = ("bf16", "f32")
DEFAULT_ENCODER_MEMORY = 1 << 30


def encoder_region_bytes(option: int | None, memory_budget: int) -> int:
    """The encoder region a runner with `memory_budget` bytes takes for CudaOptions.encoder_memory = `option`."""
    return option if option is not None else min(DEFAULT_ENCODER_MEMORY, memory_budget // 4)


@dataclass(frozen=True)
class CudaOptions:
    dtype: str = "bf16"  # what the decoder computes and stores its cache in: "bf16" or "f32"
    device_id: int = 0
    # The one start-up allocation, in bytes; None takes `memory_fraction` of the device's free memory.
    memory_budget: int | None = None
    memory_fraction: float = 0.85  # DOCPIPE_CUDA_MEMORY_FRACTION
    use_graphs: bool = True  # decode steps replay CUDA graphs (DOCPIPE_CUDA_GRAPHS=0 turns that off)
    graph_memory: int = 2 << 30  # most bytes one decode graph's buffers may take (graphs share them); larger: eager
    use_pdl: bool = False  # programmatic dependent launch between kernels (needs sm_90; DOCPIPE_CUDA_PDL=1)
    # A step carrying a 32+-token prompt chunk gives its one-token rows to the decode attention kernel instead of
    # flash_prefill (text_model.CudaTextModel.decode_rows_apart; DOCPIPE_CUDA_DECODE_ROWS_APART=0 turns it off).
    # On by default since session 8: check_decode_rows_apart passed on the H200, and the 9B document step (56 decode
    # rows + 4 prompt chunks, 8192 tokens) ran 243.3 -> 236.1 ms, flash_prefill 30.8 -> 19.1 ms (cuda_notes.md).
    decode_rows_apart: bool = True
    # Bytes of the on-device encoder-cache region (DOCPIPE_CUDA_ENCODER_MEMORY), also the engine's default encoder
    # budget on this runner; None: encoder_region_bytes(budget) = DEFAULT_ENCODER_MEMORY (1 GiB: 65,536 tokens of
    # 27B-class embeddings; a 12 MP photo at 9B is 92.5 MiB), at most a quarter of the memory budget.
    encoder_memory: int | None = None
    module_cache: Path | None = None  # compiled kernels on disk; None: ~/.cache/docpipe/cuda_modules
    # The vision tower's flash-attention kernel variant (vision_flash.VARIANTS; DOCPIPE_CUDA_VISION_FLASH); None:
    # vision_flash.DEFAULT_VARIANT.
    vision_flash: str | None = None
    # The prefill attention kernel (flash_plan.FLASH_TILE_ROWS; DOCPIPE_CUDA_FLASH_PREFILL): "fa2" (flash_prefill.cu,
    # mma.sync) or "ws" (flash_prefill_ws.cu: warp-specialised wgmma, 128-row tiles; used for a bf16 KV cache at
    # head_dim 256 on sm_90, "fa2" elsewhere: flash_plan.flash_variant). "ws" since session 14: check_flash 39/39 and
    # 1.16-1.19x fa2 on the H200 at 9B / 27B (bench/results/cuda/cuda_flash_prefill_bench.json).
    flash_prefill: str = "ws"
    # Same-grid vision items of a step in one tower call (encode_vision_batch, cuda/vision_batch.py;
    # DOCPIPE_CUDA_VISION_BATCH=1). check_vision passed it on an H200, the 9B document run gained nothing: opt-in.
    vision_batch: bool = False
    # Speculative decoding: how a verify window's linear-attention state is rolled back (cuda/verify.py):
    # "recompute" (snapshot + re-feed the accepted tokens) or "window" (keep every window token's state, windows of
    # at most verify_window_tokens + 1 tokens).
    rollback: str = "recompute"
    verify_window_tokens: int = 3
    # The checkpoint's MTP head drafts for speculative="auto" requests too (DOCPIPE_CUDA_MTP_AUTO=1), not only for
    # speculative="mtp" ones: auto's prompt lookup and its backoff otherwise. Opt-in until checked on a GPU (#16).
    mtp_in_auto: bool = False
    # The full-attention layers' KV cache: "auto" (the compute dtype) or "fp8_e4m3" (e4m3 bytes with a float32 scale
    # per token and kv head, kv_fp8.py; gpu_engine.load's kv_cache_dtype). Opt-in until checked on a GPU.
    kv_cache_dtype: str = "auto"
    # The chunked gated delta rule variant of bf16 prefill (deltanet_chunked.VARIANTS; DOCPIPE_CUDA_DELTANET_CHUNKED):
    # "current" (prep + scan with the output on the scan's chain) or "states" (prep + a state-only scan + a parallel
    # output launch, #14). "states" since session 14: bit-identical to "current" on the H200 (check_deltanet_chunked
    # 75/75), 0.80x its time on a fresh 8k chunk, 0.88x on the 27B document step (cuda_deltanet_bench.json).
    deltanet_chunked: str = "states"
    # A bf16 step whose chunked delta rule would also run one-token rows (decode rows beside prompt chunks) gives a
    # leading or trailing run of them to the token kernel, which decode steps use (text_model.CudaTextModel.
    # deltanet_rows_apart, step.DeltaNetSplit; DOCPIPE_CUDA_DELTANET_ROWS_APART=1 turns it on). Each kernel runs
    # its own rows as it runs a step of them alone (CPU-tested; check_decode_rows_apart's "deltanet rows apart" is
    # its GPU check). Why: on the H200 a 9B document step's chunked call took 1.23 ms with its 56 decode rows, 0.96
    # ms for its 8192 prompt tokens alone (cuda_deltanet_bench, doc vs fresh8k). Opt-in: written in session 14,
    # when no GPU was left to run its check.
    deltanet_rows_apart: bool = False
    # An MoE layer's calls of <= moe_decode.MAX_ROWS (8) token rows (decode): "grouped" (router GEMM, route, plan,
    # grouped GEMMs, combine) or "fused" (moe_decode.py: three launches, the router GEMV + top-k, gate|up, down with
    # the combine; DOCPIPE_CUDA_MOE_DECODE). Opt-in: written without a GPU, check_moe and bench/moe_layer_bench.py
    # have not run it yet. moe_weights.set_moe_decode hands it to a model's layers (ShapeError, by name, for a layer
    # the fused kernels cannot take).
    moe_decode: str = "grouped"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ShapeError(f"dtype must be 'bf16' or 'f32', got {self.dtype!r}")
        if not 0.05 <= self.memory_fraction <= 0.98:
            raise ShapeError(f"DOCPIPE_CUDA_MEMORY_FRACTION must be in [0.05, 0.98], got {self.memory_fraction}")
        from .vision_flash import VARIANTS

        if self.vision_flash is not None and self.vision_flash not in VARIANTS:
            raise ShapeError(f"DOCPIPE_CUDA_VISION_FLASH must be one of {sorted(VARIANTS)}, got {self.vision_flash!r}")
        from .flash_plan import FLASH_TILE_ROWS

        if self.flash_prefill not in FLASH_TILE_ROWS:
            raise ShapeError(f"DOCPIPE_CUDA_FLASH_PREFILL must be one of {sorted(FLASH_TILE_ROWS)}, got "
                             f"{self.flash_prefill!r}")
        from ..reference.fp8_kv import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        from .deltanet_chunked import check_variant

        check_variant(self.deltanet_chunked)
        from .moe_decode import DECODE_PATHS

        if self.moe_decode not in DECODE_PATHS:
            raise ShapeError(f"DOCPIPE_CUDA_MOE_DECODE must be one of {list(DECODE_PATHS)}, got {self.moe_decode!r}")
        if self.rollback not in ("recompute", "window"):
            raise ShapeError(f"CudaOptions.rollback must be 'recompute' or 'window', got {self.rollback!r}")
        for name in ("memory_budget", "graph_memory", "encoder_memory", "device_id", "verify_window_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ShapeError(f"CudaOptions.{name} must be >= 0, got {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CudaOptions:
        """Defaults, then the DOCPIPE_CUDA_* variables that are set, then `overrides` (CudaOptions field names)."""
        env = os.environ if environ is None else environ
        read: dict[str, Any] = {}
        if "DOCPIPE_CUDA_MEMORY_FRACTION" in env:
            read["memory_fraction"] = float(env["DOCPIPE_CUDA_MEMORY_FRACTION"])
        if "DOCPIPE_CUDA_GRAPHS" in env:
            read["use_graphs"] = env["DOCPIPE_CUDA_GRAPHS"] != "0"
        if "DOCPIPE_CUDA_GRAPH_MEMORY" in env:
            read["graph_memory"] = int(env["DOCPIPE_CUDA_GRAPH_MEMORY"])
        if "DOCPIPE_CUDA_PDL" in env:
            read["use_pdl"] = env["DOCPIPE_CUDA_PDL"] == "1"
        if "DOCPIPE_CUDA_MTP_AUTO" in env:
            read["mtp_in_auto"] = env["DOCPIPE_CUDA_MTP_AUTO"] == "1"
        if "DOCPIPE_CUDA_DECODE_ROWS_APART" in env:
            read["decode_rows_apart"] = env["DOCPIPE_CUDA_DECODE_ROWS_APART"] == "1"
        if "DOCPIPE_CUDA_DELTANET_ROWS_APART" in env:
            read["deltanet_rows_apart"] = env["DOCPIPE_CUDA_DELTANET_ROWS_APART"] == "1"
        if "DOCPIPE_CUDA_ENCODER_MEMORY" in env:
            read["encoder_memory"] = int(env["DOCPIPE_CUDA_ENCODER_MEMORY"])
        if "DOCPIPE_CUDA_VISION_BATCH" in env:
            read["vision_batch"] = env["DOCPIPE_CUDA_VISION_BATCH"] == "1"
        if env.get("DOCPIPE_CUDA_VISION_FLASH"):
            read["vision_flash"] = env["DOCPIPE_CUDA_VISION_FLASH"]
        if env.get("DOCPIPE_CUDA_FLASH_PREFILL"):
            read["flash_prefill"] = env["DOCPIPE_CUDA_FLASH_PREFILL"]
        if env.get("DOCPIPE_CUDA_MOE_DECODE"):
            read["moe_decode"] = env["DOCPIPE_CUDA_MOE_DECODE"]
        if env.get("DOCPIPE_CUDA_DELTANET_CHUNKED"):
            read["deltanet_chunked"] = env["DOCPIPE_CUDA_DELTANET_CHUNKED"]
        if "DOCPIPE_CUDA_CACHE" in env:
            read["module_cache"] = Path(env["DOCPIPE_CUDA_CACHE"])
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown CudaOptions field(s): {', '.join(sorted(unknown))}")
        return replace(cls(**read), **overrides)
