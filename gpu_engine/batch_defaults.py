"""The batch sizes an engine gets when EngineConfig leaves them AUTO (0, the default): small on a runner that
cannot size its own cache (the numpy reference), sized from the cache the runner can hold (the CUDA runner).

The rule, for a runner with `cache_budget(max_num_seqs, max_batched_tokens)`:
- max_batched_tokens: SIZED_MAX_BATCHED_TOKENS (8192): prompt chunks large enough to keep the GEMMs on the tensor
  cores, the step activations they need are already part of the runner's reserve;
- max_num_seqs: the largest power of two up to MAX_SIZED_NUM_SEQS (256) whose linear-attention state slots
  (the running ones plus the prefix-snapshot slots EngineConfig.state_slots adds) and SEQ_KV_TOKENS (2048) tokens
  of KV per sequence fit the cache budget (kv_cache_bytes when given, else the runner's own for that batch size).
On the H200 this gives 256 for the 0.8B-9B shapes and 128 for 27B (state 147 MiB a slot), the sizes measured best
there (bench/results/cuda_notes.md, session 6); a smaller card or a larger model gets less, never a cache too
small to start. An explicit max_num_seqs / max_batched_tokens is always kept as given.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .engine_config import AUTO, DEFAULT_MAX_SNAPSHOT_SLOTS, EngineConfig

REFERENCE_MAX_NUM_SEQS = 32
REFERENCE_MAX_BATCHED_TOKENS = 2048
SIZED_MAX_BATCHED_TOKENS = 8192
MAX_SIZED_NUM_SEQS = 256
SEQ_KV_TOKENS = 2048  # KV tokens each sequence of a full batch must find on average (a page prompt is ~2-5k)


def sized_max_num_seqs(fits: Any, cap: int = MAX_SIZED_NUM_SEQS) -> int:
    """Largest power of two n <= cap with fits(n) true, 1 if none: `fits(n)` says whether n sequences fit."""
    n = 1 << (max(1, cap).bit_length() - 1)
    while n > 1 and not fits(n):
        n //= 2
    return n


def cache_need_bytes(cfg: EngineConfig, n: int, kv_bytes_per_token: float, state_bytes_per_slot: int) -> int:
    """Bytes n running sequences need: their state slots (and the snapshot slots that come with them) plus
    SEQ_KV_TOKENS of KV each."""
    if cfg.num_state_slots is not None:
        slots = cfg.num_state_slots
    else:
        slots = n + min(n, DEFAULT_MAX_SNAPSHOT_SLOTS)  # EngineConfig.state_slots at max_num_seqs=n
    return int(slots * state_bytes_per_slot + n * SEQ_KV_TOKENS * kv_bytes_per_token)


def resolve_batching(cfg: EngineConfig, runner: Any) -> EngineConfig:
    """`cfg` with max_num_seqs and max_batched_tokens filled in for this runner (module docstring)."""
    if AUTO not in (cfg.max_num_seqs, cfg.max_batched_tokens):
        return cfg
    own = getattr(runner, "cache_budget", None)
    if own is None:
        seqs = cfg.max_num_seqs or min(REFERENCE_MAX_NUM_SEQS, cfg.max_batched_tokens or REFERENCE_MAX_NUM_SEQS)
        tokens = cfg.max_batched_tokens or max(REFERENCE_MAX_BATCHED_TOKENS, seqs)
        return dataclasses.replace(cfg, max_num_seqs=seqs, max_batched_tokens=tokens)
    tokens = cfg.max_batched_tokens or SIZED_MAX_BATCHED_TOKENS
    seqs = cfg.max_num_seqs
    if seqs == AUTO:
        per_token = int(runner.kv_bytes_per_block(block_size=cfg.block_size)) / cfg.block_size
        state = int(runner.state_bytes_per_slot())

        def fits(n: int) -> bool:
            budget = cfg.kv_cache_bytes if cfg.kv_cache_bytes is not None else int(own(n, max(tokens, n)).nbytes)
            return cache_need_bytes(cfg, n, per_token, state) <= budget

        cap = min(MAX_SIZED_NUM_SEQS, tokens, cfg.num_state_slots or MAX_SIZED_NUM_SEQS)
        seqs = sized_max_num_seqs(fits, cap)
    return dataclasses.replace(cfg, max_num_seqs=seqs, max_batched_tokens=max(tokens, seqs))
