"""Engine acceptance tests on the real ReferenceRunner with a tiny random checkpoint (CPU).

The one-request-at-a-time oracle is gpu_engine.load(...).generate (the model helper's plain loop: one sequence,
whole-prompt prefill, its own cache) — none of the engine's scheduler / cache / encoder-cache code is involved.
Log-probabilities are compared to 1e-4 absolute (float32, different chunking changes rounding).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from PIL import Image

import gpu_engine
from gpu_engine.engine import Engine, RequestError
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.sampling import log_softmax
from gpu_engine.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=11)


@pytest.fixture(scope="module")
def oracle(ckpt):
    return gpu_engine.load(ckpt)


def image(rng, h, w) -> Image.Image:
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def frames(rng, n, h=64, w=64) -> list[np.ndarray]:
    return [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def user(*parts) -> list[dict]:
    content = []
    for p in parts:
        if isinstance(p, str):
            content.append({"type": "text", "text": p})
        elif isinstance(p, Image.Image):
            content.append({"type": "image", "image": p})
        else:
            content.append({"type": "video", "video": p, "fps": 2.0})
    return [{"role": "user", "content": content}]


def mixed_requests(seed: int):
    rng = np.random.default_rng(seed)
    words = "invoice total amount date vendor page scan table line item due".split()

    def text(n):
        return " ".join(rng.choice(words, size=n))

    prompts = [
        user(text(3)), user(text(25)), user(image(rng, 64, 96), text(4)), user(image(rng, 96, 64), text(9)),
        rng.integers(0, 2000, size=7).tolist(), user(frames(rng, 8), text(2)), user(text(60)),
        user(image(rng, 64, 64), image(rng, 64, 128), text(3)), rng.integers(0, 2000, size=41).tolist(),
        user(frames(rng, 12, 64, 96), text(5)), user(text(1)), user(image(rng, 128, 64), text(12)),
        user(text(14)), user(frames(rng, 4), image(rng, 64, 64), text(6)), rng.integers(0, 2000, size=3).tolist(),
        user(image(rng, 64, 96), text(30)), user(text(7)), user(frames(rng, 6), text(1)),
    ]
    max_tokens = [int(rng.integers(2, 12)) for _ in prompts]
    return prompts, max_tokens


def test_batched_equals_one_at_a_time(ckpt, oracle):
    prompts, max_tokens = mixed_requests(0)
    assert len(prompts) >= 16
    expected = [oracle.generate(p, max_tokens=n) for p, n in zip(prompts, max_tokens)]
    lengths = [len(oracle.prepare(p)) if isinstance(p[0], dict) else len(p) for p in prompts]
    # KV room for the longest request plus a little: concurrent requests must take turns (preemption).
    blocks = -(-(max(lengths) + max(max_tokens)) // 8) + 2
    cfg = EngineConfig(max_num_seqs=6, max_batched_tokens=24, block_size=8, num_kv_blocks=blocks)
    eng = Engine.from_pretrained(ckpt, config=cfg)
    steps: list[list[tuple[int, int, int]]] = []  # per forward: (sequence, start, tokens)
    forward = eng.runner.forward

    def recording_forward(batch):
        steps.append([(c.seq_id, c.start, c.num_tokens) for c in batch.chunks])
        return forward(batch)

    eng.runner.forward = recording_forward  # type: ignore[method-assign]  # spy on the runner
    outs = eng.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    assert [o.token_ids for o in outs] == expected
    assert all(sum(n for _, _, n in step) <= cfg.max_batched_tokens and len(step) <= 6 for step in steps)
    # Mixing: some forward carried decode tokens of some requests and prefill chunks of others.
    assert any(any(s >= lengths[i] for i, s, n in step) and any(s < lengths[i] for i, s, n in step) for step in steps)
    st = eng.stats()
    assert st["preemptions"] > 0
    assert st["prefix_hit_tokens"] > 0  # re-admitted sequences reuse their own cached blocks + state snapshots
    assert st["encoder_encodes"] > 0 and st["kv_blocks_used"] == 0
    longest = max(o.prompt_tokens for o in outs)
    assert longest > cfg.max_batched_tokens  # chunked prefill was needed
    assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_preemption_mid_decode_on_the_reference_runner(ckpt, oracle):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 2000, size=int(n)).tolist() for n in (5, 9, 6, 12)]
    expected = [oracle.generate(p, max_tokens=24) for p in prompts]
    eng = Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=4, block_size=4, num_kv_blocks=22))
    assert [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=24))] == expected
    st = eng.stats()
    assert st["preemptions"] > 0 and st["chunked_output_tokens"] > 0


def test_prefix_cache_hit_same_tokens_and_logprobs(ckpt):
    rng = np.random.default_rng(1)
    msgs = user(image(rng, 64, 96), "What is the invoice total on this page? Answer briefly.")
    params = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3)
    eng = Engine.from_pretrained(ckpt, config=EngineConfig(block_size=8, max_batched_tokens=256))
    first = eng.generate([msgs], params)[0]
    computed = eng.stats()["prompt_tokens_computed"]
    second = eng.generate([msgs], params)[0]
    assert second.token_ids == first.token_ids
    assert second.cached_prompt_tokens > 0 and first.cached_prompt_tokens == 0
    assert eng.stats()["prompt_tokens_computed"] - computed == second.prompt_tokens - second.cached_prompt_tokens
    assert eng.stats()["prefix_hit_tokens"] == second.cached_prompt_tokens
    np.testing.assert_allclose([t.logprob for t in second.logprobs], [t.logprob for t in first.logprobs], atol=1e-4)


def test_same_text_different_images_never_share_blocks(ckpt, oracle):
    rng = np.random.default_rng(2)
    text = "Read the vendor name."
    system = {"role": "system", "content": "You extract fields from scanned business documents as JSON."}
    a, b = [system] + user(image(rng, 64, 96), text), [system] + user(image(rng, 64, 96), text)
    pa, pb = oracle.prepare(a), oracle.prepare(b)
    assert np.array_equal(pa.token_ids, pb.token_ids)  # placeholders make the token ids identical
    image_start = pb.vision_items[0].token_start
    eng = Engine.from_pretrained(ckpt, config=EngineConfig(block_size=4, max_batched_tokens=256))
    out_a = eng.generate([a], SamplingParams(max_tokens=5))[0]
    out_b = eng.generate([b], SamplingParams(max_tokens=5))[0]
    # The instructions before the image are shared (state snapshot there), nothing from the image on.
    assert out_b.cached_prompt_tokens == image_start // 4 * 4 > 0
    assert out_a.token_ids == oracle.generate(a, max_tokens=5)
    assert out_b.token_ids == oracle.generate(b, max_tokens=5)
    # Together in one batch: no block in common at all.
    eng2 = Engine.from_pretrained(ckpt, config=EngineConfig(block_size=4, max_batched_tokens=256))
    ra, rb = eng2.add_request(a, SamplingParams(max_tokens=5)), eng2.add_request(b, SamplingParams(max_tokens=5))
    eng2.step()
    seqs = {s.request_id: s for s in eng2.scheduler.running}
    assert not set(seqs[ra].block_table) & set(seqs[rb].block_table)


def test_long_video_stays_in_encoder_budget(ckpt, oracle):
    rng = np.random.default_rng(3)
    msgs = user(frames(rng, 48), "Summarise the video.")
    prompt = oracle.prepare(msgs)
    items = prompt.vision_items
    emb_bytes = [oracle.runner.embedding_nbytes(it) for it in items]
    budget = 3 * max(emb_bytes)
    assert sum(emb_bytes) > 3 * budget  # the whole video would not fit
    cfg = EngineConfig(block_size=4, max_batched_tokens=8, max_num_seqs=2, encoder_cache_bytes=budget)
    eng = Engine.from_pretrained(ckpt, config=cfg)
    out = eng.generate([msgs], SamplingParams(max_tokens=4))[0]
    st = eng.stats()
    assert out.token_ids == oracle.generate(msgs, max_tokens=4)
    assert st["encoder_cache_peak_bytes"] <= budget
    one_item = max(e + it.pixel_values.nbytes for e, it in zip(emb_bytes, items))
    assert st["encoder_peak_bytes"] <= budget + one_item
    assert st["encoder_encodes"] >= len(items)
    # What reached one forward: at most a chunk's worth of tokens, hence of vision rows.
    assert st["peak_step_tokens"] <= cfg.max_batched_tokens
    assert 0 < st["peak_step_vision_rows"] <= cfg.max_batched_tokens


def test_logprobs_match_independent_forward(ckpt, oracle):
    ids = np.random.default_rng(4).integers(0, 2000, size=12).tolist()
    eng = Engine.from_pretrained(ckpt, config=EngineConfig(block_size=4, max_batched_tokens=5, max_num_seqs=4))
    out = eng.generate([ids], SamplingParams(max_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True))[0]
    full = oracle.logits(ids + out.token_ids)
    ref = log_softmax(full[len(ids) - 1 : len(ids) - 1 + len(out.token_ids)].astype(np.float64))
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i] == int(np.argmax(ref[i]))
        assert abs(lp.logprob - ref[i, lp.token_id]) < 1e-4
        assert [t for t, _ in lp.top] == np.argsort(-ref[i])[:2].tolist()


def test_stop_strings_and_streaming(ckpt):
    ids = np.random.default_rng(5).integers(0, 2000, size=9).tolist()
    eng = Engine.from_pretrained(ckpt)
    full = eng.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True))[0].text
    assert len(full) > 12
    stop = full[6:9]
    cut = full.index(stop)
    rid = eng.add_request(ids, SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop, "\x00never"]))
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            deltas.append(out.delta)
            final = out
    assert final.finish_reason == "stop" and final.text == full[:cut]
    assert "".join(deltas) == final.text  # a stop string is never streamed, even partly
    # stop_token_ids: stop at the 3rd generated token, which is kept in token_ids but not in the text.
    tokens = eng.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    out = eng.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[tokens[2]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: tokens.index(tokens[2]) + 1]


def test_bad_media_is_a_request_error(ckpt):
    eng = Engine.from_pretrained(ckpt)
    bad = [{"role": "user", "content": [{"type": "image", "image": b"not an image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(RequestError, match="cannot prepare"):
        eng.add_request(bad, SamplingParams(max_tokens=3))
    assert not eng.has_unfinished()


def test_model_fingerprint_reported(ckpt, oracle):
    eng = Engine.from_pretrained(ckpt)
    assert eng.model_fingerprint == oracle.fingerprint and len(eng.model_fingerprint) == 64
    assert eng.stats()["model_fingerprint"] == oracle.fingerprint


def test_cli_generate_with_schema(ckpt, tmp_path):
    rng = np.random.default_rng(6)
    img = tmp_path / "page.png"
    image(rng, 64, 96).save(img)
    schema = {"type": "object", "properties": {"total": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "currency": {"enum": ["EUR", "USD", "GBP"]}},
              "required": ["total", "currency"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    cmd = [sys.executable, "-m", "gpu_engine", "generate", "--model", str(ckpt), "--image", str(img), "--prompt",
           "Total?", "--json-schema", str(tmp_path / "s.json"), "--max-tokens", "64", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    jsonschema.validate(json.loads(result["text"]), schema)
    assert result["finish_reason"] == "stop" and len(result["model_fingerprint"]) == 64
    bad = subprocess.run(cmd[:-5] + ["--json-schema", str(tmp_path / "missing.json")], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and "cannot read the JSON schema" in bad.stderr
    # Cut by --max-tokens before the JSON closes: not an answer, so a clear error and a non-zero exit.
    cut_cmd = [a if a != "64" else "2" for a in cmd[:-1]]
    cut = subprocess.run(cut_cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert cut.returncode == 3 and "cut at --max-tokens 2" in cut.stderr, cut.stderr


def test_cli_bench_writes_json(ckpt, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "gpu_engine", "bench", "--model", str(ckpt), "--num-requests", "3",
           "--prompt-len", "8", "--max-tokens", "4", "--max-num-seqs", "2", "--max-batched-tokens", "16",
           "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["requests"] == 3 and result["generated_tokens_per_s"] > 0
    assert result["ttft_p50_s"] <= result["latency_p50_s"]


def test_engine_and_prompt_processor_share_one_tokenizer(ckpt):
    """The tokenizer (a 248k vocabulary for real checkpoints) is loaded once, not again by the processor."""
    eng = Engine.from_pretrained(ckpt)
    eng.prepare_prompt([{"role": "user", "content": "hello"}])
    loaded = eng._prepare.__self__  # the LoadedModel whose processor served the prompt
    assert loaded._processor.tokenizer is eng.tokenizer
