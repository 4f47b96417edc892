"""EngineConfig: the knobs that bound the engine's memory and batching, checked once at construction.

Memory is bounded by configuration, never by luck: the KV cache and the linear-attention state slots are sized
from `kv_cache_bytes` (or an explicit `num_kv_blocks`), vision embeddings from `encoder_cache_bytes`, and a
step never holds more than `max_batched_tokens` tokens for `max_num_seqs` sequences. Left unset, the two byte
budgets come from the runner (cache_sizing.cache_budget, encoder_cache.default_encoder_budget): on the CUDA runner
the GPU memory left after the weights and its on-device encoder region; elsewhere the small defaults below.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import EngineError

DEFAULT_KV_CACHE_BYTES = 256 * 1024**2  # runners that do not size a cache themselves (the numpy reference)
# Prefix-cache snapshot slots by default: max_num_seqs of them up to this many. Each costs a whole linear-attention
# state (9B: 49 MiB, 27B: 147 MiB), and a few dozen shared prefixes cover the common case; at max_num_seqs 256 the
# old "as many as running sequences" took 12-37 GiB from the KV blocks.
DEFAULT_MAX_SNAPSHOT_SLOTS = 32
AUTO = 0  # max_num_seqs / max_batched_tokens: the runner's default (batch_defaults.resolve_batching)


class EngineConfigError(EngineError, ValueError):
    """An EngineConfig value is out of range or inconsistent with another one."""


@dataclass(frozen=True)
class EngineConfig:
    # Sequences running at once (each holds one linear-attention state slot) and tokens per forward step (decode
    # tokens + prefill chunks together). AUTO (0) -> the runner's default, filled in when the engine is built
    # (batch_defaults.resolve_batching): 32 / 2048 on the reference runner, sized from the cache on the CUDA runner.
    max_num_seqs: int = AUTO
    max_batched_tokens: int = AUTO
    block_size: int = 16  # tokens per paged KV block (also the prefix-cache granularity)
    # Cache memory: a byte budget (KV blocks + state slots are carved from it) or an explicit block count;
    # at most one of the two; neither -> the runner's own budget (CudaRunner.cache_budget: free memory after the
    # weights) or, for runners without one, DEFAULT_KV_CACHE_BYTES.
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    # Linear-attention state slots: one per running sequence, the rest hold prefix-cache snapshots.
    # None -> max_num_seqs + min(max_num_seqs, DEFAULT_MAX_SNAPSHOT_SLOTS).
    num_state_slots: int | None = None
    # Vision embeddings kept between chunks / requests (hard cap); None -> encoder_cache.default_encoder_budget.
    encoder_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_jump_forward: bool = True  # feed grammar-forced token runs into the next forward as one chunk
    # Launch the next decode step before taking in the tokens of the one in flight (gpu_engine/lookahead.py), on
    # runners that support it (the cuda runner): the host's per-token work then overlaps the GPU's forward.
    lookahead: bool = True
    max_model_len: int | None = None  # prompt + generated tokens; None -> what the KV cache can hold
    max_logprobs: int = 20  # largest SamplingParams.top_logprobs accepted
    json_whitespace_flexible: bool = False  # compact JSON (no free whitespace) keeps outputs short and finite
    seed: int = 0  # seeds requests that give no seed of their own (reproducible runs of the whole engine)
    # Prompt chunks held back (0: never): a step that has decode rows carries prompt chunks only once at least
    # this many prompt tokens are ready (running prompts' rest + waiting prompts that have a free slot), or after
    # max_prefill_hold_steps steps held in a row. Each step pays the weight reads and, on the CUDA runner, an eager
    # launch sequence when it carries prompt work (decode-only steps replay graphs): fewer, fuller prompt steps.
    min_prefill_tokens: int = 0
    max_prefill_hold_steps: int = 4

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"{name} must be a positive int, got {value!r}")

        positive("block_size")
        for name in ("max_num_seqs", "max_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise EngineConfigError(f"{name} must be a positive int or 0 (the runner's default), got {value!r}")
        if self.encoder_cache_bytes is not None:
            positive("encoder_cache_bytes")
        if self.kv_cache_bytes is not None and self.num_kv_blocks is not None:
            raise EngineConfigError(
                "give at most one of kv_cache_bytes and num_kv_blocks "
                f"(got kv_cache_bytes={self.kv_cache_bytes!r}, num_kv_blocks={self.num_kv_blocks!r})"
            )
        if self.kv_cache_bytes is not None:
            positive("kv_cache_bytes")
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
        # Every running sequence must be able to advance by at least one token per step.
        if AUTO not in (self.max_batched_tokens, self.max_num_seqs) and self.max_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.num_state_slots is not None and self.num_state_slots < self.max_num_seqs:  # AUTO passes
            raise EngineConfigError(
                f"num_state_slots ({self.num_state_slots}) must be >= max_num_seqs ({self.max_num_seqs}): "
                "every running sequence holds one"
            )
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.min_prefill_tokens < 0 or self.max_prefill_hold_steps < 0:
            raise EngineConfigError(
                f"min_prefill_tokens and max_prefill_hold_steps must be >= 0, got {self.min_prefill_tokens} and "
                f"{self.max_prefill_hold_steps}"
            )
        if self.max_logprobs < 0:
            raise EngineConfigError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    @property
    def cache_budget_bytes(self) -> int:
        return self.kv_cache_bytes if self.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES

    @property
    def state_slots(self) -> int:
        if self.num_state_slots is not None:
            return self.num_state_slots
        if self.max_num_seqs == AUTO:
            raise EngineConfigError("max_num_seqs is AUTO: the engine fills it in (batch_defaults.resolve_batching)")
        return self.max_num_seqs + min(self.max_num_seqs, DEFAULT_MAX_SNAPSHOT_SLOTS)
