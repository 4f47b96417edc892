"""Lookahead steps in the prefill phase (gpu_engine/lookahead_step.py): continuing prompt chunks, admissions, vision
encodes and prefix-cache snapshots in the step launched while the one before is in flight — against the plain
runner-sampling path on the reference runner (which runs a launched step at once, so a state snapshot taken after
the next launch would hold the next chunk's state: the snapshot test catches exactly that).

Every engine here asserts lookahead_failures == 0 (the recovery path would hide a runner exception) unless the
test injects the failure, and that lookahead steps with prompt chunks did run. Fresh random prompts each run.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from test_device_sampling_engine import SCHEMA, fresh_rng
from test_lookahead_engine import same_outputs

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import RequestOutput, SamplingParams
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=47)


def engine(ckpt, lookahead: bool, **cfg) -> Engine:
    """Small token budget (prompts take several chunks), blocks of 8, runner sampling on; speculation off."""
    config = EngineConfig(**{"max_num_seqs": 4, "max_batched_tokens": 16, "block_size": 8, **cfg})
    eng = Engine.from_pretrained(ckpt, config=config, speculative=SpeculativeConfig(num_tokens=0))
    eng.runner.samples_on_device = True
    eng.runner.supports_lookahead = eng.lookahead.enabled = lookahead
    return eng


def run_arrivals(eng: Engine, arrivals: list[tuple[int, object, SamplingParams]]) -> list[RequestOutput]:
    """Requests added at given step() counts (arrivals while others prefill); final outputs in arrival order."""
    ids: list[str | None] = [None] * len(arrivals)
    finals: dict[str, RequestOutput] = {}
    step = 0
    while step == 0 or eng.has_unfinished() or any(i is None for i in ids):
        for k, (at, prompt, params) in enumerate(arrivals):
            if ids[k] is None and at <= step:
                ids[k] = eng.add_request(prompt, params)
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 5000
    return [finals[i] for i in ids if i is not None]


def check_lookahead_ran(eng: Engine) -> dict:
    stats = eng.stats()
    assert stats["lookahead_failures"] == 0, eng.lookahead.off_reason
    assert stats["lookahead_prefill_steps"] > 0 and stats["lookahead_steps"] >= stats["lookahead_prefill_steps"]
    return stats


def mixed(rng, n: int) -> list[SamplingParams]:
    """Greedy, seeded (one uniform per sampled token: same draws on both paths), logprobs, JSON schema."""
    out = []
    for i in range(n):
        kind = i % 4
        out.append(SamplingParams(
            max_tokens=int(rng.integers(3, 20)) if kind != 3 else 100, ignore_eos=kind == 1,
            temperature=0.0 if kind == 0 else float(rng.uniform(0.6, 1.3)), seed=int(rng.integers(1 << 30)),
            top_k=int(rng.integers(2, 40)) if kind == 2 else 0, logprobs=i % 3 == 0,
            top_logprobs=2 if i % 3 == 0 else 0, json_schema=SCHEMA if kind == 3 else None))
    return out


def test_chunked_prompts_and_arrivals_give_the_plain_paths_outputs(ckpt):
    rng = fresh_rng()
    n = 10
    prompts = [rng.integers(0, 2000, size=int(rng.integers(20, 70))).tolist() for _ in range(n)]
    params = mixed(rng, n)
    at = sorted(int(s) for s in rng.integers(0, 25, size=n))
    arrivals = list(zip(at, prompts, params))
    plain, look = engine(ckpt, False), engine(ckpt, True)
    expected = run_arrivals(plain, arrivals)
    got = run_arrivals(look, arrivals)
    same_outputs(expected, got)
    for out, p in zip(got, params):
        if p.json_schema is not None and out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"name", "n", "ok"}
    stats = check_lookahead_ran(look)
    assert stats["lookahead_admissions"] > 0  # waiting requests came in through lookahead steps
    assert stats["sampled_tokens"] == plain.stats()["sampled_tokens"]
    assert stats["prompt_tokens_computed"] == plain.stats()["prompt_tokens_computed"]


def test_prefill_alone_runs_in_lookahead_steps(ckpt):
    """One long prompt, nothing decoding: its chunks after the first are lookahead steps (the first is launched
    although it has no logits row)."""
    rng = fresh_rng()
    prompt = rng.integers(0, 2000, size=75).tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    look = engine(ckpt, True, enable_prefix_caching=False)
    got = look.generate([prompt], params)
    same_outputs(engine(ckpt, False, enable_prefix_caching=False).generate([prompt], params), got)
    stats = check_lookahead_ran(look)
    assert stats["lookahead_prefill_steps"] >= 75 // 16  # every chunk after the first


def prefix_prompts(rng, n: int, prefix_len: int = 45) -> list[list[int]]:
    prefix = rng.integers(0, 2000, size=prefix_len).tolist()
    return [prefix + rng.integers(0, 2000, size=int(rng.integers(5, 20))).tolist() for _ in range(n)]


def test_prefix_hits_restore_the_snapshot_of_the_chunk_that_ended_there(ckpt):
    """Request A's prompt chunks end on block boundaries with the next chunk launched behind them; the snapshots
    taken there must hold the state at the boundary (not after the next chunk): B and C, admitted later with a
    prefix hit, must give what an engine without a prefix cache gives (a wrong state moves every logprob)."""
    rng = fresh_rng()
    a, b, c = prefix_prompts(rng, 3)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
    truth = engine(ckpt, False, enable_prefix_caching=False)
    look = engine(ckpt, True)
    expected = truth.generate([a], params) + truth.generate([b, c], params)
    got = look.generate([a], params)
    snaps = look.stats()["state_snapshots_taken"]
    assert snaps > 0
    got += look.generate([b, c], params)
    same_outputs(expected, got)
    stats = check_lookahead_ran(look)
    assert stats["prefix_hit_tokens"] >= 2 * 32 and stats["prefix_hit_requests"] >= 2


def test_requests_sharing_a_prefix_while_it_prefills(ckpt):
    """Same-prefix requests arriving while the first still prefills (hits on blocks committed one step earlier),
    seeded and greedy."""
    rng = fresh_rng()
    ps = prefix_prompts(rng, 6, prefix_len=40)
    params = mixed(rng, 6)
    arrivals = [(2 * k, p, q) for k, (p, q) in enumerate(zip(ps, params))]
    expected = run_arrivals(engine(ckpt, False, enable_prefix_caching=False), arrivals)
    look = engine(ckpt, True)
    same_outputs(expected, run_arrivals(look, arrivals))
    stats = check_lookahead_ran(look)
    assert stats["prefix_hit_requests"] > 0


def image_messages(rng, n: int) -> list[list[dict]]:
    out = []
    for _ in range(n):
        h, w = (int(x) for x in rng.choice([32, 48, 64], size=2))
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        out.append([{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image},
                                                 {"type": "text", "text": "what is it?"}]}])
    return out


def test_images_are_encoded_while_the_step_before_is_in_flight(ckpt):
    rng = fresh_rng()
    msgs = image_messages(rng, 5)
    params = mixed(rng, 5)
    arrivals = [(3 * k, m, p) for k, (m, p) in enumerate(zip(msgs, params))]
    plain, look = engine(ckpt, False), engine(ckpt, True)
    expected = run_arrivals(plain, arrivals)
    enc, in_flight = look.encoder, []
    encode, encode_batch = enc._encode, enc._encode_batch

    def spy(item):
        in_flight.append(look.lookahead.in_flight is not None)
        return encode(item)

    def spy_batch(items):
        in_flight.extend(look.lookahead.in_flight is not None for _ in items)
        return encode_batch(items)

    enc._encode = spy
    if encode_batch is not None:
        enc._encode_batch = spy_batch
    got = run_arrivals(look, arrivals)
    same_outputs(expected, got)
    check_lookahead_ran(look)
    assert any(in_flight), "no vision encode ran while a step was in flight"
    assert all(o.finish_reason != "error" for o in got), [o.error for o in got]


def test_a_failure_in_a_prefill_lookahead_step_withdraws_its_prefix_entries(ckpt):
    """The runner raises while a prompt chunk is in flight: the blocks and snapshots its settling offered are
    withdrawn, the sequences recomputed; later same-prefix requests still get the no-prefix-cache outputs."""
    rng = fresh_rng()
    ps = prefix_prompts(rng, 4)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True)
    truth = engine(ckpt, False, enable_prefix_caching=False)
    expected = truth.generate(ps[:2], params) + truth.generate(ps[2:], params)
    look = engine(ckpt, True)
    launch, count, corrupted = look.runner.launch, [0], []

    def flaky(batch, previous, feed):
        count[0] += 1
        if count[0] == 3:  # a lookahead step behind a prompt chunk ending on a snapshot boundary
            # a device failure leaves the in-flight step's results suspect: the snapshot its settling just took
            # (the newest) holds garbage; only its withdrawal keeps later prefix hits off it
            slots = list(look.blocks._snapshots.values())
            corrupted.extend(slots[-1:])  # asserted below: raising here would be taken for the runner's failure
            for slot in slots[-1:]:
                for layer in look.runner.recurrent_state:
                    look.runner.recurrent_state[layer][slot] += 1.0
            look.runner._launched = None
            raise RuntimeError("device lost the step")
        return launch(batch, previous, feed)

    look.runner.launch = flaky
    got = look.generate(ps[:2], params) + look.generate(ps[2:], params)
    same_outputs(expected, got)
    stats = look.stats()
    assert corrupted and stats["lookahead_failures"] == 1 and stats["preempted_after_failure"] > 0
    assert "device lost the step" in look.lookahead.off_reason and stats["prefix_hit_requests"] > 0
