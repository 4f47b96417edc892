"""Tokenizer and chat template of a checkpoint folder: HF `tokenizers` for tokenizer.json, jinja2 for the template.

The template is rendered in the same jinja environment transformers builds for `apply_chat_template`
(sandboxed, trim_blocks + lstrip_blocks, loop controls, its own `tojson`, `raise_exception`, `strftime_now`,
a pass-through `{% generation %}` tag), with the same variables (messages, tools, documents,
add_generation_prompt, the named special tokens, caller kwargs such as enable_thinking), so the prompt string is
byte-for-byte what transformers produces.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import EngineError

# transformers passes these named special tokens (when set) to every chat template render.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(EngineError):
    """A checkpoint's tokenizer files are missing, unreadable or inconsistent."""


class ChatTemplateError(EngineError):
    """The chat template is missing, does not compile, or refused the messages (raise_exception)."""


# ---------------------------------------------------------------------------------------------------------------
# jinja environment (mirrors transformers' so that templates render identically)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Like transformers: no HTML escaping (jinja's default tojson escapes <, >, &, ').
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc} (line {exc.lineno})") from exc


# ---------------------------------------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc


def _find_chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """Where transformers looks, in its order: chat_template.jinja, chat_template.json, tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        template = _read_json(json_file).get("chat_template")
        if isinstance(template, str):
            return template
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    return None


@dataclass
class Tokenizer:
    """Encode/decode with a checkpoint's tokenizer.json and render its chat template."""

    backend: HFTokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # named special tokens (eos_token, pad_token, ...) as the template sees them
    eos_token_ids: tuple[int, ...]  # generation stops on any of these
    folder: Path | None = None
    _special_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder} (expected {tokenizer_file})")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for malformed files
            raise TokenizerError(f"cannot load {tokenizer_file}: {exc}") from exc

        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        special_tokens = {
            name: content for name in _NAMED_SPECIAL_TOKENS if (content := _token_content(config.get(name)))
        }
        # transformers also exposes named extra tokens (image_token, video_token, ...) to the template.
        extra = config.get("extra_special_tokens")
        if isinstance(extra, Mapping):
            special_tokens.update({name: c for name, value in extra.items() if (c := _token_content(value))})
        special_ids = {
            int(token_id) for token_id, entry in config.get("added_tokens_decoder", {}).items() if entry.get("special")
        }
        special_ids |= {token_id for token_id, tok in backend.get_added_tokens_decoder().items() if tok.special}

        eos_ids: list[int] = []
        if "eos_token" in special_tokens:
            eos_id = backend.token_to_id(special_tokens["eos_token"])
            if eos_id is None:
                raise TokenizerError(f"eos_token {special_tokens['eos_token']!r} of {config_file} is not in the "
                                     "vocabulary")
            eos_ids.append(eos_id)
        # generation_config.json may list more stop ids (Qwen: <|im_end|> and <|endoftext|>).
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            gen_eos = _read_json(gen_file).get("eos_token_id")
            for value in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
                if isinstance(value, int) and value not in eos_ids:
                    eos_ids.append(value)

        return cls(
            backend=backend,
            chat_template=_find_chat_template(folder, config),
            special_tokens=special_tokens,
            eos_token_ids=tuple(eos_ids),
            folder=folder,
            _special_ids=frozenset(special_ids),
        )

    # -- vocabulary ------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int:
        """Id of a token by its text (e.g. "<|image_pad|>"); TokenizerError if the vocabulary lacks it."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary of {self.folder or 'this tokenizer'}")
        return token_id

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- encode / decode -------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>") become their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    # -- chat template ---------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt string for `messages` (what transformers' apply_chat_template(tokenize=False) returns).

        Extra keyword arguments reach the template as variables (enable_thinking=False, ...). Like transformers,
        an argument left out is undefined in the template, so pass enable_thinking explicitly to pin it.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ChatTemplateError(
                f"{self.folder or 'this tokenizer'} has no chat template "
                "(no chat_template.jinja, chat_template.json or tokenizer_config.json 'chat_template')"
            )
        template = compile_chat_template(source)
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return template.render(
                messages=list(messages),
                tools=list(tools) if tools is not None else None,
                documents=list(documents) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template refused the messages: {exc}") from exc


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level (GPT-2 style) vocabularies: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters U+0100.. in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def byte_level_token_bytes(tokenizer: Any, vocab_size: int, *, skip_special_tokens: bool) -> list[bytes] | None:
    """The raw bytes of every token id in [0, vocab_size) when the tokenizer's decoder is plain ByteLevel (Qwen,
    GPT-2 style): decoding is then "concatenate the tokens' bytes, UTF-8 with replacement", which
    IncrementalDetokenizer can do one token at a time instead of re-decoding a window. Each token is checked
    against the tokenizer's own decode; None (use the window decoder) for any other decoder or any mismatch.
    Ids the tokenizer does not know decode to nothing, as in tokenizers."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    alphabet = _byte_level_alphabet()
    special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    table: list[bytes] = []
    for i in range(vocab_size):
        token = backend.id_to_token(i)
        if token is None or (skip_special_tokens and i in special):
            table.append(b"")
        elif all(c in alphabet for c in token):
            table.append(bytes(alphabet[c] for c in token))
        else:  # added tokens written in plain text (tokenizers falls back to their UTF-8 bytes too)
            table.append(token.encode("utf-8"))
    expected = backend.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=skip_special_tokens)
    if any(b.decode("utf-8", "replace") != e for b, e in zip(table, expected)):
        return None
    return table


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text pieces, never emitting half a UTF-8 character.

    Byte-level tokens can end in the middle of a multi-byte character; decoding such a prefix yields U+FFFD.
    The text is held back while the decoded text so far ends in U+FFFD, so each piece is final.

    Two ways to get there, with the same pieces:
    - `token_bytes` given (byte_level_token_bytes: ByteLevel decoders): each token's bytes go through an
      incremental UTF-8 decoder; held back while it buffers an incomplete character or the pending text ends in
      U+FFFD. No tokenizer call per token (this runs for every sequence of every decode step).
    - otherwise: decode a small window of recent tokens (prefix_offset..) with the tokenizer; the window keeps
      enough context for decoders that look at neighbouring tokens.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, token_bytes: Sequence[bytes] | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._bytes = token_bytes
        self._undecoded = b""  # byte path: the start of an incomplete UTF-8 character
        self._pending = ""  # byte path: decoded text not emitted yet (it ends in U+FFFD)
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this index have been emitted
        # Text of ids[prefix_offset:read_offset]. The window start only moves every _WINDOW tokens, so after an
        # emission the cached text is simply the window just decoded: one decode per token on the hot path
        # instead of two.
        self._emitted = ""

    _WINDOW = 16  # tokens of context kept before the window start moves forward

    def _window(self, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[self._prefix_offset:end], skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._bytes is not None:
            # codecs.utf_8_decode(final=False) decodes what it can and reports how many bytes it used; the rest
            # is an incomplete character (the incremental decoder's buffer, without its per-call wrapper).
            data = self._undecoded + self._bytes[token_id]
            text, used = codecs.utf_8_decode(data, "replace", False)
            self._undecoded = data[used:]
            text = self._pending + text
            if not text or text[-1] == "\ufffd" or self._undecoded:
                self._pending = text  # an incomplete character or a replacement at the end: hold back
                return ""
            self._pending = ""
            return text
        current = self._window()
        if len(current) <= len(self._emitted) or current.endswith("\ufffd"):
            return ""
        piece = current[len(self._emitted):]
        previous_read = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted = current
        if self._read_offset - self._prefix_offset > self._WINDOW:
            # Keep the last emitted piece's tokens as context for decoders that look at neighbours.
            self._prefix_offset = previous_read
            self._emitted = self._window(self._read_offset)
        return piece

    def flush(self) -> str:
        """Text still held back at the end of generation (an incomplete character decodes as U+FFFD)."""
        if self._bytes is not None:
            piece = self._pending + codecs.utf_8_decode(self._undecoded, "replace", True)[0]
            self._pending, self._undecoded = "", b""
            return piece
        current = self._window()
        piece = current[len(self._emitted):]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted = ""
        return piece

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)
