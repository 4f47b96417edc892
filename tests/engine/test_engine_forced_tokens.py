"""Grammar-forced tokens (jump-forward) count as probability 1: their logprob is exactly 0, so a field made only
of forced tokens has confidence 1 (README, "Confidence"). `logprob <= 0` would hold for any logprob; these tests
pin the exact value."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.tiny import make_tiny_checkpoint
from pipeline.confidence import field_confidence

# One free choice (the digit); the key names, the punctuation and the only allowed enum value are forced.
SCHEMA = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["approved-by-accounting"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["verdict", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=23)
    return Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=4))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_tokens_have_logprob_exactly_zero(engine: Engine, seed: int) -> None:
    before = engine.stats()["forced_tokens"]
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=60, json_schema=SCHEMA, temperature=1.0,
                                                      logprobs=True, seed=seed))[0]
    forced = engine.stats()["forced_tokens"] - before
    assert out.finish_reason == "stop" and out.text.startswith('{"verdict":"approved-by-accounting","n":')
    assert forced >= 10  # most of the answer was appended by jump-forward
    logprobs = [lp.logprob for lp in out.logprobs]
    assert len(logprobs) == len(out.token_ids)
    # every forced token reports log(1) = 0 exactly (a sampled token whose grammar left no alternative may too)
    assert sum(lp == 0.0 for lp in logprobs) >= forced
    # so the enum field, forced throughout, has confidence 1 by the pipeline's formula
    texts = [engine.tokenizer.decode([t]) for t in out.token_ids]
    assert "".join(texts) == out.text  # ASCII answer: the token texts line up with it
    conf = field_confidence(out.text, texts, logprobs)
    assert conf.fields["/verdict"] == 1.0
    assert conf.overall == pytest.approx(math.exp(sum(logprobs) / len(logprobs)), rel=1e-12)


def test_a_single_choice_is_forced_to_its_end(engine: Engine) -> None:
    before = engine.stats()["forced_tokens"]
    out = engine.generate([[9, 8, 7]], SamplingParams(max_tokens=40, choice=["approve the whole document"],
                                                      temperature=1.0, logprobs=True, seed=4))[0]
    forced = engine.stats()["forced_tokens"] - before
    assert out.text == "approve the whole document" and forced >= len(out.token_ids) - 1
    assert all(lp.logprob == 0.0 for lp in out.logprobs[:forced])
