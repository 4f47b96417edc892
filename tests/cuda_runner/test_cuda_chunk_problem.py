"""gpu_engine.runner_rules.chunk_problem: the batch validation both runners (numpy reference, CUDA) share; on the
CPU."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.runner_api import CacheSpec, SeqChunk, VisionSlice
from gpu_engine.runner_rules import chunk_problem

SPEC = CacheSpec(num_kv_blocks=8, block_size=4, num_state_slots=2)
VOCAB, HIDDEN = 100, 16


def chunk(rng: np.random.Generator, n: int = 6, **changes) -> SeqChunk:
    fields = dict(seq_id=3, token_ids=rng.integers(0, VOCAB, n), positions=np.broadcast_to(np.arange(n), (3, n)),
                  start=0, block_table=np.array([5, 2], np.int32), state_slot=1)
    fields.update(changes)
    return SeqChunk(**fields)


def problem(c: SeqChunk, paged_kv: bool = True) -> str | None:
    return chunk_problem(c, SPEC, vocab_size=VOCAB, hidden_size=HIDDEN, paged_kv=paged_kv)


def test_well_formed_chunks_pass() -> None:
    rng = np.random.default_rng()
    assert problem(chunk(rng)) is None
    device_like = SimpleNamespace(shape=(2, HIDDEN))  # device buffers are checked through .shape only
    host = rng.standard_normal((4, HIDDEN)).astype(np.float32)
    assert problem(chunk(rng, vision=[VisionSlice(0, device_like), VisionSlice(2, host)], logits="all")) is None
    # no full-attention layers: the block table is not used, so it is not checked
    assert problem(chunk(rng, block_table=np.zeros(0, np.int32)), paged_kv=False) is None


@pytest.mark.parametrize("changes, words", [
    (dict(n=0), "needs at least one token"),
    (dict(token_ids=np.array([1, 2, VOCAB, 3, 4, 5])), rf"token ids must be in \[0, {VOCAB}\)"),
    (dict(token_ids=np.array([1, -1, 2, 3, 4, 5])), "token ids must be in"),
    (dict(positions=np.zeros((2, 6), np.int64)), r"positions must have shape \(3, 6\), got \(2, 6\)"),
    (dict(start=-2), "start must be >= 0, got -2"),
    (dict(start=3), "block table has 2 blocks, needs 3"),
    (dict(block_table=np.array([5, 8], np.int32)), r"block ids must be in \[0, 8\)"),
    (dict(state_slot=2), r"state slot 2 out of range \[0, 2\)"),
    (dict(logits="first"), "logits must be 'none', 'last' or 'all', got 'first'"),
    (dict(vision=[VisionSlice(0, np.zeros((2, HIDDEN + 1)))]), r"vision embeddings must be \[n, 16\], got \(2, 17\)"),
    (dict(vision=[VisionSlice(5, np.zeros((2, HIDDEN)))]), r"vision rows \[5, 7\) fall outside the chunk of 6"),
    (dict(vision=[VisionSlice(-1, SimpleNamespace(shape=(1, HIDDEN)))]), r"vision rows \[-1, 0\)"),
])
def test_bad_chunks_are_named(changes: dict, words: str) -> None:
    rng = np.random.default_rng()
    n = changes.pop("n", 6)
    if n == 0:
        changes.update(token_ids=np.zeros(0, np.int64), positions=np.zeros((3, 0), np.int64))
    found = problem(chunk(rng, n=n, **changes))
    assert found is not None and found.startswith("sequence 3: ")
    assert re.search(words, found), found


def test_state_slot_copies_are_range_checked_by_the_same_rule() -> None:
    """copy_state's check (check_state_slots) and the batch check name an out-of-range slot in the same words."""
    from gpu_engine.errors import RunnerInputError
    from gpu_engine.runner_rules import check_state_slots

    slots = int(np.random.default_rng().integers(1, 9))
    spec = CacheSpec(num_kv_blocks=8, block_size=4, num_state_slots=slots)
    check_state_slots(spec, 0, slots - 1)  # both ends of the range
    for bad in (slots, -1):
        with pytest.raises(RunnerInputError, match=re.escape(f"state slot {bad} out of range [0, {slots})")):
            check_state_slots(spec, 0, bad)
