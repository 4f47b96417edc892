"""numpy emulation of kernels/vision_flash.cu's schedule, for CPU tests of the tiling itself.

What is emulated as the kernel does it: per segment, query tiles of TILE_ROWS rows (rows past the segment end are
zero queries that are never stored), Q and K zero-padded from head_dim to padded_head_dim for the score product,
key tiles of KEYS_PER_STEP keys with the keys past the segment end zero-filled and their scores -inf, the
exp2-domain online softmax in fp32 (running max and sum per row), P rounded to bf16 for the PV product, fp32 O,
then O / l rounded to bf16. Query tiles are independent (each row's softmax is its own), so they are computed side
by side here. What it cannot check is the CUDA code (fragment layouts, cp.async, barriers): check_vision_flash does.
"""
from __future__ import annotations

import numpy as np

from gpu_engine.cuda import vision_flash
from gpu_engine.cuda.bf16 import round_to_bf16

LOG2E = 1.4426950408889634


def vision_flash_emulated(qkv: np.ndarray, heads: int, head_dim: int, seg_len: int, scale: float, *,
                          mask_tail: bool = True, pad_with: float = 0.0, variant: str = "m1") -> np.ndarray:
    """qkv [n, 3*heads*head_dim] (bf16 values as float32) -> out [n, heads*head_dim] (bf16 values as float32).
    mask_tail=False and pad_with != 0 break the kernel's rules on purpose (the tests show those would be caught).
    `variant` (vision_flash.VARIANTS) sets the query tile rows and the keys per step."""
    n = qkv.shape[0]
    hdp, rows = vision_flash.padded_head_dim(head_dim), vision_flash.tile_rows(variant)
    bn = vision_flash.VARIANTS[variant][1]
    assert n % seg_len == 0
    view = qkv.astype(np.float32).reshape(n, 3, heads, head_dim)
    padded_rows = vision_flash.tiles_per_segment(seg_len, rows) * rows
    sl = np.float32(scale * LOG2E)
    out = np.full((n, heads, head_dim), np.nan, np.float32)  # poisoned: every stored row must be written
    for s0 in range(0, n, seg_len):
        q = np.zeros((heads, padded_rows, hdp), np.float32)  # zero query rows past the segment, zero pad dims
        q[:, :seg_len, :head_dim] = view[s0 : s0 + seg_len, 0].transpose(1, 0, 2)
        m = np.full((heads, padded_rows), -np.inf, np.float32)
        l = np.zeros((heads, padded_rows), np.float32)
        o = np.zeros((heads, padded_rows, head_dim), np.float32)
        for kt in range(0, seg_len, bn):
            valid = np.arange(kt, kt + bn) < seg_len
            count = int(valid.sum())
            k = np.full((heads, bn, hdp), pad_with, np.float32)  # K's padded columns (zero in the kernel)
            k[:, :, :head_dim] = 0.0
            k[:, :count, :head_dim] = view[s0 + kt : s0 + kt + count, 1].transpose(1, 0, 2)
            k[:, count:, :] = 0.0  # rows past the segment are zero-filled whole
            v = np.zeros((heads, bn, head_dim), np.float32)
            v[:, :count] = view[s0 + kt : s0 + kt + count, 2].transpose(1, 0, 2)
            s = np.einsum("hrd,hkd->hrk", q, k)  # fp32 accumulate (einsum: no BLAS thread pool)
            if mask_tail:
                s[:, :, ~valid] = -np.inf
            mx = np.maximum(m, s.max(2))  # finite: key tile 0 holds the segment's first key
            base = mx * sl
            corr = np.exp2(m * sl - base)
            p = np.exp2(s * sl - base[:, :, None])
            m = mx
            l = l * corr + p.sum(2)
            o = o * corr[:, :, None] + np.einsum("hrk,hkd->hrd", round_to_bf16(p.astype(np.float32)), v)
        res = o[:, :seg_len] / l[:, :seg_len, None]
        out[s0 : s0 + seg_len] = round_to_bf16(res.astype(np.float32)).transpose(1, 0, 2)
    return out.reshape(n, heads * head_dim)


def segment_attention_f64(qkv: np.ndarray, heads: int, head_dim: int, seg_len: int, scale: float) -> np.ndarray:
    """Plain float64 attention inside each segment (the independent reference)."""
    n = qkv.shape[0]
    view = qkv.astype(np.float64).reshape(n, 3, heads, head_dim)
    out = np.empty((n, heads, head_dim))
    for s0 in range(0, n, seg_len):
        q, k, v = (view[s0 : s0 + seg_len, i].transpose(1, 0, 2) for i in range(3))
        z = q @ k.transpose(0, 2, 1) * scale
        p = np.exp(z - z.max(2, keepdims=True))
        out[s0 : s0 + seg_len] = (p / p.sum(2, keepdims=True) @ v).transpose(1, 0, 2)
    return out.reshape(n, heads * head_dim)
