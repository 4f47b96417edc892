"""Built-in extraction schemas: JSON Schema + prompt + merge rules for each.

Design choices that matter for constrained decoding:
- every property is `required` and `additionalProperties` is false: the model always answers every field (null when
  absent), so a result has one predictable shape and output length stays bounded;
- every free-text string has a `maxLength` and every array a `maxItems`, so even a weak (or random) model ends;
- dates are strings with a YYYY-MM-DD pattern (patterns are enforced by the grammar; `format` would not be);
- numbers have a minimum and maximum (the grammar then cannot produce overflowing exponents).

Merge rules (page results -> one document result) are described in `pipeline/merge.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SchemaSpec:
    name: str
    json_schema: dict[str, Any]
    prompt: str
    merge_rules: dict[str, str] = field(default_factory=dict)
    version: int = 1


DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}


def text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(properties: dict[str, Any], description: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    if description:
        out["description"] = description
    return out


def array(items: dict[str, Any], max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "maxItems": max_items}


# Numbers are bounded: an unbounded JSON number grammar lets a model write 9E+99999, which parses as infinity.
AMOUNT = {"type": "number", "minimum": -1e12, "maximum": 1e12}
MONEY = nullable(AMOUNT)
SECONDS = {"type": "number", "minimum": 0, "maximum": 86400}
CURRENCY = nullable({"type": "string", "pattern": "^[A-Z]{3}$"})

_COMMON_RULES = (
    "Answer with JSON only, matching the schema. Copy values exactly as printed. Use null when a value is not "
    "on the page; never guess. Dates as YYYY-MM-DD, amounts as plain numbers without currency symbols, currency "
    "as an ISO 4217 code."
)

INVOICE = SchemaSpec(
    name="invoice",
    json_schema=obj(
        {
            "invoice_number": nullable(text(64)),
            "invoice_date": nullable(DATE),
            "due_date": nullable(DATE),
            "currency": CURRENCY,
            "vendor": obj({"name": nullable(text(200)), "address": nullable(text(300)), "tax_id": nullable(text(64))}),
            "customer": obj({"name": nullable(text(200)), "address": nullable(text(300))}),
            "line_items": array(
                obj(
                    {
                        "description": text(300),
                        "quantity": MONEY,
                        "unit_price": MONEY,
                        "amount": MONEY,
                    }
                ),
                200,
            ),
            "subtotal": MONEY,
            "tax": MONEY,
            "total": MONEY,
        },
        "An invoice",
    ),
    prompt="Extract the invoice on this page: number, dates, vendor, customer, line items and totals. "
    + _COMMON_RULES,
    merge_rules={
        "invoice_number": "first",
        "invoice_date": "first",
        "due_date": "first",
        "currency": "first",
        "vendor": "first",
        "customer": "first",
        "line_items": "concat",
        "subtotal": "last",  # totals are printed at the end of the document
        "tax": "last",
        "total": "last",
    },
)

RECEIPT = SchemaSpec(
    name="receipt",
    json_schema=obj(
        {
            "merchant": obj({"name": nullable(text(200)), "address": nullable(text(300))}),
            "date": nullable(DATE),
            "time": nullable({"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}),
            "items": array(obj({"description": text(200), "amount": MONEY}), 200),
            "subtotal": MONEY,
            "tax": MONEY,
            "total": MONEY,
            "currency": CURRENCY,
            "payment_method": nullable(text(64)),
        },
        "A till receipt",
    ),
    prompt="Extract this receipt: merchant, date and time, purchased items with amounts, totals and payment "
    "method. " + _COMMON_RULES,
    merge_rules={
        "merchant": "first",
        "date": "first",
        "time": "first",
        "items": "concat",
        "subtotal": "last",
        "tax": "last",
        "total": "last",
        "currency": "first",
        "payment_method": "last",
    },
)

ID_DOCUMENT = SchemaSpec(
    name="id_document",
    json_schema=obj(
        {
            "document_type": {
                "type": "string",
                "enum": ["passport", "id_card", "driving_licence", "residence_permit", "other"],
            },
            "issuing_country": nullable(text(64)),
            "document_number": nullable(text(64)),
            "surname": nullable(text(100)),
            "given_names": nullable(text(100)),
            "date_of_birth": nullable(DATE),
            "sex": nullable({"type": "string", "enum": ["F", "M", "X"]}),
            "nationality": nullable(text(64)),
            "date_of_issue": nullable(DATE),
            "date_of_expiry": nullable(DATE),
            "mrz": nullable(text(200)),
        },
        "An identity document",
    ),
    prompt="Extract the identity document on this page (passport, ID card, driving licence, residence permit). "
    "Give the machine-readable zone verbatim if present. " + _COMMON_RULES,
    merge_rules={},  # every field: "best" (front and back of a card each hold some fields)
)

FORM = SchemaSpec(
    name="form",
    json_schema=obj(
        {
            "title": nullable(text(200)),
            "fields": array(obj({"key": text(200), "value": nullable(text(500))}), 300),
        },
        "A filled-in form as key/value pairs",
    ),
    prompt="Read this form. Give its title and every field as a key (the printed label) and its filled-in value "
    "(null when empty), in reading order. " + _COMMON_RULES,
    merge_rules={"title": "first", "fields": "union"},
)

GENERIC = SchemaSpec(
    name="generic",
    json_schema=obj(
        {
            "document_type": text(64),
            "title": nullable(text(200)),
            "dates": array(DATE, 20),
            "parties": array(obj({"name": text(200), "role": nullable(text(64))}), 20),
            "amounts": array(obj({"label": text(100), "value": AMOUNT, "currency": CURRENCY}), 50),
            "summary": text(1000),
            "language": nullable({"type": "string", "pattern": "^[a-z]{2}$"}),
        },
        "Any document",
    ),
    prompt="Describe this document page: what kind of document it is, its title, the dates, the parties named "
    "(people or organisations, with their role), the amounts, a short summary, and the language as an ISO 639-1 "
    "code. " + _COMMON_RULES,
    merge_rules={
        "document_type": "first",
        "title": "first",
        "dates": "union",
        "parties": "union",
        "amounts": "concat",
        "summary": "join",
        "language": "first",
    },
)

VIDEO = SchemaSpec(
    name="video",
    json_schema=obj(
        {
            "segments": array(
                obj({"start_s": SECONDS, "end_s": SECONDS, "description": text(300)}), 100
            ),
            "text_seen": array(text(300), 100),
            "summary": text(1000),
        },
        "A short video",
    ),
    prompt="Watch this video. Split it into segments with start and end times in seconds and describe each, list "
    "the text that can be read in it, and summarise it. Answer with JSON only, matching the schema.",
    merge_rules={"segments": "concat", "text_seen": "union", "summary": "join"},
)

BUILTIN_SCHEMAS: dict[str, SchemaSpec] = {s.name: s for s in (INVOICE, RECEIPT, ID_DOCUMENT, FORM, GENERIC, VIDEO)}
