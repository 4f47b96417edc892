"""Bad inputs to the CUDA op launchers are refused before anything reaches a GPU (runs without one)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_engine.cuda import ops
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.errors import ShapeError
from tests.cuda_runner import logits_checks
from tests.cuda_runner.no_launch import arr, no_launch_ctx


@pytest.fixture()
def ctx() -> SimpleNamespace:
    return no_launch_ctx()


def test_mixed_float_dtypes_are_refused(ctx) -> None:
    with pytest.raises(ShapeError, match="one float dtype"):
        ops.add(ctx, arr((4, 8)), arr((4, 8), "f32"), arr((4, 8)))


def test_norm_weight_must_match_dim(ctx) -> None:
    with pytest.raises(ShapeError, match="norm weight"):
        ops.rmsnorm(ctx, arr((4, 8)), arr((4, 8)), arr((7,)), 4, 8, 1e-6, True)
    with pytest.raises(ShapeError, match="add_rmsnorm shapes"):
        ops.add_rmsnorm(ctx, arr((4, 8)), arr((4, 8)), arr((4, 9)), arr((8,)), 1e-6, True)


def test_silu_mul_needs_gate_and_up_halves(ctx) -> None:
    with pytest.raises(ShapeError, match="silu_mul"):
        ops.silu_mul(ctx, arr((3, 10)), arr((3, 10)))


def test_rope_tables_must_fit_rot_dim(ctx) -> None:
    with pytest.raises(ShapeError, match="rope tables"):
        ops.rope(ctx, arr((5, 64)), 5, 2, 16, 64, 32, arr((3, 5), "i32"), arr((7,), "f32"), arr((8,), "i32"))
    with pytest.raises(ShapeError, match="pos must be i32"):
        ops.rope(ctx, arr((5, 64)), 5, 2, 16, 64, 32, arr((3, 5), "f32"), arr((8,), "f32"), arr((8,), "i32"))


def test_embed_ids_must_be_int32(ctx) -> None:
    with pytest.raises(ShapeError, match="ids must be i32"):
        ops.embed_gather(ctx, arr((3, 16)), arr((100, 16)), arr((3,), "f32"))


def test_attention_limits(ctx) -> None:
    common = dict(k_cache=arr((4, 16, 2, 512)), v_cache=arr((4, 16, 2, 512)), block_tables=arr((1, 4), "i32"),
                  token_seq=arr((1,), "i32"), token_pos=arr((1,), "i32"))
    with pytest.raises(ShapeError, match="head_dim <= 256"):
        ops.paged_attention(ctx, arr((1, 4096)), arr((1, 4096)), 4096, arr((1, 8192)), 8192, 1024, heads=8,
                            kv_heads=2, head_dim=512, block_size=16, scale=0.1, **common)
    with pytest.raises(ShapeError, match="heads % kv_heads"):
        ops.paged_attention(ctx, arr((1, 768)), arr((1, 768)), 768, arr((1, 1536)), 1536, 256, heads=3,
                            kv_heads=2, head_dim=256, block_size=16, scale=0.1, **common)


def test_attention_method_choice(ctx) -> None:
    def call(method: str, heads: int, kv_heads: int, head_dim: int) -> None:
        cache = arr((4, 16, kv_heads, head_dim))
        ops.paged_attention(ctx, arr((1, heads * head_dim)), arr((1, heads * head_dim)), heads * head_dim,
                            arr((1, 2 * heads * head_dim)), 2 * heads * head_dim, 2 * head_dim, cache, cache,
                            arr((1, 4), "i32"), arr((1,), "i32"), arr((1,), "i32"), heads, kv_heads, head_dim, 16,
                            0.1, method=method)

    with pytest.raises(ShapeError, match="method must be"):
        call("fastest", 8, 2, 256)
    with pytest.raises(ShapeError, match="grouped paged_attention needs"):
        call("grouped", 10, 2, 256)  # 5 query heads per KV head: no kernel compiled for that group
    with pytest.raises(ShapeError, match="grouped paged_attention needs"):
        call("grouped", 8, 2, 96)  # not a power-of-two head size
    assert ops.gqa_attention_fits(arr((1, 6 * 256)), 6 * 256, arr((4, 16, 1, 256)), arr((4, 16, 1, 256)), 6, 1, 256)
    misaligned = DArray((1 << 20) + 2, (1, 6 * 256), "bf16")
    assert not ops.gqa_attention_fits(misaligned, 6 * 256, arr((4, 16, 1, 256)), arr((4, 16, 1, 256)), 6, 1, 256)
    assert not ops.gqa_attention_fits(arr((1, 6 * 256)), 6 * 256 + 1, arr((4, 16, 1, 256)), arr((4, 16, 1, 256)),
                                      6, 1, 256)
    with pytest.raises(ShapeError, match="mma paged_attention needs"):
        call("mma", 18, 2, 256)  # 9 query heads per KV head: more than the score mma's 8 columns
    with pytest.raises(ShapeError, match="mma paged_attention needs"):
        call("mma", 8, 2, 96)  # no kernel built for that head size
    cache = arr((4, 16, 4, 256))
    assert ops.paged_mma_fits(arr((1, 16 * 256)), 16 * 256, cache, cache, 16, 4, 256)
    assert not ops.paged_mma_fits(arr((1, 16 * 256), "f32"), 16 * 256, arr((4, 16, 4, 256), "f32"),
                                  arr((4, 16, 4, 256), "f32"), 16, 4, 256)  # bf16 only
    assert not ops.paged_mma_fits(DArray((1 << 20) + 2, (1, 16 * 256), "bf16"), 16 * 256, cache, cache, 16, 4, 256)


def test_deltanet_shapes(ctx) -> None:
    with pytest.raises(ShapeError, match="K=9"):
        ops.conv1d_silu(ctx, arr((2, 64)), 64, arr((2, 64)), 64, arr((64, 9)), arr((4, 8, 64)),
                        arr((2,), "i32"), arr((1,), "i32"), arr((1,), "i32"))
    x = arr((2, 64))
    with pytest.raises(ShapeError, match="state"):
        ops.gated_delta_rule(ctx, arr((2, 64)), x, x, x, 64, x, x, 64, arr((2,), "f32"), arr((2,), "f32"),
                             arr((4, 2, 32, 16), "f32"), arr((2,), "i32"), arr((1,), "i32"), arr((1,), "i32"),
                             k_heads=1, v_heads=2, dk=32, dv=32)
    with pytest.raises(ShapeError, match="rows must be 1 or 4"):
        ops.gated_delta_rule(ctx, arr((2, 64)), x, x, x, 64, x, x, 64, arr((2,), "f32"), arr((2,), "f32"),
                             arr((4, 2, 32, 32), "f32"), arr((2,), "i32"), arr((1,), "i32"), arr((1,), "i32"),
                             k_heads=1, v_heads=2, dk=32, dv=32, method="two_pass", rows=2)
    with pytest.raises(ShapeError, match="method"):
        ops.gated_delta_rule(ctx, arr((2, 64)), x, x, x, 64, x, x, 64, arr((2,), "f32"), arr((2,), "f32"),
                             arr((4, 2, 32, 32), "f32"), arr((2,), "i32"), arr((1,), "i32"), arr((1,), "i32"),
                             k_heads=1, v_heads=2, dk=32, dv=32, method="chunked")
    with pytest.raises(ShapeError, match="decode needs dk == 128"):
        ops.gated_delta_rule(ctx, arr((2, 64)), x, x, x, 64, x, x, 64, arr((2,), "f32"), arr((2,), "f32"),
                             arr((4, 2, 32, 32), "f32"), arr((2,), "i32"), arr((1,), "i32"), arr((1,), "i32"),
                             k_heads=1, v_heads=2, dk=32, dv=32, method="decode")
    assert ops.gdn_decode_fits(arr((4, 32, 128, 128), "f32"), 128, 128)
    assert not ops.gdn_decode_fits(arr((4, 32, 256, 128), "f32"), 128, 256)  # more columns than 8 warps x 16


def test_sampling_inputs(ctx) -> None:
    with pytest.raises(ShapeError, match="logits must be f32"):
        logits_checks.argmax(ctx, arr((2,), "i32"), arr((2, 100)))
    with pytest.raises(ShapeError, match="bitmask"):
        logits_checks.apply_bitmask(ctx, arr((2, 100), "f32"), arr((2, 3), "u32"))


def test_darray_views_stay_inside() -> None:
    a = DArray(4096, (4, 8), "bf16")
    assert a.view((2, 8), 16).ptr == 4096 + 32
    assert a.at(3).shape == (29,)
    with pytest.raises(ShapeError):
        a.view((4, 8), 1)
    with pytest.raises(ShapeError):
        a.at(32)
