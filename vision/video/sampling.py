"""Which frames of a video the model sees: Qwen3-VL's sampling rule.

The rule (transformers' `Qwen3VLVideoProcessor.sample_frames`, reproduced here from its description, not copied):
  n = int(total_frames / video_fps * fps)            # frames at the requested rate
  n = min(max(n, min_frames), max_frames, total_frames)
  indices = round(linspace(0, total_frames - 1, n))  # spread over the whole clip, first and last included
The processor then pads the frame list to a multiple of its temporal patch size (2) by repeating the last frame;
`pad_indices` does the same, so the engine receives an even count and the pad is numerically what HF would add.
"""

from __future__ import annotations

import numpy as np


def qwen_frame_indices(
    total_frames: int, video_fps: float, *, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768
) -> list[int]:
    """Source frame indices (ascending, may repeat for very short clips) Qwen3-VL samples from a clip."""
    if total_frames <= 0:
        raise ValueError(f"total_frames must be > 0, got {total_frames}")
    if video_fps <= 0:
        raise ValueError(f"video_fps must be > 0, got {video_fps}")
    count = int(total_frames / video_fps * fps)
    count = min(max(count, min_frames), max_frames, total_frames)
    return [int(i) for i in np.linspace(0, total_frames - 1, count).round().astype(np.int64)]


def pad_indices(indices: list[int], multiple: int) -> list[int]:
    """Pad to a multiple of `multiple` by repeating the last index (Qwen's temporal patch padding)."""
    if not indices or multiple <= 1:
        return list(indices)
    short = -len(indices) % multiple
    return list(indices) + [indices[-1]] * short
