"""Launchers of tests/cuda_runner/kernels/logits_checks.cu: argmax, log_softmax and the grammar bitmask as single
kernels on fp32 logits, which check_kernels compares with numpy. The engine never launches them (it samples with
sample_rows_f32, gpu_engine/cuda/sampler.py), so they live here and not in the shipped package."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from gpu_engine.cuda.context import DArray, GpuContext
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.ops import _need

KERNELS = Path(__file__).parent / "kernels"
FAMILY = "logits_checks"
i32 = np.int32


def argmax(ctx: GpuContext, out: DArray, logits: DArray) -> None:
    _need(logits, "f32", "logits")
    _need(out, "i32", "argmax output")
    rows, vocab = logits.shape
    ctx.device.add_kernel_dir(KERNELS)
    ctx.device.launch(FAMILY, "argmax_f32", rows, 1024, out.ptr, logits.ptr, i32(rows), i32(vocab))


def log_softmax(ctx: GpuContext, out: DArray, lse: DArray, logits: DArray) -> None:
    for arr, name in ((out, "out"), (lse, "lse"), (logits, "logits")):
        _need(arr, "f32", name)
    rows, vocab = logits.shape
    ctx.device.add_kernel_dir(KERNELS)
    ctx.device.launch(FAMILY, "log_softmax_f32", rows, 1024, out.ptr, lse.ptr, logits.ptr, i32(rows), i32(vocab))


def apply_bitmask(ctx: GpuContext, logits: DArray, mask: DArray) -> None:
    """logits[r, i] = -inf where bit i of mask row r is 0 (mask u32/i32 [rows, ceil(vocab/32)])."""
    _need(logits, "f32", "logits")
    rows, vocab = logits.shape
    words = (vocab + 31) // 32
    if mask.shape != (rows, words) or mask.dtype not in ("u32", "i32"):
        raise ShapeError(f"bitmask {mask.shape} {mask.dtype}, expected u32 {(rows, words)}")
    ctx.device.add_kernel_dir(KERNELS)
    ctx.device.launch(FAMILY, "apply_bitmask_f32", rows, 256, logits.ptr, mask.ptr, i32(rows), i32(vocab),
                      i32(words))
