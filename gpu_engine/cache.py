"""Cache bookkeeping: paged KV blocks, linear-attention state slots, and the prefix cache over both.

The runner owns the memory; this module only decides which block / slot belongs to whom.

Prefix caching: every full block of a sequence gets a hash chained from its parent's, over the block's token ids
AND the content hashes (plus offsets) of the vision items whose placeholders lie in it — placeholder ids alone are
identical for every image, so without the content hash two different images would share KV. Hybrid models
(linear-attention layers) also need the recurrent state at the end of the reused prefix: that state is snapshotted
into a spare state slot (runner.copy_state_slot) at chosen block boundaries, and a prefix hit is only usable up to
the last boundary that has a snapshot.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from .sequence import Sequence

_ROOT = b"docpipe-prefix-v1"


def block_hash(parent: bytes, seq: Sequence, block_index: int, block_size: int) -> bytes:
    start = block_index * block_size
    end = start + block_size
    h = hashlib.sha256(parent)
    h.update(seq.token_ids[start:end].tobytes())
    for item in seq.vision_items_in(start, end):
        # The offset inside the item tells which slice of its embeddings sits in this block.
        offset = max(start, item.token_start) - item.token_start
        h.update(f"|{item.content_hash}@{offset}".encode())
    return h.digest()


@dataclass
class PrefixHit:
    blocks: list[int]  # physical blocks of the reused prefix, in order
    num_tokens: int
    snapshot_slot: int | None  # state slot holding the linear-attention state after the prefix (hybrid models)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        num_state_slots: int,
        enable_prefix_caching: bool,
        has_linear_state: bool,
        copy_state_slot: Callable[[int, int], None],
    ) -> None:
        if num_state_slots < max_num_seqs:
            raise ValueError(f"num_state_slots ({num_state_slots}) < max_num_seqs ({max_num_seqs})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.has_linear_state = has_linear_state
        self._copy_state_slot = copy_state_slot

        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # never hashed: take these first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unreferenced; oldest first
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}

        # State slots [0, max_num_seqs) belong to running sequences, the rest hold prefix snapshots.
        self._free_seq_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._free_snapshot_slots: list[int] = list(range(num_state_slots - 1, max_num_seqs - 1, -1))
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # hash of the last prefix block -> slot; LRU

        self.prefix_hit_tokens = 0
        self.prefix_miss_tokens = 0
        self.prefix_hit_requests = 0
        self.snapshots_taken = 0

    # ---- capacity ----
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_held: int | None = None) -> int:
        held = len(seq.block_table) if num_held is None else num_held
        total = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, total - held)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    # ---- hashing / prefix lookup ----
    def update_hashes(self, seq: Sequence) -> None:
        full = seq.num_tokens // self.block_size
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else _ROOT
            seq.block_hashes.append(block_hash(parent, seq, i, self.block_size))

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """Longest reusable cached prefix; always leaves >= 1 token to compute (its logits are needed)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0, None)
        self.update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            b = self._hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
        slot = None
        if self.has_linear_state:
            k = len(blocks)
            while k > 0 and seq.block_hashes[k - 1] not in self._snapshots:
                k -= 1
            blocks = blocks[:k]
            if k:
                slot = self._snapshots[seq.block_hashes[k - 1]]
        return PrefixHit(blocks, len(blocks) * self.block_size, slot)

    def can_admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        if not self._free_seq_slots:
            return False
        total = -(-(hit.num_tokens + num_new_tokens) // self.block_size)
        new = total - len(hit.blocks)
        # Hit blocks sitting in the evictable pool stop being free once we take them.
        reclaimed = sum(1 for b in hit.blocks if self._ref[b] == 0)
        return new <= self.num_free_blocks - reclaimed

    def admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """Give `seq` a state slot and the prefix blocks of `hit` (restoring the linear state snapshot)."""
        assert seq.state_slot is None and not seq.block_table
        for b in hit.blocks:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        seq.block_table = list(hit.blocks)
        seq.num_computed = hit.num_tokens
        seq.num_committed_blocks = len(hit.blocks)
        seq.state_slot = self._free_seq_slots.pop()
        if hit.snapshot_slot is not None:
            self._copy_state_slot(hit.snapshot_slot, seq.state_slot)
            self._snapshots.move_to_end(seq.block_hashes[len(hit.blocks) - 1])
        if self.enable_prefix_caching:
            # Count over what this admission had to compute (a recompute after preemption counts again).
            self.prefix_hit_tokens += hit.num_tokens
            self.prefix_miss_tokens += seq.num_tokens - hit.num_tokens
            self.prefix_hit_requests += bool(hit.num_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {need} blocks, {self.num_free_blocks} free (scheduler bug)")
        for _ in range(need):
            seq.block_table.append(self._take_block())

    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            h = self._block_to_hash.pop(b)
            del self._hash_to_block[h]
            # A snapshot past an evicted block can never be reached again: drop it.
            slot = self._snapshots.pop(h, None)
            if slot is not None:
                self._free_snapshot_slots.append(slot)
        self._ref[b] = 1
        return b

    def free(self, seq: Sequence) -> None:
        self._release(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:
            self._free_seq_slots.append(seq.state_slot)
            seq.state_slot = None

    def _release(self, blocks: list[int]) -> None:
        # Reverse order: the tail of a chain is evicted before its head (a head without tail is still useful).
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._block_to_hash:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq.num_computed` (speculative decoding: the KV of rejected drafts). They were never
        offered to the prefix cache: commit() only hashes blocks of computed tokens."""
        keep = -(-seq.num_computed // self.block_size)
        self._release(seq.block_table[keep:])
        seq.block_table = seq.block_table[:keep]  # a new list: Sequence.block_table_array() caches by identity

    # ---- after a forward ----
    def commit(self, seq: Sequence) -> list[bytes]:
        """Offer the newly computed full blocks of `seq` to the prefix cache; returns the hashes it took."""
        if not self.enable_prefix_caching:
            return []
        full = seq.num_computed // self.block_size
        if full <= seq.num_committed_blocks:
            return []
        self.update_hashes(seq)
        taken = []
        for i in range(seq.num_committed_blocks, full):
            h = seq.block_hashes[i]
            b = seq.block_table[i]
            if h not in self._hash_to_block and b not in self._block_to_hash:
                self._hash_to_block[h] = b
                self._block_to_hash[b] = h
                taken.append(h)
        seq.num_committed_blocks = full
        return taken

    def chunk_computed(self, seq: Sequence, chunk_tokens: int) -> tuple[list[bytes], bytes | None]:
        """After a chunk of `chunk_tokens` tokens of `seq` ran (seq.num_computed is its end): its filled blocks to the
        prefix cache, and the linear-attention state kept at a prompt block boundary; only when a block may have
        filled up. Returns what was added (the hashes, the snapshot's), which withdraw() takes back."""
        if seq.num_computed % self.block_size and chunk_tokens <= 1:
            return [], None
        hashes = self.commit(seq)
        return hashes, self.snapshot_state(seq) if seq.num_computed <= seq.prompt_len else None

    def withdraw(self, hashes: list[bytes], snapshots: list[bytes]) -> None:
        """Take back what commit() / snapshot_state() returned for a step whose forward then failed (its KV and state
        cannot be trusted): those blocks and snapshots are no prefix for anyone."""
        for h in hashes:
            b = self._hash_to_block.pop(h, None)
            if b is not None:
                del self._block_to_hash[b]
                if b in self._evictable:
                    del self._evictable[b]
                    self._free.append(b)
        for h in snapshots:
            slot = self._snapshots.pop(h, None)
            if slot is not None:
                self._free_snapshot_slots.append(slot)

    def snapshot_state(self, seq: Sequence) -> bytes | None:
        """Keep the linear-attention state of `seq` at its current (block-aligned) length for later prefix hits;
        returns the hash it is kept under when a snapshot was taken (copied) now."""
        if not (self.enable_prefix_caching and self.has_linear_state):
            return None
        n = seq.num_computed
        if n == 0 or n % self.block_size or seq.state_slot is None:
            return None
        h = seq.block_hashes[n // self.block_size - 1]
        if h in self._snapshots:
            self._snapshots.move_to_end(h)
            return None
        if h not in self._hash_to_block:
            return None  # the KV of this prefix is not cached (duplicate block): the snapshot could not be used
        if self._free_snapshot_slots:
            slot = self._free_snapshot_slots.pop()
        elif self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
        else:
            return None  # no snapshot slots configured
        self._copy_state_slot(seq.state_slot, slot)
        self._snapshots[h] = slot
        self.snapshots_taken += 1
        return h

    def stats(self) -> dict[str, float]:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_cached": self.num_cached_blocks,
            "kv_usage": self.num_used_blocks / self.num_blocks,
            "state_snapshots": len(self._snapshots),
            "state_snapshots_taken": self.snapshots_taken,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_miss_tokens": self.prefix_miss_tokens,
            "prefix_hit_requests": self.prefix_hit_requests,
        }
