"""The runner contract: the one boundary between the host-side engine and any compute backend.

The engine (scheduler + cache manager) decides *what* runs each step; a runner (numpy `reference`, `cuda`)
computes it. Runners own the physical cache storage; the engine owns the bookkeeping (which block / slot
belongs to which sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from .inputs import VisionItem

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

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class StepBatch:
    chunks: list[SeqChunk]


@dataclass
class StepOutput:
    """Logit rows in chunk order: 0 rows for logits="none", 1 for "last", n for "all"."""

    logits: np.ndarray  # float32 [rows, vocab] on the host
    row_offsets: list[int]  # row_offsets[i] = first row of chunk i; row_offsets[-1] == rows (len == chunks + 1)
    hidden: np.ndarray | None = None  # final-norm hidden states of the same rows, when the runner was asked for them


class Runner(Protocol):
    """Every runner implements exactly this."""

    name: str

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


def chunk_problem(chunk: SeqChunk, spec: CacheSpec, *, vocab_size: int, hidden_size: int, paged_kv: bool) -> str | None:
    """What makes `chunk` unusable for a runner with cache `spec` and this model, or None when it is well formed.

    Shared by the runners so that every backend refuses the same bad inputs with the same words (each raises it as
    its own error type). `paged_kv`: the model has full-attention layers, so the block table must cover the chunk.
    Vision embeddings are checked by shape only (`.shape`: host arrays and device buffers alike)."""
    n = chunk.num_tokens
    where = f"sequence {chunk.seq_id}"
    if n < 1:
        return f"{where}: a chunk needs at least one token"
    if chunk.token_ids.min() < 0 or chunk.token_ids.max() >= vocab_size:
        return f"{where}: token ids must be in [0, {vocab_size})"
    if chunk.positions.shape != (3, n):
        return f"{where}: positions must have shape (3, {n}), got {chunk.positions.shape}"
    if chunk.start < 0:
        return f"{where}: start must be >= 0, got {chunk.start}"
    if paged_kv:
        needed = -(-(chunk.start + n) // spec.block_size)
        table = np.asarray(chunk.block_table)
        if table.shape[0] < needed:
            return f"{where}: block table has {table.shape[0]} blocks, needs {needed}"
        if table[:needed].min() < 0 or table[:needed].max() >= spec.num_kv_blocks:
            return f"{where}: block ids must be in [0, {spec.num_kv_blocks})"
    if not 0 <= chunk.state_slot < spec.num_state_slots:
        return f"{where}: state slot {chunk.state_slot} out of range [0, {spec.num_state_slots})"
    if chunk.logits not in ("none", "last", "all"):
        return f"{where}: logits must be 'none', 'last' or 'all', got {chunk.logits!r}"
    for piece in chunk.vision:
        shape = np.shape(piece.embeddings)
        if len(shape) != 2 or shape[1] != hidden_size:
            return f"{where}: vision embeddings must be [n, {hidden_size}], got {tuple(shape)}"
        if piece.chunk_offset < 0 or piece.chunk_offset + shape[0] > n:
            return f"{where}: vision rows [{piece.chunk_offset}, {piece.chunk_offset + shape[0]}) fall outside the chunk of {n}"
    return None
