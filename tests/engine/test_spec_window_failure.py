"""A runner error in a verify window may come from a draft, which is no real token: the engine retries that request
without drafts (failure isolation finds it, the speculator turns its speculation off, it is preempted and
recomputed) and ends it with the error only when the plain retry fails too. Reference runner, tiny checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpu_engine
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import RequestOutput, SamplingParams
from gpu_engine.runner_api import StepBatch, StepOutput
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.speculative.drafters import Replay
from gpu_engine.tiny import make_tiny_checkpoint
from gpu_engine.tokenizer import Tokenizer

VOCAB = 2074  # the tiny tokenizer's
PROMPTS = [np.random.default_rng(2).integers(10, 2000, n).tolist() for n in (11, 26, 7)]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


class FailingRunner:
    """The reference runner, except that a forward raises when one of its chunks is a verify window holding drafts
    (`on_drafts`), or continues sequence `poison_seq` past `poison_from` tokens (a failure of a real token)."""

    def __init__(self, inner: Any, on_drafts: bool = True, poison_seq: int | None = None,
                 poison_from: int = 0) -> None:
        self.inner, self.on_drafts = inner, on_drafts
        self.poison_seq, self.poison_from = poison_seq, poison_from
        self.window_failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, batch: StepBatch) -> StepOutput:
        for c in batch.chunks:
            if self.on_drafts and c.verify and len(c.token_ids) > 1:
                self.window_failures += 1
                raise RuntimeError(f"sequence {c.seq_id}: this runner cannot verify drafts")
            if c.seq_id == self.poison_seq and c.start + len(c.token_ids) > self.poison_from:
                raise RuntimeError(f"sequence {c.seq_id}: poisoned past {self.poison_from} tokens")
        return self.inner.forward(batch)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=6)


def engine(folder: Path, wrap: dict[str, Any] | None = None, k: int = 3) -> Engine:
    loaded = gpu_engine.load(folder)
    runner = FailingRunner(loaded.runner, **wrap) if wrap is not None else loaded.runner
    return Engine(runner, Tokenizer.from_pretrained(folder), vocab_size=loaded.config.text.vocab_size,
                  config=EngineConfig(max_num_seqs=3, block_size=4), speculative=SpeculativeConfig(num_tokens=k),
                  prepare=loaded.prepare)


def run(eng: Engine) -> dict[str, RequestOutput]:
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, GREEDY, request_id=f"r{i}")
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def plain(folder: Path) -> dict[str, list[int]]:
    return {r: o.token_ids for r, o in run(engine(folder, k=0)).items()}


def test_a_window_failing_for_its_drafts_is_retried_without_them(folder: Path, plain: dict[str, list[int]]) -> None:
    eng = engine(folder, wrap={})
    eng.spec.override = Replay(plain, 0.0, VOCAB)  # every decoding step of every request carries drafts
    got = run(eng)
    assert {r: o.finish_reason for r, o in got.items()} == {r: "length" for r in plain}
    assert {r: o.token_ids for r, o in got.items()} == plain  # greedy: as if no draft had ever run
    st = eng.stats()
    assert st["spec_window_retries"] == len(PROMPTS)  # once each: then the request decodes without drafts
    assert st["requests_failed_by_runner"] == 0
    assert eng.runner.window_failures >= len(PROMPTS)
    assert all(o.draft_tokens == 0 for o in got.values())  # no window was ever verified


def test_a_request_failing_without_drafts_too_ends_with_the_error(folder: Path, plain: dict[str, list[int]]) -> None:
    """Sequence 1 fails for a real token (past 30 tokens): its window fails, its plain retry fails, it ends with
    the runner's error; the others are exact."""
    eng = engine(folder, wrap={"on_drafts": False, "poison_seq": 1, "poison_from": 30})
    eng.spec.override = Replay(plain, 0.0, VOCAB)
    got = run(eng)
    bad = got["r1"]
    assert bad.finish_reason == "error" and "poisoned past 30 tokens" in (bad.error or "")
    assert {r: o.token_ids for r, o in got.items() if r != "r1"} == {r: t for r, t in plain.items() if r != "r1"}
    st = eng.stats()
    assert st["spec_window_retries"] == 1 and st["requests_failed_by_runner"] == 1
    assert bad.token_ids == plain["r1"][:len(bad.token_ids)]  # what it had produced was exact

