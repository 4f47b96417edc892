"""Host-to-device uploads through a pinned staging ring, so that an upload never waits for the GPU.

A copy from pageable host memory is staged by the driver and may return only once the stream has drained; the
runner then synchronised after every upload so the host array could die. Each step's tables, the bitmasks and
every page's pixels (tens of MB) thus drained the stream: the GPU sat idle while the host copied the next item.

Here the host bytes are copied (numpy, on the host) into a ring of page-locked memory, and the device copy from
there is a true async copy, ordered on the stream like a kernel. A ring region is reused only after the event
recorded behind its copy has completed; an array larger than a piece (half the ring) goes through in pieces, so
the host fills one half while the DMA engine drains the other. Ordering on the device needs nothing more: the copy
sits in the stream before the kernels that read it and after the ones that read the region's previous contents.

`StagingRing` is the placement rule (pure Python: tested without a GPU); `CudaDevice` owns the pinned buffer and
issues the copies.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

STAGING_BYTES = 128 << 20  # a page's pixels (~53 MB at the document dpi) twice over; steps' tables are ~MB
STAGING_ALIGN = 256


class Completion(Protocol):
    """What the ring waits on before reusing a region (a CUDA event recorded after the region's copy)."""

    def sync(self) -> None: ...

    @property
    def is_done(self) -> bool: ...


@dataclass
class _Busy:
    start: int
    end: int
    done: Completion


class StagingRing:
    """Placement of uploads in a ring of `capacity` bytes: `reserve(n)` returns an offset whose bytes no copy
    still reads (it waits on the completions of the regions in the way, oldest first), `busy(start, n, done)`
    marks a region in use until `done` completes."""

    def __init__(self, capacity: int) -> None:
        if capacity < 2 * STAGING_ALIGN:
            raise ValueError(f"staging ring of {capacity} bytes is too small")
        self.capacity = capacity
        self.piece = capacity // 2 // STAGING_ALIGN * STAGING_ALIGN  # largest single reservation
        self.head = 0
        self._busy: deque[_Busy] = deque()
        self.waits = 0  # times a reservation had to wait for a copy to finish

    def pieces(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset into the host bytes, length) of each piece an upload of `nbytes` goes through."""
        return [(a, min(self.piece, nbytes - a)) for a in range(0, nbytes, self.piece)] or [(0, 0)]

    def reserve(self, nbytes: int) -> int:
        if not 0 <= nbytes <= self.piece:
            raise ValueError(f"a staging reservation holds 0..{self.piece} bytes, asked {nbytes}")
        start = self.head if self.head + nbytes <= self.capacity else 0
        end = start + nbytes
        while self._busy and any(b.start < end and start < b.end for b in self._busy):
            self._busy.popleft().done.sync()  # completions arrive in stream order: the oldest goes first
            self.waits += 1
        self.head = -(-end // STAGING_ALIGN) * STAGING_ALIGN
        return start

    def busy(self, start: int, nbytes: int, done: Completion) -> None:
        self._busy.append(_Busy(start, start + nbytes, done))
        while self._busy[0].done.is_done:  # finished copies need no tracking (the newest may be one of them)
            self._busy.popleft()
            if not self._busy:
                break

    def drain(self) -> None:
        """Wait for every copy (before the pinned buffer is freed)."""
        while self._busy:
            self._busy.popleft().done.sync()
