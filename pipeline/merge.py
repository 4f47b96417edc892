"""Merging page results into one document result, field by field (top-level properties of the schema).

Rules (a schema's `merge_rules` names one per top-level field; fields without a rule use `concat` when the
field is an array and `best` otherwise):

    first   the value from the first page (in page order) where it is not empty
    last    the value from the last page where it is not empty (totals printed at the end)
    best    the non-empty value with the highest confidence (mean of the field's leaf confidences); ties -> earlier
    concat  arrays appended in page order
    union   arrays appended in page order, dropping items equal to an earlier item
    join    strings joined with a newline in page order, skipping empty and repeated ones

"Empty" means null, "", [], or an object whose values are all empty. When every page is empty the first page's
value is kept (so the field still has the schema's shape). Arrays are cut at the schema's `maxItems` and joined
strings at its `maxLength` so that the merged result stays valid against the schema.

Confidence of a merged field: the chosen page's leaf confidences (first/last/best), re-indexed leaf confidences
(concat/union), or the lowest of the joined parts (join: a text is as reliable as its weakest part).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .confidence import escape_pointer_token

MERGE_RULES = frozenset({"first", "last", "best", "concat", "union", "join"})


@dataclass
class UnitData:
    """One successful page (or video) result: its data and its leaf confidences by JSON pointer."""

    data: dict[str, Any]
    fields: dict[str, float]


def is_empty(value: Any) -> bool:
    if value is None or value == "" or value == []:
        return True
    if isinstance(value, dict):
        return all(is_empty(v) for v in value.values())
    return False


def _prefix(name: str) -> str:
    return "/" + escape_pointer_token(name)


def _sub_confidence(fields: dict[str, float], prefix: str) -> dict[str, float]:
    return {p: c for p, c in fields.items() if p == prefix or p.startswith(prefix + "/")}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rule_for(name: str, prop_schema: dict[str, Any], merge_rules: dict[str, str]) -> str:
    if name in merge_rules:
        return merge_rules[name]
    return "concat" if prop_schema.get("type") == "array" else "best"


def _limit(prop_schema: dict[str, Any], key: str) -> int | None:
    """maxItems/maxLength of a property, also when it is written as anyOf[<schema>, null]."""
    if key in prop_schema:
        return int(prop_schema[key])
    limits = [int(s[key]) for s in prop_schema.get("anyOf", []) if isinstance(s, dict) and key in s]
    return min(limits) if limits else None


def merge_units(units: list[UnitData], json_schema: dict[str, Any], merge_rules: dict[str, str]) -> UnitData:
    """Merge page results (in page order) into one result. One unit comes back unchanged."""
    if not units:
        raise ValueError("nothing to merge: no successful page results")
    if len(units) == 1:
        return UnitData(data=dict(units[0].data), fields=dict(units[0].fields))
    properties: dict[str, Any] = json_schema.get("properties", {})
    names = list(properties) + [n for n in units[0].data if n not in properties]
    data: dict[str, Any] = {}
    fields: dict[str, float] = {}
    for name in names:
        prefix = _prefix(name)
        present = [u for u in units if name in u.data]
        if not present:
            continue
        prop_schema = properties.get(name, {})
        rule = rule_for(name, prop_schema, merge_rules)
        if rule in ("first", "last", "best"):
            candidates = [u for u in present if not is_empty(u.data[name])] or present[:1]
            if rule == "first":
                chosen = candidates[0]
            elif rule == "last":
                chosen = candidates[-1]
            else:
                scores = [_mean(list(_sub_confidence(u.fields, prefix).values())) for u in candidates]
                chosen = candidates[scores.index(max(scores))]
            data[name] = chosen.data[name]
            fields.update(_sub_confidence(chosen.fields, prefix))
        elif rule in ("concat", "union"):
            items: list[Any] = []
            for unit in present:
                value = unit.data[name]
                if not isinstance(value, list):
                    continue
                for i, item in enumerate(value):
                    if rule == "union" and item in items:
                        continue
                    new_index = len(items)
                    items.append(item)
                    old = f"{prefix}/{i}"
                    for p, c in _sub_confidence(unit.fields, old).items():
                        fields[f"{prefix}/{new_index}{p[len(old):]}"] = c
            max_items = _limit(prop_schema, "maxItems")
            if max_items is not None and len(items) > max_items:
                items = items[:max_items]
                fields = {
                    p: c for p, c in fields.items()
                    if not p.startswith(prefix + "/") or int(p[len(prefix) + 1 :].split("/")[0]) < max_items
                }
            data[name] = items
        elif rule == "join":
            parts: list[str] = []
            confs: list[float] = []
            for unit in present:
                value = unit.data[name]
                if isinstance(value, str) and value and value not in parts:
                    parts.append(value)
                    if prefix in unit.fields:
                        confs.append(unit.fields[prefix])
            if not parts:
                data[name] = present[0].data[name]
                fields.update(_sub_confidence(present[0].fields, prefix))
                continue
            joined = "\n".join(parts)
            max_length = _limit(prop_schema, "maxLength")
            if max_length is not None:
                joined = joined[:max_length]
            data[name] = joined
            if confs:
                fields[prefix] = min(confs)
        else:
            raise ValueError(f"unknown merge rule {rule!r} for field {name!r}")
    return UnitData(data=data, fields=fields)
