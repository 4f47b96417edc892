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
