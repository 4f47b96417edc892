"""paged_attention_mma's index arithmetic on the CPU (tests/cuda_runner/paged_mma_emulation.py: the kernel's
lanes, ldmatrix addresses and mma fragments emulated) against float64 attention; the GPU check is check_kernels."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.cuda import ops
from gpu_engine.cuda.bf16 import round_to_bf16
from tests.cuda_runner.paged_mma_emulation import BN, paged_attention_mma_emulated


def _reference(q, k_cache, v_cache, tables, token_seq, token_pos, heads, kv_heads, block_size, scale):
    hd = k_cache.shape[-1]
    out = np.zeros((len(token_seq), heads, hd))
    for i, (seq, last) in enumerate(zip(token_seq, token_pos)):
        slots = [tables[seq][p // block_size] * block_size + p % block_size for p in range(last + 1)]
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            s = k_cache[slots, kvh].astype(np.float64) @ q[i, h * hd:(h + 1) * hd].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ v_cache[slots, kvh] / p.sum()
    return out


@pytest.mark.parametrize("hd,heads,kv_heads,positions,splits", [
    (64, 8, 2, [0, 15, 16, 70, 150], 1),     # one key, a 16-key edge, several tiles, a partial warp
    (64, 4, 1, [5, 129, 200], 3),            # splits not aligned to tiles; an empty split (position 5)
    (128, 6, 2, [40, 90], 2),                # G = 3: padding columns in the score mma
    (256, 4, 1, [80], 2),                    # the 9B / 27B head size
])
def test_emulated_kernel_matches_float64_attention(hd, heads, kv_heads, positions, splits):
    rng = np.random.default_rng(hd * 1000 + len(positions))
    block_size = 16
    per_seq = max(positions) // block_size + 1
    n = len(positions)
    k_cache = round_to_bf16(rng.standard_normal((n * per_seq * block_size, kv_heads, hd)).astype(np.float32))
    v_cache = round_to_bf16(rng.standard_normal((n * per_seq * block_size, kv_heads, hd)).astype(np.float32))
    tables = rng.permutation(n * per_seq).reshape(n, per_seq)
    q = round_to_bf16(rng.standard_normal((n, heads * hd)).astype(np.float32))
    token_seq, token_pos = np.arange(n), np.array(positions)
    scale = hd ** -0.5
    got = paged_attention_mma_emulated(q, k_cache, v_cache, tables, token_seq, token_pos, heads, kv_heads,
                                       block_size, scale, splits)
    want = _reference(q, k_cache, v_cache, tables, token_seq, token_pos, heads, kv_heads, block_size, scale)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 8e-3  # P rounded to bf16 (2^-9 relative per element)
    assert np.all(np.isfinite(got))


def test_host_shared_bytes_match_the_kernel_layout_and_fit_the_card():
    for hd in ops.PAGED_MMA_HEAD_DIMS:
        pipe = 3 * 2 * BN * (hd + 8) * 2
        assert ops.paged_mma_shared_bytes(hd) >= pipe + 4 * 16 * 8 * 2
        assert ops.paged_mma_shared_bytes(hd) <= 227 * 1024  # sm_90's opt-in limit per block
