"""The text-weight upload (gpu_engine/cuda/weights.py) on the CPU: with a bf16 runner it takes a BF16 checkpoint's
stored bits as they are (no float32 round trip), and what reaches the device is byte for byte what rounding the
loader's float32 values to bf16 gives (the path it replaced); an f32 runner gets the loader's float32 values.
A recording stand-in for GpuContext keeps each named upload."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.config import ModelConfig
from gpu_engine.cuda.bf16 import f32_to_bf16_bits
from gpu_engine.cuda.weights import upload_text_weights
from gpu_engine.loader import ModelWeights, load_weights
from gpu_engine.tiny import make_tiny_checkpoint
from tests.cuda_runner.recording_context import RecordingContext


def _upload(folder, dtype: str) -> dict[str, np.ndarray]:
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    ctx = RecordingContext()
    upload_text_weights(ctx, config.text, weights, dtype)
    return ctx.sent


def _expected(folder, dtype: str) -> dict[str, np.ndarray]:
    """The old path: the loader's float32 values (a plain dict, so nothing raw is reached), rounded to bf16."""
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    plain = {n: np.array(weights.text[n], np.float32) for n in weights.text}
    head = None if weights.tied else np.array(weights.lm_head, np.float32)
    replica = ModelWeights(plain, weights.vision, head)
    ctx = RecordingContext()
    upload_text_weights(ctx, config.text, replica, dtype)
    return ctx.sent


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_checkpoint_reaches_the_device_with_its_stored_bits(tmp_path, tied: bool) -> None:
    seed = int(np.random.default_rng().integers(1 << 30))
    folder = make_tiny_checkpoint(tmp_path / "m", seed=seed, dtype="bfloat16", tie_word_embeddings=tied)
    sent, expected = _upload(folder, "bf16"), _expected(folder, "bf16")
    assert sent.keys() == expected.keys()
    assert ("lm_head" in sent) is (not tied)  # a tied head is the embedding itself, uploaded once
    for name in expected:
        assert np.array_equal(sent[name], expected[name]), name
    # and the bits are the file's: the embedding equals the stored bf16 rounded from nothing
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    assert np.array_equal(sent["embed_tokens"], f32_to_bf16_bits(weights.text["embed_tokens.weight"]))


def test_an_f32_runner_gets_the_loaders_float32_values(tmp_path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=int(np.random.default_rng().integers(1 << 30)),
                                  dtype="bfloat16")
    sent, expected = _upload(folder, "f32"), _expected(folder, "f32")
    for name in expected:
        assert sent[name].dtype == np.float32 and np.array_equal(sent[name], expected[name]), name
