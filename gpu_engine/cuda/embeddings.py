"""Vision embeddings that stay on the GPU between encode_vision() and the prefill steps that scatter them.

The engine's encoder cache keeps encoded items for a while and evicts them in LRU order, so their memory cannot
come from the arena's stack. A fixed region of the arena (taken at start-up) is managed here by a first-fit
allocator with coalescing free ranges; a block goes back to it when the last Python reference to its
embeddings (the cache entry and every slice the engine cut from it) is gone.

DeviceEmbeddings is the runner-native array of the runner contract: `.shape`, `.dtype`, `.nbytes`, row slices
`emb[a:b]` (views sharing the block) and `np.asarray(emb)` (a float32 download, for host-side callers).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .arena import ALIGN
from .errors import ShapeError


@dataclass
class BlockPool:
    """First-fit allocator over [base, base + capacity) (pure bookkeeping on integer addresses)."""

    base: int
    capacity: int
    free: list[tuple[int, int]] = field(default_factory=list)  # (offset, size), sorted, coalesced

    def __post_init__(self) -> None:
        if self.capacity > 0 and not self.free:
            self.free = [(0, self.capacity)]

    def alloc(self, nbytes: int) -> int | None:
        """Address of a block of at least nbytes (ALIGN-aligned), or None when no free range is large enough."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (off, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, room - size)
                return self.base + off
        return None

    def release(self, ptr: int, nbytes: int) -> None:
        """Return a block (same nbytes as allocated); neighbours merge into one free range."""
        off, size = ptr - self.base, -(-max(nbytes, 1) // ALIGN) * ALIGN
        if off < 0 or off + size > self.capacity:
            raise ValueError(f"block at {ptr:#x} (+{size}) is outside the pool")
        ranges = sorted(self.free + [(off, size)])
        merged: list[tuple[int, int]] = []
        for o, s in ranges:
            if merged and merged[-1][0] + merged[-1][1] > o:
                raise ValueError(f"block at {ptr:#x} released twice or overlapping a free range")
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.free = merged

    @property
    def free_bytes(self) -> int:
        return sum(s for _, s in self.free)


class _Block:
    """Owns one pool block; releases it when garbage-collected."""

    def __init__(self, pool: BlockPool, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self._finalizer = weakref.finalize(self, pool.release, ptr, nbytes)


class DeviceEmbeddings:
    """[rows, hidden] embeddings in device memory (a view of a pool block)."""

    def __init__(self, owner: _Block, ptr: int, shape: tuple[int, int], dtype: str, download: Any) -> None:
        self._owner, self.ptr, self.shape, self.dtype, self._download = owner, ptr, shape, dtype, download

    @classmethod
    def allocate(cls, pool: BlockPool, shape: tuple[int, int], dtype: str, itemsize: int,
                 download: Any) -> DeviceEmbeddings | None:
        nbytes = shape[0] * shape[1] * itemsize
        ptr = pool.alloc(nbytes)
        if ptr is None:
            return None
        return cls(_Block(pool, ptr, nbytes), ptr, shape, dtype, download)

    @property
    def itemsize(self) -> int:
        return {"bf16": 2, "f32": 4}[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> DeviceEmbeddings:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise ShapeError(f"device embeddings support contiguous row slices only, got {rows!r}")
        start, stop, _ = rows.indices(self.shape[0])
        stop = max(start, stop)
        ptr = self.ptr + start * self.shape[1] * self.itemsize
        return DeviceEmbeddings(self._owner, ptr, (stop - start, self.shape[1]), self.dtype, self._download)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = self._download(self)
        return host if dtype is None else host.astype(dtype)

    def __repr__(self) -> str:
        return f"DeviceEmbeddings(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"
