"""Per-frame geometry of the Qwen vision tower, shared by the numpy tower (reference/vision_tower.py) and the GPU
one (cuda/vision.py): where each patch sits in its frame and how the learned position table is resampled onto
the frame. It depends on the grid only, never on weights."""
from __future__ import annotations

import numpy as np


def merge_window_coords(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of one h x w frame, in the processors' merge-window row order."""
    raster = np.arange(h * w).reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
    return raster // w, raster % w


def bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source taps (lo, hi) and the weight of hi for resampling `side` table points to `size` grid points,
    align_corners=True: the grid's first and last points sit exactly on the table's first and last entries."""
    src = index * (side - 1) / max(size - 1, 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, side - 1)
    return lo, hi, src - lo
