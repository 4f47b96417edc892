"""pipeline/merge.py rule by rule (the mutation pass of issue #22, tests/MUTATION.md): emptiness, the default rules,
each merge rule with its confidences, the schema's limits and the refusals, on plain data (no pipeline)."""
from __future__ import annotations

from typing import Any

import pytest

from pipeline.merge import (
    MERGE_RULES,
    UnitData,
    _limit,
    _mean,
    _prefix,
    _sub_confidence,
    is_empty,
    merge_units,
    rule_for,
)


def _merge(units: list[UnitData], properties: dict[str, Any], rules: dict[str, str] | None = None) -> UnitData:
    return merge_units(units, {"type": "object", "properties": properties}, rules or {})


STRING = {"type": "string"}
ARRAY = {"type": "array"}


# --- the pieces -------------------------------------------------------------------------------------------------
def test_what_counts_as_empty() -> None:
    empty: list[Any] = [None, "", [], {}, {"a": None, "b": "", "c": []}, {"a": {"b": None}}]
    full: list[Any] = [0, False, "x", [None], [""], {"a": None, "b": 0}, {"a": {"b": "x"}}, 0.0]
    assert [is_empty(v) for v in empty] == [True] * len(empty)
    assert [is_empty(v) for v in full] == [False] * len(full)


def test_pointer_prefix_and_the_confidences_under_it() -> None:
    assert _prefix("total") == "/total"
    assert _prefix("a/b~c") == "/a~1b~0c"  # escaped as a JSON pointer token
    fields = {"/a": 0.1, "/a/0": 0.2, "/a/0/x": 0.3, "/ab": 0.4, "/b/a": 0.5, "/a/10": 0.6}
    assert _sub_confidence(fields, "/a") == {"/a": 0.1, "/a/0": 0.2, "/a/0/x": 0.3, "/a/10": 0.6}
    assert _sub_confidence(fields, "/a/1") == {}  # "/a/10" is another item
    assert _sub_confidence(fields, "/a/0") == {"/a/0": 0.2, "/a/0/x": 0.3}
    assert _mean([]) == 0.0 and _mean([0.2, 0.4, 0.9]) == pytest.approx(0.5, abs=1e-15) and _mean([0.7]) == 0.7


def test_the_default_rule_is_concat_for_arrays_and_best_otherwise() -> None:
    assert rule_for("items", ARRAY, {}) == "concat"
    assert rule_for("name", STRING, {}) == "best"
    assert rule_for("name", {}, {}) == "best"
    assert rule_for("items", ARRAY, {"items": "union"}) == "union"
    assert rule_for("name", STRING, {"other": "last"}) == "best"
    assert MERGE_RULES == {"first", "last", "best", "concat", "union", "join"}


def test_limits_written_directly_or_in_any_of() -> None:
    assert _limit({"type": "array", "maxItems": 3}, "maxItems") == 3
    assert _limit({"type": "array", "maxItems": "4"}, "maxItems") == 4
    assert _limit({"type": "array"}, "maxItems") is None
    nullable = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 5}]}
    assert _limit(nullable, "maxItems") == 5
    assert _limit({"anyOf": [{"maxLength": 9}, True, {"maxLength": 4}, {"maxItems": 1}]}, "maxLength") == 4
    assert _limit({"anyOf": [{"type": "null"}, True]}, "maxLength") is None
    assert _limit({"maxItems": 2, "anyOf": [{"maxItems": 1}]}, "maxItems") == 2  # the direct limit wins


# --- merge_units ------------------------------------------------------------------------------------------------
def test_nothing_to_merge_is_refused_and_one_unit_comes_back_as_a_copy() -> None:
    with pytest.raises(ValueError) as caught:
        _merge([], {})
    assert str(caught.value) == "nothing to merge: no successful page results"
    one = UnitData({"name": "", "extra": 1}, {"/name": 0.5})
    merged = _merge([one], {"name": STRING}, {"name": "join"})
    assert (merged.data, merged.fields) == ({"name": "", "extra": 1}, {"/name": 0.5})  # unchanged, no rule applied
    merged.data["name"], merged.fields["/name"] = "changed", 0.0
    assert one == UnitData({"name": "", "extra": 1}, {"/name": 0.5})


def test_fields_come_in_schema_order_then_the_first_units_extra_fields() -> None:
    units = [UnitData({"z": 1, "b": "x", "extra": "e"}, {}), UnitData({"a": "y", "b": "w", "late": 2}, {})]
    merged = _merge(units, {"a": STRING, "b": STRING, "absent": STRING})
    assert list(merged.data) == ["a", "b", "z", "extra"]  # "absent" is on no page; "late" is not on the first
    assert merged.data == {"a": "y", "b": "x", "z": 1, "extra": "e"}


def test_first_and_last_skip_empty_values() -> None:
    units = [UnitData({"n": None}, {"/n": 0.9}), UnitData({"n": "A"}, {"/n": 0.2}),
             UnitData({"n": {}}, {}), UnitData({"n": "B"}, {"/n": 0.3}), UnitData({"n": ""}, {"/n": 0.99}),
             UnitData({}, {"/n": 0.98})]
    first = _merge(units, {"n": STRING}, {"n": "first"})
    assert (first.data, first.fields) == ({"n": "A"}, {"/n": 0.2})
    last = _merge(units, {"n": STRING}, {"n": "last"})
    assert (last.data, last.fields) == ({"n": "B"}, {"/n": 0.3})


def test_when_every_page_is_empty_the_first_pages_value_is_kept() -> None:
    units = [UnitData({"v": {"a": None}}, {"/v/a": 0.4}), UnitData({"v": None}, {"/v": 0.8})]
    for rule in ("first", "last", "best"):
        merged = _merge(units, {"v": {"type": "object"}}, {"v": rule})
        assert (merged.data, merged.fields) == ({"v": {"a": None}}, {"/v/a": 0.4}), rule


def test_best_takes_the_highest_mean_confidence_and_the_earlier_of_a_tie() -> None:
    units = [
        UnitData({"v": {"a": "1", "b": "1"}, "w": "p"}, {"/v/a": 0.9, "/v/b": 0.1, "/w": 0.3}),  # mean 0.5
        UnitData({"v": {"a": "2", "b": "2"}, "w": "q"}, {"/v/a": 0.6, "/v/b": 0.6, "/w": 0.3}),  # mean 0.6
        UnitData({"v": {"a": "3", "b": "3"}, "w": "r"}, {"/v/a": 0.7, "/v/b": 0.5, "/w": 0.3}),  # mean 0.6, later
    ]
    merged = _merge(units, {"v": {"type": "object"}, "w": STRING})
    assert merged.data == {"v": {"a": "2", "b": "2"}, "w": "p"}  # w: a three-way tie goes to the first page
    assert merged.fields == {"/v/a": 0.6, "/v/b": 0.6, "/w": 0.3}
    unknown = [UnitData({"w": "none known"}, {}), UnitData({"w": "known"}, {"/w": 0.01})]
    assert _merge(unknown, {"w": STRING}).data == {"w": "known"}  # no confidence scores 0


def test_concat_appends_in_page_order_and_reindexes_the_confidences() -> None:
    units = [UnitData({"items": [{"x": 1}, {"x": 2}]}, {"/items/0/x": 0.1, "/items/1/x": 0.2, "/items/1": 0.25}),
             UnitData({"items": None}, {"/items": 0.5}),
             UnitData({"items": [{"x": 1}]}, {"/items/0/x": 0.3, "/other": 0.9})]
    merged = _merge(units, {"items": ARRAY})
    assert merged.data == {"items": [{"x": 1}, {"x": 2}, {"x": 1}]}
    assert merged.fields == {"/items/0/x": 0.1, "/items/1/x": 0.2, "/items/1": 0.25, "/items/2/x": 0.3}


def test_union_drops_items_equal_to_an_earlier_one_with_their_confidences() -> None:
    units = [UnitData({"tags": ["a", "b"]}, {"/tags/0": 0.1, "/tags/1": 0.2}),
             UnitData({"tags": ["b", "c", "a", "d"]}, {"/tags/0": 0.3, "/tags/1": 0.4, "/tags/2": 0.5,
                                                       "/tags/3": 0.6})]
    merged = _merge(units, {"tags": ARRAY}, {"tags": "union"})
    assert merged.data == {"tags": ["a", "b", "c", "d"]}
    assert merged.fields == {"/tags/0": 0.1, "/tags/1": 0.2, "/tags/2": 0.4, "/tags/3": 0.6}


def test_arrays_are_cut_at_max_items_with_the_confidences_of_what_was_cut() -> None:
    units = [UnitData({"name": "n", "items": [{"x": 1}, {"x": 2}], "itemsx": "k"},
                      {"/name": 0.7, "/items/0/x": 0.1, "/items/1/x": 0.2, "/itemsx": 0.8}),
             UnitData({"name": "n", "items": [{"x": 3}, {"x": 4}], "itemsx": "k"},
                      {"/items/0/x": 0.3, "/items/1/x": 0.4, "/items/1": 0.45})]
    properties = {"name": STRING, "items": {"anyOf": [{"type": "array", "maxItems": 3}, {"type": "null"}]},
                  "itemsx": STRING}
    merged = _merge(units, properties, {"items": "concat"})
    assert merged.data == {"name": "n", "items": [{"x": 1}, {"x": 2}, {"x": 3}], "itemsx": "k"}
    assert merged.fields == {"/name": 0.7, "/items/0/x": 0.1, "/items/1/x": 0.2, "/items/2/x": 0.3, "/itemsx": 0.8}
    exact = _merge(units, {"items": {"type": "array", "maxItems": 4}})
    assert exact.data["items"] == [{"x": 1}, {"x": 2}, {"x": 3}, {"x": 4}] and len(exact.fields) == 7
    one = _merge(units, {"items": {"type": "array", "maxItems": 1}})
    assert one.data["items"] == [{"x": 1}] and set(one.fields) == {"/name", "/items/0/x", "/itemsx"}


def test_join_skips_empty_repeated_and_non_text_parts_and_keeps_the_weakest_confidence() -> None:
    units = [UnitData({"s": "abc"}, {"/s": 0.6}), UnitData({"s": ""}, {"/s": 0.01}),
             UnitData({"s": "abc"}, {"/s": 0.02}), UnitData({"s": 5}, {"/s": 0.03}),
             UnitData({"s": "def"}, {"/s": 0.4}), UnitData({"s": "ghi"}, {}), UnitData({}, {"/s": 0.04})]
    merged = _merge(units, {"s": STRING}, {"s": "join"})
    assert (merged.data, merged.fields) == ({"s": "abc\ndef\nghi"}, {"/s": 0.4})
    cut = _merge(units, {"s": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}}, {"s": "join"})
    assert cut.data == {"s": "abc\nde"}
    unknown = _merge([UnitData({"s": "a"}, {}), UnitData({"s": "b"}, {"/t": 0.5})], {"s": STRING}, {"s": "join"})
    assert (unknown.data, unknown.fields) == ({"s": "a\nb"}, {})  # no part's confidence known: none claimed


def test_join_of_nothing_keeps_the_first_pages_value_and_goes_on_to_the_next_field() -> None:
    units = [UnitData({"s": None, "t": "a"}, {"/s": 0.3, "/s/x": 0.2, "/t": 0.9}),
             UnitData({"s": "", "t": "b"}, {"/s": 0.5, "/t": 0.1})]
    merged = _merge(units, {"s": STRING, "t": STRING, "u": STRING}, {"s": "join"})
    assert (merged.data, merged.fields) == ({"s": None, "t": "a"}, {"/s": 0.3, "/s/x": 0.2, "/t": 0.9})


def test_an_unknown_rule_is_refused_naming_it() -> None:
    units = [UnitData({"s": "a"}, {}), UnitData({"s": "b"}, {})]
    with pytest.raises(ValueError) as caught:
        _merge(units, {"s": STRING}, {"s": "average"})
    assert str(caught.value) == "unknown merge rule 'average' for field 's'"
