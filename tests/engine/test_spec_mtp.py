"""The MTP head as a drafter on the reference runner (tiny checkpoints carry no MTP head: random mtp.* weights are
attached): greedy output stays plain decoding; the drafts the engine gets after every step — whose head KV was
filled chunk by chunk, rolled over rejected windows and shared through the prefix cache — equal the head run over
the whole sequence at once from an empty cache; the head costs one more KV layer per block."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpu_engine
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.loader import ModelWeights
from gpu_engine.params import SamplingParams
from gpu_engine.reference.mtp import MtpHead, random_mtp_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch, VisionSlice
from gpu_engine.sequence import Sequence
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint
from gpu_engine.tokenizer import Tokenizer

PROMPTS = [np.random.default_rng(1).integers(10, 2000, n).tolist() for n in (9, 23, 14)]
K = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=8)


def with_mtp(folder: Path) -> ReferenceRunner:
    return mtp_model(folder)[0]


def mtp_model(folder: Path) -> tuple[ReferenceRunner, gpu_engine.LoadedModel]:
    loaded = gpu_engine.load(folder)
    assert isinstance(loaded.runner, ReferenceRunner)
    w = loaded.runner.weights
    weights = ModelWeights(w.text, w.vision, w.lm_head, mtp=random_mtp_weights(loaded.config.text, seed=3))
    return ReferenceRunner(loaded.config, weights), loaded


def mtp_engine(folder: Path, k: int = K, num_kv_blocks: int | None = None) -> Engine:
    runner, loaded = mtp_model(folder)
    return Engine(runner, Tokenizer.from_pretrained(folder), vocab_size=runner.config.text.vocab_size,
                  config=EngineConfig(max_num_seqs=3, block_size=4, num_kv_blocks=num_kv_blocks),
                  speculative=SpeculativeConfig(num_tokens=k), prepare=loaded.prepare)


def from_scratch(runner: Any, seq: Sequence, k: int) -> list[int]:
    """The head's drafts after `seq`'s tokens (the last one not yet in the cache), recomputed at once: the trunk
    over every computed token (vision rows included), then the head over all of them from an empty cache."""
    assert isinstance(runner, ReferenceRunner)
    fresh = ReferenceRunner(runner.config, runner.weights)
    tokens = seq.token_ids
    n = len(tokens) - 1
    blocks = -(-(n + k) // 4) + 1
    fresh.allocate_cache(CacheSpec(num_kv_blocks=blocks, block_size=4, num_state_slots=1))
    pos = seq.positions(0, n + k)
    table = np.arange(blocks, dtype=np.int32)
    vision = [VisionSlice(it.token_start, runner.encode_vision(it)) for it in seq.prompt.vision_items]
    whole = SeqChunk(seq_id=0, token_ids=tokens[:n + 1], positions=pos[:, :n + 1], start=0, block_table=table,
                     state_slot=0, vision=vision)
    embeds = fresh._embeds(whole)  # input rows of every token, vision merged: the head's "next token" rows
    out = fresh.forward(StepBatch([SeqChunk(seq_id=0, token_ids=tokens[:n], positions=pos[:, :n], start=0,
                                            block_table=table, state_slot=0, logits="all", vision=vision)]))
    assert out.hidden is not None  # the final-norm hidden states of every row
    head = fresh.mtp
    assert isinstance(head, MtpHead)
    return head.draft(tokens[1:], out.hidden, pos, fresh.mtp_k, fresh.mtp_v, table.astype(np.int64), 0, k,
                      next_embeds=embeds[1:])


def run_checking_drafts(eng: Engine, prompts: list[Any]) -> tuple[dict[str, list[int]], int]:
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True, speculative="mtp"), request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    checked = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        for seq in eng.scheduler.running:
            if seq.mtp_drafts:
                want = from_scratch(eng.runner, seq, len(seq.mtp_drafts))
                assert seq.mtp_drafts == want, (seq.request_id, seq.num_tokens)
                checked += 1
    return done, checked


def test_mtp_drafts_equal_the_head_over_the_whole_sequence_and_output_is_exact(folder: Path) -> None:
    plain = mtp_engine(folder, k=0)
    want = {}
    for i, p in enumerate(PROMPTS):
        want[f"r{i}"] = plain.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    eng = mtp_engine(folder)
    got, checked = run_checking_drafts(eng, PROMPTS)
    assert got == want
    st = eng.stats()
    assert checked > 20 and st["mtp_head_runs"] > 20 and st["spec_draft_tokens"] > 20
    # the prefix cache hands the same prompts' blocks (and the head's KV in them) to a second run
    again, checked = run_checking_drafts(eng, PROMPTS)
    assert again == want and checked > 20 and eng.stats()["prefix_hit_tokens"] > 0


def test_auto_uses_the_head_when_lookup_finds_nothing(folder: Path) -> None:
    eng = mtp_engine(folder)
    out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.draft_tokens > 0 and eng.stats()["mtp_head_runs"] > 0
    off = mtp_engine(folder)
    off.generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True, speculative="ngram"))
    assert off.stats()["mtp_head_runs"] == 0  # the head runs only for requests that may use it


def test_the_head_has_its_own_kv_layer_in_every_block(folder: Path) -> None:
    runner = with_mtp(folder)
    plain = gpu_engine.load(folder).runner
    t = runner.config.text
    assert runner.kv_bytes_per_block(4) - plain.kv_bytes_per_block(4) == 2 * 4 * t.num_key_value_heads * t.head_dim * 4
    assert isinstance(plain, ReferenceRunner) and runner.mtp_head and not plain.mtp_head


def test_a_prompt_chunk_fills_the_head_and_the_last_one_drafts(folder: Path) -> None:
    """The prompt of 23 runs as 20 + 3 (a prefix-cache snapshot boundary): after the first chunk the head only
    fills its KV (the next token is the prompt's own), after the second it drafts K."""
    eng = mtp_engine(folder)
    rid = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True, speculative="mtp"))
    seq: Sequence = eng._live[rid]
    eng.step()
    assert seq.num_computed == 20 and seq.mtp_drafts == [] and eng.stats()["mtp_head_runs"] == 1
    eng.step()
    assert seq.num_computed == len(PROMPTS[1]) and seq.num_tokens == len(PROMPTS[1]) + 1
    assert seq.mtp_drafts == from_scratch(eng.runner, seq, K)
    assert len(seq.mtp_drafts) == K


def test_the_head_reads_vision_rows_as_the_trunk_did(folder: Path) -> None:
    """Next to an image, the head's "next token" input is the vision embedding the trunk saw (as vLLM's drafter
    merges multimodal embeddings), not the placeholder token's; prompt chunks split the image (chunked prefill)."""
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(4).integers(0, 255, (48, 80, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Read"}]}]
    plain = mtp_engine(folder, k=0).generate(messages, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    eng = mtp_engine(folder)
    got, checked = run_checking_drafts(eng, [messages])
    assert got["r0"] == plain and checked >= 3


def test_a_checkpoint_with_an_incomplete_head_loads_without_one(folder: Path) -> None:
    loaded = gpu_engine.load(folder)
    assert isinstance(loaded.runner, ReferenceRunner)
    w = loaded.runner.weights
    partial = random_mtp_weights(loaded.config.text)
    del partial["fc.weight"]
    runner = ReferenceRunner(loaded.config, ModelWeights(w.text, w.vision, w.lm_head, mtp=partial))
    assert not runner.mtp_head and runner.kv_bytes_per_block(4) == loaded.runner.kv_bytes_per_block(4)


def test_preempted_sequences_refill_the_head(folder: Path) -> None:
    eng = mtp_engine(folder, num_kv_blocks=22)  # three sequences of up to 47 tokens in 88 token slots
    got, checked = run_checking_drafts(eng, PROMPTS)
    plain = mtp_engine(folder, k=0)
    want = {f"r{i}": plain.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
            for i, p in enumerate(PROMPTS)}
    assert got == want and checked > 20 and eng.stats()["preemptions"] > 0
