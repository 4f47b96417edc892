"""check_decode_graphs' step driver on the CPU, with the reference runner standing in for the CUDA runners (and
greedy "device sampling" done on its logits): the schedule's shapes, the forced inputs and the sampled steps."""
from __future__ import annotations

import tempfile

import numpy as np

from gpu_engine.config import ModelConfig
from gpu_engine.loader import load_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.runner_api import StepBatch, StepOutput
from gpu_engine.sampling import SampleResult
from gpu_engine.tiny import make_tiny_checkpoint
from tests.cuda_runner import check_decode_graphs as check


class GreedyOnDevice:
    """The reference runner, returning argmax tokens as `sampled` when the batch carries a SamplingRequest."""

    def __init__(self, runner: ReferenceRunner) -> None:
        self.runner, self.use_graphs = runner, True

    def allocate_cache(self, spec) -> None:
        self.runner.allocate_cache(spec)

    def forward(self, batch: StepBatch) -> StepOutput:
        out = self.runner.forward(StepBatch(batch.chunks))
        if batch.sampling is None:
            return out
        ids = np.argmax(out.logits, axis=-1).astype(np.int64)
        return StepOutput(logits=np.zeros((0, out.logits.shape[1]), np.float32), row_offsets=out.row_offsets,
                          hidden=out.hidden, sampled=SampleResult(ids, np.full(ids.size, np.nan, np.float32),
                                                                  [[] for _ in ids]))


def test_the_driver_replays_the_same_inputs_and_samples_the_last_steps():
    with tempfile.TemporaryDirectory() as folder:
        make_tiny_checkpoint(folder, seed=3)
        config = ModelConfig.from_pretrained(folder)
        weights, _ = load_weights(folder, config)
    steps, inputs, sampled = check._drive(GreedyOnDevice(ReferenceRunner(config, weights)), config, 11)
    again, inputs2, sampled2 = check._drive(GreedyOnDevice(ReferenceRunner(config, weights)), config, 11,
                                            forced=inputs)
    assert inputs2 == inputs and sampled2 == sampled and len(sampled) == check.SAMPLED_STEPS
    assert len(steps) == 1 + len(check.SCHEDULE) - check.SAMPLED_STEPS + 1  # prefill, logits steps, the final one
    assert all(np.array_equal(a, b) for a, b in zip(steps, again))
    runs = [len(ids) for step in inputs for ids in step]
    assert max(runs) == check.RUN and runs.count(check.RUN) >= 10  # jump-forward runs were fed
    assert steps[-1].shape[0] == 2 * check.SEQS  # the final eager step: two logits rows per sequence
