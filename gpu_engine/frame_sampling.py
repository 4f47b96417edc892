"""Which frames of a video the model sees: Qwen3-VL's sampling rule, in its one home.

The rule (transformers' `Qwen3VLVideoProcessor.sample_frames`, reproduced from its description, not copied):
  n = int(total_frames / video_fps * fps)            # frames at the requested rate
  n = min(max(n, min_frames), max_frames, total_frames)
  indices = round(linspace(0, total_frames - 1, n))  # spread over the whole clip, first and last included

The engine's `VideoProcessor` samples frame lists with it; callers that decode videos themselves (docpipe's
`vision` package, which must not import the engine) are handed a `QwenFrameSampler` by whoever configures both, so
a video is sampled once, by this rule, and its frames reach the engine already chosen.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def qwen_frame_indices(
    total_frames: int, video_fps: float, *, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768
) -> list[int]:
    """Source frame indices (ascending) Qwen3-VL samples from a clip of `total_frames` at `video_fps`."""
    if total_frames <= 0:
        raise ValueError(f"total_frames must be > 0, got {total_frames}")
    if video_fps <= 0:
        raise ValueError(f"video_fps must be > 0, got {video_fps}")
    count = int(total_frames / video_fps * fps)
    return spread_indices(total_frames, min(max(count, min_frames), max_frames, total_frames))


def spread_indices(total_frames: int, count: int) -> list[int]:
    """`count` indices spread evenly over a clip, first and last frame included (repeats when count > total)."""
    return [int(i) for i in np.linspace(0, total_frames - 1, count).round().astype(np.int64)]


@dataclass(frozen=True)
class QwenFrameSampler:
    """`qwen_frame_indices` with its parameters bound: called as `sampler(total_frames, video_fps)`."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    def __post_init__(self) -> None:
        if self.fps <= 0 or self.min_frames < 1 or self.max_frames < self.min_frames:
            raise ValueError(f"QwenFrameSampler needs fps > 0 and 1 <= min_frames <= max_frames, got {self}")

    def __call__(self, total_frames: int, video_fps: float) -> list[int]:
        return qwen_frame_indices(total_frames, video_fps, fps=self.fps, min_frames=self.min_frames,
                                  max_frames=self.max_frames)
