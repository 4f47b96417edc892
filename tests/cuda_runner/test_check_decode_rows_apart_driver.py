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
    split, deltanet = [], []
    for batch in first.batches[1:]:
        tables = build_step(batch, first.spec, config.text, "bf16", deltanet_split=True).tables
        split.append(tables.dec_rows is not None and tables.dec_rows.size == len(batch.chunks) - 1)
        gdn = tables.gdn_split
        deltanet.append(None if gdn is None else (gdn.token_rows, gdn.token_row == 0))
    assert split == [new is not None for _, new in check.SCHEDULE]
    assert sum(split) == 5  # the five mixed steps of SCHEDULE
    # the chunks of 64+ tokens: every decode row on the token kernel, leading (64, 70) or trailing (96)
    assert deltanet == [(5, True), None, None, (7, True), (7, False), None, None]


def test_run_all_compares_every_case_on_stand_in_runners(monkeypatch):
    """run_all end to end with the reference runner standing in for every CudaRunner: all cases exact, PASS."""
    import gpu_engine.cuda.device as device
    import gpu_engine.cuda.runner as runner

    class StandIn(ReferenceRunner):
        def __init__(self, config, weights, options) -> None:
            from tests.cuda_runner.check_runner import _rounded

            super().__init__(config, _rounded(weights))

        def close(self) -> None:
            pass

    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(runner, "CudaRunner", StandIn)
    results, meta = check.run_all(seed=3)
    assert [r.config for r in results] == [c[0] for c in check.CASES] + ["both vs reference"]
    assert all(r.ok and r.max_rel_err == 0.0 and r.mixed_steps == 5 for r in results)
    assert "PASS" in check.format_table(results) and meta == {"seed": 3}
