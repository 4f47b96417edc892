"""How big the engine's cache is: KV blocks and linear-attention state slots from EngineConfig's memory budget (or
its explicit block count) and what one block / slot costs on the runner; the longest sequence that then fits.
The BlockManager (cache.py) hands out what is sized here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine_config import DEFAULT_KV_CACHE_BYTES, EngineConfig, EngineConfigError
from .runner_api import CacheSpec

DEFAULT_MODEL_LEN = 32768  # sequence length a block count is sized for when no limit is known


@dataclass(frozen=True)
class CacheSizing:
    num_kv_blocks: int
    block_size: int
    num_state_slots: int
    kv_bytes_per_block: int  # on the runner, over all full-attention layers
    state_bytes_per_slot: int  # on the runner, over all linear-attention layers
    max_model_len: int  # prompt + output tokens one sequence may hold: the cache and every configured limit

    @property
    def cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block + self.num_state_slots * self.state_bytes_per_slot

    @property
    def spec(self) -> CacheSpec:
        return CacheSpec(num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
                         num_state_slots=self.num_state_slots)


def cache_budget(cfg: EngineConfig, runner: Any) -> tuple[int, str]:
    """The cache's byte budget and where it came from (quoted when it is too small): cfg.kv_cache_bytes; else the
    runner's own (a runner with `cache_budget(max_num_seqs, max_batched_tokens)`, e.g. CudaRunner: GPU memory left
    after the weights); else DEFAULT_KV_CACHE_BYTES (the numpy reference runner keeps that small default)."""
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes, f"kv_cache_bytes={cfg.kv_cache_bytes}"
    own = getattr(runner, "cache_budget", None)
    if own is not None:
        budget = own(cfg.max_num_seqs, cfg.max_batched_tokens)
        return int(budget.nbytes), f"{budget.explain} (set kv_cache_bytes to choose it yourself)"
    return DEFAULT_KV_CACHE_BYTES, f"the default kv_cache_bytes={DEFAULT_KV_CACHE_BYTES}"


def size_cache(cfg: EngineConfig, kv_bytes_per_block: int, state_bytes_per_slot: int,
               model_max_len: int | None = None, budget: tuple[int, str] | None = None) -> CacheSizing:
    """The state slots come off the budget first; the rest is KV blocks. `model_max_len`: the model's own context
    limit (max_position_embeddings), a cap on top of cfg.max_model_len. `budget`: (bytes, where they came from) as
    cache_budget returns it; None: cfg.cache_budget_bytes."""
    if budget is None:
        budget = (cfg.cache_budget_bytes, f"kv_cache_bytes={cfg.cache_budget_bytes}")
    nbytes, source = budget
    num_slots = cfg.state_slots
    limits = [x for x in (cfg.max_model_len, model_max_len) if x is not None]
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
    elif kv_bytes_per_block == 0:
        # No full-attention layers: blocks cost nothing, only bookkeeping; enough for every sequence at full length.
        num_blocks = cfg.max_num_seqs * -(-min(limits, default=DEFAULT_MODEL_LEN) // cfg.block_size)
    else:
        left = nbytes - num_slots * state_bytes_per_slot
        if left < kv_bytes_per_block:
            raise EngineConfigError(
                f"the cache budget of {nbytes} bytes ({source}) is too small: {num_slots} state slots take "
                f"{num_slots * state_bytes_per_slot} bytes and one KV block {kv_bytes_per_block} bytes; "
                "lower max_num_seqs / num_state_slots or give a larger kv_cache_bytes"
            )
        num_blocks = left // kv_bytes_per_block
    return CacheSizing(num_kv_blocks=num_blocks, block_size=cfg.block_size, num_state_slots=num_slots,
                       kv_bytes_per_block=kv_bytes_per_block, state_bytes_per_slot=state_bytes_per_slot,
                       max_model_len=min([num_blocks * cfg.block_size, *limits]))
