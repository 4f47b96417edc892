"""Which CUDA graph a decode step replays: batch-size buckets, and the runner's scratch rows that pad a batch up
to its bucket.

A decode graph is captured for a fixed number of sequences. With one graph per exact batch size, a run whose batch
shrinks one sequence at a time (the tail of a document batch) or wanders between 150 and 256 meets a new size at
almost every step and runs eagerly; so graphs are captured for a few bucket sizes only and a batch is padded to
the next one (step.pad_decode_step). Padding rows are nearly free in a decode step, which reads every weight once
whatever the batch: at 190 rows the 192-row graph does 1 % more row work.

Every graph writes all it reads before reading it (tables uploaded before each replay, activations recomputed,
results read right after), and replays and eager steps run one at a time on one stream, so graphs need not own
memory: each is captured at the arena's top and the memory is released right after, to be used by the next
step or graph. What a graph costs is its driver-side executable, not our arena.
"""
from __future__ import annotations

from dataclasses import dataclass

# Up to 256 sequences; past that, steps of 64. Closer at the low end (where a decode step's time grows with the
# batch) than at the top (where padding rows ride on the weight reads).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
BUCKET_STEP_PAST_256 = 64


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """The bucket sizes that cover every batch of 1..max_rows sequences (the last one >= max_rows)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    sizes = [b for b in BUCKETS if b < max_rows]
    top = next((b for b in BUCKETS if b >= max_rows), None)
    if top is None:  # sizes holds all of BUCKETS
        top = BUCKETS[-1] + BUCKET_STEP_PAST_256
        while top < max_rows:
            sizes.append(top)
            top += BUCKET_STEP_PAST_256
    sizes.append(top)
    return tuple(sizes)


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows` sequences; None when none does (the step runs eagerly)."""
    return next((b for b in sizes if b >= rows), None)


def table_width_bucket(longest_table: int) -> int:
    """Block tables of a graph are padded to a power of two (a few widths over a run's context lengths)."""
    return 1 << (max(longest_table, 1) - 1).bit_length()


@dataclass(frozen=True)
class GraphKey:
    rows: int  # the bucket: sequences the graph was captured for
    width: int  # block-table width
    sampling: bool  # sampled on the device (a SamplingRequest) or logits returned


@dataclass(frozen=True)
class ScratchRows:
    """Cache space of the runner's own (not in the engine's CacheSpec) that padding rows write into."""

    block: int  # KV block id (one past the spec's blocks)
    slot: int  # linear-attention state slot (one past the spec's slots)


@dataclass
class DecodeCounts:
    """What the runner's steps ran as, since the cache was allocated (for benches and checks)."""

    graphed: int = 0  # decode steps replayed from a graph
    padded: int = 0  # of those, with padding rows
    eager_decode: int = 0  # decode steps run eagerly (a key's first step, no graph for the key, no bucket)
    other: int = 0  # steps that are not plain decode steps (prompt chunks, jump-forward runs, vision): eager
    captures: int = 0
