"""check_speculative's driver on the CPU (reference runner): the drafters run and move the counters, their greedy
outputs equal the plain run's, and compare() reports a divergence with the plain run's top-2 gap there."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import RequestOutput, SamplingParams, TokenLogprob
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint
from tests.cuda_runner import check_speculative as cs


def test_the_drafters_agree_with_plain_decoding_on_the_reference_runner(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=3)
    eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=4, block_size=4),
                                 speculative=SpeculativeConfig(num_tokens=cs.K))
    ids = cs.prompts(np.random.default_rng(0), eng.vocab_size, count=3)
    plain = cs.run(eng, ids, SamplingParams(max_tokens=cs.MAX_TOKENS, ignore_eos=True, logprobs=True,
                                            top_logprobs=2, speculative="off"))
    rows = cs.run_drafters(eng, ids, plain, eng.vocab_size, seed=1)
    assert [name for name, _, _ in rows] == list(cs.DRAFTERS)
    for name, got, moved in rows:
        assert cs.compare(plain, got) == (True, False, ""), name
        if name.startswith("replay"):
            assert moved["spec_draft_tokens"] > 0
    by_name = {name: moved for name, _, moved in rows}
    assert by_name["replay-0.0"]["spec_accepted_tokens"] == by_name["replay-0.0"]["spec_draft_tokens"]
    assert by_name["replay-1.0"]["spec_accepted_tokens"] == 0
    assert by_name["ngram"]["spec_accepted_tokens"] > 0  # the lookup text holds the continuation


def out(tokens: list[int], gaps: list[float]) -> RequestOutput:
    lps = [TokenLogprob(t, "", -0.1, [(t, -0.1), (t + 1, -0.1 - g)]) for t, g in zip(tokens, gaps)]
    return RequestOutput(request_id="r0", text="", token_ids=tokens, finished=True,
                         logprobs=lps)


def test_compare_names_the_divergence_and_its_gap() -> None:
    plain = {"r0": out([1, 2, 3], [1.0, 0.01, 1.0])}
    assert cs.compare(plain, {"r0": out([1, 2, 3], [0, 0, 0])}) == (True, False, "")
    same, tie, note = cs.compare(plain, {"r0": out([1, 5, 3], [0, 0, 0])})
    assert (same, tie) == (False, True) and "diverges at 1" in note
    same, tie, note = cs.compare(plain, {"r0": out([9, 2, 3], [0, 0, 0])})
    assert (same, tie) == (False, False) and "diverges at 0" in note
