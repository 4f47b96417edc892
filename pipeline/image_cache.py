"""A small in-process cache of rendered page images, keyed by the blob key of their PNG.

When one process both ingests and runs a job (the embedded path, or a worker that takes both queues) the page
images are still in memory: decoding their PNGs again would cost ~5-20 ms per page for nothing. PNG is lossless,
so a cached image is pixel-identical to the decoded blob: results do not depend on whether the cache hit.
Bounded by bytes (least recently used out first); a budget of 0 turns it off.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from PIL import Image


class ImageCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Image.Image] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _size(image: Image.Image) -> int:
        return image.width * image.height * len(image.getbands())

    def put(self, key: str, image: Image.Image) -> None:
        size = self._size(image)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            self._items[key] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= self._size(old)

    def get(self, key: str) -> Image.Image | None:
        with self._lock:
            image = self._items.get(key)
            if image is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return image

    @property
    def nbytes(self) -> int:
        return self._bytes
