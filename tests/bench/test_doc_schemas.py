"""bench/doc_schemas.py: which schema each bench/doc_throughput.py mode sends, and that page_text's fixedN variant
keeps the JSON open for N tokens whatever tokens are chosen (the grammar, not the random weights, decides)."""
from __future__ import annotations

from pathlib import Path

import doc_throughput as dtp
import numpy as np
import pytest
from doc_schemas import longest_string_token_bytes, mode_schema, page_text_spec

from gpu_engine.params import SamplingParams
from gpu_engine.structured import StructuredOutput
from gpu_engine.tiny_assets import build_tokenizer


def test_modes_pick_their_schema() -> None:
    assert mode_schema("fixed256", "auto", "form").name == "invoice"  # the fixed256 series keeps its schema
    assert mode_schema("fixed1024", "auto", "form").name == "page_text-min1024"
    assert mode_schema("grammar", "auto", "form").name == "form"
    assert mode_schema("fixed256", "page_text", "form").name == "page_text-min256"
    assert mode_schema("fixed1024", "receipt", "form").name == "receipt"
    plain = mode_schema("grammar", "auto", "page_text")  # the grammar mode ends where the grammar ends
    assert plain.name == "page_text" and "minLength" not in plain.json_schema["properties"]["natural_text"]
    with pytest.raises(SystemExit, match="unknown schema"):
        mode_schema("fixed1024", "olmocr", "form")


def test_page_text_is_a_schema_a_user_could_register() -> None:
    from pipeline.schemas import validate_schema_definition

    for spec in (page_text_spec(), page_text_spec(min_tokens=1024)):
        validate_schema_definition(spec.name, spec.json_schema, spec.merge_rules)
    text = page_text_spec(min_tokens=1024).json_schema["properties"]["natural_text"]
    assert text["minLength"] == 1024 * longest_string_token_bytes() <= text["maxLength"]


def test_fixed_mode_sends_the_min_length_to_the_grammar(tmp_path: Path) -> None:
    spec = mode_schema("fixed1024", "auto", "form")
    _, params, fixed = dtp.mode_params("fixed1024", spec, tmp_path)
    assert fixed == 1024 and params.max_tokens == 1024 and params.ignore_eos and params.logprobs
    # a model folder: no grammar caps, so nothing shortens natural_text's bounds on the way to the decoder
    assert params.json_schema["properties"]["natural_text"] == spec.json_schema["properties"]["natural_text"]


def _tokens_to_close(structured: StructuredOutput, schema: dict, decoded: list[str]) -> int:
    """Tokens an adversary needs to end the JSON: each step a token holding `"` where the grammar allows one (to
    close strings), else the allowed token of the most bytes (to fill them fast)."""
    matcher = structured.new_matcher(SamplingParams(json_schema=schema))
    n_bytes = np.array([len(t.encode()) for t in decoded])
    quotes = np.array(['"' in t for t in decoded])
    steps = 0
    while not matcher.is_stopped():
        assert steps < 4000, "the adversary never closed the JSON"
        bits = np.unpackbits(structured.bitmask([(matcher, 0)], 1)[0].view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:len(decoded)])
        closing = allowed[quotes[allowed]]
        token = closing[0] if len(closing) else allowed[np.argmax(n_bytes[allowed])]
        assert matcher.consume_token(int(token))
        steps += 1
    return steps


def test_the_transcription_cannot_close_before_n_tokens() -> None:
    tok = build_tokenizer()  # the tokenizer bench/random_model_dir.py writes into every bench model folder
    vocab = tok.get_vocab_size(with_added_tokens=True)
    structured = StructuredOutput(tok.to_str(), vocab, [tok.token_to_id("<|im_end|>")])
    decoded = [tok.decode([i]) for i in range(vocab)]
    n = 64
    open_ended = _tokens_to_close(structured, page_text_spec().json_schema, decoded)
    held_open = _tokens_to_close(structured, page_text_spec(min_tokens=n).json_schema, decoded)
    # same adversary, same fields before natural_text: without minLength it closes the string at once, with it
    # the string alone takes at least n tokens
    assert held_open - open_ended >= n - 1
