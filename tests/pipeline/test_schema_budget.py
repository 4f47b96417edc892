"""The schema budget (pipeline.schemas) and the storable-text rule (pipeline.storable_text), without a database."""
from __future__ import annotations

from typing import Any

import pytest

from pipeline.errors import InvalidSchemaError, SchemaTooComplexError, UnstorableTextError
from pipeline.schemas import SCHEMA_BUDGET, SchemaBudget, check_schema_budget, validate_schema_definition
from pipeline.storable_text import check_storable, clean_display_name, storable, text_problem


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def depth_of_nested(levels: int) -> int:
    return 2 * levels + 1  # each level: the object and its "properties" object; the leaf schema is one more


def test_depth_is_refused_from_one_level_past_the_limit() -> None:
    budget = SchemaBudget(max_depth=9)
    check_schema_budget(nested(4), "s", budget)  # depth 9
    assert depth_of_nested(4) == 9
    with pytest.raises(SchemaTooComplexError) as err:
        check_schema_budget(nested(5), "s", budget)  # depth 11
    assert err.value.limit == "depth" and err.value.maximum == 9 and "nested more than 9" in str(err.value)
    check_schema_budget([[[1]]], "s", SchemaBudget(max_depth=3))  # arrays count as levels too
    with pytest.raises(SchemaTooComplexError):
        check_schema_budget([[[[1]]]], "s", SchemaBudget(max_depth=3))


def test_depth_far_past_the_recursion_limit_is_reported_not_crashed() -> None:
    deep: Any = 1
    for _ in range(50_000):
        deep = [deep]
    with pytest.raises(SchemaTooComplexError) as err:
        check_schema_budget({"type": "object", "x": deep}, "s")
    assert err.value.limit == "depth"


def test_size_and_ref_limits() -> None:
    budget = SchemaBudget(max_values=10, max_refs=2)
    check_schema_budget({"a": [1, 2, 3], "b": {"c": None}}, "s", budget)  # 7 values
    with pytest.raises(SchemaTooComplexError) as err:
        check_schema_budget({"a": list(range(10))}, "s", budget)  # 12 values
    assert err.value.limit == "size" and err.value.maximum == 10
    check_schema_budget({"p": {"$ref": "#/a"}, "q": {"$ref": "#/b"}}, "s", budget)
    with pytest.raises(SchemaTooComplexError) as err:
        check_schema_budget({"p": {"$ref": "#/a"}, "q": {"$ref": "#/b"}, "r": {"$ref": "#/c"}}, "s", budget)
    assert err.value.limit == "refs"


def test_the_built_in_schemas_fit_the_default_budget() -> None:
    from pipeline.builtin_schemas import BUILTIN_SCHEMAS

    for spec in BUILTIN_SCHEMAS.values():
        check_schema_budget(spec.json_schema, spec.name)


def test_validation_checks_the_budget_before_compiling() -> None:
    # 200 levels: jsonschema's check_schema would end in RecursionError; the budget answers first, by name.
    with pytest.raises(SchemaTooComplexError, match="schema 'deep'"):
        validate_schema_definition("deep", nested(200))
    assert issubclass(SchemaTooComplexError, InvalidSchemaError)  # callers that catch the parent still do
    levels = (SCHEMA_BUDGET.max_depth - 1) // 2
    validate_schema_definition("deepest", nested(levels))  # at the limit: compiles


def test_schema_text_must_be_storable() -> None:
    for bad in ({"type": "object", "properties": {"a\x00": {"type": "string"}}},
                {"type": "object", "properties": {"a": {"type": "string", "enum": ["\ud800"]}}}):
        with pytest.raises(UnstorableTextError):
            validate_schema_definition("s", bad)


def test_storable_text_rule() -> None:
    assert storable("Rechnung № 42 — 😀") and text_problem("plain") is None
    assert not storable("a\x00b") and "NUL" in (text_problem("a\x00b") or "")
    assert not storable("\ud800x") and "surrogate" in (text_problem("\ud800x") or "")
    assert check_storable("ok", "field") == "ok"
    with pytest.raises(UnstorableTextError) as err:
        check_storable("x\x00", "the prompt")
    assert err.value.field == "the prompt" and str(err.value).startswith("the prompt contains a NUL")


def test_display_names_lose_control_characters_and_surrogates_only() -> None:
    assert clean_display_name("in\x00voice\x07\r\n.pdf") == "invoice.pdf"
    assert clean_display_name("a\ud800b.png") == "ab.png"
    assert clean_display_name("Rechnung März 2024 (1).pdf") == "Rechnung März 2024 (1).pdf"


def test_a_huge_flat_schema_is_refused_without_copying_it() -> None:
    import tracemalloc

    huge = {"type": "object", "enum": list(range(2_000_000))}  # what a 16 MiB request body can hold
    tracemalloc.start()
    try:
        with pytest.raises(SchemaTooComplexError) as err:
            check_schema_budget(huge, "s")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.limit == "size"
    assert peak < 1_000_000, peak  # a stack of pending values would hold ~2 million entries (>100 MB)
