"""Qwen3-VL frame sampling (gpu_engine.frame_sampling, the rule's one home) equals transformers'
Qwen3VLVideoProcessor.sample_frames (test-only dependency)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.frame_sampling import QwenFrameSampler, qwen_frame_indices


@pytest.fixture(scope="module")
def hf():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )
    from transformers.video_utils import VideoMetadata

    return Qwen3VLVideoProcessor, VideoMetadata


def hf_indices(hf, total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    processor_cls, metadata_cls = hf
    processor = processor_cls(min_frames=min_frames, max_frames=max_frames)
    meta = metadata_cls(total_num_frames=total, fps=video_fps, duration=total / video_fps)
    return [int(i) for i in processor.sample_frames(meta, fps=fps)]


def test_defaults_match_the_processor(hf):
    processor = hf[0]()
    assert (processor.fps, processor.min_frames, processor.max_frames) == (2, 4, 768)
    assert qwen_frame_indices(300, 30.0) == hf_indices(hf, 300, 30.0, 2, 4, 768)


def test_random_settings_match(hf):
    rng = np.random.default_rng()
    for _ in range(300):
        total = int(rng.integers(1, 20_000))
        video_fps = float(rng.choice([1.0, 7.5, 23.976, 24.0, 25.0, 29.97, 30.0, 59.94, 60.0, 120.0]))
        fps = float(rng.choice([0.25, 0.5, 1.0, 2.0, 3.0, 4.0]))
        min_frames = int(rng.integers(1, 10))
        max_frames = int(rng.integers(min_frames, 1000))
        ours = qwen_frame_indices(total, video_fps, fps=fps, min_frames=min_frames, max_frames=max_frames)
        assert ours == hf_indices(hf, total, video_fps, fps, min_frames, max_frames), (total, video_fps, fps)


@pytest.mark.parametrize("total, video_fps", [(1, 30.0), (3, 30.0), (4, 30.0), (5, 1.0), (100_000, 30.0)])
def test_edges_match(hf, total, video_fps):
    # fewer frames than min_frames, exactly min_frames, and a clip long enough to hit max_frames
    assert qwen_frame_indices(total, video_fps) == hf_indices(hf, total, video_fps, 2, 4, 768)


def test_sampler_binds_the_rule():
    sampler = QwenFrameSampler(fps=1.0, max_frames=6)
    assert sampler(300, 30.0) == qwen_frame_indices(300, 30.0, fps=1.0, max_frames=6)
    with pytest.raises(ValueError, match="min_frames <= max_frames"):
        QwenFrameSampler(min_frames=8, max_frames=4)


@pytest.mark.parametrize("total, video_fps", [(0, 30.0), (10, 0.0)])
def test_bad_inputs(total, video_fps):
    with pytest.raises(ValueError):
        qwen_frame_indices(total, video_fps)
