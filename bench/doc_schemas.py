"""The extraction schema of each bench/doc_throughput.py output mode: the pipeline's built-ins, plus `page_text`.

    spec = mode_schema("fixed1024", schema="auto", grammar_schema="form")   # -> page_text_spec(min_tokens=1024)

`page_text` is a bench-only schema shaped like olmOCR's page response (its metadata fields, then the page's
`natural_text`), so a 1,024-token row is a page transcription, as olmOCR's ~1k-token outputs are. It is no built-in,
but a user could register it (it passes pipeline.schemas.validate_schema_definition, llguidance included), and the
bench sends it down the pipeline's own path (prompt building, grammar, logprobs).

Why fixedN needs more than a long maxLength: ignore_eos does not outlast the grammar, and random weights close a
string when they happen to pick `"` (tiny-moe closed natural_text after 130-600 tokens on the CPU; the invoice's
JSON closed at ~484 tokens a page on the 9B class, bench/results/doc_throughput.md). So a fixedN mode sends
natural_text with minLength = N x the longest token the grammar may emit in a string (bytes, the bundled tokenizer
every bench model folder carries): the JSON cannot close before N tokens, the grammar's counterpart of ignore_eos.
The grammar and mask work per token are those of any long free-text field; only where the answer may end moves.

--schema auto (the default): fixedN modes use `invoice` up to FIXED_INVOICE_MAX_TOKENS (the fixed256 series since
session 5, which every 9B invoice reached) and page_text (with the minLength above) past it; a schema name instead
applies to every fixedN mode (page_text then with its minLength too). The grammar mode sends --grammar-schema as
it is (page_text without minLength).
"""
from __future__ import annotations

import functools
from typing import Any

FIXED_INVOICE_MAX_TOKENS = 256
PAGE_TEXT_MAX_CHARS = 16_000  # a real page's transcription (olmOCR: a few thousand characters) fits with room
PAGE_TEXT_PROMPT = (
    "Transcribe this page. Put its plain text in natural_text as a person would read it, in reading order, tables "
    "as Markdown; give the page's primary language as an ISO 639-1 code, whether it is upright (else the clockwise "
    "rotation that would make it so) and whether it is mostly a table or a diagram. Do not hallucinate. Answer with "
    "JSON only, matching the schema."
)


def page_text_spec(min_tokens: int = 0) -> Any:
    """page_text as a pipeline SchemaSpec (builtin_schemas' helpers: every field required, no extras); with
    `min_tokens`, natural_text cannot end before that many tokens (module docstring) and the name says so."""
    from pipeline.builtin_schemas import SchemaSpec, nullable, obj

    min_chars = min_tokens * longest_string_token_bytes()
    natural_text: dict[str, Any] = {"type": "string", "maxLength": max(PAGE_TEXT_MAX_CHARS, min_chars)}
    if min_chars:
        natural_text["minLength"] = min_chars
    schema = obj({
        "primary_language": nullable({"type": "string", "pattern": "^[a-z]{2}$"}),
        "is_rotation_valid": {"type": "boolean"},
        "rotation_correction": {"type": "integer", "enum": [0, 90, 180, 270]},
        "is_table": {"type": "boolean"},
        "is_diagram": {"type": "boolean"},
        "natural_text": natural_text,
    }, "One page's transcription (olmOCR-style)")
    return SchemaSpec(name=f"page_text-min{min_tokens}" if min_tokens else "page_text", json_schema=schema,
                      prompt=PAGE_TEXT_PROMPT, merge_rules={"natural_text": "join"})


@functools.lru_cache(maxsize=1)
def longest_string_token_bytes() -> int:
    """Bytes of the longest token of the bundled tokenizer (bench/random_model_dir.py writes it into every model
    folder) that may stand inside a JSON string: BPE tokens and the non-special added ones. A JSON escape only
    shortens what a token adds to a string, and a character is at least a byte, so a token adds at most this."""
    from gpu_engine.tiny_assets import build_tokenizer

    tok = build_tokenizer()
    plain = [len(tok.decode([i]).encode()) for i in tok.get_vocab(with_added_tokens=False).values()]
    added = [len(t.content.encode()) for t in tok.get_added_tokens_decoder().values() if not t.special]
    return max(plain + added)


def bench_schemas() -> dict[str, Any]:
    """Every schema name --schema / --grammar-schema accept: the built-ins and page_text."""
    from pipeline.builtin_schemas import BUILTIN_SCHEMAS

    return {**BUILTIN_SCHEMAS, "page_text": page_text_spec()}


def mode_schema(mode: str, schema: str, grammar_schema: str) -> Any:
    """The SchemaSpec a mode sends (module docstring); an unknown name exits naming the choices."""
    fixed = int(mode[5:]) if mode.startswith("fixed") and mode[5:].isdigit() else 0
    if mode == "grammar":
        name = grammar_schema
    elif schema != "auto":
        name = schema
    else:
        name = "invoice" if fixed <= FIXED_INVOICE_MAX_TOKENS else "page_text"
    schemas = bench_schemas()
    if name not in schemas:
        raise SystemExit(f"unknown schema {name!r}: use one of {', '.join(schemas)}")
    if name == "page_text" and mode != "grammar":
        return page_text_spec(min_tokens=fixed)
    return schemas[name]
