"""What became of each request of one bench/doc_throughput.py mode: submitted all at once, timed per request, and
checked the way the run requires (a failed or short request fails the run; the pipeline reads the answers).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from doc_workload import Unit

from gpu_engine.errors import RequestError


class DocBenchFailed(RuntimeError):
    """A request did not finish as the mode requires."""


@dataclasses.dataclass
class Outcome:
    """One request's clock readings and final output, written by its listener on the engine's loop thread."""
    unit: Unit
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    output: Any = None  # the final RequestOutput
    error: str | None = None


def drive(front: Any, units: list[Unit], requests: list[Any], submitters: int,
          prepare: Callable[[Any], Any] | None = None) -> tuple[list[Outcome], float]:
    """Submit every request at once (from `submitters` threads) and wait for all; returns outcomes and wall time
    from the first submit to the last final output. `prepare` turns a request's messages into the engine's
    ProcessedPrompt on the submitting thread (the product's page-preparation processes); None: the engine's own
    processor prepares them there."""
    outcomes = [Outcome(u) for u in units]
    done = threading.Event()
    left = [len(units)]
    lock = threading.Lock()

    def listener(o: Outcome) -> Any:
        def listen(item: Any) -> None:  # on the engine's loop thread
            now = time.perf_counter()
            if isinstance(item, BaseException):
                o.error, o.finished = f"{type(item).__name__}: {item}", now
            else:
                if item.token_ids and o.first_token is None:
                    o.first_token = now
                if not item.finished:
                    return
                o.finished, o.output = now, item
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return listen

    def submit(i: int) -> None:
        outcomes[i].submitted = time.perf_counter()
        try:
            prompt = requests[i].messages if prepare is None else prepare(requests[i].messages)
        except RequestError as exc:  # refused before the engine, as the engine would refuse it: the run fails
            listener(outcomes[i])(exc)
            return
        front.submit(prompt, requests[i].params, listener=listener(outcomes[i]))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=submitters) as pool:
        list(pool.map(submit, range(len(units))))
    if not done.wait(3600):
        raise DocBenchFailed(f"{left[0]} of {len(units)} requests did not finish within an hour")
    return outcomes, max(o.finished for o in outcomes if o.finished is not None) - start


def check_outcomes(outcomes: list[Outcome], fixed: int | None) -> dict[str, Any]:
    """Problems fail the run; grammar completions before a fixed length are counted."""
    problems, early = [], 0
    for o in outcomes:
        out = o.output
        if o.error or out is None or out.finish_reason == "error" or out.finish_reason == "abort":
            problems.append(f"unit {o.unit.index} ({o.unit.kind}): {o.error or (out.error if out else 'no output')}")
        elif fixed is not None and out.completion_tokens != fixed:
            if out.finish_reason == "stop":
                early += 1  # the grammar completed the JSON before N tokens
            else:
                problems.append(f"unit {o.unit.index}: {out.completion_tokens}/{fixed} tokens, {out.finish_reason}")
        if out is not None and out.logprobs is not None and not all(np.isfinite(lp.logprob) for lp in out.logprobs):
            problems.append(f"unit {o.unit.index}: non-finite logprobs")
    if problems:
        raise DocBenchFailed("; ".join(problems[:8]))
    return {"grammar_completed_before_length": early}


def validate(outcomes: list[Outcome], json_schema: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The pipeline's own reading of each answer (parse, jsonschema, per-field confidence from logprobs)."""
    from pipeline.engine_client import EngineReply
    from pipeline.extraction import interpret_reply

    ok, reasons = 0, dict[str, int]()
    for o in outcomes:
        out = o.output
        lps = out.logprobs or []
        reply = EngineReply(text=out.text, finish_reason=out.finish_reason, error=out.error,
                            token_texts=[lp.text for lp in lps], token_logprobs=[float(lp.logprob) for lp in lps],
                            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
        result = interpret_reply(reply, json_schema, max_tokens)
        ok += result.ok
        if not result.ok:
            key = (result.error or "")[:80]
            reasons[key] = reasons.get(key, 0) + 1
    return {"schema_valid": ok, "schema_invalid_reasons": reasons}
