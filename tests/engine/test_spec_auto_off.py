"""`auto` off where verification cannot pay (Speculator.auto_room): on a runner that samples on the device, a step
whose decode rows could not all carry a full window under the cost rule is the plain decode path — no drafter
call, no window, lookahead launches as with speculation off, the same steps and tokens; once the batch shrinks
under the limit `auto` drafts again. Named drafters draft as asked. Runners that sample on the host keep the
token rule (partial windows: test_spec_engine, test_spec_backoff)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.speculative.drafters import Replay
from gpu_engine.tiny import make_tiny_checkpoint
from tests.engine.engine_runs import run_prompts

VOCAB = 2074  # the tiny tokenizer's
PROMPTS = [np.random.default_rng(5).integers(10, 2000, n).tolist() for n in (9, 21, 14, 11)]
LIMIT = 8  # max_step_tokens: with k = 3, windows for at most 2 decode rows


class CountingReplay(Replay):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def propose(self, seq: Any, k: int) -> list[int]:
        self.calls += 1
        return super().propose(seq, k)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=13)


def device_engine(folder: Path, k: int) -> Engine:
    """The reference runner with sampling on the runner and lookahead on (the CUDA runner's path)."""
    eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=4, block_size=4),
                                 speculative=SpeculativeConfig(num_tokens=k, max_step_tokens=LIMIT))
    eng.runner.samples_on_device = eng.runner.supports_lookahead = True  # type: ignore[attr-defined]
    eng.lookahead.enabled = True
    return eng


def drive(eng: Engine, params: list[SamplingParams]) -> dict[str, list[int]]:
    return run_prompts(eng, PROMPTS, params)


def params(method: str, lengths: tuple[int, ...] = (24, 24, 24, 24)) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True, speculative=method) for n in lengths]


@pytest.fixture(scope="module")
def plain(folder: Path) -> tuple[dict[str, list[int]], dict[str, Any]]:
    eng = device_engine(folder, 0)  # speculation off engine-wide
    return drive(eng, params("off")), eng.stats()


def test_auto_above_the_limit_is_the_plain_path(folder: Path, plain: tuple[dict, dict]) -> None:
    tokens, base = plain
    eng = device_engine(folder, 3)
    drafter = CountingReplay(tokens, 0.0, VOCAB)  # drafts that would all be accepted: still not worth a window
    eng.spec.override = drafter
    forwards: list[Any] = []
    for name in ("forward", "launch"):
        real = getattr(eng.runner, name)

        def spy(batch: Any, *rest: Any, _real: Any = real) -> Any:
            forwards.append(batch)
            return _real(batch, *rest)

        setattr(eng.runner, name, spy)
    assert drive(eng, params("auto")) == tokens
    st = eng.stats()
    assert drafter.calls == 0 and st["spec_draft_tokens"] == 0 and st["spec_verify_windows"] == 0
    assert st["spec_auto_rest_skips"] == 0  # nothing was tried, so no sequence rests either
    assert not any(c.verify or c.logits == "all" for b in forwards for c in b.chunks)
    for key in ("steps", "lookahead_steps", "decode_tokens", "sampled_tokens"):
        assert st[key] == base[key], key
    assert st["lookahead_steps"] > 0


def test_auto_drafts_again_once_the_batch_fits_the_limit(folder: Path) -> None:
    lengths = (6, 6, 30, 30)
    off = device_engine(folder, 0)
    tokens = drive(off, params("off", lengths))
    eng = device_engine(folder, 3)
    eng.spec.override = Replay(tokens, 0.0, VOCAB)
    steps: list[tuple[int, int]] = []  # per step: decode rows, drafts
    propose = eng.spec.propose

    def spy(running: list[Any], blocks: Any) -> None:
        propose(running, blocks)
        decoding = [s for s in running if s.num_uncomputed == 1 and s.num_computed >= s.prompt_len]
        steps.append((len(decoding), sum(s.num_drafts for s in decoding)))

    eng.spec.propose = spy  # type: ignore[method-assign]
    assert drive(eng, params("auto", lengths)) == tokens
    assert all(rows * 4 <= LIMIT for rows, drafts in steps if drafts)  # windows only with 2 decode rows or fewer
    st = eng.stats()
    assert st["lookahead_steps"] > 0  # the 4-row steps: launched ahead (no drafts), propose() not even called
    assert st["spec_accepted_tokens"] > 10 and st["spec_verify_windows"] > 0


def test_named_drafters_draft_above_the_limit(folder: Path, plain: tuple[dict, dict]) -> None:
    tokens, _ = plain
    eng = device_engine(folder, 3)
    eng.spec.override = Replay(tokens, 0.0, VOCAB)
    assert drive(eng, params("ngram")) == tokens
    assert eng.stats()["spec_verify_windows"] > 0 and eng.stats()["spec_auto_off_steps"] == 0


def test_auto_room_rules(folder: Path) -> None:
    eng = device_engine(folder, 3)
    assert [eng.spec.auto_room(n) for n in (1, 2, 3)] == [7, 6, 0]  # 3 rows * 4 > 8
    eng.runner.max_verify_drafts = 1  # type: ignore[attr-defined]  # windows of 2 tokens: 4 rows fit
    assert [eng.spec.auto_room(n) for n in (4, 5)] == [4, 0]
    eng.runner.samples_on_device = False  # type: ignore[attr-defined]  # host sampling: the token rule alone
    assert [eng.spec.auto_room(n) for n in (5, 7, 8, 9)] == [3, 1, 0, 0]
