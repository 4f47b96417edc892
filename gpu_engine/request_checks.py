"""The checks a request must pass before the engine queues it (each failure a RequestError a person can act on):
token ids and positions, the length limit, logprobs, stop conditions, timeout, and vision items that fit."""
from __future__ import annotations

from collections.abc import Callable

from .errors import RequestError
from .inputs import ProcessedPrompt, VisionItem
from .params import SamplingParams


def check_request(prompt: ProcessedPrompt, params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  max_logprobs: int, encoder_cache_bytes: int, item_bytes: Callable[[VisionItem], int]) -> None:
    """`item_bytes`: what one vision item's embeddings take in the encoder cache (EncoderCache.item_bytes)."""
    n = len(prompt)
    if n == 0:
        raise RequestError("the prompt is empty")
    ids = prompt.token_ids
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})")
    if prompt.positions.shape != (3, n):
        raise RequestError(f"prompt positions must have shape (3, {n}), got {prompt.positions.shape}")
    if n + params.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds this engine's limit of "
            f"{max_model_len} tokens (KV cache capacity / max_model_len); lower max_tokens or shorten the prompt"
        )
    if params.top_logprobs > max_logprobs:
        raise RequestError(f"top_logprobs={params.top_logprobs} exceeds max_logprobs={max_logprobs}")
    if isinstance(params.stop, str) or isinstance(params.stop_token_ids, int):
        raise RequestError("stop must be a list of strings and stop_token_ids a list of ints")
    bad = [t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise RequestError("stop strings must be non-empty strings")
    if params.timeout_s is not None and params.timeout_s <= 0:
        raise RequestError(f"timeout_s must be > 0, got {params.timeout_s}")
    end = 0
    for item in prompt.vision_items:
        if item.token_start < end or item.token_end > n:
            raise RequestError("vision items must be ordered, non-overlapping and inside the prompt")
        end = item.token_end
        size = item_bytes(item)
        if size > encoder_cache_bytes:
            raise RequestError(
                f"a {item.kind} item needs {size} bytes of embeddings, more than encoder_cache_bytes="
                f"{encoder_cache_bytes}; raise the budget or send smaller images / fewer frames per group"
            )
