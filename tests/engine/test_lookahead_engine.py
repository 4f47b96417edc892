"""Lookahead decoding (gpu_engine/lookahead.py) against the plain runner-sampling path, on the reference runner.

Two engines over the same tiny checkpoint, both sampling on the runner; one launches steps and runs the next decode
step before taking in the tokens of the one in flight. Tokens, logprobs, texts and finish reasons must be the same
(the reference runner computes every sequence on its own, so a different chunking of a forced run changes nothing
but float rounding). Fresh random prompts and seeds each run.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_device_sampling_engine import SCHEMA, fresh_rng, prompts

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.lookahead import expand_request
from gpu_engine.params import SamplingParams
from gpu_engine.runner_api import SamplingRequest
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=43)


def engine(ckpt, lookahead: bool, **cfg) -> Engine:
    """Speculation off: with fewer decode rows than the cost rule's 32 `auto` may draft, and a step that may draft
    is never a lookahead step (test_auto_speculation_keeps_its_steps covers that)."""
    config = EngineConfig(**{"max_num_seqs": 16, "max_batched_tokens": 256, "block_size": 8, **cfg})
    eng = Engine.from_pretrained(ckpt, config=config, speculative=SpeculativeConfig(num_tokens=0))
    eng.runner.samples_on_device = True
    eng.runner.supports_lookahead = lookahead
    eng.lookahead.enabled = lookahead
    return eng


LOGPROB_RTOL = 1e-5  # float32 rounding: a forced run computed as its own chunk instead of behind its first token


def same_outputs(a, b) -> None:
    """Same tokens, texts and finish reasons; logprobs equal up to LOGPROB_RTOL."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert (x.finish_reason, x.error, x.text) == (y.finish_reason, y.error, y.text)
        assert (x.logprobs is None) == (y.logprobs is None)
        for p, q in zip(x.logprobs or [], y.logprobs or []):
            assert p.token_id == q.token_id and [t for t, _ in p.top] == [t for t, _ in q.top]
            assert np.allclose([p.logprob, *(v for _, v in p.top)], [q.logprob, *(v for _, v in q.top)],
                               rtol=LOGPROB_RTOL, atol=0)


def mixed_params(rng, n: int) -> list[SamplingParams]:
    """Greedy and seeded rows, with and without logprobs, EOS allowed on some (they end at different steps),
    JSON-schema rows (grammar-forced runs: the discarded-row path)."""
    out = []
    for i in range(n):
        kind = i % 4
        out.append(SamplingParams(
            max_tokens=int(rng.integers(5, 40)) if kind != 3 else 120, ignore_eos=kind == 1,
            temperature=0.0 if kind == 0 else float(rng.uniform(0.6, 1.3)), seed=int(rng.integers(1 << 30)),
            top_k=int(rng.integers(2, 40)) if kind == 2 else 0, logprobs=i % 3 == 0,
            top_logprobs=2 if i % 3 == 0 else 0, json_schema=SCHEMA if kind == 3 else None,
        ))
    return out


def test_lookahead_gives_the_plain_paths_outputs(ckpt):
    rng = fresh_rng()
    ps, params = prompts(rng, 12), mixed_params(rng, 12)
    plain, look = engine(ckpt, False), engine(ckpt, True)
    expected = plain.generate(ps, params)
    got = look.generate(ps, params)
    same_outputs(expected, got)
    for out, p in zip(got, params):
        if p.json_schema is not None:
            assert out.finish_reason == "stop", out.error
            assert set(json.loads(out.text)) == {"name", "n", "ok"}
    stats = look.stats()
    assert stats["lookahead_failures"] == 0, look.lookahead.off_reason
    assert stats["lookahead_steps"] > 0 and plain.stats()["lookahead_steps"] == 0
    assert stats["lookahead_discarded_rows"] > 0  # forced runs and finished rows took the discard path
    assert stats["sampled_tokens"] == plain.stats()["sampled_tokens"]
    assert stats["forced_tokens"] == plain.stats()["forced_tokens"]
    assert not look.has_unfinished()
    left = look.lookahead.in_flight  # a last launched step may hold rows of requests that ended meanwhile
    assert left is None or all(sc.seq.is_finished for sc in left.scheduled)
    look.step()  # the next step takes it in and runs nothing
    assert look.lookahead.in_flight is None


def test_a_launch_feeds_the_previous_steps_tokens_to_the_next(ckpt):
    """What the runner receives on the lookahead path: the next step's fed chunks carry a placeholder and a feed
    row, and the tokens it returns are the ones the engine then appends."""
    look = engine(ckpt, True)
    calls: list[tuple[bool, list[int]]] = []
    launch = look.runner.launch

    def spy(batch, previous, feed):
        calls.append((previous is not None, [] if feed is None else feed.tolist()))
        return launch(batch, previous, feed)

    look.runner.launch = spy
    rng = fresh_rng()
    out = look.generate(prompts(rng, 3), SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in out)
    assert calls[0] == (False, [])  # the first (prefill) step is launched plainly
    fed = [f for has_prev, f in calls if has_prev]
    decoding = [f for f in fed if len(f) == 3 and -1 not in f]  # earlier lookahead steps may hold prompt chunks
    assert decoding and all(f == [0, 1, 2] for f in decoding[:3])  # three decode rows, each fed from its own row
    assert look.stats()["lookahead_steps"] == len(fed)


def test_an_abort_while_in_flight_ends_only_that_request(ckpt):
    rng = fresh_rng()
    ps = prompts(rng, 4)
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=int(rng.integers(1 << 30)))
              for _ in range(4)]
    look = engine(ckpt, True)
    ids = [look.add_request(p, q) for p, q in zip(ps, params)]
    finals = {}
    for _ in range(5):
        for out in look.step():
            finals[out.request_id] = out
    assert look.lookahead.in_flight is not None
    assert look.abort(ids[1])
    while look.has_unfinished():
        for out in look.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[ids[1]].finish_reason == "abort"
    rest = [i for i in range(4) if i != 1]
    expected = engine(ckpt, False).generate([ps[i] for i in rest], [params[i] for i in rest])
    same_outputs(expected, [finals[ids[i]] for i in rest])


def test_a_runner_failure_in_flight_loses_no_token_and_turns_lookahead_off(ckpt):
    rng = fresh_rng()
    ps, params = prompts(rng, 6), mixed_params(rng, 6)
    look = engine(ckpt, True)
    launch, count = look.runner.launch, [0]

    def flaky(batch, previous, feed):
        count[0] += 1
        if count[0] == 6:
            look.runner._launched = None  # the contract: a runner that raises leaves no step launched
            raise RuntimeError("device lost the step")
        return launch(batch, previous, feed)

    look.runner.launch = flaky
    got = look.generate(ps, params)
    same_outputs(engine(ckpt, False).generate(ps, params), got)
    stats = look.stats()
    assert stats["lookahead_failures"] == 1 and stats["preempted_after_failure"] > 0
    assert "device lost the step" in look.lookahead.off_reason
    assert count[0] == 6  # no launch after the failure: the plain path ran the rest


def test_waiting_requests_are_admitted_as_soon_as_a_slot_frees(ckpt):
    """With more requests than slots, a finished sequence's slot goes to the next waiting request at the same step
    as on the plain path (a lookahead step never delays an admission)."""
    rng = fresh_rng()
    ps = prompts(rng, 5)
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in rng.integers(3, 12, size=5)]
    finish_steps = []
    for lookahead in (False, True):
        eng = engine(ckpt, lookahead, max_num_seqs=2)
        ids = [eng.add_request(p, q) for p, q in zip(ps, params)]
        done: dict[str, int] = {}
        step = 0
        while eng.has_unfinished():
            step += 1
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = step
        finish_steps.append([done[i] for i in ids])
    plain, look = finish_steps
    # each request's tokens come one step() later on the lookahead path, never later than that
    assert all(b - a in (0, 1) for a, b in zip(plain, look)), (plain, look)


def test_expand_request_places_rows_and_leaves_the_others_neutral():
    rng = np.random.default_rng()
    r = SamplingRequest(temperature=np.array([0.7, 0.0], np.float32), top_k=np.array([5, 0]),
                        top_p=np.array([0.9, 1.0], np.float32), min_p=np.array([0.0, 0.1], np.float32),
                        uniform=rng.random(2), num_logprobs=np.array([0, 3]),
                        bitmask=rng.integers(0, 2**31, size=(1, 4)).astype(np.int32), mask_index=np.array([-1, 0]))
    out = expand_request(r, 5, [1, 4])
    assert out.problem(5, 100) is None
    assert out.temperature.tolist() == pytest.approx([0, 0.7, 0, 0, 0])
    assert out.top_k.tolist() == [0, 5, 0, 0, 0] and out.num_logprobs.tolist() == [-1, 0, -1, -1, 3]
    assert out.uniform[[1, 4]].tolist() == r.uniform.tolist() and out.uniform[[0, 2, 3]].tolist() == [0, 0, 0]
    assert out.mask_index.tolist() == [-1, -1, -1, -1, 0] and out.bitmask is r.bitmask
    neutral = expand_request(None, 3, [])
    assert neutral.bitmask is None and neutral.temperature.tolist() == [0, 0, 0]


def test_auto_speculation_keeps_its_steps(ckpt):
    """Where `auto` may draft (fewer decode rows than the cost rule's budget) no lookahead step is taken: the
    speculator's windows run as on the plain path, with the same outputs."""
    rng = fresh_rng()
    ps = prompts(rng, 4)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, speculative="auto") for _ in range(4)]
    eng = Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=8, max_batched_tokens=256, block_size=8))
    eng.runner.samples_on_device = eng.runner.supports_lookahead = True
    eng.lookahead.enabled = True
    ref = Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=8, max_batched_tokens=256, block_size=8))
    ref.runner.samples_on_device = True
    same_outputs(ref.generate(ps, params), eng.generate(ps, params))
    assert eng.stats()["lookahead_steps"] == 0


def test_forced_runs_cut_to_the_runners_decode_chunk_continue_on_the_lookahead_path(ckpt):
    """A runner that takes decoding chunks of one token: a forced run is spread over steps, its first pieces want
    no logits, and the lookahead step after such a piece runs the run's next piece (its tokens are known), never
    a fed row."""
    rng = fresh_rng()
    ps = prompts(rng, 10)
    params = [SamplingParams(max_tokens=120, json_schema=SCHEMA, temperature=0.0 if i % 2 else 1.1,
                             seed=int(rng.integers(1 << 30)), speculative="off", logprobs=True) for i in range(10)]
    plain, look = engine(ckpt, False), engine(ckpt, True)
    for eng in (plain, look):
        eng.scheduler.decode_chunk_limit = 1
    launch, last = look.runner.launch, {}

    def checked(batch, previous, feed):
        """Every fed chunk takes the token of its own sequence's logits row in the step launched before."""
        if feed is not None:
            prev = last["batch"]
            row_seq = [c.seq_id for c in prev.chunks for _ in range({"none": 0, "last": 1}[c.logits])]
            for chunk, f in zip(batch.chunks, feed):
                if f >= 0:
                    assert row_seq[f] == chunk.seq_id, "fed from another sequence's row"
        last["batch"] = batch
        return launch(batch, previous, feed)

    look.runner.launch = checked
    same_outputs(plain.generate(ps, params), look.generate(ps, params))
    stats = look.stats()
    assert stats["lookahead_failures"] == 0, look.lookahead.off_reason  # the check above raised in the runner
    assert stats["lookahead_steps"] > 0 and look.scheduler.num_cut_runs + stats["lookahead_discarded_rows"] > 0


def test_a_failing_sampling_plan_after_a_launch_loses_no_output(ckpt, monkeypatch):
    """The bitmasks of a launched lookahead step cannot be built (the grammar library raises): the tokens already
    taken in still come out, the launched step is dropped and its sequences recomputed, lookahead goes off."""
    import gpu_engine.lookahead as la

    rng = fresh_rng()
    ps, params = prompts(rng, 5), mixed_params(rng, 5)
    look = engine(ckpt, True)
    real, calls = la.plan_runner_sampling, [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("matcher broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(la, "plan_runner_sampling", flaky)
    got = look.generate(ps, params)
    same_outputs(engine(ckpt, False).generate(ps, params), got)
    assert "matcher broke" in look.lookahead.off_reason and look.stats()["lookahead_failures"] == 1
