"""Speculative decoding in the engine on the reference runner: greedy output equals plain decoding token for token
whatever the drafts (all right, partly right, all wrong), with continuous batching, block-boundary rollbacks, the
prefix cache, grammars, penalties, stop strings and logprobs; rejected drafts leave no blocks behind; sampling
keeps its distribution; `auto` obeys the cost rule; runners that cannot verify run without speculation."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.errors import RequestError
from gpu_engine.params import RequestOutput, SamplingParams
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.speculative.drafters import Replay
from gpu_engine.tiny import make_tiny_checkpoint

VOCAB = 2074  # the tiny tokenizer's


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=5)


PROMPTS = [np.random.default_rng(0).integers(10, 2000, n).tolist() for n in (12, 30, 17, 5, 40)]


def engine(folder: Path, k: int = 3, **config: Any) -> Engine:
    cfg = {"max_num_seqs": 4, "block_size": 4, **config}
    return Engine.from_pretrained(folder, config=EngineConfig(**cfg), speculative=SpeculativeConfig(num_tokens=k))


def run(eng: Engine, params: SamplingParams | list[SamplingParams], prompts: list[list[int]] | None = None,
        check_blocks: bool = False) -> dict[str, RequestOutput]:
    prompts = PROMPTS if prompts is None else prompts
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        eng.add_request(p, sp, request_id=f"r{i}")
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if check_blocks:  # rejected drafts hold no block: every running sequence holds what its tokens need
            for seq in eng.scheduler.running:
                assert len(seq.block_table) <= -(-seq.num_tokens // eng.config.block_size)
    return done


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(folder: Path) -> dict[str, list[int]]:
    return {r: o.token_ids for r, o in run(engine(folder, k=0), GREEDY).items()}


@pytest.mark.parametrize("corrupt", [0.0, 0.3, 0.7, 1.0])
def test_greedy_output_is_plain_decoding_whatever_the_drafts(folder: Path, plain: dict[str, list[int]],
                                                             corrupt: float) -> None:
    eng = engine(folder)
    eng.spec.override = Replay(plain, corrupt, VOCAB, seed=1)
    # a named drafter drafts every step (an `auto` request would rest after misses: test_spec_backoff.py)
    got = run(eng, SamplingParams(max_tokens=40, ignore_eos=True, speculative="ngram"), check_blocks=True)
    assert {r: o.token_ids for r, o in got.items()} == plain
    st = eng.stats()
    assert st["spec_draft_tokens"] > 100
    if corrupt == 0.0:
        assert st["spec_acceptance_rate"] == 1.0 and st["spec_mean_accepted_length"] > 3.5
        assert st["steps"] < 30  # 40 tokens each in ~10 verify steps (5 requests, 4 at a time); plain: > 80
    elif corrupt == 1.0:
        assert st["spec_accepted_tokens"] == 0 and st["spec_rejected_tokens"] == st["spec_draft_tokens"]
    else:
        assert 0.0 < st["spec_acceptance_rate"] < 1.0
    out = got["r1"]
    assert out.draft_tokens > 0 and out.verify_steps > 0
    assert out.acceptance_rate == pytest.approx(out.accepted_draft_tokens / out.draft_tokens)
    assert out.mean_accepted_length == pytest.approx((out.accepted_draft_tokens + out.verify_steps)
                                                     / out.verify_steps)
    assert st["kv_blocks_used"] == 0  # everything given back at the end


def test_the_prefix_cache_serves_a_speculative_run(folder: Path, plain: dict[str, list[int]]) -> None:
    eng = engine(folder, max_num_seqs=2)
    eng.spec.override = Replay(plain, 0.4, VOCAB, seed=2)
    first = run(eng, GREEDY)
    again = run(eng, GREEDY)  # the same prompts: their blocks (and state snapshots) come from the cache
    assert eng.stats()["prefix_hit_tokens"] > 0
    assert {r: o.token_ids for r, o in first.items()} == plain == {r: o.token_ids for r, o in again.items()}


def test_a_small_token_budget_cuts_windows_and_stays_exact(folder: Path, plain: dict[str, list[int]]) -> None:
    eng = engine(folder, max_num_seqs=4, max_batched_tokens=6)  # 4 decoding sequences, 2 tokens left for drafts
    eng.spec.override = Replay(plain, 0.2, VOCAB, seed=3)
    got = run(eng, GREEDY)
    assert {r: o.token_ids for r, o in got.items()} == plain
    assert eng.stats()["spec_verify_windows"] > 0


def test_prompt_lookup_drafts_from_the_lookup_text(folder: Path) -> None:
    """The request's lookup_text (a page's text layer) is tokenized once; once the output's tail matches it,
    prompt lookup drafts what follows there."""
    from gpu_engine.speculative.drafters import PromptLookup

    eng = engine(folder)
    text = "Invoice number 12345, ACME Corporation, 221B Baker Street"
    page = eng.tokenizer.encode(text, add_special_tokens=False)
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=30, speculative="ngram", lookup_text=text))
    seq = eng._live[rid]
    assert seq.lookup_ids is not None and seq.lookup_ids.tolist() == page
    lookup = PromptLookup(SpeculativeConfig())
    assert lookup.propose(seq, 3) == []  # the prompt's tail is not on the page
    for t in page[5:8]:  # the output reaches "12345"
        seq.append(t)
    assert lookup.propose(seq, 3) == page[8:11]
    eng.abort(rid)


def test_prompt_lookup_run_is_exact(folder: Path) -> None:
    prompt = (PROMPTS[1][:10] * 4)  # a repeating prompt: lookup finds matches once the output repeats it
    params = SamplingParams(max_tokens=30, ignore_eos=True, speculative="ngram")
    want = run(engine(folder, k=0), SamplingParams(max_tokens=30, ignore_eos=True), [prompt])["r0"].token_ids
    assert run(engine(folder), params, [prompt])["r0"].token_ids == want


@pytest.mark.parametrize("corrupt", [0.0, 0.5])
def test_grammar_penalties_stops_and_logprobs_are_applied_at_every_verified_position(
        folder: Path, corrupt: float) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}}, "required": ["name", "n"]}
    plist = [
        SamplingParams(max_tokens=40, json_schema=schema, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(max_tokens=40, regex=r"[a-z]{3,8}-[0-9]{2,5}"),
        SamplingParams(max_tokens=40, ignore_eos=True, stop=["e"]),
    ]
    prompts = PROMPTS[:4]
    plain = run(engine(folder, k=0), plist, prompts)
    eng = engine(folder)
    eng.spec.override = Replay({r: o.token_ids for r, o in plain.items()}, corrupt, VOCAB, seed=4)
    got = run(eng, plist, prompts, check_blocks=True)
    for r, want in plain.items():
        assert got[r].token_ids == want.token_ids and got[r].text == want.text
        assert got[r].finish_reason == want.finish_reason
    lp_plain = [x.logprob for x in plain["r0"].logprobs or []]
    lp_spec = [x.logprob for x in got["r0"].logprobs or []]
    np.testing.assert_allclose(lp_spec, lp_plain, atol=1e-5)
    assert [[t for t, _ in x.top] for x in got["r0"].logprobs or []] == \
        [[t for t, _ in x.top] for x in plain["r0"].logprobs or []]
    assert eng.stats()["spec_verify_windows"] > 0


def test_drafts_the_grammar_refuses_are_cut_before_verification(folder: Path) -> None:
    eng = engine(folder)
    bad = eng.tokenizer.encode("ZZZZ", add_special_tokens=False)

    class Refused:
        def propose(self, seq: Any, k: int) -> list[int]:
            return bad[:k]

    eng.spec.override = Refused()
    out = run(eng, SamplingParams(max_tokens=20, regex=r"[a-z]{3,30}"), PROMPTS[:1])["r0"]
    st = eng.stats()
    assert st["spec_grammar_cut_tokens"] > 0 and st["spec_draft_tokens"] == 0
    assert out.finish_reason in ("stop", "length") and out.text.isalpha() and out.text.islower()


def test_sampling_keeps_its_distribution(folder: Path) -> None:
    """Three sampled tokens (top-k 2: at most 8 outcomes) with and without drafts: a chi-square homogeneity test
    over the outcomes (1200 seeds each, temperature 2 so that no outcome dominates). The drafts are the target's
    greedy choices, accepted about as often as the target picks them, so both branches of the rejection rule run;
    a rule that accepts 20 % too often fails this test."""
    prompt = PROMPTS[2]
    greedy = run(engine(folder, k=0), SamplingParams(max_tokens=1), [prompt])["r0"].token_ids

    def outcomes(k: int) -> tuple[dict[tuple[int, ...], int], Engine]:
        # "ngram" named: the cost rule would turn `auto` off for 64 sequences
        sp = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=2.0, top_k=2, seed=s,
                             speculative="ngram" if k else "auto") for s in range(1200)]
        eng = engine(folder, k=k, max_num_seqs=64, max_batched_tokens=512)
        if k:
            eng.spec.override = GreedyOfTarget(folder)
        counts: dict[tuple[int, ...], int] = {}
        for out in run(eng, sp, [prompt] * len(sp)).values():
            counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        return counts, eng

    a, _ = outcomes(0)
    b, eng = outcomes(2)
    st = eng.stats()
    assert 0.2 < st["spec_acceptance_rate"] < 0.95 and st["spec_draft_tokens"] >= 1200, st
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(x, 0) for x in keys], [b.get(x, 0) for x in keys]], np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    quantile_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
    assert stat < quantile_999[len(keys) - 1], (stat, a, b)
    assert greedy[0] in {x[0] for x in keys}


class GreedyOfTarget:
    """Drafts the target's own greedy continuation (computed with a one-sequence model: a test-only oracle)."""

    def __init__(self, folder: Path) -> None:
        import gpu_engine

        self.model = gpu_engine.load(folder)

        self.memo: dict[tuple[int, ...], int] = {}  # the sampled runs share a handful of contexts

    def propose(self, seq: Any, k: int) -> list[int]:
        tokens = [int(t) for t in seq.token_ids]
        for _ in range(k):
            key = tuple(tokens)
            if key not in self.memo:
                self.memo[key] = int(np.argmax(self.model.logits(tokens)[-1]))
            tokens.append(self.memo[key])
        return tokens[len(seq.token_ids):]


def test_auto_turns_speculation_off_for_large_batches(folder: Path, plain: dict[str, list[int]]) -> None:
    eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=5, block_size=4),
                                 speculative=SpeculativeConfig(num_tokens=3, max_step_tokens=8))
    eng.spec.override = Replay(plain, 0.0, VOCAB)
    windows: list[int] = []  # per step: decoding sequences + drafts
    propose = eng.spec.propose

    def spy(running: list[Any], blocks: Any) -> None:
        propose(running, blocks)
        decoding = [s for s in running if s.num_uncomputed == 1 and s.num_computed >= s.prompt_len]
        windows.append(len(decoding) + sum(s.num_drafts for s in decoding))

    eng.spec.propose = spy  # type: ignore[method-assign]
    got = run(eng, GREEDY)  # 5 decoding sequences leave room for 3 drafts of 8 tokens, 4 for 4, ...
    st = eng.stats()
    assert {r: o.token_ids for r, o in got.items()} == plain
    assert st["spec_auto_off_steps"] > 0 and st["spec_draft_tokens"] > 0
    assert max(windows) <= 8 and 8 in windows
    eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=5, block_size=4),
                                 speculative=SpeculativeConfig(num_tokens=3, max_step_tokens=8))
    eng.spec.override = Replay(plain, 0.0, VOCAB)
    run(eng, SamplingParams(max_tokens=40, ignore_eos=True, speculative="ngram"))  # named: no cost rule
    assert eng.stats()["spec_auto_off_steps"] == 0 and eng.stats()["spec_verify_windows"] > 0


def test_off_never_drafts(folder: Path, plain: dict[str, list[int]]) -> None:
    eng = engine(folder)
    eng.spec.override = Replay(plain, 0.0, VOCAB)
    got = run(eng, SamplingParams(max_tokens=40, ignore_eos=True, speculative="off"))
    assert eng.stats()["spec_verify_windows"] == 0 and got["r0"].draft_tokens == 0


def test_a_runner_that_cannot_verify_runs_without_speculation(folder: Path, plain: dict[str, list[int]]) -> None:
    eng = engine(folder)
    setattr(eng.runner, "supports_verify", False)  # noqa: B010  # as the CUDA runner today (Runner has no such field)
    from gpu_engine.speculative import Speculator

    eng.spec = Speculator(SpeculativeConfig(), eng.runner, eng._counters)
    got = run(eng, GREEDY)
    assert {r: o.token_ids for r, o in got.items()} == plain and eng.stats()["spec_verify_windows"] == 0
    for method in ("ngram", "mtp"):
        with pytest.raises(RequestError, match="cannot verify"):
            eng.add_request([1, 2, 3], SamplingParams(speculative=method))
    with pytest.raises(RequestError, match="speculative must be one of"):
        engine(folder).add_request([1, 2, 3], SamplingParams(speculative="eagle"))
    with pytest.raises(RequestError, match="no MTP head"):
        engine(folder).add_request([1, 2, 3], SamplingParams(speculative="mtp"))


def test_cache_pressure_preempts_and_stays_exact(folder: Path, plain: dict[str, list[int]]) -> None:
    """Too few blocks for all five: sequences are preempted and recomputed mid-speculation; drafts never force a
    preemption of their own, and the output is still plain decoding's."""
    eng = engine(folder, num_kv_blocks=40)
    eng.spec.override = Replay(plain, 0.3, VOCAB, seed=5)
    got = run(eng, GREEDY, check_blocks=True)
    assert {r: o.token_ids for r, o in got.items()} == plain
    assert eng.stats()["preemptions"] > 0 and eng.stats()["spec_verify_windows"] > 0
