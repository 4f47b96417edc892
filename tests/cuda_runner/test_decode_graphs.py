"""Decode graphs on the CPU: the bucket sizes, padding a decode step to its bucket (step.pad_decode_step), and the
runner's choice between a graph replay, a warm-up and an eager step (CudaRunner._forward_graphed with the device
work stubbed out)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import runner as runner_mod
from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.decode_graphs import (
    BUCKETS,
    DecodeCounts,
    GraphKey,
    ScratchRows,
    bucket_for,
    bucket_sizes,
    table_width_bucket,
)
from gpu_engine.cuda.runner import CudaRunner
from gpu_engine.cuda.step import PAD_SAMPLE_PARAMS, build_step, pad_decode_step
from gpu_engine.errors import RunnerInputError
from gpu_engine.runner_api import CacheSpec, SamplingRequest, SeqChunk, StepBatch, StepOutput

SPEC = CacheSpec(num_kv_blocks=8, block_size=4, num_state_slots=5)
CFG = SimpleNamespace(vocab_size=50, hidden_size=6, full_attention_layers=[1])


def decode(seq: int, start: int, table: list[int], slot: int) -> SeqChunk:
    return SeqChunk(seq_id=seq, token_ids=np.array([seq + 7]), positions=np.full((3, 1), start), start=start,
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


def test_a_padded_decode_step_keeps_its_rows_and_points_the_padding_at_the_scratch_rows():
    batch = StepBatch([decode(0, 5, [3, 1], 2), decode(1, 2, [4], 0), decode(2, 9, [6, 7, 5], 4)],
                      sampling=greedy(3, temperature=0.7))
    plain = build_step(batch, SPEC, CFG, "bf16", table_width=4)
    scratch = ScratchRows(block=SPEC.num_kv_blocks, slot=SPEC.num_state_slots)
    padded = pad_decode_step(plain, 8, scratch.block, scratch.slot, SPEC.block_size)
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
    assert pad_decode_step(plain, 3, scratch.block, scratch.slot, 4) is plain


def test_only_decode_steps_are_padded_and_never_shrunk():
    batch = StepBatch([decode(0, 5, [3, 1], 2), decode(1, 2, [4], 0)])
    plain = build_step(batch, SPEC, CFG, "bf16")
    with pytest.raises(RunnerInputError, match="does not fit 1 rows"):
        pad_decode_step(plain, 1, 8, 5, 4)
    prompt = SeqChunk(seq_id=0, token_ids=np.arange(3), positions=np.tile(np.arange(3), (3, 1)), start=0,
                      block_table=np.array([2], np.int32), state_slot=1)
    with pytest.raises(RunnerInputError, match="only decode steps"):
        pad_decode_step(build_step(StepBatch([prompt]), SPEC, CFG, "bf16"), 4, 8, 5, 4)
    twice = pad_decode_step(plain, 4, 8, 5, 4)
    with pytest.raises(RunnerInputError, match="only decode steps"):
        pad_decode_step(twice, 8, 8, 5, 4)


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

    def run_eager(host, batch):
        r.eager_hosts.append(host)  # type: ignore[attr-defined]
        return StepOutput(logits=np.zeros((host.batch_logit_rows, 50), np.float32), row_offsets=[], hidden=None)

    def record(host, batch, width, owns):
        assert not owns
        if fail_capture:
            raise RuntimeError("capture refused")
        r.ctx.arena.alloc(4096, "graph buffers")  # released by _record's caller in the real runner
        return FakeStep(host)

    monkeypatch.setattr(r, "_run_eager", run_eager)
    monkeypatch.setattr(r, "_record", record)
    return r


def batch_of(rows: int, start: int = 2) -> StepBatch:
    return StepBatch([decode(s, start, [s], s) for s in range(rows)])


def test_a_key_runs_eagerly_at_its_padded_size_then_is_captured_then_replayed(monkeypatch):
    r = fake_runner(monkeypatch)
    for _ in range(3):
        out = r.forward(batch_of(3))
        assert out.logits.shape == (3, 50)
    key = GraphKey(rows=4, width=1, sampling=False)
    assert list(r._graphs) == [key] and r.eager_hosts[0].n == 4 and r.eager_hosts[0].padding == 1
    step = r._graphs[key]
    assert step.replays == 2 and step.loads == 1  # captured on the second step (tables uploaded there), then loaded
    r.forward(batch_of(4))  # the same graph, no padding this time
    r.forward(batch_of(2))  # bucket 2: a new key, eager first
    assert step.replays == 3 and step.host.padding == 0
    assert r.decode_counts == DecodeCounts(graphed=3, padded=2, eager_decode=2, other=0, captures=1)
    assert 0 < r._graph_bytes <= r.graph_memory_cap


def test_a_failed_capture_leaves_the_key_eager(monkeypatch):
    r = fake_runner(monkeypatch, fail_capture=True)
    for _ in range(4):
        r.forward(batch_of(3))
    key = GraphKey(rows=4, width=1, sampling=False)
    assert not r._graphs and "capture refused" in r._no_graph[key] and len(r.eager_hosts) == 4
    assert r.decode_counts.eager_decode == 4


def test_without_scratch_rows_graphs_are_per_exact_size_and_other_steps_stay_eager(monkeypatch):
    r = fake_runner(monkeypatch, scratch=False)
    for _ in range(2):
        r.forward(batch_of(3))
    assert list(r._graphs) == [GraphKey(rows=3, width=1, sampling=False)]
    assert r.eager_hosts[0].padding == 0
    monkeypatch.setattr(r, "_forward_eager", lambda batch: "eager")
    prompt = SeqChunk(seq_id=0, token_ids=np.arange(3), positions=np.tile(np.arange(3), (3, 1)), start=0,
                      block_table=np.array([2], np.int32), state_slot=1)
    assert r.forward(StepBatch([prompt])) == "eager" and r.decode_counts.other == 1


def test_graphs_are_capped(monkeypatch):
    r = fake_runner(monkeypatch)
    monkeypatch.setattr(runner_mod, "MAX_GRAPHS", 1)
    for rows in (3, 3, 1, 1, 1):
        r.forward(batch_of(rows))
    assert len(r._graphs) == 1 and r.decode_counts.eager_decode == 4
