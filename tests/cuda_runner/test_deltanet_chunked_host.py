"""Host-side checks of the chunked gated delta rule launcher (no GPU): bad arguments raise ShapeError before any
launch, the workspace arithmetic, and the runner's choice of path."""
from __future__ import annotations

import pytest

from gpu_engine.cuda import deltanet_chunked as dc
from gpu_engine.cuda.errors import ShapeError
from tests.cuda_runner.no_launch import arr, no_launch_ctx

KH, VH, DK, DV, N, SEQS = 2, 4, 128, 64, 100, 2
STRIDE = 2 * KH * DK + VH * DV


def _args(**over):
    args = dict(out=arr((N, VH * DV)), q=arr((N, STRIDE)), k=arr((N, STRIDE)), v=arr((N, STRIDE)),
                qkv_stride=STRIDE, a=arr((N, 2 * VH)), b=arr((N, 2 * VH)), ab_stride=2 * VH,
                A_log=arr((VH,), "f32"), dt_bias=arr((VH,), "f32"), state=arr((3, VH, DV, DK), "f32"),
                cu_seqlens=arr((SEQS + 1,), "i32"), state_slots=arr((SEQS,), "i32"), fresh=arr((SEQS,), "i32"),
                k_heads=KH, v_heads=VH, dk=DK, dv=DV)
    args.update(over)
    return args


@pytest.mark.parametrize("bad, match", [
    ({"q": arr((N, STRIDE), "f32")}, "must be bf16"),
    ({"out": arr((N, VH * DV), "f32")}, "must be bf16"),
    ({"state": arr((3, VH, DV, DK), "bf16")}, "must be f32"),
    ({"A_log": arr((VH,), "bf16")}, "must be f32"),
    ({"fresh": arr((SEQS,), "f32")}, "must be i32"),
    ({"dk": 96, "state": arr((3, VH, DV, 96), "f32")}, "dk, dv"),
    ({"dv": 48, "state": arr((3, VH, 48, DK), "f32")}, "dk, dv"),
    ({"v_heads": 3}, "v_heads % k_heads"),
    ({"qkv_stride": STRIDE + 1}, "even"),
    ({"state": arr((3, VH, DK, DV), "f32")}, "expected"),
    ({"cu_seqlens": arr((SEQS,), "i32")}, "cu_seqlens"),
    ({"out": arr((N, VH * DV - 2))}, "out"),
])
def test_bad_arguments_never_launch(bad, match) -> None:
    with pytest.raises(ShapeError, match=match):
        dc.chunked_gated_delta_rule(no_launch_ctx(), **_args(**bad))


def test_chunk_slots_and_workspace() -> None:
    assert dc.chunk_slots(8192, 1) == 129
    assert dc.chunk_slots(63, 3) == 3
    # W, Qd, Kd^T (dk each), U (dv) and P (64) in bf16 per 64-token chunk and head, plus one f32 decay
    assert dc.workspace_bytes(64, 1, 1, 128, 128, variant="current") == 2 * (2 * 64 * (3 * 128 + 128 + 64) + 4)
    assert dc.supports(128, 128) and not dc.supports(256, 128)


def test_bad_slice_width_never_launches() -> None:
    with pytest.raises(ShapeError, match="dv_slice"):
        dc.chunked_gated_delta_rule(no_launch_ctx(), **_args(), dv_slice=8)


@pytest.mark.parametrize("dv, v_heads, seqs, sms, width", [
    (128, 16, 1, 132, 16),   # 2B, one sequence: 64 blocks of 32 columns would leave 68 SMs idle
    (128, 16, 2, 132, 16),   # 128 blocks < 132
    (128, 16, 3, 132, 32),   # 192 blocks: the full grid already covers the SMs
    (128, 48, 1, 132, 32),   # 27B heads: 192 blocks
    (128, 32, 1, 132, 16),   # 9B heads: 128 blocks < 132
    (64, 4, 1, 132, 16),
    (128, 33, 1, 132, 32),   # 132 blocks: not fewer than the SMs
])
def test_scan_slice_width(dv, v_heads, seqs, sms, width) -> None:
    assert dc.scan_slice(dv, v_heads, seqs, sms) == width
