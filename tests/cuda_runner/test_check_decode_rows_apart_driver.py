"""check_decode_rows_apart's step driver on the CPU, with the reference runner standing in for the CUDA runners:
its steps are valid, the forced inputs replay, and the scheduled mixed steps are the ones the CUDA runner splits
(step.build_step lists their decode rows)."""
from __future__ import annotations

import tempfile

import numpy as np

from gpu_engine.config import ModelConfig
from gpu_engine.cuda.step import build_step
from gpu_engine.loader import load_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.runner_api import CacheSpec, StepBatch, StepOutput
from gpu_engine.tiny import make_tiny_checkpoint
from tests.cuda_runner import check_decode_rows_apart as check


class Recording:
    """The reference runner, keeping every batch it was given."""

    def __init__(self, runner: ReferenceRunner) -> None:
        self.runner, self.batches, self.spec = runner, [], None

    def allocate_cache(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.runner.allocate_cache(spec)

    def forward(self, batch: StepBatch) -> StepOutput:
        self.batches.append(batch)
        return self.runner.forward(batch)


def test_the_driver_replays_its_inputs_and_its_mixed_steps_are_split():
    with tempfile.TemporaryDirectory() as folder:
        make_tiny_checkpoint(folder, seed=5, text_config=check.SMALL)
        config = ModelConfig.from_pretrained(folder)
        weights, _ = load_weights(folder, config)
    first = Recording(ReferenceRunner(config, weights))
    steps, inputs = check._drive(first, config, 7)
    second = Recording(ReferenceRunner(config, weights))
    again, inputs2 = check._drive(second, config, 7, forced=inputs)
    assert inputs2 == inputs and all(np.array_equal(a, b) for a, b in zip(steps, again))
    assert len(steps) == 1 + len(check.SCHEDULE)
    split = []
    for batch in first.batches[1:]:
        tables = build_step(batch, first.spec, config.text, "bf16").tables
        split.append(tables.dec_rows is not None and tables.dec_rows.size == len(batch.chunks) - 1)
    assert split == [new is not None for _, new in check.SCHEDULE]
    assert sum(split) == 4  # the four mixed steps of SCHEDULE
