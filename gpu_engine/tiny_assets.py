"""Tokenizer, chat template and processor configs for tiny test checkpoints — built offline, deterministically.

The tiny checkpoint generator (and our tests) need a folder that both our engine and transformers load
exactly like a real Qwen3.5 checkpoint: a byte-level BPE tokenizer.json with Qwen's special tokens, a
tokenizer_config.json, a Qwen3.5-style chat_template.jinja (written by us) and the image/video processor configs.
Only `tokenizers` is needed here (no torch, no network).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen3.5's pre-tokenizer split (letters with combining marks, single digits, punctuation runs, newlines, spaces).
# Must stay identical to the one transformers' Qwen3_5Tokenizer rebuilds from our vocab, or encodings diverge.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# (content, special) in id order after the BPE vocabulary, as in Qwen checkpoints.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

DEFAULT_BPE_VOCAB = 2048

# Our own Qwen3.5-style chat template. Rendered by transformers' apply_chat_template and by gpu_engine.tokenizer.
# - content is a string or a list of parts: text / image / image_url / video.
# - assistant turns after the last user turn keep their reasoning in a <think> block; earlier ones drop it
#   (Qwen3 behaviour: old reasoning is not fed back).
# - the generation prompt opens a <think> block; enable_thinking=false closes it empty right away.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'image' or part.type == 'image_url' -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}
    {{- raise_exception('No messages provided.') -}}
{%- endif -%}
{%- set ns = namespace(last_query_index=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_query_index = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) | string -%}
    {%- if message.role == 'system' or message.role == 'user' -%}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if loop.index0 > ns.last_query_index -%}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
        {%- else -%}
            {{- content.lstrip('\\n') -}}
        {%- endif -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- raise_exception('Unsupported message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- else -%}
        {{- '<think>\\n' -}}
    {%- endif -%}
{%- endif -%}
"""


@dataclass(frozen=True)
class TinyVocab:
    """Ids a checkpoint generator must put into config.json (and size its embedding by)."""

    vocab_size: int  # number of ids in use (BPE vocabulary + added tokens)
    bpe_vocab_size: int
    endoftext_token_id: int
    im_start_token_id: int
    im_end_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    image_token_id: int
    video_token_id: int
    think_start_token_id: int
    think_end_token_id: int

    @property
    def eos_token_id(self) -> int:  # what generation stops on in chat use
        return self.im_end_token_id

    @property
    def pad_token_id(self) -> int:
        return self.endoftext_token_id


def _training_corpus() -> list[str]:
    """A fixed, varied text so the merges are realistic: English, JSON, numbers, code, a few non-ASCII scripts."""
    words = (
        "the invoice total amount date number customer address page document table field value name "
        "quantity price tax currency vendor receipt signature item description order shipping payment "
        "image video frame seconds describe what you see extract return json schema object array string "
        "assistant user system think answer question hello world model vision language token"
    ).split()
    lines = []
    for i, word in enumerate(words):
        nxt = words[(i * 7 + 3) % len(words)]
        lines.append(f"The {word} of the {nxt} is {i * 37 % 1000}.")
        lines.append(f'{{"{word}": "{nxt}", "count": {i}, "ok": true, "ratio": {i / 7:.3f}}}')
        lines.append(f"def {word}_{nxt}(x):\n    return x + {i}\n")
    # Pseudo-words from a fixed syllable table give the trainer enough distinct pairs to fill ~2k merges.
    syllables = "ka ri to mu sen da lo vi pre con ex tion ing er al ment ly ous able ra ne qu st ph th".split()
    state = 12345
    for _ in range(600):
        sentence = []
        for _ in range(8):
            word = ""
            for _ in range(2 + state % 3):
                state = (state * 1103515245 + 12345) % 2**31  # fixed LCG: deterministic, no `random` state
                word += syllables[state % len(syllables)]
            sentence.append(word)
        lines.append(" ".join(sentence) + ".")
    lines += [
        "Größe, Straße, café, naïve, déjà vu — «quotes» and ‘single’ ones…",
        "日本語のテキスト、中文文本和한국어 텍스트。",
        "Русский текст и ελληνικά γράμματα. 😀 👍 ✓ € £ ¥",
        "Total: $1,234.56 (incl. 19% VAT) on 2024-05-17 at 14:32:05",
    ]
    return lines * 3


def build_tokenizer(bpe_vocab_size: int = DEFAULT_BPE_VOCAB) -> Tokenizer:
    """Train the tiny byte-level BPE (deterministic: fixed corpus, single-threaded semantics) and add Qwen's tokens."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_tokens(
        [
            AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for content, special in QWEN_ADDED_TOKENS
        ]
    )
    return tok


def _tokenizer_config(tok: Tokenizer) -> dict:
    added = {
        str(tok.token_to_id(content)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in QWEN_ADDED_TOKENS
    }
    return {
        "tokenizer_class": "Qwen3_5Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 262144,
        "extra_special_tokens": {
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    }


def write_tokenizer_files(folder: str | Path, *, bpe_vocab_size: int = DEFAULT_BPE_VOCAB) -> TinyVocab:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `folder`; return the ids."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(bpe_vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    def tid(content: str) -> int:
        value = tok.token_to_id(content)
        assert value is not None, content  # every added token was just inserted
        return value

    return TinyVocab(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bpe_vocab_size=tok.get_vocab_size(with_added_tokens=False),
        endoftext_token_id=tid("<|endoftext|>"),
        im_start_token_id=tid("<|im_start|>"),
        im_end_token_id=tid("<|im_end|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        think_start_token_id=tid("<think>"),
        think_end_token_id=tid("</think>"),
    )


def write_processor_configs(
    folder: str | Path,
    *,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
    image_min_pixels: int | None = None,
    image_max_pixels: int | None = None,
    video_min_pixels: int | None = None,
    video_max_pixels: int | None = None,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5),
) -> None:
    """Write preprocessor_config.json and video_preprocessor_config.json (Qwen3.5 layout).

    Pixel budgets default to small tiny-model values: images 4..64 merged tokens, videos 4..256 merged tokens
    over all frames, so tests stay fast. Pass real budgets for real-size configs.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    factor = patch_size * merge_size
    common = {
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(image_mean),
        "image_std": list(image_std),
        "resample": 3,  # bicubic
        "patch_size": patch_size,
        "temporal_patch_size": temporal_patch_size,
        "merge_size": merge_size,
        "processor_class": "Qwen3VLProcessor",
    }
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {
            "shortest_edge": image_min_pixels if image_min_pixels is not None else 4 * factor * factor,
            "longest_edge": image_max_pixels if image_max_pixels is not None else 64 * factor * factor,
        },
    }
    video = {
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {
            "shortest_edge": video_min_pixels if video_min_pixels is not None else 4 * factor * factor,
            "longest_edge": video_max_pixels if video_max_pixels is not None else 256 * factor * factor,
        },
        "do_sample_frames": True,
        "fps": fps,
        "min_frames": min_frames,
        "max_frames": max_frames,
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
