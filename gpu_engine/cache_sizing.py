"""How big the engine's cache is: KV blocks and linear-attention state slots from EngineConfig's memory budget (or
its explicit block count) and what one block / slot costs on the runner; the longest sequence that then fits.
The BlockManager (cache.py) hands out what is sized here."""
from __future__ import annotations

from dataclasses import dataclass

from .engine_config import EngineConfig, EngineConfigError
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


def size_cache(cfg: EngineConfig, kv_bytes_per_block: int, state_bytes_per_slot: int,
               model_max_len: int | None = None) -> CacheSizing:
    """The state slots come off the budget first; the rest is KV blocks. `model_max_len`: the model's own context
    limit (max_position_embeddings), a cap on top of cfg.max_model_len."""
    num_slots = cfg.state_slots
    limits = [x for x in (cfg.max_model_len, model_max_len) if x is not None]
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
    elif kv_bytes_per_block == 0:
        # No full-attention layers: blocks cost nothing, only bookkeeping; enough for every sequence at full length.
        num_blocks = cfg.max_num_seqs * -(-min(limits, default=DEFAULT_MODEL_LEN) // cfg.block_size)
    else:
        left = cfg.cache_budget_bytes - num_slots * state_bytes_per_slot
        if left < kv_bytes_per_block:
            raise EngineConfigError(
                f"kv_cache_bytes={cfg.cache_budget_bytes} is too small: {num_slots} state slots take "
                f"{num_slots * state_bytes_per_slot} bytes and one KV block {kv_bytes_per_block} bytes"
            )
        num_blocks = left // kv_bytes_per_block
    return CacheSizing(num_kv_blocks=num_blocks, block_size=cfg.block_size, num_state_slots=num_slots,
                       kv_bytes_per_block=kv_bytes_per_block, state_bytes_per_slot=state_bytes_per_slot,
                       max_model_len=min([num_blocks * cfg.block_size, *limits]))
