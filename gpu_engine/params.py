"""Public request/response types of the engine (what servers, workers and the pipeline program against)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .list_prefix import ListPrefix

FinishReason = Literal["stop", "length", "abort", "error"]


# A crafted PDF page can carry megabytes of text: lookup text is capped so that tokenising it (when the request is
# added) and matching against it (every step) stay small beside the step itself.
MAX_LOOKUP_TEXT_CHARS = 100_000

@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int | None = None  # per-request, reproducible
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output (at most one of these):
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    # Wall-clock limit for this request, enforced by the engine (threads/solo worker pools ignore Celery's).
    timeout_s: float | None = None
    # Speculative decoding (gpu_engine/speculative/): "auto", "off", "ngram" (prompt lookup) or "mtp" (the
    # checkpoint's MTP head). Output is unchanged by it: greedy token for token, sampling in distribution.
    speculative: str = "auto"
    # Text the output is likely to copy (e.g. a PDF page's text layer): prompt lookup drafts from it too. At most
    # MAX_LOOKUP_TEXT_CHARS: it is tokenised when the request is added and matched at every step.
    lookup_text: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if sum(x is not None for x in (self.json_schema, self.regex, self.choice)) > 1:
            raise ValueError("give at most one of json_schema, regex, choice")
        if self.lookup_text is not None and len(self.lookup_text) > MAX_LOOKUP_TEXT_CHARS:
            raise ValueError(f"lookup_text holds {len(self.lookup_text)} characters, more than "
                             f"MAX_LOOKUP_TEXT_CHARS ({MAX_LOOKUP_TEXT_CHARS})")


@dataclass
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    text: str  # full generated text so far (stop string excluded)
    # token_ids / logprobs: lists in a final output; in an unfinished one ListPrefixes that read as those lists
    token_ids: list[int] | ListPrefix[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None  # set when finish_reason == "error"
    logprobs: list[TokenLogprob] | ListPrefix[TokenLogprob] | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    delta: str = ""  # text added since the previous output of this request (streaming)
    # Speculative decoding: drafts verified, drafts accepted, verify windows run.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    verify_steps: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified drafts (None: nothing was drafted)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify window added on average: accepted drafts + the target's own token (None: no window)."""
        return (self.accepted_draft_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else None
