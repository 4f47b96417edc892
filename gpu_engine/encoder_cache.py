"""Just-in-time vision encoding with a byte-bounded cache of embeddings.

A prefill chunk that overlaps an item's placeholders needs that item's embeddings; the item is encoded then (not
the whole video up front) and kept, keyed by its content hash (which covers pixels, grid and processor
parameters), until the budget forces it out (LRU). Items needed by the step being built are pinned: the scheduler
reserves them first, and cuts a chunk short at the first item that does not fit, so the cache never holds more than
`budget_bytes` and one step never needs more than that. Encoding happens one item at a time, so the peak is the
cache plus one item's encoder input/output — whatever the video length.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

from .inputs import VisionItem
from .runner_api import VisionSlice
from .vision_batch import same_grid_groups

MIN_ENCODER_BUDGET = 64 * 1024**2  # the smallest default budget (the old fixed default)
DEFAULT_ENCODER_TOKENS = 16384  # the largest image the Qwen3.5 processors make (16,777,216 pixels) is 16,384 tokens


def default_encoder_budget(runner: Any) -> int:
    """The encoder-cache budget when EngineConfig.encoder_cache_bytes is None: a runner's on-device region where
    it has one (CudaRunner.encoder_region_bytes, so that cached embeddings stay on the GPU), else room for the
    largest image the processors make (DEFAULT_ENCODER_TOKENS rows of the runner's embeddings); never below
    MIN_ENCODER_BUDGET. A 12 MP phone photo is 11,844 tokens: 92.5 MiB at 9B in bf16, 185 MiB in float32."""
    region = int(getattr(runner, "encoder_region_bytes", 0) or 0)
    if region > 0:
        return max(MIN_ENCODER_BUDGET, region)
    one_row = int(runner.embedding_nbytes(cast(VisionItem, SimpleNamespace(num_tokens=1))))  # bytes per token
    return max(MIN_ENCODER_BUDGET, DEFAULT_ENCODER_TOKENS * one_row)


def check_embeddings(item: VisionItem, emb: Any) -> None:
    """An encoder must return one embedding row per placeholder token of the item."""
    if emb.shape[0] != item.num_tokens:
        raise ValueError(
            f"vision encoder returned {emb.shape[0]} embeddings for an item with {item.num_tokens} placeholders"
        )


def chunk_slices(
    items: list[VisionItem], start: int, end: int, embeddings: Callable[[VisionItem], Any]
) -> list[VisionSlice]:
    """The slices of `embeddings(item)` that fall in the chunk of tokens [start, end); items outside are skipped
    (and not encoded)."""
    out = []
    for item in items:
        lo = max(start, item.token_start)
        hi = min(end, item.token_end)
        if lo >= hi:
            continue
        emb = embeddings(item)
        out.append(VisionSlice(chunk_offset=lo - start, embeddings=emb[lo - item.token_start : hi - item.token_start]))
    return out


class EncoderCache:
    def __init__(
        self,
        budget_bytes: int,
        encode: Callable[[VisionItem], Any],
        nbytes: Callable[[VisionItem], int],
        encode_batch: Callable[[list[VisionItem]], list[Any]] | None = None,
    ) -> None:
        """`encode_batch`: the runner's encode_vision_batch (same-grid items in one tower call), if it has one."""
        self.budget_bytes = budget_bytes
        self._encode = encode
        self._nbytes = nbytes
        self._encode_batch = encode_batch
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # content hash -> (embeddings, bytes)
        self._pinned: dict[str, int] = {}  # reserved for the step being built: content hash -> bytes
        self.bytes_cached = 0
        # Accounting (asserted by tests, reported by stats()).
        self.peak_cached_bytes = 0
        self.peak_bytes = 0  # cache + the one item being encoded (its pixel input + embedding output)
        self.encodes = 0
        self.hits = 0
        self.evictions = 0
        self.batched_encodes = 0  # tower calls that encoded several items (prefetch)
        self.batch_failures = 0  # batches that raised: their items were left to get(), one at a time

    def item_bytes(self, item: VisionItem) -> int:
        return int(self._nbytes(item))

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())

    def reserve(self, items: list[VisionItem]) -> int:
        """Pin `items` in order for the coming step; returns how many leading items fit the budget."""
        for i, item in enumerate(items):
            key = item.content_hash
            if key in self._pinned:
                continue
            size = self._entries[key][1] if key in self._entries else self.item_bytes(item)
            if self.pinned_bytes + size > self.budget_bytes:
                return i
            self._pinned[key] = size
        return len(items)

    def release(self) -> None:
        """The step ran: its items may be evicted again."""
        self._pinned.clear()

    def get(self, item: VisionItem) -> Any:
        key = item.content_hash
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]
        size = self.item_bytes(item)
        self._evict_until(size)
        self.peak_bytes = max(self.peak_bytes, self.bytes_cached + int(item.pixel_values.nbytes) + size)
        emb = self._encode(item)
        check_embeddings(item, emb)
        self._store(item, emb, size)
        return emb

    def _store(self, item: VisionItem, emb: Any, size: int) -> None:
        self.encodes += 1
        self._entries[item.content_hash] = (emb, size)
        self.bytes_cached += size
        self.peak_cached_bytes = max(self.peak_cached_bytes, self.bytes_cached)

    def _evict_until(self, size: int) -> None:
        for key in list(self._entries):
            if self.bytes_cached + size <= self.budget_bytes:
                return
            if key in self._pinned:
                continue
            _, freed = self._entries.pop(key)
            self.bytes_cached -= freed
            self.evictions += 1
        if self.bytes_cached + size > self.budget_bytes:
            raise RuntimeError(
                f"encoder cache: {size} bytes do not fit next to {self.bytes_cached} pinned bytes "
                f"(budget {self.budget_bytes}); reserve() must run first"
            )

    def prefetch(self, items: list[VisionItem]) -> None:
        """Encode the step's uncached, reserved `items` ahead of get(), several of one grid in one tower call
        (vision_batch.py). Best effort: a batch that does not fit or raises leaves its items to get(), where each
        encodes alone and a bad one fails only its own request."""
        if self._encode_batch is None:
            return
        todo = list({i.content_hash: i for i in items if i.content_hash not in self._entries}.values())
        for group in same_grid_groups(todo):
            if len(group) < 2:
                continue
            sizes = [self.item_bytes(item) for item in group]
            try:
                self._evict_until(sum(sizes))
            except RuntimeError:
                continue  # one at a time fits (reserve() saw to it), all at once does not
            self.peak_bytes = max(self.peak_bytes, self.bytes_cached + sum(sizes)
                                  + sum(int(i.pixel_values.nbytes) for i in group))
            try:
                embs = self._encode_batch(group)
                for item, emb in zip(group, embs, strict=True):
                    check_embeddings(item, emb)
            except Exception:  # noqa: BLE001 - get() encodes them singly and reports a bad item on its own
                self.batch_failures += 1
                continue
            self.batched_encodes += 1
            for item, emb, size in zip(group, embs, sizes):
                self._store(item, emb, size)

    def slices(self, items: list[VisionItem], start: int, end: int) -> list[VisionSlice]:
        """Embedding slices for the chunk covering tokens [start, end) (items already reserved)."""
        return chunk_slices(items, start, end, self.get)

    def stats(self) -> dict[str, int]:
        return {
            "encoder_cache_bytes": self.bytes_cached,
            "encoder_cache_budget_bytes": self.budget_bytes,
            "encoder_cache_peak_bytes": self.peak_cached_bytes,
            "encoder_peak_bytes": self.peak_bytes,
            "encoder_encodes": self.encodes,
            "encoder_hits": self.hits,
            "encoder_evictions": self.evictions,
            "encoder_batched_encodes": self.batched_encodes,
            "encoder_batch_failures": self.batch_failures,
        }
