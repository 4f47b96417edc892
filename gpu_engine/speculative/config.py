"""SpeculativeConfig: the engine-wide knobs of speculative decoding, checked at construction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import EngineError

Method = Literal["auto", "off", "ngram", "mtp"]
METHODS: tuple[str, ...] = ("auto", "off", "ngram", "mtp")
MAX_DRAFTS = 8


class SpeculativeConfigError(EngineError, ValueError):
    """A SpeculativeConfig value is out of range."""


@dataclass(frozen=True)
class SpeculativeConfig:
    # Drafts per sequence per step (k; the verify window is k + 1 tokens). 0 turns speculation off engine-wide.
    num_tokens: int = 3
    # The cost rule of `auto`: a step's decoding sequences (one token each) plus all drafts of `auto` requests stay
    # within this many tokens; past it `auto` sequences get fewer drafts, then none. A decode step is bound by
    # reading the weights until its batch reaches the GEMMs' compute knee: up to there drafts ride along almost
    # free, past it every rejected draft costs a full token's compute. 128 is a conservative knee for a 27B-class
    # model on one H200 (to be measured for the CUDA runner, bench/; the reference runner gains nothing either way).
    # On a runner that samples on the device a window costs the whole step that sampling, so there `auto` drafts
    # only while decode rows * (k + 1) fit (Speculator.auto_room): at 32 and k = 3, batches of up to 8.
    max_step_tokens: int = 128
    # Prompt lookup: the longest / shortest tail n-gram matched against the prompt, output and lookup text.
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= MAX_DRAFTS:
            raise SpeculativeConfigError(f"num_tokens must be in [0, {MAX_DRAFTS}], got {self.num_tokens!r}")
        if self.max_step_tokens < 1:
            raise SpeculativeConfigError(f"max_step_tokens must be >= 1, got {self.max_step_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpeculativeConfigError(
                f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min!r}, ngram_max={self.ngram_max!r}")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0
