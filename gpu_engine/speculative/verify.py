"""Verifying one sequence's window: the target's logits at the last real token and at each draft pick a token
(grammar mask and penalties applied at every position, as plain decoding would); drafts are accepted while they
equal the picked token. The first mismatch yields the target's own token, a fully accepted window one bonus token,
so every verify step adds between 1 and k + 1 tokens."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..params import FinishReason, RequestOutput
from ..sampling import SamplingRows, apply_bitmask_rows, apply_penalties
from ..sequence import Sequence
from .rejection import choose, logprob_entries

Accept = Callable[[Sequence, int, float, list[tuple[int, float]]], RequestOutput]
Finish = Callable[[Sequence, FinishReason, str | None], RequestOutput]


@dataclass
class Verified:
    output: RequestOutput
    accepted: int  # drafts accepted (their KV stays)
    chosen: int  # tokens picked from the target's rows (accepted drafts + the target's own token)


def verify_window(seq: Sequence, rows: np.ndarray, drafts: list[int], accept: Accept, finish: Finish,
                  structured: Callable[[], Any]) -> Verified:
    """`rows` [len(drafts) + 1, V]: the logits at the last real token and at each draft, in order. `accept`
    appends a chosen token (output processor, grammar advance, jump-forward, stop checks); `finish` ends the
    request; `structured()` the engine's StructuredOutput (bitmasks)."""
    table = SamplingRows.from_rows([seq.sampling_row])
    accepted = 0
    while True:  # ends at the first token that is not the draft (always at the last row: it has no draft)
        draft = drafts[accepted] if accepted < len(drafts) else None
        if table.has_penalties or seq.matcher is not None:  # written below: a copy of the runner's row
            logits = np.array(rows[accepted:accepted + 1], dtype=np.float32, copy=True)
        else:  # only read (choose / logprob_entries copy what they change): no vocabulary-wide copy per row
            logits = np.asarray(rows[accepted:accepted + 1], dtype=np.float32)
        if table.has_penalties:
            apply_penalties(logits, table, [seq.token_ids], [seq.output_ids])
        if seq.matcher is not None:
            allowed = apply_bitmask_rows(logits, [0], structured().bitmask([(seq.matcher, 0)], 1))
            if not allowed.any():
                err = seq.matcher.get_error() or "the grammar allows no further token"
                return Verified(finish(seq, "error", f"structured output failed: {err}"), accepted, accepted)
        token = choose(logits[0], table, draft, seq.rng)
        logprob, top = logprob_entries(logits[0], token, int(table.num_logprobs[0]))
        before = seq.num_tokens
        try:
            out = accept(seq, token, logprob, top)
        except Exception as exc:  # a request-level failure (grammar, detokenizer) ends that request only
            return Verified(finish(seq, "error", f"{type(exc).__name__}: {exc}"), accepted, accepted)
        if token != draft:
            return Verified(out, accepted, accepted + 1)
        accepted += 1
        # Finished, or the grammar forced tokens after the draft (jump-forward): the rest of the window is stale.
        if seq.is_finished or seq.num_tokens != before + 1:
            return Verified(out, accepted, accepted)
