"""FP8 (e4m3) KV cache of the reference runner (issue 15 item 5): the per-(token, kv head) quantisation against
float64 truth, zero-amax tokens, the cache array the attention code indexes, the option's refusals, the bytes the
cache sizing sees, and the model end to end against the normal float32 KV cache."""
from __future__ import annotations

import numpy as np
import pytest

import gpu_engine
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.fp8 import E4M3_MAX
from gpu_engine.params import SamplingParams
from gpu_engine.reference.fp8_kv import Fp8KvArray, dequantize_kv, kv_array, quantize_kv
from gpu_engine.tiny import make_tiny_checkpoint

# e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 relative for normal numbers; below the smallest normal
# (2^-6, after scaling) the spacing is 2^-9, so the error is within 2^-10 absolute (in scaled units)
REL_BOUND = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


def _wide_range(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values whose magnitudes span 10 decades across tokens and heads and 3 within a head, both signs."""
    row_scale = 10.0 ** rng.uniform(-6, 4, shape[:-1])[..., None]
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-1.5, 1.5, shape) * row_scale).astype(np.float32)


def test_round_trip_is_within_e4m3_rounding_of_float64_truth():
    x = _wide_range(np.random.default_rng(0), (257, 3, 64))
    bits, scale = quantize_kv(x)
    assert bits.dtype == np.uint8 and bits.shape == x.shape and scale.shape == x.shape[:-1]
    truth = x.astype(np.float64)
    amax = np.abs(truth).max(axis=-1)
    np.testing.assert_allclose(scale, amax / E4M3_MAX, rtol=1e-6)  # the row's largest value maps to 448
    err = np.abs(dequantize_kv(bits, scale).astype(np.float64) - truth)
    bound = np.maximum(REL_BOUND * np.abs(truth), SUBNORMAL_ABS * scale[..., None].astype(np.float64))
    assert (err <= bound * (1 + 1e-5)).all(), float((err / bound).max())
    # nearest rounding, not truncation: the worst relative error of the normal numbers comes close to the bound,
    # while the typical one is about a quarter of it
    normal = np.abs(truth) >= 2.0**-6 * scale[..., None]
    rel = err[normal] / np.abs(truth[normal])
    assert 0.8 * REL_BOUND < rel.max() <= REL_BOUND * (1 + 1e-5)
    assert rel.mean() < 0.5 * REL_BOUND


def test_a_zero_token_head_reads_back_as_exact_zeros():
    x = np.random.default_rng(1).standard_normal((4, 2, 32)).astype(np.float32)
    x[1] = 0.0  # a whole token
    x[2, 1] = 0.0  # one head of a token
    bits, scale = quantize_kv(x)
    assert scale[1].tolist() == [1.0, 1.0] and scale[2, 1] == 1.0 and np.isfinite(scale).all()
    out = dequantize_kv(bits, scale)
    assert not np.isnan(out).any()
    assert (out[1] == 0).all() and (out[2, 1] == 0).all()
    assert (np.abs(out[0] - x[0]) <= REL_BOUND * np.abs(x[0]) + 1e-7).all()


def test_the_cache_array_stores_bytes_and_reads_like_the_float32_cache():
    shape = (6, 4, 2, 32)  # blocks, block_size, kv heads, head_dim
    fp8, plain = kv_array("fp8_e4m3", shape), kv_array("auto", shape)
    assert isinstance(fp8, Fp8KvArray) and isinstance(plain, np.ndarray) and plain.dtype == np.float32
    x = np.random.default_rng(2).standard_normal((7, 2, 32)).astype(np.float32) * 5
    blocks, offsets = np.array([5, 5, 5, 5, 0, 0, 0]), np.array([0, 1, 2, 3, 0, 1, 2])
    fp8[blocks, offsets] = x
    plain[blocks, offsets] = x
    assert fp8.bits.dtype == np.uint8 and fp8.nbytes == 6 * 4 * 2 * (32 + 4)
    np.testing.assert_array_equal(fp8[blocks, offsets], dequantize_kv(*quantize_kv(x)))
    assert not np.array_equal(fp8[blocks, offsets], plain[blocks, offsets])  # quantised, not stored as float32
    assert (fp8[np.array([1, 5]), np.array([0, 3])][0] == 0).all()  # an unwritten slot reads as zeros


@pytest.mark.parametrize("value", ["fp8", "e4m3", "bf16", ""])
def test_an_unknown_kv_cache_dtype_is_refused_by_name(value, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        gpu_engine.load(tmp_path / "no-such-checkpoint", kv_cache_dtype=value)


def test_the_cuda_runner_takes_the_same_kv_cache_dtypes_by_name():
    from gpu_engine.cuda.options import CudaOptions  # its FP8 cache: tests/cuda_runner/test_kv_fp8.py

    assert CudaOptions(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CudaOptions(kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8kv"), seed=0)


def test_cache_bytes_per_token_count_one_byte_and_a_scale(tiny):
    plain, fp8 = gpu_engine.load(tiny), gpu_engine.load(tiny, kv_cache_dtype="fp8_e4m3")
    t = plain.config.text
    layers = len(t.full_attention_layers)
    assert plain.runner.kv_bytes_per_block(16) == layers * 2 * 16 * t.num_key_value_heads * t.head_dim * 4
    assert fp8.runner.kv_bytes_per_block(16) == layers * 2 * 16 * t.num_key_value_heads * (t.head_dim + 4)
    # and the engine's byte budget holds that many more blocks
    budget = EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=2)
    a = Engine.from_pretrained(tiny, config=budget).stats()
    b = Engine.from_pretrained(tiny, config=budget, kv_cache_dtype="fp8_e4m3").stats()
    assert b["kv_blocks_total"] > 3 * a["kv_blocks_total"]


def test_the_model_with_fp8_kv_stays_close_to_the_normal_kv(tiny):
    """Fails if the quantisation is skipped (logits equal) and if it is wrong (beyond the measured bound:
    bench/results/fp8_kv_accuracy.json: rel-L2 <= 1.03e-2 at every position, mean 1.1e-3, on the tiny models; this
    prompt measured 8.2e-3 / 1.3e-3 and 32 of 32 greedy tokens equal)."""
    ids = (np.arange(600) * 7919) % 1500 + 3  # a long-ish text prompt
    plain, fp8 = gpu_engine.load(tiny), gpu_engine.load(tiny, kv_cache_dtype="fp8_e4m3")
    a, b = plain.logits(ids), fp8.logits(ids, chunk_size=256)  # chunked: later chunks read earlier chunks' bytes
    rel = np.linalg.norm(b - a, axis=1) / np.linalg.norm(a, axis=1)
    assert rel.max() < 1.5e-2 and rel.mean() < 3e-3
    assert rel.mean() > 2e-4  # the attention read quantised keys and values
    assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() > 0.98
    assert isinstance(fp8.runner.k_cache[3], Fp8KvArray)
    ours = fp8.generate(list(ids[:200]), max_tokens=32, stop_token_ids=[])
    normal = plain.generate(list(ids[:200]), max_tokens=32, stop_token_ids=[])
    assert sum(x == y for x, y in zip(ours, normal)) >= 30
    # the serving engine with the option generates the same tokens as the one-sequence helper
    engine = Engine.from_pretrained(tiny, kv_cache_dtype="fp8_e4m3")
    [out] = engine.generate(list(ids[:200]), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert out.token_ids == ours
