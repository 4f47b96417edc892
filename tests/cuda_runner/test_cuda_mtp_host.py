"""The CUDA runner's MTP head, host side (gpu_engine/cuda/mtp.py), on the CPU: the kept-rows book and the head's
step tables (plan_drafts), run by a numpy emulation of CudaMtpHead.run that computes each step of the plan with the
reference head's layer over the plan's own block tables and positions. Beside a reference runner in an engine
(prompt chunks, verify windows with rejections, preemption, an image), every mtp_draft call's emulated drafts
equal the reference runner's, and the chained rows write only their own blocks or their scratch blocks."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpu_engine
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.mtp import DraftPlan, Kept, KeptRows, MtpCache, plan_drafts, scratch_blocks_per_request
from gpu_engine.cuda.options import CudaOptions
from gpu_engine.cuda.text_model import AttentionCache
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.errors import RunnerInputError
from gpu_engine.loader import ModelWeights
from gpu_engine.params import SamplingParams
from gpu_engine.reference.mtp import MtpHead, random_mtp_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.runner_api import CacheSpec, MtpDraftRequest, SeqChunk
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint
from gpu_engine.tokenizer import Tokenizer
from tests.engine.engine_runs import run_prompts

PROMPTS = [np.random.default_rng(1).integers(10, 2000, n).tolist() for n in (9, 23, 14)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=8)


def emulate(plan: DraftPlan, head: MtpHead, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """What CudaMtpHead.run computes, step by step from the plan's tables, in numpy float32."""

    def layer(step: Any, embeds: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        t, out = step.tables, np.empty_like(embeds)
        for s in range(t.cu.size - 1):
            a, b = int(t.cu[s]), int(t.cu[s + 1])
            out[a:b] = head.layer(embeds[a:b], hidden[a:b], t.pos[:, a:b].astype(np.int64), k, v,
                                  t.tables[s].astype(np.int64), int(t.tok_pos[a]))
        return out

    fill = plan.fill
    embeds = head.embed[fill.tables.ids].astype(np.float32)
    if fill.vision_embeds is not None:
        embeds[fill.tables.vis_rows] = fill.vision_embeds
    out = layer(fill, embeds, plan.hidden.astype(np.float32))
    if not plan.drafting:
        return np.zeros((0, 0), np.int64)
    rows = out[fill.tables.logit_rows]
    tokens = np.argmax(head.logits(rows), axis=-1)
    drafts = [tokens]
    for step in plan.chain:
        rows = layer(step, head.embed[tokens].astype(np.float32), rows)
        tokens = np.argmax(head.logits(rows), axis=-1)
        drafts.append(tokens)
    return np.stack(drafts)


class EmulatedHeadRunner(ReferenceRunner):
    """The reference runner, whose every mtp_draft is also computed the CUDA runner's way (KeptRows, plan_drafts,
    emulate) into a head cache of its own, and compared."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept = KeptRows()
        self.calls = self.drafted = 0
        self.mismatches: list[str] = []
        self.stray_writes: list[str] = []

    def allocate_cache(self, spec: CacheSpec) -> None:
        super().allocate_cache(spec)
        t = self.config.text
        per, requests = scratch_blocks_per_request(spec.block_size), spec.num_state_slots
        shape = (spec.num_kv_blocks + per * requests, spec.block_size, t.num_key_value_heads, t.head_dim)
        dummy = DArray(0, shape, "f32")  # plan_drafts reads the block counts only
        self.head_cache = MtpCache(AttentionCache(dummy, dummy), spec.num_kv_blocks, per, requests)
        self.emu_k, self.emu_v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.kept.clear()

    def forward(self, batch: Any) -> Any:
        self.kept.begin_step()
        return super().forward(batch)

    def _keep_hidden(self, chunk: SeqChunk, hidden: np.ndarray) -> None:
        super()._keep_hidden(chunk, hidden)
        vision = [(p.chunk_offset, np.asarray(p.embeddings, np.float32)) for p in chunk.vision]
        self.kept.keep(chunk, hidden.copy(), vision)

    def mtp_draft(self, requests: list[MtpDraftRequest]) -> list[list[int]]:
        want = super().mtp_draft(requests)
        assert self.spec is not None and self.mtp is not None
        rows = [self.kept.take(r) for r in requests]
        plan = plan_drafts(requests, rows, self.spec, self.head_cache, self.config.text, "f32")
        self._check_chain_writes(plan, requests)
        got = emulate(plan, self.mtp, self.emu_k, self.emu_v)
        for p, i in enumerate(plan.drafting):
            drafts = got[:requests[i].num_drafts, p].tolist()
            if drafts != want[i]:
                self.mismatches.append(f"seq {requests[i].seq_id} at {requests[i].start}: {drafts} != {want[i]}")
        self.calls += 1
        self.drafted += len(plan.drafting)
        return want

    def _check_chain_writes(self, plan: DraftPlan, requests: list[MtpDraftRequest]) -> None:
        bs = self.head_cache.kv.k.shape[1]
        for step in plan.chain:
            for s, i in enumerate(plan.drafting):
                block = int(step.tables.kv_slots[s]) // bs
                first = self.head_cache.num_kv_blocks + s * self.head_cache.per_request
                if block not in set(requests[i].block_table.tolist()) and not first <= block < first + \
                        self.head_cache.per_request:
                    self.stray_writes.append(f"seq {requests[i].seq_id}: chained row writes block {block}")


def emulated_engine(folder: Path, k: int = 3, num_kv_blocks: int | None = None,
                    max_batched_tokens: int | None = None) -> Engine:
    loaded = gpu_engine.load(folder)
    assert isinstance(loaded.runner, ReferenceRunner)
    w = loaded.runner.weights
    weights = ModelWeights(w.text, w.vision, w.lm_head, mtp=random_mtp_weights(loaded.config.text, seed=3))
    runner = EmulatedHeadRunner(loaded.config, weights)
    extra = {} if max_batched_tokens is None else {"max_batched_tokens": max_batched_tokens}
    return Engine(runner, Tokenizer.from_pretrained(folder), vocab_size=runner.config.text.vocab_size,
                  config=EngineConfig(max_num_seqs=3, block_size=4, num_kv_blocks=num_kv_blocks, **extra),
                  speculative=SpeculativeConfig(num_tokens=k), prepare=loaded.prepare)


def generate_all(eng: Engine, prompts: list[Any], speculative: str = "mtp") -> dict[str, list[int]]:
    return run_prompts(eng, prompts, SamplingParams(max_tokens=24, ignore_eos=True, speculative=speculative))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_cuda_plan_drafts_what_the_reference_head_drafts(folder: Path, k: int) -> None:
    eng = emulated_engine(folder, k=k)
    got = generate_all(eng, PROMPTS)
    runner = eng.runner
    assert isinstance(runner, EmulatedHeadRunner)
    assert runner.mismatches == [] and runner.stray_writes == []
    assert runner.calls > 10 and runner.drafted > 10
    plain = emulated_engine(folder, k=0)
    assert got == generate_all(plain, PROMPTS, speculative="off")


def test_prompt_chunks_preemption_and_an_image(folder: Path) -> None:
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(4).integers(0, 255, (48, 80, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Read"}]}]
    eng = emulated_engine(folder, num_kv_blocks=26, max_batched_tokens=16)
    generate_all(eng, [messages, *PROMPTS])
    runner = eng.runner
    assert isinstance(runner, EmulatedHeadRunner)
    assert runner.mismatches == [] and runner.stray_writes == [] and runner.drafted > 10
    assert eng.stats()["preemptions"] > 0


def test_kept_rows_join_a_slots_last_row_and_refuse_what_was_not_kept() -> None:
    book = KeptRows()
    hidden = np.arange(12, dtype=np.float32).reshape(4, 3)
    vision = [(2, np.full((2, 3), 7.0, np.float32))]  # rows 2, 3 of the chunk are an image's
    chunk = SeqChunk(seq_id=1, token_ids=np.array([5, 6, 9, 9]), positions=np.zeros((3, 4), np.int64), start=0,
                     block_table=np.zeros(1, np.int32), state_slot=2, keep_hidden=True)
    book.keep(chunk, hidden, vision)
    assert book.last_row[2].start == 3 and book.last_row[2].vision[0][1].shape == (1, 3)
    book.begin_step()
    nxt = SeqChunk(seq_id=1, token_ids=np.array([9, 4]), positions=np.zeros((3, 2), np.int64), start=4,
                   block_table=np.zeros(2, np.int32), state_slot=2, keep_hidden=True)
    book.keep(nxt, hidden[:2] + 100, [(0, np.full((1, 3), 8.0, np.float32))])
    kept = book.by_seq[1]
    assert kept.start == 3 and kept.hidden.shape == (3, 3) and kept.tokens.tolist() == [9, 9, 4]
    # positions 3, 4 with next tokens 9 (the image row that ran at 4) and 4: one vision row, the first
    rows = book.take(MtpDraftRequest(seq_id=1, start=3, next_tokens=np.array([9, 4]),
                                     positions=np.zeros((3, 2), np.int64), block_table=np.zeros(2, np.int32),
                                     num_drafts=0))
    assert rows.hidden.tolist() == [hidden[3].tolist(), (hidden[0] + 100).tolist()]
    assert [(v.chunk_offset, v.embeddings.tolist()) for v in rows.vision] == [(0, [[8.0, 8.0, 8.0]])]
    with pytest.raises(RunnerInputError, match="keep_hidden"):
        book.take(MtpDraftRequest(seq_id=1, start=3, next_tokens=np.array([1]), positions=np.zeros((3, 1)),
                                  block_table=np.zeros(2, np.int32), num_drafts=1))


def test_plan_refuses_more_drafting_requests_than_scratch() -> None:
    dummy = DArray(0, (1,), "f32")
    cache = MtpCache(AttentionCache(dummy, dummy), num_kv_blocks=8, per_request=1, requests=1)
    reqs = [MtpDraftRequest(seq_id=i, start=0, next_tokens=np.array([1]), positions=np.zeros((3, 3), np.int64),
                            block_table=np.array([i], np.int32), num_drafts=3) for i in range(2)]
    with pytest.raises(RunnerInputError, match="scratch"):
        plan_drafts(reqs, [], CacheSpec(8, 4, 2), cache, None, "f32")  # type: ignore[arg-type]


def test_auto_keeps_prompt_lookup_unless_opted_in(folder: Path) -> None:
    assert CudaOptions().mtp_in_auto is False
    assert CudaOptions.from_env({"DOCPIPE_CUDA_MTP_AUTO": "1"}).mtp_in_auto is True
    eng = emulated_engine(folder)
    eng.runner.mtp_in_auto = False  # type: ignore[attr-defined] - what a CudaRunner without the opt-in says
    eng.spec.__init__(eng.spec.config, eng.runner, eng._counters)  # type: ignore[misc] - re-read the runner
    generate_all(eng, PROMPTS[:1], speculative="auto")
    assert eng.stats()["mtp_head_runs"] == 0
    generate_all(eng, PROMPTS[:1], speculative="mtp")
    assert eng.stats()["mtp_head_runs"] > 0



def test_the_runner_keeps_each_chunks_own_rows_and_drafts_in_rounds_of_its_scratch(folder: Path) -> None:
    """KeptRows.keep_step takes a chunk's rows at the end of its run chunk (re-fed tokens run in front);
    mtp_draft runs drafting requests past the head's scratch in further rounds and hands each its own drafts."""
    from types import SimpleNamespace

    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.runner_api import StepBatch

    cfg = gpu_engine.load(folder).config.text
    h = cfg.hidden_size
    source = np.arange(7 * h, dtype=np.float32).reshape(7, h)
    r = CudaRunner.__new__(CudaRunner)
    r.cfg, r.dtype, r.kept = cfg, "f32", KeptRows()
    r.ctx = SimpleNamespace(device=SimpleNamespace(  # type: ignore[assignment]
        download=lambda host, ptr: host.__setitem__(slice(None), source[:host.shape[0]])))

    def chunk(seq: int, n: int, keep: bool) -> SeqChunk:
        return SeqChunk(seq_id=seq, token_ids=np.arange(n) + 10 * seq, positions=np.zeros((3, n), np.int64),
                        start=4, block_table=np.arange(4, dtype=np.int32), state_slot=seq, keep_hidden=keep)

    batch = StepBatch([chunk(0, 3, True), chunk(1, 1, False), chunk(2, 1, True)])
    cu = np.array([0, 3, 4, 6, 7], np.int32)  # the step's run-chunk ends: 1 re-fed row at 4
    r.kept.keep_step(r.ctx, batch, cu, DArray(0, (7, h), "f32"), h, "f32", r._download)
    assert r.kept.by_seq[0].hidden.tolist() == source[0:3].tolist()
    assert r.kept.by_seq[2].hidden.tolist() == source[5:6].tolist() and 1 not in r.kept.by_seq

    runs: list[list[int]] = []

    class Head:
        def run(self, plan: DraftPlan, kv: Any, block_size: int) -> np.ndarray:
            t = plan.fill.tables
            seqs = [int(t.ids[t.cu[plan.drafting[p]]]) for p in range(len(plan.drafting))]  # next token = seq id
            runs.append(seqs)
            return np.array([[100 * s + j for s in seqs] for j in range(3)], np.int64)

    dummy = DArray(0, (1,), "f32")
    r.mtp, r.spec = Head(), CacheSpec(8, 4, 4)  # type: ignore[assignment]
    r.mtp_cache = MtpCache(AttentionCache(dummy, dummy), num_kv_blocks=8, per_request=1, requests=1)
    r.kept = KeptRows()
    reqs = []
    for seq, drafts in ((1, 3), (2, 0), (3, 2), (4, 3)):
        r.kept.by_seq[seq] = Kept(0, np.zeros((1, h), np.float32), np.array([seq]))
        reqs.append(MtpDraftRequest(seq_id=seq, start=0, next_tokens=np.array([seq]),
                                    positions=np.zeros((3, 3), np.int64), block_table=np.array([seq], np.int32),
                                    num_drafts=drafts))
    assert r.mtp_draft(reqs) == [[100, 101, 102], [], [300, 301], [400, 401, 402]]
    assert runs == [[1], [3], [4]]
