"""One device allocation, sub-allocated by a bump arena.

The runner takes its whole memory budget once at start-up and carves it into named regions (weights, KV blocks,
state slots, activations, encoder cache). Regions live as long as the arena; per-step scratch uses mark/release
so that its peak is bounded and nothing fragments. Pure Python over integer addresses: testable without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ArenaExhausted

ALIGN = 256  # cuBLASLt and 16-byte vector loads both want aligned bases; 256 also matches cudaMalloc's alignment


@dataclass(frozen=True)
class Region:
    name: str
    ptr: int
    nbytes: int


@dataclass
class Arena:
    base: int
    capacity: int
    used: int = 0
    peak: int = 0  # high-water mark of `used` (what the budget must at least hold)
    regions: list[Region] = field(default_factory=list)

    def alloc(self, nbytes: int, name: str) -> int:
        """Reserve `nbytes` (rounded up to ALIGN) and return the device address."""
        if nbytes < 0:
            raise ValueError(f"negative allocation {nbytes} for {name!r}")
        start = _round_up(self.used, ALIGN)
        end = start + _round_up(max(nbytes, 1), ALIGN)
        if end > self.capacity:
            raise ArenaExhausted(
                f"arena budget exhausted allocating {name!r}: need {nbytes} bytes, "
                f"{self.capacity - start} of {self.capacity} left; raise the GPU memory budget or lower "
                f"max_num_seqs / KV blocks / max_batched_tokens"
            )
        self.used = end
        self.peak = max(self.peak, end)
        region = Region(name, self.base + start, nbytes)
        self.regions.append(region)
        return region.ptr

    def mark(self) -> int:
        """Current fill level; release(mark) frees everything allocated after it (stack discipline)."""
        return len(self.regions)

    def release(self, mark: int) -> None:
        if not 0 <= mark <= len(self.regions):
            raise ValueError(f"bad arena mark {mark} (have {len(self.regions)} regions)")
        del self.regions[mark:]
        self.used = (self.regions[-1].ptr - self.base + self.regions[-1].nbytes) if self.regions else 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - _round_up(self.used, ALIGN)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a
