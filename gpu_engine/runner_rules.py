"""The rules every runner applies the same way: cache-spec and slot checks, step-batch validation, the bytes a
cache block / state slot costs, and the logits-row layout of a step's output. Each runner calls these instead of
keeping its own copy, so that every backend refuses the same bad inputs with the same words."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .config import TextConfig
from .errors import RunnerInputError
from .runner_api import CacheSpec, SeqChunk


def check_cache_spec(spec: CacheSpec) -> None:
    if spec.num_kv_blocks < 1 or spec.block_size < 1 or spec.num_state_slots < 1:
        raise RunnerInputError(f"cache spec needs positive sizes, got {spec}")


def allocated(spec: CacheSpec | None) -> CacheSpec:
    """The runner's cache spec; running the model before allocate_cache() is a caller's mistake."""
    if spec is None:
        raise RuntimeError("allocate_cache() must be called before running the model")
    return spec


def slot_problem(spec: CacheSpec, slot: int) -> str | None:
    """The one state-slot range rule: what is wrong with `slot` for cache `spec`, or None."""
    if not 0 <= slot < spec.num_state_slots:
        return f"state slot {slot} out of range [0, {spec.num_state_slots})"
    return None


def check_state_slots(spec: CacheSpec, *slots: int) -> None:
    for slot in slots:
        if problem := slot_problem(spec, slot):
            raise RunnerInputError(problem)


def kv_bytes_per_block(cfg: TextConfig, block_size: int, itemsize: int) -> int:
    """One KV block (keys and values of `block_size` tokens) over all full-attention layers."""
    return len(cfg.full_attention_layers) * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


def state_bytes_per_slot(cfg: TextConfig, conv_itemsize: int, state_itemsize: int) -> int:
    """One linear-attention slot (conv window + recurrent state) over all linear-attention layers."""
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * conv_itemsize
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_itemsize
    return len(cfg.linear_attention_layers) * (conv + state)


def row_offsets(chunks: Sequence[SeqChunk]) -> list[int]:
    """StepOutput.row_offsets: 0 logits rows for logits="none", 1 for "last", n for "all", in chunk order."""
    offsets = [0]
    for chunk in chunks:
        offsets.append(offsets[-1] + {"none": 0, "last": 1, "all": chunk.num_tokens}[chunk.logits])
    return offsets


def check_chunk(chunk: SeqChunk, spec: CacheSpec, cfg: TextConfig) -> None:
    problem = chunk_problem(chunk, spec, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                            paged_kv=bool(cfg.full_attention_layers))
    if problem:
        raise RunnerInputError(problem)


def chunk_problem(chunk: SeqChunk, spec: CacheSpec, *, vocab_size: int, hidden_size: int, paged_kv: bool) -> str | None:
    """What makes `chunk` unusable for a runner with cache `spec` and this model, or None when it is well formed.

    `paged_kv`: the model has full-attention layers, so the block table must cover the chunk.
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
    if slot := slot_problem(spec, chunk.state_slot):
        return f"{where}: {slot}"
    if chunk.logits not in ("none", "last", "all"):
        return f"{where}: logits must be 'none', 'last' or 'all', got {chunk.logits!r}"
    for piece in chunk.vision:
        shape = np.shape(piece.embeddings)
        if len(shape) != 2 or shape[1] != hidden_size:
            return f"{where}: vision embeddings must be [n, {hidden_size}], got {tuple(shape)}"
        if piece.chunk_offset < 0 or piece.chunk_offset + shape[0] > n:
            return (f"{where}: vision rows [{piece.chunk_offset}, {piece.chunk_offset + shape[0]}) fall outside "
                    f"the chunk of {n}")
    return None
