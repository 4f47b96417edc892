"""Host-side parts of bench/cuda_prefill_profile.py: the document-like step it profiles and the FLOP counts its
rates come from (checked against limit_model's own attention count and plain arithmetic)."""
from __future__ import annotations

import cuda_prefill_profile as prof
import numpy as np
import pytest


def test_doc_step_fills_the_token_budget_with_decode_rows_then_chunks() -> None:
    rng = np.random.default_rng()
    tokens, rows = int(rng.integers(100, 9000)), int(rng.integers(0, 60))
    chunk, start = int(rng.integers(1, 3000)), int(rng.integers(0, 5000))
    shape = prof.doc_step(tokens, rows, 4000, start, chunk)
    assert sum(n for _, n in shape) == tokens
    assert shape[:rows] == [(4000, 1)] * rows
    prefill = shape[rows:]
    assert prefill and all(s == start for s, _ in prefill)
    assert all(n == chunk for _, n in prefill[:-1]) and 0 < prefill[-1][1] <= chunk


def test_default_doc_step_is_the_runs_shape() -> None:
    shape = prof.doc_step()
    assert sum(n for _, n in shape) == prof.STEP_TOKENS == 8192
    assert sum(1 for _, n in shape if n == 1) == prof.DECODE_ROWS


@pytest.mark.parametrize("bad", [dict(decode_rows=8192), dict(chunk=0), dict(decode_context=0), dict(prefill_start=-1)])
def test_doc_step_refuses_impossible_shapes(bad) -> None:
    with pytest.raises(ValueError):
        prof.doc_step(**bad)


def test_gemm_flops_from_the_traced_name() -> None:
    rng = np.random.default_rng()
    m, n, k = (int(v) for v in rng.integers(1, 20000, 3))
    assert prof.gemm_flops(f"gemm {m}x{n}x{k}") == 2.0 * m * n * k
    assert prof.gemm_flops("flash_prefill") is None


def test_attention_flops_count_causal_keys() -> None:
    # one fresh chunk of 3 tokens sees 1 + 2 + 3 keys; a decode row at start 10 sees 11
    assert prof.attention_flops([(0, 3)], 256, 16) == 4.0 * 256 * 16 * 6
    assert prof.attention_flops([(10, 1)], 256, 16) == 4.0 * 256 * 16 * 11
    rng = np.random.default_rng()
    shape = [(int(s), int(n)) for s, n in zip(rng.integers(0, 5000, 5), rng.integers(1, 3000, 5))]
    brute = sum(sum(s + i + 1 for i in range(n)) for s, n in shape)
    assert prof.attention_flops(shape, 128, 8) == pytest.approx(4.0 * 128 * 8 * brute)
