"""The incremental detokenizer's byte path (per-token bytes + incremental UTF-8) against its window path and the
tokenizer's own decode: the same pieces after every token, the same text in the end."""
from __future__ import annotations

import numpy as np
import pytest
from test_engine_core_fakes import tiny_tokenizer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from gpu_engine.tokenizer import IncrementalDetokenizer, Tokenizer, byte_level_token_bytes

TEXTS = ["plain ascii words", "€ 5,20 über café", "日本語のテキスト", "emoji 😀🧾 end", "mixed é€😀 x\n\ttabs"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    return [detok.push(t) for t in ids] + [detok.flush()]


def random_streams(tok: Tokenizer, rng: np.random.Generator, count: int):
    """Token-id streams of three kinds: encoded text (characters split across byte tokens), uniformly random ids
    (invalid UTF-8, special tokens, ids past the tokenizer's vocabulary) and raw byte tokens of random bytes."""
    vocab = tok.vocab_size
    byte_ids = [tok.token_to_id(c) for c in _alphabet_chars()]
    for k in range(count):
        kind = k % 3
        if kind == 0:
            text = "".join(rng.choice(TEXTS, size=int(rng.integers(1, 6))))
            yield tok.encode(text)
        elif kind == 1:
            yield rng.integers(0, vocab + 8, size=int(rng.integers(1, 60))).tolist()
        else:
            yield [byte_ids[b] for b in rng.integers(0, 256, size=int(rng.integers(1, 40)))]


def _alphabet_chars() -> list[str]:
    from gpu_engine.tokenizer import _byte_level_alphabet

    by_byte = {b: c for c, b in _byte_level_alphabet().items()}
    return [by_byte[b] for b in range(256)]


@pytest.mark.parametrize("skip_special", [True, False])
def test_byte_path_equals_window_path_and_full_decode(tok, skip_special):
    vocab = tok.vocab_size + 8  # a model's logits may be wider than the tokenizer's vocabulary
    table = byte_level_token_bytes(tok, vocab, skip_special_tokens=skip_special)
    assert table is not None and len(table) == vocab
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    held_back = 0
    for ids in random_streams(tok, rng, 150):
        fast = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip_special, token_bytes=table), ids)
        window = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip_special), ids)
        assert fast == window, f"seed={seed} ids={ids}"
        assert "".join(fast) == tok.decode(ids, skip_special_tokens=skip_special), f"seed={seed} ids={ids}"
        held_back += sum(1 for p in fast[:-1] if p == "")
    assert held_back > 50, "the streams never held text back: the comparison would prove little"


def test_special_tokens_and_unknown_ids_have_no_bytes(tok):
    table = byte_level_token_bytes(tok, tok.vocab_size + 2, skip_special_tokens=True)
    im_end = tok.token_to_id("<|im_end|>")
    assert table[im_end] == b"" and table[-1] == b"" and table[tok.token_to_id("<think>")] == b"<think>"
    with_special = byte_level_token_bytes(tok, tok.vocab_size, skip_special_tokens=False)
    assert with_special[im_end] == b"<|im_end|>"


def test_other_decoders_use_the_window_path(tok):
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "ab": 1, "##cd": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    other = Tokenizer(backend=wordpiece, chat_template=None, special_tokens={}, eos_token_ids=())
    assert byte_level_token_bytes(other, 3, skip_special_tokens=True) is None
    assert "".join(stream(IncrementalDetokenizer(other), [1, 2, 1])) == other.decode([1, 2, 1])

    class NoBackend:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i) for i in ids)

    assert byte_level_token_bytes(NoBackend(), 3, skip_special_tokens=True) is None
