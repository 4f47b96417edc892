"""Run an engine's requests to the end (the loop many engine tests share)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu_engine.engine import Engine
from gpu_engine.params import SamplingParams


def run_prompts(eng: Engine, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams]
                ) -> dict[str, list[int]]:
    """Every prompt as request r0, r1, ... with its params (one SamplingParams: the same for all), stepped until
    none is unfinished: the final token ids by request id."""
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    for i, (prompt, p) in enumerate(zip(prompts, each)):
        eng.add_request(prompt, p, request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done
