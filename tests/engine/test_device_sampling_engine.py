"""The engine's runner-sampling path (StepBatch.sampling -> StepOutput.sampled) against its host sampling path.

The reference runner implements the contract with the numpy sampler (runner_api.sample_on_host), so with its
`samples_on_device` switched on, every step goes through the engine's device path: uniforms drawn before the
forward, grammar bitmasks sent with the batch, tokens and logprobs taken from the runner. Requests are run on two
engines over the same tiny checkpoint (one per path) and must produce identical tokens, logprobs (exact: same
logits, same numpy code) and finish reasons. Fresh random prompts and seeds each run.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_engine_core_fakes import FakeRunner, text_prompt, tiny_tokenizer
from test_engine_core_isolation import POISON, ChunkwiseRunner, make_engine

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.runner_api import StepBatch, StepOutput, sample_on_host
from gpu_engine.tiny import make_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


def fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=41)


def engines(ckpt, **cfg) -> tuple[Engine, Engine, list[int]]:
    """(host-path engine, runner-sampling engine, per forward of the latter: rows it was asked to sample (-1 = no
    request))."""
    config = EngineConfig(**{"max_num_seqs": 16, "max_batched_tokens": 256, "block_size": 8, **cfg})
    host = Engine.from_pretrained(ckpt, config=config)
    dev = Engine.from_pretrained(ckpt, config=config)
    dev.runner.samples_on_device = True
    asked: list[int] = []
    forward = dev.runner.forward

    def spy(batch: StepBatch) -> StepOutput:
        asked.append(-1 if batch.sampling is None else batch.sampling.num_rows)
        out = forward(batch)
        assert (batch.sampling is None) == (out.sampled is None)
        return out

    dev.runner.forward = spy
    return host, dev, asked


def same_outputs(a, b) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert (x.finish_reason, x.error, x.text) == (y.finish_reason, y.error, y.text)
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            for p, q in zip(x.logprobs, y.logprobs):
                assert p.token_id == q.token_id and p.logprob == q.logprob and p.top == q.top


def prompts(rng, n):
    return [rng.integers(0, 2000, size=int(rng.integers(2, 24))).tolist() for _ in range(n)]


def test_greedy_and_seeded_sampling_match_host_path(ckpt):
    rng = fresh_rng()
    ps = prompts(rng, 10)
    params = []
    for i in range(10):
        kind = i % 5
        params.append(SamplingParams(
            max_tokens=int(rng.integers(4, 14)), ignore_eos=True, seed=int(rng.integers(1 << 30)),
            temperature=0.0 if kind == 0 else float(rng.uniform(0.5, 1.5)),
            top_k=int(rng.integers(1, 50)) if kind in (2, 4) else 0,
            top_p=float(rng.uniform(0.3, 0.95)) if kind in (3, 4) else 1.0,
            min_p=float(rng.uniform(0.01, 0.2)) if kind == 4 else 0.0,
            logprobs=i % 3 == 0, top_logprobs=int(rng.integers(0, 6)) if i % 3 == 0 else 0,
        ))
    host, dev, asked = engines(ckpt)
    expected = host.generate(ps, params)
    got = dev.generate(ps, params)
    same_outputs(expected, got)
    assert any(n > 0 for n in asked) and dev.stats()["sample_time_s"] == 0.0  # the host sampler never ran
    assert host.stats()["sampled_tokens"] == dev.stats()["sampled_tokens"]


def test_json_schema_requests_match_host_path(ckpt):
    rng = fresh_rng()
    ps = prompts(rng, 6)
    params = [SamplingParams(max_tokens=120, json_schema=SCHEMA, temperature=0.0 if i == 0 else 1.2,
                             seed=int(rng.integers(1 << 30)), logprobs=i % 2 == 0, top_logprobs=3 * (i % 2 == 0))
              for i in range(6)]
    host, dev, asked = engines(ckpt)
    expected = host.generate(ps, params)
    got = dev.generate(ps, params)
    same_outputs(expected, got)
    for out in got:
        assert out.finish_reason == "stop", out.error
        assert set(json.loads(out.text)) == {"name", "n", "ok"}
    assert any(n > 0 for n in asked)
    assert host.stats()["forced_tokens"] == dev.stats()["forced_tokens"]


def test_penalised_rows_fall_back_to_host_sampling_for_their_steps(ckpt):
    """A step holding a row with a repetition / presence penalty is sampled on the host (the runner gets no
    request); steps without one still go to the runner; results are those of the host path either way."""
    rng = fresh_rng()
    ps = prompts(rng, 4)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=int(rng.integers(1 << 30)))
              for _ in range(3)]
    params.append(SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, repetition_penalty=1.3,
                                 presence_penalty=0.5, seed=7))
    host, dev, asked = engines(ckpt)
    expected = host.generate(ps, params)
    same_outputs(expected, dev.generate(ps, params))
    assert -1 in asked
    # max_tokens 6 vs 12: the penalised request decodes alone at the end, so runner-sampled steps also happened
    # only if the penalised one was not in them; every step with it was on the host.
    assert dev.stats()["sample_time_s"] > 0.0


def test_engine_without_capability_never_sends_a_request(ckpt):
    host, dev, asked = engines(ckpt)
    dev.runner.samples_on_device = False
    dev.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=1.0, seed=1))
    assert asked and all(n == -1 for n in asked)


class SamplingChunkwiseRunner(ChunkwiseRunner):
    """ChunkwiseRunner (fails part-way for poisoned chunks) that also samples when asked."""

    samples_on_device = True

    def forward(self, batch: StepBatch) -> StepOutput:
        out = super().forward(StepBatch(batch.chunks))
        if batch.sampling is None:
            return out
        return StepOutput(logits=out.logits[:0], row_offsets=out.row_offsets,
                          sampled=sample_on_host(out.logits, batch.sampling))


@pytest.mark.parametrize("linear_state", [True, False])
def test_isolated_failure_keeps_seeded_sampling_exact(tmp_path, linear_state):
    """A poisoned request in a runner-sampled step: it fails alone; survivors, including those preempted to
    rebuild their state (their drawn uniform is kept for their next token), give the clean host-path tokens."""
    tok = tiny_tokenizer(tmp_path)
    rng = fresh_rng()
    ps = [text_prompt(rng.integers(0, 2000, size=int(rng.integers(1, 30)))) for _ in range(6)]
    params = [SamplingParams(max_tokens=int(rng.integers(3, 10)), ignore_eos=True, temperature=1.0, top_k=40,
                             seed=int(rng.integers(1 << 30)), logprobs=True, top_logprobs=2) for _ in ps]
    clean = make_engine(tok, ChunkwiseRunner(linear_state=linear_state), max_num_seqs=4, max_batched_tokens=64)
    expected = clean.generate(ps, params)

    poisoned = rng.integers(0, 2000, size=40)
    poisoned[33] = POISON
    runner = SamplingChunkwiseRunner(POISON, linear_state=linear_state)
    eng = make_engine(tok, runner, max_num_seqs=7, max_batched_tokens=16, block_size=4, num_kv_blocks=60)
    outs = eng.generate(ps[:3] + [text_prompt(poisoned)] + ps[3:], params[:3] + [params[0]] + params[3:])
    assert outs[3].finish_reason == "error" and "FloatingPointError" in outs[3].error
    same_outputs(expected, outs[:3] + outs[4:])
    st = eng.stats()
    assert st["forward_failures"] >= 1 and st["requests_failed_by_runner"] == 1 and st["sample_time_s"] == 0.0
    if linear_state:
        assert st["preempted_after_failure"] > 0


def test_runner_that_ignores_the_request_is_an_error_for_the_step(tmp_path):
    """A runner that claims the capability but returns logits only: the step's requests end with an error that
    says so (isolation re-runs find every chunk failing) instead of silently sampling on the host."""
    tok = tiny_tokenizer(tmp_path)

    class Liar(FakeRunner):
        samples_on_device = True

    eng = Engine(Liar(), tok, vocab_size=2074, config=EngineConfig(num_kv_blocks=64))
    outs = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, temperature=1.0, seed=3))
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("returned no sampled rows" in o.error for o in outs)
