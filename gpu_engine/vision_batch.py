"""Vision items of one patch grid through the tower in one call (issue 14: "the vision tower batched across images").

Every VisionItem is one image or one video frame group with grid t == 1 (inputs.py), and the tower's attention never
crosses a frame group: n items of grid (1, h, w) stacked row-wise are one item of grid (n, h, w), whose embeddings
are the n items' embeddings one after the other — the same arithmetic, one set of kernel launches and GEMMs n times
taller instead of n. Runners offer it as `encode_vision_batch(items)` (runner_api.py); the encoder cache
(encoder_cache.py: prefetch) groups the items a step needs with `same_grid_groups`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .inputs import VisionItem

MAX_BATCH_PATCHES = 32768  # a group's patches: half the largest image the processors make (the runners' reserve)


def same_grid_groups(items: Sequence[VisionItem], max_patches: int = MAX_BATCH_PATCHES) -> list[list[VisionItem]]:
    """`items` (distinct) in groups of one grid (1, h, w), in first-seen order, each at most `max_patches` patches;
    an item of another t, or larger than the cap, is a group of its own."""
    groups: dict[tuple[int, int, int], list[list[VisionItem]]] = {}
    order: list[list[VisionItem]] = []
    for item in items:
        t, h, w = item.grid_thw
        if t != 1 or h * w > max_patches:
            order.append([item])
            continue
        runs = groups.setdefault(item.grid_thw, [])
        if not runs or (len(runs[-1]) + 1) * h * w > max_patches:
            runs.append([])
            order.append(runs[-1])
        runs[-1].append(item)
    return order


def stacked(items: Sequence[VisionItem]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The pixels and grid of one tower call for a same-grid group."""
    grids = {item.grid_thw for item in items}
    if len(grids) != 1 or next(iter(grids))[0] != 1:
        raise ValueError(f"a batch needs one grid with t == 1, got {sorted(grids)}")
    _, h, w = items[0].grid_thw
    return np.concatenate([np.asarray(item.pixel_values, np.float32) for item in items]), (len(items), h, w)


def row_ranges(items: Sequence[VisionItem]) -> list[tuple[int, int]]:
    """Each item's rows [a, b) of the batch's embeddings."""
    ends = np.cumsum([item.num_tokens for item in items])
    return [(int(e - item.num_tokens), int(e)) for item, e in zip(items, ends)]
