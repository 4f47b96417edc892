"""`auto` speculation rests a sequence whose drafts gain nothing (gpu_engine/speculative/backoff.py): the rest
doubles with each miss up to its cap and ends with an accepted draft; in the engine, wrong drafts cost a few windows
per answer instead of one every step, right drafts still verify every step, named drafters draft as asked, and the
output never changes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.speculative.backoff import MAX_REST_STEPS, AutoBackoff
from gpu_engine.speculative.drafters import Replay
from gpu_engine.tiny import make_tiny_checkpoint
from tests.engine.engine_runs import run_prompts

VOCAB = 2074  # the tiny tokenizer's
TOKENS = 48


def rests(backoff: AutoBackoff, seq_id: int, steps: int) -> list[int]:
    """Steps (1-based) at which seq_id may draft, if every attempt misses."""
    drafted = []
    for _ in range(steps):
        backoff.new_step()
        if not backoff.resting(seq_id):
            drafted.append(backoff.step)
            backoff.record(seq_id, gained=False)
    return drafted


def test_rest_doubles_per_miss_up_to_the_cap_and_a_gain_ends_it() -> None:
    b = AutoBackoff(max_rest=4)
    # rests of 1, 2, 4, 4, 4 steps after the misses at steps 1, 3, 6, 11, 16
    assert rests(b, 7, 20) == [1, 3, 6, 11, 16]
    b.record(7, gained=True)
    b.new_step()
    assert not b.resting(7)
    assert not b.resting(8)  # another sequence never inherits a streak
    b.record(8, gained=False)
    b.forget_all_but({7})
    assert not b.resting(8)
    with pytest.raises(ValueError):
        AutoBackoff(max_rest=0)
    steps = rests(AutoBackoff(), 1, 300)  # the default cap
    assert steps[-1] - steps[-2] == 1 + MAX_REST_STEPS


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=11)


PROMPTS = [np.random.default_rng(3).integers(10, 2000, n).tolist() for n in (9, 21, 14)]


def generate(folder: Path, method: str, corrupt: float | None, plain: dict[str, list[int]] | None = None
             ) -> tuple[dict[str, list[int]], dict]:
    eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=4, block_size=4),
                                 speculative=SpeculativeConfig(num_tokens=3 if corrupt is not None else 0))
    if corrupt is not None:
        assert plain is not None
        eng.spec.override = Replay(plain, corrupt, VOCAB, seed=1)
    return drive(eng, SamplingParams(max_tokens=TOKENS, ignore_eos=True, speculative=method)), eng.stats()


def drive(eng: Engine, params: SamplingParams) -> dict[str, list[int]]:
    """Every prompt through `eng` with `params`, to the end: the token ids by request."""
    return run_prompts(eng, PROMPTS, params)


@pytest.fixture(scope="module")
def plain(folder: Path) -> dict[str, list[int]]:
    return generate(folder, "off", None)[0]


def test_wrong_drafts_rest_auto_sequences_but_not_named_drafters(folder: Path, plain: dict[str, list[int]]) -> None:
    got, st = generate(folder, "auto", 1.0, plain)  # every draft replaced by another token: nothing is accepted
    assert got == plain
    assert st["spec_accepted_tokens"] == 0 and st["spec_auto_rest_skips"] > 0
    # misses at decode steps 1, 3, 6, 11, 20, 37: six windows per answer of 48 tokens, not ~47
    assert st["spec_verify_windows"] <= 7 * len(PROMPTS)
    got, st = generate(folder, "ngram", 1.0, plain)  # named: drafts as asked, every step
    assert got == plain
    assert st["spec_auto_rest_skips"] == 0 and st["spec_verify_windows"] >= (TOKENS - 2) * len(PROMPTS)


def test_right_drafts_keep_auto_drafting_every_step(folder: Path, plain: dict[str, list[int]]) -> None:
    got, st = generate(folder, "auto", 0.0, plain)
    assert got == plain
    assert st["spec_auto_rest_skips"] == 0
    assert st["spec_accepted_tokens"] == st["spec_draft_tokens"] > TOKENS  # all accepted: ~4 tokens a window


def test_a_runner_may_declare_a_tighter_cost_rule(folder: Path, plain: dict[str, list[int]]) -> None:
    """CudaRunner.spec_max_step_tokens (32, measured): `auto` drafts only while decode rows + drafts fit it."""
    from gpu_engine.cuda.runner import CudaRunner

    assert CudaRunner.spec_max_step_tokens == 32
    eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=4, block_size=4),
                                 speculative=SpeculativeConfig(num_tokens=3))
    eng.runner.spec_max_step_tokens = 5  # type: ignore[attr-defined]  # 3 decoding sequences leave 2 drafts
    from gpu_engine.speculative import Speculator

    eng.spec = Speculator(eng.spec.config, eng.runner, eng._counters)
    eng.spec.override = Replay(plain, 0.0, VOCAB)
    assert eng.spec.max_step_tokens == 5
    widths: list[int] = []
    propose = eng.spec.propose

    def spy(running: list, blocks: object) -> None:
        propose(running, blocks)  # type: ignore[arg-type]
        decoding = [s for s in running if s.num_uncomputed == 1 and s.num_computed >= s.prompt_len]
        widths.append(len(decoding) + sum(s.num_drafts for s in decoding))

    eng.spec.propose = spy  # type: ignore[method-assign]
    assert drive(eng, SamplingParams(max_tokens=TOKENS, ignore_eos=True)) == plain
    assert max(widths) <= 5 and 5 in widths and eng.stats()["spec_auto_off_steps"] > 0
