"""What the processor hands to the engine: token ids, M-RoPE positions and the vision items inside them.

Shared by the processor (producer), the scheduler/engine (which chunks prompts) and every runner (consumer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # typing.TypeIs is 3.13+; only the type checker needs it
    from typing_extensions import TypeIs


@dataclass(frozen=True)
class VisionItem:
    """One unit the vision tower encodes on its own: an image, or ONE temporal frame group of a video.

    Videos are split into frame groups (grid t == 1 each) because the tower's attention never crosses a
    frame group, so encoding them one by one is exact and keeps encoder memory bounded by one group.
    """

    kind: str  # "image" | "video"
    pixel_values: np.ndarray  # float32 [grid_t*grid_h*grid_w, channels*temporal_patch*patch*patch]
    grid_thw: tuple[int, int, int]
    token_start: int  # index in the prompt's token ids of the first placeholder token of this item
    num_tokens: int  # placeholders = grid_t*grid_h*grid_w // merge_size**2
    content_hash: str  # sha256 over pixel bytes + grid + processor parameters (encoder- and prefix-cache key)
    timestamp: float | None = None  # seconds, video frame groups only

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_tokens


@dataclass
class ProcessedPrompt:
    """A fully expanded prompt: one placeholder token per merged vision token."""

    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [3, T]  M-RoPE (temporal, height, width) position ids
    rope_delta: int  # position of generated token i (0-based in the whole sequence) is i + rope_delta
    vision_items: list[VisionItem] = field(default_factory=list)  # ordered by token_start

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def is_token_ids(value: object) -> TypeIs[Sequence[int] | np.ndarray]:
    """A prompt given as token ids rather than chat messages: an integer numpy array, or a non-empty sequence (not
    str / bytes) of ints (bools are not token ids). Callers check the shape (1-D) with their own words."""
    if isinstance(value, np.ndarray):
        return bool(np.issubdtype(value.dtype, np.integer))
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) > 0
            and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value))
