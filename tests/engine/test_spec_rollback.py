"""The reference runner's verify / rollback capability: a verify window rolled back to j tokens leaves exactly the
linear-attention state of j decode steps, and its hidden states are those decode steps' bit for bit (the logits
too, up to the last bits of a many-row lm_head product, as for any batch of decode rows)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpu_engine
from gpu_engine.errors import RunnerInputError
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch
from gpu_engine.tiny import make_tiny_checkpoint

PROMPT = np.random.default_rng(2).integers(10, 2000, 11)
WINDOW = np.random.default_rng(3).integers(10, 2000, 4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=9)


def fresh(folder: Path) -> ReferenceRunner:
    runner = gpu_engine.load(folder).runner
    assert isinstance(runner, ReferenceRunner)
    runner.allocate_cache(CacheSpec(num_kv_blocks=8, block_size=4, num_state_slots=2))
    return runner


def chunk(tokens: np.ndarray, start: int, *, verify: bool = False) -> SeqChunk:
    pos = np.broadcast_to(np.arange(start, start + len(tokens), dtype=np.int64), (3, len(tokens))).copy()
    return SeqChunk(seq_id=0, token_ids=tokens, positions=pos, start=start, block_table=np.arange(8, dtype=np.int32),
                    state_slot=1, logits="all" if verify else "last", verify=verify)


def states(runner: ReferenceRunner) -> list[np.ndarray]:
    return [s[1].copy() for s in (*runner.conv_state.values(), *runner.recurrent_state.values())]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_rollback_leaves_the_state_of_the_accepted_tokens(folder: Path, keep: int) -> None:
    decode = fresh(folder)
    decode.forward(StepBatch([chunk(PROMPT, 0)]))
    rows, hidden = [], []
    for i in range(keep):
        step = decode.forward(StepBatch([chunk(WINDOW[i:i + 1], len(PROMPT) + i)]))
        assert step.hidden is not None
        rows.append(step.logits[0])
        hidden.append(step.hidden[0])
    want = states(decode)

    spec = fresh(folder)
    spec.forward(StepBatch([chunk(PROMPT, 0)]))
    out = spec.forward(StepBatch([chunk(WINDOW, len(PROMPT), verify=True)]))
    assert out.logits.shape[0] == len(WINDOW)
    assert out.hidden is not None
    np.testing.assert_array_equal(out.hidden[:keep], np.stack(hidden))  # decode's arithmetic, bit for bit
    np.testing.assert_allclose(out.logits[:keep], np.stack(rows), rtol=0, atol=1e-5)
    spec.rollback_state(1, keep)
    for got, expected in zip(states(spec), want):
        np.testing.assert_array_equal(got, expected)


def test_rollback_needs_the_window_of_the_last_forward(folder: Path) -> None:
    runner = fresh(folder)
    runner.forward(StepBatch([chunk(PROMPT, 0)]))
    with pytest.raises(RunnerInputError, match="verify window"):
        runner.rollback_state(1, 1)
    runner.forward(StepBatch([chunk(WINDOW, len(PROMPT), verify=True)]))
    with pytest.raises(RunnerInputError, match="cannot keep 5 tokens"):
        runner.rollback_state(1, 5)
    runner.forward(StepBatch([chunk(WINDOW[:1], len(PROMPT) + 1)]))  # the slot's next forward ends its window
    with pytest.raises(RunnerInputError, match="verify window"):
        runner.rollback_state(1, 1)
