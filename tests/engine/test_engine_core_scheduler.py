"""Scheduler, cache manager and encoder cache, driven through the Engine with the FakeRunner test double."""
from __future__ import annotations

import time

import numpy as np
import pytest
from test_engine_core_fakes import FakeRunner, text_prompt, tiny_tokenizer, vision_prompt

from gpu_engine.cache import BlockManager
from gpu_engine.engine import Engine, RequestError
from gpu_engine.engine_config import EngineConfig, EngineConfigError
from gpu_engine.params import SamplingParams
from gpu_engine.sequence import Sequence


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def make_engine(tok, runner=None, **cfg) -> Engine:
    if "kv_cache_bytes" not in cfg:
        cfg.setdefault("num_kv_blocks", 256)
    return Engine(runner or FakeRunner(), tok, vocab_size=2074, config=EngineConfig(**cfg))


def mixed_prompts(seed: int, n: int):
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        if i % 3 == 0:
            prompts.append(vision_prompt(rng, [int(rng.integers(2, 9)), ("image", int(rng.integers(3, 12)), f"img{i}"),
                                               int(rng.integers(1, 7))]))
        else:
            prompts.append(text_prompt(rng.integers(0, 2000, size=int(rng.integers(1, 40)))))
    return prompts


def solo_outputs(tok, prompts, params, linear_state=True):
    outs = []
    for p, sp in zip(prompts, params):
        eng = make_engine(tok, FakeRunner(linear_state=linear_state), max_num_seqs=1, max_batched_tokens=4096,
                          enable_prefix_caching=False)
        outs.append(eng.generate([p], sp)[0].token_ids)
    return outs


@pytest.mark.parametrize("linear_state", [True, False])
def test_batched_equals_solo_with_chunking_mixing_preemption(tok, linear_state):
    prompts = mixed_prompts(1, 20)
    rng = np.random.default_rng(2)
    params = [SamplingParams(max_tokens=int(rng.integers(1, 14)), ignore_eos=bool(i % 2)) for i in range(20)]
    expected = solo_outputs(tok, prompts, params, linear_state)

    runner = FakeRunner(linear_state=linear_state)
    eng = make_engine(tok, runner, max_num_seqs=5, max_batched_tokens=16, block_size=4, num_kv_blocks=24)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got == expected

    st = eng.stats()
    assert st["preemptions"] > 0, "the cache was sized to force preemption"
    assert all(sum(n for _, _, n in b) <= 16 and len(b) <= 5 for b in runner.batches)
    prompt_len = {eng_seq: len(p) for eng_seq, p in enumerate(prompts)}
    mixed = [b for b in runner.batches
             if any(n == 1 and s >= prompt_len[i] for i, s, n in b) and any(s < prompt_len[i] for i, s, n in b)]
    assert mixed, "no step mixed decode tokens with prefill chunks"
    assert any(s > 0 and s < prompt_len[i] for b in runner.batches for i, s, n in b), "no prompt was chunked"
    assert st["kv_blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0


def test_preemption_mid_decode_recomputes_generated_tokens(tok):
    """Decoding sequences outgrow the cache: the newest is preempted with tokens already generated, recomputed
    later (prompt + its outputs as one prefill), and continues exactly — sampled ones included (own RNG)."""
    rng = np.random.default_rng(11)
    prompts = [text_prompt(rng.integers(0, 2000, size=4)) for _ in range(4)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=t, seed=i)
              for i, t in enumerate((0.0, 1.0, 0.0, 0.8))]
    expected = solo_outputs(tok, prompts, params)
    eng = make_engine(tok, max_num_seqs=4, max_batched_tokens=64, block_size=4, num_kv_blocks=20)
    assert [o.token_ids for o in eng.generate(prompts, params)] == expected
    st = eng.stats()
    assert st["preemptions"] > 0 and st["chunked_output_tokens"] > 0


def test_fifo_admission_and_backfill(tok):
    runner = FakeRunner()
    eng = make_engine(tok, runner, max_num_seqs=8, max_batched_tokens=10, block_size=4, enable_prefix_caching=False)
    rng = np.random.default_rng(3)
    lens = [7, 3, 12, 2, 5]
    for n in lens:
        eng.add_request(text_prompt(rng.integers(0, 2000, size=n)), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    # Step 1: request 0 (7 tokens) whole, then request 1 (3 tokens) backfills the budget exactly.
    assert runner.batches[0] == [(0, 0, 7), (1, 0, 3)]
    while eng.has_unfinished():
        eng.step()
    first_step = {}
    for k, batch in enumerate(runner.batches):
        for seq_id, start, _ in batch:
            if start == 0:
                first_step.setdefault(seq_id, k)
    assert [first_step[i] for i in range(5)] == sorted(first_step[i] for i in range(5))


def test_max_num_seqs_bounds_running(tok):
    runner = FakeRunner()
    eng = make_engine(tok, runner, max_num_seqs=3, max_batched_tokens=64)
    for i in range(7):
        eng.add_request([5 + i, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        assert len(eng.scheduler.running) <= 3
    assert max(len(b) for b in runner.batches) == 3


def test_vision_hash_keeps_different_images_apart(tok):
    rng = np.random.default_rng(4)
    text = rng.integers(0, 2000, size=8).tolist()
    a = vision_prompt(np.random.default_rng(5), [8, ("image", 8, "cat"), 8])
    b = vision_prompt(np.random.default_rng(5), [8, ("image", 8, "dog"), 8])
    c = vision_prompt(np.random.default_rng(5), [8, ("image", 8, "cat"), 8])
    assert np.array_equal(a.token_ids, b.token_ids)  # identical token ids, different pixels
    del text
    bm = BlockManager(64, 4, 2, 4, True, False, lambda s, d: None)
    seqs = [Sequence(i, str(i), p, SamplingParams(), np.random.default_rng(0), frozenset())
            for i, p in enumerate((a, b, c))]
    for s in seqs:
        bm.update_hashes(s)
    # Blocks before the image agree, every block from the image on differs for a vs b and agrees for a vs c.
    assert seqs[0].block_hashes[:2] == seqs[1].block_hashes[:2]
    assert all(x != y for x, y in zip(seqs[0].block_hashes[2:], seqs[1].block_hashes[2:]))
    assert seqs[0].block_hashes == seqs[2].block_hashes


def test_prefix_hit_skips_prefill_and_matches(tok):
    rng = np.random.default_rng(6)
    prompt = text_prompt(rng.integers(0, 2000, size=37))
    expected = solo_outputs(tok, [prompt], [SamplingParams(max_tokens=6, ignore_eos=True)])[0]
    runner = FakeRunner()
    eng = make_engine(tok, runner, block_size=4, max_batched_tokens=64)
    first = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    computed = eng.stats()["prompt_tokens_computed"]
    second = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert first.token_ids == second.token_ids == expected
    assert first.cached_prompt_tokens == 0
    # Snapshot at the prompt's last full block boundary (36); one token is always recomputed for its logits.
    assert second.cached_prompt_tokens == 36
    assert eng.stats()["prompt_tokens_computed"] - computed == 1
    assert eng.stats()["prefix_hit_tokens"] == 36


def test_hybrid_prefix_hit_needs_state_snapshot(tok):
    rng = np.random.default_rng(7)
    base = rng.integers(0, 2000, size=40).tolist()
    other = base[:30] + [1, 2, 3, 4, 5]  # shares 30 tokens; snapshots exist only at 36 and chunk ends
    for linear_state, want in ((True, 0), (False, 28)):
        eng = make_engine(tok, FakeRunner(linear_state=linear_state), block_size=4, max_batched_tokens=64)
        eng.generate([base], SamplingParams(max_tokens=2))
        out = eng.generate([other], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert out.cached_prompt_tokens == want
        assert out.token_ids == solo_outputs(
            tok, [text_prompt(other)], [SamplingParams(max_tokens=4, ignore_eos=True)], linear_state)[0]


def test_snapshot_after_last_image_serves_other_questions(tok):
    """Same document image, another question: the state snapshot after the image is reused."""
    p1 = vision_prompt(np.random.default_rng(8), [5, ("image", 14, "page1"), 9])
    p2 = vision_prompt(np.random.default_rng(8), [5, ("image", 14, "page1"), 3])
    p2.token_ids[-3:] = [11, 12, 13]
    runner = FakeRunner()
    eng = make_engine(tok, runner, block_size=4, max_batched_tokens=64)
    eng.generate([p1], SamplingParams(max_tokens=2))
    out = eng.generate([p2], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.cached_prompt_tokens == 16  # image ends at 19 -> boundary 16
    assert out.token_ids == solo_outputs(tok, [p2], [SamplingParams(max_tokens=5, ignore_eos=True)])[0]


def test_encoder_cache_budget_long_video(tok):
    """A 768-frame video = 384 frame groups (items): encoded one by one as chunks reach them, never all at once."""
    rng = np.random.default_rng(9)
    segments = [3] + [("image", 4, f"frame{i}") for i in range(384)] + [4]
    prompt = vision_prompt(rng, segments)
    runner = FakeRunner()
    item_bytes = 4 * runner.hidden * 4
    budget = 10 * item_bytes  # far below the 384 items of the whole video
    eng = make_engine(tok, runner, block_size=4, max_num_seqs=4, max_batched_tokens=16, encoder_cache_bytes=budget,
                      num_kv_blocks=512)
    expected = solo_outputs(tok, [prompt], [SamplingParams(max_tokens=3, ignore_eos=True)])[0]
    encoded_per_step = []
    rid = eng.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    final = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
        encoded_per_step.append(len(runner.encoded))
    st = eng.stats()
    assert final.token_ids == expected
    assert st["encoder_cache_peak_bytes"] <= budget
    pixels = 4 * 4 * 8 * 4  # one item's pixel_values (test double: [4 * n, 8] float32)
    assert st["encoder_peak_bytes"] <= budget + item_bytes + pixels  # cache + the one item being encoded
    assert st["encoder_encodes"] >= 384
    # Just in time: a 16-token chunk touches at most 5 items of 4 tokens; encoding is spread over ~100 steps.
    assert max(np.diff([0] + encoded_per_step)) <= 5 and len(encoded_per_step) > 90
    assert st["peak_step_tokens"] <= 16


def test_request_error_does_not_stop_others(tok):
    rng = np.random.default_rng(10)
    good = [text_prompt(rng.integers(0, 2000, size=9)) for _ in range(3)]
    bad = vision_prompt(rng, [2, ("image", 5, "corrupt"), 2])
    runner = FakeRunner()
    runner.fail_encode.add(bad.vision_items[0].content_hash)
    eng = make_engine(tok, runner, max_batched_tokens=32)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = eng.generate(good[:2] + [bad] + good[2:], params)
    assert outs[2].finish_reason == "error" and "corrupt image" in outs[2].error
    assert [o.token_ids for o in outs[:2] + outs[3:]] == solo_outputs(tok, good, [params] * 3)
    assert eng.stats()["kv_blocks_used"] == 0


def test_abort_running_and_waiting(tok):
    eng = make_engine(tok, max_num_seqs=1)
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort(a) and eng.abort(b) and not eng.abort("nope")
    outs = {o.request_id: o for o in eng.step()}
    assert outs[a].finish_reason == "abort" and len(outs[a].token_ids) == 2
    assert outs[b].finish_reason == "abort" and outs[b].token_ids == []
    assert not eng.has_unfinished() and eng.stats()["kv_blocks_used"] == 0


def test_timeout_finishes_with_error(tok):
    eng = make_engine(tok)
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True, timeout_s=0.05))
    outs = eng.step()  # on a loaded machine this first step alone may outlast the timeout
    time.sleep(0.06)
    while eng.has_unfinished():
        outs += eng.step()
    [final] = [o for o in outs if o.finished]
    assert final.request_id == rid and final.finish_reason == "error" and "timed out" in final.error
    assert final.completion_tokens < 100


def test_bad_requests_are_rejected(tok):
    eng = make_engine(tok, num_kv_blocks=8, block_size=4, encoder_cache_bytes=100)
    with pytest.raises(RequestError, match="exceeds"):
        eng.add_request([1] * 30, SamplingParams(max_tokens=3))  # 33 tokens > 32 of cache
    with pytest.raises(RequestError, match="vocabulary|must be in"):
        eng.add_request([1, 99999], SamplingParams())
    with pytest.raises(RequestError, match="prompt must be"):
        eng.add_request("plain text", SamplingParams())
    with pytest.raises(RequestError, match="prompt must be"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="SamplingParams"):
        eng.add_request([1, 2], {"max_tokens": 3})
    with pytest.raises(RequestError, match="top_logprobs"):
        eng.add_request([1, 2], SamplingParams(max_tokens=3, logprobs=True, top_logprobs=50))
    with pytest.raises(RequestError, match="stop_token_ids"):
        eng.add_request([1, 2], SamplingParams(max_tokens=3, stop_token_ids=[-1]))
    with pytest.raises(RequestError, match="list of strings"):
        eng.add_request([1, 2], SamplingParams(max_tokens=3, stop="END"))  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(RequestError, match="encoder_cache_bytes"):
        eng.add_request(vision_prompt(np.random.default_rng(0), [1, ("image", 8, "x")]), SamplingParams(max_tokens=3))
    with pytest.raises(RequestError, match="no processor"):
        eng.add_request([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3))
    eng.add_request([1, 2], SamplingParams(max_tokens=3), request_id="r1")
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request([1, 2], SamplingParams(max_tokens=3), request_id="r1")
    with pytest.raises(RequestError, match="json_schema|grammar"):
        eng.add_request([1, 2], SamplingParams(max_tokens=3, regex="[0-9"))
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(min_p=1.0), dict(top_k=-2),
                dict(regex="a", choice=["a"])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize("bad", [
    dict(max_num_seqs=-1), dict(max_batched_tokens=4, max_num_seqs=8), dict(block_size=0),
    dict(kv_cache_bytes=0), dict(kv_cache_bytes=1024, num_kv_blocks=8), dict(num_state_slots=2, max_num_seqs=4),
    dict(encoder_cache_bytes=0), dict(max_model_len=0),
])
def test_engine_config_invariants(bad):
    with pytest.raises(EngineConfigError):
        EngineConfig(**bad)


def test_cache_budget_too_small_is_a_clear_error(tok):
    with pytest.raises(EngineConfigError, match="too small"):
        Engine(FakeRunner(), tok, vocab_size=2074, config=EngineConfig(kv_cache_bytes=100, max_num_seqs=8))


def test_kv_blocks_sized_from_budget(tok):
    runner = FakeRunner()
    cfg = EngineConfig(kv_cache_bytes=10_000, block_size=4, max_num_seqs=2, num_state_slots=6)
    eng = Engine(runner, tok, vocab_size=2074, config=cfg)
    # 6 slots x 16 bytes of state, the rest in 32-byte blocks.
    assert runner.spec.num_kv_blocks == (10_000 - 6 * 16) // 32
    assert runner.spec.num_state_slots == 6
    assert eng.max_model_len == runner.spec.num_kv_blocks * 4


def _seq(i, ids, bm):
    s = Sequence(i, str(i), text_prompt(ids), SamplingParams(max_tokens=4), np.random.default_rng(0), frozenset())
    bm.update_hashes(s)
    return s


def _run_prefill(bm, seq, upto):
    hit = bm.match_prefix(seq)
    assert bm.can_admit(seq, hit, upto - hit.num_tokens)
    bm.admit(seq, hit)
    bm.allocate(seq, upto - seq.num_computed)
    seq.num_computed = upto
    bm.commit(seq)
    bm.snapshot_state(seq)
    return hit


def test_block_manager_refcounts_and_lru_eviction():
    copies = []
    bm = BlockManager(6, 4, 2, 3, True, False, lambda s, d: copies.append((s, d)))
    ids = list(range(100, 109))  # 2 full blocks + 1 token
    a = _seq(0, ids, bm)
    _run_prefill(bm, a, 9)
    assert bm.num_used_blocks == 3 and bm.num_cached_blocks == 2
    b = _seq(1, ids, bm)
    hit = _run_prefill(bm, b, 9)
    assert hit.num_tokens == 8 and b.block_table[:2] == a.block_table[:2]  # shared, refcount 2
    bm.free(a)
    assert bm.num_used_blocks == 3  # b still holds the shared blocks + its own third
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    # A different request needing all 6 blocks evicts the cached ones; the prefix is gone afterwards.
    c = _seq(2, list(range(500, 524)), bm)
    _run_prefill(bm, c, 23)
    bm.free(c)
    assert bm.match_prefix(_seq(3, ids, bm)).num_tokens == 0
    assert not copies  # no linear state: nothing to snapshot


def test_snapshot_slots_are_lru_and_gate_hits():
    copies = []
    # 1 sequence slot + 1 snapshot slot.
    bm = BlockManager(32, 4, 1, 2, True, True, lambda s, d: copies.append((s, d)))
    p1, p2 = list(range(10, 19)), list(range(50, 59))
    s1 = _seq(0, p1, bm)
    _run_prefill(bm, s1, 8)
    bm.free(s1)
    assert copies == [(0, 1)]  # state of slot 0 after 8 tokens -> snapshot slot 1
    assert bm.match_prefix(_seq(1, p1, bm)).num_tokens == 8
    s2 = _seq(2, p2, bm)
    _run_prefill(bm, s2, 8)  # takes the only snapshot slot: p1's snapshot is dropped
    bm.free(s2)
    assert bm.match_prefix(_seq(3, p1, bm)).num_tokens == 0  # KV still cached, but no state to resume from
    again = _seq(4, p2, bm)
    hit = _run_prefill(bm, again, 9)
    assert hit.num_tokens == 8 and hit.snapshot_slot == 1 and copies[-1] == (1, 0)  # restored into its slot


def test_vision_items_in_matches_brute_force():
    rng = np.random.default_rng()
    segments = []
    for i in range(30):
        segments += [int(rng.integers(0, 4)), ("image", int(rng.integers(1, 6)), f"i{i}")]
    p = vision_prompt(rng, segments)
    seq = Sequence(0, "0", p, SamplingParams(), rng, frozenset())
    for _ in range(300):
        a = int(rng.integers(0, len(p) + 3))
        b = a + int(rng.integers(1, 12))
        want = [it for it in p.vision_items if it.token_start < b and it.token_end > a] if a < len(p) else []
        assert seq.vision_items_in(a, b) == want


def test_model_len_limits_and_stateless_kv(tok):
    class NoAttention(FakeRunner):
        def kv_bytes_per_block(self, block_size=None):
            return 0  # only linear-attention layers: KV blocks are bookkeeping only

    eng = Engine(NoAttention(), tok, vocab_size=2074, model_max_len=100,
                 config=EngineConfig(max_num_seqs=2, block_size=4, max_model_len=64))
    assert eng.max_model_len == 64 and eng.blocks.num_blocks == 2 * 16
    with pytest.raises(RequestError, match="exceeds"):
        eng.add_request([1] * 60, SamplingParams(max_tokens=5))
    out = eng.generate([[1] * 50], SamplingParams(max_tokens=14, ignore_eos=True))[0]
    assert len(out.token_ids) == 14
    eng2 = Engine(FakeRunner(), tok, vocab_size=2074, model_max_len=40, config=EngineConfig(num_kv_blocks=100))
    assert eng2.max_model_len == 40


def test_stats_report_latency_percentiles(tok):
    eng = make_engine(tok)
    assert eng.stats()["ttft_p50_s"] is None
    eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    st = eng.stats()
    assert 0 < st["ttft_p50_s"] <= st["latency_p50_s"] and st["latency_p50_s"] <= st["latency_p95_s"]
    assert st["requests_finished"] == 2 and st["finished_length"] == 2 and st["sampled_tokens"] == 6
