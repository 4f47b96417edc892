"""Structured output through llguidance: JSON schema, regex and choice grammars.

One LLMatcher per constrained request follows the generated tokens. Each step the masks of all constrained rows
are computed together (LLExecutor) into one int32 bitmask [rows, ceil(vocab / 32)] that the sampler applies before
choosing. After a token is accepted, `forced_tokens` asks the grammar for the tokens it allows as the only
continuation (JSON keys, punctuation): the engine appends them at once and feeds them to the next forward as a small
chunk (jump-forward) instead of decoding them one step at a time.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from .errors import InvalidRequestError
from .params import SamplingParams

_GRAMMAR_CACHE_SIZE = 256

# An exact regex for JSON Schema's "format": "date" (RFC 3339 full-date, Gregorian leap years, year >= 0001).
# llguidance's own date format accepts e.g. 2729-02-29, which jsonschema's format checker rightly rejects.
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
DATE_PATTERN = rf"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)$"
# Keys whose values are JSON data, not subschemas: never rewritten.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


def exact_formats(schema: Any) -> Any:
    """A copy of `schema` for grammar building, with "format": "date" (without a pattern of its own) replaced by
    DATE_PATTERN, so that every generated date is a real calendar date."""
    if isinstance(schema, list):
        return [exact_formats(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYS else exact_formats(v)) for k, v in schema.items()}
    if out.get("format") == "date" and "pattern" not in out:
        del out["format"]
        out["pattern"] = DATE_PATTERN
    return out


class GrammarError(InvalidRequestError, ValueError):
    """The json_schema / regex / choice of a request cannot be compiled into a grammar."""


def is_constrained(params: SamplingParams) -> bool:
    return params.json_schema is not None or params.regex is not None or params.choice is not None


class StructuredOutput:
    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        whitespace_flexible: bool = False,
        num_threads: int = 1,
    ) -> None:
        if not eos_token_ids:
            raise GrammarError("structured output needs at least one eos token id (the grammar ends with it)")
        self.vocab_size = vocab_size
        # n_vocab = the model's logit width (often padded past the tokenizer's vocabulary).
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads)
        self.whitespace_flexible = whitespace_flexible
        # Request key -> a fresh matcher of that grammar. New requests get deep copies: the copy shares the compiled
        # grammar and its lazily built lexer automaton, so the second request of a schema does not pay to build
        # (and warm) it again.
        self._templates: OrderedDict[str, Any] = OrderedDict()

    @staticmethod
    def _key(params: SamplingParams) -> str:
        """What identifies a request's grammar (cheap: no compilation)."""
        if params.json_schema is not None:
            if not isinstance(params.json_schema, dict):
                raise GrammarError(f"json_schema must be a dict, got {type(params.json_schema).__name__}")
            try:
                return "json:" + json.dumps(params.json_schema, sort_keys=True)
            except (TypeError, ValueError) as exc:
                raise GrammarError(f"json_schema is not JSON-serialisable: {exc}") from exc
        if params.regex is not None:
            return "regex:" + params.regex
        if not params.choice or not all(isinstance(c, str) and c for c in params.choice):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return "choice:" + json.dumps(params.choice)

    def _grammar(self, params: SamplingParams) -> str:
        if params.json_schema is not None:
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    exact_formats(params.json_schema), defaults={"whitespace_flexible": self.whitespace_flexible}
                )
            except ValueError as exc:
                raise GrammarError(f"json_schema is not a valid JSON object: {exc}") from exc
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        assert params.choice is not None
        # Lark string literals take JSON-style escapes, so json.dumps quotes any choice safely.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))

    def new_matcher(self, params: SamplingParams) -> Any:
        key = self._key(params)
        template = self._templates.get(key)
        if template is None:
            grammar = self._grammar(params)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
            if is_error:
                raise GrammarError(f"cannot build the output grammar: {'; '.join(messages)}")
            template = llguidance.LLMatcher(self.tokenizer, grammar)
            if template.is_error():
                raise GrammarError(f"cannot start the output grammar: {template.get_error()}")
            self._templates[key] = template
            if len(self._templates) > _GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()

    def bitmask(self, matchers: list[tuple[Any, int]], num_rows: int) -> np.ndarray:
        """int32 [num_rows, ceil(V/32)]; rows not listed allow every token."""
        mask = llnp.allocate_token_bitmask(num_rows, self.vocab_size)
        if matchers:
            llnp.fill_next_token_bitmask_par(self.executor, matchers, mask)
        return mask

    @staticmethod
    def forced_tokens(matcher: Any, limit: int) -> list[int]:
        """Consume and return the run of tokens the grammar forces next (at most `limit`)."""
        if limit <= 0 or matcher.is_stopped():
            return []
        forced = matcher.compute_ff_tokens()  # a new list
        if not forced:
            return forced
        if len(forced) > limit:
            forced = forced[:limit]
        if not matcher.consume_tokens(forced):
            raise GrammarError(f"grammar rejected its own forced tokens: {matcher.get_error()}")
        return forced
