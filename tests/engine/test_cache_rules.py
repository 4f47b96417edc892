"""gpu_engine/cache.py rule by rule (the mutation pass of issue #22, tests/MUTATION.md): paged KV blocks and their
reference counts, state slots, the prefix cache with its LRU eviction, and linear-state snapshots.

The BlockManager is driven directly, with a stand-in for the runner's memory that records which tokens each KV block
and each state slot holds, so a prefix hit can be checked for serving the right KV and the right recurrent state.
Everything is in memory (milliseconds). Random workloads use fixed seeds: a mutant's verdict must not depend on
the draw.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from gpu_engine.cache import BlockManager, PrefixHit, block_hash
from gpu_engine.inputs import ProcessedPrompt, VisionItem
from gpu_engine.params import SamplingParams
from gpu_engine.sequence import Sequence

BS = 4  # block size of every manager below


class Memory:
    """The runner's side: tokens whose KV each block holds, tokens whose state each slot holds, copies made."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[int, ...]] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.copies: list[tuple[int, int]] = []

    def copy(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
        self.state[dst] = self.state[src]


def manager(num_blocks: int, max_num_seqs: int = 2, num_state_slots: int = 4, *, caching: bool = True,
            linear: bool = True) -> tuple[BlockManager, Memory]:
    mem = Memory()
    return BlockManager(num_blocks, BS, max_num_seqs, num_state_slots, caching, linear, mem.copy), mem


def prompt(ids: list[int], items: list[VisionItem] | None = None) -> ProcessedPrompt:
    arr = np.asarray(ids, dtype=np.int64)
    return ProcessedPrompt(arr, np.broadcast_to(np.arange(arr.size), (3, arr.size)).copy(), 0, items or [])


_next_id = iter(range(10**9))


def seq(ids: list[int], items: list[VisionItem] | None = None, max_tokens: int = 16) -> Sequence:
    i = next(_next_id)
    return Sequence(i, str(i), prompt(ids, items), SamplingParams(max_tokens=max_tokens), np.random.default_rng(0),
                    frozenset())


def image(token_start: int, num_tokens: int, tag: str) -> VisionItem:
    return VisionItem(kind="image", pixel_values=np.zeros((4 * num_tokens, 8), np.float32),
                      grid_thw=(1, 2, 2 * num_tokens), token_start=token_start, num_tokens=num_tokens,
                      content_hash=hashlib.sha256(tag.encode()).hexdigest())


def tokens(s: Sequence) -> tuple[int, ...]:
    return tuple(int(t) for t in s.token_ids)


def admit(bm: BlockManager, mem: Memory, s: Sequence) -> PrefixHit:
    """match + admit, then check the hit serves the KV and (hybrid models) the state of exactly its tokens."""
    hit = bm.match_prefix(s)
    assert bm.can_admit(s, hit, s.num_tokens - hit.num_tokens)
    bm.admit(s, hit)
    assert s.state_slot is not None
    if hit.snapshot_slot is None:
        mem.state[s.state_slot] = ()  # the runner starts a fresh state
    for i, b in enumerate(s.block_table):
        assert mem.kv[b] == tokens(s)[i * BS:(i + 1) * BS], "a prefix hit served another prefix's KV"
    if bm.has_linear_state:
        assert mem.state[s.state_slot] == tokens(s)[:hit.num_tokens], "the restored state is not the prefix's"
    return hit


def compute(bm: BlockManager, mem: Memory, s: Sequence, upto: int, snapshot: bool = True) -> None:
    """What one forward does: blocks for the new tokens, their KV and the state written, commit, snapshot."""
    bm.allocate(s, upto - s.num_computed)
    ids = tokens(s)
    for j in range(s.num_computed // BS, -(-upto // BS)):
        mem.kv[s.block_table[j]] = ids[j * BS:min((j + 1) * BS, upto)]
    mem.state[s.state_slot] = ids[:upto]  # type: ignore[index]  # admitted: it has a slot
    s.num_computed = upto
    bm.commit(s)
    if snapshot:
        bm.snapshot_state(s)


def run(bm: BlockManager, mem: Memory, ids: list[int], upto: int | None = None) -> tuple[Sequence, PrefixHit]:
    s = seq(ids)
    hit = admit(bm, mem, s)
    compute(bm, mem, s, len(ids) if upto is None else upto)
    return s, hit


# --- block hashes -----------------------------------------------------------------------------------------------
def test_block_hashes_chain_over_full_blocks_only() -> None:
    bm, _ = manager(8)
    a, b, c = seq(list(range(11))), seq(list(range(8)) + [50, 51, 52]), seq([99] + list(range(1, 11)))
    for s in (a, b, c):
        bm.update_hashes(s)
    assert len(a.block_hashes) == 2  # 11 tokens: two full blocks, the partial third has no hash
    assert a.block_hashes == b.block_hashes  # later tokens do not change a full block's hash
    assert c.block_hashes[0] != a.block_hashes[0]
    assert c.block_hashes[1] != a.block_hashes[1]  # same tokens 4..7, different parent
    assert a.block_hashes[0] != a.block_hashes[1]
    d = seq(list(range(4)) + [7, 5, 6, 4])  # same first block, block 1 with its tokens reordered
    bm.update_hashes(d)
    assert d.block_hashes[0] == a.block_hashes[0] and d.block_hashes[1] != a.block_hashes[1]
    for n in (0, 3, 4, 12):
        e = seq(list(range(n)) or [1])
        bm.update_hashes(e)
        assert len(e.block_hashes) == len(tokens(e)) // BS


def test_block_hash_covers_the_image_content_and_the_slice_of_it_in_the_block() -> None:
    placeholder = 7
    root = b"parent"
    # one 8-token image at token 4 (blocks 1 and 2 hold its slices 0..3 and 4..7) and one at token 8
    first = seq([1, 2, 3, 0] + [placeholder] * 8, [image(4, 8, "cat")])
    later = seq([1, 2, 3, 0, 5, 6, 7, 8] + [placeholder] * 8, [image(8, 8, "cat")])
    dog = seq([1, 2, 3, 0] + [placeholder] * 8, [image(4, 8, "dog")])
    assert block_hash(root, first, 1, BS) == block_hash(root, later, 2, BS)  # same image slice 0..3
    assert block_hash(root, first, 2, BS) == block_hash(root, later, 3, BS)  # same image slice 4..7
    assert block_hash(root, first, 1, BS) != block_hash(root, first, 2, BS)  # same tokens, other slice
    assert block_hash(root, first, 1, BS) != block_hash(root, dog, 1, BS)  # same tokens, other pixels
    assert block_hash(root, first, 0, BS) == block_hash(root, dog, 0, BS)  # before the image
    # an image that starts inside a block: the block sees its slice from offset 0
    mid = seq([1, 2] + [placeholder] * 6, [image(2, 6, "cat")])
    mid_later = seq([1, 2, 3, 0, 1, 2] + [placeholder] * 6, [image(6, 6, "cat")])
    assert block_hash(root, mid, 0, BS) == block_hash(root, mid_later, 1, BS)
    assert block_hash(root, mid, 1, BS) == block_hash(root, mid_later, 2, BS)
    assert block_hash(b"other", mid, 0, BS) != block_hash(root, mid, 0, BS)


# --- construction, capacity, allocation -------------------------------------------------------------------------
def test_state_slots_must_cover_the_running_sequences() -> None:
    with pytest.raises(ValueError) as caught:
        manager(4, max_num_seqs=3, num_state_slots=2)
    assert str(caught.value) == "num_state_slots (2) < max_num_seqs (3)"
    bm, _ = manager(4, max_num_seqs=3, num_state_slots=3)  # equal is enough (no snapshots)
    assert bm.stats() == {
        "kv_blocks_total": 4, "kv_blocks_used": 0, "kv_blocks_cached": 0, "kv_usage": 0.0, "state_snapshots": 0,
        "state_snapshots_taken": 0, "prefix_hit_tokens": 0, "prefix_miss_tokens": 0, "prefix_hit_requests": 0,
    }


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 5])
def test_running_sequences_get_the_slots_below_max_num_seqs_each_once(max_num_seqs: int) -> None:
    bm, mem = manager(64, max_num_seqs=max_num_seqs, num_state_slots=max_num_seqs + 2, caching=False)
    running = []
    for k in range(max_num_seqs):
        s = seq([k + 1] * 3)
        admit(bm, mem, s)
        running.append(s)
    assert sorted(s.state_slot for s in running) == list(range(max_num_seqs))  # type: ignore[type-var]
    extra = seq([9])
    assert not bm.can_admit(extra, bm.match_prefix(extra), 1)  # no slot left, plenty of blocks
    bm.free(running[0])
    assert running[0].state_slot is None and running[0].block_table == []
    assert bm.can_admit(extra, bm.match_prefix(extra), 1)
    admit(bm, mem, extra)
    assert extra.state_slot in range(max_num_seqs)


def test_blocks_needed_counts_whole_blocks_past_those_held() -> None:
    bm, mem = manager(16, caching=False)
    s = seq(list(range(9)))
    assert bm.blocks_needed(s, 9) == 3 and bm.blocks_needed(s, 8) == 2 and bm.blocks_needed(s, 1) == 1
    assert bm.blocks_needed(s, 0) == 0
    assert bm.blocks_needed(s, 9, num_held=1) == 2 and bm.blocks_needed(s, 9, num_held=5) == 0
    admit(bm, mem, s)
    compute(bm, mem, s, 5)  # 5 tokens in 2 blocks
    assert s.block_table and len(s.block_table) == 2
    assert bm.blocks_needed(s, 3) == 0 and bm.blocks_needed(s, 4) == 1
    assert bm.blocks_needed(s, 4, num_held=0) == 3  # as if it held none: ceil(9 / 4)


def test_allocation_up_to_the_last_free_block_and_not_past_it() -> None:
    bm, mem = manager(3, caching=False)
    s = seq(list(range(12)))
    admit(bm, mem, s)
    assert bm.can_allocate(s, 12) and not bm.can_allocate(s, 13)
    with pytest.raises(RuntimeError) as caught:
        bm.allocate(s, 13)
    assert str(caught.value) == "allocate: need 4 blocks, 3 free (scheduler bug)"
    assert s.block_table == []
    bm.allocate(s, 12)
    assert sorted(s.block_table) == [0, 1, 2] and bm.num_free_blocks == 0 and bm.num_used_blocks == 3
    assert bm.stats()["kv_usage"] == 1.0 and bm.stats()["kv_blocks_used"] == 3
    bm.free(s)
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 0 and bm.stats()["kv_usage"] == 0.0


def test_a_sequence_is_admitted_once_and_again_after_it_was_freed() -> None:
    bm, mem = manager(8, caching=False)
    s = seq([1, 2, 3])
    admit(bm, mem, s)
    with pytest.raises(AssertionError):
        bm.admit(s, PrefixHit([], 0, None))  # it holds a state slot already (and no block yet)
    compute(bm, mem, s, 3)
    with pytest.raises(AssertionError):
        bm.admit(s, PrefixHit([], 0, None))
    bm.free(s)  # preempted: everything is given back, it can be admitted again
    admit(bm, mem, s)
    assert s.num_computed == 0 and s.block_table == []


# --- the prefix cache -------------------------------------------------------------------------------------------
def test_without_prefix_caching_nothing_is_cached_hit_or_counted() -> None:
    bm, mem = manager(16, caching=False)
    ids = list(range(13))
    first, _ = run(bm, mem, ids)
    bm.free(first)
    s = seq(ids)
    assert bm.match_prefix(s) == PrefixHit([], 0, None)
    admit(bm, mem, s)
    compute(bm, mem, s, 13)
    stats = bm.stats()
    assert stats["kv_blocks_cached"] == 0 and stats["prefix_hit_tokens"] == 0 and stats["prefix_miss_tokens"] == 0
    assert stats["prefix_hit_requests"] == 0 and stats["state_snapshots"] == 0 and mem.copies == []


@pytest.mark.parametrize(("length", "reused"), [(4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_a_hit_always_leaves_a_token_to_compute(length: int, reused: int) -> None:
    bm, mem = manager(16, linear=False)
    ids = list(range(100, 116))
    first, _ = run(bm, mem, ids)
    blocks = list(first.block_table)
    bm.free(first)
    hit = bm.match_prefix(seq(ids[:length]))
    assert hit.num_tokens == reused and len(hit.blocks) == reused // BS and hit.snapshot_slot is None
    assert hit.blocks == blocks[:reused // BS]


def test_a_hit_stops_at_the_first_block_not_cached() -> None:
    bm, mem = manager(16, linear=False)
    ids = list(range(20, 33))
    first, _ = run(bm, mem, ids)
    bm.free(first)
    other = ids[:4] + [0] + ids[5:]  # block 1 differs, so block 2's chained hash differs too
    assert bm.match_prefix(seq(other)).num_tokens == 4
    assert bm.match_prefix(seq([0] + ids[1:])).num_tokens == 0


def test_shared_blocks_are_counted_per_holder_and_freed_by_the_last() -> None:
    bm, mem = manager(8, max_num_seqs=3, num_state_slots=3, linear=False)
    ids = list(range(9))
    a, _ = run(bm, mem, ids)  # blocks: 2 full (cached) + 1 partial
    b, hit_b = run(bm, mem, ids)
    c, hit_c = run(bm, mem, ids)
    assert hit_b.blocks == hit_c.blocks == a.block_table[:2]
    assert bm.num_used_blocks == 5  # 2 shared + one partial block each
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5  # c still holds the shared two
    # taking every free block must not take the shared ones from under c
    d = seq(list(range(50, 70)))
    admit(bm, mem, d)
    compute(bm, mem, d, 20)
    assert not set(d.block_table) & set(c.block_table)
    assert bm.num_free_blocks == 0
    bm.free(c)
    assert bm.num_free_blocks == 3  # the shared blocks are evictable now, c's partial one is free


def test_admission_counts_hit_blocks_that_leave_the_evictable_pool() -> None:
    bm, mem = manager(4, linear=False)
    ids = list(range(9))
    a, _ = run(bm, mem, ids)  # 3 blocks, 2 of them cached
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    longer = seq(ids[:8] + list(range(60, 68)))  # 16 tokens: the 8 cached + 8 new
    hit = bm.match_prefix(longer)
    assert hit.num_tokens == 8
    # 2 new blocks fit in the 4 free minus the 2 the hit takes out of the evictable pool; 3 do not
    assert bm.can_admit(longer, hit, 8) and not bm.can_admit(longer, hit, 9)
    bm.admit(longer, hit)
    assert bm.num_free_blocks == 2 and bm.num_used_blocks == 2
    # hit blocks someone still holds are not taken out of the free count
    other = seq(ids[:8] + [70, 71, 72, 73, 74, 75, 76, 77])
    hit2 = bm.match_prefix(other)
    assert hit2.blocks == hit.blocks
    assert bm.can_admit(other, hit2, 8) and not bm.can_admit(other, hit2, 9)


def test_eviction_takes_never_cached_blocks_first_then_the_least_recently_freed_tail() -> None:
    bm, mem = manager(5, max_num_seqs=3, num_state_slots=3, linear=False)
    a_ids, b_ids = list(range(10, 19)), list(range(30, 39))
    a, _ = run(bm, mem, a_ids[:8])  # 2 blocks, both cached
    b, _ = run(bm, mem, b_ids[:8])
    bm.free(a)  # a's tail enters the pool first, then its head, then b's tail and head
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 5
    c = seq([90, 91, 92])
    admit(bm, mem, c)
    compute(bm, mem, c, 3)  # takes the one never-cached block: nothing is evicted
    assert bm.num_cached_blocks == 4
    d = seq([80, 81, 82])
    admit(bm, mem, d)
    compute(bm, mem, d, 3)  # evicts a's tail
    assert bm.num_cached_blocks == 3
    assert bm.match_prefix(seq(a_ids)).num_tokens == 4  # a's head is still useful
    assert bm.match_prefix(seq(b_ids)).num_tokens == 8
    e = seq([70])
    admit(bm, mem, e)
    compute(bm, mem, e, 1)  # evicts a's head next
    assert bm.match_prefix(seq(a_ids)).num_tokens == 0 and bm.match_prefix(seq(b_ids)).num_tokens == 8
    assert d.block_table and mem.kv[d.block_table[0]] == (80, 81, 82)


def test_commit_offers_only_newly_computed_full_blocks_and_keeps_the_first_copy() -> None:
    bm, mem = manager(16, max_num_seqs=2, num_state_slots=2, linear=False)
    ids = list(range(40, 50))
    a, b = seq(ids), seq(ids)  # both admitted before either computed: no hit for either
    admit(bm, mem, a)
    admit(bm, mem, b)
    compute(bm, mem, a, 5)
    assert bm.num_cached_blocks == 1 and a.num_committed_blocks == 1
    compute(bm, mem, b, 10)
    assert bm.num_cached_blocks == 2  # b's block 0 duplicates a's: a's copy stays the cached one
    assert b.num_committed_blocks == 2
    compute(bm, mem, a, 10)
    assert bm.num_cached_blocks == 2  # a's block 1 duplicates b's
    hit = bm.match_prefix(seq(ids + [1]))
    assert hit.blocks == [a.block_table[0], b.block_table[1]]
    bm.free(a)
    bm.free(b)
    # b's duplicate of block 0 was never cached: it is plainly free; every cached block is evictable
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2
    # the duplicates are not re-offered later either: a computes nothing new, b never re-commits block 0
    again = seq(ids + [2, 3])
    admit(bm, mem, again)
    compute(bm, mem, again, 12)
    assert bm.num_cached_blocks == 3


def test_evicting_every_cached_block_leaves_consistent_books() -> None:
    bm, mem = manager(4, max_num_seqs=1, num_state_slots=1, linear=False)
    for round_ in range(3):
        ids = [round_ * 100 + t for t in range(16)]
        s, hit = run(bm, mem, ids)
        assert hit.num_tokens == 0 and bm.num_cached_blocks == 4
        bm.free(s)
        again, hit = run(bm, mem, ids)
        assert hit.num_tokens == 12
        bm.free(again)


# --- linear-attention state snapshots ---------------------------------------------------------------------------
def test_snapshots_fill_every_spare_slot_before_the_least_recently_used_is_reused() -> None:
    bm, mem = manager(64, max_num_seqs=2, num_state_slots=5)  # slots 2, 3, 4 hold snapshots
    prompts = [[k * 50 + t for t in range(9)] for k in range(4)]
    for p in prompts[:3]:
        s, _ = run(bm, mem, p, upto=8)
        bm.free(s)
    assert sorted(dst for _, dst in mem.copies) == [2, 3, 4] and bm.stats()["state_snapshots"] == 3
    assert bm.stats()["state_snapshots_taken"] == 3
    # use prompt 0's snapshot: prompt 1's is now the least recently used
    s, hit = run(bm, mem, prompts[0])
    assert hit.num_tokens == 8 and hit.snapshot_slot is not None and mem.copies[-1] == (hit.snapshot_slot, 0)
    bm.free(s)
    t, _ = run(bm, mem, prompts[3], upto=8)
    bm.free(t)
    assert bm.stats()["state_snapshots"] == 3 and bm.stats()["state_snapshots_taken"] == 4
    reused = [bm.match_prefix(seq(p)).num_tokens for p in prompts]
    assert reused == [8, 0, 8, 8]  # prompt 1's KV is still cached, but its state is gone


def test_snapshots_only_at_block_boundaries_of_cached_prefixes() -> None:
    bm, mem = manager(64, max_num_seqs=2, num_state_slots=4)
    ids = list(range(300, 314))
    s = seq(ids)
    admit(bm, mem, s)
    bm.snapshot_state(s)  # nothing computed yet
    compute(bm, mem, s, 6)  # not at a boundary
    assert mem.copies == []
    compute(bm, mem, s, 8)
    assert mem.copies == [(s.state_slot, 2)]
    compute(bm, mem, s, 12, snapshot=False)
    blocks = list(s.block_table)
    bm.free(s)
    hit = bm.match_prefix(seq(ids))
    # KV is cached for 3 blocks, but the state only at 8 tokens: the hit stops at the snapshot
    assert bm.num_cached_blocks == 3
    assert hit.num_tokens == 8 and hit.blocks == blocks[:2] and hit.snapshot_slot == 2
    assert bm.match_prefix(seq(ids[:7])).num_tokens == 0  # its only cached block has no snapshot


def test_no_snapshot_for_a_duplicate_block_and_a_second_snapshot_only_touches_the_first() -> None:
    bm, mem = manager(64, max_num_seqs=2, num_state_slots=4)  # snapshot slots 2, 3
    ids = list(range(500, 509))
    a, b = seq(ids), seq(ids)
    admit(bm, mem, a)
    admit(bm, mem, b)
    compute(bm, mem, a, 8)
    compute(bm, mem, b, 8)  # same prefix: its state is already kept
    assert len(mem.copies) == 1 and bm.stats()["state_snapshots_taken"] == 1
    bm.free(a)
    bm.free(b)
    # two more prefixes fill the snapshot slots; the touch by b made ids the most recent before them
    for k in (1, 2):
        s, _ = run(bm, mem, [k * 1000 + t for t in range(9)], upto=8)
        bm.free(s)
    assert bm.match_prefix(seq(ids)).num_tokens == 0  # ids was older than prefix 1000: evicted first
    c, d = seq(list(range(600, 609))), seq(list(range(700, 709)))
    admit(bm, mem, c)
    compute(bm, mem, c, 8)
    admit(bm, mem, d)  # d's block will duplicate nothing; c and d both snapshot
    bm.free(c)
    assert bm.stats()["state_snapshots"] == 2


def test_a_snapshot_of_an_evicted_block_frees_its_slot() -> None:
    bm, mem = manager(4, max_num_seqs=1, num_state_slots=3)  # snapshot slots 1, 2
    a_ids, b_ids = list(range(10, 18)), list(range(20, 28))
    a, _ = run(bm, mem, a_ids[:4])
    bm.free(a)
    b, _ = run(bm, mem, b_ids[:4])
    bm.free(b)
    assert bm.stats()["state_snapshots"] == 2
    c = seq(list(range(40, 52)))
    admit(bm, mem, c)
    bm.allocate(c, 12)  # 3 blocks: the 2 never cached, then a's (the least recently freed) is evicted
    assert bm.stats()["state_snapshots"] == 1  # a's snapshot went with its block
    compute(bm, mem, c, 12)
    assert bm.stats()["state_snapshots"] == 2  # c's took the freed slot
    assert bm.match_prefix(seq(b_ids)).num_tokens == 4  # b's snapshot was not the one dropped
    bm.free(c)
    assert sorted({dst for _, dst in mem.copies}) == [1, 2]


def test_a_model_without_linear_state_never_copies_state() -> None:
    bm, mem = manager(32, linear=False)
    ids = list(range(9))
    for _ in range(3):
        s, _ = run(bm, mem, ids)
        bm.free(s)
    assert mem.copies == [] and bm.stats()["state_snapshots"] == 0 and bm.stats()["state_snapshots_taken"] == 0


def test_prefix_counters_over_admissions() -> None:
    bm, mem = manager(32, linear=False)
    ids = list(range(13))
    s, _ = run(bm, mem, ids)  # miss 13
    bm.free(s)
    s, _ = run(bm, mem, ids)  # hit 12, miss 1
    bm.free(s)
    s, _ = run(bm, mem, ids[:6])  # hit 4, miss 2
    bm.free(s)
    s, _ = run(bm, mem, [7, 7])  # miss 2
    stats = bm.stats()
    assert (stats["prefix_hit_tokens"], stats["prefix_miss_tokens"], stats["prefix_hit_requests"]) == (16, 18, 2)
    assert stats["kv_blocks_cached"] == 3 and stats["kv_blocks_total"] == 32 and stats["kv_blocks_used"] == 1
    assert stats["kv_usage"] == 1 / 32


# --- random workloads: the books balance and every hit serves the right KV and state ----------------------------
def _check_books(bm: BlockManager, running: list[Sequence], max_num_seqs: int, num_state_slots: int) -> None:
    held = [b for s in running for b in s.block_table]
    assert bm.num_used_blocks == len(set(held)) and bm.num_free_blocks == bm.num_blocks - len(set(held))
    slots = [s.state_slot for s in running]
    assert len(set(slots)) == len(slots) and all(x in range(max_num_seqs) for x in slots)
    snap = list(bm._snapshots.values())
    assert len(set(snap)) == len(snap) and all(x in range(max_num_seqs, num_state_slots) for x in snap)


@pytest.mark.parametrize("linear", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_the_books_and_serve_the_right_prefixes(seed: int, linear: bool) -> None:
    rng = random.Random(seed)
    max_num_seqs, num_state_slots = 3, 3 + rng.randint(2, 4)
    bm, mem = manager(rng.randint(10, 24), max_num_seqs, num_state_slots, linear=linear)
    bases = [[rng.randrange(1000) for _ in range(rng.randint(5, 14))] for _ in range(3)]
    running: list[Sequence] = []
    hits = misses = 0
    for _ in range(120):
        if running and (rng.random() < 0.4 or len(running) == max_num_seqs):
            s = running.pop(rng.randrange(len(running)))
            bm.free(s)
        elif running and rng.random() < 0.5:
            s = rng.choice(running)  # decode or a further chunk
            if s.num_computed == s.num_tokens and s.num_tokens < s.prompt_len + 8:
                s.append(rng.randrange(1000))
            if s.num_computed < s.num_tokens and bm.can_allocate(s, s.num_tokens - s.num_computed):
                compute(bm, mem, s, s.num_tokens)
        else:
            base = rng.choice(bases)
            s = seq(base[:rng.randint(1, len(base))] + [rng.randrange(1000) for _ in range(rng.randint(0, 6))],
                    max_tokens=8)
            hit = bm.match_prefix(s)
            if not bm.can_admit(s, hit, s.num_tokens - hit.num_tokens):
                continue
            admit(bm, mem, s)
            hits, misses = hits + hit.num_tokens, misses + s.num_tokens - hit.num_tokens
            running.append(s)
            # a prompt in one or two chunks; a chunk end at a block boundary takes a snapshot
            cut = rng.choice([s.num_tokens, s.num_tokens // BS * BS, s.num_tokens - rng.randint(0, 5)])
            if cut > s.num_computed:
                compute(bm, mem, s, cut)
        _check_books(bm, running, max_num_seqs, num_state_slots)
    stats = bm.stats()
    assert (stats["prefix_hit_tokens"], stats["prefix_miss_tokens"]) == (hits, misses)
    assert hits > 0, (hits, misses)


def test_a_duplicate_block_is_not_offered_later_when_the_cached_copy_was_evicted() -> None:
    bm, mem = manager(4, max_num_seqs=3, num_state_slots=3, linear=False)
    ids = list(range(800, 809))
    a, b = seq(ids), seq(ids)
    admit(bm, mem, a)
    admit(bm, mem, b)
    compute(bm, mem, a, 4)
    compute(bm, mem, b, 4)  # b's block 0 duplicates a's: not cached
    bm.free(a)
    c = seq([1, 2, 3])
    admit(bm, mem, c)
    compute(bm, mem, c, 3)  # takes one of the two never-cached blocks
    d = seq([4, 5, 6, 7, 8])
    admit(bm, mem, d)
    bm.allocate(d, 5)  # the last never-cached block, then a's block 0, the only cached copy of the prefix
    assert bm.num_cached_blocks == 0
    bm.free(c)
    bm.free(d)
    compute(bm, mem, b, 8)  # b's new full block 1 is offered; its block 0 was computed earlier and is not
    assert bm.num_cached_blocks == 1
    assert bm.match_prefix(seq(ids)).num_tokens == 0  # the chain starts at an uncached block


def test_no_snapshot_before_anything_is_computed_even_when_the_prompt_is_cached() -> None:
    bm, mem = manager(16, max_num_seqs=2, num_state_slots=4)
    ids = list(range(900, 913))
    a = seq(ids)
    admit(bm, mem, a)
    compute(bm, mem, a, 12, snapshot=False)  # KV cached for 3 blocks, no state kept
    bm.free(a)
    b = seq(ids)
    hit = admit(bm, mem, b)
    assert hit.num_tokens == 0  # no snapshot: nothing reusable for a hybrid model
    bm.snapshot_state(b)  # at 0 tokens: there is no state to keep
    assert mem.copies == [] and bm.stats()["state_snapshots"] == 0


def test_trim_frees_the_blocks_past_the_computed_tokens_and_keeps_the_rest() -> None:
    """Speculative decoding: the blocks taken for drafts that were rejected go back; whole blocks of computed
    tokens, and the partly filled last one, stay."""
    bm, mem = manager(8, linear=False)
    s = seq(list(range(6)))
    admit(bm, mem, s)
    compute(bm, mem, s, 6)  # 2 blocks: one full (cached), one partial
    bm.allocate(s, 8)  # room for 8 drafts: 14 tokens in 4 blocks
    assert len(s.block_table) == 4 and bm.num_free_blocks == 4
    table, kept, dropped = s.block_table, s.block_table[:2], s.block_table[2:]
    s.num_computed = 7  # one draft accepted: 7 tokens fill 2 blocks
    bm.trim(s)
    assert s.block_table == kept and s.block_table is not table  # a new list (the runner caches by identity)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.num_cached_blocks) == (6, 2, 1)
    other = seq(list(range(100, 124)))  # takes every free block, the trimmed ones too, never s's
    admit(bm, mem, other)
    compute(bm, mem, other, 24)
    assert set(dropped) <= set(other.block_table) and not set(kept) & set(other.block_table)
    bm.free(other)
    s.num_computed = 8  # exactly two full blocks: nothing past them to free
    bm.trim(s)
    assert s.block_table == kept and bm.num_used_blocks == 2
    bm.allocate(s, 1)
    s.num_computed = 8  # the draft's block goes back; a block boundary keeps no extra block
    bm.trim(s)
    assert s.block_table == kept and bm.num_used_blocks == 2
