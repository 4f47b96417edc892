"""Decode graphs on the CPU: the bucket sizes, the graph shape of a step (decode_graphs.graph_shape), padding a step
to it (step.pad_step), and the runner's choice between a graph replay, a warm-up and an eager step
(CudaRunner._forward_graphed with the device work stubbed out)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import runner as runner_mod
from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.decode_graphs import (
    BUCKETS,
    GRAPH_MAX_CHUNK,
    TOKEN_BUCKETS,
    DecodeCounts,
    GraphKey,
    ScratchRows,
    bucket_for,
    bucket_sizes,
    graph_shape,
    table_width_bucket,
)
from gpu_engine.cuda.runner import CudaRunner
from gpu_engine.cuda.step import PAD_SAMPLE_PARAMS, build_step, pad_step
from gpu_engine.cuda.verify import VerifyBook
from gpu_engine.errors import RunnerInputError
from gpu_engine.runner_api import CacheSpec, SamplingRequest, SeqChunk, StepBatch, StepOutput

SPEC = CacheSpec(num_kv_blocks=8, block_size=4, num_state_slots=5)
CFG = SimpleNamespace(vocab_size=50, hidden_size=6, full_attention_layers=[1])


def decode(seq: int, start: int, table: list[int], slot: int, n: int = 1) -> SeqChunk:
    """`n` new tokens of sequence `seq` from `start` (n > 1: a jump-forward run), last-row logits."""
    return SeqChunk(seq_id=seq, token_ids=np.arange(n) + seq + 7,
                    positions=np.tile(np.arange(start, start + n), (3, 1)), start=start,
                    block_table=np.array(table, np.int32), state_slot=slot)


def greedy(rows: int, temperature: float = 0.0) -> SamplingRequest:
    return SamplingRequest(temperature=np.full(rows, temperature, np.float32), top_k=np.zeros(rows, np.int64),
                           top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                           uniform=np.full(rows, 0.25), num_logprobs=np.full(rows, 3, np.int64))


def test_buckets_cover_every_batch_up_to_the_state_slots():
    assert bucket_sizes(256) == BUCKETS
    assert bucket_sizes(5) == (1, 2, 4, 8)
    assert bucket_sizes(288) == (*BUCKETS, 320)
    assert bucket_sizes(1) == (1,)
    for top in (1, 7, 100, 256, 288, 600):
        sizes = bucket_sizes(top)
        assert list(sizes) == sorted(set(sizes)) and sizes[-1] >= top
        for rows in range(1, top + 1):
            b = bucket_for(rows, sizes)
            assert b is not None and rows <= b
            assert b < 2 * rows or b == rows == 1  # padding rows never outnumber the batch
    assert bucket_for(190, BUCKETS) == 192 and bucket_for(257, BUCKETS) is None
    with pytest.raises(ValueError):
        bucket_sizes(0)
    assert [table_width_bucket(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]


def test_graph_shapes_round_the_forced_tokens_up_and_leave_room_for_their_padding():
    assert graph_shape([1] * 190, BUCKETS, 16) == (192, 192)  # plain decode: no token bucket past one each
    assert graph_shape([1] * 192, BUCKETS, 16) == (192, 192)
    # 190 rows + 10 runs of 5 tokens: 40 tokens past one each -> 48; 8 spare tokens need one padding sequence
    assert graph_shape([1] * 180 + [5] * 10, BUCKETS, 16) == (192, 240)
    # 192 sequences leave no padding row in the 192 bucket: the next one
    assert graph_shape([1] * 182 + [5] * 10, BUCKETS, 16) == (224, 272)
    # spare tokens beyond one padding sequence's block: as many padding sequences as carry them
    assert graph_shape([1, 2], BUCKETS, 4) == (8, 8 + 16)  # 15 spare tokens, 3 a sequence: 5 sequences -> 8
    assert graph_shape([1] * 3 + [GRAPH_MAX_CHUNK], BUCKETS, 16) is not None
    assert graph_shape([1] * 3 + [GRAPH_MAX_CHUNK + 1], BUCKETS, 16) is None  # the prefill kernels' length
    assert graph_shape([20] * 20, BUCKETS, 16) is None  # 380 tokens past one each: more than TOKEN_BUCKETS
    assert graph_shape([1] * 257, BUCKETS, 16) is None and graph_shape([], BUCKETS, 16) is None
    assert graph_shape([1, 2], BUCKETS, 1) is None  # one-token blocks cannot carry spare tokens
    for lens in ([1], [3, 1, 1], [1] * 40 + [7] * 9, [31] * 8):
        rows, tokens = graph_shape(lens, BUCKETS, 16)
        assert rows >= len(lens) and tokens - rows in TOKEN_BUCKETS and tokens - sum(lens) >= rows - len(lens)
        assert tokens - sum(lens) <= (rows - len(lens)) * 16


def test_a_padded_decode_step_keeps_its_rows_and_points_the_padding_at_the_scratch_rows():
    batch = StepBatch([decode(0, 5, [3, 1], 2), decode(1, 2, [4], 0), decode(2, 9, [6, 7, 5], 4)],
                      sampling=greedy(3, temperature=0.7))
    plain = build_step(batch, SPEC, CFG, "bf16", table_width=4)
    scratch = ScratchRows(block=SPEC.num_kv_blocks, slot=SPEC.num_state_slots)
    padded = pad_step(plain, 8, 8, scratch.block, SPEC.block_size, scratch.slot)
    p, t = padded.tables, plain.tables
    assert padded.n == 8 and padded.logit_rows == 8 and padded.padding == 5 and padded.batch_logit_rows == 3
    assert p.cu.tolist() == list(range(9)) and p.tok_seq.tolist() == list(range(8))
    for name, arr in t.items():  # the batch's own rows come first, unchanged
        got = getattr(p, name)
        if name in ("cu", "tiles"):
            continue
        if name == "pos":
            assert (got[:, :3] == arr).all()
        elif name != "vis_rows":
            assert (got[: arr.shape[0]] == arr).all(), name
    assert p.ids[3:].tolist() == [0] * 5 and (p.pos[:, 3:] == 0).all() and p.tok_pos[3:].tolist() == [0] * 5
    assert p.slots[3:].tolist() == [5] * 5 and p.fresh[3:].tolist() == [1] * 5  # fresh: the slot is never read
    assert (p.tables[3:] == 8).all() and p.kv_slots[3:].tolist() == [8 * 4] * 5  # block 8: not one of the spec's
    assert p.logit_rows.tolist() == list(range(8)) and p.tiles.tolist() == [[r, 1] for r in range(8)]
    assert p.sample_params is not None and p.sample_params.shape == (8, 8)
    params = p.sample_params.view(np.float32)
    assert (params[3:] == PAD_SAMPLE_PARAMS).all() and params[0, 0] == np.float32(0.7)
    assert all(arr.dtype == np.int32 for _, arr in p.items())
    assert pad_step(plain, 3, 3, scratch.block, 4, scratch.slot) is plain


def test_padding_sequences_carry_the_spare_tokens_a_block_at_a_time():
    batch = StepBatch([decode(0, 5, [3, 1], 2, n=3), decode(1, 2, [4], 0)])  # a 3-token run and a decode token
    plain = build_step(batch, SPEC, CFG, "bf16")
    padded = pad_step(plain, 5, 4 + 9, 8, SPEC.block_size, 5)  # 3 padding sequences, 9 tokens: 4 + 4 + 1
    t = padded.tables
    assert padded.n == 13 and padded.padding == 3 and padded.batch_logit_rows == 2 and padded.longest_chunk == 4
    assert t.cu.tolist() == [0, 3, 4, 8, 12, 13] and t.tok_seq.tolist() == [0] * 3 + [1] + [2] * 4 + [3] * 4 + [4]
    assert t.tok_pos[4:].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0] and (t.pos[:, 4:] == t.tok_pos[4:]).all()
    assert t.kv_slots[4:].tolist() == [32, 33, 34, 35, 32, 33, 34, 35, 32]  # all in scratch block 8 (block size 4)
    assert t.logit_rows.tolist() == [2, 3, 7, 11, 12]
    assert t.tiles.tolist() == [[0, 3], [3, 1], [4, 4], [8, 4], [12, 1]]
    assert t.slots.tolist() == [2, 0, 5, 5, 5] and t.fresh.tolist() == [0, 0, 1, 1, 1]
    assert t.ids.size == 13 and t.pos.shape == (3, 13) and all(a.dtype == np.int32 for _, a in t.items())


def test_only_short_chunk_steps_are_padded_and_never_shrunk():
    batch = StepBatch([decode(0, 5, [3, 1], 2), decode(1, 2, [4], 0)])
    plain = build_step(batch, SPEC, CFG, "bf16")
    with pytest.raises(RunnerInputError, match="does not pad to 1 and 1"):
        pad_step(plain, 1, 1, 8, 4, 5)
    with pytest.raises(RunnerInputError, match="does not pad to 3 and 8"):  # 6 tokens for one padding row of 4
        pad_step(plain, 3, 8, 8, 4, 5)
    with pytest.raises(RunnerInputError, match="does not pad to 2 and 3"):  # tokens but no padding row
        pad_step(plain, 2, 3, 8, 4, 5)
    prompt = SeqChunk(seq_id=0, token_ids=np.arange(3), positions=np.tile(np.arange(3), (3, 1)), start=0,
                      block_table=np.array([2], np.int32), state_slot=1, logits="all")
    with pytest.raises(RunnerInputError, match="one logits row each"):
        pad_step(build_step(StepBatch([prompt]), SPEC, CFG, "bf16"), 4, 8, 8, 4, 5)
    twice = pad_step(plain, 4, 4, 8, 4, 5)
    with pytest.raises(RunnerInputError, match="one logits row each"):
        pad_step(twice, 8, 8, 8, 4, 5)


class FakeStep:
    """Stands in for CapturedStep: records loads and replays."""

    def __init__(self, host) -> None:
        self.host, self.loads, self.replays = host, 0, 0
        self.bufs = SimpleNamespace(sampler=None)

    def load(self, host, batch) -> None:
        self.host, self.loads = host, self.loads + 1

    def replay(self) -> None:
        self.replays += 1

    def hidden(self) -> np.ndarray:
        return np.zeros((self.host.batch_logit_rows, 6), np.float32)

    def logits(self) -> np.ndarray:
        return np.zeros((self.host.batch_logit_rows, 50), np.float32)


def fake_runner(monkeypatch, fail_capture: bool = False, scratch: bool = True) -> CudaRunner:
    """A CudaRunner without a GPU: the host-side graph bookkeeping of _forward_graphed, device work stubbed."""
    r = CudaRunner.__new__(CudaRunner)
    r.cfg, r.dtype, r.spec, r.use_graphs = CFG, "bf16", SPEC, True
    r.ctx = SimpleNamespace(arena=Arena(base=1 << 30, capacity=1 << 30))
    r._graphs, r._warm, r._no_graph, r.decode_counts = {}, set(), {}, DecodeCounts()
    r.graph_memory_cap, r._graph_bytes = 1 << 20, 0
    r.scratch = ScratchRows(SPEC.num_kv_blocks, SPEC.num_state_slots) if scratch else None
    r.buckets = bucket_sizes(SPEC.num_state_slots) if scratch else ()
    r.eager_hosts = []  # type: ignore[attr-defined]
    r.book, r._verify_layers = VerifyBook("recompute", SPEC.num_state_slots), []

    def run_eager(host, batch, offsets):
        r.eager_hosts.append(host)  # type: ignore[attr-defined]
        return StepOutput(logits=np.zeros((host.batch_logit_rows, 50), np.float32), row_offsets=offsets, hidden=None)

    def record(host, batch, width, owns):
        assert not owns
        if fail_capture:
            raise RuntimeError("capture refused")
        r.ctx.arena.alloc(4096, "graph buffers")  # released by _record's caller in the real runner
        return FakeStep(host)

    monkeypatch.setattr(r, "_run_eager", run_eager)
    monkeypatch.setattr(r, "_record", record)
    return r


def batch_of(rows: int, start: int = 1, runs: int = 0) -> StepBatch:
    """`rows` decode tokens, the last `runs` of them 3-token jump-forward runs."""
    return StepBatch([decode(s, start, [s], s, n=3 if s >= rows - runs else 1) for s in range(rows)])


def test_a_key_runs_eagerly_at_its_padded_size_and_is_captured_for_its_next_steps(monkeypatch):
    r = fake_runner(monkeypatch)
    for _ in range(3):
        out = r.forward(batch_of(3))
        assert out.logits.shape == (3, 50)
    key = GraphKey(rows=4, tokens=4, width=1, sampling=False)
    assert list(r._graphs) == [key] and r.eager_hosts[0].n == 4 and r.eager_hosts[0].padding == 1
    step = r._graphs[key]
    assert step.replays == 2 and step.loads == 2 and len(r.eager_hosts) == 1
    r.forward(batch_of(4))  # the same graph, no padding this time
    r.forward(batch_of(2))  # bucket 2: a new key, eager first
    assert step.replays == 3 and step.host.padding == 0
    assert r.decode_counts == DecodeCounts(graphed=3, padded=2, with_runs=0, eager_graphable=2, other=0, captures=2)
    assert 0 < r._graph_bytes <= r.graph_memory_cap


def test_steps_with_jump_forward_runs_replay_their_own_graphs(monkeypatch):
    r = fake_runner(monkeypatch)
    for _ in range(3):
        # 3 sequences, 7 tokens: 4 past one each -> 16; 12 spare tokens, 3 a padding row (block size 4): 4 rows
        r.forward(batch_of(3, runs=2))
    key = GraphKey(rows=8, tokens=8 + 16, width=1, sampling=False)
    assert list(r._graphs) == [key] and r._graphs[key].host.n == 24 and r._graphs[key].host.padding == 5
    assert r.decode_counts.graphed == 2 and r.decode_counts.with_runs == 2
    long_run = StepBatch([decode(0, 2, [0, 1, 2, 3, 4, 5, 6, 7, 8], 0, n=GRAPH_MAX_CHUNK + 1)])
    monkeypatch.setattr(r, "_forward_eager", lambda *args: "eager")
    assert r.forward(long_run) == "eager" and r.decode_counts.other == 1


def test_a_failed_capture_leaves_the_key_eager(monkeypatch):
    r = fake_runner(monkeypatch, fail_capture=True)
    for _ in range(4):
        r.forward(batch_of(3))
    key = GraphKey(rows=4, tokens=4, width=1, sampling=False)
    assert not r._graphs and "capture refused" in r._no_graph[key] and len(r.eager_hosts) == 4
    assert r.decode_counts.eager_graphable == 4 and r.decode_counts.captures == 0


def test_without_scratch_rows_graphs_are_per_exact_size_and_other_steps_stay_eager(monkeypatch):
    r = fake_runner(monkeypatch, scratch=False)
    for _ in range(2):
        r.forward(batch_of(3))
    assert list(r._graphs) == [GraphKey(rows=3, tokens=3, width=1, sampling=False)]
    assert r.eager_hosts[0].padding == 0
    monkeypatch.setattr(r, "_forward_eager", lambda *args: "eager")
    prompt = SeqChunk(seq_id=0, token_ids=np.arange(3), positions=np.tile(np.arange(3), (3, 1)), start=0,
                      block_table=np.array([2], np.int32), state_slot=1, logits="none")
    assert r.forward(StepBatch([prompt])) == "eager" and r.decode_counts.other == 1


def test_graphs_are_capped(monkeypatch):
    r = fake_runner(monkeypatch)
    monkeypatch.setattr(runner_mod, "MAX_GRAPHS", 1)
    for rows in (3, 3, 1, 1, 1):
        r.forward(batch_of(rows))
    assert len(r._graphs) == 1 and r.decode_counts.eager_graphable == 4 and r.decode_counts.graphed == 1
