"""Host-side parts of bench/cuda_attention_bench.py: argument checks before any GPU, the old kernel's tiles and
the table (the timings themselves need the GPU)."""
from __future__ import annotations

import cuda_attention_bench as bench
import numpy as np
import pytest


@pytest.mark.parametrize("argv", [["--shapes", "70b"], ["--lengths", "0"], ["--reps", "0"], ["--lengths", ""]])
def test_bad_arguments_fail_before_the_gpu(argv) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("n", [1, 31, 32, 1000])
def test_old_kernel_tiles_cover_the_chunk_in_32_row_pieces(n) -> None:
    tiles = bench.v1_tiles(n)
    assert tiles.dtype == np.int32 and np.all(tiles[:, 1] <= bench.V1_TILE) and np.all(tiles[:, 1] >= 1)
    assert np.array_equal(np.concatenate([np.arange(f, f + c) for f, c in tiles]), np.arange(n))


def test_table_lists_old_and_new_rows() -> None:
    with_old = {"shape": "27b", "tokens": 8192, "q_heads": 24, "kv_heads": 4, "head_dim": 256, "new_ms": 5.0,
                "new_TFLOPs": 164.9, "old_ms": 40.0, "old_TFLOPs": 20.6, "speedup": 8.0, "agree": 1.2e-3}
    new_only = {k: v for k, v in with_old.items() if not k.startswith("old") and k not in ("speedup", "agree")}
    text = bench.format_table([with_old, new_only])
    assert "164.9" in text and "8.0x" in text and "1.2e-03" in text
    assert len(text.splitlines()) == 5


def test_agreement_is_relative_l2_and_nan_on_non_finite() -> None:
    from op_bench import agreement

    b = np.array([3.0, 4.0], np.float32)
    assert agreement(b, b) == 0.0 and agreement(np.array([3.0, 4.5], np.float32), b) == 0.1
    assert np.isnan(agreement(np.array([np.nan, 4.0], np.float32), b)) and np.isnan(agreement(b, b * np.inf))
