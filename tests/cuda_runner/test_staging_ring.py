"""The pinned staging ring's placement rule (gpu_engine/cuda/staging.py), without a GPU: reservations never overlap
a region whose copy is still pending, they wait for the oldest pending copies first, and big uploads split."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.cuda.staging import STAGING_ALIGN, StagingRing


class FakeCopy:
    """A copy that completes when the test says so (or when waited on, as a CUDA event does)."""

    def __init__(self, log: list[int], tag: int) -> None:
        self.log, self.tag, self.done = log, tag, False

    def sync(self) -> None:
        self.done = True
        self.log.append(self.tag)

    @property
    def is_done(self) -> bool:
        return self.done


def test_reservations_never_overlap_pending_copies() -> None:
    rng = np.random.default_rng()
    capacity = int(rng.integers(8, 40)) * STAGING_ALIGN
    ring = StagingRing(capacity)
    pending: list[tuple[int, int, FakeCopy]] = []
    log: list[int] = []
    for tag in range(400):
        n = int(rng.integers(0, ring.piece + 1))
        at = ring.reserve(n)
        assert 0 <= at and at + n <= capacity and at % STAGING_ALIGN == 0
        pending = [p for p in pending if not p[2].done]
        for start, length, _ in pending:
            assert at + n <= start or start + length <= at, "reserved bytes a pending copy still reads"
        copy = FakeCopy(log, tag)
        ring.busy(at, n, copy)
        pending.append((at, n, copy))
        for p in pending:  # the GPU finishes some copies on its own, always in stream order
            if rng.random() < 0.3 and all(q[2].done for q in pending[: pending.index(p)]):
                p[2].done = True
    assert log == sorted(log), "waited on a newer copy before an older one"


def test_wait_happens_only_when_the_ring_wraps_onto_a_pending_copy() -> None:
    ring = StagingRing(4 * STAGING_ALIGN)
    log: list[int] = []
    first, second = FakeCopy(log, 0), FakeCopy(log, 1)
    ring.busy(ring.reserve(2 * STAGING_ALIGN), 2 * STAGING_ALIGN, first)
    ring.busy(ring.reserve(2 * STAGING_ALIGN), 2 * STAGING_ALIGN, second)
    assert ring.waits == 0 and log == []
    assert ring.reserve(STAGING_ALIGN) == 0  # wraps: the first region's copy must be over
    assert log == [0] and ring.waits == 1
    second.done = True  # finished on its own: no wait needed to reuse its bytes
    ring.busy(0, STAGING_ALIGN, FakeCopy(log, 2))
    assert ring.reserve(2 * STAGING_ALIGN) == STAGING_ALIGN and log == [0]  # overlaps the finished second one


def test_pieces_cover_an_upload_in_order() -> None:
    ring = StagingRing(10 * STAGING_ALIGN)
    n = 3 * ring.piece + 17
    pieces = ring.pieces(n)
    assert [p[0] for p in pieces] == [0, ring.piece, 2 * ring.piece, 3 * ring.piece]
    assert sum(p[1] for p in pieces) == n and max(p[1] for p in pieces) == ring.piece
    assert ring.pieces(0) == [(0, 0)]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        StagingRing(STAGING_ALIGN)
    ring = StagingRing(8 * STAGING_ALIGN)
    with pytest.raises(ValueError, match="staging reservation"):
        ring.reserve(ring.piece + 1)
    with pytest.raises(ValueError, match="staging reservation"):
        ring.reserve(-1)


def test_drain_waits_for_every_copy() -> None:
    ring = StagingRing(8 * STAGING_ALIGN)
    log: list[int] = []
    for tag in range(3):
        ring.busy(ring.reserve(STAGING_ALIGN), STAGING_ALIGN, FakeCopy(log, tag))
    ring.drain()
    assert log == [0, 1, 2]
