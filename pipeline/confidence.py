"""Per-field confidence from the token logprobs of the model's JSON answer.

Formula. Let the answer text be the concatenation of the generated tokens t_1..t_n with log-probabilities
l_1..l_n (natural log, as reported by the engine for the token actually emitted). For every leaf value of the JSON
(string, number, true/false/null) at JSON pointer p, let [a, b) be the characters of its literal in the text
(for strings: including the quotes), and T(p) the tokens whose characters overlap [a, b). Then

    confidence(p) = exp( mean_{i in T(p)} l_i )        (geometric mean of the token probabilities)
    overall       = exp( mean_{i = 1..n} l_i )

Both lie in (0, 1]. The geometric mean does not punish long values for their length (a product would) yet one
very unlikely token still pulls the value down. Containers (objects, arrays) get no entry of their own: use the
leaves under their pointer. Token texts are aligned to the answer text character by character; a token that
holds only part of a multi-byte character (shown as U+FFFD) is given the span of the character it helps to form.
If the tokens cannot be aligned, only `overall` is reported and `fields` is empty rather than guessed.
"""
from __future__ import annotations

import json
import math
import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # CPython has it; typeshed does not list it

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def escape_pointer_token(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def leaf_spans(text: str) -> list[tuple[str, int, int]]:
    """(JSON pointer, start, end) of every leaf literal in a JSON text, in text order. ValueError if not JSON."""
    spans: list[tuple[str, int, int]] = []

    def skip(i: int) -> int:
        m = _WS.match(text, i)
        return m.end() if m else i

    def expect(i: int, char: str) -> int:
        if i >= len(text) or text[i] != char:
            raise ValueError(f"expected {char!r} at character {i}")
        return i + 1

    def value(i: int, pointer: str) -> int:
        i = skip(i)
        if i >= len(text):
            raise ValueError("unexpected end of JSON text")
        c = text[i]
        if c == "{":
            i = skip(i + 1)
            if text[i : i + 1] == "}":
                return i + 1
            while True:
                i = expect(i, '"')
                key, i = scanstring(text, i)
                i = expect(skip(i), ":")
                i = skip(value(i, f"{pointer}/{escape_pointer_token(key)}"))
                if text[i : i + 1] == ",":
                    i = skip(i + 1)
                    continue
                return expect(i, "}")
        if c == "[":
            i = skip(i + 1)
            if text[i : i + 1] == "]":
                return i + 1
            index = 0
            while True:
                i = skip(value(i, f"{pointer}/{index}"))
                index += 1
                if text[i : i + 1] == ",":
                    i = skip(i + 1)
                    continue
                return expect(i, "]")
        _, end = _DECODER.raw_decode(text, i)
        spans.append((pointer, i, end))
        return end

    end = skip(value(0, ""))
    if end != len(text):
        raise ValueError(f"extra data after the JSON value at character {end}")
    return spans


REPLACEMENT = "\ufffd"
_MAX_CHAR_LOOKAHEAD = 4  # characters a run of partial-byte tokens can stand for before the next plain character


def align_tokens(text: str, token_texts: list[str]) -> list[tuple[int, int]] | None:
    """Character span [start, end) of each token in `text`, or None if they do not line up."""
    spans: list[tuple[int, int]] = []
    pos = 0
    pending: dict[int, int] = {}  # token index -> its start, for tokens holding bytes of an unfinished character

    def resolve(end: int) -> None:
        for j, j_start in pending.items():
            spans[j] = (j_start, end)
        pending.clear()

    for i, piece in enumerate(token_texts):
        spans.append((pos, pos))
        start: int | None = None
        for ch in piece:
            if ch == REPLACEMENT and not text.startswith(REPLACEMENT, pos):
                if i not in pending:
                    pending[i] = start if start is not None else pos
                continue
            if pending:
                found = text.find(ch, pos + 1, pos + 1 + _MAX_CHAR_LOOKAHEAD)
                if found < 0:
                    return None
                mine = pending.pop(i, None)
                resolve(found)  # the characters before `ch` are those the partial tokens formed
                pos = found
                if mine is not None:
                    start = mine
            if not text.startswith(ch, pos):
                return None
            if start is None:
                start = pos
            pos += 1
        if i not in pending:
            spans[i] = (start if start is not None else pos, pos)
    if pending:  # the text ends with the character the partial tokens formed
        resolve(len(text))
        pos = len(text)
    return spans if pos == len(text) else None


@dataclass
class Confidence:
    overall: float | None
    fields: dict[str, float]

    def as_json(self) -> dict[str, object]:
        return {"overall": self.overall, "fields": self.fields}


def field_confidence(text: str, token_texts: list[str], token_logprobs: list[float]) -> Confidence:
    """Confidence per leaf pointer (formula in the module docstring)."""
    if len(token_texts) != len(token_logprobs):
        raise ValueError("token_texts and token_logprobs differ in length")
    if not token_logprobs:
        return Confidence(overall=None, fields={})
    overall = math.exp(sum(token_logprobs) / len(token_logprobs))
    spans = align_tokens(text, token_texts)
    if spans is None:  # token boundaries do not describe this text: report nothing per field
        return Confidence(overall=overall, fields={})
    # spans are non-decreasing in both ends, so bisect finds the overlapping tokens
    starts = [a for a, _ in spans]
    ends = [b for _, b in spans]
    fields: dict[str, float] = {}
    for pointer, a, b in leaf_spans(text):
        # tokens i with starts[i] < b and ends[i] > a overlap [a, b)
        first = bisect_right(ends, a)
        last = bisect_left(starts, b)
        chosen = [token_logprobs[i] for i in range(first, last) if ends[i] > starts[i]]
        if chosen:
            fields[pointer] = math.exp(sum(chosen) / len(chosen))
    return Confidence(overall=overall, fields=fields)
