"""Sequence: the engine's per-request state (tokens, cache ownership, sampling and output bookkeeping).

One request = one sequence. Its tokens are the prompt followed by the generated tokens; `num_computed` of them
are in the cache. Everything the scheduler runs is "the next uncomputed tokens": a prefill chunk, one decode
token, or a run of grammar-forced tokens (jump-forward) — one code path for all three.
"""
from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .inputs import ProcessedPrompt, VisionItem
from .params import FinishReason, SamplingParams, TokenLogprob
from .sampling import sampling_row


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (cache dropped, will be recomputed)
    RUNNING = "running"  # holds cache blocks and a state slot
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    rng: np.random.Generator
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic time after which the request ends with finish_reason "error"

    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV / linear state is in the cache
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash chain of full blocks
    num_committed_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    admitted_once: bool = False

    # Speculative decoding: drafts of this step sit in the token buffer right after the real tokens (never in
    # output_ids); the scheduler runs them with the last real token as one verify window (speculative/).
    num_drafts: int = 0
    draft_tokens: int = 0  # drafts sent to verification over the request's life
    accepted_draft_tokens: int = 0  # of those, accepted
    verify_steps: int = 0  # verify windows run
    mtp_drafts: list[int] = field(default_factory=list)  # MTP head's proposal for the next step (speculative/)
    mtp_next: int = -1  # the first position the MTP head has not seen (-1: none seen in this admission)
    lookup_ids: np.ndarray | None = None  # the tokens of params.lookup_text, for prompt lookup
    speculate: bool = True  # False once a verify window of it failed in the runner: it decodes plainly

    matcher: Any = None  # llguidance.LLMatcher when the request is constrained
    logprobs: list[TokenLogprob] | None = None
    detok: Any = None  # incremental detokenizer
    text: str = ""  # generated text (stop string excluded once finished)
    emitted_chars: int = 0  # characters of `text` already sent as deltas
    stopped_by_string: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)
        # Fixed capacity: a request can never grow past prompt + max_tokens (forced runs are capped too).
        self._tokens = np.zeros(self.prompt_len + self.params.max_tokens, dtype=np.int64)
        self._tokens[: self.prompt_len] = self.prompt.token_ids
        self.num_tokens = self.prompt_len
        self.logprobs = [] if self.params.logprobs else None
        self._item_ends = [it.token_end for it in self.prompt.vision_items]  # sorted: items are in prompt order
        # generated ids as Python ints; like `logprobs` only ever appended to: unfinished outputs read both in place
        self.output_list: list[int] = []
        self._bt_source: list[int] | None = None  # the block_table list the cached array was built from
        self._bt_array = np.zeros(0, dtype=np.int32)
        self.sampling_row = sampling_row(self.params)  # the params as SamplingRows wants them, built once

    # ---- tokens ----
    @property
    def token_ids(self) -> np.ndarray:
        return self._tokens[: self.num_tokens]

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """token_ids[start:end] as one view (the hot path builds one per sequence per step); drafts included."""
        return self._tokens[start:min(end, self.num_tokens + self.num_drafts)]

    @property
    def num_tokens_with_drafts(self) -> int:
        """The end of what the scheduler may run: the real tokens, then this step's drafts."""
        return self.num_tokens + self.num_drafts

    def set_drafts(self, tokens: list[int]) -> None:
        """This step's drafts (at most remaining_tokens - 1: the verify step adds one token of its own)."""
        n = min(len(tokens), max(0, self.remaining_tokens - 1))
        self._tokens[self.num_tokens:self.num_tokens + n] = tokens[:n]
        self.num_drafts = n

    def drafts(self) -> list[int]:
        return self._tokens[self.num_tokens:self.num_tokens + self.num_drafts].tolist()

    @property
    def output_ids(self) -> np.ndarray:
        return self._tokens[self.prompt_len : self.num_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def remaining_tokens(self) -> int:
        """How many more tokens this request may generate."""
        return self.params.max_tokens - self.num_output_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def last_token(self) -> int:
        return int(self._tokens[self.num_tokens - 1])

    def append(self, token_id: int) -> None:
        self._tokens[self.num_tokens] = token_id
        self.num_tokens += 1
        self.output_list.append(token_id)

    def block_table_array(self) -> np.ndarray:
        """int32 copy of block_table, rebuilt only when the table changed (a new block every block_size tokens)."""
        if self._bt_source is not self.block_table or len(self._bt_array) != len(self.block_table):
            self._bt_source = self.block_table
            self._bt_array = np.asarray(self.block_table, dtype=np.int32)
        return self._bt_array

    def positions(self, start: int, n: int) -> np.ndarray:
        """M-RoPE positions [3, n] of tokens [start, start + n): the processor's for the prompt, then i + rope_delta."""
        out = np.empty((3, n), dtype=np.int64)
        in_prompt = max(0, min(n, self.prompt_len - start))
        if in_prompt:
            out[:, :in_prompt] = self.prompt.positions[:, start : start + in_prompt]
        if in_prompt < n:  # generated tokens: the same position on all three axes
            out[:, in_prompt:] = np.arange(start + in_prompt, start + n, dtype=np.int64) + self.prompt.rope_delta
        return out

    def vision_items_in(self, start: int, end: int) -> list[VisionItem]:
        """Vision items whose placeholders overlap tokens [start, end)."""
        if start >= self.prompt_len or not self._item_ends:
            return []
        items = self.prompt.vision_items
        out = []
        for i in range(bisect.bisect_right(self._item_ends, start), len(items)):  # first item ending after start
            if items[i].token_start >= end:
                break
            out.append(items[i])
        return out

    # ---- state ----
    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def slot_in_use(self) -> int:
        """The state slot of an admitted sequence (the cache gives every admitted sequence one)."""
        if self.state_slot is None:
            raise RuntimeError(f"sequence {self.request_id} is scheduled but holds no state slot")
        return self.state_slot

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget the cache, keep every generated token (they are re-prefilled)."""
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.block_table = []
        self.state_slot = None
        self.num_committed_blocks = 0
        self.num_drafts = 0
        self.mtp_drafts = []
        self.mtp_next = -1
        self.num_preemptions += 1
