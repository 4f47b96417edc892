"""Drafters: one interface, `propose(seq, k) -> up to k tokens` to follow the sequence's real tokens.

- PromptLookup: n-gram match against the prompt, the output so far and the request's lookup_text (ngram.py).
- MtpHead: the drafts the checkpoint's MTP head chained after the previous step (the runner computes them,
  Speculator.run_mtp stores them on the sequence).
- Auto: prompt lookup when it matches, else the MTP head's drafts (when the runner has one).
- Replay: benchmarks and tests only — replays a recorded continuation per request, each draft replaced by another
  token with probability `corrupt`, so the acceptance rate is chosen, not hoped for (random weights accept nothing).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ..sequence import Sequence
from .config import SpeculativeConfig
from .ngram import find_continuation


class Drafter(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]: ...


class PromptLookup:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min, self.n_max = config.ngram_min, config.ngram_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return find_continuation(seq.token_ids, seq.lookup_ids, k, self.n_min, self.n_max)


class MtpHead:
    def propose(self, seq: Sequence, k: int) -> list[int]:
        return seq.mtp_drafts[:k]


class Auto:
    def __init__(self, lookup: Drafter, mtp: Drafter | None) -> None:
        self.lookup, self.mtp = lookup, mtp

    def propose(self, seq: Sequence, k: int) -> list[int]:
        found = self.lookup.propose(seq, k)
        if found or self.mtp is None:
            return found
        return self.mtp.propose(seq, k)


class Replay:
    def __init__(self, continuations: Mapping[str, list[int]], corrupt: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= corrupt <= 1.0:
            raise ValueError(f"corrupt must be in [0, 1], got {corrupt}")
        self.continuations, self.corrupt, self.vocab = continuations, corrupt, vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        done = seq.num_output_tokens
        out = list(self.continuations.get(seq.request_id, [])[done:done + k])
        for i, t in enumerate(out):
            if self.rng.random() < self.corrupt:
                out[i] = (t + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab  # any other token
        return out
