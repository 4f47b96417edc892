"""The prompt forms the engine accepts (chat messages, token ids, a ProcessedPrompt) -> one ProcessedPrompt."""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np

from .errors import RequestError
from .inputs import ProcessedPrompt, is_token_ids
from .params import RequestOutput, SamplingParams
from .rope_index import text_positions

Prompt = list[dict[str, Any]] | SequenceABC[int] | np.ndarray | ProcessedPrompt


def processed_prompt(prompt: Prompt,
                     prepare: Callable[[list[dict[str, Any]]], ProcessedPrompt] | None) -> ProcessedPrompt:
    """Messages go through `prepare` (the processor: chat template, media); token ids become a text prompt."""
    if isinstance(prompt, ProcessedPrompt):
        return prompt
    if is_token_ids(prompt):
        ids = np.asarray(prompt)
        if ids.ndim != 1:
            raise RequestError(f"token-id prompts must be a 1-D list of ints, got shape {ids.shape} {ids.dtype}")
        ids = ids.astype(np.int64)
        positions = text_positions(ids.size)
        return ProcessedPrompt(token_ids=ids, positions=positions, rope_delta=0, vision_items=[])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        if prepare is None:
            raise RequestError("this engine has no processor: pass token ids or a ProcessedPrompt")
        try:
            return prepare(prompt)
        except Exception as exc:  # the processor's own errors say what is wrong with the messages
            raise RequestError(f"cannot prepare the messages: {exc}") from exc
    raise RequestError(
        "prompt must be a non-empty list of chat messages (dicts), a non-empty list of token ids, "
        f"or a ProcessedPrompt; got {type(prompt).__name__}"
    )


def prompt_batch(prompts: SequenceABC[Prompt] | Prompt,
                 params: SamplingParams | SequenceABC[SamplingParams] | None) -> list[tuple[Prompt, SamplingParams]]:
    """Engine.generate's arguments as (prompt, params) pairs: one conversation / token-id prompt or a list of them,
    with one SamplingParams for all or one each."""
    if isinstance(prompts, ProcessedPrompt) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], dict)):
        prompts = [prompts]  # one chat conversation
    elif is_token_ids(prompts):
        prompts = [prompts]  # one token-id prompt
    batch: list[Prompt] = list(prompts)  # type: ignore[arg-type]  # narrowed above: a sequence of prompts
    if params is None or isinstance(params, SamplingParams):
        return [(p, params or SamplingParams()) for p in batch]
    plist = list(params)
    if len(plist) != len(batch):
        raise RequestError(f"{len(batch)} prompts but {len(plist)} SamplingParams")
    return list(zip(batch, plist))


def run_to_completion(step: Callable[[], list[RequestOutput]], ids: list[str]) -> list[RequestOutput]:
    """Engine.generate's loop: step until every request of `ids` has its final output; those, in `ids` order."""
    final: dict[str, RequestOutput] = {}
    wanted = set(ids)
    while wanted - final.keys():
        for out in step():
            if out.finished and out.request_id in wanted:
                final[out.request_id] = out
    return [final[r] for r in ids]
