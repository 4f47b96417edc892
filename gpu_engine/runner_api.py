"""The runner contract: the one boundary between the host-side engine and any compute backend.

The engine (scheduler + cache manager) decides *what* runs each step; a runner (numpy `reference`, `cuda`)
computes it. Runners own the physical cache storage; the engine owns the bookkeeping (which block / slot
belongs to which sequence).

Sampling on the runner (optional capability): a runner with `samples_on_device = True` accepts a SamplingRequest
on the StepBatch and then returns the sampled tokens (StepOutput.sampled) instead of logit rows, so that only
token ids (+ logprobs) cross to the host. The engine sends one only when every row of the step can be sampled
there (no repetition / presence penalties); it draws each row's uniform from the request's own Generator and
computes the grammar bitmask itself, so results equal the host sampler's (gpu_engine/sampling.py) up to float
rounding at a CDF / top-p boundary.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from .inputs import VisionItem
from .sampling import Drawn, SampleResult, SamplingRows, apply_bitmask_rows, sample

LogitsWanted = Literal["none", "last", "all"]


@dataclass(frozen=True)
class CacheSpec:
    """Physical cache layout the engine asks a runner to allocate once at start-up."""

    num_kv_blocks: int  # paged KV blocks, shared by all full-attention layers (one block id = same slot in every layer)
    block_size: int  # tokens per KV block
    num_state_slots: int  # linear-attention (conv + recurrent) state slots; one per live sequence + snapshots


@dataclass
class VisionSlice:
    """Vision embeddings that replace the token embeddings of rows [chunk_offset, chunk_offset + n) of a chunk."""

    chunk_offset: int
    embeddings: Any  # runner-native float array [n, text_hidden] (np.ndarray for the reference runner)


@dataclass
class SeqChunk:
    """One sequence's share of a step: a prefill chunk (n >= 1 tokens) or a decode token (n == 1)."""

    seq_id: int
    token_ids: np.ndarray  # int64 [n]; vision placeholder ids where `vision` supplies embeddings
    positions: np.ndarray  # int64 [3, n] M-RoPE positions of these tokens
    start: int  # tokens of this sequence already in the cache; start == 0 means "fresh: zero the state slot"
    block_table: np.ndarray  # int32 [ceil((start + n) / block_size)] physical KV block ids, in order
    state_slot: int  # linear-attention state slot of this sequence
    vision: list[VisionSlice] = field(default_factory=list)
    logits: LogitsWanted = "last"
    # Speculative decoding (runners with supports_verify): a verify window — the last real token then drafts. The
    # runner keeps the linear-attention state after each of its tokens until the slot's next forward, so that
    # rollback_state() can return the slot to the last accepted token.
    verify: bool = False
    keep_hidden: bool = False  # keep these rows' final-norm hidden states for mtp_draft() (runners with mtp_head)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


MAX_SAMPLED_TOP_LOGPROBS = 20  # top-n logprobs a runner must support when it samples (EngineConfig.max_logprobs)


@dataclass
class SamplingRequest:
    """Sample every logits row of the step on the runner (StepBatch.sampling). Arrays have one entry per row, in
    row order (the same rows StepOutput.row_offsets describes). The runner samples the processed logits: its own
    logits with the row's grammar bitmask applied; it never applies penalties (the engine keeps such rows on the
    host). Semantics are those of gpu_engine.sampling.sample, with `uniform[r]` as the row's one random draw."""

    temperature: np.ndarray  # float32 [R], 0 = greedy
    top_k: np.ndarray  # int64 [R], 0 = off
    top_p: np.ndarray  # float32 [R], 1 = off
    min_p: np.ndarray  # float32 [R], 0 = off
    uniform: np.ndarray  # float64 [R] in [0, 1): the draw of the request's own Generator (unused on greedy rows)
    num_logprobs: np.ndarray  # int64 [R]: -1 none, 0 the chosen token's, n <= MAX_SAMPLED_TOP_LOGPROBS also top-n
    bitmask: np.ndarray | None = None  # int32 [M, ceil(V/32)] llguidance bitmasks (bit set = allowed)
    mask_index: np.ndarray | None = None  # int64 [R]: row of `bitmask` that constrains this row, -1 = none

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    def select(self, rows: list[int]) -> SamplingRequest:
        """The request for a subset of the rows (in that order), e.g. to re-run part of a step."""
        idx = np.asarray(rows, np.int64)
        return SamplingRequest(
            temperature=self.temperature[idx], top_k=self.top_k[idx], top_p=self.top_p[idx], min_p=self.min_p[idx],
            uniform=self.uniform[idx], num_logprobs=self.num_logprobs[idx], bitmask=self.bitmask,
            mask_index=None if self.mask_index is None else self.mask_index[idx],
        )

    def problem(self, rows: int, vocab: int) -> str | None:
        """What makes this request unusable for a step with `rows` logits rows, or None."""
        r = self.num_rows
        if r != rows:
            return f"sampling request has {r} rows, the step has {rows} logits rows"
        for name in ("top_k", "top_p", "min_p", "uniform", "num_logprobs"):
            if np.shape(getattr(self, name)) != (r,):
                return f"sampling request: {name} must have shape ({r},)"
        if np.any(self.temperature < 0) or np.any(self.top_k < 0):
            return "sampling request: temperature and top_k must be >= 0"
        if np.any(~((self.top_p > 0) & (self.top_p <= 1))) or np.any(~((self.min_p >= 0) & (self.min_p < 1))):
            return "sampling request: top_p must be in (0, 1] and min_p in [0, 1)"
        if np.any(~((self.uniform >= 0) & (self.uniform < 1))):
            return "sampling request: uniform draws must be in [0, 1)"
        if np.any(self.num_logprobs < -1) or np.any(self.num_logprobs > MAX_SAMPLED_TOP_LOGPROBS):
            return f"sampling request: num_logprobs must be in [-1, {MAX_SAMPLED_TOP_LOGPROBS}]"
        if (self.bitmask is None) != (self.mask_index is None):
            return "sampling request: bitmask and mask_index come together"
        if self.bitmask is not None and self.mask_index is not None:
            words = -(-vocab // 32)
            if self.bitmask.ndim != 2 or self.bitmask.shape[1] != words:
                return f"sampling request: bitmask must be [masks, {words}], got {self.bitmask.shape}"
            if self.mask_index.shape != (r,) or np.any(self.mask_index < -1) or np.any(
                    self.mask_index >= self.bitmask.shape[0]):
                return f"sampling request: mask_index must be in [-1, {self.bitmask.shape[0]})"
        return None


def sample_on_host(logits: np.ndarray, request: SamplingRequest) -> SampleResult:
    """A SamplingRequest carried out with the numpy sampler: what a runner that samples must return (the
    reference runner uses it; on other runners it is the oracle). `logits` float32 [R, V] are not modified."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if request.bitmask is not None and request.mask_index is not None:
        rows = np.nonzero(request.mask_index >= 0)[0]
        if len(rows):
            apply_bitmask_rows(x, rows, request.bitmask[request.mask_index[rows]])
    n = request.num_rows
    rows_table = SamplingRows(
        temperature=request.temperature.astype(np.float32), top_k=request.top_k.astype(np.int64),
        top_p=request.top_p.astype(np.float32), min_p=request.min_p.astype(np.float32),
        repetition_penalty=np.ones(n, np.float32), presence_penalty=np.zeros(n, np.float32),
        num_logprobs=request.num_logprobs.astype(np.int64),
    )
    return sample(x, rows_table, [Drawn(float(u)) for u in request.uniform])


def fed_chunks(chunks: list[SeqChunk], feed: np.ndarray | None, tokens: np.ndarray | None) -> list[SeqChunk]:
    """A lookahead launch's chunks with each fed chunk's one token set to tokens[feed[i]] (runner_api: launch)."""
    if feed is None:
        return chunks
    if tokens is None or len(feed) != len(chunks):
        raise ValueError("feed needs the previous step's tokens and one entry per chunk")
    out = list(chunks)
    for i in np.nonzero(np.asarray(feed) >= 0)[0]:
        chunk = chunks[i]
        if chunk.num_tokens != 1:
            raise ValueError(f"chunk {i} is fed a token but has {chunk.num_tokens}")
        out[i] = dataclasses.replace(chunk, token_ids=np.array([int(tokens[feed[i]])], np.int64))
    return out


@dataclass
class MtpDraftRequest:
    """Run the checkpoint's MTP head for one sequence after a step (runners with `mtp_head`): positions
    [start, start + n) of the sequence's last forward (keep_hidden) are final; `next_tokens` [n] are the tokens at
    start + 1 ... start + n. The head writes its own KV for those positions (the same block ids), then chains
    `num_drafts` greedy drafts from the last one (0: only fill its KV, e.g. after a prompt chunk). `start` may be
    the chunk's start - 1: the last position of the slot's previous keep_hidden chunk, left for this step (a prompt
    chunk's next token may be an image row only the next chunk has)."""

    seq_id: int
    start: int
    next_tokens: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [3, n + num_drafts]: M-RoPE positions of start ... start + n + num_drafts - 1
    block_table: np.ndarray  # int32, covering start + n tokens
    num_drafts: int


@dataclass
class StepBatch:
    chunks: list[SeqChunk]
    sampling: SamplingRequest | None = None  # only for runners with samples_on_device = True


@dataclass
class StepOutput:
    """Logit rows in chunk order: 0 rows for logits="none", 1 for "last", n for "all".

    When the batch carried a SamplingRequest, `sampled` holds the sampled rows instead (row_offsets index them)
    and `logits` has no rows."""

    logits: np.ndarray  # float32 [rows, vocab] on the host
    row_offsets: list[int]  # row_offsets[i] = first row of chunk i; row_offsets[-1] == rows (len == chunks + 1)
    hidden: np.ndarray | None = None  # final-norm hidden states of the same rows, when the runner was asked for them
    sampled: SampleResult | None = None  # token ids, chosen logprobs, top-n logprobs per row


class Runner(Protocol):
    """Every runner implements exactly this."""

    name: str
    # Optional attribute `samples_on_device: bool`: True when forward() honours StepBatch.sampling (the engine reads
    # it with getattr(runner, "samples_on_device", False) every step, so it can be switched at run time).
    # Optional speculative-decoding capabilities (read with getattr, default False; gpu_engine/speculative/):
    # `supports_verify: bool` — forward() honours SeqChunk.verify and the runner has
    #     rollback_state(state_slot: int, keep_tokens: int) -> None: the slot's linear-attention state becomes the
    #     one after the first `keep_tokens` tokens of its last verify window (called before the slot's next forward;
    #     KV needs no rollback: rejected positions are rewritten before they are ever read); optionally
    #     verify_room() -> int: windows the next step can roll back (the speculator drafts for no more sequences),
    #     max_verify_drafts: int | None, the most drafts one window may carry, and spec_max_step_tokens: int, a
    #     tighter cost rule for `auto` than SpeculativeConfig.max_step_tokens (decode rows + drafts a step);
    # `mtp_head: bool` — forward() honours SeqChunk.keep_hidden and the runner has
    #     mtp_draft(requests: list[MtpDraftRequest]) -> list[list[int]]: one list of greedy drafts per request;
    #     optionally mtp_in_auto: bool (default True) — False keeps the head for speculative="mtp" requests only;
    # Optional attribute `max_decode_chunk_tokens: int` (read once, at engine construction; absent / None = no
    # limit): the longest chunk of a decoding sequence the engine sends; longer grammar-forced runs are computed
    # over several steps (gpu_engine/forced_runs.py). Prompt chunks and verify windows are not cut by it.
    # Optional `supports_lookahead: bool` (with samples_on_device; gpu_engine/lookahead.py) — the runner has
    #     launch(batch, previous: SamplingRequest | None, feed: np.ndarray | None) -> SampleResult | None: samples
    #     the step launched before (if any: `previous` is its request, the tokens are returned), then enqueues
    #     `batch`'s forward and keeps its logits rows (batch.sampling is ignored); feed[i] >= 0 makes chunk i's
    #     single token the token just sampled in row feed[i] (fed_chunks); and
    #     finish(request: SamplingRequest) -> SampleResult: samples the launched step, leaving none launched.
    #     A runner that raises in either leaves no step launched.
    # Optional `batches_vision: bool` with encode_vision_batch(items) -> list of embeddings: items of one grid
    #     (1, h, w) encoded in one tower call (gpu_engine/vision_batch.py), used by the encoder cache's prefetch.

    def allocate_cache(self, spec: CacheSpec) -> None:
        """Take the cache memory once; later forwards index into it."""

    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        """Bytes one KV block of `block_size` tokens (default: the allocated one) costs across all full-attention
        layers; asked before allocation, so the engine can size the cache from a memory budget."""

    def state_bytes_per_slot(self) -> int:
        """Bytes one linear-attention state slot costs across all linear-attention layers."""

    def forward(self, batch: StepBatch) -> StepOutput:
        """Run one step for a batch of sequences, each with its own chunk and cache."""

    def encode_vision(self, item: VisionItem) -> Any:
        """Vision tower for one item -> [item.num_tokens, text_hidden] embeddings (runner-native array)."""

    def copy_state_slot(self, src: int, dst: int) -> None:
        """Copy linear-attention conv + recurrent state (prefix-cache snapshots and restores)."""

    def embedding_nbytes(self, item: VisionItem) -> int:
        """Bytes the encoded embeddings of `item` occupy (for the encoder-cache budget)."""
