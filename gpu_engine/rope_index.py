"""M-RoPE position ids for a prompt that mixes text, images and video frame groups (transformers' get_rope_index).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .processing_errors import ProcessorError


@dataclass(frozen=True)
class VisionSpan:
    """A run of placeholder tokens that one image or one video frame group fills."""

    kind: str  # "image" | "video"
    start: int
    length: int


def find_vision_spans(token_ids: np.ndarray, image_token_id: int, video_token_id: int) -> list[VisionSpan]:
    """Maximal runs of image or video placeholder tokens, in order."""
    ids = np.asarray(token_ids, dtype=np.int64)
    kind = np.where(ids == image_token_id, 1, np.where(ids == video_token_id, 2, 0))
    change = np.flatnonzero(np.diff(kind)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(ids)]])
    return [
        VisionSpan("image" if kind[s] == 1 else "video", int(s), int(e - s))
        for s, e in zip(starts, ends) if len(ids) and kind[s] != 0
    ]


def text_positions(n: int) -> np.ndarray:
    """M-RoPE position ids [3, n] of a text-only prompt: all three axes advance together, 0..n-1."""
    return np.broadcast_to(np.arange(n, dtype=np.int64), (3, n)).copy()


def rope_index(
    token_ids: Sequence[int] | np.ndarray,
    *,
    image_grid_thw: Sequence[Sequence[int]] | np.ndarray | None,
    video_grid_thw: Sequence[Sequence[int]] | np.ndarray | None,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """M-RoPE position ids [3, T] (temporal, height, width) and the rope delta, as Qwen3.5's get_rope_index.

    Text advances all three axes together. A vision run (one image, or one video frame group: videos are split
    per temporal patch because timestamps separate them) takes t = start, h = start + row, w = start + col over its
    merged grid, then text resumes at start + max(rows, cols). Generated token i (0-based over the whole sequence)
    sits at position i + delta.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0:
        raise ProcessorError("rope_index needs a non-empty 1-D token sequence")
    grids: dict[str, list[tuple[int, ...]]] = {
        "image": [tuple(int(v) for v in g) for g in (image_grid_thw if image_grid_thw is not None else [])],
        "video": [(1, int(g[1]), int(g[2])) for g in (video_grid_thw if video_grid_thw is not None else [])
                  for _ in range(int(g[0]))],
    }
    spans = find_vision_spans(ids, image_token_id, video_token_id)
    for kind in ("image", "video"):
        runs = sum(1 for s in spans if s.kind == kind)
        if runs != len(grids[kind]):
            raise ProcessorError(
                f"{runs} {kind} placeholder runs in the tokens but {len(grids[kind])} {kind} grids "
                "(video grids count once per frame group)"
            )
    positions = np.empty((3, len(ids)), dtype=np.int64)
    next_grid = {"image": iter(grids["image"]), "video": iter(grids["video"])}
    pos = 0  # next text position
    cursor = 0  # next token index
    for span in spans:
        text_len = span.start - cursor
        positions[:, cursor:span.start] = pos + np.arange(text_len)
        pos += text_len
        t, h, w = next(next_grid[span.kind])
        lh, lw = h // spatial_merge_size, w // spatial_merge_size
        if t * lh * lw != span.length:
            raise ProcessorError(
                f"{span.kind} run at token {span.start} has {span.length} placeholders but its grid "
                f"{(t, h, w)} needs {t * lh * lw}"
            )
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        end = span.start + span.length
        positions[0, span.start:end] = tt.reshape(-1) + pos
        positions[1, span.start:end] = hh.reshape(-1) + pos
        positions[2, span.start:end] = ww.reshape(-1) + pos
        pos += max(h, w) // spatial_merge_size
        cursor = end
    positions[:, cursor:] = pos + np.arange(len(ids) - cursor)
    delta = int(positions.max()) + 1 - len(ids)
    return positions, delta
