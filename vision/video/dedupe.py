"""Optional near-duplicate frame removal for document videos (off by default, `RenderOptions.dedupe_frames`).

A page held still for 5 s sampled at 2 fps gives 10 frames of the same page; the model needs one. We compare each
frame's perceptual hash (imagehash's pHash: DCT of a 32x32 greyscale thumbnail, 64 bits) with the last frame we
kept and drop it when the Hamming distance is at most `max_distance` bits. pHash ignores the small changes a
handheld camera makes (noise, slight exposure drift) but changes when the content moves or the page turns.
"""

from __future__ import annotations

import imagehash
from PIL import Image


class NearDuplicateFilter:
    def __init__(self, max_distance: int) -> None:
        self.max_distance = max_distance
        self._last: imagehash.ImageHash | None = None

    def keep(self, image: Image.Image) -> bool:
        """True when `image` differs enough from the last kept image (the first image is always kept)."""
        digest = imagehash.phash(image)
        if self._last is not None and digest - self._last <= self.max_distance:
            return False
        self._last = digest
        return True
