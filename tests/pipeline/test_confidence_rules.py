"""pipeline/confidence.py rule by rule (the mutation pass of issue #22, tests/MUTATION.md): JSON pointers and leaf
spans, token alignment with partial multi-byte tokens, and field confidences against an oracle that works on bytes.

Everything here is pure and in memory (milliseconds), so each mutant of the module is checked quickly. The random
documents use fixed seeds: these tests guard exact rules, and a mutant's verdict must not depend on the draw.
"""
from __future__ import annotations

import json
import math
import random

import pytest

from pipeline.confidence import Confidence, align_tokens, escape_pointer_token, field_confidence, leaf_spans

R = "\ufffd"  # how the engine shows a token that holds only some bytes of a character


# --- JSON pointers and leaf spans -------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "escaped"), [
    ("plain", "plain"), ("/", "~1"), ("~", "~0"), ("a/b~c", "a~1b~0c"), ("~1", "~01"), ("/~", "~1~0"), ("", ""),
])
def test_pointer_tokens_escape_tilde_before_slash(key: str, escaped: str) -> None:
    assert escape_pointer_token(key) == escaped


def test_leaf_spans_of_every_kind_with_every_whitespace() -> None:
    text = ' \t{ "s" :\n"x\\"y" ,\r"n":-1.5e3,"t":true,"f":false,"z":null,"a":[ 1 ,[ ],{ },[2]],"o":{"k/~":"v"}}\n'
    spans = leaf_spans(text)
    assert [(p, text[a:b]) for p, a, b in spans] == [
        ("/s", '"x\\"y"'), ("/n", "-1.5e3"), ("/t", "true"), ("/f", "false"), ("/z", "null"), ("/a/0", "1"),
        ("/a/3/0", "2"), ("/o/k~1~0", '"v"'),
    ]
    assert spans[0][1] == text.index('"x')


def test_leaf_spans_after_empty_containers_and_of_a_bare_value() -> None:
    text = '[{},[],{"a":{}},"w",[[]],0]'
    assert leaf_spans(text) == [("/3", 16, 19), ("/5", 25, 26)]
    assert leaf_spans('{"e":{},"b":[],"c":3}') == [("/c", 19, 20)]
    assert leaf_spans("{}") == [] and leaf_spans("[ ]") == [] and leaf_spans("{ }") == []
    assert leaf_spans(' "only" ') == [("", 1, 7)]
    assert leaf_spans("7") == [("", 0, 1)]


@pytest.mark.parametrize(("text", "message"), [
    ('{"a" 1}', "expected ':' at character 5"),
    ('{"a":1 "b":2}', "expected '}' at character 7"),
    ('{"a":1', "expected '}' at character 6"),
    ('{"a":1,', "expected '\"' at character 7"),
    ("[1,", "unexpected end of JSON text"),
    ("[1 2]", "expected ']' at character 3"),
    ("[1", "expected ']' at character 2"),
    ("{1:2}", "expected '\"' at character 1"),
    ("{", "expected '\"' at character 1"),
    ('{"a":', "unexpected end of JSON text"),
    ("", "unexpected end of JSON text"),
    ("  ", "unexpected end of JSON text"),
    ('{"a":1} x', "extra data after the JSON value at character 8"),
    ("[1]]", "extra data after the JSON value at character 3"),
])
def test_leaf_spans_refuse_text_that_is_not_one_json_value(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        leaf_spans(text)
    assert str(caught.value) == message


def test_leaf_spans_refuse_a_bad_literal() -> None:
    with pytest.raises(ValueError):  # json's own error (a subclass of ValueError)
        leaf_spans('{"a":tru}')


# --- random documents: a generator that records where it writes each leaf --------------------------------------
_CHARS = "ab z\"\\/~é€𝄞中ü"


def _ws(rng: random.Random) -> str:
    return "".join(rng.choice(" \t\n\r") for _ in range(rng.choice((0, 0, 0, 1, 2))))


def _document(rng: random.Random) -> tuple[str, list[tuple[str, int, int]]]:
    """A JSON text and its leaves (pointer, start, end), built together so the spans do not come from a parser."""
    out: list[str] = []
    leaves: list[tuple[str, int, int]] = []
    size = 0

    def put(s: str) -> None:
        nonlocal size
        out.append(s)
        size += len(s)

    def value(pointer: str, depth: int) -> None:
        kind = rng.choice(("obj", "arr", "str", "str", "num", "lit")) if depth < 3 else rng.choice(("str", "num"))
        put(_ws(rng))
        if kind in ("obj", "arr"):
            n = rng.randint(0, 3)
            put("{" if kind == "obj" else "[")
            keys = rng.sample(["k", "a/b", "t~", "é", "x y", "q"], n)
            for j in range(n):
                if j:
                    put(",")
                put(_ws(rng))
                if kind == "obj":
                    key = keys[j]
                    put(json.dumps(key, ensure_ascii=False) + _ws(rng) + ":")
                    value(f"{pointer}/{key.replace('~', '~0').replace('/', '~1')}", depth + 1)
                else:
                    value(f"{pointer}/{j}", depth + 1)
                put(_ws(rng))
            put(_ws(rng) + ("}" if kind == "obj" else "]"))
            return
        if kind == "str":
            literal = json.dumps("".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 6))), ensure_ascii=False)
        elif kind == "num":
            literal = rng.choice(("0", "-3", "12.5", "1e3", "-0.25E-2"))
        else:
            literal = rng.choice(("true", "false", "null"))
        leaves.append((pointer, size, size + len(literal)))
        put(literal)

    value("", 0)
    put(_ws(rng))
    return "".join(out), leaves


def _byte_tokens(rng: random.Random, text: str) -> list[bytes]:
    """The text's UTF-8 bytes cut at random places, multi-byte characters included, with some empty tokens."""
    data = text.encode()
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, len(data)))))
    bounds = [0, *cuts, len(data)]
    tokens = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    for _ in range(rng.randint(0, 2)):
        tokens.insert(rng.randint(0, len(tokens)), b"")
    return tokens


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_leaf_spans_match_the_generator(seed: int) -> None:
    text, leaves = _document(random.Random(seed))
    assert leaf_spans(text) == leaves


@pytest.mark.parametrize("seed", SEEDS)
def test_field_confidence_matches_a_byte_level_oracle(seed: int) -> None:
    """A leaf's tokens are those whose bytes overlap the bytes of its literal; the confidence is exp(mean logprob)."""
    rng = random.Random(1000 + seed)
    text, leaves = _document(rng)
    tokens = _byte_tokens(rng, text)
    texts = [t.decode("utf-8", errors="replace") for t in tokens]
    logprobs = [-rng.random() * 3 for _ in tokens]
    bounds = [0]
    for t in tokens:
        bounds.append(bounds[-1] + len(t))
    want: dict[str, float] = {}
    for pointer, a, b in leaves:
        ba, bb = len(text[:a].encode()), len(text[:b].encode())
        chosen = [lp for lp, s, e in zip(logprobs, bounds, bounds[1:]) if e > s and s < bb and e > ba]
        want[pointer] = math.exp(sum(chosen) / len(chosen))
    conf = field_confidence(text, texts, logprobs)
    assert conf.overall == pytest.approx(math.exp(sum(logprobs) / len(logprobs)), rel=1e-12)
    assert conf.fields.keys() == want.keys()
    for pointer, value in want.items():
        assert conf.fields[pointer] == pytest.approx(value, rel=1e-12), pointer


# --- token alignment --------------------------------------------------------------------------------------------
def test_alignment_of_plain_tokens_and_empty_ones() -> None:
    assert align_tokens("abcd", ["a", "bc", "", "d"]) == [(0, 1), (1, 3), (3, 3), (3, 4)]
    assert align_tokens("", []) == []
    assert align_tokens("ab", ["", "ab"]) == [(0, 0), (0, 2)]


def test_alignment_refuses_tokens_that_do_not_spell_the_text() -> None:
    assert align_tokens("abc", ["a", "b"]) is None  # text left over
    assert align_tokens("ab", ["a", "bc"]) is None  # token text past the end
    assert align_tokens("abc", ["a", "x", "c"]) is None
    assert align_tokens("éb", [R, "x"]) is None  # the character after the partial run is not in the text


def test_partial_tokens_get_the_span_of_the_character_they_form() -> None:
    # "é" is two bytes: the first token holds "a" and one byte, the second the other byte and "b"
    assert align_tokens("aéb", ["a" + R, R + "b"]) == [(0, 2), (1, 3)]
    assert align_tokens("éa", [R, R + "a"]) == [(0, 1), (0, 2)]
    assert align_tokens("xéa", ["x", R, R, "a"]) == [(0, 1), (1, 2), (1, 2), (2, 3)]
    # the plain character after the partial one also came before it: the search starts after the partial character
    assert align_tokens("aéa", ["a", R, R + "a"]) == [(0, 1), (1, 2), (1, 3)]
    # the character after the partial one comes twice soon after: the first is the one
    assert align_tokens('é","', [R, R + '"', ',"']) == [(0, 1), (0, 2), (2, 4)]
    assert align_tokens("éaa", [R, R + "a", "a"]) == [(0, 1), (0, 2), (2, 3)]


def test_partial_tokens_at_the_end_of_the_text() -> None:
    assert align_tokens("aé", ["a" + R, R]) == [(0, 2), (1, 2)]
    assert align_tokens("é", [R, R]) == [(0, 1), (0, 1)]


def test_a_run_of_partial_tokens_stands_for_at_most_four_characters() -> None:
    for n in (1, 2, 3, 4):
        text = "é" * n + "b"
        spans = align_tokens(text, [R] * (2 * n) + ["b"])
        assert spans == [(0, n)] * (2 * n) + [(n, n + 1)], n
    assert align_tokens("é" * 5 + "b", [R] * 10 + ["b"]) is None


def test_a_replacement_character_in_the_text_itself_is_a_plain_character() -> None:
    assert align_tokens(f"a{R}b", ["a", R, "b"]) == [(0, 1), (1, 2), (2, 3)]
    assert align_tokens(f"{R}é", [R, R, R]) == [(0, 1), (1, 2), (1, 2)]


# --- field confidence -------------------------------------------------------------------------------------------
def test_field_confidence_by_hand() -> None:
    text = '{"a":12,"b":"x"}'
    tokens = ['{"', 'a":', "1", '2,"', 'b":"', 'x"', "}"]
    lps = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]
    conf = field_confidence(text, tokens, lps)
    assert conf.overall == pytest.approx(math.exp(sum(lps) / 7), rel=1e-12)
    # "12" is tokens "1" and '2,"'; the token 'a":' ends where "12" starts and is not part of it
    assert conf.fields["/a"] == pytest.approx(math.exp((-0.3 - 0.4) / 2), rel=1e-12)
    # '"x"' starts inside 'b":"' and ends inside 'x"'; "}" starts where it ends and is not part of it
    assert conf.fields["/b"] == pytest.approx(math.exp((-0.5 - 0.6) / 2), rel=1e-12)
    assert set(conf.fields) == {"/a", "/b"}


def test_one_token_for_a_whole_leaf_and_an_empty_token_at_its_edge() -> None:
    conf = field_confidence('[7,"q"]', ["[", "", "7", "", ',"q"', "]"], [-1.0, -9.0, -0.5, -8.0, -0.25, -2.0])
    assert conf.fields == {"/0": pytest.approx(math.exp(-0.5), rel=1e-12),
                           "/1": pytest.approx(math.exp(-0.25), rel=1e-12)}


def test_field_confidence_refuses_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError) as caught:
        field_confidence('{"a":1}', ['{"a":1}'], [-0.1, -0.2])
    assert str(caught.value) == "token_texts and token_logprobs differ in length"


def test_no_tokens_no_confidence_and_unaligned_tokens_only_overall() -> None:
    empty = field_confidence("", [], [])
    assert empty.overall is None and empty.fields == {}
    unaligned = field_confidence('{"a":1}', ['{"a":', "2}"], [-0.2, -0.4])
    assert unaligned.overall == pytest.approx(math.exp(-0.3), rel=1e-12) and unaligned.fields == {}


def test_confidence_as_json() -> None:
    assert Confidence(overall=0.5, fields={"/a": 0.25}).as_json() == {"overall": 0.5, "fields": {"/a": 0.25}}
    assert Confidence(overall=None, fields={}).as_json() == {"overall": None, "fields": {}}
