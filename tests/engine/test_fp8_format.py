"""gpu_engine/fp8.py against independent float64 truth (fp8_truth.py) and against transformers' own quantiser."""
from __future__ import annotations

import numpy as np
import pytest
from fp8_truth import TABLE, bf16_round, decode, dequantize64, fake_quantize64, round_to_e4m3

from gpu_engine import fp8


def fresh_rng() -> np.random.Generator:
    return np.random.default_rng()  # fresh inputs every run; failures print the arrays


def test_every_e4m3_byte_decodes_to_its_bit_layout_value():
    got = fp8.e4m3_to_float32(np.arange(256, dtype=np.uint8)).astype(np.float64)
    nan = np.isnan(TABLE)
    assert list(np.flatnonzero(nan)) == [0x7F, 0xFF]
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], TABLE[~nan])


def test_encoding_rounds_to_nearest_even_and_saturates():
    rng = fresh_rng()
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.uniform(-4, 3, 4000),
                        TABLE[:126] + 1e-9, (TABLE[:125] + TABLE[1:126]) / 2,  # exact ties between neighbours
                        [500.0, -1e6, 448.0, 464.0, 0.0, -0.0]]).astype(np.float32)
    got = fp8.e4m3_to_float32(fp8.float32_to_e4m3(x)).astype(np.float64)
    np.testing.assert_array_equal(got, round_to_e4m3(x))
    assert not np.isnan(got).any()


@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (5, 7), (257, 129)])
def test_quantize_uses_each_blocks_own_amax_and_dequantize_is_exact(shape):
    rng = fresh_rng()
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
    w[: min(3, shape[0]), : min(3, shape[1])] = 0.0
    bits, scale_inv = fp8.quantize(w)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    assert bits.dtype == np.uint8 and bits.shape == shape and scale_inv.dtype == np.float32
    assert scale_inv.shape == grid == fp8.scale_grid(shape)
    for r in range(grid[0]):
        for c in range(grid[1]):
            block = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].astype(np.float64)
            amax = np.abs(block).max()
            scale = (np.float32(1.0) / np.float32(amax)) * np.float32(448.0)  # torch's 448.0 / tensor
            assert scale_inv[r, c] == np.float32(1.0) / scale, (r, c)  # transformers' recipe, ragged edges too
            q = decode(bits[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128])
            assert np.abs(q).max() == 448.0  # the block's largest element maps to the top of the range
            np.testing.assert_array_equal(q, round_to_e4m3(block.astype(np.float32) * scale))
    deq = fp8.dequantize(bits, scale_inv)
    np.testing.assert_array_equal(deq, dequantize64(bits, scale_inv).astype(np.float32))
    # e4m3 keeps 4 significant bits: half a unit in the last place relative, or half the subnormal step
    bound = np.maximum(np.abs(w) * 2.0**-4, fp8.expand_scales(scale_inv, shape) * 2.0**-10)
    assert np.all(np.abs(deq - w) <= bound * (1 + 1e-6))


def test_all_zero_block_keeps_scale_one():
    w = np.zeros((130, 140), np.float32)
    w[129, 139] = 2.0
    bits, scale_inv = fp8.quantize(w)
    np.testing.assert_array_equal(scale_inv, np.array([[1.0, 1.0], [1.0, 2.0 / 448.0]], np.float32))
    np.testing.assert_array_equal(fp8.dequantize(bits, scale_inv), w)


def test_bf16_scales_dequantize_exactly_and_f32_scales_correctly_rounded():
    rng = fresh_rng()
    bits = rng.integers(0, 256, size=(300, 260)).astype(np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x11  # no NaN codes
    scale = np.exp(rng.uniform(-12, 2, size=(3, 3))).astype(np.float32)
    exact = fp8.dequantize(bits, bf16_round(scale))
    np.testing.assert_array_equal(exact.astype(np.float64), dequantize64(bits, bf16_round(scale)))  # no rounding
    np.testing.assert_array_equal(fp8.dequantize(bits, scale), dequantize64(bits, scale).astype(np.float32))


def test_quantize_refuses_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize(np.zeros((2, 3, 4), np.float32))


@pytest.mark.parametrize("features", [128, 200, 37, 384])
def test_activation_quantisation_per_token_and_group(features):
    rng = fresh_rng()
    x = (rng.standard_normal((9, features)) * 10.0 ** rng.uniform(-3, 2, size=(9, 1))).astype(np.float32)
    x[2] = 0.0  # an all-zero token stays zero
    x[3, : min(128, features)] = 0.0  # so does an all-zero group of a token
    got = fp8.fake_quantize_activations(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, fake_quantize64(x).astype(np.float32))
    assert np.all(got[2] == 0) and np.all(got[3, : min(128, features)] == 0)
    # each group's largest |x| lands on 448 * s, i.e. is kept to e4m3 precision
    assert np.all(np.abs(got - x) <= np.abs(x) * 2.0**-4 + np.abs(x).max(axis=1, keepdims=True) / 448 * 2**-10 * 2)


def test_quantize_matches_transformers_fp8quantize_bit_for_bit():
    """transformers 5.17's Fp8Quantize (the op its FP8 integration runs to quantise a BF16 model) on shapes it
    tiles (multiples of 128): the same e4m3 bytes and the same float32 inverse scales."""
    from ci_rule import require_module

    torch = require_module("torch")
    require_module("transformers")
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128])))
    rng = fresh_rng()
    for shape in [(256, 384), (128, 128), (512, 256)]:
        w = bf16_round((rng.standard_normal(shape) * rng.uniform(0.001, 2)).astype(np.float32))
        theirs = op.convert({"x.weight": torch.from_numpy(w).to(torch.bfloat16)})
        bits, scale_inv = fp8.quantize(w)
        np.testing.assert_array_equal(bits, theirs["x.weight"].view(torch.uint8).numpy())
        np.testing.assert_array_equal(scale_inv, theirs["x.weight_scale_inv"].numpy())
