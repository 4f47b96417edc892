"""gpu_engine.load(...) hands the runner's own vision embeddings object to forward (VisionSlice.embeddings is
runner-native): a GPU runner's device embeddings must not be copied to the host between encode and scatter."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image

import gpu_engine
from gpu_engine.runner_api import StepBatch, StepOutput
from gpu_engine.tiny import make_tiny_checkpoint


class NativeEmbeddings:
    """Stands in for a device array: shape, row slices, and a host copy only when someone asks (np.asarray)."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data
        self.shape = data.shape

    def __getitem__(self, rows: slice) -> NativeEmbeddings:
        return NativeEmbeddings(self._data[rows])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._data if dtype is None else self._data.astype(dtype)


def test_vision_embeddings_reach_the_runner_unconverted(tmp_path):
    model = gpu_engine.load(make_tiny_checkpoint(tmp_path / "ckpt", seed=5))
    rng = np.random.default_rng()
    image = Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Read it"}]}]
    expected = model.logits_for_messages(messages, chunk_size=5)  # the plain reference path (numpy embeddings)

    runner = model.runner
    encode, forward = runner.encode_vision, runner.forward
    seen: list[type] = []

    def native_encode(item):
        return NativeEmbeddings(encode(item))

    def recording_forward(batch: StepBatch) -> StepOutput:
        seen.extend(type(v.embeddings) for c in batch.chunks for v in c.vision)
        return forward(batch)

    runner.encode_vision, runner.forward = native_encode, recording_forward
    got = model.logits_for_messages(messages, chunk_size=5)
    assert seen and all(t is NativeEmbeddings for t in seen)
    # Same numbers: the reference runner reads the runner-native object through np.asarray. float32, same order of
    # operations, so equal to rounding only.
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_encoder_returning_the_wrong_row_count_is_a_clear_error(tmp_path):
    model = gpu_engine.load(make_tiny_checkpoint(tmp_path / "ckpt", seed=6))
    encode = model.runner.encode_vision
    model.runner.encode_vision = lambda item: encode(item)[:-1]
    image = Image.fromarray(np.zeros((32, 32, 3), np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "x"}]}]
    with pytest.raises(ValueError, match="placeholders"):
        model.logits_for_messages(messages)
