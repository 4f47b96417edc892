"""Tokenizer + chat template vs transformers 5.17 (the external truth), and the incremental detokenizer.

Chat-template strings and token ids must be byte-/id-identical to transformers'. No float comparisons here.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from ci_rule import require_module

from gpu_engine.tiny_assets import CHAT_TEMPLATE, write_tokenizer_files
from gpu_engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, TokenizerError

transformers = require_module("transformers")


def _write_folder(folder: Path) -> None:
    write_tokenizer_files(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))  # AutoTokenizer resolves by model_type


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_tok")
    _write_folder(path)
    return path


@pytest.fixture(scope="module")
def ours(folder: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(folder)


CONVERSATIONS = {
    "text": [{"role": "user", "content": "Hello, wörld! 日本語 😀"}],
    "system_text": [
        {"role": "system", "content": "You extract JSON."},
        {"role": "user", "content": [{"type": "text", "text": "Total?"}]},
    ],
    "image": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
    ],
    "video": [
        {"role": "user", "content": [{"type": "text", "text": "What happens?"}, {"type": "video"}]},
    ],
    "multi_turn_reasoning": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nThey differ."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And this?"}]},
        {"role": "assistant", "content": "Same.", "reasoning_content": "\nlooked at frames\n"},
    ],
    "assistant_last_with_think": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize(
    "kwargs",
    [
        {"add_generation_prompt": True, "enable_thinking": False},
        {"add_generation_prompt": True, "enable_thinking": True},
        {"add_generation_prompt": True},  # enable_thinking undefined: the template's default (thinking on)
        {"add_generation_prompt": False},
    ],
    ids=["gen-nothink", "gen-think", "gen-default", "nogen"],
)
def test_chat_template_matches_transformers(ours: Tokenizer, hf, name: str, kwargs: dict) -> None:
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected


def test_thinking_switch_changes_generation_prompt(ours: Tokenizer) -> None:
    messages = CONVERSATIONS["text"]
    off = ours.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    on = ours.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n<think>\n")


# A template exercising the environment features transformers sets up (loop controls, its tojson, generation tag,
# named special tokens, strftime_now, namespace) — read from tokenizer_config.json instead of chat_template.jinja.
FEATURE_TEMPLATE = (
    "{%- for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% if m.role == 'stop' %}{% break %}{% endif %}\n"
    "  <{{ m.role }}>{{ m | tojson }}{% generation %}[{{ m.content }}]{% endgeneration %}\n"
    "{% endfor %}{{ eos_token }}{{ image_token }}{{ strftime_now('%Y') }}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
)


def test_template_features_and_tokenizer_config_source(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = FEATURE_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    messages = [
        {"role": "user", "content": "a<b>&'\"ü"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"role": "stop", "content": "z"},
        {"role": "user", "content": "never"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    expected = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools) == expected
    assert "<user>" in expected and "never" not in expected


def test_raise_exception_in_template_is_chat_template_error(ours: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="Unsupported message role"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="Unsupported content part type"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}])


def test_template_syntax_error(ours: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours.apply_chat_template(CONVERSATIONS["text"], chat_template="{% for x in %}")


def test_missing_chat_template(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS["text"])


def _random_text(rng: random.Random, ours: Tokenizer) -> str:
    pieces = [
        "invoice", " total", "Größe", "日本語", "😀", "  ", "\n\n", "\t", "123456", "3.14", "'s", "'LL", "{\"a\": 1}",
        "<|im_start|>", "<|image_pad|>", "<think>", "</think>", "é", "e\u0301", "ñandú", "Ω≈ç√", " ", "\r\n",
    ]
    out = []
    for _ in range(rng.randint(1, 30)):
        if rng.random() < 0.3:
            out.append("".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF),
                                               rng.randint(0x4E00, 0x9FFF), rng.randint(0x1F300, 0x1F64F)]))
                               for _ in range(rng.randint(1, 6))))
        else:
            out.append(rng.choice(pieces))
    return "".join(out)


def test_encode_decode_match_transformers(ours: Tokenizer, hf) -> None:
    rng = random.Random()  # fresh inputs every run
    for _ in range(60):
        text = _random_text(rng, ours)
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text


def test_special_token_ids(ours: Tokenizer, hf, folder: Path) -> None:
    vocab = write_tokenizer_files(folder / "again")
    assert ours.token_to_id("<|image_pad|>") == vocab.image_token_id == hf.convert_tokens_to_ids("<|image_pad|>")
    assert ours.token_to_id("<|video_pad|>") == vocab.video_token_id
    assert ours.token_to_id("<|vision_start|>") == vocab.vision_start_token_id
    assert ours.eos_token_ids == (vocab.im_end_token_id,) == (hf.eos_token_id,)
    assert ours.vocab_size == vocab.vocab_size == len(hf)
    assert ours.is_special(vocab.im_start_token_id) and not ours.is_special(vocab.think_start_token_id)
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        ours.token_to_id("<|no_such_token|>")


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    vocab = write_tokenizer_files(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [vocab.im_end_token_id, vocab.endoftext_token_id]})
    )
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (vocab.im_end_token_id, vocab.endoftext_token_id)


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    a = write_tokenizer_files(tmp_path / "a")
    b = write_tokenizer_files(tmp_path / "b")
    assert a == b
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert 1000 <= a.vocab_size <= 4096


def test_transformers_loads_the_tiny_tokenizer(hf) -> None:
    assert type(hf).__name__ == "Qwen3_5Tokenizer"
    assert hf.image_token == "<|image_pad|>" and hf.video_token == "<|video_pad|>"


# ------------------------------------------------------------------------------------- incremental detokenizer


def test_incremental_detokenizer_never_emits_half_characters(ours: Tokenizer) -> None:
    rng = random.Random()
    split_seen = long_seen = False
    for _ in range(40):
        text = _random_text(rng, ours) * rng.randint(1, 4)
        long_seen |= len(ours.encode(text)) > 3 * IncrementalDetokenizer._WINDOW  # the decode window moves
        ids = ours.encode(text)
        detok = IncrementalDetokenizer(ours, skip_special_tokens=False)
        pieces = []
        for token_id in ids:
            piece = detok.push(token_id)
            assert "\ufffd" not in piece
            pieces.append(piece)
        pieces.append(detok.flush())
        assert "".join(pieces) == ours.decode(ids)
        # did some token boundary fall inside a multi-byte character?
        split_seen |= any(ours.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    assert split_seen, "no input split a character across tokens: the test would prove nothing"
    assert long_seen, "no input was long enough to move the decode window"


def _byte_symbol(byte: int) -> str:
    """GPT-2 byte-level alphabet: the printable stand-in character for one raw byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    if byte in keep:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in keep].index(byte))


def test_incremental_detokenizer_holds_then_releases(ours: Tokenizer) -> None:
    ids = [ours.token_to_id(_byte_symbol(b)) for b in "€".encode()]  # one character as three byte tokens
    detok = IncrementalDetokenizer(ours)
    assert [detok.push(t) for t in ids] == ["", "", "€"]
    assert detok.flush() == ""


def test_incremental_detokenizer_flushes_incomplete_bytes(ours: Tokenizer) -> None:
    detok = IncrementalDetokenizer(ours)
    assert detok.push(ours.encode("a")[0]) == "a"
    assert detok.push(ours.token_to_id(_byte_symbol(0xE2))) == ""  # lead byte of a 3-byte character, never completed
    assert detok.flush() == "\ufffd"


def test_incremental_detokenizer_skips_special_tokens(ours: Tokenizer) -> None:
    detok = IncrementalDetokenizer(ours, skip_special_tokens=True)
    ids = ours.encode("hi<|im_end|>")
    assert "".join(detok.push(t) for t in ids) + detok.flush() == "hi"


# ------------------------------------------------------------------------------------------------- bad input


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_tokenizer_config(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_eos_token_outside_vocabulary(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|missing_eos|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="eos_token"):
        Tokenizer.from_pretrained(tmp_path)
