"""Structured output with a random tiny model: every constrained generation must parse and validate.

Schemas are bounded (maxLength, maxItems, numeric ranges, multipleOf for decimals, additionalProperties: false) so
that a random model can always finish within max_tokens. An unbounded schema may legitimately end with
finish_reason "length": a degenerate model can repeat digits of a plain "number" forever ("980.3996122080808...").
"""
from __future__ import annotations

import json
import re
from decimal import Decimal

import jsonschema
import numpy as np
import pytest

from gpu_engine.engine import Engine, RequestError
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.tiny import make_tiny_checkpoint

SCHEMAS = [
    {  # nested objects + date strings
        "type": "object",
        "properties": {
            "vendor": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                        "vat": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}},
                       "required": ["name", "vat"], "additionalProperties": False},
            "issued": {"type": "string", "format": "date"},
        },
        "required": ["vendor", "issued"], "additionalProperties": False,
    },
    {  # arrays of objects, numbers with ranges
        "type": "object",
        "properties": {
            "lines": {"type": "array", "maxItems": 3, "items": {
                "type": "object",
                "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 99},
                               "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01}},
                "required": ["qty", "price"], "additionalProperties": False}},
            "total": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01},
        },
        "required": ["lines", "total"], "additionalProperties": False,
    },
    {  # enums, booleans, null
        "type": "object",
        "properties": {
            "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
            "paid": {"type": "boolean"},
            "kind": {"type": "string", "enum": ["invoice", "receipt", "letter"]},
            "note": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["currency", "paid", "kind", "note"], "additionalProperties": False,
    },
    {  # top-level array of enums and a date-time-like pattern
        "type": "array", "minItems": 1, "maxItems": 4,
        "items": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
    },
    {  # optional properties, integer ranges, nested array of strings
        "type": "object",
        "properties": {
            "page": {"type": "integer", "minimum": 1, "maximum": 500},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.001},
        },
        "required": ["page"], "additionalProperties": False,
    },
]


def _exact_multiple_of(validator, divisor, instance, schema):
    # jsonschema checks float multipleOf with float division (0.29 / 0.01 = 28.999...): compare in decimal instead.
    if validator.is_type(instance, "number") and Decimal(str(instance)) % Decimal(str(divisor)) != 0:
        yield jsonschema.ValidationError(f"{instance} is not a multiple of {divisor}")


ExactValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"multipleOf": _exact_multiple_of})


def validate(text: str, schema: dict) -> None:
    """Parse (decimals kept exact) and validate, formats (date) included."""
    doc = json.loads(text, parse_float=Decimal)
    ExactValidator(schema, format_checker=jsonschema.FormatChecker()).validate(doc)


def test_exact_validator_is_strict():
    schema = {"type": "number", "multipleOf": 0.01, "maximum": 1}
    validate("0.29", schema)
    for bad in ("0.291", "1.01", '"0.2"'):
        with pytest.raises(jsonschema.ValidationError):
            validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        validate('"2024-13-45"', {"type": "string", "format": "date"})


def test_date_pattern_is_exact():
    import datetime

    from gpu_engine.structured import DATE_PATTERN, exact_formats

    rx = re.compile(DATE_PATTERN)
    rng = np.random.default_rng()
    years = list(rng.integers(0, 10000, size=300)) + [0, 4, 100, 400, 1900, 2000, 2024, 2100, 2729]
    for y in years:
        for m in range(0, 14):
            for d in (0, 1, 28, 29, 30, 31, 32):
                s = f"{y:04d}-{m:02d}-{d:02d}"
                try:
                    datetime.date.fromisoformat(s)
                    ok = True
                except ValueError:
                    ok = False
                assert bool(rx.fullmatch(s)) == ok, s
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "format": {"const": {"format": "date"}}}}
    rewritten = exact_formats(schema)
    assert rewritten["properties"]["d"] == {"type": "string", "pattern": DATE_PATTERN}
    assert rewritten["properties"]["format"] == {"const": {"format": "date"}}  # data is left alone
    assert schema["properties"]["d"]["format"] == "date"  # the caller's schema is not modified


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=23)
    return Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=32, max_batched_tokens=512, block_size=8))


def test_100_json_schema_generations_validate(engine):
    rng = np.random.default_rng()
    prompts, params = [], []
    for i in range(100):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(rng.integers(0, 2000, size=int(rng.integers(3, 20))).tolist())
        # Greedy for some, sampled (hot, to explore the grammar) for the rest.
        temperature = 0.0 if i % 4 == 0 else float(rng.uniform(0.7, 1.5))
        params.append(SamplingParams(max_tokens=160, json_schema=schema, temperature=temperature,
                                     seed=int(rng.integers(1 << 30)), logprobs=i % 10 == 0))
    before = engine.stats()
    outs = engine.generate(prompts, params)
    for out, p in zip(outs, params):
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        validate(out.text, p.json_schema)
    st = engine.stats()
    # Jump-forward: keys and punctuation were appended without sampling and run as multi-token chunks.
    assert st["forced_tokens"] - before["forced_tokens"] > 0
    assert st["chunked_output_tokens"] - before["chunked_output_tokens"] > 0
    generated = sum(len(o.token_ids) for o in outs)
    assert st["sampled_tokens"] - before["sampled_tokens"] < generated
    # Forced tokens report probability 1 under the constrained distribution.
    with_lp = [o for o in outs if o.logprobs is not None]
    assert with_lp and all(len(o.logprobs) == len(o.token_ids) for o in with_lp)
    assert all(lp.logprob <= 0.0 for o in with_lp for lp in o.logprobs)


def test_jump_forward_off_still_valid(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", seed=5)
    eng = Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=8, enable_jump_forward=False))
    outs = eng.generate([[1, 2, 3]] * 4, [SamplingParams(max_tokens=160, json_schema=SCHEMAS[2], temperature=1.0,
                                                         seed=s) for s in range(4)])
    for o in outs:
        validate(o.text, SCHEMAS[2])
    assert eng.stats()["forced_tokens"] == 0


def test_regex_and_choice(engine):
    rng = np.random.default_rng()
    regex = r"[A-Z]{3}-[0-9]{2,4}"
    choices = ["approve", "reject", "needs review"]
    prompts = [rng.integers(0, 2000, size=5).tolist() for _ in range(12)]
    params = [SamplingParams(max_tokens=20, regex=regex, temperature=1.0, seed=i) for i in range(6)]
    params += [SamplingParams(max_tokens=20, choice=choices, temperature=1.0, seed=i) for i in range(6)]
    outs = engine.generate(prompts, params)
    for o in outs[:6]:
        assert re.fullmatch(regex, o.text), o.text
    for o in outs[6:]:
        assert o.text in choices
    assert all(o.finish_reason == "stop" for o in outs)


def test_unfinishable_output_reports_length(engine):
    # max_tokens too small for the schema: the answer is cut and says so (never silently truncated).
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, json_schema=SCHEMAS[0]))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("params", [
    dict(json_schema={"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
    dict(regex="(unclosed"),
    dict(choice=[]),
    dict(json_schema="not a dict"),
])
def test_bad_grammars_are_request_errors(engine, params):
    with pytest.raises(RequestError):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, **params))
