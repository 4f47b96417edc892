"""FP8 weights on their way to the GPU, on the CPU (a recording stand-in for GpuContext): which projections become
which linear layer types, that the device receives the checkpoint's e4m3 bytes and scale grids (padded to 4 block
columns) unchanged, and what the CUDA runner refuses before uploading anything."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine import fp8
from gpu_engine.config import ModelConfig
from gpu_engine.cuda.errors import CudaBackendError
from gpu_engine.cuda.fp8_ops import join_fp8, weight_scale_grid
from gpu_engine.cuda.linear import ConcatLinear, DenseLinear, Fp8Linear
from gpu_engine.cuda.weights import upload_text_weights
from gpu_engine.loader import ModelWeights, load_weights
from gpu_engine.tensors import Fp8Tensor
from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint
from tests.cuda_runner.recording_context import RecordingContext

T = "layers.{}."


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    folder = make_tiny_fp8_checkpoint(tmp_path_factory.mktemp("fp8"), seed=int(np.random.default_rng().integers(1000)))
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    return config, weights


def test_projections_become_fp8_layers_joined_only_where_their_scale_grids_join(tiny_fp8) -> None:
    config, weights = tiny_fp8
    ctx = RecordingContext()
    tw = upload_text_weights(ctx, config.text, weights, "bf16")
    attn = tw.layers[3].mixer  # full attention: q 256 rows | k 64 | v 64 -> [q|k] (q ends on a block) and [v]
    assert isinstance(attn.qkv, ConcatLinear)
    assert [type(p) for p in attn.qkv.parts] == [Fp8Linear, Fp8Linear]
    assert [p.shape for p in attn.qkv.parts] == [(320, 64), (64, 64)]
    assert isinstance(attn.o_proj, Fp8Linear)
    delta = tw.layers[0].mixer  # qkv 128 rows | z 64 (FP8, joined) beside b | a (BF16, kept so by the releases)
    assert isinstance(delta.in_proj, ConcatLinear)
    assert [type(p) for p in delta.in_proj.parts] == [Fp8Linear, DenseLinear]
    assert [p.shape for p in delta.in_proj.parts] == [(192, 64), (8, 64)]
    assert isinstance(tw.layers[0].mlp.gate_up, Fp8Linear) and tw.layers[0].mlp.gate_up.shape == (256, 64)
    assert isinstance(tw.layers[0].mlp.down, Fp8Linear)
    text = weights.text
    q, k = text.fp8(T.format(3) + "self_attn.q_proj.weight"), text.fp8(T.format(3) + "self_attn.k_proj.weight")
    assert q is not None and k is not None
    sent_bits = ctx.sent["layers.3.self_attn.qkv[layers.3.self_attn.q_proj.weight..]"]
    assert np.array_equal(sent_bits, np.concatenate([q.bits, k.bits]))
    grid = ctx.sent["layers.3.self_attn.qkv[layers.3.self_attn.q_proj.weight..].scale_inv"]
    assert grid.shape == (3, 4) and np.array_equal(grid[:, :1], np.concatenate([q.scale_inv, k.scale_inv]))
    assert np.all(grid[:, 1:] == 1.0)


def test_join_refuses_a_part_that_does_not_end_on_a_block() -> None:
    rng = np.random.default_rng()
    parts = [Fp8Tensor(*fp8.quantize(rng.standard_normal((r, 256)).astype(np.float32)), (128, 128), "F32")
             for r in (64, 128)]
    with pytest.raises(ValueError, match="does not end on a 128-row block"):
        join_fp8(parts)
    bits, grid = join_fp8(parts[::-1])
    assert bits.shape == (192, 256) and grid.shape == (2, 2)
    assert weight_scale_grid(grid).shape == (2, 4)


def test_the_cuda_runner_refuses_fp8_it_cannot_run(tiny_fp8) -> None:
    config, weights = tiny_fp8
    with pytest.raises(CudaBackendError, match="need the bf16 CUDA runner"):
        upload_text_weights(RecordingContext(), config.text, weights, "f32")
    plain = {n: weights.text[n] for n in weights.text}
    embed = Fp8Tensor(*fp8.quantize(plain["embed_tokens.weight"]), (128, 128), "F32")
    bad = ModelWeights(dict(plain, **{"embed_tokens.weight": embed}), weights.vision, weights.lm_head)
    with pytest.raises(CudaBackendError, match="no FP8 path for embedding: text/embed_tokens.weight"):
        upload_text_weights(RecordingContext(), config.text, bad, "bf16")


def test_row_plan_streams_small_batches_and_gives_cublaslt_whole_multiples() -> None:
    from gpu_engine.cuda.fp8_ops import CUBLAS_M_MULTIPLE, GEMV_MAX_M, row_plan

    assert row_plan(1) == [(0, 1, "gemv")] and row_plan(GEMV_MAX_M) == [(0, GEMV_MAX_M, "gemv")]
    assert row_plan(8192) == [(0, 8192, "cublaslt")]
    m = 8 * CUBLAS_M_MULTIPLE + CUBLAS_M_MULTIPLE - 1
    tail = CUBLAS_M_MULTIPLE - 1
    assert row_plan(m) == [(0, m - tail, "cublaslt"), (m - tail, tail, "gemv")]
    for m in range(GEMV_MAX_M + 1, 200):
        plan = row_plan(m)
        assert sum(rows for _, rows, _ in plan) == m and plan[0][0] == 0 and all(rows > 0 for _, rows, _ in plan)
        assert all(rows % CUBLAS_M_MULTIPLE == 0 for _, rows, path in plan if path == "cublaslt")
        assert all(rows <= 32 for _, rows, path in plan if path == "gemv")

