"""Forced runs spread over steps (gpu_engine/forced_runs.py): with a runner that declares max_decode_chunk_tokens
= N, no decoding sequence's chunk is longer than N, the outputs equal those of the unsplit run token for token,
and prompt chunks are what they were. The reference runner, wrapped to declare the limit, computes both runs."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpu_engine.cuda.decode_graphs import GRAPH_MAX_CHUNK
from gpu_engine.cuda.runner import CudaRunner
from gpu_engine.cuda.text_model import FLASH_MIN_CHUNK
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.errors import RunnerInputError
from gpu_engine.forced_runs import decode_chunk, decode_chunk_limit
from gpu_engine.params import RequestOutput, SamplingParams
from gpu_engine.scheduler import SchedulerOutput
from gpu_engine.tiny import make_tiny_checkpoint

LIMIT = 3
# Long key names and enum values: after the first free character of a value the rest is forced, so the grammar
# forces runs of many tokens between a few sampled ones.
SCHEMA = {"type": "object", "properties": {
    "verdict_of_the_accounting_department": {"type": "string",
                                             "enum": ["approved-by-accounting-north", "rejected-for-missing-receipts"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "reviewer_signature_on_the_last_page": {"type": "boolean"}},
    "required": ["verdict_of_the_accounting_department", "n", "reviewer_signature_on_the_last_page"],
    "additionalProperties": False}
PROMPTS = [[5, 6, 7], list(range(10, 50)), [9, 8], list(range(100, 120))]  # two prompts longer than LIMIT * 5


class LimitedRunner:
    """The reference runner, declaring a decode chunk limit (everything else is the wrapped runner's)."""

    def __init__(self, inner: Any, limit: int) -> None:
        self._inner = inner
        self.max_decode_chunk_tokens = limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


Chunk = tuple[int, int, int, int]  # (request index, start, tokens, prompt length)


def run(engine: Engine, seed: int) -> tuple[list[RequestOutput], list[Chunk]]:
    """The batch's outputs and every chunk the scheduler handed out, by request."""
    chunks: list[Chunk] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        chunks.extend((int(sc.seq.request_id), sc.start, sc.num_tokens, sc.seq.prompt_len) for sc in out.chunks)
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]  # record, then schedule as before
    try:
        params = [SamplingParams(max_tokens=120, json_schema=SCHEMA, temperature=1.0, logprobs=True, seed=seed + i)
                  for i in range(len(PROMPTS))]
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            engine.add_request(prompt, p, request_id=str(i))
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return [done[str(i)] for i in range(len(PROMPTS))], chunks


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=29)


def engines(folder: Path) -> tuple[Engine, Engine]:
    config = EngineConfig(max_num_seqs=4)
    plain = Engine.from_pretrained(folder, config=config)
    base = Engine.from_pretrained(folder, config=config)
    limited = Engine(LimitedRunner(base.runner, LIMIT), base.tokenizer, vocab_size=base.vocab_size, config=config,
                     prepare=base._prepare, eos_token_ids=sorted(base.eos_token_ids))
    return plain, limited


@pytest.mark.parametrize("seed", [1, 7])
def test_split_runs_give_the_same_outputs_and_short_decode_chunks(folder: Path, seed: int) -> None:
    plain, limited = engines(folder)
    assert plain.scheduler.decode_chunk_limit is None and limited.scheduler.decode_chunk_limit == LIMIT
    want, plain_chunks = run(plain, seed)
    got, split_chunks = run(limited, seed)

    decoding = [c for c in plain_chunks if c[1] >= c[3]]
    assert max(n for _, _, n, _ in decoding) > 2 * LIMIT  # the unsplit run did send long forced runs whole
    assert all(n <= LIMIT for _, start, n, prompt_len in split_chunks if start >= prompt_len)
    assert len(split_chunks) > len(plain_chunks)  # so they were computed over more steps
    cut = sum(1 for _, start, n, prompt_len in split_chunks if start >= prompt_len and n == LIMIT)
    assert 0 < limited.scheduler.num_cut_runs <= cut and plain.scheduler.num_cut_runs == 0

    for w, g in zip(want, got, strict=True):
        assert g.finish_reason == w.finish_reason == "stop"
        assert g.token_ids == w.token_ids and g.text == w.text
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-5)
    assert limited.stats()["forced_tokens"] == plain.stats()["forced_tokens"] > 0

    # Prompt chunks (with the forced tokens prefilled beside a prompt) are the same chunks in both runs.
    def prompt_chunks(chunks: list[Chunk]) -> list[Chunk]:
        return sorted(c for c in chunks if c[1] < c[3])
    assert prompt_chunks(split_chunks) == prompt_chunks(plain_chunks)
    assert any(n > LIMIT for _, _, n, _ in prompt_chunks(split_chunks))  # a prompt longer than the limit, whole


def test_a_verify_window_is_not_cut_and_no_limit_leaves_chunks_whole() -> None:
    window, run_ = SimpleNamespace(num_drafts=4), SimpleNamespace(num_drafts=0)
    assert decode_chunk(window, 9, 3) == 9  # type: ignore[arg-type]  # drafts: verified as one window
    assert decode_chunk(run_, 9, 3) == 3 and decode_chunk(run_, 2, 3) == 2  # type: ignore[arg-type]
    assert decode_chunk(run_, 9, None) == 9  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "31"])
def test_a_bad_declared_limit_is_refused_by_name(bad: object) -> None:
    with pytest.raises(RunnerInputError, match="max_decode_chunk_tokens"):
        decode_chunk_limit(SimpleNamespace(name="x", max_decode_chunk_tokens=bad))


def test_the_cuda_runner_declares_its_graph_limit_below_the_prefill_kernels() -> None:
    assert CudaRunner.max_decode_chunk_tokens == GRAPH_MAX_CHUNK < FLASH_MIN_CHUNK
    assert decode_chunk_limit(SimpleNamespace(name="reference")) is None
