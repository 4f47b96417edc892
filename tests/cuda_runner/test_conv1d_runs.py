"""The token-parallel conv1d's launch choice (ops.conv_runs_launch) and its run/window logic, on the CPU.

emulate_runs walks the batch the way conv1d_silu_runs does (one run of rows at a time, the window filled once
per run or sequence start from x / old state / zeros, then slid) over all channels at once, and must equal the
float64 reference conv for every run length, including runs that cross sequence boundaries and empty sequences.
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.cuda import ops
from gpu_engine.cuda.errors import ShapeError
from tests.cuda_runner import references as ref


def emulate_runs(x: np.ndarray, w: np.ndarray, state: np.ndarray, cu: np.ndarray, slots: np.ndarray,
                 fresh: np.ndarray, run: int, km: int) -> np.ndarray:
    n, K = x.shape[0], w.shape[1]
    seqs = slots.size
    token_seq = np.repeat(np.arange(seqs), np.diff(cu))
    wr = np.zeros((km, w.shape[0]))
    wr[km - K:] = w.T  # right-aligned taps
    out = np.full((n, w.shape[0]), np.nan)
    for t0 in range(0, n, run):
        t1, s, t = min(t0 + run, n), int(token_seq[t0]), t0
        while t < t1 and s < seqs:
            start, end = int(cu[s]), min(int(cu[s + 1]), t1)
            if end <= t:
                s += 1
                continue
            win = np.zeros((km - 1, w.shape[0]))
            for j in range(km - K, km - 1):
                src = t - (km - 1) + j
                if src >= start:
                    win[j] = x[src]
                elif not fresh[s]:
                    win[j] = state[slots[s], K - 1 - (start - src)]
            for tok in range(t, end):
                a = wr[km - 1] * x[tok] + (wr[km - K:km - 1] * win[km - K:]).sum(axis=0)
                out[tok] = a / (1 + np.exp(-a))
                win = np.concatenate([win[1:], x[tok][None]])
            t = end
            s += 1
    return out


@pytest.mark.parametrize("run", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("K", [2, 4, 6])
def test_runs_match_reference_conv(run: int, K: int) -> None:
    rng = np.random.default_rng()
    lens = [5, 0, 1, 9, 3]  # an empty sequence, a one-token one, and runs crossing boundaries
    fresh = np.array([1, 0, 0, 0, 1], np.int32)
    slots = np.array([2, 4, 0, 3, 1], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    C = 24
    x = rng.standard_normal((cu[-1], C))
    w = rng.standard_normal((C, K)) * 0.5
    state = rng.standard_normal((5, K - 1, C))
    expected = []
    for i in range(len(lens)):
        st = np.zeros((K - 1, C)) if fresh[i] else state[slots[i]]
        expected.append(ref.causal_conv1d_silu(x[cu[i]:cu[i + 1]], w, st)[0])
    got = emulate_runs(x, w, state, cu, slots, fresh, run, 4 if K <= 4 else 8)
    np.testing.assert_allclose(got, np.concatenate(expected), rtol=1e-12, atol=1e-12)


def test_launch_uses_16_byte_vectors_on_aligned_rows() -> None:
    lp = ops.conv_runs_launch(8192, 6144, 4, "bf16", 1 << 20, 8224, 1 << 21, 6144)
    assert (lp.kernel, lp.vec, lp.run) == ("conv1d_silu_runs_bf16_vec_k4", 8, ops.CONV_RUN_TOKENS)
    assert lp.grid == (6, 8192 // ops.CONV_RUN_TOKENS)
    lp = ops.conv_runs_launch(100, 1000, 7, "f32", 256, 1004, 512, 1000)
    assert (lp.kernel, lp.vec, lp.grid) == ("conv1d_silu_runs_f32_vec_k8", 4, ((250 + 127) // 128, 7))


@pytest.mark.parametrize("x_ptr, x_stride, out_ptr, out_stride, conv_dim", [
    (1 << 20, 8225, 1 << 21, 6144, 6144),      # odd row stride: rows after the first are misaligned
    ((1 << 20) + 2, 8224, 1 << 21, 6144, 6144),  # x base off by one element
    (1 << 20, 8224, (1 << 21) + 8, 6144, 6144),  # out base off by 8 bytes
    (1 << 20, 8224, 1 << 21, 6148, 6148),      # conv_dim not a multiple of 8
])
def test_launch_falls_back_to_one_channel_per_thread(x_ptr, x_stride, out_ptr, out_stride, conv_dim) -> None:
    lp = ops.conv_runs_launch(64, conv_dim, 4, "bf16", x_ptr, x_stride, out_ptr, out_stride)
    assert (lp.kernel, lp.vec) == ("conv1d_silu_runs_bf16_v1_k4", 1)
    assert lp.grid == ((conv_dim + 127) // 128, 4)


def test_long_batches_lengthen_the_run_to_fit_the_grid() -> None:
    lp = ops.conv_runs_launch(2_000_000, 256, 4, "bf16", 0, 256, 0, 256)
    assert lp.grid[1] <= 65535 and lp.grid[1] * lp.run >= 2_000_000
    with pytest.raises(ShapeError, match="65535 runs"):
        ops.conv_runs_launch(70000, 256, 4, "bf16", 0, 256, 0, 256, run=1)
