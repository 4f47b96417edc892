"""Which CUDA graph a step replays: batch-size and token-count buckets, and the runner's scratch rows that pad
a step up to its bucket.

A graph is captured for fixed sequence and token counts. With one graph per exact batch size, a run whose batch
shrinks one sequence at a time (the tail of a document batch) or wanders between 150 and 256 meets a new size at
almost every step and runs eagerly; so graphs are captured for a few bucket sizes only and a step is padded to
the next one (step.pad_step). Padding rows are nearly free in a decode step, which reads every weight once
whatever the batch: at 190 rows the 192-row graph does 1 % more row work. Steps with grammar-forced runs
(jump-forward chunks of a few tokens beside the decode rows) replay graphs too: their kernels are the decode
step's (paged attention, token-by-token DeltaNet) as long as no chunk reaches GRAPH_MAX_CHUNK, and the tokens past
one per sequence are rounded up to TOKEN_BUCKETS.

Every graph writes all it reads before reading it (tables uploaded before each replay, activations recomputed,
results read right after), and replays and eager steps run one at a time on one stream, so graphs need not own
memory: each is captured at the arena's top and the memory is released right after, to be used by the next
step or graph. What a graph costs is its driver-side executable, not our arena.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The longest chunk a graph takes: below text_model.FLASH_MIN_CHUNK (and the chunked DeltaNet's 64 tokens), so
# that the kernels a step launches, and their grids, depend on its sequence and token counts only.
GRAPH_MAX_CHUNK = 31
# Tokens past one per sequence (jump-forward runs: ~10 runs of ~5 tokens a step in the 9B document run).
TOKEN_BUCKETS = (0, 16, 32, 48, 64, 96, 128, 192, 256)
# Steps with verify windows (k drafts per sequence, cuda/verify.py): at small batches the tokens past one per
# sequence are a few, and padding 3 up to 16 would run a batch-1 verify step at 17 rows; so every count up to 8,
# then the forced-run buckets.
VERIFY_TOKEN_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, *TOKEN_BUCKETS[1:])
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


def graph_shape(lens: Sequence[int], sizes: tuple[int, ...], block_size: int,
                token_buckets: tuple[int, ...] = TOKEN_BUCKETS) -> tuple[int, int] | None:
    """(sequences, tokens) of the graph a step of chunks of `lens` tokens pads to (step.pad_step), or None when
    no graph takes it: a chunk longer than GRAPH_MAX_CHUNK, more tokens past one per sequence than
    TOKEN_BUCKETS[-1], or more sequences than the largest bucket. The tokens past one per sequence are rounded up
    to a `token_buckets` size; the padding sequences carry the difference, 1..block_size tokens each."""
    seqs, n = len(lens), int(sum(lens))
    if not seqs or max(lens) > GRAPH_MAX_CHUNK:
        return None
    extra = n - seqs
    extra_bucket = next((b for b in token_buckets if b >= extra), None)
    if extra_bucket is None:
        return None
    spare = extra_bucket - extra  # padding tokens past one per padding sequence
    if spare and block_size < 2:
        return None
    need = -(-spare // (block_size - 1)) if spare else 0  # padding sequences that can carry them
    rows = next((b for b in sizes if b >= seqs + need), None)
    return None if rows is None else (rows, rows + extra_bucket)


def table_width_bucket(longest_table: int) -> int:
    """Block tables of a graph are padded to a power of two (a few widths over a run's context lengths)."""
    return 1 << (max(longest_table, 1) - 1).bit_length()


@dataclass(frozen=True)
class GraphKey:
    rows: int  # the bucket: sequences the graph was captured for
    tokens: int  # tokens it was captured for (rows + a TOKEN_BUCKETS size)
    width: int  # block-table width
    sampling: bool  # sampled on the device (a SamplingRequest) or logits returned
    verify: bool = False  # a step with verify windows: logits at every token (step.pad_step all_rows)


@dataclass(frozen=True)
class ScratchRows:
    """Cache space of the runner's own (not in the engine's CacheSpec) that padding rows write into."""

    block: int  # KV block id (one past the spec's blocks)
    slot: int  # linear-attention state slot (one past the spec's slots)


@dataclass
class DecodeCounts:
    """What the runner's steps ran as, since the cache was allocated (for benches and checks)."""

    graphed: int = 0  # steps replayed from a graph
    padded: int = 0  # of those, with padding rows
    with_runs: int = 0  # of those, with chunks of more than one token (jump-forward runs)
    eager_graphable: int = 0  # steps a graph could take, run eagerly (a key's first step, a failed capture, ...)
    other: int = 0  # steps no graph takes (long prompt chunks, vision, logits of other rows): eager
    captures: int = 0
