"""EngineConfig.min_prefill_tokens: prompt chunks held back while decode rows run, until a step is worth it.

Exactness (every request's tokens are those of a solo run), the bound on how long a prompt waits, that held
steps carry only decode rows, and that 0 (the default) schedules exactly as before.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_engine_core_fakes import FakeRunner, text_prompt, tiny_tokenizer, vision_prompt

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig, EngineConfigError
from gpu_engine.params import SamplingParams


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def run(tok, prompts, params, **cfg):
    """Tokens of every request, the runner's batches, the engine and the scheduler's hold decision of each step."""
    runner = FakeRunner()
    cfg.setdefault("num_kv_blocks", 512)
    eng = Engine(runner, tok, vocab_size=2074, config=EngineConfig(**cfg))
    decisions: list[bool] = []
    decide = eng.scheduler._hold_prompts

    def recorded() -> bool:
        decisions.append(decide())
        return decisions[-1]

    eng.scheduler._hold_prompts = recorded  # type: ignore[method-assign]  # observe, do not change
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    return outs, runner.batches, eng, decisions


def workload(seed: int, n: int):
    """Document-like: prompts of 20-60 tokens (a third with an image first), answers of 10-30 tokens."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        if i % 3 == 0:
            prompts.append(vision_prompt(rng, [2, ("image", int(rng.integers(8, 20)), f"img{i}"),
                                               int(rng.integers(10, 40))]))
        else:
            prompts.append(text_prompt(rng.integers(0, 2000, size=int(rng.integers(20, 60)))))
    params = [SamplingParams(max_tokens=int(rng.integers(10, 30)), ignore_eos=True) for _ in range(n)]
    return prompts, params


def kinds(batch, prompt_len):
    """(decode rows, prompt chunks) of one step: (seq_id, start, num_tokens) triples."""
    decode = [c for c in batch if c[1] >= prompt_len[c[0]]]
    prompt = [c for c in batch if c[1] < prompt_len[c[0]]]
    return decode, prompt


@pytest.mark.parametrize("want,hold_steps", [(64, 3), (200, 6), (10_000, 2)])
def test_held_prompts_give_the_same_tokens_and_wait_at_most_the_bound(tok, want, hold_steps):
    prompts, params = workload(3, 24)
    expected, plain_batches, _, _ = run(tok, prompts, params, max_num_seqs=6, max_batched_tokens=256, block_size=4)
    got, batches, eng, decisions = run(tok, prompts, params, max_num_seqs=6, max_batched_tokens=256, block_size=4,
                            min_prefill_tokens=want, max_prefill_hold_steps=hold_steps)
    assert got == expected
    assert eng.scheduler.num_held_steps > 0, "this workload leaves decode steps with little prompt work"
    assert len(batches) != len(plain_batches) or batches != plain_batches
    prompt_len = {i: len(p) for i, p in enumerate(prompts)}
    assert len(decisions) == len(batches)  # one decision per step (every step here runs something)
    longest = run_of_held = 0
    for held, batch in zip(decisions, batches):
        run_of_held = run_of_held + 1 if held else 0
        longest = max(longest, run_of_held)
        decode, prompt = kinds(batch, prompt_len)
        if held:
            assert decode and not prompt  # a held step still runs its decode rows, and no prompt chunk
    assert 0 < longest <= hold_steps
    assert sum(1 for b in batches if kinds(b, prompt_len)[0] and not kinds(b, prompt_len)[1]) > sum(
        1 for b in plain_batches if kinds(b, prompt_len)[0] and not kinds(b, prompt_len)[1])


def test_prompt_steps_carry_at_least_the_threshold_when_that_much_is_ready(tok):
    """With a long hold bound, every step that mixes decode rows and prompt chunks got there because enough prompt
    tokens were ready or the bound ran out: such steps carry more prompt tokens on average than without holding."""
    prompts, params = workload(5, 30)
    cfg = dict(max_num_seqs=8, max_batched_tokens=512, block_size=4)
    _, plain, _, _ = run(tok, prompts, params, **cfg)
    _, held, _, _ = run(tok, prompts, params, **cfg, min_prefill_tokens=120, max_prefill_hold_steps=8)
    prompt_len = {i: len(p) for i, p in enumerate(prompts)}

    def mean_prompt_tokens(batches):
        sizes = [sum(n for _, _, n in kinds(b, prompt_len)[1]) for b in batches]
        sizes = [s for s, b in zip(sizes, batches) if s and kinds(b, prompt_len)[0]]
        return sum(sizes) / len(sizes)

    assert mean_prompt_tokens(held) > 1.3 * mean_prompt_tokens(plain)


def test_zero_schedules_as_before_and_no_hold_without_decode_rows(tok):
    prompts, params = workload(7, 12)
    cfg = dict(max_num_seqs=4, max_batched_tokens=128, block_size=4)
    _, a, _, _ = run(tok, prompts, params, **cfg)
    _, b, eng, _ = run(tok, prompts, params, **cfg, min_prefill_tokens=0)
    assert a == b and eng.scheduler.num_held_steps == 0
    # Only prompts (max_tokens 1: nothing ever decodes past its prompt's last token) -> never held.
    one = [SamplingParams(max_tokens=1, ignore_eos=True) for _ in prompts]
    _, _, eng, _ = run(tok, prompts, one, **cfg, min_prefill_tokens=10_000)
    assert eng.scheduler.num_held_steps == 0


def test_bad_values_fail_by_name():
    with pytest.raises(EngineConfigError, match="min_prefill_tokens"):
        EngineConfig(min_prefill_tokens=-1)
    with pytest.raises(EngineConfigError, match="max_prefill_hold_steps"):
        EngineConfig(max_prefill_hold_steps=-2)


def test_default_snapshot_slots_are_capped():
    assert EngineConfig(max_num_seqs=3).state_slots == 6
    assert EngineConfig(max_num_seqs=256, max_batched_tokens=8192).state_slots == 256 + 32
    assert EngineConfig(max_num_seqs=256, max_batched_tokens=8192, num_state_slots=300).state_slots == 300
