"""Per-field confidence from the token logprobs of the model's JSON answer.

Formula. Let the answer text be the concatenation of the generated tokens t_1..t_n with log-probabilities
l_1..l_n (natural log, as reported by the engine for the token actually emitted). For every leaf value of the JSON
(string, number, true/false/null) at JSON pointer p, let [a, b) be the characters of its literal in the text
(for strings: including the quotes), and T(p) the tokens whose characters overlap [a, b). Then

    confidence(p) = exp( mean_{i in T(p)} l_i )        (geometric mean of the token probabilities)
    overall       = exp( mean_{i = 1..n} l_i )

Both lie in (0, 1]. The geometric mean does not punish long values for their length (a product would) yet one
very unlikely token still pulls the value down. Containers (objects, arrays) get no entry of their own: use the
leaves under their pointer. If the token texts do not line up with the answer text (they always should), only
`overall` is reported and `fields` is empty rather than guessed.
"""
from __future__ import annotations

import json
import math
import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from json.decoder import scanstring

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
    joined = "".join(token_texts)
    if not joined.startswith(text):  # token boundaries do not describe this text: report nothing per field
        return Confidence(overall=overall, fields={})
    starts: list[int] = []
    ends: list[int] = []
    pos = 0
    for piece in token_texts:
        starts.append(pos)
        pos += len(piece)
        ends.append(pos)
    fields: dict[str, float] = {}
    for pointer, a, b in leaf_spans(text):
        # tokens i with starts[i] < b and ends[i] > a overlap [a, b)
        first = bisect_right(ends, a)
        last = bisect_left(starts, b)
        chosen = [token_logprobs[i] for i in range(first, last) if ends[i] > starts[i]]
        if chosen:
            fields[pointer] = math.exp(sum(chosen) / len(chosen))
    return Confidence(overall=overall, fields=fields)
