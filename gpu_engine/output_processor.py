"""OutputProcessor: generated tokens -> text and RequestOutputs (vLLM v1's split: the engine core schedules and
runs; this turns tokens into what a caller sees). Detokenising, logprob entries, stop tokens and stop strings,
the max_tokens limit, and holding back the tail of the text that a stop string could still claim."""
from __future__ import annotations

from typing import Any

from .list_prefix import ListPrefix
from .params import FinishReason, RequestOutput, TokenLogprob
from .sequence import Sequence
from .tokenizer import IncrementalDetokenizer, byte_level_token_bytes


class OutputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._token_bytes: list[bytes] | None = None  # for the detokenizer's byte path (ByteLevel tokenizers)
        self._token_bytes_checked = False
        self._token_text: dict[int, str] = {}  # decode([token]) of the tokens seen: a logprob entry's text

    @property
    def token_bytes(self) -> list[bytes] | None:
        """Every token's bytes (None: the tokenizer is not plain byte-level), built on first use: lets the
        detokenizer skip a tokenizer call per generated token."""
        if not self._token_bytes_checked:
            self._token_bytes = byte_level_token_bytes(self.tokenizer, self.vocab_size, skip_special_tokens=True)
            self._token_bytes_checked = True
        return self._token_bytes

    def token_text(self, token: int) -> str:
        """One token's own text (a tokenizer call per generated token with logprobs otherwise: ~10 us each)."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def start(self, seq: Sequence) -> None:
        """Give a new request its incremental detokenizer."""
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True, token_bytes=self.token_bytes)

    def append(
        self, seq: Sequence, token: int, *, logprob: float = 0.0, top: list[tuple[int, float]] | None = None,
        forced: bool = False,
    ) -> FinishReason | None:
        """Append one generated token; returns a finish reason when this token ends the request."""
        seq.append(token)
        params = seq.params
        if seq.logprobs is not None:
            text = self._token_text.get(token)
            if text is None:
                text = self.token_text(token)
            if forced:  # the only token the grammar allowed: probability 1 under the constrained distribution
                entry = TokenLogprob(token, text, 0.0, [(token, 0.0)] if params.top_logprobs else [])
            else:
                entry = TokenLogprob(token, text, logprob, list(top) if top else [])
            seq.logprobs.append(entry)
        if token in seq.eos_token_ids or token in params.stop_token_ids:
            return "stop"  # the stop token's text is not part of the output
        piece = seq.detok.push(token)
        if piece:
            seq.text += piece
            if params.stop and cut_stop_string(seq, len(piece)):
                seq.stopped_by_string = True
                return "stop"
        if seq.num_tokens - seq.prompt_len >= params.max_tokens:  # == remaining_tokens <= 0, without 2 calls
            return "length"
        return None

    @staticmethod
    def finish_text(seq: Sequence) -> None:
        """The request ends: bytes held back for an incomplete character join the text (not after a stop string,
        which cut the text where it began)."""
        if not seq.stopped_by_string and seq.detok is not None:
            seq.text += seq.detok.flush()

    @staticmethod
    def output(seq: Sequence) -> RequestOutput:
        """The request's output now; `delta` is the text since the previous output. A final output owns copies of
        the token and logprob lists; an unfinished one reads the sequence's own in place (list_prefix.py)."""
        finished = seq.is_finished
        text = seq.text if finished or not seq.params.stop else visible_text(seq)
        delta = text[seq.emitted_chars:]
        seq.emitted_chars = len(text)
        ids, lps = seq.output_list, seq.logprobs
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=ids[:] if finished else ListPrefix(ids, len(ids)),
            finished=finished,
            finish_reason=seq.finish_reason,
            error=seq.error,
            logprobs=None if lps is None else lps[:] if finished else ListPrefix(lps, len(lps)),
            prompt_tokens=seq.prompt_len,
            cached_prompt_tokens=seq.cached_prompt_tokens,
            delta=delta,
            draft_tokens=seq.draft_tokens,
            accepted_draft_tokens=seq.accepted_draft_tokens,
            verify_steps=seq.verify_steps,
        )


def cut_stop_string(seq: Sequence, new_chars: int) -> bool:
    """Cut the text at the first stop string that the last `new_chars` characters completed, if any."""
    longest = max(len(s) for s in seq.params.stop)
    begin = max(0, len(seq.text) - new_chars - longest + 1)
    hits = [i for s in seq.params.stop if (i := seq.text.find(s, begin)) >= 0]
    if not hits:
        return False
    seq.text = seq.text[: min(hits)]
    return True


def visible_text(seq: Sequence) -> str:
    """Text safe to show: while running, the tail that could still become a stop string is held back."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    hold = max(len(s) for s in seq.params.stop) - 1
    return seq.text[: max(seq.emitted_chars, len(seq.text) - hold)]
