"""CudaRunner.launch / finish (gpu_engine/cuda/launch.py) with the device stubbed out (bench/step_host_cost.py):
the order of device work, the fed tokens in the next step's tables, arena and graph bookkeeping, refusals."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import step_host_cost as shc
from eager_step_profile import greedy

from gpu_engine.errors import RunnerInputError
from gpu_engine.runner_api import SeqChunk, StepBatch

ROWS, CONTEXT = 5, 40


class Recorder:
    """Wraps the stub device: every kernel launch and graph replay in order; downloads return `tokens`."""

    def __init__(self, runner: Any) -> None:
        self.log: list[str] = []
        self.tokens = np.zeros(0, np.int64)
        dev = runner.ctx.device
        launch, graph, download = dev.launch, dev.launch_graph, dev.download

        def rec_launch(family: str, name: str, *a: Any, **kw: Any) -> None:
            self.log.append(name)
            launch(family, name, *a, **kw)

        def rec_graph(g: Any, stream: Any = None) -> None:
            self.log.append("graph")
            graph(g, stream)

        def rec_download(host: np.ndarray, src: int, stream: Any = None) -> np.ndarray:
            download(host, src, stream)
            if host.dtype == np.int32 and host.ndim == 1 and host.size >= self.tokens.size:
                host[: self.tokens.size] = self.tokens  # the sampler's tokens buffer (and any other i32 vector)
            return host

        dev.launch, dev.launch_graph, dev.download = rec_launch, rec_graph, rec_download


def decode_batch(runner: Any, tables: list[np.ndarray], start: int, rng: np.random.Generator) -> StepBatch:
    vocab = runner.cfg.vocab_size
    return StepBatch([SeqChunk(s, rng.integers(0, vocab, 1), np.full((3, 1), start), start, tables[s], s)
                      for s in range(ROWS)])


@pytest.fixture
def runner_and_tables() -> tuple[Any, list[np.ndarray]]:
    return shc.build_runner(layers=4, rows=ROWS, forced=0, forced_len=0, context=CONTEXT)


def test_a_launch_samples_the_step_before_its_own_forward_and_feeds_the_tokens(runner_and_tables):
    runner, tables = runner_and_tables
    rec = Recorder(runner)
    rng = np.random.default_rng()
    seen: list[np.ndarray] = []
    enqueue = runner._enqueue

    def spy(run: StepBatch, host: Any, key: Any) -> Any:
        seen.append(host.tables.ids.copy())
        return enqueue(run, host, key)

    runner._enqueue = spy
    mark = runner.ctx.arena.mark()
    assert runner.launch(decode_batch(runner, tables, CONTEXT, rng), None, None) is None
    assert "sample_rows_f32" not in rec.log  # no sampler until the request comes
    assert runner.ctx.arena.mark() > mark  # the eager step keeps its buffers: its logits are not read yet
    assert runner.decode_counts.captures == 0  # the new shape's graph waits until the logits are read
    first = len(rec.log)

    rec.tokens = rng.integers(1, runner.cfg.vocab_size, ROWS)
    feed = np.array([4, -1, 0, 2, -1])
    sampled = runner.launch(decode_batch(runner, tables, CONTEXT + 1, rng), greedy(ROWS), feed)
    assert sampled is not None and sampled.token_ids.tolist() == rec.tokens.tolist()
    second = rec.log[first:]
    assert second.index("sample_rows_f32") < second.index("graph")  # step 1 sampled, then step 2 replayed
    assert runner.decode_counts.captures == 1 and runner.decode_counts.graphed == 1
    ids = seen[1][: ROWS]  # padded tables: the real rows first, one token each
    for i, f in enumerate(feed):
        if f >= 0:
            assert ids[i] == rec.tokens[f]
    assert ids[1] == seen[1][1] and ids[4] == seen[1][4]  # unfed rows keep their own tokens

    n = len(rec.log)
    runner.finish(greedy(ROWS))
    assert rec.log[n:] == ["sample_rows_f32"]  # the graph computed no sampler of its own
    assert runner._launched is None and runner.ctx.arena.mark() == mark


def test_launch_and_finish_refuse_what_the_contract_does_not_allow(runner_and_tables):
    runner, tables = runner_and_tables
    rng = np.random.default_rng()
    with pytest.raises(RunnerInputError, match="no launched step"):
        runner.finish(greedy(ROWS))
    with pytest.raises(RunnerInputError, match="previous"):
        runner.launch(decode_batch(runner, tables, CONTEXT, rng), greedy(ROWS), None)
    runner.launch(decode_batch(runner, tables, CONTEXT, rng), None, None)
    with pytest.raises(RunnerInputError, match="previous"):
        runner.launch(decode_batch(runner, tables, CONTEXT + 1, rng), None, None)
    with pytest.raises(RunnerInputError, match="rows"):
        runner.finish(greedy(ROWS + 1))
    assert runner._launched is None  # a refused finish still ends the launched step
    verify = decode_batch(runner, tables, CONTEXT, rng)
    verify.chunks[0].verify = True
    with pytest.raises(RunnerInputError, match="verify"):
        runner.launch(verify, None, None)


def test_prefill_phase_steps_are_launched_eagerly_with_vision_rows_and_fed_rows(runner_and_tables):
    """What the engine's prefill-phase lookahead sends (lookahead_step.py): a step of prompt chunks only (no logits
    row, so its request has none), then one mixing a fed decode row, a prompt chunk with host vision embeddings
    (logits "last") and a continuing prompt chunk (logits "none"); then finish. Eager steps keep their arena until
    sampled; the fed token lands on its chunk's token."""
    from gpu_engine.lookahead import expand_request
    from gpu_engine.runner_api import VisionSlice

    runner, tables = runner_and_tables
    rec = Recorder(runner)
    rng = np.random.default_rng()
    vocab, hidden = runner.cfg.vocab_size, runner.cfg.hidden_size
    seen: list[np.ndarray] = []
    enqueue = runner._enqueue

    def spy(run: StepBatch, host: Any, key: Any) -> Any:
        seen.append(host.tables.ids.copy())
        assert key is None  # prompt chunks and vision rows never replay a graph
        return enqueue(run, host, key)

    runner._enqueue = spy

    def prompt(seq: int, start: int, n: int, logits: str, vision: list | None = None) -> SeqChunk:
        pos = np.broadcast_to(np.arange(start, start + n), (3, n)).copy()
        return SeqChunk(seq, rng.integers(0, vocab, n), pos, start, tables[seq], seq, vision=vision or [],
                        logits=logits)

    mark = runner.ctx.arena.mark()
    first = StepBatch([prompt(0, 0, 16, "last"), prompt(1, 0, 16, "none")])
    assert runner.launch(first, None, None) is None
    n0 = len(rec.log)
    rec.tokens = rng.integers(1, vocab, 1)
    fed = SeqChunk(0, np.zeros(1, np.int64), np.full((3, 1), 16), 16, tables[0], 0)
    image = VisionSlice(2, rng.standard_normal((6, hidden)).astype(np.float32))
    second = StepBatch([fed, prompt(1, 16, 16, "last", [image]), prompt(2, 0, 12, "none")])
    sampled = runner.launch(second, greedy(1), np.array([0, -1, -1]))
    assert sampled is not None and sampled.token_ids.tolist() == rec.tokens.tolist()
    assert "sample_rows_f32" in rec.log[n0:] and runner.decode_counts.graphed == 0
    assert seen[1][0] == rec.tokens[0]  # the fed chunk's one token is the sampled one
    assert runner.ctx.arena.mark() > mark
    out = runner.finish(greedy(2))
    assert out.token_ids.size == 2 and runner._launched is None and runner.ctx.arena.mark() == mark

    only_prompts = StepBatch([prompt(3, 0, 16, "none")])  # no logits row: an empty request samples it
    runner.launch(only_prompts, None, None)
    assert runner.finish(expand_request(None, 0, [])).token_ids.size == 0
    assert runner._launched is None and runner.ctx.arena.mark() == mark
