"""Verify windows on the CUDA runner, host side (cuda/verify.py, verify_ops.copy_table, the verify parts of step.py,
decode_graphs.py and runner.py), without a GPU: a numpy stand-in for the device runs each StepPlan as the kernels
would (one launch of simultaneous copies, then every chunk token by token from its slot's state, window rows
written by the window strategy) on a toy recurrence, and an engine-like driver accepts a random part of every
window. Every logits row must carry the state of the true sequence at its position, for both strategies."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.decode_graphs import VERIFY_TOKEN_BUCKETS, GraphKey, graph_shape
from gpu_engine.cuda.step import build_step, pad_step
from gpu_engine.cuda.verify import Copy, StepPlan, VerifyBook
from gpu_engine.cuda.verify_ops import VerifyRows, copy_table
from gpu_engine.errors import RunnerInputError
from gpu_engine.runner_api import SeqChunk, StepBatch
from tests.cuda_runner.test_decode_graphs import CFG, SPEC, fake_runner

MOD = 1_000_003


def step_state(state: int, token: int, pos: int) -> int:
    """The toy recurrence standing in for a layer's conv + delta-rule state: order-sensitive, exact."""
    return (state * 131 + token * 7 + pos * 3 + 1) % MOD


class EmuDevice:
    """Slots, snapshot / window rows and the kernels' order: copies (all read before any is written), then chunks."""

    def __init__(self, slots: int, rows: int) -> None:
        self.slot = np.zeros(slots, np.int64)
        self.extra = np.full(rows, -1, np.int64)  # snapshot rows or window rows

    def run(self, plan: StepPlan) -> list[np.ndarray]:
        slot0, extra0 = self.slot.copy(), self.extra.copy()
        for c in plan.copies:
            if c.kind == "slot_to_snap":
                self.extra[c.row] = slot0[c.slot]
            else:
                self.slot[c.slot] = extra0[c.row]
        rows = []
        for i, chunk in enumerate(plan.batch.chunks):
            st = 0 if chunk.start == 0 else int(self.slot[chunk.state_slot])
            states = []
            for j, (tok, pos) in enumerate(zip(chunk.token_ids, chunk.positions[0])):
                st = step_state(st, int(tok), int(pos))
                states.append(st)
                if plan.win is not None and plan.win[i] >= 0 and j < chunk.num_tokens - 1:
                    self.extra[plan.win[i] + j] = st
            self.slot[chunk.state_slot] = st
            skip = plan.logit_skip[i]
            rows.append(np.array(states[skip:] if chunk.logits == "all" else states[-1:], np.int64))
        return rows


def truth(tokens: list[int]) -> list[int]:
    st, out = 0, []
    for pos, tok in enumerate(tokens):
        st = step_state(st, tok, pos)
        out.append(st)
    return out


def chunk(seq: int, tokens: list[int], start: int, slot: int, verify: bool) -> SeqChunk:
    return SeqChunk(seq_id=seq, token_ids=np.array(tokens, np.int64),
                    positions=np.tile(np.arange(start, start + len(tokens)), (3, 1)), start=start,
                    block_table=np.arange(-(-(start + len(tokens)) // SPEC.block_size), dtype=np.int32) % 8,
                    state_slot=slot, logits="all" if verify else "last",
                    verify=verify)


@pytest.mark.parametrize("strategy", ["recompute", "window"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rows", [4, 2])
def test_every_logits_row_sees_the_state_of_the_accepted_sequence(strategy: str, seed: int, rows: int) -> None:
    """`rows` < slots: the driver drafts for at most book.room() sequences a step, as the speculator does, and
    finished sequences' windows are taken back when a step runs short."""
    rng = np.random.default_rng(seed)
    slots, k = 4, 3
    book = VerifyBook(strategy, rows, window_tokens=k)
    dev = EmuDevice(slots, rows * (k if strategy == "window" else 1))
    seqs: dict[int, list[int]] = {}  # slot -> the true tokens (prompt + accepted)
    fresh = list(range(slots))
    refed = rolled = 0
    for _ in range(200):
        for s in fresh:  # a new sequence takes the slot: a prompt chunk from 0
            seqs[s] = rng.integers(0, 50, int(rng.integers(1, 6))).tolist()
        chunks, lens = [], {}
        room = book.room()
        for s, toks in seqs.items():
            if s in fresh:
                chunks.append(chunk(s, toks, 0, s, False))
                continue
            start = len(toks) - 1  # the last real token is not in the cache yet
            drafts = rng.integers(0, 50, int(rng.integers(0, k + 1)) if room > 0 else 0).tolist()
            room -= bool(drafts)
            chunks.append(chunk(s, [toks[-1], *drafts], start, s, bool(drafts)))
            lens[s] = len(drafts)
        fresh = []
        order = rng.permutation(len(chunks))
        batch = StepBatch([chunks[i] for i in order])
        plan = book.plan(batch)
        assert book.plan(batch).copies == plan.copies  # planning changes nothing
        refed += sum(plan.logit_skip)
        rows = dev.run(plan)
        book.commit(plan)
        for c, got in zip(batch.chunks, rows):
            s, toks = c.state_slot, seqs[c.state_slot]
            if c.start == 0:
                assert got.tolist() == truth(toks)[-1:]
                seqs[s] = toks + [int(rng.integers(0, 50))]  # the sampled token
                continue
            expect = truth(toks[:-1] + c.token_ids.tolist())[c.start:]
            assert got.tolist() == (expect if c.verify else expect[-1:])
            keep = int(rng.integers(1, lens[s] + 2))  # the last real token and keep - 1 drafts stay
            seqs[s] = toks + c.token_ids[1:keep].tolist() + [int(rng.integers(0, 50))]
            if c.verify and keep < c.num_tokens:
                book.rollback(s, keep)
                rolled += 1
            if rng.random() < 0.05:
                fresh.append(s)
    assert rolled > 30 and (refed > 30 if strategy == "recompute" else refed == 0)


def test_recompute_refeeds_the_accepted_tokens_and_reuses_the_snapshot() -> None:
    book = VerifyBook("recompute", 2)
    window = chunk(0, [5, 6, 7, 8], 10, 1, True)
    plan = book.plan(StepBatch([window]))
    assert plan.copies == [Copy("slot_to_snap", 1, 0)] and plan.logit_skip == [0] and plan.win is None
    book.commit(plan)
    book.rollback(1, 2)  # tokens 10, 11 stay
    assert book.owes(1)
    nxt = book.plan(StepBatch([chunk(0, [9, 1, 2], 12, 1, True)]))
    run = nxt.batch.chunks[0]
    assert run.start == 10 and run.token_ids.tolist() == [5, 6, 9, 1, 2] and nxt.logit_skip == [2]
    assert run.positions[:, 0].tolist() == [10, 10, 10]
    assert nxt.copies == [Copy("snap_to_slot", 1, 0)]  # restored; the row stays the new window's snapshot
    book.commit(nxt)
    assert not book.owes(1) and book.windows[1].prefix == 2
    book.rollback(1, 1)  # of the engine's window: keeps the re-fed 2 and token 12
    assert book.refeeds[1].token_ids.tolist() == [5, 6, 9] and book.refeeds[1].start == 10
    with pytest.raises(RunnerInputError, match="rolled back to position 13"):
        book.plan(StepBatch([chunk(0, [4], 14, 1, False)]))
    restart = book.plan(StepBatch([chunk(3, [1, 2, 3], 0, 1, False)]))  # a fresh sequence takes the slot
    assert restart.logit_skip == [0] and restart.copies == []
    book.commit(restart)
    assert not book.owes(1) and 1 not in book.windows


def test_window_strategy_keeps_rows_and_copies_back_the_accepted_one() -> None:
    book = VerifyBook("window", 2, window_tokens=3)
    plan = book.plan(StepBatch([chunk(0, [1], 4, 0, False), chunk(1, [5, 6, 7, 8], 10, 1, True)]))
    assert plan.win is not None and plan.win.tolist() == [-1, 0] and plan.copies == []
    book.commit(plan)
    book.rollback(1, 2)
    assert book.pending == [Copy("window_to_slot", 1, 1)]  # the state after the window's second token
    nxt = book.plan(StepBatch([chunk(1, [9, 2], 12, 1, True), chunk(2, [3, 4], 7, 0, True)]))
    assert nxt.copies == [Copy("window_to_slot", 1, 1)] and nxt.logit_skip == [0, 0]
    assert nxt.win is not None and sorted(nxt.win.tolist()) == [0, 3]  # row 0's pending copy ran first
    with pytest.raises(RunnerInputError, match="window rows"):
        book.plan(StepBatch([chunk(1, [9, 2, 3, 4, 5], 12, 1, True)]))
    book.commit(nxt)
    assert book.pending == []
    book.forget(0)
    assert 0 not in book.windows


def test_refusals_name_the_problem() -> None:
    book = VerifyBook("recompute", 1)
    with pytest.raises(RunnerInputError, match="cannot keep 2 tokens"):
        book.rollback(0, 2)
    with pytest.raises(RunnerInputError, match="no free snapshot rows"):
        book.plan(StepBatch([chunk(0, [1, 2], 3, 0, True), chunk(1, [1, 2], 3, 1, True)]))
    book.commit(book.plan(StepBatch([chunk(0, [1, 2], 3, 0, True)])))
    with pytest.raises(RunnerInputError, match="cannot keep 3 tokens of a verify window of 2"):
        book.rollback(0, 3)
    book.rollback(0, 2)  # all kept: nothing to do
    assert not book.owes(0)
    with pytest.raises(ValueError, match="strategy"):
        VerifyBook("undo", 1)  # type: ignore[arg-type]


def test_copy_table_moves_every_layer_both_ways() -> None:
    def arr(ptr: int, rows: int, shape: tuple[int, ...], dtype: str) -> DArray:
        return DArray(ptr, (rows, *shape), dtype)

    layers = [VerifyRows(arr(1000 * i, 4, (3, 8), "bf16"), arr(10**6 * (i + 1), 4, (2, 4, 4), "f32"),
                         arr(10**8 + 1000 * i, 2, (3, 8), "bf16"), arr(10**9 * (i + 1), 2, (2, 4, 4), "f32"))
              for i in range(2)]
    table = copy_table([Copy("slot_to_snap", 3, 1), Copy("window_to_slot", 2, 0)], layers)
    assert table.shape == (8, 3)
    conv, state = 3 * 8 * 2, 2 * 4 * 4 * 4
    assert table[0].tolist() == [10**8 + conv, 3 * conv, conv]  # snapshot row 1 <- slot 3, layer 0 conv
    assert table[1].tolist() == [10**9 + state, 10**6 + 3 * state, state]
    assert table[4].tolist() == [2 * conv, 10**8, conv]  # slot 2 <- window row 0
    assert table[7].tolist() == [2 * 10**6 + 2 * state, 2 * 10**9, state]


def test_refed_rows_get_no_logits_and_verify_graphs_compute_every_row() -> None:
    spec, cfg = SPEC, CFG
    refed = chunk(0, [5, 6, 9, 1, 2], 4, 0, True)
    host = build_step(StepBatch([refed, chunk(1, [3], 2, 1, False)]), spec, cfg, "bf16", logit_skip=[2, 0])
    assert host.tables.logit_rows.tolist() == [2, 3, 4, 5] and host.batch_logit_rows == 4
    shape = graph_shape([5, 1], (1, 2, 4), spec.block_size, VERIFY_TOKEN_BUCKETS)
    assert shape == (2, 6)  # 4 tokens past one per sequence: an exact verify bucket, no padding row
    padded = pad_step(host, 4, 12, 8, spec.block_size, 5, all_rows=True)
    assert padded.logit_rows == 12 and padded.batch_logit_rows == 4 and padded.tables.logit_rows[:4].tolist() == [
        2, 3, 4, 5]


def test_a_verify_step_replays_its_own_graph_with_every_rows_logits(monkeypatch) -> None:
    r = fake_runner(monkeypatch)
    for start in (5, 6, 7):
        out = r.forward(StepBatch([chunk(0, [1, 2, 3, 4], start, 0, True), chunk(1, [7], start, 1, False)]))
        assert out.logits.shape == (5, 50) and out.row_offsets == [0, 4, 5]
        r.book.windows.clear()  # no rollback: the fake runs nothing
    key = GraphKey(rows=2, tokens=5, width=4, sampling=False, verify=True)
    assert list(r._graphs) == [key] and r.decode_counts.graphed == 2


def test_a_step_short_of_rows_takes_the_oldest_stale_window() -> None:
    book = VerifyBook("recompute", 2)
    for slot in (0, 1):  # two windows no rollback comes for (all accepted, or finished)
        book.commit(book.plan(StepBatch([chunk(slot, [1, 2], 5, slot, True)])))
    assert book.room() == 2
    plan = book.plan(StepBatch([chunk(2, [3, 4], 7, 2, True)]))
    assert plan.evicted == [0] and plan.copies == [Copy("slot_to_snap", 2, book.windows[0].row)]
    book.commit(plan)
    assert sorted(book.windows) == [1, 2]
    book.rollback(2, 1)  # a refeed holds its row until the slot's next chunk
    assert book.room() == 1
    with pytest.raises(RunnerInputError, match="no free snapshot rows"):
        book.plan(StepBatch([chunk(3, [1, 2], 4, 3, True), chunk(0, [1, 2], 7, 0, True)]))


def test_refed_tokens_do_not_send_a_step_to_the_prefill_kernels() -> None:
    run = chunk(0, list(range(1, 32)), 6, 0, False)  # a 31-token forced run, 3 re-fed tokens in front
    refed = SeqChunk(seq_id=0, token_ids=np.concatenate([[7, 8, 9], run.token_ids]),
                     positions=np.tile(np.arange(3, 37), (3, 1)), start=3,
                     block_table=np.arange(10, dtype=np.int32) % 8, state_slot=0)
    host = build_step(StepBatch([refed]), SPEC, CFG, "bf16", logit_skip=[3])
    assert host.n == 34 and host.longest_chunk == 31 < 32  # text_model.FLASH_MIN_CHUNK
