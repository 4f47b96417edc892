"""Padding a frame plan to whole temporal patches.

Which frames a video contributes is not decided here: `RenderOptions.frame_sampler` brings the model's rule
(docpipe: `gpu_engine.frame_sampling`). Qwen's processor pads the frame list to a multiple of its temporal patch
size (2) by repeating the last frame; `pad_indices` does the same, so the pad is numerically what HF would add.
"""

from __future__ import annotations


def pad_indices(indices: list[int], multiple: int) -> list[int]:
    """Pad to a multiple of `multiple` by repeating the last index (Qwen's temporal patch padding)."""
    if not indices or multiple <= 1:
        return list(indices)
    short = -len(indices) % multiple
    return list(indices) + [indices[-1]] * short
